"""The operator's Prometheus metrics (DESIGN §4), on a registry of their own.

Served by ``specrl operator --metrics-port`` at ``/metrics``. Only the operator writes these; the
runtime's metrics live in ``specrl.runtime.metrics``.

Per-job series (allocation, conditions, rebalances, coordinator errors) are rendered at scrape time from
one entry per RLJob, the way kube-state-metrics exports object state: a job's series appear when it is first
reconciled and all disappear with :func:`forget_job` when it is deleted, and a condition whose reason changes
is exported under the new reason only (never a stale series under the old one). A job is labelled
``rljob_namespace`` and ``rljob``, never ``namespace``/``job``: Prometheus sets those on every target (the
operator pod's namespace, the scrape job), so they would collide unless ``honor_labels`` is on.
"""

from __future__ import annotations

import asyncio
import copy
import threading
import time
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import (
    GC_COLLECTOR,
    PLATFORM_COLLECTOR,
    PROCESS_COLLECTOR,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    start_http_server,
)
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

REGISTRY = CollectorRegistry(auto_describe=True)
# A registry of our own (tests and several operators in one process stay apart) loses the default collectors:
# add process_* (CPU, memory, open fds, start time), python_gc_* and python_info back, as a controller's
# users expect from controller-runtime's and kopf's own metrics.
for _collector in (PROCESS_COLLECTOR, PLATFORM_COLLECTOR, GC_COLLECTOR):
    REGISTRY.register(_collector)

RECONCILE_SECONDS = Histogram(
    "specrl_operator_reconcile_duration_seconds",
    "Wall time of one reconciliation of one RLJob (handler or timer tick).",
    ["trigger"],
    buckets=(0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120),
    registry=REGISTRY,
)
API_WRITES = Counter(
    "specrl_operator_api_writes_total",
    "Writes the operator sent to the Kubernetes API for children and status.",
    ["verb", "kind"],
    registry=REGISTRY,
)

RECONCILE_ERRORS = Counter(
    "specrl_operator_reconcile_errors",
    "Reconciliations that raised (kopf retries them), by trigger and reason (the Kubernetes status reason of an "
    "API error, such as Conflict or Forbidden, else the exception type).",
    ["trigger", "reason"],
    registry=REGISTRY,
)
RECONCILES_IN_FLIGHT = Gauge(
    "specrl_operator_reconciles_in_flight",
    "Reconciliations started and not finished, including those waiting for their job's lock (the work queue).",
    registry=REGISTRY,
)
API_REQUESTS = Counter(
    "specrl_operator_api_requests",
    "Kubernetes API requests of the operator's own client (operator/kube.py; kopf's watches are not counted), by "
    "verb and HTTP code (0: no response), as controller-runtime's rest_client_requests_total. Errors are the "
    "codes >= 400; 409 on a create of a child that exists and 404 on a delete of one that is gone are expected.",
    ["verb", "code"],
    registry=REGISTRY,
)

# HTTP code -> Kubernetes StatusReason (k8s.io/apimachinery metav1.StatusReason), for reconcile error reasons.
STATUS_REASONS = {400: "BadRequest", 401: "Unauthorized", 403: "Forbidden", 404: "NotFound", 405: "MethodNotAllowed",
                  409: "Conflict", 410: "Expired", 413: "RequestEntityTooLarge", 415: "UnsupportedMediaType",
                  422: "Invalid", 429: "TooManyRequests", 500: "InternalError", 503: "ServiceUnavailable",
                  504: "Timeout"}
VERBS = {"GET": "get", "POST": "create", "PUT": "update", "PATCH": "patch", "DELETE": "delete"}


def error_reason(exc: BaseException) -> str:
    """A bounded label value for an exception: the StatusReason of an API error, else the exception type."""
    status = getattr(exc, "status", None)
    if isinstance(status, int):
        return STATUS_REASONS.get(status, f"HTTP{status}")
    if isinstance(exc, (TimeoutError, asyncio.TimeoutError)):
        return "Timeout"
    return type(exc).__name__


def count_api_request(method: str, code: int) -> None:
    API_REQUESTS.labels(VERBS.get(method.upper(), method.lower()), str(code)).inc()


@contextmanager
def reconciling(trigger: str) -> Iterator[None]:
    """Around one reconciliation: in-flight gauge, duration, and errors by reason (cancellation is no error)."""
    RECONCILES_IN_FLIGHT.inc()
    started = time.perf_counter()
    try:
        yield
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        RECONCILE_ERRORS.labels(trigger, error_reason(exc)).inc()
        raise
    finally:
        RECONCILES_IN_FLIGHT.dec()
        RECONCILE_SECONDS.labels(trigger).observe(time.perf_counter() - started)


PHASES = ("Pending", "Running", "Suspended", "Complete", "Failed")


@dataclass
class _Job:
    phase: str | None = None
    replicas: dict[str, int] = field(default_factory=dict)
    gpus: dict[str, int] = field(default_factory=dict)
    conditions: dict[str, tuple[str, bool]] = field(default_factory=dict)  # type -> (reason, status is True)
    rebalances: dict[tuple[str, str, str], float] = field(default_factory=dict)  # (from, to, reason) -> count
    coordinator_errors: float = 0.0
    pod_failures: int = 0  # status.restarts: pod failures counted against spec.backoffLimit


_lock = threading.Lock()  # scrapes run in the metrics server's thread, updates in kopf's event loop
_jobs: dict[tuple[str, str], _Job] = {}


def _job(namespace: str, job: str) -> _Job:
    return _jobs.setdefault((namespace, job), _Job())


def observe_job(namespace: str, job: str, status: Mapping[str, Any]) -> None:
    """Export a job's phase, allocation and conditions as its status says (called wherever status is written)."""
    with _lock:
        entry = _job(namespace, job)
        entry.phase = status.get("phase") or entry.phase
        for role, alloc in (status.get("allocation") or {}).items():
            entry.replicas[role] = int(alloc.get("replicas", 0))
            entry.gpus[role] = int(alloc.get("gpus", 0))
        entry.conditions = {str(c["type"]): (str(c.get("reason") or ""), c.get("status") == "True")
                            for c in status.get("conditions") or () if c.get("type")}
        if status.get("restarts") is not None:
            entry.pod_failures = int(status["restarts"])


def expect_rebalances(namespace: str, job: str, moves: Iterable[tuple[str, str, str]]) -> None:
    """Create the job's rebalance counters at 0 for every (from_role, to_role, reason) it can see, so that
    panels show 0 instead of "No data" and ``increase()`` sees the first move (a series born at 1 has none)."""
    with _lock:
        counts = _job(namespace, job).rebalances
        for move in moves:
            counts.setdefault(move, 0.0)


def count_rebalance(namespace: str, job: str, from_role: str, to_role: str, reason: str) -> None:
    with _lock:
        counts = _job(namespace, job).rebalances
        counts[(from_role, to_role, reason)] = counts.get((from_role, to_role, reason), 0.0) + 1


def count_coordinator_error(namespace: str, job: str) -> None:
    with _lock:
        _job(namespace, job).coordinator_errors += 1


def forget_job(namespace: str, job: str) -> None:
    """Drop every series of a deleted job."""
    with _lock:
        _jobs.pop((namespace, job), None)


class _JobState(Collector):
    """Every per-job family, rendered from the job entries at scrape time."""

    def collect(self) -> Iterator[Metric]:
        with _lock:  # a snapshot, rendered without holding the lock
            jobs = copy.deepcopy(_jobs)
        phases = GaugeMetricFamily("specrl_operator_jobs", "RLJobs served by this operator, by phase.",
                                   labels=["phase"])
        replicas = GaugeMetricFamily("specrl_operator_allocation_replicas",
                                     "Pods the operator allocates to each role of a job (after rebalancing).",
                                     labels=["rljob_namespace", "rljob", "role"])
        gpus = GaugeMetricFamily("specrl_operator_allocation_gpus",
                                 "GPUs the operator allocates to each role of a job (replicas x gpusPerPod).",
                                 labels=["rljob_namespace", "rljob", "role"])
        conditions = GaugeMetricFamily(
            "specrl_operator_job_condition",
            "Status conditions of a job: 1 when the condition is True, 0 otherwise; reason is the current one.",
            labels=["rljob_namespace", "rljob", "condition", "reason"])
        rebalances = CounterMetricFamily("specrl_operator_rebalance",
                                         "Pods moved between roles by the elastic rebalancer.",
                                         labels=["rljob_namespace", "rljob", "from_role", "to_role", "reason"])
        errors = CounterMetricFamily("specrl_operator_coordinator_errors",
                                     "Failed polls of a job coordinator's GET /status.", labels=["rljob_namespace", "rljob"])
        failures = GaugeMetricFamily(
            "specrl_operator_job_pod_failures",
            "Pod failures of a job (restarts of its workers) counted against spec.backoffLimit (status.restarts).",
            labels=["rljob_namespace", "rljob"])
        counts = dict.fromkeys(PHASES, 0)
        for (ns, name), e in sorted(jobs.items()):
            if e.phase:
                counts[e.phase] = counts.get(e.phase, 0) + 1
            for role in sorted(e.replicas):
                replicas.add_metric([ns, name, role], e.replicas[role])
                gpus.add_metric([ns, name, role], e.gpus[role])
            for ctype, (reason, true) in e.conditions.items():
                conditions.add_metric([ns, name, ctype, reason], 1.0 if true else 0.0)
            for (src, dst, reason), n in sorted(e.rebalances.items()):
                rebalances.add_metric([ns, name, src, dst, reason], n)
            errors.add_metric([ns, name], e.coordinator_errors)
            failures.add_metric([ns, name], e.pod_failures)
        for phase, n in sorted(counts.items()):
            phases.add_metric([phase], n)
        yield from (phases, replicas, gpus, conditions, rebalances, errors, failures)


REGISTRY.register(_JobState())


def serve(port: int, addr: str = "0.0.0.0") -> None:
    if port:
        start_http_server(port, addr=addr, registry=REGISTRY)
