"""What the cluster did to a job's pods, and what the operator does about it (pure: no I/O, no clock).

The reconciler reads pods from kopf's index and nodes on demand; these functions classify them:

* **disruptions** (:func:`disruption_of`): a pod the cluster took away — eviction (API or kubelet node
  pressure), preemption, taint-based deletion, pod GC, graceful node shutdown. Kubernetes marks them with the
  ``DisruptionTarget`` condition (or ``status.reason: Evicted`` / ``Preempting``). As a Job with a pod failure
  policy ``Ignore`` does, they are replaced at once and never count against ``spec.backoffLimit``.
* **waiting reasons** (:func:`waiting_of`): why a pod does not run yet (``ImagePullBackOff``,
  ``CreateContainerConfigError``, ``Unschedulable``...), surfaced in the Ready condition and as Warning events.
* **lost nodes** (:func:`node_lost`): a pod in phase ``Unknown``, or stuck terminating past its deletion time,
  whose node is NotReady (or gone) for longer than a grace period, is force-deleted so that its fixed name can
  be reused; the replacement does not count as a failure.
* **deadlines** (:func:`deadline_problem`): ``spec.startupDeadlineSeconds`` bounds the time a (re)started job
  stays Pending, ``spec.progressDeadlineSeconds`` the time a running job goes without finishing a step.
* **create backoff** (:func:`create_delay`): a create the API refuses (quota 403, admission 422) is retried
  after an exponentially growing delay, not on every tick.
"""

from __future__ import annotations

import datetime as dt
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

# Kubelet states that mean "still starting normally", not a problem to surface.
BENIGN_WAITING = frozenset({"ContainerCreating", "PodInitializing"})
DISRUPTION_REASONS = frozenset({"Evicted", "Preempting", "Shutdown", "Terminated", "NodeShutdown"})


def _time(value: Any) -> float | None:
    if not value:
        return None
    try:
        return dt.datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return None


def _condition(conditions: Any, type_: str) -> Mapping[str, Any]:
    for cond in conditions or ():
        if isinstance(cond, Mapping) and cond.get("type") == type_:
            return cond
    return {}


def disruption_of(status: Mapping[str, Any]) -> str:
    """The disruption that ended a pod ("" if none): its DisruptionTarget reason, or Evicted/Preempting."""
    cond = _condition(status.get("conditions"), "DisruptionTarget")
    if cond.get("status") == "True":
        return str(cond.get("reason") or "DisruptionTarget")
    reason = str(status.get("reason") or "")
    return reason if reason in DISRUPTION_REASONS else ""


def waiting_of(status: Mapping[str, Any]) -> str:
    """``"Reason: message"`` of the first problem that keeps a pod from running, "" when there is none."""
    for cs in [*(status.get("initContainerStatuses") or ()), *(status.get("containerStatuses") or ())]:
        waiting = ((cs or {}).get("state") or {}).get("waiting") or {}
        reason = waiting.get("reason")
        if reason and reason not in BENIGN_WAITING:
            return f"{reason}: {waiting.get('message') or 'waiting'}"[:300]
    sched = _condition(status.get("conditions"), "PodScheduled")
    if sched.get("status") == "False" and sched.get("reason"):
        return f"{sched['reason']}: {sched.get('message') or 'not scheduled'}"[:300]
    return ""


def ready_of(status: Mapping[str, Any]) -> bool:
    return _condition(status.get("conditions"), "Ready").get("status") == "True"


def deletion_time(meta: Mapping[str, Any]) -> float | None:
    """When a terminating pod should be gone (the API server sets deletionTimestamp = request + grace)."""
    return _time(meta.get("deletionTimestamp"))


class PodLike(Protocol):
    # Read-only members, so that frozen dataclasses (PodInfo) satisfy it.
    @property
    def name(self) -> str: ...
    @property
    def role(self) -> str: ...
    @property
    def phase(self) -> str: ...
    @property
    def deleting(self) -> bool: ...
    @property
    def node(self) -> str: ...
    @property
    def deleted_at(self) -> float | None: ...


def suspect(pod: PodLike, now: float) -> bool:
    """A pod whose node may be lost: phase Unknown, or still terminating after its deletion time."""
    if not pod.node:
        return False
    if pod.phase == "Unknown":
        return True
    return pod.deleting and pod.deleted_at is not None and now >= pod.deleted_at


def node_lost(node: Mapping[str, Any] | None, now: float, grace: float) -> str:
    """Why the node counts as lost ("" if it does not): deleted, or NotReady for at least ``grace`` seconds."""
    if node is None:
        return "the node no longer exists"
    ready = _condition((node.get("status") or {}).get("conditions"), "Ready")
    if ready.get("status") == "True":
        return ""
    since = _time(ready.get("lastTransitionTime"))
    if since is not None and now - since < grace:
        return ""
    reason = ready.get("reason") or "NodeNotReady"
    return f"node {node.get('metadata', {}).get('name', '?')} is NotReady ({reason}) for {grace:g}s or more"


@dataclass(frozen=True)
class Deadline:
    reason: str
    message: str


def deadline_problem(*, phase: str | None, now: float, pending_since: float | None, progress_at: float | None,
                     startup_deadline: int, progress_deadline: int, step: int, waiting: Iterable[str] = (),
                     coordinator_problem: str = "") -> Deadline | None:
    """The deadline the job has run past, if any (0 disables a deadline)."""
    detail = "; ".join(list(waiting)[:3])
    if coordinator_problem:
        detail = f"{detail}; {coordinator_problem}" if detail else coordinator_problem
    if phase == "Pending" and startup_deadline > 0 and pending_since is not None \
            and now - pending_since > startup_deadline:
        return Deadline("StartupDeadlineExceeded",
                        f"the job did not start within spec.startupDeadlineSeconds={startup_deadline}"
                        + (f": {detail}" if detail else ""))
    if phase == "Running" and progress_deadline > 0 and progress_at is not None \
            and now - progress_at > progress_deadline:
        return Deadline("ProgressDeadlineExceeded",
                        f"no RL step completed for spec.progressDeadlineSeconds={progress_deadline} (at step {step})"
                        + (f": {detail}" if detail else ""))
    return None


def create_delay(failures: int, base: float, cap: float) -> float:
    """Seconds before creating again after ``failures`` consecutive refused creates."""
    return min(cap, base * 2 ** max(0, failures - 1))
