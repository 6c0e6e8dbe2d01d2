"""Elastic rebalancing policy: which GPUs should move between the trainer and rollout roles, if any.

Pure and deterministic (no I/O, no clock): the operator's timer and the cluster simulator
(`specrl.runtime.sim`) both call :func:`decide` with the coordinator's latest signals, the current
allocation, the policy knobs from ``spec.elastic``/``spec.resources`` and the time of the last move.
The caller executes the returned :class:`Move` (drain the victim, delete its pod, create one of the
other role) and records it as the new :class:`LastMove`.

The rules, with ``Q`` = queue depth, ``B`` = trainer backlog, ``A`` = active sequences, ``S`` = step
batch size and ``h`` = hysteresis (a fraction of the queue high watermark ``W``):

* **Pull towards rollout** (rollout is the bottleneck)
  - ``QueueBacklog``: ``Q >= W`` — prompts wait for a free rollout slot;
  - ``TrainerStarved`` (async mode): ``B == 0`` while ``Q > (1 - h)·W`` and no long tail —
    trainers idle because rollouts cannot keep up.
* **Push towards trainer** (only when no pull rule fires and ``Q < (1 - h)·W``)
  - ``TrainerBacklog`` (async mode): ``B >= trainerBacklogHighWatermark`` — samples pile up for training;
  - ``LongTail``: the coordinator reports a long tail and ``A <= longTailFraction·S`` — a few long
    sequences occupy rollout pods whose GPUs sit mostly idle.

Pull and push thresholds are separated by the hysteresis band, so for any one input at most one
direction is possible: on a constant input the policy moves monotonically until a bound stops it and
never reverses (no oscillation). Every move also respects:

* one move at a time: nothing while a worker is still draining, nothing inside ``cooldownSeconds``
  of the previous move, nothing during weight sync or before the job runs;
* bounds: the donor role never drops below its minimum, the receiver never exceeds its maximum;
* the GPU budget: ``(trainer + rollout) · gpusPerPod <= totalGPUs`` after the move (a move keeps the
  total constant, so an over-budget allocation — e.g. after a spec edit — is left to reconciliation).
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Literal

Role = Literal["trainer", "rollout"]
ROLES: tuple[Role, Role] = ("trainer", "rollout")

# Coordinator phases in which moving a worker would disturb the step loop rather than help it.
_QUIET_PHASES = frozenset({"Starting", "Syncing", "Complete", "Failed"})
_POD_INDEX = re.compile(r"-(trainer|rollout)-(\d+)$")


@dataclass(frozen=True)
class WorkerState:
    """One worker as the coordinator reports it (``workers[]`` in ``GET /status``)."""

    name: str
    role: str
    state: str  # active | draining | retired


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

    @classmethod
    def from_status(cls, status: dict) -> Signals:
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
        )

    @property
    def draining(self) -> tuple[str, ...]:
        return tuple(w.name for w in self.workers if w.state == "draining")


@dataclass(frozen=True)
class Allocation:
    """Current replicas per role; ``pods`` (optional) names them so a victim can be chosen."""

    trainer: int
    rollout: int
    pods: tuple[str, ...] = ()

    def of(self, role: str) -> int:
        return self.trainer if role == "trainer" else self.rollout

    def after(self, move: Move) -> Allocation:
        delta = {move.from_role: -move.count, move.to_role: move.count}
        return Allocation(trainer=self.trainer + delta.get("trainer", 0), rollout=self.rollout + delta.get("rollout", 0))


@dataclass(frozen=True)
class PolicyConfig:
    """Policy knobs, normally taken from an RLJob spec with :meth:`from_spec`."""

    trainer_min: int = 1
    trainer_max: int = 1_000_000
    rollout_min: int = 1
    rollout_max: int = 1_000_000
    gpus_per_pod: int = 1
    total_gpus: int | None = None  # None: no budget beyond the role maxima
    mode: str = "sync"
    enabled: bool = True
    cooldown_seconds: float = 60.0
    long_tail_fraction: float = 0.25
    queue_high_watermark: int = 64
    trainer_backlog_high_watermark: int = 64
    hysteresis: float = 0.2
    max_pods_per_move: int = 1

    def bounds(self, role: str) -> tuple[int, int]:
        return (self.trainer_min, self.trainer_max) if role == "trainer" else (self.rollout_min, self.rollout_max)

    @classmethod
    def from_spec(cls, spec: object) -> PolicyConfig:
        """Read ``spec.resources``, ``spec.elastic`` and ``spec.mode`` from an RLJob spec model.

        Attribute access only (snake_case, as in ``specrl.runtime.api``); absent optional knobs keep
        the defaults above, so older specs keep working.
        """
        res = getattr(spec, "resources")
        el = getattr(spec, "elastic", None)
        trainer, rollout = res.trainer, res.rollout

        def pick(obj: object, name: str, default: object) -> object:
            value = getattr(obj, name, None) if obj is not None else None
            return default if value is None else value

        t_rep = int(pick(trainer, "replicas", 1))
        r_rep = int(pick(rollout, "replicas", 1))
        mode = getattr(spec, "mode", "sync")
        mode = getattr(mode, "value", mode)
        return cls(
            trainer_min=int(pick(trainer, "min_replicas", t_rep)),
            trainer_max=int(pick(trainer, "max_replicas", t_rep)),
            rollout_min=int(pick(rollout, "min_replicas", r_rep)),
            rollout_max=int(pick(rollout, "max_replicas", r_rep)),
            gpus_per_pod=int(pick(res, "gpus_per_pod", 1)),
            total_gpus=pick(res, "total_gpus", None),  # type: ignore[arg-type]
            mode=str(mode),
            enabled=bool(pick(el, "enabled", False)),
            cooldown_seconds=float(pick(el, "cooldown_seconds", 60.0)),
            long_tail_fraction=float(pick(el, "long_tail_fraction", 0.25)),
            queue_high_watermark=int(pick(el, "queue_high_watermark", 64)),
            trainer_backlog_high_watermark=int(pick(el, "trainer_backlog_high_watermark", 64)),
            hysteresis=float(pick(el, "hysteresis", 0.2)),
            max_pods_per_move=int(pick(el, "max_pods_per_move", 1)),
        )


@dataclass(frozen=True)
class LastMove:
    time: float
    from_role: str
    to_role: str


@dataclass(frozen=True)
class Move:
    """Move ``count`` pods from ``from_role`` to ``to_role``; ``victim`` is the first pod to drain."""

    from_role: Role
    to_role: Role
    count: int
    reason: str
    victim: str | None = None
    message: str = field(default="", compare=False)


def pull_reason(s: Signals, cfg: PolicyConfig) -> tuple[str, str] | None:
    """Why rollout needs more GPUs (reason, message), or None."""
    w = cfg.queue_high_watermark
    if s.queue_depth >= w:
        return "QueueBacklog", f"rollout queue depth {s.queue_depth} >= high watermark {w}"
    if cfg.mode == "async" and s.trainer_backlog == 0 and not s.long_tail and s.queue_depth > (1 - cfg.hysteresis) * w:
        return "TrainerStarved", f"trainer backlog is empty while {s.queue_depth} prompts wait for rollout"
    return None


def push_reason(s: Signals, cfg: PolicyConfig) -> tuple[str, str] | None:
    """Why the trainer should get GPUs back (reason, message), or None. Assumes no pull reason."""
    if s.queue_depth >= (1 - cfg.hysteresis) * cfg.queue_high_watermark:
        return None  # inside the hysteresis band: hold
    tb = cfg.trainer_backlog_high_watermark
    if cfg.mode == "async" and s.trainer_backlog >= tb:
        return "TrainerBacklog", f"trainer backlog {s.trainer_backlog} >= high watermark {tb}"
    if s.long_tail and s.step_batch_size > 0 and s.active_sequences <= cfg.long_tail_fraction * s.step_batch_size:
        return "LongTail", (
            f"long tail: {s.active_sequences} of {s.step_batch_size} sequences still decoding "
            f"(<= {cfg.long_tail_fraction:g} of the step)"
        )
    return None


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


def _room(alloc: Allocation, cfg: PolicyConfig, src: str, dst: str) -> int:
    """How many pods may move from ``src`` to ``dst`` without breaking a bound or the budget."""
    src_min, _ = cfg.bounds(src)
    _, dst_max = cfg.bounds(dst)
    room = min(alloc.of(src) - src_min, dst_max - alloc.of(dst))
    if cfg.total_gpus is not None and (alloc.trainer + alloc.rollout) * cfg.gpus_per_pod > cfg.total_gpus:
        return 0
    return max(0, room)


def decide(
    signals: Signals,
    alloc: Allocation,
    cfg: PolicyConfig,
    now: float,
    last: LastMove | None = None,
) -> Move | None:
    """Return the one move to make now, or None. See the module docstring for the rules."""
    if not cfg.enabled or signals.complete or signals.phase in _QUIET_PHASES:
        return None
    if signals.draining:
        return None  # a previous move is still in flight
    if last is not None and now - last.time < cfg.cooldown_seconds:
        return None

    pulled = pull_reason(signals, cfg)
    if pulled is not None:
        src, dst, (reason, message) = "trainer", "rollout", pulled
    else:
        pushed = push_reason(signals, cfg)
        if pushed is None:
            return None
        src, dst, (reason, message) = "rollout", "trainer", pushed

    room = _room(alloc, cfg, src, dst)
    if room <= 0:
        return None
    count = min(room, max(1, cfg.max_pods_per_move), _pressure(signals, cfg, reason))
    victim = pick_victim(src, alloc.pods) if alloc.pods else None
    return Move(from_role=src, to_role=dst, count=count, reason=reason, victim=victim, message=message)  # type: ignore[arg-type]


def _pressure(s: Signals, cfg: PolicyConfig, reason: str) -> int:
    """How many pods the signal justifies (at least one): multiples of the watermark that are exceeded."""
    if reason == "QueueBacklog":
        return max(1, math.floor(s.queue_depth / max(1, cfg.queue_high_watermark)))
    if reason == "TrainerBacklog":
        return max(1, math.floor(s.trainer_backlog / max(1, cfg.trainer_backlog_high_watermark)))
    return 1
