"""The per-step control hook of the engine (policy lives elsewhere, e.g. `adaptive.py`).

Before every decode step the engine calls `controller.decide(active_batch_size) -> Decision`:
`Decision(method=None)` runs one plain autoregressive step; `Decision(method="draft_model", gamma=4)` runs one
speculative step with that proposer (it must be one the engine built: `engine.proposers`) and draft length
gamma (clamped to `engine.max_gamma`). After the step the engine calls `controller.observe(decision, record)`
with a `StepRecord` (batch size, drafted/accepted/emitted tokens, wall seconds split into draft and target
parts). Every record is also kept in `engine.stats.steps` (bounded) for metrics and offline analysis.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol, runtime_checkable


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


@runtime_checkable
class Controller(Protocol):
    def decide(self, active_batch_size: int) -> Decision: ...

    def observe(self, decision: Decision, record: StepRecord) -> None: ...


class FixedController:
    """Always the configured method and draft length (method "none": always AR)."""

    def __init__(self, method: str | None, gamma: int) -> None:
        self.decision = Decision(method=None if method in (None, "none") else method,
                                 gamma=gamma if method not in (None, "none") else 0)

    def decide(self, active_batch_size: int) -> Decision:
        return self.decision

    def observe(self, decision: Decision, record: StepRecord) -> None:
        return None
