"""Pure fault classification (operator/faults.py), the coordinator /status model and the Ready guard."""

from __future__ import annotations

import math

import pytest
from specrl.operator import faults
from specrl.operator.coordinator_client import CoordinatorStatus, InvalidStatus
from specrl.operator.rebalance import Allocation, PolicyConfig, Signals, decide
from specrl.operator.status import now_iso

T = 1_700_000_000.0


def test_disruptions_are_told_from_failures():
    assert faults.disruption_of({"conditions": [{"type": "DisruptionTarget", "status": "True",
                                                 "reason": "PreemptionByScheduler"}]}) == "PreemptionByScheduler"
    assert faults.disruption_of({"phase": "Failed", "reason": "Evicted",
                                 "message": "The node was low on resource: memory."}) == "Evicted"
    assert faults.disruption_of({"conditions": [{"type": "DisruptionTarget", "status": "False"}]}) == ""
    assert faults.disruption_of({"phase": "Failed", "reason": "OOMKilled"}) == ""


def test_waiting_reasons_skip_normal_startup():
    pulling = {"containerStatuses": [{"state": {"waiting": {"reason": "ImagePullBackOff", "message": "no such image"}}}]}
    assert faults.waiting_of(pulling) == "ImagePullBackOff: no such image"
    assert faults.waiting_of({"containerStatuses": [{"state": {"waiting": {"reason": "ContainerCreating"}}}]}) == ""
    unsched = {"conditions": [{"type": "PodScheduled", "status": "False", "reason": "Unschedulable",
                               "message": "0/4 nodes have free nvidia.com/gpu"}]}
    assert faults.waiting_of(unsched).startswith("Unschedulable: 0/4 nodes")


def test_node_lost_after_grace_or_when_gone():
    def node(status: str, since: float) -> dict:
        return {"metadata": {"name": "n"}, "status": {"conditions": [
            {"type": "Ready", "status": status, "lastTransitionTime": now_iso(since)}]}}
    assert faults.node_lost(node("True", T - 999), T, 60) == ""
    assert faults.node_lost(node("Unknown", T - 30), T, 60) == ""
    assert "NotReady" in faults.node_lost(node("Unknown", T - 61), T, 60)
    assert faults.node_lost(None, T, 60) == "the node no longer exists"


def test_deadlines():
    kw: dict = {"now": T, "startup_deadline": 600, "progress_deadline": 300, "step": 4}
    assert faults.deadline_problem(phase="Pending", pending_since=T - 599, progress_at=None, **kw) is None
    d = faults.deadline_problem(phase="Pending", pending_since=T - 601, progress_at=None,
                                waiting=["j-trainer-0: Unschedulable: no GPU"], **kw)
    assert d is not None and d.reason == "StartupDeadlineExceeded" and "Unschedulable" in d.message
    d = faults.deadline_problem(phase="Running", pending_since=T - 9999, progress_at=T - 301, **kw)
    assert d is not None and d.reason == "ProgressDeadlineExceeded" and "step 4" in d.message
    assert faults.deadline_problem(phase="Running", pending_since=None, progress_at=T - 9999,
                                   **{**kw, "progress_deadline": 0}) is None  # 0 disables
    assert [faults.create_delay(n, 5, 300) for n in (1, 2, 3, 10)] == [5, 10, 20, 300]


@pytest.mark.parametrize("bad, field", [
    ({"queueDepth": "lots"}, "queueDepth"),
    ({"tokensPerSecond": math.nan}, "tokensPerSecond"),
    ({"tokensPerSecond": 1e308}, "tokensPerSecond"),
    ({"step": 1e308}, "step"),
    ({"acceptanceLength": math.inf}, "acceptanceLength"),
    ({"workers": [{"state": "active"}]}, "workers.0.name"),
    ({"lastStep": {"rolloutSeconds": -1, "trainSeconds": 1}}, "lastStep.rolloutSeconds"),
])
def test_garbage_status_is_refused_with_the_field(bad, field):
    with pytest.raises(InvalidStatus) as err:
        CoordinatorStatus.parse({"phase": "Rollout", **bad}, "GET http://c/status")
    assert f"invalid status: {field}:" in str(err.value) and "\n" not in str(err.value)


def test_valid_status_keeps_what_the_policy_reads():
    doc = CoordinatorStatus.parse({"phase": "Rollout", "queueDepth": 90, "acceptanceLength": None, "extra": 1,
                                   "workers": [{"name": "j-rollout-0", "role": "rollout", "state": "active"}]}, "x")
    s = Signals.from_status(doc)
    assert s.queue_depth == 90 and s.workers[0].name == "j-rollout-0" and "extra" not in doc
    with pytest.raises(InvalidStatus):
        CoordinatorStatus.parse(["not", "an", "object"], "x")


def test_no_move_while_a_worker_is_not_ready():
    cfg = PolicyConfig(hysteresis=1, cooldown_seconds=0, queue_high_watermark=10)
    sig = Signals(queue_depth=500)
    pods = ("j-trainer-0", "j-trainer-1", "j-rollout-0")
    held = decide(sig, Allocation(2, 1, pods, unready=("j-rollout-0",)), cfg, T)
    assert held.move is None and "not Ready" in held.held
    assert decide(sig, Allocation(2, 1, pods), cfg, T).move is not None
