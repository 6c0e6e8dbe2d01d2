"""kopf handlers for RLJobs: thin adapters that hand every trigger to :func:`reconcile.reconcile`.

* ``create`` / ``resume`` / ``update`` (spec changes): full convergence, including the job-level objects.
* a timer per RLJob that is not Complete/Failed, every ``--poll-interval`` seconds: pods, the coordinator's
  ``GET /status``, status and rebalancing (the level-based loop; no writes when nothing changed).
* ``delete``: removes the pods right away (GPUs are freed without waiting for garbage collection) and the
  job-level objects; ownerReferences remain the safety net.
* an index of the job's pods (``specrl.io/job`` label) so that observing children costs no API request, and
  one of its Services and ConfigMap, so that every reconcile recreates one deleted by hand for free (the
  Secret is not watched: the operator may not list Secrets; see :func:`reconcile._ensure_static`).
* an event handler on the job's pods that remembers an eviction or preemption, so that a pod that terminates
  between two ticks is still counted as a disruption (and an evicted coordinator's group restart not as a
  failure).

Registration is explicit (:func:`register` into a registry) because the timer interval comes from the
command line.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import kopf

from ..runtime.api import GROUP, PLURAL, VERSION
from . import children
from . import metrics as m
from .coordinator_client import CoordinatorClient
from .kube import KubeClient, set_client
from .reconcile import OperatorConfig, PodInfo, Runtime, reconcile

log = logging.getLogger("specrl.operator.handlers")

_runtime: Runtime | None = None


def runtime() -> Runtime:
    if _runtime is None:
        raise kopf.TemporaryError("the operator is not logged in yet", delay=1)
    return _runtime


def _emit(body: Mapping[str, Any], type_: str, reason: str, message: str) -> None:
    # kopf types `objs` as its Body wrapper; any mapping with apiVersion, kind and metadata is what it reads
    kopf.event(body, type=type_, reason=reason, message=message[:1024])  # type: ignore[arg-type]


def _observed(index: Any, namespace: str, name: str) -> list[Any]:
    # A kopf index holds whatever its indexer returned: PodInfo for pods, (kind, name) for job-level objects.
    try:
        return list(index.get((namespace, name), ()))
    except KeyError:
        return []


def _ns(namespace: str | None) -> str:
    # kopf types `namespace` as optional because cluster-scoped resources have none; every resource here is namespaced.
    if namespace is None:
        raise kopf.PermanentError("a namespaced object arrived without a namespace")
    return namespace


def _apply(patch: kopf.Patch, status: dict[str, Any]) -> None:
    # An empty dict under "status" would still be sent as a PATCH: add the key only when needed.
    if status:
        patch.setdefault("status", {}).update(status)


def register(registry: kopf.OperatorRegistry, config: OperatorConfig) -> None:
    """Register every handler of the operator into ``registry``."""
    target: dict[str, Any] = {"group": GROUP, "version": VERSION, "plural": PLURAL, "registry": registry}

    @kopf.on.login(id="login", registry=registry)
    def login(**kwargs: Any) -> Any:
        # One authentication path for kopf and our own client: service account in a pod, else kubeconfig.
        info = kopf.login_with_service_account(**kwargs) or kopf.login_with_kubeconfig(**kwargs)
        if info is None:
            raise kopf.LoginError("no Kubernetes credentials: no service account and no kubeconfig")
        global _runtime
        kube = KubeClient(info)
        set_client(kube)
        coord = _runtime.coord if _runtime else CoordinatorClient(config.coordinator_url_template)
        _runtime = Runtime(config=config, kube=kube, coord=coord, emit=_emit)
        return info

    @kopf.on.cleanup(id="close", registry=registry)
    async def cleanup(**_: Any) -> None:
        if _runtime is not None:
            await _runtime.kube.close()
            await _runtime.coord.close()

    @kopf.index("pods", labels={children.LABEL_JOB: kopf.PRESENT,
                                "app.kubernetes.io/managed-by": children.MANAGED_BY},
                id="pods_by_job", registry=registry)
    def pods_by_job(body: kopf.Body, namespace: str | None, labels: Mapping[str, str], **_: Any) -> Any:
        info = PodInfo.from_body(body)
        return {(_ns(namespace), labels[children.LABEL_JOB]): info} if info is not None else None

    @kopf.on.event("pods", labels={children.LABEL_JOB: kopf.PRESENT,
                                   "app.kubernetes.io/managed-by": children.MANAGED_BY},
                   id="pod_disruptions", registry=registry)
    def pod_disruption(body: kopf.Body, namespace: str | None, labels: Mapping[str, str], **_: Any) -> None:
        # An evicted pod can terminate between two ticks: remember the disruption, so that it is counted once
        # and the group restart an evicted coordinator causes is not counted against backoffLimit.
        if _runtime is not None and (info := PodInfo.from_body(body)) is not None:
            _runtime.note_disruption((_ns(namespace), labels[children.LABEL_JOB]), info)

    def job_level(kind: str) -> Any:
        def index(namespace: str | None, name: str, labels: Mapping[str, str], **_: Any) -> Any:
            return {(_ns(namespace), labels[children.LABEL_JOB]): (kind, name)}
        return index

    for kind, plural in (("Service", "services"), ("ConfigMap", "configmaps")):
        kopf.index(plural, labels={children.LABEL_JOB: kopf.PRESENT, "app.kubernetes.io/managed-by": children.MANAGED_BY},
                   id=f"{plural}_by_job", registry=registry)(job_level(kind))

    # kopf passes every index as a keyword argument named by its id (pods_by_job, services_by_job, ...).
    def statics(namespace: str, name: str, **indexes: Any) -> set[tuple[str, str]]:
        return {obj for plural in ("services", "configmaps")
                for obj in _observed(indexes[f"{plural}_by_job"], namespace, name)}

    @kopf.on.create(**target, id="converge", backoff=5)
    @kopf.on.resume(**target, id="converge", backoff=5)
    @kopf.on.update(**target, id="converge", field="spec", backoff=5)
    async def converge(body: kopf.Body, reason: str, namespace: str | None, name: str, patch: kopf.Patch,
                       **indexes: Any) -> None:
        namespace = _ns(namespace)
        trigger = str(getattr(reason, "value", reason))
        status = await reconcile(runtime(), body, _observed(indexes["pods_by_job"], namespace, name), trigger,
                                 statics(namespace, name, **indexes))
        _apply(patch, status)

    def running(status: Mapping[str, Any], **_: Any) -> bool:
        return status.get("phase") not in ("Complete", "Failed")

    @kopf.timer(**target, interval=config.poll_interval, initial_delay=config.poll_interval, when=running,
                id="tick", backoff=config.poll_interval)
    async def tick(body: kopf.Body, namespace: str | None, name: str, patch: kopf.Patch,
                   **indexes: Any) -> None:
        namespace = _ns(namespace)
        status = await reconcile(runtime(), body, _observed(indexes["pods_by_job"], namespace, name), "timer",
                                 statics(namespace, name, **indexes))
        _apply(patch, status)

    @kopf.on.delete(**target, id="cleanup", optional=True)
    async def delete(body: kopf.Body, namespace: str | None, name: str, **indexes: Any) -> None:
        namespace = _ns(namespace)
        rt = runtime()
        owner = children.Owner.from_body(body)
        async with rt.lock((namespace, name)):
            for pod in _observed(indexes["pods_by_job"], namespace, name):
                if not pod.deleting:
                    await rt.kube.delete("Pod", namespace, pod.name)
            for kind, obj_name in (("ConfigMap", children.config_map_name(name)),
                                   ("Secret", children.secret_name(name)),
                                   ("Service", children.headless_service_name(name)),
                                   ("Service", children.coordinator_service_name(name))):
                await rt.kube.delete(kind, namespace, obj_name)
        rt.forget((namespace, name))
        m.forget_job(namespace, name)
        log.info("deleted the children of %s/%s", owner.namespace, owner.name)

    @kopf.on.probe(id="jobs", registry=registry)
    def jobs(**_: Any) -> int:
        return len(_runtime.locks) if _runtime else 0
