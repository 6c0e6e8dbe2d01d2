"""RLJob status: phase, kstatus-style conditions, and the minimal patch between two statuses.

Conditions follow the Kubernetes convention (``type``, ``status`` "True"/"False", ``reason``
CamelCase, ``message``, ``lastTransitionTime`` changing only when ``status`` flips,
``observedGeneration``), so ``kubectl wait --for=condition=Ready`` and kstatus/Helm ``--wait``
understand a job. Everything here is pure; the reconciler decides when to patch and posts Events
for the transitions this module reports.
"""

from __future__ import annotations

import copy
import datetime as dt
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

CONDITION_TYPES = ("Ready", "Rebalancing", "Suspended", "Complete", "Failed", "Degraded")
PHASES = ("Pending", "Running", "Suspended", "Complete", "Failed")
TERMINAL_PHASES = frozenset({"Complete"})

# Status keys the operator owns; anything else under status (kopf's bookkeeping) is left alone.
MANAGED_KEYS = (
    "phase", "message", "conditions", "observedGeneration", "allocation", "rollout", "step", "weightVersion",
    "lastRebalance", "restarts", "lastFailure", "nextRetryTime", "pendingMove", "applied",
    "disruptions", "pendingSince", "progressAt",
)


def now_iso(now: float) -> str:
    return dt.datetime.fromtimestamp(now, tz=dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_iso(value: str | None) -> float | None:
    if not value:
        return None
    try:
        return dt.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc).timestamp()
    except ValueError:
        return None


def get_condition(status: Mapping[str, Any], type_: str) -> dict[str, Any] | None:
    for cond in status.get("conditions") or ():
        if cond.get("type") == type_:
            return dict(cond)
    return None


def condition_true(status: Mapping[str, Any], type_: str) -> bool:
    cond = get_condition(status, type_)
    return bool(cond and cond.get("status") == "True")


def set_condition(
    status: dict[str, Any], type_: str, value: bool, reason: str, message: str, now: float, generation: int | None
) -> None:
    """Set one condition in place; ``lastTransitionTime`` moves only when the truth value flips."""
    conds = [dict(c) for c in status.get("conditions") or ()]
    text = "True" if value else "False"
    for cond in conds:
        if cond.get("type") == type_:
            if cond.get("status") != text:
                cond["lastTransitionTime"] = now_iso(now)
            cond.update(status=text, reason=reason, message=message)
            if generation is not None:
                cond["observedGeneration"] = generation
            break
    else:
        cond = {"type": type_, "status": text, "reason": reason, "message": message,
                "lastTransitionTime": now_iso(now)}
        if generation is not None:
            cond["observedGeneration"] = generation
        conds.append(cond)
    order = {t: i for i, t in enumerate(CONDITION_TYPES)}
    status["conditions"] = sorted(conds, key=lambda c: order.get(c.get("type", ""), len(order)))


def managed(status: Mapping[str, Any] | None) -> dict[str, Any]:
    return {k: copy.deepcopy(v) for k, v in (status or {}).items() if k in MANAGED_KEYS}


def status_patch(old: Mapping[str, Any], new: Mapping[str, Any]) -> dict[str, Any]:
    """The merge patch turning ``old`` into ``new`` for managed keys (None deletes); {} when equal.

    Top-level granularity on purpose: conditions are a list (merge patch replaces lists), and the
    nested objects are small.
    """
    patch: dict[str, Any] = {}
    for key in MANAGED_KEYS:
        if key in new:
            if old.get(key) != new[key]:
                patch[key] = copy.deepcopy(new[key])
        elif key in old and old[key] is not None:
            patch[key] = None
    return patch


@dataclass(frozen=True)
class Transition:
    type: str  # Normal | Warning
    reason: str
    message: str


def transitions(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[Transition]:
    """Events to post for a status change: the phase and every condition that flipped."""
    out: list[Transition] = []
    if old.get("phase") != new.get("phase") and new.get("phase"):
        phase = new["phase"]
        kind = "Warning" if phase == "Failed" else "Normal"
        msg = new.get("message") or f"phase {old.get('phase') or '(none)'} -> {phase}"
        out.append(Transition(kind, f"Phase{phase}", msg))
    for type_ in CONDITION_TYPES:
        before, after = get_condition(old, type_), get_condition(new, type_)
        if after is None:
            continue
        flipped = (before or {}).get("status") != after.get("status")
        reason_changed = before is not None and before.get("reason") != after.get("reason")
        if flipped and (before is not None or after.get("status") == "True") or (reason_changed and after["status"] == "True"):
            bad = type_ in ("Failed", "Degraded") and after["status"] == "True"
            out.append(Transition("Warning" if bad else "Normal", after.get("reason") or type_,
                                  f"{type_}={after['status']}: {after.get('message', '')}".rstrip(": ")))
    return out
