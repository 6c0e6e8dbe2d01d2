"""Membership: which pods are workers of the job, and who may join at the next step boundary.

In a cluster every trainer and rollout pod is a Ray node advertising `specrl_pod_<pod name>`; the coordinator
reads the live nodes from Ray. Pure functions here, so the rules are unit-testable without Ray.
"""

from __future__ import annotations

from collections.abc import Iterable

from specrl.runtime.scheduling import WorkerState, WorkerTable

ROLES = ("trainer", "rollout")


def members_from_nodes(nodes: list[dict], job: str) -> list[tuple[str, str]]:
    """(worker name, role) for every alive Ray node that advertises a specrl pod resource of this job."""
    out = []
    for node in nodes:
        if not node.get("Alive", node.get("alive", False)):
            continue
        res = node.get("Resources", node.get("resources_total", {})) or {}
        for key in res:
            if key.startswith("specrl_pod_"):
                name = key.removeprefix("specrl_pod_")
                for role in ROLES:
                    if name.startswith(f"{job}-{role}-"):
                        out.append((name, role))
    return sorted(set(out), key=lambda x: (x[1], _index_of(x[0])))


def _index_of(name: str) -> int:
    try:
        return int(name.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return 0


def joiners(found: Iterable[tuple[str, str]], table: WorkerTable, dead: set[str]) -> list[tuple[str, str]]:
    """The members found on live nodes that are not in the job yet (nor known dead)."""
    out = []
    for name, role in found:
        if name in dead or (name in table.workers and table.workers[name].state != WorkerState.RETIRED):
            continue
        out.append((name, role))
    return out
