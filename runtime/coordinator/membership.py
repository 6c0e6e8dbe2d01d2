"""Membership: which pods are workers of the job, and who may join at the next step boundary.

In a cluster every trainer and rollout pod is a Ray node advertising `specrl_pod_<pod name>`; the coordinator
reads the live nodes from Ray. Pure functions here, so the rules are unit-testable without Ray.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from ..scheduling import WorkerTable

ROLES = ("trainer", "rollout")


@dataclass(frozen=True)
class Member:
    """A worker pod as Ray sees it: its name, role, and identity (the Ray node ID of this incarnation)."""

    name: str
    role: str
    node_id: str


def members_from_nodes(nodes: list[dict], job: str) -> list[Member]:
    """Every alive Ray node that advertises a specrl pod resource of this job, by role and index."""
    out = []
    for node in nodes:
        if not node.get("Alive", node.get("alive", False)):
            continue
        res = node.get("Resources", node.get("resources_total", {})) or {}
        node_id = str(node.get("NodeID", node.get("node_id", "")))
        for key in res:
            if key.startswith("specrl_pod_"):
                name = key.removeprefix("specrl_pod_")
                for role in ROLES:
                    if name.startswith(f"{job}-{role}-"):
                        out.append(Member(name, role, node_id))
    return sorted(set(out), key=lambda m: (m.role, _index_of(m.name), m.node_id))


def _index_of(name: str) -> int:
    try:
        return int(name.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return 0


def joiners(found: Iterable[Member], table: WorkerTable) -> list[Member]:
    """The members found on live nodes that may join now.

    Never a retired identity (drained or lost: a drained pod's node lives on until the operator deletes it), never
    a second member under a name whose current member is not retired yet; a new identity under a retired name
    is a recreated pod: a new member.
    """
    out = []
    for m in found:
        if m.node_id in table.retired_identities:
            continue
        rec = table.workers.get(m.name)
        if rec is not None and not rec.state.gone:
            continue
        out.append(m)
    return out
