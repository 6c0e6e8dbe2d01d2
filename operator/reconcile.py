"""Level-based reconciliation of one RLJob: observed children + coordinator signals -> writes + status.

Every trigger (create, resume after an operator restart, spec update, the periodic timer) runs the same
:func:`reconcile`: it recomputes what the job should own from the spec and ``status.allocation``,
compares it with the pods kopf's index has observed, creates what is missing and deletes what is extra.
Names are deterministic (``{job}-{role}-{index}``), so a repeated or concurrent create is a 409, never a
duplicate. Writes happen only when something differs; the status is patched only when it changed.

Decisions live in pure modules (:mod:`children`, :mod:`rebalance`, :mod:`status`); this module sequences
them and talks to the adapters (:class:`KubeClient`, :class:`CoordinatorClient`).
"""

from __future__ import annotations

import asyncio
import copy
import json
import logging
import os
import secrets
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from pydantic import ValidationError
from specrl.operator import actuator, children
from specrl.operator import metrics as m
from specrl.operator.coordinator_client import CoordinatorClient, CoordinatorError
from specrl.operator.kube import KubeClient
from specrl.operator.rebalance import (
    Allocation,
    LastMove,
    PolicyConfig,
    Signals,
    Streak,
    decide,
    possible_moves,
)
from specrl.operator.status import (
    condition_true,
    get_condition,
    managed,
    now_iso,
    parse_iso,
    set_condition,
    status_patch,
    transitions,
)
from specrl.runtime.api import RLJob, problems_from

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
                   phase=str(st.get("phase") or ""), deleting=bool(meta.get("deletionTimestamp")), reason=reason)


@dataclass
class OperatorConfig:
    coordinator_url_template: str = "http://{name}-coordinator.{namespace}.svc:8000"
    poll_interval: float = 10.0
    # Pod failures: recreate after base * 2^(n-1) seconds (capped), up to spec.backoffLimit.
    restart_backoff_base: float = float(os.environ.get("SPECRL_OPERATOR_RESTART_BACKOFF", "10"))
    restart_backoff_max: float = 300.0
    drain_poll: float = 1.0


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
                p = pods[name]
                pods[name] = PodInfo(p.name, p.role, p.index, p.uid, p.phase, True, p.reason)


class TrackingKube:
    """The API client, noting every pod write in the job's :class:`Expectations`."""

    def __init__(self, kube: KubeClient, exp: Expectations) -> None:
        self._kube, self._exp = kube, exp

    def __getattr__(self, name: str) -> Any:
        return getattr(self._kube, name)

    async def create(self, obj: Mapping[str, Any]) -> bool:
        created = await self._kube.create(obj)
        if obj["kind"] == "Pod":
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

    def lock(self, key: tuple[str, str]) -> asyncio.Lock:
        return self.locks.setdefault(key, asyncio.Lock())

    def forget(self, key: tuple[str, str]) -> None:
        self.locks.pop(key, None)
        self.streaks.pop(key, None)
        self.expectations.pop(key, None)
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
    if status.get("phase") != "Running":
        set_condition(status, "Ready", False, status.get("phase") or "Pending",
                      f"job is {status.get('phase') or 'Pending'}; {len(running)}/{len(want)} pods running", now, gen)
    elif len(running) == len(want):
        set_condition(status, "Ready", True, "AllPodsRunning", f"{len(want)}/{len(want)} pods running", now, gen)
    else:
        set_condition(status, "Ready", False, "PodsNotReady", f"{len(running)}/{len(want)} pods running", now, gen)


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


async def _create_static(rt: Runtime, desired: children.Desired, job: RLJob, owner: children.Owner,
                         update_config: bool) -> None:
    async def one(obj: dict[str, Any]) -> None:
        created = await rt.kube.create(obj)
        m.API_WRITES.labels("create", obj["kind"]).inc()
        if not created and update_config and obj["kind"] == "ConfigMap":
            await rt.kube.patch(obj["kind"], owner.namespace, obj["metadata"]["name"], {"data": obj["data"]})
            m.API_WRITES.labels("patch", "ConfigMap").inc()

    await asyncio.gather(*(one(obj) for obj in desired.static.values()))


async def _delete_pods(rt: Runtime, owner: children.Owner, names: Iterable[str]) -> int:
    names = list(names)
    await asyncio.gather(*(rt.kube.delete("Pod", owner.namespace, n) for n in names))
    if names:
        m.API_WRITES.labels("delete", "Pod").inc(len(names))
    return len(names)


async def reconcile(rt: Runtime, body: Mapping[str, Any], observed: Iterable[PodInfo], trigger: str) -> dict[str, Any]:
    """Converge one job; returns the status patch still to apply (the caller hands it to kopf)."""
    owner = children.Owner.from_body(body)
    key = (owner.namespace, owner.name)
    with m.reconciling(trigger):
        async with rt.lock(key):
            exp = rt.expectations.setdefault(key, Expectations())
            pods = {p.name: p for p in observed}
            exp.apply(owner.name, pods, time.monotonic())
            local = copy.copy(rt)
            local.kube = TrackingKube(rt.kube, exp)  # type: ignore[assignment]
            return await _reconcile(local, body, pods, trigger, owner, key)


async def _reconcile(rt: Runtime, body: Mapping[str, Any], pods: dict[str, PodInfo], trigger: str,
                     owner: children.Owner, key: tuple[str, str]) -> dict[str, Any]:
    now = rt.clock()
    gen = (body.get("metadata") or {}).get("generation")
    writer = StatusWriter(rt, body, owner)
    st = copy.deepcopy(writer.current)
    if gen is not None:
        st["observedGeneration"] = gen
    full = trigger != "timer"  # handlers (create/resume/update) also ensure the job-level objects

    job, problem = _validate(body)
    if job is None:
        st["phase"], st["message"] = "Failed", f"invalid spec: {problem}"
        set_condition(st, "Failed", True, "InvalidSpec", problem, now, gen)
        set_condition(st, "Ready", False, "InvalidSpec", problem, now, gen)
        return writer.final(st)
    if get_condition(st, "Failed") and get_condition(st, "Failed").get("reason") == "InvalidSpec":
        # The spec was fixed: start over as a fresh job.
        st = {k: v for k, v in st.items() if k in ("observedGeneration",)}

    if not writer.deleting:
        m.expect_rebalances(*key, possible_moves(job.spec.mode))
    applied = st.setdefault("applied", {})
    applied.setdefault("model", IMMUTABLE[0][1](job))
    applied.setdefault("image", children.image_of(job))
    job, changes = _with_applied(job, applied)
    alloc = _allocation(job, st)
    desired_alloc = dict(alloc)
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
    elif get_condition(st, "Degraded") and get_condition(st, "Degraded").get("reason") == "ImmutableFieldChanged":
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

    # ---- failed pods: count, back off, recreate; past backoffLimit the job fails ---------------------
    failed = [p for p in pods.values() if not p.deleting and (p.phase == "Failed" or
              (p.phase == "Succeeded" and p.role in children.WORKER_ROLES))]
    coordinator_done = any(p.role == "coordinator" and p.phase == "Succeeded" for p in pods.values())
    last_uid = (st.get("lastFailure") or {}).get("uid")
    new_failures = [p for p in failed if p.uid != last_uid]
    if new_failures:
        restarts = int(st.get("restarts") or 0) + len(new_failures)
        first = new_failures[0]
        st["restarts"] = restarts
        st["lastFailure"] = {"pod": new_failures[-1].name, "uid": new_failures[-1].uid, "time": now_iso(now),
                             "reason": new_failures[-1].reason or "Failed"}
        limit = job.spec.backoff_limit
        if restarts > limit:
            msg = (f"{restarts} pod failures exceed spec.backoffLimit {limit} "
                   f"(last: {first.name}: {first.reason or 'Failed'})")
            st["phase"], st["message"] = "Failed", msg
            set_condition(st, "Failed", True, "BackoffLimitExceeded", msg, now, gen)
            set_condition(st, "Ready", False, "BackoffLimitExceeded", msg, now, gen)
            await writer.persist(st)
            await _delete_pods(rt, owner, [p.name for p in pods.values()
                                           if p.role in children.WORKER_ROLES and not p.deleting])
            return writer.final(st)
        delay = min(rt.config.restart_backoff_max, rt.config.restart_backoff_base * 2 ** (restarts - 1))
        st["nextRetryTime"] = now_iso(now + delay)
        rt.emit(body, "Warning", "PodFailed",
                f"{first.name} failed ({first.reason or 'Failed'}); restart {restarts}/{limit} in {delay:g}s")
        await writer.persist(st)  # before deleting: a crash in between must not count the pod twice
    if failed:
        await _delete_pods(rt, owner, [p.name for p in failed])
        for p in failed:
            pods.pop(p.name, None)

    # ---- a move interrupted by an operator restart is finished first ---------------------------------
    if st.get("pendingMove") and not suspended:
        pending = actuator.PendingMove.from_status(st["pendingMove"])
        await _move(rt, job, owner, pending, st, writer, gen)
        alloc = {r: st["allocation"][r]["replicas"] for r in children.WORKER_ROLES}

    # ---- converge the children ------------------------------------------------------------------------
    existing = list(pods)
    token = secrets.token_urlsafe(32) if full else ""
    desired = children.desired(job, owner, alloc, existing, token=token, workers=not suspended)
    if full:
        await _create_static(rt, desired, job, owner, update_config=trigger == "update")
    retry_at = parse_iso(st.get("nextRetryTime"))
    missing = [n for n in desired.pods if n not in pods]
    if missing and retry_at is not None and now < retry_at:
        missing = []  # restart backoff: the timer creates them once it expires
    elif retry_at is not None and now >= retry_at:
        st.pop("nextRetryTime", None)
    extra = [n for n, p in pods.items() if n not in desired.pods and not p.deleting]
    await asyncio.gather(*(rt.kube.create(desired.pods[n]) for n in missing))
    if missing:
        m.API_WRITES.labels("create", "Pod").inc(len(missing))
    await _delete_pods(rt, owner, extra)

    # ---- coordinator: progress, completion, rebalancing -------------------------------------------------
    if trigger == "timer" and not suspended and any(p.role == "coordinator" for p in pods.values()):
        await _observe_coordinator(rt, job, owner, st, writer, pods, alloc, gen, now, key)
    if coordinator_done and st.get("phase") not in ("Complete", "Failed"):
        _complete(st, "the coordinator exited successfully", now, gen)
    if st.get("phase") == "Complete":
        await _delete_pods(rt, owner, [p.name for p in pods.values()
                                       if p.role in children.WORKER_ROLES and not p.deleting])

    alloc_now = {r: st["allocation"][r]["replicas"] for r in children.WORKER_ROLES}
    want = children.desired(job, owner, alloc_now, list(pods), workers=not suspended).pods
    if st.get("phase") not in ("Complete", "Failed", "Suspended"):
        _ready_condition(st, want, pods, now, gen)
    del desired_alloc
    return writer.final(st)


def _complete(st: dict[str, Any], message: str, now: float, gen: int | None) -> None:
    st["phase"], st["message"] = "Complete", message
    set_condition(st, "Complete", True, "JobComplete", message, now, gen)
    set_condition(st, "Ready", False, "Complete", message, now, gen)


async def _move(rt: Runtime, job: RLJob, owner: children.Owner, pending: actuator.PendingMove,
                st: dict[str, Any], writer: StatusWriter, gen: int | None) -> bool:
    def emit(kind: str, reason: str, message: str) -> None:
        rt.emit(writer.body, kind, reason, message)

    return await actuator.execute(
        job=job, owner=owner, pending=pending, status=st, kube=rt.kube, coord=rt.coord, persist=writer.persist,
        now=rt.clock, drain_timeout=float(job.spec.elastic.drain_timeout_seconds), drain_poll=rt.config.drain_poll,
        generation=gen, emit=emit)


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
            st["message"] = "waiting for the coordinator to answer GET /status"
            return
        if (get_condition(st, "Degraded") or {}).get("reason") != "ImmutableFieldChanged":
            set_condition(st, "Degraded", True, "CoordinatorUnreachable",
                          f"{exc}; no rebalancing until it answers", now, gen)
        return
    if (get_condition(st, "Degraded") or {}).get("reason") == "CoordinatorUnreachable":
        set_condition(st, "Degraded", False, "AsExpected", "coordinator reachable", now, gen)
    signals = Signals.from_status(data)
    st["step"] = int(data.get("step") or 0)
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
        msg = "coordinator reports the job failed"
        st["phase"], st["message"] = "Failed", msg
        set_condition(st, "Failed", True, "CoordinatorFailed", msg, now, gen)
        return
    if st.get("phase") == "Pending":
        st["phase"], st["message"] = "Running", f"coordinator phase {data.get('phase', 'Rollout')}"
    elif st.get("phase") == "Running":
        st["message"] = f"coordinator phase {data.get('phase', 'Rollout')}"

    if st.get("phase") != "Running":
        return
    cfg = PolicyConfig.from_spec(job.spec)
    last_t = parse_iso((st.get("lastRebalance") or {}).get("time"))
    last = LastMove(last_t, st["lastRebalance"].get("fromRole", ""), st["lastRebalance"].get("toRole", "")) \
        if last_t is not None else None
    active = tuple(n for n, p in pods.items() if not p.deleting and p.role in children.WORKER_ROLES)
    decision = decide(signals, Allocation(alloc["trainer"], alloc["rollout"], active), cfg, now, last,
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
        victim = pods.pop(pending.victim, None)
        role, idx = children.parse_pod_name(owner.name, pending.new_pod) or (pending.to_role, 0)
        pods[pending.new_pod] = PodInfo(pending.new_pod, role, idx, "", "", False)
        del victim
        alloc.update({r: st["allocation"][r]["replicas"] for r in children.WORKER_ROLES})
