"""Status conditions and patches, the operator's metrics, and its RBAC rules."""

from __future__ import annotations

import subprocess
import sys

from prometheus_client import generate_latest
from specrl.operator import metrics as m
from specrl.operator.rbac import RBAC_RULES
from specrl.operator.status import get_condition, set_condition, status_patch, transitions


def test_condition_transition_time_moves_only_on_flips():
    st: dict = {}
    set_condition(st, "Ready", False, "Pending", "0/3", 100.0, 1)
    first = get_condition(st, "Ready")["lastTransitionTime"]
    set_condition(st, "Ready", False, "PodsNotReady", "1/3", 200.0, 2)
    cond = get_condition(st, "Ready")
    assert cond["lastTransitionTime"] == first and cond["reason"] == "PodsNotReady" and cond["observedGeneration"] == 2
    set_condition(st, "Ready", True, "AllPodsRunning", "3/3", 300.0, 2)
    assert get_condition(st, "Ready")["lastTransitionTime"] != first
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


def test_metrics_names_and_labels():
    m.observe_job("ns", "j", "Running", {"trainer": 2, "rollout": 3})
    m.REBALANCES.labels("trainer", "rollout", "QueueBacklog").inc()
    m.RECONCILE_SECONDS.labels("timer").observe(0.01)
    text = generate_latest(m.REGISTRY).decode()
    assert 'specrl_operator_allocation_replicas{job="j",namespace="ns",role="rollout"} 3.0' in text
    assert 'specrl_operator_rebalance_total{from_role="trainer",reason="QueueBacklog",to_role="rollout"}' in text
    assert "specrl_operator_reconcile_duration_seconds_bucket" in text
    assert 'specrl_operator_jobs{phase="Running"}' in text
    m.forget_job("ns", "j")
    assert 'job="j"' not in generate_latest(m.REGISTRY).decode().split("specrl_operator_allocation_replicas")[-1][:200]


def test_rbac_rules_cover_every_write_the_operator_makes():
    verbs = {(g, r): set(rule["verbs"]) for rule in RBAC_RULES for g in rule["apiGroups"] for r in rule["resources"]}
    assert {"create", "delete", "list", "watch"} <= verbs[("", "pods")]
    assert {"create", "patch"} <= verbs[("", "configmaps")]
    assert {"get", "create"} <= verbs[("", "secrets")] and "list" not in verbs[("", "secrets")]
    assert {"create"} <= verbs[("", "services")] and {"create"} <= verbs[("", "events")]
    assert {"get", "list", "watch", "patch"} <= verbs[("specrl.io", "rljobs")]
    assert {"patch"} <= verbs[("specrl.io", "rljobs/status")]


def test_operator_imports_no_torch():
    code = ("import sys, specrl.operator.main, specrl.operator.handlers; "
            "bad = [m for m in ('torch', 'transformers', 'ray') if m in sys.modules]; print(bad); assert not bad")
    subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, timeout=60)
