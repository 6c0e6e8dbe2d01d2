"""Elastic rebalancing policy: which GPUs should move between the trainer and rollout roles, if any.

Pure and deterministic (no I/O, no clock, no randomness): the operator's timer and the cluster simulator
(`specrl.runtime.sim`) both call :func:`decide` with the coordinator's latest signals, the current
allocation, the policy knobs from ``spec.elastic``/``spec.resources`` (:meth:`PolicyConfig.from_spec`),
the time of the last move and the hysteresis streak returned by the previous call. The caller executes
the returned :class:`Move` (drain the victim, delete its pod, create one of the other role), records it
as the new :class:`LastMove` and passes the returned streak back in on the next poll.

Signals: ``Q`` = queue depth, ``B`` = trainer backlog, ``A`` = active sequences, ``S`` = step batch size,
``R`` = rollout replicas now; ``W``/``L`` = ``queueHighWatermark``/``queueLowWatermark`` (prompts per
rollout worker), ``f`` = ``longTailFraction``.

* **Pull towards rollout** (rollout is the bottleneck):
  - ``QueueBacklog``: ``Q > W·R`` — prompts wait for a free rollout slot;
  - ``TrainerStarved`` (async mode): ``B == 0``, ``Q > L·R`` and no long tail — trainers idle because
    rollouts cannot keep up.
* **Push towards trainer** (only when no pull rule fires and ``Q <= L·R``):
  - ``TrainerBacklog`` (async mode): ``B >= trainerBacklogHighWatermark`` — samples pile up for training;
  - ``LongTail``: the coordinator reports a long tail and ``A < f·S`` — a few long sequences occupy rollout
    pods whose GPUs sit mostly idle — *and* the last step's timings say a trainer pod would shorten the
    step (:func:`trainer_gains`; without timings, e.g. before the first step, the tail alone decides).
* **Balance from step timings** (``lastStep`` in the status): ``StepBalance`` pulls a trainer pod to rollout
  when one more rollout worker would save more than one trainer fewer costs (:func:`rollout_gains`).
  This rule was added after the cluster simulator (``specrl simulate``) showed that pushing in every long
  tail drifts the split towards the trainer and makes the job slower than a static split: a moved pod only
  joins its new role at the next step boundary, so the GPU the tail idles is not won back in that step.

Guards, in order: elastic rebalancing enabled; the job is running (not Starting/Syncing/Complete/Failed);
no worker still draining (one move at a time); every worker pod Ready (``Allocation.unready`` empty: no
move lands on a pod that is still Pending or starting); a want that ``hysteresis`` consecutive polls agree on;
``cooldownSeconds`` since the previous move; the donor stays at or above its ``minReplicas``, the
receiver at or below its ``maxReplicas``; ``(trainer + rollout)·gpusPerPod <= totalGPUs`` (a move keeps
the total, so an allocation that is already over budget is left to reconciliation).

No oscillation: a move is made only if, in the allocation it produces and on the same signals, the policy
would not want the opposite move. Hence on a constant input consecutive moves never reverse each other:
the allocation moves monotonically until a bound, the budget or the watermarks stop it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["trainer", "rollout"]
ROLES: tuple[Role, Role] = ("trainer", "rollout")

# Coordinator phases in which moving a worker would disturb the step loop rather than help it.
QUIET_PHASES = frozenset({"Starting", "Syncing", "Complete", "Failed"})
_POD_INDEX = re.compile(r"-(trainer|rollout)-(\d+)$")


@dataclass(frozen=True)
class WorkerState:
    """One worker as the coordinator reports it (``workers[]`` in ``GET /status``)."""

    name: str
    role: str
    state: str  # active | draining | retired | lost (died: its pod is being replaced, never deleted for it)


@dataclass(frozen=True)
class StepTiming:
    """Where the last finished RL step spent its time (``lastStep`` in ``GET /status``), in seconds."""

    rollout_seconds: float
    long_tail_seconds: float
    train_seconds: float

    @property
    def bulk_seconds(self) -> float:
        """Rollout time before the long tail: the part that shrinks when rollout gets more workers."""
        return max(self.rollout_seconds - self.long_tail_seconds, 0.0)

    @classmethod
    def from_status(cls, data: Any) -> StepTiming | None:
        if not isinstance(data, dict):
            return None
        try:
            t = cls(float(data["rolloutSeconds"]), float(data.get("longTailSeconds") or 0.0),
                    float(data["trainSeconds"]))
        except (KeyError, TypeError, ValueError):
            return None
        return t if t.rollout_seconds > 0 and t.train_seconds > 0 else None


@dataclass(frozen=True)
class Signals:
    """The subset of the coordinator's ``GET /status`` that the policy reads."""

    queue_depth: int = 0
    active_sequences: int = 0
    step_batch_size: int = 0
    long_tail: bool = False
    trainer_backlog: int = 0
    phase: str = "Rollout"
    complete: bool = False
    workers: tuple[WorkerState, ...] = ()
    last_step: StepTiming | None = None

    @classmethod
    def from_status(cls, status: dict[str, Any]) -> Signals:
        """Build from the coordinator's camelCase JSON; unknown keys are ignored, missing ones default."""
        workers = tuple(
            WorkerState(name=str(w.get("name", "")), role=str(w.get("role", "")), state=str(w.get("state", "")))
            for w in status.get("workers") or ()
            if isinstance(w, dict)
        )
        return cls(
            queue_depth=int(status.get("queueDepth") or 0),
            active_sequences=int(status.get("activeSequences") or 0),
            step_batch_size=int(status.get("stepBatchSize") or 0),
            long_tail=bool(status.get("longTail")),
            trainer_backlog=int(status.get("trainerBacklog") or 0),
            phase=str(status.get("phase") or "Rollout"),
            complete=bool(status.get("complete")),
            workers=workers,
            last_step=StepTiming.from_status(status.get("lastStep")),
        )

    @property
    def draining(self) -> tuple[str, ...]:
        return tuple(w.name for w in self.workers if w.state == "draining")


@dataclass(frozen=True)
class Allocation:
    """Current replicas per role; ``pods`` (optional) names them so a victim can be chosen; ``unready`` names
    those of them that are not Ready yet (pending, pulling images, starting)."""

    trainer: int
    rollout: int
    pods: tuple[str, ...] = ()
    unready: tuple[str, ...] = ()

    def of(self, role: str) -> int:
        return self.trainer if role == "trainer" else self.rollout

    def after(self, from_role: str, to_role: str, count: int = 1) -> Allocation:
        delta = {from_role: -count, to_role: count}
        return Allocation(trainer=self.trainer + delta.get("trainer", 0), rollout=self.rollout + delta.get("rollout", 0))


@dataclass(frozen=True)
class PolicyConfig:
    """Policy knobs, normally taken from an RLJob spec with :meth:`from_spec` (defaults match the API)."""

    trainer_min: int = 1
    trainer_max: int = 1_000_000
    rollout_min: int = 1
    rollout_max: int = 1_000_000
    gpus_per_pod: int = 1
    total_gpus: int | None = None  # None: no budget beyond the role maxima
    mode: str = "sync"
    enabled: bool = True
    cooldown_seconds: float = 120.0
    long_tail_fraction: float = 0.25
    queue_high_watermark: int = 64
    queue_low_watermark: int = 0
    trainer_backlog_high_watermark: int = 256
    hysteresis: int = 3
    max_pods_per_move: int = 1
    # How much better (relative) the other role must use a pod before step timings justify moving it.
    balance_margin: float = 0.1

    def bounds(self, role: str) -> tuple[int, int]:
        return (self.trainer_min, self.trainer_max) if role == "trainer" else (self.rollout_min, self.rollout_max)

    @classmethod
    def from_spec(cls, spec: Any) -> PolicyConfig:
        """Read an ``RLJobSpec`` (``specrl.runtime.api``), preferably of ``job.resolved()`` so that the
        derived defaults (``totalGPUs``, ``maxReplicas``) are filled in."""
        res, el = spec.resources, spec.elastic
        t, r = res.trainer, res.rollout
        return cls(
            trainer_min=int(t.min_replicas),
            trainer_max=int(t.max_replicas if t.max_replicas is not None else t.replicas),
            rollout_min=int(r.min_replicas),
            rollout_max=int(r.max_replicas if r.max_replicas is not None else r.replicas),
            gpus_per_pod=int(res.gpus_per_pod),
            total_gpus=None if res.total_gpus is None or res.gpus_per_pod == 0 else int(res.total_gpus),
            mode=str(spec.mode),
            enabled=bool(el.enabled),
            cooldown_seconds=float(el.cooldown_seconds),
            long_tail_fraction=float(el.long_tail_fraction),
            queue_high_watermark=int(el.queue_high_watermark),
            queue_low_watermark=int(el.queue_low_watermark),
            trainer_backlog_high_watermark=int(el.trainer_backlog_high_watermark),
            hysteresis=int(el.hysteresis),
        )


@dataclass(frozen=True)
class LastMove:
    time: float
    from_role: str
    to_role: str


@dataclass(frozen=True)
class Want:
    """A direction the signals ask for, before guards: ``from_role`` -> ``to_role`` because ``reason``."""

    from_role: Role
    to_role: Role
    reason: str
    message: str = field(default="", compare=False)


@dataclass(frozen=True)
class Streak:
    """How many consecutive polls wanted the same direction (the hysteresis counter)."""

    direction: tuple[str, str] | None = None
    count: int = 0

    def update(self, want: Want | None) -> Streak:
        if want is None:
            return Streak()
        direction = (want.from_role, want.to_role)
        return Streak(direction, self.count + 1 if direction == self.direction else 1)


@dataclass(frozen=True)
class Move:
    """Move ``count`` pods from ``from_role`` to ``to_role``; ``victim`` is the first pod to drain."""

    from_role: Role
    to_role: Role
    count: int
    reason: str
    victim: str | None = None
    message: str = field(default="", compare=False)


@dataclass(frozen=True)
class Decision:
    move: Move | None
    streak: Streak
    want: Want | None = None
    held: str = ""  # why a want did not become a move (for logs and the simulator's trace)


# Every (from_role, to_role, reason) :func:`want` can return, and the modes it can return it in.
_REASONS: tuple[tuple[Role, Role, str, frozenset[str]], ...] = (
    ("trainer", "rollout", "QueueBacklog", frozenset({"sync", "async"})),
    ("trainer", "rollout", "TrainerStarved", frozenset({"async"})),
    ("trainer", "rollout", "StepBalance", frozenset({"sync", "async"})),
    ("rollout", "trainer", "TrainerBacklog", frozenset({"async"})),
    ("rollout", "trainer", "LongTail", frozenset({"sync", "async"})),
)


def possible_moves(mode: str) -> tuple[tuple[Role, Role, str], ...]:
    """The (from_role, to_role, reason) triples a job in ``mode`` can move by (its rebalance counters)."""
    return tuple((src, dst, reason) for src, dst, reason, modes in _REASONS if mode in modes)


def want(s: Signals, alloc: Allocation, cfg: PolicyConfig) -> Want | None:
    """The direction the signals ask for in this allocation, ignoring every guard."""
    r = max(alloc.rollout, 1)
    w, lo = cfg.queue_high_watermark, cfg.queue_low_watermark
    if s.queue_depth > w * r:
        return Want("trainer", "rollout", "QueueBacklog",
                    f"rollout queue depth {s.queue_depth} > {w} per worker x {r} rollout workers")
    if cfg.mode == "async" and s.trainer_backlog == 0 and not s.long_tail and s.queue_depth > lo * r:
        return Want("trainer", "rollout", "TrainerStarved",
                    f"trainer backlog is empty while {s.queue_depth} prompts wait for {r} rollout workers")
    if s.queue_depth > lo * r:
        return None  # between the watermarks: hold
    tb = cfg.trainer_backlog_high_watermark
    if cfg.mode == "async" and s.trainer_backlog >= tb:
        return Want("rollout", "trainer", "TrainerBacklog", f"trainer backlog {s.trainer_backlog} >= {tb} samples")
    if s.last_step is not None and rollout_gains(s.last_step, alloc, cfg):
        t = s.last_step
        return Want("trainer", "rollout", "StepBalance",
                    f"last step: rollout {t.rollout_seconds:.0f}s ({t.long_tail_seconds:.0f}s long tail) vs "
                    f"training {t.train_seconds:.0f}s: a rollout worker saves more than a trainer costs")
    if s.long_tail and (s.step_batch_size <= 0 or s.active_sequences < cfg.long_tail_fraction * s.step_batch_size):
        if s.last_step is not None and not trainer_gains(s.last_step, alloc, cfg):
            return None  # the tail idles rollout GPUs, but a trainer would not shorten the step
        return Want("rollout", "trainer", "LongTail",
                    f"long tail: {s.active_sequences} of {s.step_batch_size} sequences still decoding "
                    f"(< {cfg.long_tail_fraction:g} of the step)")
    return None


def trainer_gains(t: StepTiming, alloc: Allocation, cfg: PolicyConfig) -> bool:
    """Would moving one rollout pod to training shorten the step, judged on the last step's timings?

    Sync: a step is rollout + training. Training time scales as 1/trainers and the pre-tail part of the
    rollout as 1/rollout workers (the tail itself is one long sequence on one worker and does not shrink),
    so the move gains train/(T+1) and costs bulk/(R-1). Async: the slower role sets the pace, so only a
    trainer-bound job gains.
    """
    tr, ro = max(alloc.trainer, 1), alloc.rollout
    if ro <= 1:
        return False
    if cfg.mode == "async":
        return t.train_seconds > (1 + cfg.balance_margin) * t.rollout_seconds
    return t.train_seconds / (tr + 1) > (1 + cfg.balance_margin) * t.bulk_seconds / (ro - 1)


def rollout_gains(t: StepTiming, alloc: Allocation, cfg: PolicyConfig) -> bool:
    """The mirror of :func:`trainer_gains`: would one more rollout pod (one trainer fewer) shorten the step?"""
    tr, ro = alloc.trainer, max(alloc.rollout, 1)
    if tr <= 1:
        return False
    if cfg.mode == "async":
        return t.rollout_seconds > (1 + cfg.balance_margin) * t.train_seconds
    return t.bulk_seconds / (ro + 1) > (1 + cfg.balance_margin) * t.train_seconds / (tr - 1)


def pick_victim(role: str, pods: Iterable[str], exclude: Sequence[str] = ()) -> str | None:
    """The highest-index pod of ``role`` (newest first, like KubeRay's scale-down), or None."""
    best: tuple[int, str] | None = None
    for name in pods:
        m = _POD_INDEX.search(name)
        if m and m.group(1) == role and name not in exclude:
            idx = int(m.group(2))
            if best is None or idx > best[0]:
                best = (idx, name)
    return best[1] if best else None


def room(alloc: Allocation, cfg: PolicyConfig, src: str, dst: str) -> int:
    """How many pods may move from ``src`` to ``dst`` without breaking a bound or the budget."""
    if cfg.total_gpus is not None and (alloc.trainer + alloc.rollout) * cfg.gpus_per_pod > cfg.total_gpus:
        return 0
    src_min, _ = cfg.bounds(src)
    _, dst_max = cfg.bounds(dst)
    return max(0, min(alloc.of(src) - src_min, dst_max - alloc.of(dst)))


def _pressure(s: Signals, alloc: Allocation, cfg: PolicyConfig, reason: str) -> int:
    """How many pods the signal justifies (at least one)."""
    if reason == "QueueBacklog":
        # Enough rollout workers to bring the queue back to the high watermark.
        return max(1, math.ceil(s.queue_depth / max(1, cfg.queue_high_watermark)) - alloc.rollout)
    if reason == "TrainerBacklog":
        return max(1, s.trainer_backlog // max(1, cfg.trainer_backlog_high_watermark))
    return 1


def decide(
    signals: Signals,
    alloc: Allocation,
    cfg: PolicyConfig,
    now: float,
    last: LastMove | None = None,
    streak: Streak = Streak(),
) -> Decision:
    """The one move to make now (or None) and the streak to pass to the next call. See the module doc."""
    if not cfg.enabled:
        return Decision(None, Streak(), held="elastic rebalancing is disabled")
    if signals.complete or signals.phase in QUIET_PHASES:
        return Decision(None, Streak(), held=f"coordinator phase {signals.phase}")
    if signals.draining:
        return Decision(None, Streak(), held=f"{', '.join(signals.draining)} still draining")
    if alloc.unready:
        # A pod that is not Ready yet is a move still landing (or a pod that cannot start): moving more
        # capacity on top of it would act on signals that do not reflect it yet.
        return Decision(None, Streak(), held=f"{', '.join(alloc.unready[:3])} not Ready")
    w = want(signals, alloc, cfg)
    streak = streak.update(w)
    if w is None:
        return Decision(None, streak)
    if streak.count < cfg.hysteresis:
        return Decision(None, streak, w, held=f"{streak.count}/{cfg.hysteresis} polls agree")
    if last is not None and now - last.time < cfg.cooldown_seconds:
        left = cfg.cooldown_seconds - (now - last.time)
        return Decision(None, streak, w, held=f"cooldown: {left:.0f}s left")
    n = min(room(alloc, cfg, w.from_role, w.to_role), max(1, cfg.max_pods_per_move),
            _pressure(signals, alloc, cfg, w.reason))
    if n <= 0:
        return Decision(None, streak, w, held=f"{w.from_role} at its minimum, {w.to_role} at its maximum or over budget")
    # Never make a move the policy would want to undo on the same signals.
    while n > 0:
        back = want(signals, alloc.after(w.from_role, w.to_role, n), cfg)
        if back is None or (back.from_role, back.to_role) == (w.from_role, w.to_role):
            break
        n -= 1
    if n <= 0:
        return Decision(None, streak, w, held="the move would be reversed on the same signals")
    victim = pick_victim(w.from_role, alloc.pods) if alloc.pods else None
    move = Move(w.from_role, w.to_role, n, w.reason, victim, w.message)
    return Decision(move, Streak(), w)
