"""The reconcile loop against in-memory API and coordinator doubles: every branch of the state machine.

The doubles record calls and keep objects like the API server would (create 409 on duplicates, delete
404 when absent); the end-to-end path with real kopf, kubectl and HTTP is in tests/integration/operator.
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
from typing import Any, cast

import pytest
from specrl.operator import children
from specrl.operator import metrics as m
from specrl.operator.coordinator_client import (
    CoordinatorClient,
    CoordinatorError,
    DrainRejected,
    InvalidStatus,
)
from specrl.operator.kube import ApiError, KubeClient
from specrl.operator.rebalance import possible_moves
from specrl.operator.reconcile import OperatorConfig, PodInfo, Runtime, reconcile

from tests.unit.operator.conditions import require_condition

JOB: dict[str, Any] = {
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
        self.refuse: dict[str, ApiError] = {}  # kind -> the error a create of that kind gets
        self.graces: dict[str, int | None] = {}

    async def create(self, obj):
        key = (obj["kind"], obj["metadata"]["name"])
        self.calls.append(("create", *key))
        if obj["kind"] in self.refuse:
            raise self.refuse[obj["kind"]]
        if key in self.objects:
            return False
        self.uid += 1
        self.objects[key] = copy.deepcopy(obj) | {"_uid": f"uid-{self.uid}"}
        return True

    async def delete(self, kind, namespace, name, grace_seconds=None):
        self.calls.append(("delete", kind, name))
        self.graces[name] = grace_seconds
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
                info = PodInfo.from_body(body)
                assert info is not None, name
                out.append(info)
        return out

    def writes(self) -> list[tuple[str, str, str]]:
        return [c for c in self.calls if c[0] != "get"]


class FakeCoord:
    def __init__(self) -> None:
        self.state: dict[str, Any] = {"phase": "Rollout", "queueDepth": 0, "workers": []}
        self.drains: list[str] = []
        self.tokens: list[str] = []
        self.fail = False
        self.error: CoordinatorError | None = None
        self.drain_error: CoordinatorError | None = None
        self.order: list[tuple[str, str]] = []

    async def status(self, namespace, name):
        if self.fail:
            raise CoordinatorError("GET http://x/status: connection refused")
        if self.error is not None:
            raise self.error
        return copy.deepcopy(self.state)

    async def drain(self, namespace, name, worker, token):
        self.tokens.append(token)
        self.drains.append(worker)
        if self.drain_error is not None:
            raise self.drain_error
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
    # The fakes are duck-typed stand-ins for the two clients.
    rt = Runtime(config=OperatorConfig(restart_backoff_base=10, drain_poll=0.01), kube=cast(KubeClient, kube),
                 coord=cast(CoordinatorClient, coord),
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
    assert body["status"]["phase"] == "Running" and require_condition(body["status"], "Ready")["status"] == "True"
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
    assert require_condition(st, "Rebalancing")["status"] == "False"
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
    deg = require_condition(body["status"], "Degraded")
    assert deg["status"] == "True" and deg["reason"] == "CoordinatorUnreachable"
    assert "connection refused" in deg["message"] and coord.drains == []
    coord.fail = False
    coord.state["queueDepth"] = 0
    await run(rt, kube, body)
    assert require_condition(body["status"], "Degraded")["status"] == "False"


async def test_suspend_deletes_workers_and_resume_recreates_them(env):
    rt, kube, _coord, _events, _ = env
    body = copy.deepcopy(JOB)
    await run(rt, kube, body, "create")
    body["spec"]["suspend"] = True
    await run(rt, kube, body, "update")
    assert pod_names(kube) == ["j-coordinator-0"]
    assert body["status"]["phase"] == "Suspended"
    assert require_condition(body["status"], "Suspended")["status"] == "True"
    assert body["status"]["allocation"]["trainer"]["replicas"] == 2  # status kept
    body["spec"]["suspend"] = False
    await run(rt, kube, body, "update")
    assert len(pod_names(kube)) == 5 and body["status"]["phase"] == "Pending"
    assert require_condition(body["status"], "Suspended")["reason"] == "Resumed"


async def test_invalid_cross_field_spec_fails_with_the_field_path_and_creates_nothing(env):
    rt, kube, _coord, _events, _ = env
    body = copy.deepcopy(JOB)
    body["spec"]["resources"]["totalGPUs"] = 3  # 2 + 2 pods x 1 GPU do not fit
    patch = await run(rt, kube, body, "create")
    assert kube.calls == []
    assert patch["phase"] == "Failed"
    failed = require_condition(patch, "Failed")
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
    deg = require_condition(body["status"], "Degraded")
    assert deg["status"] == "True" and deg["reason"] == "ImmutableFieldChanged"
    assert "spec.model" in deg["message"] and "spec.resources.image" in deg["message"]
    assert not [c for c in kube.calls if c[0] in ("create", "delete") and c[1] == "Pod"]
    cm = kube.objects[("ConfigMap", "j-config")]
    assert "builtin:tiny" in cm["data"]["job.yaml"]
    # Reverting clears it.
    body["spec"]["model"]["name"] = "builtin:tiny"
    body["spec"]["resources"]["image"] = JOB["spec"]["resources"].get("image", "ghcr.io/specrl/specrl:0.1.0")
    await run(rt, kube, body, "update")
    assert require_condition(body["status"], "Degraded")["status"] == "False"


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
    failed_cond = require_condition(body["status"], "Failed")
    assert failed_cond["reason"] == "BackoffLimitExceeded" and "backoffLimit 2" in failed_cond["message"]
    assert pod_names(kube) == ["j-coordinator-0"]
    assert any(e[1] == "PodFailed" for e in events)


async def test_completion_releases_workers(env):
    rt, kube, coord, _events, _ = env
    body = copy.deepcopy(JOB)
    await run(rt, kube, body, "create")
    coord.state.update(complete=True, phase="Complete", step=20)
    await run(rt, kube, body)
    assert body["status"]["phase"] == "Complete" and body["status"]["step"] == 20
    assert require_condition(body["status"], "Complete")["status"] == "True"
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
    assert require_condition(st, "Degraded")["status"] == "False"
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


# ---- faults (issue 13): each test injects one fault and asserts the defined outcome -----------------------

async def run_with(rt, kube, body, pods, trigger="timer"):
    """One reconcile over an explicit pod list (the faults a kubelet or the cluster would report)."""
    patch = await reconcile(rt, body, pods, trigger)
    st = body.setdefault("status", {})
    for p in [*kube.status_patches, patch]:
        for k, v in p.items():
            if v is None:
                st.pop(k, None)
            else:
                st[k] = v
    kube.status_patches.clear()
    return patch


def with_pod(kube, name, **changes):
    """The observed pods, with ``name`` changed (phase, disruption, waiting, node, deleting...)."""
    return [dataclasses.replace(p, **changes) if p.name == name else p for p in kube.pods()]


async def running_job(rt, kube, **spec):
    body = copy.deepcopy(JOB)
    body["spec"].update(spec)
    await run(rt, kube, body, "create")
    await run(rt, kube, body)
    assert body["status"]["phase"] == "Running"
    return body


async def test_coordinator_failed_releases_workers_and_sets_conditions_in_the_same_tick(env):
    rt, kube, coord, events, _ = env
    body = await running_job(rt, kube)
    coord.state.update(phase="Failed", step=7)
    await run(rt, kube, body)
    st = body["status"]
    assert st["phase"] == "Failed" and pod_names(kube) == ["j-coordinator-0"]
    assert require_condition(st, "Failed")["reason"] == "CoordinatorFailed"
    assert require_condition(st, "Ready")["status"] == "False"
    assert ("Warning", "PhaseFailed") in [(e[0], e[1]) for e in events]


async def test_a_reconcile_that_waited_for_the_lock_reads_the_job_again(env):
    rt, kube, _coord, _events, _ = env
    body = await running_job(rt, kube)
    stale = copy.deepcopy(body)  # what an update handler captured before a move changed the allocation
    body["status"]["allocation"] = {"trainer": {"replicas": 1, "gpus": 1}, "rollout": {"replicas": 3, "gpus": 3}}
    body["status"]["applied"]["replicas"] = {"trainer": 2, "rollout": 2}
    kube.objects[("RLJob", "j")] = body
    del kube.objects[("Pod", "j-trainer-1")]
    await kube.create(children.pod(_job(), children.Owner("j", "ns", "u-1"), "rollout", 2))
    lock = rt.lock(("ns", "j"))
    await lock.acquire()
    task = asyncio.ensure_future(reconcile(rt, stale, kube.pods(), "update"))
    await asyncio.sleep(0.01)
    lock.release()
    await task
    # Converging the stale body would have deleted j-rollout-2 (undrained) and recreated j-trainer-1.
    assert pod_names(kube) == ["j-coordinator-0", "j-rollout-0", "j-rollout-1", "j-rollout-2", "j-trainer-0"]


def _job():
    from specrl.runtime.api import RLJob
    return RLJob.model_validate({k: JOB[k] for k in ("apiVersion", "kind", "metadata", "spec")}).resolved()


async def test_lost_coordinator_restarts_the_whole_job_once(env):
    rt, kube, _coord, events, clock = env
    body = await running_job(rt, kube, backoffLimit=1)
    uids = {p.name: p.uid for p in kube.pods()}
    # The coordinator pod fails and its workers lose their Ray head in the same moment.
    pods = [dataclasses.replace(p, phase="Failed", reason="Error (exit code 1)") for p in kube.pods()]
    await run_with(rt, kube, body, pods)
    st = body["status"]
    assert st["restarts"] == 1 and st["phase"] == "Pending" and "restarting the coordinator" in st["message"]
    assert pod_names(kube) == []  # everything deleted together, recreated after the backoff
    assert [e[1] for e in events].count("CoordinatorLost") == 1
    await run(rt, kube, body)  # inside the backoff window: nothing counted twice, nothing created
    assert st["restarts"] == 1 and pod_names(kube) == []
    clock.t += 11
    await run(rt, kube, body, phase="Pending")
    assert len(pod_names(kube)) == 5 and all(p.uid != uids[p.name] for p in kube.pods())
    await run(rt, kube, body)
    assert body["status"]["phase"] == "Running" and body["status"]["restarts"] == 1
    # Gone while running (deleted, node lost): one more group restart; backoffLimit 1 is now exceeded.
    await run_with(rt, kube, body, [p for p in kube.pods() if p.role != "coordinator"])
    assert body["status"]["phase"] == "Failed" and pod_names(kube) == ["j-coordinator-0"]


async def test_evicted_coordinator_restarts_the_job_without_counting(env):
    rt, kube, _coord, _events, _ = env
    body = await running_job(rt, kube)
    pods = with_pod(kube, "j-coordinator-0", deleting=True, disruption="EvictionByEvictionAPI")
    await run_with(rt, kube, body, pods)
    st = body["status"]
    assert st.get("restarts") is None and st["disruptions"] == 1 and st["phase"] == "Pending"
    assert "nextRetryTime" not in st and pod_names(kube) == ["j-coordinator-0"]  # still terminating


async def test_evictions_and_preemptions_do_not_count_against_backoff_limit(env):
    rt, kube, _coord, events, _ = env
    body = await running_job(rt, kube, backoffLimit=0)
    for i, reason in enumerate(("EvictionByEvictionAPI", "PreemptionByScheduler", "Evicted")):
        uid = {p.name: p.uid for p in kube.pods()}["j-rollout-1"]
        await run_with(rt, kube, body, with_pod(kube, "j-rollout-1", phase="Failed", disruption=reason))
        st = body["status"]
        assert st["phase"] == "Running" and st.get("restarts") is None and st["disruptions"] == i + 1
        assert "nextRetryTime" not in st
        assert {p.name: p.uid for p in kube.pods()}["j-rollout-1"] != uid  # replaced at once
    assert [e[1] for e in events].count("PodDisrupted") == 3


async def test_pod_on_a_lost_node_is_force_deleted_after_the_grace_period(env):
    rt, kube, _coord, events, clock = env
    rt.config.node_lost_grace = 60
    body = await running_job(rt, kube)
    from specrl.operator.status import now_iso
    node: dict[str, Any] = {"metadata": {"name": "n1"}, "status": {"conditions": [
        {"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
         "lastTransitionTime": now_iso(clock.t - 30)}]}}
    kube.objects[("Node", "n1")] = node
    stuck = with_pod(kube, "j-rollout-1", node="n1", deleting=True, deleted_at=clock.t - 5)
    await run_with(rt, kube, body, stuck)
    assert kube.graces.get("j-rollout-1") is None and "j-rollout-1" in pod_names(kube)  # 30 s < 60 s grace
    clock.t += 31
    await run_with(rt, kube, body, stuck)
    assert kube.graces["j-rollout-1"] == 0  # force-deleted: its fixed name is free again
    assert "j-rollout-1" in pod_names(kube)  # ...and recreated in the same tick
    assert body["status"].get("restarts") is None and body["status"]["disruptions"] == 1
    assert any(e[1] == "NodeLost" for e in events)
    # Phase Unknown (the kubelet stopped reporting) on the lost node: the same.
    kube.graces.clear()
    await run_with(rt, kube, body, with_pod(kube, "j-trainer-0", node="n1", phase="Unknown"))
    assert kube.graces["j-trainer-0"] == 0 and body["status"]["disruptions"] == 2
    # A healthy node: a slow termination is left alone.
    node["status"]["conditions"][0]["status"] = "True"
    kube.graces.clear()
    await run_with(rt, kube, body, with_pod(kube, "j-trainer-0", node="n1", phase="Unknown"))
    assert kube.graces == {}


async def test_waiting_reasons_are_surfaced_and_the_startup_deadline_fails_the_job(env):
    rt, kube, coord, events, clock = env
    body = copy.deepcopy(JOB)
    body["spec"]["startupDeadlineSeconds"] = 600
    await run(rt, kube, body, "create")
    coord.fail = True  # the coordinator never answers while its pod cannot pull its image
    msg = 'ImagePullBackOff: Back-off pulling image "ghcr.io/x/specrl:typo"'
    pods = with_pod(kube, "j-trainer-1", phase="Pending", waiting=msg)
    for _ in range(3):
        await run_with(rt, kube, body, pods)
    ready = require_condition(body["status"], "Ready")
    assert ready["reason"] == "ImagePullBackOff" and "j-trainer-1: ImagePullBackOff" in ready["message"]
    assert [(e[0], e[1]) for e in events].count(("Warning", "ImagePullBackOff")) == 1  # once, not every tick
    clock.t += 601
    await run_with(rt, kube, body, pods)
    st = body["status"]
    assert st["phase"] == "Failed" and require_condition(st, "Failed")["reason"] == "StartupDeadlineExceeded"
    assert "ImagePullBackOff" in st["message"] and pod_names(kube) == ["j-coordinator-0"]


async def test_progress_deadline_fails_a_stalled_job(env):
    rt, kube, coord, _events, clock = env
    body = await running_job(rt, kube, progressDeadlineSeconds=300)
    coord.state["step"] = 1
    clock.t += 200
    await run(rt, kube, body)
    clock.t += 200  # step 1 was reached 200 s ago: within the deadline
    await run(rt, kube, body)
    assert body["status"]["phase"] == "Running"
    coord.fail = True  # and then nothing: the coordinator stops answering
    clock.t += 101
    await run(rt, kube, body)
    st = body["status"]
    assert st["phase"] == "Failed" and require_condition(st, "Failed")["reason"] == "ProgressDeadlineExceeded"
    assert "connection refused" in st["message"] and pod_names(kube) == ["j-coordinator-0"]


async def test_refused_creates_set_a_condition_and_back_off(env):
    rt, kube, _coord, events, _ = env
    rt.config.create_backoff_base = 0.2
    kube.refuse["Pod"] = ApiError(403, "POST", "/api/v1/namespaces/ns/pods", json.dumps(
        {"kind": "Status", "code": 403, "message": 'pods "j-trainer-0" is forbidden: exceeded quota: gpus'}))
    body = copy.deepcopy(JOB)
    await run(rt, kube, body, "create")  # no exception: the reconcile finishes and writes the status
    deg = require_condition(body["status"], "Degraded")
    assert deg["status"] == "True" and deg["reason"] == "FailedCreate" and "exceeded quota" in deg["message"]
    assert any(e[:2] == ("Warning", "FailedCreate") for e in events)
    attempts = sum(1 for c in kube.calls if c[:2] == ("create", "Pod"))
    await run(rt, kube, body)
    assert sum(1 for c in kube.calls if c[:2] == ("create", "Pod")) == attempts  # backing off: no new try
    del kube.refuse["Pod"]
    await asyncio.sleep(0.25)
    await run(rt, kube, body)
    assert len(pod_names(kube)) == 5 and require_condition(body["status"], "Degraded")["status"] == "False"


async def test_invalid_coordinator_status_degrades_and_never_reaches_the_status(env):
    rt, kube, coord, _events, _ = env
    body = await running_job(rt, kube)
    coord.error = InvalidStatus("GET http://x/status: invalid status: queueDepth: Input should be a valid integer")
    await run(rt, kube, body)
    deg = require_condition(body["status"], "Degraded")
    assert deg["status"] == "True" and deg["reason"] == "CoordinatorResponseInvalid" and "queueDepth" in deg["message"]
    coord.error = None
    await run(rt, kube, body)
    assert require_condition(body["status"], "Degraded")["status"] == "False"


async def test_job_level_objects_deleted_by_hand_are_recreated_on_the_next_tick(env):
    rt, kube, _coord, events, _ = env
    body = await running_job(rt, kube)
    token = kube.objects[("Secret", "j-token")]["stringData"]["token"]
    statics = {k for k in kube.objects if k[0] in ("Service", "ConfigMap")}
    kube.calls.clear()
    await reconcile(rt, body, kube.pods(), "timer", statics)
    assert kube.writes() == []  # nothing missing: no request
    del kube.objects[("Service", "j-workers")]
    await reconcile(rt, body, kube.pods(), "timer", statics - {("Service", "j-workers")})
    assert ("Service", "j-workers") in kube.objects and ("create", "Service", "j-workers") in kube.calls
    assert any(e[1] == "ChildRecreated" for e in events)
    # The Secret (not watched): recreated with the token the coordinator holds when a pod or a drain needs it.
    del kube.objects[("Secret", "j-token")]
    pods = with_pod(kube, "j-rollout-0", waiting='CreateContainerConfigError: secret "j-token" not found')
    await reconcile(rt, body, pods, "timer", statics)
    assert kube.objects[("Secret", "j-token")]["stringData"]["token"] == token


async def test_a_drain_the_coordinator_refuses_shows_its_reason(env):
    rt, kube, coord, events, _ = env
    body = await running_job(rt, kube)
    coord.state["workers"] = [{"name": p.name, "role": p.role, "state": "active"}
                              for p in kube.pods() if p.role != "coordinator"]
    await run(rt, kube, body)
    why = "POST http://x/drain -> HTTP 409: j-trainer-1 is the last active trainer worker; the job cannot run without one"
    coord.drain_error = DrainRejected(409, why)
    coord.state["queueDepth"] = 50
    await run(rt, kube, body)
    cond = require_condition(body["status"], "Rebalancing")
    assert (cond["reason"], cond["message"]) == ("DrainRejected", why)
    assert ("Warning", "DrainRejected", why) in [tuple(e[:3]) for e in events]
    assert "j-trainer-1" in pod_names(kube)  # the move is abandoned; the worker keeps running


async def test_a_retired_pod_outside_a_move_is_moved_or_replaced(env):
    rt, kube, coord, _events, _ = env
    body = await running_job(rt, kube)
    workers = [{"name": p.name, "role": p.role, "state": "active"} for p in kube.pods() if p.role != "coordinator"]
    coord.state["workers"] = workers
    await run(rt, kube, body)  # the coordinator lists them as members
    # A drain whose request failed after reaching the coordinator: the move is abandoned...
    coord.drain_error = CoordinatorError("POST http://x/drain: ServerDisconnectedError")
    coord.state["queueDepth"] = 50
    await run(rt, kube, body)
    assert coord.drains == ["j-trainer-1"] and require_condition(body["status"], "Rebalancing")["reason"] == "DrainFailed"
    assert "j-trainer-1" in pod_names(kube)
    # ...but the coordinator retired the worker: its pod would idle on a GPU. The move is finished.
    coord.drain_error = None
    coord.state["queueDepth"] = 0
    coord.state["workers"] = [w | {"state": "retired"} if w["name"] == "j-trainer-1" else w for w in workers]
    await run(rt, kube, body)
    assert pod_names(kube) == ["j-coordinator-0", "j-rollout-0", "j-rollout-1", "j-rollout-2", "j-trainer-0"]
    assert body["status"]["lastRebalance"]["reason"] == "RetiredWorker"
    # A worker the coordinator retired on its own (not drained): replaced in its role.
    uid = {p.name: p.uid for p in kube.pods()}["j-rollout-0"]
    coord.state["workers"] = [{"name": "j-rollout-0", "role": "rollout", "state": "retired"}]
    await run(rt, kube, body)
    assert "j-rollout-0" not in pod_names(kube)
    await run(rt, kube, body)  # recreated by the level-based loop
    assert {p.name: p.uid for p in kube.pods()}["j-rollout-0"] != uid
    # The fresh pod reuses the name and is listed "retired" until it registers: left alone.
    uid = {p.name: p.uid for p in kube.pods()}["j-rollout-0"]
    await run(rt, kube, body)
    assert {p.name: p.uid for p in kube.pods()}["j-rollout-0"] == uid
    # A worker that died is "lost": its pod has already been replaced under the same name (the coordinator
    # reported the old member active while the new pod existed), so nothing is deleted for it.
    coord.state["workers"] = [{"name": "j-rollout-0", "role": "rollout", "state": "active"}]
    await run(rt, kube, body)
    coord.state["workers"] = [{"name": "j-rollout-0", "role": "rollout", "state": "lost"}]
    await run(rt, kube, body)
    assert {p.name: p.uid for p in kube.pods()}["j-rollout-0"] == uid


async def test_no_rebalance_while_a_worker_pod_is_not_ready(env):
    rt, kube, coord, _events, _ = env
    body = await running_job(rt, kube)
    coord.state["queueDepth"] = 50
    await run_with(rt, kube, body, with_pod(kube, "j-rollout-1", phase="Pending", ready=False))
    assert coord.drains == []
    await run(rt, kube, body)
    assert coord.drains == ["j-trainer-1"]


async def test_a_coordinator_evicted_between_two_ticks_is_not_counted(env):
    rt, kube, _coord, _events, _ = env
    body = await running_job(rt, kube, backoffLimit=0)
    coord = next(p for p in kube.pods() if p.role == "coordinator")
    rt.note_disruption(("ns", "j"), dataclasses.replace(coord, disruption="EvictionByEvictionAPI", deleting=True))
    await run_with(rt, kube, body, [p for p in kube.pods() if p.role != "coordinator"])  # gone before a tick saw it
    st = body["status"]
    assert st["phase"] == "Pending" and st.get("restarts") is None and st["disruptions"] == 1


async def test_a_secret_whose_create_failed_is_created_by_a_later_tick(env):
    rt, kube, _coord, _events, _ = env
    rt.config.create_backoff_base = 0.0
    kube.refuse["Secret"] = ApiError(500, "POST", "/api/v1/namespaces/ns/secrets", "etcdserver: request timed out")
    body = copy.deepcopy(JOB)
    await run(rt, kube, body, "create")
    assert ("Secret", "j-token") not in kube.objects
    del kube.refuse["Secret"]
    statics = {k for k in kube.objects if k[0] in ("Service", "ConfigMap")}
    await reconcile(rt, body, kube.pods(), "timer", statics)
    assert ("Secret", "j-token") in kube.objects
    kube.calls.clear()
    await reconcile(rt, body, kube.pods(), "timer", statics)
    assert not [c for c in kube.calls if c[1] == "Secret"]  # seen: no request on later ticks
