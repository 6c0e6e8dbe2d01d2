"""Executes one rebalancing move at a time: drain the named victim, wait, delete its pod, create the new one.

The order is what makes a move safe: the coordinator retires the victim at its next safe point and
requeues its unfinished prompts (``POST /drain``), the operator waits until ``GET /status`` reports it
``retired`` (or gone, or ``drainTimeoutSeconds`` pass), only then deletes the pod, and creates a pod of
the other role with the next free index. The move is written to ``status.pendingMove`` (victim and new
pod name) before anything happens, so an operator that dies half-way finishes the same move after a
restart instead of starting a different one; every step is idempotent (drain of an unknown worker is
404, delete of a missing pod is 404, create of an existing pod is 409).
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from . import children
from . import metrics as m
from .coordinator_client import CoordinatorClient, CoordinatorError, DrainRejected
from .kube import ApiError, KubeClient
from .rebalance import Move, pick_victim
from .status import now_iso, set_condition

log = logging.getLogger("specrl.operator.actuator")

Persist = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass(frozen=True)
class PendingMove:
    victim: str
    new_pod: str
    from_role: str
    to_role: str
    reason: str
    message: str = ""

    def to_status(self, now: float) -> dict[str, Any]:
        return {"victim": self.victim, "newPod": self.new_pod, "fromRole": self.from_role, "toRole": self.to_role,
                "reason": self.reason, "message": self.message, "startedAt": now_iso(now)}

    @classmethod
    def from_status(cls, data: dict[str, Any]) -> PendingMove:
        return cls(victim=str(data["victim"]), new_pod=str(data["newPod"]), from_role=str(data["fromRole"]),
                   to_role=str(data["toRole"]), reason=str(data.get("reason", "")), message=str(data.get("message", "")))


def plan(move: Move, owner: children.Owner, pod_names: list[str]) -> PendingMove | None:
    """Name the victim (the move's, else the highest index of the donor role) and the pod to create."""
    victim = move.victim if move.victim in pod_names else pick_victim(move.from_role, pod_names)
    if victim is None:
        return None
    taken = [p[1] for p in (children.parse_pod_name(owner.name, n) for n in pod_names) if p and p[0] == move.to_role]
    new_pod = children.pod_name(owner.name, move.to_role, children.next_free_index(taken))
    return PendingMove(victim, new_pod, move.from_role, move.to_role, move.reason, move.message)


async def read_token(kube: KubeClient, owner: children.Owner, known: str = "", job: Any = None) -> str:
    """The drain token from the job's Secret; a Secret deleted by hand is recreated with ``known`` (the token
    the running coordinator holds) when the operator knows it."""
    secret = await kube.get("Secret", owner.namespace, children.secret_name(owner.name))
    if not secret and known:
        await kube.create(children.secret(owner, known, job))
        m.API_WRITES.labels("create", "Secret").inc()
        return known
    if not secret:
        raise CoordinatorError(f"secret {children.secret_name(owner.name)} is missing: cannot authenticate a drain")
    data = secret.get("data") or {}
    if data.get("token"):
        return base64.b64decode(data["token"]).decode()
    # An API server turns stringData into data; a bare store (tests' emulator) keeps stringData.
    return str((secret.get("stringData") or {}).get("token", ""))


async def wait_retired(coord: CoordinatorClient, owner: children.Owner, worker: str, timeout: float,
                       poll: float) -> bool:
    """True once the coordinator reports ``worker`` retired or no longer lists it; False on timeout."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while True:
        try:
            status = await coord.status(owner.namespace, owner.name)
            states = {w.get("name"): w.get("state") for w in status.get("workers") or () if isinstance(w, dict)}
            if states.get(worker, "retired") == "retired":
                return True
        except CoordinatorError as exc:
            log.info("waiting for %s to retire: %s", worker, exc)
        if loop.time() >= deadline:
            return False
        await asyncio.sleep(min(poll, max(0.0, deadline - loop.time())))


async def execute(
    *,
    job: Any,
    owner: children.Owner,
    pending: PendingMove,
    status: dict[str, Any],
    kube: KubeClient,
    coord: CoordinatorClient,
    persist: Persist,
    now: Callable[[], float],
    drain_timeout: float,
    drain_poll: float,
    generation: int | None,
    emit: Callable[[str, str, str], None],
    known_token: str = "",
) -> bool:
    """Run (or finish) ``pending``; updates ``status`` in place and persists each stage. True if done."""
    if status.get("pendingMove") is None:
        status["pendingMove"] = pending.to_status(now())
        set_condition(status, "Rebalancing", True, pending.reason,
                      f"moving {pending.victim} -> {pending.new_pod}: {pending.message}".rstrip(": "), now(), generation)
        await persist(status)

    try:
        token = await read_token(kube, owner, known_token, job)
        state = await coord.drain(owner.namespace, owner.name, pending.victim, token)
    except CoordinatorError as exc:
        # The victim keeps running; the move is abandoned and may be chosen again later. A refusal (409) is the
        # coordinator's decision, with its reason (e.g. the last worker of a role), not a failure to reach it.
        status["pendingMove"] = None
        reason = "DrainRejected" if isinstance(exc, DrainRejected) and exc.status == 409 else "DrainFailed"
        set_condition(status, "Rebalancing", False, reason, str(exc), now(), generation)
        await persist(status)
        emit("Warning", reason, str(exc))
        return False
    if state != "gone":
        retired = await wait_retired(coord, owner, pending.victim, drain_timeout, drain_poll)
        if not retired:
            emit("Warning", "DrainTimeout",
                 f"{pending.victim} did not retire within {drain_timeout:g}s; deleting it anyway")

    await kube.delete("Pod", owner.namespace, pending.victim)
    m.API_WRITES.labels("delete", "Pod").inc()
    role, index = children.parse_pod_name(owner.name, pending.new_pod) or (pending.to_role, 0)
    try:
        await kube.create(children.pod(job, owner, role, index))
    except ApiError as exc:
        # Quota or admission refused the new pod: the move stands (the allocation says where the GPU
        # belongs) and the level-based loop creates the pod, with its create backoff.
        emit("Warning", "FailedCreate", f"creating {pending.new_pod} was refused: HTTP {exc.status}: {exc.message}")
    m.API_WRITES.labels("create", "Pod").inc()

    alloc = status.setdefault("allocation", {})
    gpus = children.gpus_per_pod(job)
    for r, delta in ((pending.from_role, -1), (pending.to_role, +1)):
        reps = int((alloc.get(r) or {}).get("replicas", 0)) + delta
        alloc[r] = {"replicas": reps, "gpus": reps * gpus}
    status["lastRebalance"] = {"time": now_iso(now()), "fromRole": pending.from_role, "toRole": pending.to_role,
                               "reason": pending.reason}
    status["pendingMove"] = None
    set_condition(status, "Rebalancing", False, "MoveComplete",
                  f"moved one pod {pending.from_role} -> {pending.to_role} ({pending.reason}): "
                  f"{pending.victim} drained and deleted, {pending.new_pod} created", now(), generation)
    await persist(status)
    m.count_rebalance(owner.namespace, owner.name, pending.from_role, pending.to_role, pending.reason)
    return True
