"""The per-step control hook of the engine (policy lives elsewhere, e.g. `adaptive.py`).

Before every decode step the engine calls `controller.decide(active_batch_size) -> Decision`:
`Decision(method=None)` runs one plain autoregressive step; `Decision(method="draft_model", gamma=4)` runs one
speculative step with that proposer (it must be one the engine built: `engine.proposers`) and draft length
gamma (clamped to `engine.max_gamma`). After the step the engine calls `controller.observe(decision, record)`
with a `StepRecord` (batch size, drafted/accepted/emitted tokens, wall seconds split into draft and target
parts). Every record is also kept in `engine.stats.steps` (bounded) for metrics and offline analysis.

A controller may also say which proposers to keep warm: `warm_proposers(active_batch_size) -> Collection[str]`
names those whose own caches the engine fills when sequences are admitted, the batch then holding
`active_batch_size` sequences (without the method: every proposer). The others catch up
on the whole sequence, prompt included, the first time they draft for it: an engine built with several drafters
for an adaptive policy then pays the prefill of only the drafters it runs (measured on the benchmark workload, the
prefill of two unused drafters was 14% of a plain-decoding run).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol, runtime_checkable


@dataclass(frozen=True)
class Decision:
    method: str | None = None  # None: plain AR step
    gamma: int = 0


@dataclass(frozen=True)
class StepRecord:
    step: int
    method: str | None
    gamma: int
    batch_size: int
    draft_tokens: int  # tokens proposed over the batch (ragged proposers may propose fewer than B*gamma)
    accepted_tokens: int  # drafts accepted over the batch
    emitted_tokens: int  # tokens appended to sequences this step (after stop/length truncation)
    seconds: float  # wall time of the whole step
    draft_seconds: float  # of which proposing
    target_seconds: float  # of which the target forward + sampling/verification
    # draft positions actually tested: per row min(accepted + 1, drafted) — accepted / tried is the MLE of the
    # per-token acceptance probability (0 when unknown)
    tried_tokens: int = 0
    # per draft position j (0-based): rows whose draft j was tested (drafts before it accepted) and accepted;
    # tested_at[j] / accepted_at[j] summed over j give tried_tokens / accepted_tokens (empty when unknown)
    tested_at: tuple[int, ...] = ()
    accepted_at: tuple[int, ...] = ()
    # rows that emitted a stop token this step: with `emitted_tokens`, the chance a token ends its sequence, which
    # cuts a round short whatever the acceptance (the policy's stop hazard)
    stopped: int = 0


@runtime_checkable
class Controller(Protocol):
    def decide(self, active_batch_size: int) -> Decision: ...

    def observe(self, decision: Decision, record: StepRecord) -> None: ...


class StepClock:
    """Which seconds a step costs: "wall" (the engine's own timing; right on a dedicated machine or GPU) or
    "cpu" (this process's CPU time between decide and observe: on a shared CPU machine other processes stretch
    wall time by up to 5x within minutes, which would drown 10-20% differences between options)."""

    def __init__(self, clock: str = "wall") -> None:
        if clock not in ("wall", "cpu"):
            raise ValueError(f"clock: must be 'wall' or 'cpu', got {clock!r}")
        self.clock = clock
        self._t0: float | None = None

    def start(self) -> None:
        if self.clock == "cpu":
            self._t0 = time.process_time()

    def elapsed(self) -> float | None:
        """The CPU seconds since `start` on the "cpu" clock; None on the wall clock (the record's timing stands)."""
        if self.clock != "cpu" or self._t0 is None:
            return None
        seconds = max(time.process_time() - self._t0, 1e-9)
        self._t0 = None
        return seconds

    def restamp(self, record: StepRecord) -> StepRecord:
        return retimed(record, self.elapsed())


def retimed(record: StepRecord, seconds: float | None) -> StepRecord:
    """`record` with its seconds replaced by `seconds` (None: unchanged), split between drafting and verifying as
    the engine's own timing split them."""
    if seconds is None:
        return record
    share = record.draft_seconds / record.seconds if record.seconds > 0 else 0.0
    # A copy with three fields changed, without `dataclasses.replace`: that re-runs the frozen __init__ (a setattr
    # per field), 30 us a step inside a decode loop whose kernels keep the interpreter's data cold.
    out = object.__new__(StepRecord)
    out.__dict__.update(record.__dict__, seconds=seconds, draft_seconds=seconds * share,
                        target_seconds=seconds * (1 - share))
    return out


class FixedController:
    """Always the configured method and draft length (method None/"none": plain decoding).

    With `clock` set it also keeps every step's record, timed by that clock (calibration and benchmarks).
    """

    def __init__(self, method: str | None, gamma: int = 0, clock: str | None = None) -> None:
        off = method in (None, "none")
        self.decision = Decision(method=None if off else method, gamma=0 if off else gamma)
        self.records: list[StepRecord] | None = [] if clock else None
        self._clock = StepClock(clock or "wall")

    def decide(self, active_batch_size: int) -> Decision:
        self._clock.start()
        return self.decision

    def warm_proposers(self, active_batch_size: int) -> tuple[str, ...]:
        return (self.decision.method,) if self.decision.method is not None else ()

    def observe(self, decision: Decision, record: StepRecord) -> None:
        if self.records is not None:
            self.records.append(self._clock.restamp(record))

    def stats(self) -> dict[str, Any]:
        label = f"{self.decision.method}:{self.decision.gamma}" if self.decision.method else "ar"
        return {"adaptive": False, "decision": label}
