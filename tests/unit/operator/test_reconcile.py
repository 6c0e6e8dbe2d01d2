"""The reconcile loop against in-memory API and coordinator doubles: every branch of the state machine.

The doubles record calls and keep objects like the API server would (create 409 on duplicates, delete
404 when absent); the end-to-end path with real kopf, kubectl and HTTP is in tests/integration/operator.
"""

from __future__ import annotations

import copy
from typing import Any

import pytest
from specrl.operator import children
from specrl.operator import metrics as m
from specrl.operator.coordinator_client import CoordinatorError
from specrl.operator.rebalance import possible_moves
from specrl.operator.reconcile import OperatorConfig, PodInfo, Runtime, reconcile
from specrl.operator.status import get_condition

JOB = {
    "apiVersion": "specrl.io/v1alpha1",
    "kind": "RLJob",
    "metadata": {"name": "j", "namespace": "ns", "uid": "u-1", "generation": 1},
    "spec": {
        "model": {"name": "builtin:tiny"},
        "resources": {"gpusPerPod": 1, "totalGPUs": 4, "trainer": {"replicas": 2, "minReplicas": 1},
                      "rollout": {"replicas": 2, "minReplicas": 1}},
        "elastic": {"enabled": True, "cooldownSeconds": 0, "hysteresis": 1, "queueHighWatermark": 10,
                    "queueLowWatermark": 0, "drainTimeoutSeconds": 5},
        "backoffLimit": 2,
    },
}


class FakeKube:
    def __init__(self) -> None:
        self.objects: dict[tuple[str, str], dict[str, Any]] = {}
        self.calls: list[tuple[str, str, str]] = []
        self.status_patches: list[dict[str, Any]] = []
        self.uid = 0

    async def create(self, obj):
        key = (obj["kind"], obj["metadata"]["name"])
        self.calls.append(("create", *key))
        if key in self.objects:
            return False
        self.uid += 1
        self.objects[key] = copy.deepcopy(obj) | {"_uid": f"uid-{self.uid}"}
        return True

    async def delete(self, kind, namespace, name, grace_seconds=None):
        self.calls.append(("delete", kind, name))
        return self.objects.pop((kind, name), None) is not None

    async def get(self, kind, namespace, name):
        return self.objects.get((kind, name))

    async def patch(self, kind, namespace, name, body):
        self.calls.append(("patch", kind, name))

    async def patch_status(self, kind, namespace, name, status):
        self.calls.append(("patch_status", kind, name))
        self.status_patches.append(copy.deepcopy(status))

    def pods(self, phase: str = "Running") -> list[PodInfo]:
        out = []
        for (kind, name), obj in self.objects.items():
            if kind == "Pod":
                ready = {"type": "Ready", "status": "True" if phase == "Running" else "False"}
                body = {**obj, "metadata": {**obj["metadata"], "uid": obj["_uid"]},
                        "status": {"phase": phase, "conditions": [ready]}}
                out.append(PodInfo.from_body(body))
        return out

    def writes(self) -> list[tuple[str, str, str]]:
        return [c for c in self.calls if c[0] != "get"]


class FakeCoord:
    def __init__(self) -> None:
        self.state: dict[str, Any] = {"phase": "Rollout", "queueDepth": 0, "workers": []}
        self.drains: list[str] = []
        self.tokens: list[str] = []
        self.fail = False
        self.order: list[tuple[str, str]] = []

    async def status(self, namespace, name):
        if self.fail:
            raise CoordinatorError("GET http://x/status: connection refused")
        return copy.deepcopy(self.state)

    async def drain(self, namespace, name, worker, token):
        self.tokens.append(token)
        self.drains.append(worker)
        return "draining"

    def backing_off(self, namespace, name, now=None):
        return None

    def forget(self, namespace, name):
        pass


class Clock:
    def __init__(self) -> None:
        self.t = 1_000_000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def env():
    kube, coord, events, clock = FakeKube(), FakeCoord(), [], Clock()
    rt = Runtime(config=OperatorConfig(restart_backoff_base=10, drain_poll=0.01), kube=kube, coord=coord,
                 emit=lambda body, t, reason, msg: events.append((t, reason, msg)), clock=clock)
    m.forget_job("ns", "j")
    yield rt, kube, coord, events, clock
    m.forget_job("ns", "j")


async def run(rt, kube, body, trigger="timer", phase="Running"):
    patch = await reconcile(rt, body, kube.pods(phase), trigger)
    body.setdefault("status", {})
    for k, v in patch.items():
        if v is None:
            body["status"].pop(k, None)
        else:
            body["status"][k] = v
    for p in kube.status_patches:
        for k, v in p.items():
            if v is None:
                body["status"].pop(k, None)
            else:
                body["status"][k] = v
    kube.status_patches.clear()
    return patch


def pod_names(kube):
    return sorted(n for k, n in kube.objects if k == "Pod")


async def test_create_builds_every_child_once_and_reports_pending(env):
    rt, kube, _coord, events, _ = env
    body = copy.deepcopy(JOB)
    patch = await run(rt, kube, body, "create")
    assert pod_names(kube) == ["j-coordinator-0", "j-rollout-0", "j-rollout-1", "j-trainer-0", "j-trainer-1"]
    assert len(kube.writes()) == 4 + 5
    assert patch["phase"] == "Pending" and patch["allocation"]["rollout"] == {"replicas": 2, "gpus": 2}
    assert [e[1] for e in events] == ["PhasePending"]
    # The same trigger again: the job-level objects answer 409, nothing is duplicated, status unchanged.
    kube.calls.clear()
    patch = await run(rt, kube, body, "resume", phase="Pending")
    assert not [c for c in kube.calls if c[0] == "create" and c[1] == "Pod"]
    assert patch == {}


async def test_timer_with_nothing_to_change_writes_nothing(env):
    rt, kube, _coord, _events, clock = env
    body = copy.deepcopy(JOB)
    await run(rt, kube, body, "create")
    await run(rt, kube, body)  # Pending -> Running (coordinator answered)
    assert body["status"]["phase"] == "Running" and get_condition(body["status"], "Ready")["status"] == "True"
    kube.calls.clear()
    for _ in range(10):
        clock.t += 10
        assert await run(rt, kube, body) == {}
    assert kube.writes() == []


async def test_queue_backlog_moves_a_trainer_to_rollout_draining_first(env):
    rt, kube, coord, events, _clock = env
    body = copy.deepcopy(JOB)
    await run(rt, kube, body, "create")
    await run(rt, kube, body)
    coord.state["queueDepth"] = 50  # > 10 per worker x 2
    kube.calls.clear()
    await run(rt, kube, body)
    assert coord.drains == ["j-trainer-1"]
    assert coord.tokens == [kube.objects[("Secret", "j-token")]["stringData"]["token"]] and coord.tokens[0]
    assert pod_names(kube) == ["j-coordinator-0", "j-rollout-0", "j-rollout-1", "j-rollout-2", "j-trainer-0"]
    deletes = [i for i, c in enumerate(kube.calls) if c[0] == "delete"]
    creates = [i for i, c in enumerate(kube.calls) if c[0] == "create"]
    assert deletes and creates and deletes[0] < creates[0]
    st = body["status"]
    assert st["allocation"] == {"trainer": {"replicas": 1, "gpus": 1}, "rollout": {"replicas": 3, "gpus": 3}}
    assert st["lastRebalance"]["reason"] == "QueueBacklog" and st["lastRebalance"]["toRole"] == "rollout"
    assert st.get("pendingMove") is None
    assert get_condition(st, "Rebalancing")["status"] == "False"
    reasons = [e[1] for e in events]
    assert "QueueBacklog" in reasons and "MoveComplete" in reasons  # Rebalancing True then False
    # At the trainer minimum (1) no further move happens.
    kube.calls.clear()
    await run(rt, kube, body)
    assert coord.drains == ["j-trainer-1"] and kube.writes() == []


async def test_unreachable_coordinator_degrades_and_makes_no_move(env):
    rt, kube, coord, _events, _ = env
    body = copy.deepcopy(JOB)
    await run(rt, kube, body, "create")
    await run(rt, kube, body)
    coord.fail = True
    coord.state["queueDepth"] = 500
    await run(rt, kube, body)
    deg = get_condition(body["status"], "Degraded")
    assert deg["status"] == "True" and deg["reason"] == "CoordinatorUnreachable"
    assert "connection refused" in deg["message"] and coord.drains == []
    coord.fail = False
    coord.state["queueDepth"] = 0
    await run(rt, kube, body)
    assert get_condition(body["status"], "Degraded")["status"] == "False"


async def test_suspend_deletes_workers_and_resume_recreates_them(env):
    rt, kube, _coord, _events, _ = env
    body = copy.deepcopy(JOB)
    await run(rt, kube, body, "create")
    body["spec"]["suspend"] = True
    await run(rt, kube, body, "update")
    assert pod_names(kube) == ["j-coordinator-0"]
    assert body["status"]["phase"] == "Suspended"
    assert get_condition(body["status"], "Suspended")["status"] == "True"
    assert body["status"]["allocation"]["trainer"]["replicas"] == 2  # status kept
    body["spec"]["suspend"] = False
    await run(rt, kube, body, "update")
    assert len(pod_names(kube)) == 5 and body["status"]["phase"] == "Pending"
    assert get_condition(body["status"], "Suspended")["reason"] == "Resumed"


async def test_invalid_cross_field_spec_fails_with_the_field_path_and_creates_nothing(env):
    rt, kube, _coord, _events, _ = env
    body = copy.deepcopy(JOB)
    body["spec"]["resources"]["totalGPUs"] = 3  # 2 + 2 pods x 1 GPU do not fit
    patch = await run(rt, kube, body, "create")
    assert kube.calls == []
    assert patch["phase"] == "Failed"
    failed = get_condition(patch, "Failed")
    assert failed["reason"] == "InvalidSpec" and "spec.resources.totalGPUs" in failed["message"]
    # Fixing the spec recovers the job.
    body["spec"]["resources"]["totalGPUs"] = 4
    await run(rt, kube, body, "update")
    assert len(pod_names(kube)) == 5 and body["status"]["phase"] == "Pending"


async def test_immutable_model_change_is_rejected_with_a_condition(env):
    rt, kube, _coord, _events, _ = env
    body = copy.deepcopy(JOB)
    await run(rt, kube, body, "create")
    body["spec"]["model"]["name"] = "builtin:bench"
    body["spec"]["resources"]["image"] = "other:1"
    kube.calls.clear()
    await run(rt, kube, body, "update")
    deg = get_condition(body["status"], "Degraded")
    assert deg["status"] == "True" and deg["reason"] == "ImmutableFieldChanged"
    assert "spec.model" in deg["message"] and "spec.resources.image" in deg["message"]
    assert not [c for c in kube.calls if c[0] in ("create", "delete") and c[1] == "Pod"]
    cm = kube.objects[("ConfigMap", "j-config")]
    assert "builtin:tiny" in cm["data"]["job.yaml"]
    # Reverting clears it.
    body["spec"]["model"]["name"] = "builtin:tiny"
    body["spec"]["resources"]["image"] = JOB["spec"]["resources"].get("image", "ghcr.io/specrl/specrl:0.1.0")
    await run(rt, kube, body, "update")
    assert get_condition(body["status"], "Degraded")["status"] == "False"


async def test_pod_failures_back_off_then_fail_the_job(env):
    rt, kube, _coord, events, clock = env
    body = copy.deepcopy(JOB)
    await run(rt, kube, body, "create")
    delays = []
    for attempt in range(1, 4):
        failed = [p for p in kube.pods() if p.name == "j-rollout-1"]
        assert failed, f"attempt {attempt}: j-rollout-1 was not recreated"
        others = [p for p in kube.pods() if p.name != "j-rollout-1"]
        bad = PodInfo(failed[0].name, "rollout", 1, failed[0].uid, "Failed", False, "Error (exit code 1)")
        patch = await reconcile(rt, body, [*others, bad], "timer")
        body["status"].update({k: v for k, v in patch.items() if v is not None})
        for p in kube.status_patches:
            body["status"].update({k: v for k, v in p.items() if v is not None})
        kube.status_patches.clear()
        if attempt <= 2:
            assert "j-rollout-1" not in pod_names(kube)
            assert body["status"]["restarts"] == attempt
            delays.append(body["status"]["nextRetryTime"])
            await run(rt, kube, body)  # inside the backoff window: not recreated yet
            assert "j-rollout-1" not in pod_names(kube)
            clock.t += 10 * 2 ** (attempt - 1) + 1
            await run(rt, kube, body)
            assert "j-rollout-1" in pod_names(kube)
    assert body["status"]["phase"] == "Failed"
    failed = get_condition(body["status"], "Failed")
    assert failed["reason"] == "BackoffLimitExceeded" and "backoffLimit 2" in failed["message"]
    assert pod_names(kube) == ["j-coordinator-0"]
    assert any(e[1] == "PodFailed" for e in events)


async def test_completion_releases_workers(env):
    rt, kube, coord, _events, _ = env
    body = copy.deepcopy(JOB)
    await run(rt, kube, body, "create")
    coord.state.update(complete=True, phase="Complete", step=20)
    await run(rt, kube, body)
    assert body["status"]["phase"] == "Complete" and body["status"]["step"] == 20
    assert get_condition(body["status"], "Complete")["status"] == "True"
    assert pod_names(kube) == ["j-coordinator-0"]


async def test_pending_move_is_finished_after_a_restart(env):
    rt, kube, _coord, _events, _ = env
    body = copy.deepcopy(JOB)
    await run(rt, kube, body, "create")
    await run(rt, kube, body)
    # An operator died after recording the move and creating the new pod, before deleting the victim.
    body["status"]["pendingMove"] = {"victim": "j-trainer-1", "newPod": "j-rollout-2", "fromRole": "trainer",
                                     "toRole": "rollout", "reason": "QueueBacklog", "startedAt": "x"}
    await kube.create(children.pod(__import__("specrl.runtime.api", fromlist=["RLJob"]).RLJob.model_validate(
        {k: JOB[k] for k in ("apiVersion", "kind", "metadata", "spec")}).resolved(),
        children.Owner("j", "ns", "u-1"), "rollout", 2))
    await run(rt, kube, body, "resume")
    assert pod_names(kube) == ["j-coordinator-0", "j-rollout-0", "j-rollout-1", "j-rollout-2", "j-trainer-0"]
    assert body["status"]["allocation"]["rollout"]["replicas"] == 3 and body["status"].get("pendingMove") is None


async def test_spec_replica_edit_wins_over_rebalanced_allocation(env):
    rt, kube, _coord, _events, _ = env
    body = copy.deepcopy(JOB)
    await run(rt, kube, body, "create")
    body["spec"]["resources"]["trainer"]["replicas"] = 1
    body["spec"]["resources"]["rollout"]["replicas"] = 3
    await run(rt, kube, body, "update")
    assert pod_names(kube) == ["j-coordinator-0", "j-rollout-0", "j-rollout-1", "j-rollout-2", "j-trainer-0"]


async def test_coordinator_not_up_yet_keeps_the_job_pending_not_degraded(env):
    rt, kube, coord, events, _ = env
    body = copy.deepcopy(JOB)
    await run(rt, kube, body, "create")
    coord.fail = True
    await run(rt, kube, body)
    st = body["status"]
    assert st["phase"] == "Pending" and "waiting for the coordinator" in st["message"]
    assert get_condition(st, "Degraded")["status"] == "False"
    assert not [e for e in events if e[0] == "Warning"]


def sample(name: str, **labels: str) -> float | None:
    return m.REGISTRY.get_sample_value(name, {"rljob_namespace": "ns", "rljob": "j", **labels})


def job_series(name: str) -> list[dict[str, str]]:
    return [dict(s.labels) for fam in m.REGISTRY.collect() for s in fam.samples
            if s.name == name and s.labels.get("rljob") == "j" and s.labels.get("rljob_namespace") == "ns"]


async def test_metrics_follow_the_status_and_count_moves(env):
    rt, kube, coord, _events, _ = env
    body = copy.deepcopy(JOB)
    body["spec"]["resources"].update(gpusPerPod=2, totalGPUs=8)
    await run(rt, kube, body, "create")
    assert sample("specrl_operator_allocation_replicas", role="rollout") == 2
    assert sample("specrl_operator_allocation_gpus", role="rollout") == 4
    assert sample("specrl_operator_job_condition", condition="Ready", reason="Pending") == 0
    # Every move a sync job can make exists at 0 from the first reconcile on; async-only reasons do not.
    moves = {(s["from_role"], s["to_role"], s["reason"]) for s in job_series("specrl_operator_rebalance_total")}
    assert moves == set(possible_moves("sync")) and ("trainer", "rollout", "TrainerStarved") not in moves
    assert sample("specrl_operator_rebalance_total", from_role="trainer", to_role="rollout",
                  reason="QueueBacklog") == 0
    await run(rt, kube, body)
    assert sample("specrl_operator_job_condition", condition="Ready", reason="AllPodsRunning") == 1
    coord.state["queueDepth"] = 50
    await run(rt, kube, body)
    assert sample("specrl_operator_rebalance_total", from_role="trainer", to_role="rollout",
                  reason="QueueBacklog") == 1
    assert sample("specrl_operator_rebalance_total", from_role="rollout", to_role="trainer", reason="LongTail") == 0
    assert (sample("specrl_operator_allocation_gpus", role="trainer"),
            sample("specrl_operator_allocation_gpus", role="rollout")) == (2, 6)
    assert sample("specrl_operator_job_condition", condition="Rebalancing", reason="MoveComplete") == 0


async def test_async_job_precreates_the_async_only_moves_too(env):
    rt, kube, _coord, _events, _ = env
    body = copy.deepcopy(JOB)
    body["spec"]["mode"] = "async"
    await run(rt, kube, body, "create")
    moves = {(s["from_role"], s["to_role"], s["reason"]) for s in job_series("specrl_operator_rebalance_total")}
    assert moves == set(possible_moves("async")) and ("rollout", "trainer", "TrainerBacklog") in moves


async def test_degraded_condition_metric_tracks_reason_and_recovery(env):
    rt, kube, coord, _events, _ = env
    body = copy.deepcopy(JOB)
    await run(rt, kube, body, "create")
    await run(rt, kube, body)
    assert sample("specrl_operator_coordinator_errors_total") == 0
    coord.fail = True
    await run(rt, kube, body)
    degraded = [s for s in job_series("specrl_operator_job_condition") if s["condition"] == "Degraded"]
    assert [d["reason"] for d in degraded] == ["CoordinatorUnreachable"]
    assert sample("specrl_operator_job_condition", condition="Degraded", reason="CoordinatorUnreachable") == 1
    assert sample("specrl_operator_coordinator_errors_total") == 1
    coord.fail = False
    await run(rt, kube, body)
    degraded = [s for s in job_series("specrl_operator_job_condition") if s["condition"] == "Degraded"]
    assert [d["reason"] for d in degraded] == ["AsExpected"]  # the old reason's series is gone
    assert sample("specrl_operator_job_condition", condition="Degraded", reason="AsExpected") == 0


async def test_a_reconcile_of_a_deleted_job_does_not_revive_its_series(env):
    rt, kube, _coord, _events, _ = env
    body = copy.deepcopy(JOB)
    await run(rt, kube, body, "create")
    m.forget_job("ns", "j")  # what the delete handler does
    body["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    await run(rt, kube, body)
    assert job_series("specrl_operator_allocation_replicas") == []
    assert job_series("specrl_operator_rebalance_total") == []
