"""Cluster faults against the real operator (kopf subprocess), the API emulator with nodes and kubelets
(tests/kube/nodes.py), the fake coordinator and the real kubectl: each test injects one fault and asserts the
outcome defined in operator/README.md ("What happens when..."). One operator process serves every test.
"""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any

import pytest

from .conftest import PODS, KubeEnv, OperatorProcess, wait_for
from .test_operator_e2e import apply, condition, namespace, role_counts, small_job, status

pytestmark = pytest.mark.integration

ELASTIC = {"enabled": True, "cooldownSeconds": 0, "hysteresis": 1, "queueHighWatermark": 8, "drainTimeoutSeconds": 30}
RESOURCES = {"gpusPerPod": 1, "totalGPUs": 4, "trainer": {"replicas": 2, "minReplicas": 1},
             "rollout": {"replicas": 2, "minReplicas": 1}}


def running(kube: KubeEnv, ns: str, name: str, **spec: Any) -> dict[str, Any]:
    """Apply a job, answer its /status, wait until it runs with every pod Ready; returns its pods."""
    namespace(kube, ns)
    kube.coordinator.set(ns, name)
    apply(kube, small_job(name, ns, **spec))
    wait_for(lambda: status(kube, ns, name).get("phase") == "Running"
             and condition(status(kube, ns, name), "Ready").get("status") == "True", 30, f"{ns}/{name} Running, Ready")
    return kube.pods(ns, name)


def events(kube: KubeEnv, ns: str) -> list[dict[str, Any]]:
    return sorted(kube.objects("v1/events", ns).values(), key=lambda e: int(e["metadata"]["resourceVersion"]))


def kubelet_reports(kube: KubeEnv, ns: str, pod: str, st: dict[str, Any]) -> None:
    kube.kubectl("patch", "pod", pod, "-n", ns, "--subresource=status", "--type=merge", "-p", json.dumps({"status": st}))


def uid(kube: KubeEnv, ns: str, job: str, pod: str) -> str | None:
    p = kube.pods(ns, job).get(pod)
    return p["metadata"]["uid"] if p else None


def test_coordinator_reports_failed_workers_released_in_the_same_tick(kube: KubeEnv, operator: OperatorProcess):
    ns, name = "f-failed", "job"
    running(kube, ns, name)
    kube.coordinator.set(ns, name, phase="Failed")
    t0 = time.monotonic()
    st = wait_for(lambda: (s := status(kube, ns, name)).get("phase") == "Failed" and s, 20, "phase Failed")
    wait_for(lambda: role_counts(kube, ns, name) == {"trainer": 0, "rollout": 0, "coordinator": 1}, 5,
             "worker pods deleted (GPUs released)")
    released = time.monotonic() - t0
    assert condition(st, "Failed")["reason"] == "CoordinatorFailed"
    assert condition(st, "Ready") == condition(st, "Ready") | {"status": "False", "reason": "CoordinatorFailed"}
    assert released < 3, released
    assert any(e["reason"] == "PhaseFailed" and e["type"] == "Warning" for e in events(kube, ns))


def test_garbage_status_degrades_and_never_reaches_the_status(kube: KubeEnv, operator: OperatorProcess):
    ns, name = "f-garbage", "job"
    running(kube, ns, name)
    # The three responses that crashed the tick or poisoned the status before (other shapes: unit tests).
    for raw in ('{"phase": "Rollout", "queueDepth": "lots"}', '{"phase": "Rollout", "tokensPerSecond": NaN}',
                '{"phase": "Rollout", "step": 1e308, "tokensPerSecond": 1e308}'):
        kube.coordinator.raw[(ns, name)] = raw
        deg = wait_for(lambda: (c := condition(status(kube, ns, name), "Degraded")).get("status") == "True" and c,
                       15, f"Degraded for {raw}")
        assert deg["reason"] == "CoordinatorResponseInvalid", deg
        out = kube.kubectl("get", "rlj", name, "-n", ns, "-o", "json").stdout  # the status stays valid JSON
        st = json.loads(out)["status"]
        assert st["rollout"]["tokensPerSecond"] == 1000 and st["step"] == 1
        kube.coordinator.raw.pop((ns, name))
        wait_for(lambda: condition(status(kube, ns, name), "Degraded").get("status") == "False", 15, "recovered")
    assert operator.proc is not None and operator.proc.poll() is None
    assert "invalid status: queueDepth" in operator.log.read_text() or any(
        "queueDepth" in e["message"] for e in events(kube, ns))


def test_job_level_objects_deleted_by_hand_come_back(kube: KubeEnv, operator: OperatorProcess):
    ns, name = "f-children", "job"
    running(kube, ns, name, resources=RESOURCES, elastic=ELASTIC)
    token = kube.objects("v1/secrets", ns)[f"{name}-token"]["stringData"]["token"]
    for resource, obj in (("svc", f"{name}-workers"), ("svc", f"{name}-coordinator"), ("configmap", f"{name}-config")):
        plural = {"svc": "v1/services", "configmap": "v1/configmaps"}[resource]
        old = kube.objects(plural, ns)[obj]["metadata"]["uid"]
        kube.kubectl("delete", resource, obj, "-n", ns)
        t0 = time.monotonic()
        wait_for(lambda: (o := kube.objects(plural, ns).get(obj)) and o["metadata"]["uid"] != old, 10,  # noqa: B023
                 f"{obj} recreated")
        assert time.monotonic() - t0 < 5
    # The Secret is not watched: it comes back with the same token when the next drain needs it.
    kube.kubectl("delete", "secret", f"{name}-token", "-n", ns)
    kube.coordinator.set(ns, name, queueDepth=100)
    wait_for(lambda: (status(kube, ns, name).get("lastRebalance") or {}).get("reason") == "QueueBacklog", 20,
             "a move whose drain was authenticated")
    assert kube.objects("v1/secrets", ns)[f"{name}-token"]["stringData"]["token"] == token
    assert any(e["reason"] == "ChildRecreated" for e in events(kube, ns))


def test_quota_and_admission_refusals_set_a_condition_and_back_off(kube: KubeEnv, operator: OperatorProcess):
    ns, name = "f-quota", "job"
    namespace(kube, ns)
    path = f"/api/v1/namespaces/{ns}/pods"
    quota = f'pods "{name}-trainer-0" is forbidden: exceeded quota: gpu-quota, requested: nvidia.com/gpu=1, used: 8'
    kube.emulator.refuse[("POST", path)] = (403, "Forbidden", quota)
    try:
        kube.coordinator.set(ns, name)
        apply(kube, small_job(name, ns))
        deg = wait_for(lambda: (c := condition(status(kube, ns, name), "Degraded")).get("reason") == "FailedCreate"
                       and c, 15, "Degraded=True, FailedCreate")
        assert deg["status"] == "True" and "exceeded quota" in deg["message"]
        before = len(kube.requests())
        time.sleep(2.4)  # eight timer ticks at 0.3 s: the backoff (0.5, 1, 2 s...) allows two or three tries
        attempts = [r for r in kube.requests()[before:] if str(r.url.path) == path]
        assert 0 < len(attempts) <= 3 * 3, len(attempts)  # at most 3 tries of 3 pods, not 8
        kube.emulator.refuse[("POST", path)] = (422, "Invalid", 'admission webhook "gpu.policy" denied the request')
        wait_for(lambda: "denied the request" in condition(status(kube, ns, name), "Degraded").get("message", ""),
                 15, "the 422 reported")
    finally:
        kube.emulator.refuse.pop(("POST", path), None)
    wait_for(lambda: role_counts(kube, ns, name) == {"trainer": 1, "rollout": 1, "coordinator": 1}, 20,
             "pods created once the quota allows")
    wait_for(lambda: condition(status(kube, ns, name), "Degraded").get("status") == "False", 15, "Degraded cleared")
    warnings = [e for e in events(kube, ns) if e["reason"] == "FailedCreate"]
    assert warnings and all(e["type"] == "Warning" for e in warnings)


def evict(kube: KubeEnv, ns: str, pod: str) -> None:
    """POST the policy/v1 Eviction that `kubectl drain` sends (as JSON: kubectl itself sends protobuf)."""
    body = json.dumps({"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": pod, "namespace": ns}})
    req = urllib.request.Request(f"http://127.0.0.1:{kube.port}/api/v1/namespaces/{ns}/pods/{pod}/eviction",
                                 data=body.encode(), method="POST", headers={"Content-Type": "application/json"})
    assert urllib.request.urlopen(req, timeout=10).status == 201


def test_evictions_and_preemptions_do_not_count(kube: KubeEnv, operator: OperatorProcess):
    ns, name = "f-evict", "job"
    running(kube, ns, name, backoffLimit=0, resources={**RESOURCES, "totalGPUs": None})
    # The kubelet evicts a pod under node pressure: phase Failed, reason Evicted.
    victim = f"{name}-rollout-0"
    old = uid(kube, ns, name, victim)
    kubelet_reports(kube, ns, victim, {"phase": "Failed", "reason": "Evicted",
                                       "message": "The node was low on resource: memory."})
    wait_for(lambda: uid(kube, ns, name, victim) not in (None, old), 15, "the evicted pod replaced")
    # The Eviction API (kubectl drain, the cluster autoscaler): a worker, then the coordinator (a group restart).
    for pod in (f"{name}-trainer-1", f"{name}-coordinator-0"):
        old = uid(kube, ns, name, pod)
        evict(kube, ns, pod)
        wait_for(lambda: uid(kube, ns, name, pod) not in (None, old)  # noqa: B023
                 and status(kube, ns, name).get("phase") == "Running", 20, f"{pod} replaced, the job running",
                 debug=lambda: (status(kube, ns, name).get("message"), status(kube, ns, name).get("lastFailure"),
                                {n: (p["metadata"]["uid"], p["metadata"].get("deletionTimestamp"))
                                 for n, p in kube.pods(ns, name).items()}))
    st = wait_for(lambda: (s := status(kube, ns, name)).get("disruptions", 0) == 3 and s, 10, "3 disruptions")
    assert st.get("restarts") in (None, 0) and st["phase"] == "Running", st
    reasons = [e["reason"] for e in events(kube, ns)]
    assert "PodDisrupted" in reasons and "CoordinatorLost" in reasons and "PhaseFailed" not in reasons


def test_pod_on_a_lost_node_is_replaced_after_the_grace_period(kube: KubeEnv, operator: OperatorProcess):
    ns, name = "f-node", "job"
    pods = running(kube, ns, name, resources={**RESOURCES, "totalGPUs": None})
    workers = {n: p["spec"]["nodeName"] for n, p in pods.items() if "coordinator" not in n}
    coord_node = pods[f"{name}-coordinator-0"]["spec"]["nodeName"]
    lost_node = next(n for n in ("node-a", "node-b") if n != coord_node)
    on_lost = sorted(n for n, node in workers.items() if node == lost_node)
    assert len(on_lost) >= 2, workers
    stuck, unknown = on_lost[:2]
    kube.kubectl("patch", "node", lost_node, "--subresource=status", "--type=merge", "-p", json.dumps(
        {"status": {"conditions": [{"type": "Ready", "status": "Unknown", "reason": "NodeStatusUnknown",
                                    "lastTransitionTime": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}]}}))
    try:
        # The taint manager deletes the pod; its kubelet never confirms: Terminating with a fixed name.
        old = {n: uid(kube, ns, name, n) for n in (stuck, unknown)}
        kube.kubectl("delete", "pod", stuck, "-n", ns, "--grace-period=1", "--wait=false")
        assert kube.pods(ns, name)[stuck]["metadata"].get("deletionTimestamp")
        # The other one: phase Unknown (the node controller lost contact).
        kubelet_reports(kube, ns, unknown, {"phase": "Unknown"})
        for pod in (stuck, unknown):
            wait_for(lambda: uid(kube, ns, name, pod) not in (None, old[pod]), 20,  # noqa: B023
                     f"{pod} replaced on a live node")
            assert kube.pods(ns, name)[pod]["spec"].get("nodeName") in (None, coord_node)
        st = wait_for(lambda: (s := status(kube, ns, name)).get("disruptions", 0) >= 2 and s, 10, "2 disruptions")
        assert st.get("restarts") in (None, 0) and st["phase"] == "Running"
        assert sum(e["reason"] == "NodeLost" for e in events(kube, ns)) >= 2
    finally:
        kube.kubectl("patch", "node", lost_node, "--subresource=status", "--type=merge", "-p", json.dumps(
            {"status": {"conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}]}}))


def test_lost_coordinator_pod_restarts_the_job_once(kube: KubeEnv, operator: OperatorProcess):
    ns, name = "f-coord", "job"
    pods = running(kube, ns, name, backoffLimit=1, resources={**RESOURCES, "totalGPUs": None})
    before = {n: p["metadata"]["uid"] for n, p in pods.items()}

    async def lose_coordinator() -> None:
        # In one go, as it happens: the coordinator pod is gone and its workers exit, having lost their Ray head.
        await kube.emulator.delete(PODS, ns, f"{name}-coordinator-0")
        for worker in [n for n in before if "coordinator" not in n]:
            await kube.emulator.update(PODS, ns, worker, content_type="application/merge-patch+json",
                                       subresource="status", patch={"status": {"phase": "Failed", "containerStatuses": [
                                           {"name": "x", "state": {"terminated": {"reason": "Error", "exitCode": 1}}}]}})

    kube.run_async(lose_coordinator())
    wait_for(lambda: all(uid(kube, ns, name, n) not in (None, u) for n, u in before.items()), 30,
             "the coordinator and every worker recreated")
    st = wait_for(lambda: (s := status(kube, ns, name)).get("phase") == "Running" and s, 20, "Running again")
    assert st["restarts"] == 1 and st["lastFailure"]["reason"] == "CoordinatorLost", st
    time.sleep(1.0)
    assert status(kube, ns, name)["restarts"] == 1 and status(kube, ns, name)["phase"] == "Running"


def test_spec_edit_during_a_move_keeps_the_new_pod(kube: KubeEnv, operator: OperatorProcess):
    ns, name = "f-edit", "job"
    running(kube, ns, name, resources=RESOURCES, elastic={**ELASTIC, "cooldownSeconds": 600})
    kube.coordinator.retire_after = 3.0  # a slow safe point: the edit arrives while the move waits
    try:
        kube.coordinator.set(ns, name, queueDepth=100)
        pending = wait_for(lambda: status(kube, ns, name).get("pendingMove"), 20, "a move in flight")
        kube.kubectl("patch", "rlj", name, "-n", ns, "--type=merge", "-p", '{"spec":{"backoffLimit":5}}')
        st = wait_for(lambda: (s := status(kube, ns, name)).get("lastRebalance") and not s.get("pendingMove") and s,
                      30, "the move finished")
    finally:
        kube.coordinator.retire_after = 0.3
    # the update handler waited for the move; it has run once the status observes the edited generation, and the
    # moved trainer's pod is gone once the kubelet confirms its deletion
    want = {f"{name}-coordinator-0", f"{name}-trainer-0", f"{name}-rollout-0", f"{name}-rollout-1", pending["newPod"]}
    wait_for(lambda: (j := kube.job(ns, name)) is not None
             and status(kube, ns, name).get("observedGeneration") == j["metadata"]["generation"]
             and set(kube.pods(ns, name)) == want, 20, f"the edit observed and the pods {sorted(want)}")
    assert st["allocation"]["rollout"]["replicas"] == 3
    new_pod_deletes = [w for w in kube.operator_writes(kube.requests(), ns)
                       if w.startswith("DELETE") and w.endswith(f"/pods/{pending['newPod']}")]
    assert new_pod_deletes == []


def test_waiting_reasons_and_the_startup_deadline(kube: KubeEnv, operator: OperatorProcess):
    ns, name = "f-startup", "job"
    namespace(kube, ns)
    pull = {"phase": "Pending", "containerStatuses": [{"name": "trainer", "ready": False, "state": {"waiting": {
        "reason": "ImagePullBackOff", "message": 'Back-off pulling image "ghcr.io/specrl/specrl:typo"'}}}]}
    kube.kubelet.hold[(ns, f"{name}-trainer-0")] = pull
    try:
        apply(kube, small_job(name, ns, startupDeadlineSeconds=4))  # the coordinator never answers (503)
        ready = wait_for(lambda: (c := condition(status(kube, ns, name), "Ready")).get("reason") == "ImagePullBackOff"
                         and c, 15, "Ready=False, ImagePullBackOff")
        assert "typo" in ready["message"]
        st = wait_for(lambda: (s := status(kube, ns, name)).get("phase") == "Failed" and s, 20, "phase Failed")
    finally:
        kube.kubelet.hold.pop((ns, f"{name}-trainer-0"), None)
    assert condition(st, "Failed")["reason"] == "StartupDeadlineExceeded" and "ImagePullBackOff" in st["message"]
    wait_for(lambda: role_counts(kube, ns, name) == {"trainer": 0, "rollout": 0, "coordinator": 1}, 5, "released")
    warnings = [e for e in events(kube, ns) if e["reason"] == "ImagePullBackOff"]
    assert len(warnings) == 1 and warnings[0]["type"] == "Warning"


def test_progress_deadline_fails_a_stalled_job(kube: KubeEnv, operator: OperatorProcess):
    ns, name = "f-stall", "job"
    running(kube, ns, name, progressDeadlineSeconds=3)
    kube.coordinator.set(ns, name, step=2)  # one step, then the step loop hangs
    st = wait_for(lambda: (s := status(kube, ns, name)).get("phase") == "Failed" and s, 20, "phase Failed")
    assert condition(st, "Failed")["reason"] == "ProgressDeadlineExceeded" and "at step 2" in st["message"]
    wait_for(lambda: role_counts(kube, ns, name) == {"trainer": 0, "rollout": 0, "coordinator": 1}, 5, "released")


def test_retired_pods_and_unready_pods(kube: KubeEnv, operator: OperatorProcess):
    ns, name = "f-retired", "job"
    running(kube, ns, name, resources=RESOURCES, elastic={**ELASTIC, "cooldownSeconds": 600})
    # A pod that is not Ready (unschedulable) holds every move, however long the queue.
    victim = f"{name}-rollout-1"
    kube.kubelet.hold[(ns, victim)] = {"phase": "Pending", "conditions": [{
        "type": "PodScheduled", "status": "False", "reason": "Unschedulable", "message": "0/2 nodes have a free GPU"}]}
    kube.kubectl("delete", "pod", victim, "-n", ns)  # waits until the kubelet confirms
    wait_for(lambda: condition(status(kube, ns, name), "Ready").get("reason") == "Unschedulable", 15, "Unschedulable")
    kube.coordinator.set(ns, name, queueDepth=100)
    time.sleep(2.0)
    assert not [d for d in kube.coordinator.drains if d["job"] == (ns, name)]
    kube.kubelet.hold.pop((ns, victim))
    kube.coordinator.set(ns, name, queueDepth=0)
    wait_for(lambda: condition(status(kube, ns, name), "Ready").get("status") == "True", 15, "Ready again")
    # The coordinator retires a worker on its own (no move in flight): the pod is replaced in its role.
    time.sleep(1.0)  # listed as an active member first
    retired = f"{name}-rollout-0"
    old = uid(kube, ns, name, retired)
    kube.coordinator.states.setdefault((ns, name), {})[retired] = "retired"
    wait_for(lambda: uid(kube, ns, name, retired) not in (None, old), 15, "the retired pod replaced")
    fresh = uid(kube, ns, name, retired)
    time.sleep(1.5)  # still listed "retired" until it registers: not replaced again
    assert uid(kube, ns, name, retired) == fresh
    assert status(kube, ns, name)["allocation"]["rollout"]["replicas"] == 2
    kube.coordinator.states[(ns, name)].pop(retired)
