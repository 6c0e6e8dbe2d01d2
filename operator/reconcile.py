"""Level-based reconciliation of one RLJob: observed children + coordinator signals -> writes + status.

Every trigger (create, resume after an operator restart, spec update, the periodic timer) runs the same
:func:`reconcile`: it recomputes what the job should own from the spec and ``status.allocation``,
compares it with the pods kopf's index has observed, creates what is missing and deletes what is extra.
Names are deterministic (``{job}-{role}-{index}``), so a repeated or concurrent create is a 409, never a
duplicate. Writes happen only when something differs; the status is patched only when it changed.

Faults (operator/README.md, "What happens when..."): failed and disrupted pods, a lost coordinator (one group
restart), pods on lost nodes, refused creates, deadlines, retired pods and invalid coordinator answers are
handled here with the classifications of :mod:`faults`.

Decisions live in pure modules (:mod:`children`, :mod:`rebalance`, :mod:`status`, :mod:`faults`); this module
sequences them and talks to the adapters (:class:`KubeClient`, :class:`CoordinatorClient`).
"""

from __future__ import annotations

import asyncio
import copy
import dataclasses
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError

from ..runtime.api import RLJob, problems_from
from . import actuator, children, faults
from . import metrics as m
from .coordinator_client import CoordinatorClient, CoordinatorError, InvalidStatus
from .kube import ApiError, KubeClient
from .rebalance import (
    ROLES,
    Allocation,
    LastMove,
    Move,
    PolicyConfig,
    Role,
    Signals,
    Streak,
    decide,
    possible_moves,
    room,
)
from .status import (
    condition_true,
    get_condition,
    managed,
    now_iso,
    parse_iso,
    set_condition,
    status_patch,
    transitions,
)

log = logging.getLogger("specrl.operator.reconcile")

Emit = Callable[[Mapping[str, Any], str, str, str], None]


@dataclass(frozen=True)
class PodInfo:
    """What the operator needs to know about one observed pod (kept in kopf's in-memory index)."""

    name: str
    role: str
    index: int
    uid: str
    phase: str  # Pending | Running | Succeeded | Failed | Unknown | "" (not reported yet)
    deleting: bool
    reason: str = ""
    node: str = ""  # spec.nodeName once scheduled
    ready: bool = False  # the Ready condition is True
    disruption: str = ""  # DisruptionTarget reason (eviction, preemption...) or Evicted
    waiting: str = ""  # "Reason: message" of what keeps it from running (ImagePullBackOff, Unschedulable...)
    deleted_at: float | None = None  # deletionTimestamp: when a terminating pod should be gone

    @classmethod
    def from_body(cls, body: Mapping[str, Any]) -> PodInfo | None:
        meta = body.get("metadata") or {}
        labels = meta.get("labels") or {}
        job, role = labels.get(children.LABEL_JOB), labels.get(children.LABEL_ROLE)
        if not job or not role:
            return None
        parsed = children.parse_pod_name(job, str(meta.get("name", "")))
        if parsed is None:
            return None
        st = body.get("status") or {}
        reason = st.get("reason") or ""
        for cs in st.get("containerStatuses") or ():
            term = ((cs or {}).get("state") or {}).get("terminated") or {}
            if term:
                reason = f"{term.get('reason', 'Terminated')} (exit code {term.get('exitCode', '?')})"
        return cls(name=str(meta["name"]), role=parsed[0], index=parsed[1], uid=str(meta.get("uid", "")),
                   phase=str(st.get("phase") or ""), deleting=bool(meta.get("deletionTimestamp")), reason=reason,
                   node=str((body.get("spec") or {}).get("nodeName") or ""), ready=faults.ready_of(st),
                   disruption=faults.disruption_of(st), waiting=faults.waiting_of(st),
                   deleted_at=faults.deletion_time(meta))


@dataclass
class OperatorConfig:
    coordinator_url_template: str = "http://{name}-coordinator.{namespace}.svc:8000"
    poll_interval: float = 10.0
    # Pod failures: recreate after base * 2^(n-1) seconds (capped), up to spec.backoffLimit.
    restart_backoff_base: float = float(os.environ.get("SPECRL_OPERATOR_RESTART_BACKOFF", "10"))
    restart_backoff_max: float = 300.0
    drain_poll: float = 1.0
    # A pod stuck on a node that is NotReady this long is force-deleted and replaced (not counted).
    node_lost_grace: float = float(os.environ.get("SPECRL_OPERATOR_NODE_LOST_GRACE", "60"))
    # Creates the API refuses (quota, admission): retried after base * 2^(n-1) seconds (capped).
    create_backoff_base: float = float(os.environ.get("SPECRL_OPERATOR_CREATE_BACKOFF", "5"))
    create_backoff_max: float = 300.0


EXPECTATION_TTL = 60.0


@dataclass
class Expectations:
    """Pods this operator created or deleted that kopf's index has not reported yet.

    The index follows a watch stream, so right after a write it can lag by a few events; without this a
    timer tick could re-create a pod it just created (a harmless 409, but a wasted request) or delete one
    twice. The same idea as controller-runtime's ControllerExpectations, kept per job in memory only.
    """

    created: dict[str, float] = field(default_factory=dict)
    deleted: dict[str, float] = field(default_factory=dict)

    def apply(self, job: str, pods: dict[str, PodInfo], now: float) -> None:
        for name, at in list(self.created.items()):
            if name in pods or now - at > EXPECTATION_TTL:
                del self.created[name]
            elif name not in self.deleted:
                parsed = children.parse_pod_name(job, name)
                if parsed:
                    pods[name] = PodInfo(name, parsed[0], parsed[1], "", "Pending", False)
        for name, at in list(self.deleted.items()):
            if name not in pods or now - at > EXPECTATION_TTL:
                del self.deleted[name]
            elif name not in self.created:
                pods[name] = dataclasses.replace(pods[name], deleting=True)


class TrackingKube:
    """The API client, noting every pod write in the job's :class:`Expectations`."""

    def __init__(self, kube: KubeClient, exp: Expectations) -> None:
        self._kube, self._exp = kube, exp

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kube, name)

    async def create(self, obj: Mapping[str, Any]) -> bool:
        created = await self._kube.create(obj)
        # A 409 is not a pod on its way: the name is still held (often by a pod that is terminating), so
        # expecting it would hide that pod's replacement for the expectation TTL.
        if obj["kind"] == "Pod" and created:
            name = obj["metadata"]["name"]
            self._exp.deleted.pop(name, None)
            self._exp.created[name] = time.monotonic()
        return created

    async def delete(self, kind: str, namespace: str, name: str, grace_seconds: int | None = None) -> bool:
        gone = await self._kube.delete(kind, namespace, name, grace_seconds)
        if kind == "Pod":
            self._exp.created.pop(name, None)
            self._exp.deleted[name] = time.monotonic()
        return gone


@dataclass
class Runtime:
    """Process-wide adapters and per-job memory (locks, hysteresis streaks) of the operator."""

    config: OperatorConfig
    kube: KubeClient
    coord: CoordinatorClient
    emit: Emit
    clock: Callable[[], float] = time.time
    locks: dict[tuple[str, str], asyncio.Lock] = field(default_factory=dict)
    streaks: dict[tuple[str, str], Streak] = field(default_factory=dict)
    expectations: dict[tuple[str, str], Expectations] = field(default_factory=dict)
    # The coordinator token per job (as created or as read from the Secret): a Secret deleted by hand is
    # recreated with the token the running coordinator already holds.
    tokens: dict[tuple[str, str], str] = field(default_factory=dict)
    # Refused creates per job: (consecutive failures, monotonic time of the next attempt).
    create_failures: dict[tuple[str, str], tuple[int, float]] = field(default_factory=dict)
    # Waiting reasons already announced with a Warning event, per job: pod -> reason.
    waiting: dict[tuple[str, str], dict[str, str]] = field(default_factory=dict)
    # Pods (name, uid) the coordinator has listed as members, and pods the operator has drained, per job:
    # a pod is taken as retired only after it was a member (a new pod that reuses a retired worker's name is
    # listed "retired" until it registers).
    members: dict[tuple[str, str], set[tuple[str, str]]] = field(default_factory=dict)
    drained: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    # Disruptions seen on the job's pods (by the pod watch, or a reconcile), per job: pod name -> (uid, reason),
    # kept after the pod is gone (an evicted pod can terminate between two ticks); and those already counted.
    disrupted: dict[tuple[str, str], dict[str, tuple[str, str]]] = field(default_factory=dict)
    disruptions_counted: dict[tuple[str, str], set[str]] = field(default_factory=dict)
    secret_seen: set[tuple[str, str]] = field(default_factory=set)  # jobs whose Secret this process saw exist
    # Job-level objects this process created or found (409) that the watch has not reported yet, per job:
    # (kind, name) -> monotonic time; not created again until the watch catches up or EXPECTATION_TTL passes.
    statics_expected: dict[tuple[str, str], dict[tuple[str, str], float]] = field(default_factory=dict)

    def note_disruption(self, key: tuple[str, str], pod: PodInfo) -> None:
        seen = self.disrupted.setdefault(key, {})
        if pod.disruption:
            seen[pod.name] = (pod.uid, pod.disruption)
        elif pod.name in seen and seen[pod.name][0] != pod.uid:
            del seen[pod.name]  # a new incarnation: the old record no longer applies

    def lock(self, key: tuple[str, str]) -> asyncio.Lock:
        return self.locks.setdefault(key, asyncio.Lock())

    def forget(self, key: tuple[str, str]) -> None:
        self.locks.pop(key, None)
        self.streaks.pop(key, None)
        self.expectations.pop(key, None)
        for memo in (self.tokens, self.create_failures, self.waiting, self.members, self.drained, self.disrupted,
                     self.disruptions_counted, self.statics_expected):
            memo.pop(key, None)
        self.secret_seen.discard(key)
        self.coord.forget(*key)


IMMUTABLE = (("spec.model", lambda job: job.spec.model.model_dump(by_alias=True, mode="json", exclude_none=True)),
             ("spec.resources.image", lambda job: job.spec.resources.image))


_parsed: dict[str, tuple[RLJob | None, str]] = {}


def _validate(body: Mapping[str, Any]) -> tuple[RLJob | None, str]:
    """The resolved job, or the problems with field paths; memoised on the fields the models read."""
    meta = body.get("metadata") or {}
    doc = {"apiVersion": body.get("apiVersion"), "kind": body.get("kind"), "spec": body.get("spec"),
           "metadata": {k: meta[k] for k in ("name", "namespace", "labels") if k in meta}}
    key = json.dumps(doc, sort_keys=True, default=str)
    if key in _parsed:
        return _parsed[key]
    try:
        result: tuple[RLJob | None, str] = (RLJob.model_validate(copy.deepcopy(doc)).resolved(), "")
    except ValidationError as exc:
        problems = problems_from(exc, source="RLJob", name=str(meta.get("name", "")))
        result = (None, "; ".join(f"{p.path}: {p.message}" for p in problems))
    if len(_parsed) > 4096:  # bounded: old spec versions of many jobs
        _parsed.clear()
    _parsed[key] = result
    return result


def _with_applied(job: RLJob, applied: Mapping[str, Any]) -> tuple[RLJob, list[str]]:
    """The job with the immutable fields it was created with, and a message per attempted change."""
    changes: list[str] = []
    spec = job.spec
    if applied.get("model") is not None and applied["model"] != IMMUTABLE[0][1](job):
        changes.append(f"spec.model is immutable: running {applied['model'].get('name')!r}, "
                       f"requested {job.spec.model.name!r}")
        spec = spec.model_copy(update={"model": type(spec.model).model_validate(applied["model"])})
    running = applied.get("image")
    if running is not None and running != children.image_of(job):
        # Only an explicit edit is a change; a new operator default image (jobImage) is for new jobs only.
        if job.spec.resources.image is not None:
            changes.append(f"spec.resources.image is immutable: running {running!r}, "
                           f"requested {job.spec.resources.image!r}")
        spec = spec.model_copy(update={"resources": spec.resources.model_copy(update={"image": running})})
    pinned: Mapping[str, str] | None = applied.get("roleImages")
    for role in ("coordinator", "trainer", "rollout") if pinned is not None else ():
        want, have = spec.resources.role_image(role), (pinned or {}).get(role)
        if want != have:
            changes.append(f"spec.resources.{role}.image is immutable: running {have or 'the job image'!r}, "
                           f"requested {want or 'the job image'!r}")
            res = spec.resources
            part = getattr(res, role).model_copy(update={"image": have})
            spec = spec.model_copy(update={"resources": res.model_copy(update={role: part})})
    return (job.model_copy(update={"spec": spec}) if spec is not job.spec else job), changes


def _allocation(job: RLJob, status: dict[str, Any]) -> dict[str, int]:
    """Replicas per worker role: the rebalanced values, unless the user edited the spec's replicas."""
    res = job.spec.resources
    spec_reps = {"trainer": res.trainer.replicas, "rollout": res.rollout.replicas}
    applied = status.setdefault("applied", {})
    current = {r: int(((status.get("allocation") or {}).get(r) or {}).get("replicas", -1)) for r in spec_reps}
    if applied.get("replicas") != spec_reps or min(current.values()) < 0:
        current = dict(spec_reps)
        applied["replicas"] = spec_reps
    for role, spec_role in (("trainer", res.trainer), ("rollout", res.rollout)):
        hi = spec_role.max_replicas if spec_role.max_replicas is not None else spec_role.replicas
        current[role] = max(spec_role.min_replicas, min(hi, current[role]))
    gpus = res.gpus_per_pod
    status["allocation"] = {r: {"replicas": n, "gpus": n * gpus} for r, n in current.items()}
    return current


def _ready_condition(status: dict[str, Any], want: Iterable[str], pods: Mapping[str, PodInfo], now: float,
                     gen: int | None) -> None:
    want = list(want)
    running = [n for n in want if n in pods and pods[n].phase == "Running" and not pods[n].deleting]
    # The first pod that waits for something (image pull, scheduling, config) names the reason.
    waiting = [f"{n}: {pods[n].waiting}" for n in want if n in pods and pods[n].waiting and not pods[n].deleting]
    reason = waiting[0].split(": ", 2)[1] if waiting else ""
    detail = (f"; {'; '.join(waiting[:3])}" if waiting else "")[:900]
    if status.get("phase") != "Running":
        set_condition(status, "Ready", False, reason or status.get("phase") or "Pending",
                      f"job is {status.get('phase') or 'Pending'}; {len(running)}/{len(want)} pods running{detail}",
                      now, gen)
    elif len(running) == len(want):
        set_condition(status, "Ready", True, "AllPodsRunning", f"{len(want)}/{len(want)} pods running", now, gen)
    else:
        set_condition(status, "Ready", False, reason or "PodsNotReady",
                      f"{len(running)}/{len(want)} pods running{detail}", now, gen)


class StatusWriter:
    """Tracks the last written status; direct patches for mid-reconcile stages, one diff at the end."""

    def __init__(self, rt: Runtime, body: Mapping[str, Any], owner: children.Owner) -> None:
        self.rt, self.body, self.owner = rt, body, owner
        self.current = managed(body.get("status"))
        self.deleting = bool((body.get("metadata") or {}).get("deletionTimestamp"))

    def _observe(self, new: Mapping[str, Any]) -> None:
        # The metrics follow the status as written; a tick racing the delete handler must not revive them.
        if not self.deleting:
            m.observe_job(self.owner.namespace, self.owner.name, new)

    def _events(self, new: Mapping[str, Any]) -> None:
        for t in transitions(self.current, new):
            self.rt.emit(self.body, t.type, t.reason, t.message)

    async def persist(self, new: dict[str, Any]) -> None:
        patch = status_patch(self.current, new)
        if patch:
            await self.rt.kube.patch_status("RLJob", self.owner.namespace, self.owner.name, patch)
            m.API_WRITES.labels("patch", "RLJob/status").inc()
            self._events(new)
            self.current = copy.deepcopy(new)
        self._observe(new)

    def final(self, new: dict[str, Any]) -> dict[str, Any]:
        """The patch still to apply (by kopf, merged with its own bookkeeping); posts transition events."""
        gen = new.get("observedGeneration")
        if gen is not None:  # kstatus: every condition describes the generation just reconciled
            new["conditions"] = [{**c, "observedGeneration": gen} for c in new.get("conditions") or ()]
        patch = status_patch(self.current, new)
        if patch:
            self._events(new)
            m.API_WRITES.labels("patch", "RLJob/status").inc()
        self._observe(new)
        return patch


async def _create_all(rt: Runtime, key: tuple[str, str], objs: list[dict[str, Any]], st: dict[str, Any],
                      body: Mapping[str, Any], now: float, gen: int | None,
                      present: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Create ``objs`` unless a refused create is backing off; returns the objects actually created and
    appends to ``present`` those that already existed (409).

    A refusal (quota 403, admission 422, any API error but 409) is not an error of the reconcile: the job gets
    ``Degraded=True, FailedCreate`` and a Warning event, and creates wait ``create_delay`` (growing) seconds.
    """
    if not objs:
        return []
    failures, retry_at = rt.create_failures.get(key, (0, 0.0))
    if failures and time.monotonic() < retry_at:
        return []
    results = await asyncio.gather(*(rt.kube.create(obj) for obj in objs), return_exceptions=True)
    created, refused = [], []
    for obj, result in zip(objs, results):
        m.API_WRITES.labels("create", obj["kind"]).inc()
        if isinstance(result, ApiError):
            refused.append((obj, result))
        elif isinstance(result, BaseException):
            raise result
        elif result:
            created.append(obj)
        elif present is not None:
            present.append(obj)
    if refused:
        failures += 1
        delay = faults.create_delay(failures, rt.config.create_backoff_base, rt.config.create_backoff_max)
        rt.create_failures[key] = (failures, time.monotonic() + delay)
        obj, err = refused[0]
        what = f"{obj['kind']} {obj['metadata']['name']}"
        msg = f"creating {what} was refused: HTTP {err.status}: {err.message}; retrying in {delay:g}s"
        if len(refused) > 1:
            msg += f" ({len(refused)} objects refused)"
        rt.emit(body, "Warning", "FailedCreate", msg)
        if (get_condition(st, "Degraded") or {}).get("reason") != "ImmutableFieldChanged":
            set_condition(st, "Degraded", True, "FailedCreate", msg, now, gen)
    elif failures:
        del rt.create_failures[key]
        if (get_condition(st, "Degraded") or {}).get("reason") == "FailedCreate":
            set_condition(st, "Degraded", False, "AsExpected", "creates succeed again", now, gen)
    return created


async def _delete_pods(rt: Runtime, owner: children.Owner, names: Iterable[str]) -> int:
    names = list(names)
    await asyncio.gather(*(rt.kube.delete("Pod", owner.namespace, n) for n in names))
    if names:
        m.API_WRITES.labels("delete", "Pod").inc(len(names))
    return len(names)


async def reconcile(rt: Runtime, body: Mapping[str, Any], observed: Iterable[PodInfo], trigger: str,
                    statics: AbstractSet[tuple[str, str]] | None = None) -> dict[str, Any]:
    """Converge one job; returns the status patch still to apply (the caller hands it to kopf).

    ``statics`` are the job's Services and ConfigMap that exist now, as ``(kind, name)``, from the operator's
    watches; with them every reconcile recreates one that was deleted, at no request cost when none is
    missing. None (unknown) ensures the job-level objects on handlers only.
    """
    owner = children.Owner.from_body(body)
    key = (owner.namespace, owner.name)
    with m.reconciling(trigger):
        lock = rt.lock(key)
        waited = lock.locked()
        async with lock:
            if waited:
                # Another reconcile of this job (a move, a spec update) ran while this one waited: the body this
                # trigger captured predates its writes (allocation, pendingMove); converging it would undo them.
                fresh = await rt.kube.get("RLJob", owner.namespace, owner.name)
                if fresh is None:
                    return {}
                body = fresh
            exp = rt.expectations.setdefault(key, Expectations())
            pods = {p.name: p for p in observed}
            exp.apply(owner.name, pods, time.monotonic())
            local = copy.copy(rt)
            # TrackingKube wraps create/delete and hands every other KubeClient method through __getattr__
            local.kube = TrackingKube(rt.kube, exp)  # type: ignore[assignment]  # see above
            return await _reconcile(local, body, pods, trigger, owner, key, statics)


async def _reconcile(rt: Runtime, body: Mapping[str, Any], pods: dict[str, PodInfo], trigger: str,
                     owner: children.Owner, key: tuple[str, str],
                     statics: AbstractSet[tuple[str, str]] | None) -> dict[str, Any]:
    now = rt.clock()
    gen = (body.get("metadata") or {}).get("generation")
    writer = StatusWriter(rt, body, owner)
    st = copy.deepcopy(writer.current)
    if gen is not None:
        st["observedGeneration"] = gen
    full = trigger != "timer"  # handlers (create/resume/update) also rewrite the ConfigMap

    job, problem = _validate(body)
    if job is None:
        st["phase"], st["message"] = "Failed", f"invalid spec: {problem}"
        set_condition(st, "Failed", True, "InvalidSpec", problem, now, gen)
        set_condition(st, "Ready", False, "InvalidSpec", problem, now, gen)
        return writer.final(st)
    if (get_condition(st, "Failed") or {}).get("reason") == "InvalidSpec":
        # The spec was fixed: start over as a fresh job.
        st = {k: v for k, v in st.items() if k in ("observedGeneration",)}

    if not writer.deleting:
        m.expect_rebalances(*key, possible_moves(job.spec.mode))
    applied = st.setdefault("applied", {})
    applied.setdefault("model", IMMUTABLE[0][1](job))
    applied.setdefault("image", children.image_of(job))
    applied.setdefault("roleImages", children.role_images(job))
    job, changes = _with_applied(job, applied)
    alloc = _allocation(job, st)
    phase = st.get("phase")

    # ---- terminal phases: release GPUs, keep the record -------------------------------------------
    if phase in ("Complete", "Failed"):
        extra = [p.name for p in pods.values() if p.role in children.WORKER_ROLES and not p.deleting]
        await _delete_pods(rt, owner, extra)
        return writer.final(st)

    if changes:
        set_condition(st, "Degraded", True, "ImmutableFieldChanged",
                      "; ".join(changes) + "; the job keeps running with the original values "
                      "(delete and re-create the RLJob to change them)", now, gen)
    elif (get_condition(st, "Degraded") or {}).get("reason") == "ImmutableFieldChanged":
        set_condition(st, "Degraded", False, "AsExpected", "spec matches the running job", now, gen)

    if phase is None:
        st["phase"] = "Pending"
        st["message"] = "creating the job's pods"
        for ctype in ("Ready", "Rebalancing", "Suspended", "Degraded"):
            if get_condition(st, ctype) is None:
                set_condition(st, ctype, False, "Created" if ctype != "Ready" else "Pending", "", now, gen)

    # ---- suspend: delete the workers, keep the coordinator, the objects and the status --------------
    suspended = job.spec.suspend
    if suspended:
        st["phase"], st["message"] = "Suspended", "suspended: worker pods deleted, status kept"
        set_condition(st, "Suspended", True, "Suspended", "spec.suspend is true", now, gen)
        set_condition(st, "Ready", False, "Suspended", "spec.suspend is true", now, gen)
    elif condition_true(st, "Suspended"):
        st["phase"], st["message"] = "Pending", "resumed: recreating worker pods"
        set_condition(st, "Suspended", False, "Resumed", "spec.suspend is false", now, gen)

    # ---- lost nodes, a lost coordinator, failed and disrupted pods ---------------------------------------
    lost = await _release_lost_pods(rt, body, owner, pods, now)
    _count_disruptions(rt, body, key, pods, st)
    if await _restart_group_if_coordinator_lost(rt, job, body, owner, pods, st, writer, lost, now, gen):
        return writer.final(st)
    if await _handle_failed_workers(rt, job, body, owner, pods, st, writer, now, gen):
        return writer.final(st)

    # ---- a move interrupted by an operator restart is finished first ---------------------------------
    if st.get("pendingMove") and not suspended:
        pending = actuator.PendingMove.from_status(st["pendingMove"])
        await _move(rt, job, owner, pending, st, writer, gen)
        alloc = {r: st["allocation"][r]["replicas"] for r in children.WORKER_ROLES}

    # ---- converge the children ------------------------------------------------------------------------
    token = rt.tokens.get(key) or secrets.token_urlsafe(32)
    desired = children.desired(job, owner, alloc, list(pods), token=token, workers=not suspended)
    await _ensure_static(rt, key, desired, owner, st, body, now, gen, statics, token, pods,
                         update_config=trigger == "update", handler=full)
    retry_at = parse_iso(st.get("nextRetryTime"))
    missing = [n for n in desired.pods if n not in pods]
    if missing and retry_at is not None and now < retry_at:
        missing = []  # restart backoff: the timer creates them once it expires
    elif retry_at is not None and now >= retry_at:
        st.pop("nextRetryTime", None)
    extra = [n for n, p in pods.items() if n not in desired.pods and not p.deleting]
    await _create_all(rt, key, [desired.pods[n] for n in missing], st, body, now, gen)
    await _delete_pods(rt, owner, extra)

    # ---- coordinator: progress, completion, rebalancing -------------------------------------------------
    coordinator_done = any(p.role == "coordinator" and p.phase == "Succeeded" for p in pods.values())
    # A terminating coordinator (a group restart, an eviction) may still answer: its word no longer counts.
    if trigger == "timer" and not suspended and any(p.role == "coordinator" and not p.deleting
                                                     for p in pods.values()):
        await _observe_coordinator(rt, job, owner, st, writer, pods, alloc, gen, now, key)
    if coordinator_done and st.get("phase") not in ("Complete", "Failed"):
        _complete(st, "the coordinator exited successfully", now, gen)

    # ---- deadlines ---------------------------------------------------------------------------------------
    _mark_phase_times(st, writer.current.get("phase"), now)
    if trigger == "timer" and not suspended:
        degraded = get_condition(st, "Degraded") or {}
        deadline = faults.deadline_problem(
            phase=st.get("phase"), now=now, pending_since=parse_iso(st.get("pendingSince")),
            progress_at=parse_iso(st.get("progressAt")), startup_deadline=job.spec.startup_deadline_seconds,
            progress_deadline=job.spec.progress_deadline_seconds, step=int(st.get("step") or 0),
            waiting=[f"{p.name}: {p.waiting}" for p in pods.values() if p.waiting and not p.deleting],
            coordinator_problem=str(degraded.get("message") or "") if degraded.get("status") == "True"
            and degraded.get("reason") in COORDINATOR_PROBLEMS else "")
        if deadline is not None:
            _fail(st, deadline.reason, deadline.message, now, gen)

    if st.get("phase") in ("Complete", "Failed"):
        # Release the GPUs in the same tick the job ends (the timer stops at a terminal phase).
        await _delete_pods(rt, owner, [p.name for p in pods.values()
                                       if p.role in children.WORKER_ROLES and not p.deleting])
        return writer.final(st)

    alloc_now = {r: st["allocation"][r]["replicas"] for r in children.WORKER_ROLES}
    want = children.desired(job, owner, alloc_now, list(pods), workers=not suspended).pods
    _announce_waiting(rt, body, key, pods)
    if st.get("phase") not in ("Complete", "Failed", "Suspended"):
        _ready_condition(st, want, pods, now, gen)
    return writer.final(st)


COORDINATOR_PROBLEMS = frozenset({"CoordinatorUnreachable", "CoordinatorResponseInvalid"})


def _mark_phase_times(st: dict[str, Any], before: str | None, now: float) -> None:
    """Start the deadline clocks: ``pendingSince`` on entering Pending, ``progressAt`` on entering Running."""
    phase = st.get("phase")
    if phase == "Pending" and (before != "Pending" or "pendingSince" not in st):
        st["pendingSince"] = now_iso(now)
    if phase == "Running" and (before != "Running" or "progressAt" not in st):
        st["progressAt"] = now_iso(now)


def _announce_waiting(rt: Runtime, body: Mapping[str, Any], key: tuple[str, str],
                      pods: Mapping[str, PodInfo]) -> None:
    """One Warning event per pod and waiting reason (ImagePullBackOff, Unschedulable...), when it appears."""
    now_waiting = {n: p.waiting.split(":", 1)[0] for n, p in pods.items() if p.waiting and not p.deleting}
    seen = rt.waiting.setdefault(key, {})
    for name, reason in sorted(now_waiting.items()):
        if seen.get(name) != reason:
            rt.emit(body, "Warning", reason, f"{name}: {pods[name].waiting}")
    seen.clear()
    seen.update(now_waiting)


async def _ensure_static(rt: Runtime, key: tuple[str, str], desired: children.Desired, owner: children.Owner,
                         st: dict[str, Any], body: Mapping[str, Any], now: float, gen: int | None,
                         statics: AbstractSet[tuple[str, str]] | None, token: str, pods: Mapping[str, PodInfo], *,
                         update_config: bool, handler: bool) -> None:
    """Create the job-level objects that are missing; rewrite the ConfigMap on spec updates.

    Services and the ConfigMap are watched (``statics``): only missing ones are created, so a tick costs no
    request when all exist. The Secret is not watched (the operator may not list Secrets): it is recreated
    when a pod cannot start for a missing Secret (``CreateContainerConfigError``) and before a drain needs it
    (:func:`actuator.read_token`), with the token the running coordinator holds when this process knows it.
    Without ``statics`` (unknown) the handlers create everything (409 when present) and the timer nothing.
    """
    secret_key = ("Secret", children.secret_name(owner.name))
    if statics is None:
        wanted = list(desired.static.values()) if handler else []
    else:
        config_error = any(p.waiting.startswith("CreateContainerConfigError") for p in pods.values())
        # The Secret until this process saw it exist (a refused or skipped create is retried), then on demand.
        need_secret = handler or config_error or key not in rt.secret_seen
        expected = rt.statics_expected.setdefault(key, {})
        clock = time.monotonic()
        for k, at in list(expected.items()):
            if k in statics or clock - at > EXPECTATION_TTL:
                del expected[k]  # the watch reports it (or never will): trust the watch again
        wanted = [obj for k, obj in desired.static.items()
                  if (k == secret_key and need_secret) or (k != secret_key and k not in statics and k not in expected)]
        if not handler:
            for obj in wanted:
                log.warning("%s/%s: %s %s may be missing; recreating it", *key, obj["kind"], obj["metadata"]["name"])
    present: list[dict[str, Any]] = []
    created = await _create_all(rt, key, wanted, st, body, now, gen, present)
    if any(obj["kind"] == "Secret" for obj in created + present):
        rt.secret_seen.add(key)
    if statics is not None:
        for obj in created + present:
            if obj["kind"] != "Secret":
                rt.statics_expected.setdefault(key, {})[(obj["kind"], obj["metadata"]["name"])] = time.monotonic()
    if not handler:
        for obj in created:
            rt.emit(body, "Warning", "ChildRecreated",
                    f"{obj['kind']} {obj['metadata']['name']} was missing and has been recreated")
    if any(obj["kind"] == "Secret" for obj in created):
        rt.tokens[key] = token
    if update_config and not any(obj["kind"] == "ConfigMap" for obj in created):
        cm = desired.static[("ConfigMap", children.config_map_name(owner.name))]
        await rt.kube.patch("ConfigMap", owner.namespace, cm["metadata"]["name"], {"data": cm["data"]})
        m.API_WRITES.labels("patch", "ConfigMap").inc()


async def _release_lost_pods(rt: Runtime, body: Mapping[str, Any], owner: children.Owner,
                             pods: dict[str, PodInfo], now: float) -> dict[str, str]:
    """Force-delete pods stuck on a lost node (phase Unknown, or terminating past their deletion time).

    Kubernetes never confirms the deletion of a pod whose kubelet is gone, and a pod with a fixed name then
    blocks its own replacement forever. After ``node_lost_grace`` seconds of NotReady the pod is removed with
    grace period 0 (what ``kubectl delete --force`` does); the replacement is not counted as a failure.
    Returns the released pods with the reason.
    """
    released: dict[str, str] = {}
    nodes: dict[str, dict[str, Any] | None] = {}
    for pod in [p for p in pods.values() if faults.suspect(p, now)]:
        if pod.node not in nodes:
            nodes[pod.node] = await rt.kube.get("Node", "", pod.node)
        why = faults.node_lost(nodes[pod.node], now, rt.config.node_lost_grace)
        if not why:
            continue
        await rt.kube.delete("Pod", owner.namespace, pod.name, grace_seconds=0)
        m.API_WRITES.labels("delete", "Pod").inc()
        rt.emit(body, "Warning", "NodeLost", f"{pod.name} ({pod.phase or 'terminating'}): {why}; force-deleted, "
                f"it is replaced without counting against spec.backoffLimit")
        # Counted once (by UID) with the other disruptions, whether or not the cluster marked it too.
        rt.note_disruption((owner.namespace, owner.name), dataclasses.replace(pod, disruption=pod.disruption or "NodeLost"))
        released[pod.name] = f"NodeLost: {why}"
        del pods[pod.name]
    return released


async def _restart_group_if_coordinator_lost(rt: Runtime, job: RLJob, body: Mapping[str, Any],
                                             owner: children.Owner, pods: dict[str, PodInfo], st: dict[str, Any],
                                             writer: StatusWriter, lost: Mapping[str, str], now: float,
                                             gen: int | None) -> bool:
    """A lost coordinator takes the Ray head and the step loop with it: restart the whole job once.

    Lost = its pod failed, or (while Running) it is terminating or gone. The coordinator and every worker are
    deleted and recreated together (one restart, counted once, and not at all for a disruption); the new
    coordinator resumes from the job's last checkpoint. Worker failures seen in the same tick are part of the
    group restart and are not counted. True when the job failed (backoffLimit) and the caller should stop.
    """
    name = children.pod_name(owner.name, "coordinator", 0)
    coord = pods.get(name)
    why, disruption, uid = "", "", coord.uid if coord else ""
    if name in lost:
        why, disruption = f"{name} was on a lost node", lost[name]
    elif coord is not None and not coord.deleting and coord.phase == "Failed":
        why, disruption = f"{name} failed ({coord.reason or 'Failed'})", coord.disruption
    elif st.get("phase") == "Running" and (coord is None or coord.deleting):
        why = f"{name} {'is terminating' if coord else 'disappeared'}"
        noted = rt.disrupted.get((owner.namespace, owner.name), {}).get(name, ("", ""))
        disruption = (coord.disruption if coord else "") or noted[1]
    if not why:
        return False
    workers = [p.name for p in pods.values() if p.role in children.WORKER_ROLES and not p.deleting]
    if disruption:
        delay = 0.0  # counted in status.disruptions when it was seen
    else:
        restarts = int(st.get("restarts") or 0) + 1
        st["restarts"] = restarts
        limit = job.spec.backoff_limit
        if restarts > limit:
            msg = f"{restarts} failures exceed spec.backoffLimit {limit} (last: {why})"
            _fail(st, "BackoffLimitExceeded", msg, now, gen)
            st["lastFailure"] = {"pod": name, "uid": uid, "time": now_iso(now), "reason": "CoordinatorLost"}
            await writer.persist(st)
            await _delete_pods(rt, owner, workers)
            return True
        delay = min(rt.config.restart_backoff_max, rt.config.restart_backoff_base * 2 ** (restarts - 1))
    st["lastFailure"] = {"pod": name, "uid": uid, "time": now_iso(now),
                         "reason": f"CoordinatorLost ({disruption})" if disruption else "CoordinatorLost"}
    msg = (f"{why}: restarting the coordinator and its {len(workers)} workers together "
           f"(the job resumes from its last checkpoint)")
    st["phase"], st["message"] = "Pending", msg
    st["pendingSince"] = now_iso(now)
    if st.get("pendingMove"):
        st["pendingMove"] = None  # its victim goes with the group
        set_condition(st, "Rebalancing", False, "GroupRestart", "move abandoned: the job restarts", now, gen)
    if delay > 0:
        st["nextRetryTime"] = now_iso(now + delay)
    note = f"not counted: {disruption}" if disruption else f"restart {st['restarts']}/{job.spec.backoff_limit}"
    rt.emit(body, "Warning", "CoordinatorLost", f"{msg}; {note}" + (f"; in {delay:g}s" if delay else ""))
    await writer.persist(st)  # before deleting: a crash in between must not count the loss twice
    doomed = workers + ([name] if coord is not None and not coord.deleting else [])
    await _delete_pods(rt, owner, doomed)
    for n in doomed:  # recreated once they are gone (names are fixed)
        pods[n] = dataclasses.replace(pods[n], deleting=True)
    return False


async def _handle_failed_workers(rt: Runtime, job: RLJob, body: Mapping[str, Any], owner: children.Owner,
                                 pods: dict[str, PodInfo], st: dict[str, Any], writer: StatusWriter, now: float,
                                 gen: int | None) -> bool:
    """Count, back off, recreate; disruptions are replaced at once and not counted. True when the job failed."""
    failed = [p for p in pods.values() if not p.deleting and p.role in children.WORKER_ROLES
              and p.phase in ("Failed", "Succeeded")]
    last_uid = (st.get("lastFailure") or {}).get("uid")
    new = [p for p in failed if p.uid != last_uid]
    counted = [p for p in new if not p.disruption]  # disruptions: see _count_disruptions
    if new:
        last = new[-1]
        st["lastFailure"] = {"pod": last.name, "uid": last.uid, "time": now_iso(now),
                             "reason": last.disruption or last.reason or "Failed"}
    if counted:
        restarts = int(st.get("restarts") or 0) + len(counted)
        first = counted[0]
        st["restarts"] = restarts
        limit = job.spec.backoff_limit
        if restarts > limit:
            msg = (f"{restarts} pod failures exceed spec.backoffLimit {limit} "
                   f"(last: {first.name}: {first.reason or 'Failed'})")
            _fail(st, "BackoffLimitExceeded", msg, now, gen)
            await writer.persist(st)
            await _delete_pods(rt, owner, [p.name for p in pods.values()
                                           if p.role in children.WORKER_ROLES and not p.deleting])
            return True
        delay = min(rt.config.restart_backoff_max, rt.config.restart_backoff_base * 2 ** (restarts - 1))
        st["nextRetryTime"] = now_iso(now + delay)
        rt.emit(body, "Warning", "PodFailed",
                f"{first.name} failed ({first.reason or 'Failed'}); restart {restarts}/{limit} in {delay:g}s")
    if new:
        await writer.persist(st)  # before deleting: a crash in between must not count the pod twice
    if failed:
        await _delete_pods(rt, owner, [p.name for p in failed])
        for p in failed:
            pods.pop(p.name, None)
    return False


def _count_disruptions(rt: Runtime, body: Mapping[str, Any], key: tuple[str, str], pods: Mapping[str, PodInfo],
                       st: dict[str, Any]) -> None:
    """Count every disrupted pod once (by UID) in ``status.disruptions``, with a Warning event."""
    for pod in pods.values():
        rt.note_disruption(key, pod)
    counted = rt.disruptions_counted.setdefault(key, set())
    for name, (uid, reason) in sorted(rt.disrupted.get(key, {}).items()):
        if uid and uid not in counted:
            counted.add(uid)
            st["disruptions"] = int(st.get("disruptions") or 0) + 1
            rt.emit(body, "Warning", "PodDisrupted", f"{name} was disrupted ({reason}); it is replaced without "
                    "counting against spec.backoffLimit")


def _complete(st: dict[str, Any], message: str, now: float, gen: int | None) -> None:
    st["phase"], st["message"] = "Complete", message
    set_condition(st, "Complete", True, "JobComplete", message, now, gen)
    set_condition(st, "Ready", False, "Complete", message, now, gen)


def _fail(st: dict[str, Any], reason: str, message: str, now: float, gen: int | None) -> None:
    """Phase Failed with the reason on Failed and Ready; the caller releases the workers in the same tick."""
    st["phase"], st["message"] = "Failed", message
    set_condition(st, "Failed", True, reason, message, now, gen)
    set_condition(st, "Ready", False, reason, message, now, gen)
    if st.get("pendingMove"):
        st["pendingMove"] = None
        set_condition(st, "Rebalancing", False, reason, "move abandoned: the job failed", now, gen)


async def _move(rt: Runtime, job: RLJob, owner: children.Owner, pending: actuator.PendingMove,
                st: dict[str, Any], writer: StatusWriter, gen: int | None) -> bool:
    def emit(kind: str, reason: str, message: str) -> None:
        rt.emit(writer.body, kind, reason, message)

    # Remembered until the move completes: a drain whose move is abandoned may still retire the victim.
    drained = rt.drained.setdefault((owner.namespace, owner.name), set())
    drained.add(pending.victim)
    done = await actuator.execute(
        job=job, owner=owner, pending=pending, status=st, kube=rt.kube, coord=rt.coord, persist=writer.persist,
        known_token=rt.tokens.get((owner.namespace, owner.name), ""),
        now=rt.clock, drain_timeout=float(job.spec.elastic.drain_timeout_seconds), drain_poll=rt.config.drain_poll,
        generation=gen, emit=emit)
    if done:
        drained.discard(pending.victim)
    return done


async def _observe_coordinator(rt: Runtime, job: RLJob, owner: children.Owner, st: dict[str, Any],
                               writer: StatusWriter, pods: dict[str, PodInfo], alloc: dict[str, int],
                               gen: int | None, now: float, key: tuple[str, str]) -> None:
    backing_off = rt.coord.backing_off(*key)
    if backing_off is not None:
        return  # keep the last verdict until the backoff expires
    try:
        data = await rt.coord.status(owner.namespace, owner.name)
    except CoordinatorError as exc:
        m.count_coordinator_error(*key)
        if st.get("phase") == "Pending":
            # Starting up: the coordinator pod may not be scheduled or listening yet; that is not degraded.
            st["message"] = f"waiting for the coordinator to answer GET /status ({str(exc)[:200]})"
            return
        if (get_condition(st, "Degraded") or {}).get("reason") != "ImmutableFieldChanged":
            reason = "CoordinatorResponseInvalid" if isinstance(exc, InvalidStatus) else "CoordinatorUnreachable"
            set_condition(st, "Degraded", True, reason, f"{exc}; no rebalancing until it answers", now, gen)
        return
    if (get_condition(st, "Degraded") or {}).get("reason") in COORDINATOR_PROBLEMS:
        set_condition(st, "Degraded", False, "AsExpected", "coordinator reachable", now, gen)
    signals = Signals.from_status(data)
    step = int(data.get("step") or 0)
    if step > int(st.get("step") or 0):
        st["progressAt"] = now_iso(now)
    st["step"] = step
    st["weightVersion"] = int(data.get("weightVersion") or 0)
    accept = data.get("acceptanceLength")
    st["rollout"] = {
        "queueDepth": signals.queue_depth,
        "activeSequences": signals.active_sequences,
        "longTail": signals.long_tail,
        # Rounded so that jitter in throughput does not turn every poll into a status write.
        "tokensPerSecond": round(float(data.get("tokensPerSecond") or 0.0), 0),
        "acceptanceLength": None if accept is None else round(float(accept), 2),
        "specDecodeEnabled": bool(data.get("specDecodeEnabled")),
    }
    if signals.complete or data.get("phase") == "Complete":
        _complete(st, f"coordinator reports the job complete at step {st['step']}", now, gen)
        return
    if data.get("phase") == "Failed":
        _fail(st, "CoordinatorFailed", f"coordinator reports the job failed at step {st['step']}", now, gen)
        return
    if st.get("phase") == "Pending":
        st["phase"], st["message"] = "Running", f"coordinator phase {data.get('phase', 'Rollout')}"
    elif st.get("phase") == "Running":
        st["message"] = f"coordinator phase {data.get('phase', 'Rollout')}"

    members = rt.members.setdefault(key, set())
    for w in signals.workers:
        if w.state != "retired" and w.name in pods:
            members.add((w.name, pods[w.name].uid))
    if st.get("phase") != "Running":
        return
    cfg = PolicyConfig.from_spec(job.spec)
    if await _finish_retired(rt, job, owner, st, writer, pods, alloc, signals, cfg, gen, key):
        return
    last_t = parse_iso((st.get("lastRebalance") or {}).get("time"))
    last = LastMove(last_t, st["lastRebalance"].get("fromRole", ""), st["lastRebalance"].get("toRole", "")) \
        if last_t is not None else None
    active = tuple(n for n, p in pods.items() if not p.deleting and p.role in children.WORKER_ROLES)
    unready = tuple(n for n in active if not pods[n].ready)
    decision = decide(signals, Allocation(alloc["trainer"], alloc["rollout"], active, unready), cfg, now, last,
                      rt.streaks.get(key, Streak()))
    rt.streaks[key] = decision.streak
    if decision.move is None:
        if decision.want is not None:
            log.debug("%s/%s: %s held: %s", *key, decision.want.reason, decision.held)
        return
    for _ in range(decision.move.count):
        pending = actuator.plan(decision.move, owner, list(pods))
        if pending is None:
            return
        log.info("%s/%s: %s -> %s (%s): drain %s, then create %s", *key, pending.from_role, pending.to_role,
                 pending.reason, pending.victim, pending.new_pod)
        if not await _move(rt, job, owner, pending, st, writer, gen):
            return
        _moved(owner, pods, alloc, st, pending)


def _moved(owner: children.Owner, pods: dict[str, PodInfo], alloc: dict[str, int], st: dict[str, Any],
           pending: actuator.PendingMove) -> None:
    pods.pop(pending.victim, None)
    role, idx = children.parse_pod_name(owner.name, pending.new_pod) or (pending.to_role, 0)
    pods[pending.new_pod] = PodInfo(pending.new_pod, role, idx, "", "", False)
    alloc.update({r: st["allocation"][r]["replicas"] for r in children.WORKER_ROLES})


async def _finish_retired(rt: Runtime, job: RLJob, owner: children.Owner, st: dict[str, Any],
                          writer: StatusWriter, pods: dict[str, PodInfo], alloc: dict[str, int], signals: Signals,
                          cfg: PolicyConfig, gen: int | None, key: tuple[str, str]) -> bool:
    """A pod the coordinator retired outside a move in flight holds a GPU for nothing: finish its move.

    A drain the operator sent (its move abandoned after a failed request, or lost) becomes the move it was
    meant to be, when the bounds still allow it; any other retired pod is deleted and replaced in its role.
    Only pods the coordinator listed as members before count (a new pod reusing a retired name is listed
    ``retired`` until it registers). True when something was done (no policy move this tick).
    """
    members = rt.members.get(key, set())
    victim = next((w.name for w in signals.workers if w.state == "retired" and w.name in pods
                   and not pods[w.name].deleting and (w.name, pods[w.name].uid) in members), None)
    if victim is None:
        return False
    role = pods[victim].role
    other: Role = "rollout" if role == "trainer" else "trainer"
    drained = victim in rt.drained.get(key, set())
    if drained and role in ROLES and cfg.enabled \
            and room(Allocation(alloc["trainer"], alloc["rollout"]), cfg, role, other) > 0:
        pending = actuator.plan(Move(role, other, 1, "RetiredWorker", victim,
                                     f"{victim} was retired by the coordinator outside a move"), owner, list(pods))
        if pending is not None and await _move(rt, job, owner, pending, st, writer, gen):
            _moved(owner, pods, alloc, st, pending)
        return True
    rt.emit(writer.body, "Warning", "RetiredWorker",
            f"{victim} was retired by the coordinator; deleting it so that a fresh {role} pod replaces it")
    await _delete_pods(rt, owner, [victim])
    pods.pop(victim, None)
    return True
