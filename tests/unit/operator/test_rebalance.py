"""The elastic rebalancing policy: rules, guards, bounds, and no oscillation (property tests)."""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from specrl.operator.rebalance import (
    Allocation,
    LastMove,
    PolicyConfig,
    Signals,
    StepTiming,
    Streak,
    WorkerState,
    decide,
    pick_victim,
    possible_moves,
    want,
)
from specrl.runtime.api import RLJob

PODS = tuple(f"j-trainer-{i}" for i in range(4)) + tuple(f"j-rollout-{i}" for i in range(4))
CFG = PolicyConfig(trainer_min=2, trainer_max=6, rollout_min=2, rollout_max=6, gpus_per_pod=1, total_gpus=8,
                   mode="sync", enabled=True, cooldown_seconds=60, long_tail_fraction=0.25,
                   queue_high_watermark=10, queue_low_watermark=2, trainer_backlog_high_watermark=100, hysteresis=1)
ALLOC = Allocation(4, 4, PODS)


def one(signals: Signals, alloc: Allocation = ALLOC, cfg: PolicyConfig = CFG, **kw):
    return decide(signals, alloc, cfg, now=1000.0, **kw)


def test_queue_backlog_pulls_a_trainer_gpu_to_rollout_and_names_the_newest_trainer():
    d = one(Signals(queue_depth=41))  # > 10 per worker x 4 workers
    assert d.move is not None
    assert (d.move.from_role, d.move.to_role, d.move.reason) == ("trainer", "rollout", "QueueBacklog")
    assert d.move.victim == "j-trainer-3" and d.move.count == 1
    assert "41" in d.move.message


def test_queue_at_the_high_watermark_is_not_a_backlog():
    assert one(Signals(queue_depth=40)).move is None


def test_long_tail_pushes_rollout_gpus_back_to_training():
    d = one(Signals(queue_depth=0, long_tail=True, active_sequences=3, step_batch_size=64))
    assert d.move is not None
    assert (d.move.from_role, d.move.to_role, d.move.reason) == ("rollout", "trainer", "LongTail")
    assert d.move.victim == "j-rollout-3"


def test_long_tail_with_many_active_sequences_holds():
    assert one(Signals(queue_depth=0, long_tail=True, active_sequences=40, step_batch_size=64)).move is None


def test_queue_above_low_watermark_blocks_a_push():
    # 9 queued > 2 per worker x 4: rollout is still busy, even though the coordinator flags a long tail.
    assert want(Signals(queue_depth=9, long_tail=True, active_sequences=1, step_batch_size=64), ALLOC, CFG) is None


def test_trainer_backlog_pushes_only_in_async_mode():
    s = Signals(queue_depth=0, trainer_backlog=500)
    assert one(s).move is None
    cfg = PolicyConfig(**{**CFG.__dict__, "mode": "async"})
    d = one(s, cfg=cfg)
    assert d.move is not None and d.move.reason == "TrainerBacklog" and d.move.to_role == "trainer"


def test_trainer_starvation_pulls_in_async_mode():
    cfg = PolicyConfig(**{**CFG.__dict__, "mode": "async"})
    d = one(Signals(queue_depth=20, trainer_backlog=0), cfg=cfg)
    assert d.move is not None and d.move.reason == "TrainerStarved" and d.move.to_role == "rollout"
    assert one(Signals(queue_depth=20, trainer_backlog=0)).move is None  # sync: trainers wait by design


def test_hysteresis_needs_consecutive_agreeing_polls():
    cfg = PolicyConfig(**{**CFG.__dict__, "hysteresis": 3})
    s = Signals(queue_depth=100)
    d1 = decide(s, ALLOC, cfg, 0.0)
    d2 = decide(s, ALLOC, cfg, 1.0, streak=d1.streak)
    assert d1.move is None and d2.move is None and "2/3" in d2.held
    d3 = decide(s, ALLOC, cfg, 2.0, streak=d2.streak)
    assert d3.move is not None and d3.streak == Streak()
    # A disagreeing poll in between resets the count.
    quiet = decide(Signals(), ALLOC, cfg, 1.5, streak=d2.streak)
    assert decide(s, ALLOC, cfg, 2.0, streak=quiet.streak).move is None


def test_cooldown_blocks_a_second_move():
    last = LastMove(time=980.0, from_role="trainer", to_role="rollout")
    d = one(Signals(queue_depth=100), last=last)
    assert d.move is None and "cooldown" in d.held
    assert one(Signals(queue_depth=100), last=LastMove(900.0, "trainer", "rollout")).move is not None


def test_draining_worker_blocks_any_move():
    s = Signals(queue_depth=100, workers=(WorkerState("j-trainer-3", "trainer", "draining"),))
    d = one(s)
    assert d.move is None and "draining" in d.held


@pytest.mark.parametrize("phase", ["Starting", "Syncing", "Complete", "Failed"])
def test_quiet_phases_make_no_move(phase):
    assert one(Signals(queue_depth=100, phase=phase)).move is None


def test_disabled_and_complete_make_no_move():
    assert one(Signals(queue_depth=100), cfg=PolicyConfig(**{**CFG.__dict__, "enabled": False})).move is None
    assert one(Signals(queue_depth=100, complete=True)).move is None


def test_bounds_stop_moves():
    at_min = Allocation(2, 6, ())
    d = one(Signals(queue_depth=1000), alloc=at_min)
    assert d.move is None and "minimum" in d.held
    d = one(Signals(long_tail=True, active_sequences=0, step_batch_size=8), alloc=Allocation(6, 2))
    assert d.move is None


def test_over_budget_allocation_is_left_to_reconciliation():
    assert one(Signals(queue_depth=1000), alloc=Allocation(5, 4)).move is None  # 9 GPUs > 8


def test_pressure_moves_several_pods_when_allowed_but_never_past_the_bounds():
    cfg = PolicyConfig(**{**CFG.__dict__, "max_pods_per_move": 8})
    d = one(Signals(queue_depth=1000), cfg=cfg)  # wants 100 rollout workers; room: 4 - 2 = 2
    assert d.move is not None and d.move.count == 2


def test_a_move_that_would_be_undone_is_not_made():
    # One rollout worker, 4 queued > 3 per worker: a backlog. With two workers the queue (4) would sit at the
    # low watermark (2 per worker) while the coordinator flags a long tail, and the policy would push back.
    cfg = PolicyConfig(**{**CFG.__dict__, "rollout_min": 1, "queue_high_watermark": 3, "queue_low_watermark": 2})
    s = Signals(queue_depth=4, long_tail=True, active_sequences=0, step_batch_size=8)
    assert (w := want(s, Allocation(4, 1), cfg)) is not None and w.to_role == "rollout"
    assert (w := want(s, Allocation(3, 2), cfg)) is not None and w.to_role == "trainer"
    d = decide(s, Allocation(4, 1), cfg, 0.0)
    assert d.move is None and "reversed" in d.held


def test_pick_victim_highest_index_of_role():
    assert pick_victim("rollout", ["j-rollout-2", "j-rollout-10", "j-trainer-11"]) == "j-rollout-10"
    assert pick_victim("trainer", ["j-rollout-1"]) is None
    assert pick_victim("rollout", ["j-rollout-2", "j-rollout-10"], exclude=["j-rollout-10"]) == "j-rollout-2"


def test_signals_from_coordinator_json():
    s = Signals.from_status({"queueDepth": 5, "activeSequences": 2, "stepBatchSize": 64, "longTail": True,
                             "trainerBacklog": 7, "phase": "LongTail", "complete": False,
                             "workers": [{"name": "j-rollout-0", "role": "rollout", "state": "draining"}],
                             "acceptanceLength": None})
    assert (s.queue_depth, s.long_tail, s.trainer_backlog, s.draining) == (5, True, 7, ("j-rollout-0",))


def test_config_from_spec_uses_resolved_defaults():
    job = RLJob.model_validate({
        "apiVersion": "specrl.io/v1alpha1", "kind": "RLJob", "metadata": {"name": "j"},
        "spec": {"mode": "async", "resources": {"gpusPerPod": 2, "totalGPUs": 16,
                                                "trainer": {"replicas": 3, "minReplicas": 2},
                                                "rollout": {"replicas": 4, "minReplicas": 1}},
                 "elastic": {"enabled": True, "hysteresis": 2, "queueLowWatermark": 1}}}).resolved()
    cfg = PolicyConfig.from_spec(job.spec)
    assert (cfg.trainer_min, cfg.rollout_min, cfg.total_gpus, cfg.gpus_per_pod) == (2, 1, 16, 2)
    assert cfg.trainer_max == 8 - 1 and cfg.rollout_max == 8 - 2  # budget 8 pods minus the other's minimum
    assert (cfg.mode, cfg.hysteresis, cfg.queue_low_watermark, cfg.enabled) == ("async", 2, 1, True)


# ---- properties ------------------------------------------------------------------------------------

signals_st = st.builds(
    Signals,
    queue_depth=st.integers(0, 2000),
    active_sequences=st.integers(0, 512),
    step_batch_size=st.integers(0, 512),
    long_tail=st.booleans(),
    trainer_backlog=st.integers(0, 2000),
    phase=st.sampled_from(["Rollout", "LongTail", "Training"]),
    last_step=st.none() | st.builds(StepTiming, st.floats(1, 1000), st.floats(0, 1000), st.floats(1, 1000)),
)


@st.composite
def setups(draw):
    gpus = draw(st.integers(1, 4))
    t_min, r_min = draw(st.integers(1, 6)), draw(st.integers(1, 6))
    t_max, r_max = t_min + draw(st.integers(0, 10)), r_min + draw(st.integers(0, 10))
    t = draw(st.integers(t_min, t_max))
    r = draw(st.integers(r_min, r_max))
    total = (t + r) * gpus + draw(st.integers(0, 3)) * gpus
    low = draw(st.integers(0, 20))
    cfg = PolicyConfig(trainer_min=t_min, trainer_max=t_max, rollout_min=r_min, rollout_max=r_max,
                       gpus_per_pod=gpus, total_gpus=total, mode=draw(st.sampled_from(["sync", "async"])),
                       cooldown_seconds=draw(st.sampled_from([0.0, 30.0])),
                       long_tail_fraction=draw(st.floats(0.05, 1.0)),
                       queue_high_watermark=low + draw(st.integers(1, 50)), queue_low_watermark=low,
                       trainer_backlog_high_watermark=draw(st.integers(1, 500)),
                       hysteresis=draw(st.integers(1, 3)), max_pods_per_move=draw(st.integers(1, 4)))
    pods = tuple(f"j-trainer-{i}" for i in range(t)) + tuple(f"j-rollout-{i}" for i in range(r))
    return cfg, Allocation(t, r, pods)


def _apply(alloc: Allocation, move) -> Allocation:
    nxt = alloc.after(move.from_role, move.to_role, move.count)
    pods = tuple(f"j-trainer-{i}" for i in range(nxt.trainer)) + tuple(f"j-rollout-{i}" for i in range(nxt.rollout))
    return Allocation(nxt.trainer, nxt.rollout, pods)


@settings(max_examples=400, deadline=None)
@given(setups(), signals_st)
def test_property_a_move_never_breaks_bounds_or_budget(setup, signals):
    cfg, alloc = setup
    streak = Streak()
    for i in range(cfg.hysteresis):
        d = decide(signals, alloc, cfg, float(i), None, streak)
        streak = d.streak
    if d.move is None:
        return
    assert d.move.count >= 1 and d.move.from_role != d.move.to_role
    after = alloc.after(d.move.from_role, d.move.to_role, d.move.count)
    assert cfg.trainer_min <= after.trainer <= cfg.trainer_max
    assert cfg.rollout_min <= after.rollout <= cfg.rollout_max
    assert (after.trainer + after.rollout) * cfg.gpus_per_pod <= cfg.total_gpus
    assert d.move.victim is not None and d.move.victim.startswith(f"j-{d.move.from_role}-")


@settings(max_examples=400, deadline=None)
@given(setups(), signals_st)
def test_property_constant_input_never_oscillates(setup, signals):
    cfg, alloc = setup
    streak, last, now = Streak(), None, 0.0
    directions = []
    for _ in range(60):
        d = decide(signals, alloc, cfg, now, last, streak)
        streak = d.streak
        if d.move is not None:
            directions.append((d.move.from_role, d.move.to_role))
            alloc = _apply(alloc, d.move)
            last = LastMove(now, d.move.from_role, d.move.to_role)
        now += cfg.cooldown_seconds + 1.0
    assert len(set(directions)) <= 1, directions
    # ...and it settles: the last polls of a constant input make no move.
    d = decide(signals, alloc, cfg, now, last, streak)
    assert d.move is None


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_possible_moves_are_exactly_what_want_can_return(mode: str):
    # possible_moves() pre-creates the rebalance counters: it must name every want, and nothing else.
    cfg = PolicyConfig(**{**CFG.__dict__, "mode": mode})
    seen = set()
    for q in (0, 5, 20, 50):
        for backlog in (0, 10, 200):
            for tail in (False, True):
                for active in (1, 100):
                    for timing in (None, StepTiming(100, 10, 10), StepTiming(10, 1, 100)):
                        w = want(Signals(queue_depth=q, trainer_backlog=backlog, long_tail=tail,
                                         active_sequences=active, step_batch_size=64, last_step=timing), ALLOC, cfg)
                        if w is not None:
                            seen.add((w.from_role, w.to_role, w.reason))
    assert seen == set(possible_moves(mode))


# ---- step timings: move a GPU only where it shortens the step -------------------------------------------

TAIL: dict[str, Any] = {"queue_depth": 0, "long_tail": True, "active_sequences": 3, "step_batch_size": 64}


def test_long_tail_push_needs_a_trainer_that_would_shorten_the_step():
    # sync, 4/4: a trainer pod saves train/(T+1), a rollout pod less costs bulk/(R-1)
    slow_training = StepTiming(rollout_seconds=100, long_tail_seconds=60, train_seconds=100)  # 20 > 1.1 * 13.3
    fast_training = StepTiming(rollout_seconds=100, long_tail_seconds=10, train_seconds=20)   # 4 < 1.1 * 30
    d = one(Signals(**TAIL, last_step=slow_training))
    assert d.move is not None and d.move.reason == "LongTail"
    # with fast training the tail is no reason to shrink rollout; the bulk even asks for another rollout pod
    d = one(Signals(**TAIL, last_step=fast_training))
    assert d.move is not None and (d.move.to_role, d.move.reason) == ("rollout", "StepBalance")
    t = StepTiming(rollout_seconds=100, long_tail_seconds=60, train_seconds=40)  # push 8 < 1.1*13.3, pull 8 < 14.7
    assert want(Signals(**TAIL, last_step=t), ALLOC, CFG) is None


def test_step_balance_pulls_to_rollout_when_rollout_bulk_dominates():
    t = StepTiming(rollout_seconds=300, long_tail_seconds=20, train_seconds=30)  # 280/5 = 56 > 1.1 * 30/3
    d = one(Signals(queue_depth=0, last_step=t))
    assert d.move is not None
    assert (d.move.from_role, d.move.to_role, d.move.reason) == ("trainer", "rollout", "StepBalance")
    assert "300s" in d.move.message


def test_step_balance_holds_near_the_balance_point():
    # sync 4/4: pull needs bulk/5 > 1.1*train/3, push needs train/5 > 1.1*bulk/3: neither holds here
    t = StepTiming(rollout_seconds=110, long_tail_seconds=10, train_seconds=100)
    assert one(Signals(**TAIL, last_step=t)).move is None


def test_async_timing_rules_follow_the_slower_role():
    cfg = PolicyConfig(**{**CFG.__dict__, "mode": "async"})
    trainer_bound = StepTiming(rollout_seconds=50, long_tail_seconds=10, train_seconds=100)
    rollout_bound = StepTiming(rollout_seconds=100, long_tail_seconds=10, train_seconds=50)
    d = one(Signals(**TAIL, trainer_backlog=1, last_step=trainer_bound), cfg=cfg)
    assert d.move is not None and d.move.to_role == "trainer"
    d = one(Signals(**TAIL, trainer_backlog=1, last_step=rollout_bound), cfg=cfg)
    assert d.move is not None and (d.move.to_role, d.move.reason) == ("rollout", "StepBalance")


def test_last_step_parsed_from_coordinator_json():
    s = Signals.from_status({"lastStep": {"rolloutSeconds": 12.5, "longTailSeconds": 4, "trainSeconds": 3}})
    assert s.last_step == StepTiming(12.5, 4.0, 3.0) and s.last_step.bulk_seconds == 8.5
    assert Signals.from_status({"lastStep": {"rolloutSeconds": "x"}}).last_step is None
    assert Signals.from_status({}).last_step is None
