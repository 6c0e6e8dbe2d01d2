"""Status conditions and patches, the operator's metrics, and its RBAC rules."""

from __future__ import annotations

import subprocess
import sys

from prometheus_client import generate_latest
from specrl.operator import metrics as m
from specrl.operator.rbac import RBAC_RULES
from specrl.operator.status import set_condition, status_patch, transitions

from tests.unit.operator.conditions import require_condition


def test_condition_transition_time_moves_only_on_flips():
    st: dict = {}
    set_condition(st, "Ready", False, "Pending", "0/3", 100.0, 1)
    first = require_condition(st, "Ready")["lastTransitionTime"]
    set_condition(st, "Ready", False, "PodsNotReady", "1/3", 200.0, 2)
    cond = require_condition(st, "Ready")
    assert cond["lastTransitionTime"] == first and cond["reason"] == "PodsNotReady" and cond["observedGeneration"] == 2
    set_condition(st, "Ready", True, "AllPodsRunning", "3/3", 300.0, 2)
    assert require_condition(st, "Ready")["lastTransitionTime"] != first
    set_condition(st, "Degraded", True, "X", "", 300.0, 2)
    set_condition(st, "Complete", True, "Y", "", 300.0, 2)
    assert [c["type"] for c in st["conditions"]] == ["Ready", "Complete", "Degraded"]  # stable order


def test_status_patch_is_minimal_and_deletes_with_null():
    old = {"phase": "Running", "step": 3, "pendingMove": {"victim": "x"}, "kopf": {"progress": {}}}
    new = {"phase": "Running", "step": 4}
    assert status_patch(old, new) == {"step": 4, "pendingMove": None}
    assert status_patch(new, dict(new)) == {}


def test_transitions_post_events_for_phase_and_flipped_conditions_only():
    old: dict = {"phase": "Pending"}
    set_condition(old, "Degraded", False, "Created", "", 0, 1)
    new = {"phase": "Running"}
    set_condition(new, "Degraded", True, "CoordinatorUnreachable", "refused", 1, 1)
    events = transitions(old, new)
    assert [(e.type, e.reason) for e in events] == [("Normal", "PhaseRunning"), ("Warning", "CoordinatorUnreachable")]
    assert transitions(new, new) == []
    # A first condition created False is no transition.
    fresh: dict = {}
    set_condition(fresh, "Suspended", False, "Created", "", 0, 1)
    assert [e.reason for e in transitions({}, fresh)] == []


def _status(phase: str, degraded: tuple[bool, str] | None = None) -> dict:
    st: dict = {"phase": phase,
                "allocation": {"trainer": {"replicas": 2, "gpus": 8}, "rollout": {"replicas": 3, "gpus": 12}}}
    set_condition(st, "Ready", phase == "Running", "AllPodsRunning" if phase == "Running" else "Pending", "", 0, 1)
    if degraded:
        set_condition(st, "Degraded", degraded[0], degraded[1], "", 0, 1)
    return st


def _text() -> str:
    return generate_latest(m.REGISTRY).decode()


def test_metrics_names_and_labels():
    m.forget_job("ns", "j")
    m.observe_job("ns", "j", _status("Running", (False, "AsExpected")))
    m.expect_rebalances("ns", "j", [("trainer", "rollout", "QueueBacklog"), ("rollout", "trainer", "LongTail")])
    m.count_rebalance("ns", "j", "trainer", "rollout", "QueueBacklog")
    m.count_coordinator_error("ns", "j")
    m.RECONCILE_SECONDS.labels("timer").observe(0.01)
    text = _text()
    assert 'specrl_operator_allocation_replicas{rljob="j",rljob_namespace="ns",role="rollout"} 3.0' in text
    assert 'specrl_operator_allocation_gpus{rljob="j",rljob_namespace="ns",role="rollout"} 12.0' in text
    assert 'specrl_operator_allocation_gpus{rljob="j",rljob_namespace="ns",role="trainer"} 8.0' in text
    assert ('specrl_operator_rebalance_total{from_role="trainer",reason="QueueBacklog",rljob="j",rljob_namespace="ns",'
            'to_role="rollout"} 1.0') in text
    # Pre-created at 0: a panel shows 0 rather than "No data", and increase() sees the first move.
    assert ('specrl_operator_rebalance_total{from_role="rollout",reason="LongTail",rljob="j",rljob_namespace="ns",'
            'to_role="trainer"} 0.0') in text
    assert 'specrl_operator_coordinator_errors_total{rljob="j",rljob_namespace="ns"} 1.0' in text
    assert 'specrl_operator_job_condition{condition="Ready",reason="AllPodsRunning",rljob="j",rljob_namespace="ns"} 1.0' in text
    assert 'specrl_operator_job_condition{condition="Degraded",reason="AsExpected",rljob="j",rljob_namespace="ns"} 0.0' in text
    assert "specrl_operator_reconcile_duration_seconds_bucket" in text
    assert 'specrl_operator_jobs{phase="Running"} 1.0' in text and 'specrl_operator_jobs{phase="Failed"} 0.0' in text
    # Counting again only adds; expecting again never resets a count.
    m.expect_rebalances("ns", "j", [("trainer", "rollout", "QueueBacklog")])
    assert m.REGISTRY.get_sample_value("specrl_operator_rebalance_total", {
        "rljob_namespace": "ns", "rljob": "j", "from_role": "trainer", "to_role": "rollout", "reason": "QueueBacklog"}) == 1.0
    m.forget_job("ns", "j")


def test_condition_reason_change_replaces_the_series():
    m.forget_job("ns", "d")
    m.observe_job("ns", "d", _status("Running", (True, "CoordinatorUnreachable")))
    degraded = {"rljob_namespace": "ns", "rljob": "d", "condition": "Degraded"}
    assert m.REGISTRY.get_sample_value("specrl_operator_job_condition",
                                       {**degraded, "reason": "CoordinatorUnreachable"}) == 1.0
    m.observe_job("ns", "d", _status("Running", (False, "AsExpected")))
    assert m.REGISTRY.get_sample_value("specrl_operator_job_condition", {**degraded, "reason": "AsExpected"}) == 0.0
    assert 'reason="CoordinatorUnreachable"' not in _text()  # no stale series under the old reason
    # A status without a condition (e.g. reset after a fixed spec) drops that condition's series.
    m.observe_job("ns", "d", {"phase": "Pending", "conditions": []})
    assert 'rljob="d"' not in "".join(line for line in _text().splitlines() if "job_condition" in line)
    m.forget_job("ns", "d")


def test_forget_job_drops_every_series_of_the_job_only():
    for job in ("gone", "kept"):
        m.observe_job("ns", job, _status("Running", (True, "ImmutableFieldChanged")))
        m.expect_rebalances("ns", job, [("rollout", "trainer", "LongTail")])
        m.count_coordinator_error("ns", job)
    m.forget_job("ns", "gone")
    text = _text()
    assert 'rljob="gone"' not in text
    for family in ("allocation_replicas", "allocation_gpus", "job_condition", "rebalance_total",
                   "coordinator_errors_total"):
        assert any(line.startswith(f"specrl_operator_{family}{{") and 'rljob="kept"' in line
                   for line in text.splitlines()), family
    assert 'specrl_operator_jobs{phase="Running"} 1.0' in text
    m.forget_job("ns", "kept")
    assert 'rljob="kept"' not in _text()


def test_rbac_rules_cover_every_write_the_operator_makes():
    verbs = {(g, r): set(rule["verbs"]) for rule in RBAC_RULES for g in rule["apiGroups"] for r in rule["resources"]}
    assert {"create", "delete", "list", "watch"} <= verbs[("", "pods")]
    assert {"create", "patch"} <= verbs[("", "configmaps")]
    assert {"get", "create"} <= verbs[("", "secrets")] and "list" not in verbs[("", "secrets")]
    assert {"create"} <= verbs[("", "services")] and {"create"} <= verbs[("", "events")]
    assert {"get", "list", "watch", "patch"} <= verbs[("specrl.io", "rljobs")]
    assert {"patch"} <= verbs[("specrl.io", "rljobs/status")]


def test_rbac_lets_children_block_their_owners_deletion():
    # Under OwnerReferencesPermissionEnforcement (OpenShift's default) an ownerReference with
    # blockOwnerDeletion is admitted only from who may update the owner's finalizers; else every create is a 422.
    from specrl.operator.children import Owner

    assert Owner("job", "ns", "uid").reference()["blockOwnerDeletion"] is True
    verbs = {(g, r): set(rule["verbs"]) for rule in RBAC_RULES for g in rule["apiGroups"] for r in rule["resources"]}
    assert "update" in verbs.get(("specrl.io", "rljobs/finalizers"), set())


def test_operator_imports_no_torch():
    code = ("import sys, specrl.operator.main, specrl.operator.handlers; "
            "bad = [m for m in ('torch', 'transformers', 'ray') if m in sys.modules]; print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=60)
