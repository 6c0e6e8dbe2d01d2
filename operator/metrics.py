"""The operator's Prometheus metrics (DESIGN §4), on a registry of their own.

Served by ``specrl operator --metrics-port`` at ``/metrics``. Only the operator writes these; the
runtime's metrics live in ``specrl.runtime.metrics``.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector

REGISTRY = CollectorRegistry(auto_describe=True)

ALLOCATION = Gauge(
    "specrl_operator_allocation_replicas",
    "Pods the operator allocates to each role of a job (after rebalancing).",
    ["namespace", "job", "role"],
    registry=REGISTRY,
)
REBALANCES = Counter(
    "specrl_operator_rebalance_total",
    "Pods moved between roles by the elastic rebalancer.",
    ["from_role", "to_role", "reason"],
    registry=REGISTRY,
)
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
COORDINATOR_ERRORS = Counter(
    "specrl_operator_coordinator_errors_total",
    "Failed polls of a job coordinator's GET /status.",
    ["namespace", "job"],
    registry=REGISTRY,
)

_phases: dict[tuple[str, str], str] = {}


class _JobsByPhase(Collector):
    """``specrl_operator_jobs{phase}``: RLJobs this operator serves, by phase (computed at scrape)."""

    def collect(self) -> Iterator[GaugeMetricFamily]:
        fam = GaugeMetricFamily("specrl_operator_jobs", "RLJobs served by this operator, by phase.", labels=["phase"])
        counts: dict[str, int] = {p: 0 for p in ("Pending", "Running", "Suspended", "Complete", "Failed")}
        for phase in list(_phases.values()):
            counts[phase] = counts.get(phase, 0) + 1
        for phase, n in sorted(counts.items()):
            fam.add_metric([phase], n)
        yield fam


REGISTRY.register(_JobsByPhase())


def observe_job(namespace: str, job: str, phase: str | None, allocation: dict[str, int] | None) -> None:
    if phase:
        _phases[(namespace, job)] = phase
    for role, replicas in (allocation or {}).items():
        ALLOCATION.labels(namespace=namespace, job=job, role=role).set(replicas)


def forget_job(namespace: str, job: str) -> None:
    _phases.pop((namespace, job), None)
    for role in ("trainer", "rollout"):
        try:
            ALLOCATION.remove(namespace, job, role)
        except KeyError:
            pass


def serve(port: int, addr: str = "0.0.0.0") -> None:
    if port:
        start_http_server(port, addr=addr, registry=REGISTRY)
