"""RL steps on a GPU pool: rollout, weight sync and training, sync or async, static or elastic split.

Sync: rollout of step n uses weights n, so a step is rollout + sync + train. Colocated placement runs both on
all GPUs in turn; split placement gives each role its own GPUs (and idles the other role meanwhile).
Async (split only): rollout of step n may start on weights at most `max_staleness` versions old, so rollout
and training overlap and the slower of the two sets the pace.
Elastic: the operator's real policy (`specrl.operator.rebalance.decide`) polls the simulated coordinator
status every `poll_seconds`; a move it returns takes effect at the next step boundary after the drain and the
new pod's start-up delay, as the operator's actuator does it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ...operator import rebalance
from ..scheduling import is_long_tail
from .cost_model import CostModel
from .rollout_sim import RolloutPhase, simulate_rollout
from .scenario import Scenario
from .speculation import SpeculationPolicy
from .workload import step_lengths


@dataclass
class StepRecord:
    step: int
    trainer_gpus: int
    rollout_gpus: int
    alpha: float
    rollout_seconds: float
    sync_seconds: float
    train_seconds: float
    step_seconds: float
    long_tail_seconds: float
    rollout_idle_gpu_seconds: float
    trainer_idle_gpu_seconds: float
    sd_share: float
    tokens: int
    moves: list[str] = field(default_factory=list)


@dataclass
class SimResult:
    scenario: str
    steps: list[StepRecord]
    total_seconds: float
    last_phase: RolloutPhase | None = None

    @property
    def rollout_seconds(self) -> float:
        return sum(s.rollout_seconds for s in self.steps)

    @property
    def train_seconds(self) -> float:
        return sum(s.train_seconds for s in self.steps)

    def gpu_seconds(self, role: str) -> float:
        attr = "trainer_gpus" if role == "trainer" else "rollout_gpus"
        return sum(getattr(s, attr) * s.step_seconds for s in self.steps)

    def tail_idle_fraction(self) -> float:
        """Share of rollout GPU-time spent idle while the slowest instances finish the long tail."""
        total = sum(s.rollout_gpus * s.rollout_seconds for s in self.steps)
        return sum(s.rollout_idle_gpu_seconds for s in self.steps) / total if total else 0.0


def alpha_at(s: Scenario, step: int) -> float:
    """Drafter acceptance at an RL step: drifts while stale, recovers at every drafter update."""
    acc, dt = s.speculative.acceptance, s.speculative.drafter_training
    if acc.drift_per_step == 0:
        return acc.alpha
    if dt.enabled:
        since = step % dt.interval
        residual = (1.0 - dt.recovery) * acc.drift_per_step * (step - since)
        lost = acc.drift_per_step * since + residual
    else:
        lost = acc.drift_per_step * step
    return max(acc.min_alpha, acc.alpha - lost)


def _signals(phase: RolloutPhase, t: float, backlog: int, in_rollout: bool, long_tail_fraction: float,
             last: StepRecord | None) -> rebalance.Signals:
    """What the coordinator's GET /status would say at time t of this step."""
    queue, active = phase.status_at(t) if in_rollout else (0, 0)
    long_tail = in_rollout and is_long_tail(queue, active, phase.sequences, long_tail_fraction)
    timing = (rebalance.StepTiming(last.rollout_seconds, last.long_tail_seconds, last.train_seconds)
              if last is not None else None)
    return rebalance.Signals(queue_depth=queue, active_sequences=active, step_batch_size=phase.sequences,
                             long_tail=long_tail, trainer_backlog=backlog, last_step=timing,
                             phase="LongTail" if long_tail else ("Rollout" if in_rollout else "Training"))


def _policy_config(s: Scenario) -> rebalance.PolicyConfig:
    e, tp = s.elastic, s.rollout.tensor_parallel
    # one "pod" = one rollout instance's worth of GPUs, so a move never splits a tensor-parallel group
    return rebalance.PolicyConfig(
        trainer_min=max(1, e.min_trainer_gpus // tp), trainer_max=s.cluster.gpus // tp,
        rollout_min=max(1, e.min_rollout_gpus // tp), rollout_max=s.cluster.gpus // tp,
        gpus_per_pod=tp, total_gpus=s.cluster.gpus, mode=s.mode, enabled=True,
        cooldown_seconds=e.cooldown_seconds, long_tail_fraction=e.long_tail_fraction,
        queue_high_watermark=e.queue_high_watermark, queue_low_watermark=e.queue_low_watermark,
        trainer_backlog_high_watermark=max(1, e.trainer_backlog_high_watermark or s.workload.prompts_per_step),
        hysteresis=e.hysteresis, max_pods_per_move=e.max_pods_per_move,
    )


def simulate(s: Scenario, trainer_gpus: int | None = None, elastic: bool | None = None) -> SimResult:
    costs = CostModel(s)
    policy = SpeculationPolicy(s.speculative, costs)
    w, tp = s.workload, s.rollout.tensor_parallel
    colocated = s.placement == "colocated"
    elastic = s.elastic.enabled if elastic is None else elastic
    trainers = s.cluster.gpus if colocated else (trainer_gpus if trainer_gpus is not None else s.split_trainer_gpus)
    cfg = _policy_config(s) if elastic and not colocated else None
    last_move: rebalance.LastMove | None = None
    streak = rebalance.Streak()
    pending: list[tuple[float, int]] = []  # (effective time, trainer GPU delta)

    records: list[StepRecord] = []
    clock = 0.0
    rollout_free = train_free = 0.0  # async pipeline: when each role can start its next piece of work
    weights_ready: list[float] = []  # time weights version v+1 reached the rollout workers
    phase: RolloutPhase | None = None
    for step in range(w.steps):
        # moves whose drain + start-up finished take effect at this step boundary
        for when, delta in [p for p in pending if p[0] <= max(clock, rollout_free)]:
            trainers += delta
            pending.remove((when, delta))
        rollout_gpus = s.cluster.gpus if colocated else s.cluster.gpus - trainers
        instances = max(1, rollout_gpus // tp)
        lengths = step_lengths(w, step)
        alpha = alpha_at(s, step)
        phase = simulate_rollout(lengths, instances, tp, w.prompt_tokens, s.rollout.max_batch, costs, policy, alpha,
                                 s.elastic.long_tail_fraction, seed=w.seed + step)
        tokens = int(lengths.sum()) + len(lengths) * w.prompt_tokens
        train = costs.train_step(tokens, s.cluster.gpus if colocated else trainers)
        sync = costs.weight_sync(colocated)
        if s.mode == "sync":
            start = clock
            step_seconds = phase.duration + sync + train
            clock += step_seconds
            rollout_start, train_start = start, start + phase.duration
        else:
            # rollout n needs weights version n - max_staleness (trained on steps < n - max_staleness)
            need = step - s.max_staleness - 1
            rollout_start = max(rollout_free, weights_ready[need] if need >= 0 else 0.0)
            rollout_free = rollout_start + phase.duration
            train_start = max(train_free, rollout_free)
            train_free = train_start + train
            weights_ready.append(train_free + sync)
            step_seconds = train_free + sync - clock
            clock = train_free + sync
        trainer_idle = trainers * max(0.0, step_seconds - train) if not colocated else 0.0
        rec = StepRecord(step, 0 if colocated else trainers, rollout_gpus, alpha, phase.duration, sync, train,
                         step_seconds, phase.long_tail_seconds, phase.idle_gpu_seconds, trainer_idle,
                         phase.sd_share, int(lengths.sum()))
        if cfg is not None:
            last_move, streak = _poll(s, cfg, phase, rollout_start, train_start, train, trainers, rollout_gpus,
                                      last_move, streak, pending, rec, records[-1] if records else None)
        records.append(rec)
    return SimResult(s.name, records, clock, phase)


def _poll(s: Scenario, cfg: rebalance.PolicyConfig, phase: RolloutPhase, rollout_start: float, train_start: float,
          train: float, trainers: int, rollout_gpus: int, last: rebalance.LastMove | None,
          streak: rebalance.Streak, pending: list[tuple[float, int]], rec: StepRecord,
          previous: StepRecord | None) -> tuple[rebalance.LastMove | None, rebalance.Streak]:
    """Poll the policy through this step's timeline, as the operator's timer would."""
    e, tp = s.elastic, s.rollout.tensor_parallel
    end = max(rollout_start + phase.duration, train_start + train)
    t = rollout_start
    while t < end:
        in_rollout = t < rollout_start + phase.duration
        backlog = s.workload.prompts_per_step if (s.mode == "async" and not in_rollout and t < train_start) else 0
        signals = _signals(phase, t - rollout_start, backlog, in_rollout, e.long_tail_fraction, previous)
        if pending:
            signals = rebalance.Signals(**{**signals.__dict__, "workers": (
                rebalance.WorkerState("victim", "rollout", "draining"),)})
        alloc = rebalance.Allocation(trainer=(trainers + sum(d for _, d in pending)) // tp,
                                     rollout=(rollout_gpus - sum(d for _, d in pending)) // tp)
        decision = rebalance.decide(signals, alloc, cfg, now=t, last=last, streak=streak)
        streak, move = decision.streak, decision.move
        if move is not None:
            delta = move.count * tp * (1 if move.to_role == "trainer" else -1)
            pending.append((t + e.drain_seconds + e.startup_seconds, delta))
            rec.moves.append(f"{move.from_role}->{move.to_role} x{move.count} ({move.reason})")
            last = rebalance.LastMove(time=t, from_role=move.from_role, to_role=move.to_role)
        t += e.poll_seconds
    return last, streak
