"""Nodes for the API emulator: a kubelet stand-in, graceful pod deletion on lost nodes, and the Eviction API.

The base `Emulator` removes a deleted pod at once. A real API server keeps a pod that runs on a node
`Terminating` until its kubelet confirms that the containers stopped, and a pod on a node whose kubelet is gone
stays `Terminating` forever, which is the fault the operator must handle; so:

- `NodeEmulator` (an `Emulator`): deleting a pod bound to a node (`spec.nodeName`) only sets
  `deletionTimestamp` (request time + grace: the request's `gracePeriodSeconds`, else the pod's
  `terminationGracePeriodSeconds`, else 30) and keeps the pod until the kubelet confirms; a delete with
  `gracePeriodSeconds: 0` (what `kubectl delete --force --grace-period=0` sends) removes it at once.
  Watch lists (`sendInitialEvents=true`, which `kubectl delete` uses to wait) end their initial events with
  the `k8s.io/initial-events-end` bookmark. `POST pods/<name>/eviction` (policy/v1, what `kubectl drain`
  sends) marks the pod `DisruptionTarget=True, EvictionByEvictionAPI` and deletes it.
  `refuse[(METHOD, path)] = (code, reason, message)` answers such requests with that error and changes
  nothing, as an admission webhook or a ResourceQuota does (403 Forbidden, 422 Invalid).
- `Kubelet`: plays the kubelets of the emulator's nodes. Every pod that is `Pending` and unbound is bound to a
  Ready, schedulable node (round robin) and reported `Running` and Ready, unless the test holds it
  (`hold[(ns, name)] = status`: that status is reported instead, e.g. an `ImagePullBackOff` waiting reason).
  It confirms the deletion of a terminating pod on a Ready node after `confirm_after` seconds; nobody reports
  for pods on a node that is not Ready. It runs on the emulator's event loop; `paused` stops it.
"""

from __future__ import annotations

import asyncio
import datetime as dt
import logging
import time
from collections.abc import AsyncIterator
from typing import Any

import attrs
import kmock
from kmock._internal import rendering
from kmock._internal.k8s import KubernetesError

from tests.kube.emulator import Emulator, _name_of, _resource_of, _status

log = logging.getLogger("tests.kube.nodes")
PODS = kmock.resource("v1/pods")
NODES = kmock.resource("v1/nodes")
MERGE = "application/merge-patch+json"


def _iso(t: dt.datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def node_ready(node: dict[str, Any] | None) -> bool:
    for cond in ((node or {}).get("status") or {}).get("conditions") or ():
        if cond.get("type") == "Ready":
            return cond.get("status") == "True"
    return False


def node_manifest(name: str, ready: bool = True) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Node", "metadata": {"name": name, "labels": {"kubernetes.io/hostname": name}},
            "status": {"conditions": [{"type": "Ready", "status": "True" if ready else "Unknown",
                                       "reason": "KubeletReady" if ready else "NodeStatusUnknown",
                                       "lastTransitionTime": _iso(dt.datetime.now(dt.timezone.utc))}],
                       "capacity": {"nvidia.com/gpu": "8", "cpu": "64", "memory": "512Gi"}}}


@attrs.define(kw_only=True)
class NodeEmulator(Emulator):
    """`Emulator` plus graceful deletion of pods on NotReady nodes, the Eviction subresource, refusals."""

    refuse: dict[tuple[str, str], tuple[int, str, str]] = attrs.field(factory=dict, init=False)

    async def _dispatch(self, request: rendering.Request) -> Any:
        refusal = self.refuse.get((str(request.method.value).upper(), request.url.path.rstrip("/")))
        if refusal is not None:
            raise _status(*refusal)
        res = request.resource
        if res is not None and res.plural == "pods" and request.subresource == "eviction" \
                and request.method == kmock.method.POST:
            return await self._evict(request)
        return await super()._dispatch(request)

    async def _evict(self, request: rendering.Request) -> Any:
        async with self._mutex:
            pod = self._get(PODS, request.namespace, _name_of(request))
        if pod is None:
            raise self._not_found(PODS, _name_of(request))
        conds = [c for c in (pod.get("status") or {}).get("conditions") or () if c.get("type") != "DisruptionTarget"]
        conds.append({"type": "DisruptionTarget", "status": "True", "reason": "EvictionByEvictionAPI",
                      "message": "Eviction API: evicting", "lastTransitionTime": _iso(dt.datetime.now(dt.timezone.utc))})
        await self.update(PODS, request.namespace, _name_of(request), patch={"status": {"conditions": conds}},
                          content_type=MERGE, subresource="status")
        grace = ((request.data or {}).get("deleteOptions") or {}).get("gracePeriodSeconds")
        await self._delete_pod(pod["metadata"]["namespace"], pod["metadata"]["name"], grace, None)
        return rendering.Response(status=201, payload={"apiVersion": "v1", "kind": "Status", "status": "Success"})

    # `kubectl delete` waits for a terminating pod with a watch list (`sendInitialEvents=true`): the current
    # objects as ADDED events, then a BOOKMARK annotated `k8s.io/initial-events-end`, then the changes.
    async def _watch_stream(self, request: rendering.Request) -> AsyncIterator[Any]:
        if request.params.get("sendInitialEvents") != "true":
            async for chunk in super()._watch_stream(request):
                yield chunk
            return
        res = _resource_of(request)
        async with self._mutex:
            rv = str(self._rv)
            initial = self.list_objects(res, request.namespace, labels=request.params.get("labelSelector"),
                                        fields=request.params.get("fieldSelector"))
        params = {k: v for k, v in request.params.items() if k not in ("sendInitialEvents", "resourceVersionMatch")}
        inner = attrs.evolve(request, params={**params, "resourceVersion": rv})
        table = self._wants_table(request)
        first = True
        async for chunk in super()._watch_stream(inner):
            yield chunk
            if first:  # right after the headers
                first = False
                for obj in initial:
                    if request.name is None or obj["metadata"]["name"] == request.name:
                        yield self._watch_event(res, {"type": "ADDED", "object": obj}, table)
                yield {"type": "BOOKMARK", "object": {
                    "kind": self.info(res).kind, "apiVersion": res.group and f"{res.group}/{res.version}" or res.version,
                    "metadata": {"resourceVersion": rv, "annotations": {"k8s.io/initial-events-end": "true"}}}}

    async def _serve_delete(self, request: rendering.Request) -> Any:
        if request.resource is None or request.resource.plural != "pods" or request.name is None:
            return await super()._serve_delete(request)
        body = request.data if isinstance(request.data, dict) else {}
        grace = body.get("gracePeriodSeconds", request.params.get("gracePeriodSeconds"))
        return await self._delete_pod(request.namespace, request.name, grace, body.get("propagationPolicy"))

    async def _delete_pod(self, namespace: str | None, name: str, grace: Any, propagation: str | None) -> Any:
        async with self._mutex:
            pod = self._get(PODS, namespace, name)
            if pod is None:
                raise self._not_found(PODS, name)
            node = (pod.get("spec") or {}).get("nodeName")
            if node and (grace is None or int(grace) > 0):
                meta = pod["metadata"]
                if not meta.get("deletionTimestamp"):  # Terminating until its kubelet confirms
                    seconds = int(grace if grace is not None else
                                  (pod.get("spec") or {}).get("terminationGracePeriodSeconds", 30))
                    meta["deletionTimestamp"] = _iso(dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=seconds))
                    meta["deletionGracePeriodSeconds"] = seconds
                    meta["resourceVersion"] = self._next_rv()
                    self._store(PODS, namespace, name, pod)
                    self._emit(PODS, "MODIFIED", pod)
                return pod
        return await self.delete(PODS, namespace, name, propagation=propagation)


class Kubelet:
    """Binds pending pods to Ready nodes and reports them Running and Ready (see the module docstring)."""

    def __init__(self, emulator: Emulator, nodes: tuple[str, ...] = ("node-a", "node-b"), period: float = 0.05,
                 confirm_after: float = 0.2):
        self.emulator = emulator
        self.node_names = nodes
        self.period = period
        self.confirm_after = confirm_after
        self._terminating: dict[str, float] = {}  # uid -> when first seen terminating
        self.paused = False  # e.g. for a throughput test that measures the operator alone
        self.hold: dict[tuple[str, str], dict[str, Any]] = {}
        self._next = 0
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        for name in self.node_names:
            if self.emulator._get(NODES, None, name) is None:
                node = node_manifest(name)
                await self.emulator.create(NODES, None, node)  # status is written through /status only
                await self.emulator.update(NODES, None, name, patch={"status": node["status"]}, content_type=MERGE,
                                           subresource="status")
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _run(self) -> None:
        while True:
            try:
                if not self.paused:
                    await self._step()
            except KubernetesError:
                pass  # an object deleted meanwhile: next round
            except Exception:  # a kubelet that dies silently would stall every test after it
                log.exception("kubelet stand-in: step failed")
            await asyncio.sleep(self.period)

    async def _step(self) -> None:
        ready = [n["metadata"]["name"] for n in self.emulator.list_objects(NODES)
                 if node_ready(n) and not (n.get("spec") or {}).get("unschedulable")]
        # The stored objects themselves (read only): cloning every pod 20 times a second would load the loop.
        pods = [o.raw for (r, _ns, _n), o in list(self.emulator.objects.items()) if r == PODS and not o.deleted]
        for pod in pods:
            meta, spec, status = pod["metadata"], pod.get("spec") or {}, pod.get("status") or {}
            key = (meta["namespace"], meta["name"])
            if meta.get("deletionTimestamp"):
                if spec.get("nodeName") in ready:
                    seen = self._terminating.setdefault(meta["uid"], time.monotonic())
                    if time.monotonic() - seen >= self.confirm_after:
                        self._terminating.pop(meta["uid"], None)
                        await self.emulator.delete(PODS, *key)
                continue
            if status.get("phase") != "Pending" or spec.get("nodeName"):
                continue
            if key in self.hold:
                if status != {**status, **self.hold[key]}:
                    await self.emulator.update(PODS, *key, patch={"status": self.hold[key]}, content_type=MERGE,
                                               subresource="status")
                continue
            if not ready:
                continue
            node = ready[self._next % len(ready)]
            self._next += 1
            await self.emulator.update(PODS, *key, patch={"spec": {"nodeName": node}}, content_type=MERGE)
            now = _iso(dt.datetime.now(dt.timezone.utc))
            conds = [{"type": t, "status": "True", "lastTransitionTime": now}
                     for t in ("PodScheduled", "Initialized", "ContainersReady", "Ready")]
            containers = [{"name": c["name"], "ready": True, "restartCount": 0, "started": True,
                           "state": {"running": {"startedAt": now}}} for c in spec.get("containers") or ()]
            await self.emulator.update(PODS, *key, content_type=MERGE, subresource="status", patch={"status": {
                "phase": "Running", "conditions": conds, "containerStatuses": containers, "startTime": now}})
