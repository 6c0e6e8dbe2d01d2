"""Trainer death: the coordinator's recovery decision (runtime/coordinator/recovery.py)."""

from __future__ import annotations

from specrl.runtime.coordinator.recovery import Action, TrainerHealth, plan_recovery

CKPT = "/ckpt/step-000010"


def h(name: str, alive: bool = True, version: int = 12, torn: bool = False) -> TrainerHealth:
    return TrainerHealth(name, alive, version, torn)


def test_a_survivor_on_the_current_version_reseeds_the_group_and_the_step_runs_again():
    plan = plan_recovery([h("t0", alive=False), h("t1")], 12, CKPT)
    assert (plan.action, plan.dead, plan.source) == (Action.CONTINUE, ("t0",), "t1")


def test_a_survivor_that_applied_the_update_counts_the_step_as_trained():
    # the all-reduce completed, the peer died after it: t1 holds the full update of step 12
    plan = plan_recovery([h("t0", alive=False), h("t1", version=13), h("t2", version=12)], 12, CKPT)
    assert (plan.action, plan.source) == (Action.APPLIED, "t1")


def test_a_torn_survivor_is_never_a_source():
    plan = plan_recovery([h("t0", alive=False), h("t1", torn=True), h("t2")], 12, CKPT)
    assert (plan.action, plan.source) == (Action.CONTINUE, "t2")
    plan = plan_recovery([h("t0", alive=False), h("t1", torn=True)], 12, CKPT)
    assert (plan.action, plan.source) == (Action.RESTORE, CKPT)
    assert "t1: v12 torn" in plan.reason


def test_no_survivor_waits_for_a_replacement_then_restores_the_checkpoint():
    dead = [h("t0", alive=False)]
    assert plan_recovery(dead, 12, CKPT).action == Action.WAIT
    plan = plan_recovery(dead, 12, CKPT, joining=["t0"])
    assert (plan.action, plan.source) == (Action.RESTORE, CKPT)


def test_nothing_to_recover_from_fails_with_the_reason():
    plan = plan_recovery([h("t0", alive=False)], 12, None, joining=["t0"])
    assert plan.action == Action.FAIL and plan.source is None
    assert "every trainer died" in plan.reason and "spec.checkpoint.path" in plan.reason


def test_versions_other_than_v_and_v_plus_one_are_not_consistent():
    # a fresh replacement (version 0) that has not copied the group's state is no source
    plan = plan_recovery([h("t0", alive=False), h("t9", version=0)], 12, CKPT)
    assert plan.action == Action.RESTORE
