"""Membership by identity (issue 12.3): a worker is its pod's Ray node, not its name; drains that would leave a
role empty are refused with 409 and a reason."""

from __future__ import annotations

import httpx
import pytest
from specrl.runtime.coordinator import pod_resource
from specrl.runtime.coordinator.membership import joiners, members_from_nodes
from specrl.runtime.coordinator_http import HttpServer
from specrl.runtime.scheduling import DrainRefused, WorkerState, WorkerTable


def _node(name: str, node_id: str, alive: bool = True) -> dict:
    return {"NodeID": node_id, "Alive": alive, "Resources": {pod_resource(name): 1}}


def test_a_drained_worker_stays_retired_while_its_pod_lives_and_a_recreated_pod_joins():
    t = WorkerTable()
    t.add("j-rollout-0", "rollout", "n0")
    t.add("j-rollout-1", "rollout", "n1")
    t.drain("j-rollout-1")
    t.retire("j-rollout-1")
    nodes = [_node("j-rollout-0", "n0"), _node("j-rollout-1", "n1")]
    # the pod of the drained worker still runs (the operator has not deleted it yet): not a joiner
    assert joiners(members_from_nodes(nodes, "j"), t) == []
    # the pod is deleted and recreated under the same name: another Ray node, a new member
    nodes[1] = _node("j-rollout-1", "n1b")
    (m,) = joiners(members_from_nodes(nodes, "j"), t)
    assert (m.name, m.role, m.node_id) == ("j-rollout-1", "rollout", "n1b")
    t.add(m.name, m.role, m.node_id)
    assert t.workers["j-rollout-1"].state == WorkerState.ACTIVE and t.active("rollout") == ["j-rollout-0",
                                                                                           "j-rollout-1"]
    # ... while the old identity can never come back
    with pytest.raises(ValueError, match="retired"):
        WorkerTable(retired_identities={"n1"}).add("j-rollout-1", "rollout", "n1")


def test_a_dead_worker_is_lost_not_retired_and_its_replacement_joins():
    # Lost, not retired: the operator deletes the pod of a retired worker by name, and by the time it reads a
    # dead worker's state the pod under that name is the replacement it already created.
    t = WorkerTable()
    t.add("j-trainer-0", "trainer", "n0")
    t.retire("j-trainer-0", lost=True)
    assert t.workers["j-trainer-0"].state == WorkerState.LOST
    assert t.as_status() == [{"name": "j-trainer-0", "role": "trainer", "state": "lost"}]
    # the dead node may still be listed alive for a moment: never a joiner
    assert joiners(members_from_nodes([_node("j-trainer-0", "n0")], "j"), t) == []
    (m,) = joiners(members_from_nodes([_node("j-trainer-0", "n0b")], "j"), t)
    assert t.add(m.name, m.role, m.node_id).state == WorkerState.ACTIVE


def test_a_second_pod_under_an_active_name_waits_until_the_first_is_retired():
    t = WorkerTable()
    t.add("j-trainer-0", "trainer", "a")
    nodes = [_node("j-trainer-0", "a"), _node("j-trainer-0", "b")]
    assert joiners(members_from_nodes(nodes, "j"), t) == []
    t.retire("j-trainer-0")  # the old pod's actor died
    assert [m.node_id for m in joiners(members_from_nodes(nodes, "j"), t)] == ["b"]


def test_draining_the_last_worker_of_a_role_is_refused():
    t = WorkerTable()
    t.add("j-trainer-0", "trainer")
    t.add("j-rollout-0", "rollout")
    t.add("j-rollout-1", "rollout")
    with pytest.raises(DrainRefused, match="last active trainer"):
        t.drain("j-trainer-0")
    t.drain("j-rollout-0")
    with pytest.raises(DrainRefused, match="j-rollout-1 is the last active rollout worker"):
        t.drain("j-rollout-1")
    assert t.workers["j-trainer-0"].state == WorkerState.ACTIVE
    assert t.workers["j-rollout-1"].state == WorkerState.ACTIVE


class _View:
    def __init__(self, table: WorkerTable) -> None:
        self.table = table

    def status(self) -> dict:
        return {"workers": self.table.as_status()}

    def drain(self, worker: str) -> dict:
        rec = self.table.drain(worker)
        return {"worker": worker, "state": rec.state.value}

    def metrics(self) -> tuple[bytes, str]:
        return b"", "text/plain"


def test_http_drain_answers_409_with_the_reason():
    t = WorkerTable()
    t.add("j-trainer-0", "trainer")
    server = HttpServer(_View(t), "tok").start()
    try:
        auth = {"Authorization": "Bearer tok"}
        r = httpx.post(server.url + "/drain", json={"worker": "j-trainer-0"}, headers=auth, timeout=10)
        assert r.status_code == 409
        assert r.json() == {"error": "j-trainer-0 is the last active trainer worker; the job cannot run without one"}
        assert httpx.post(server.url + "/drain", json={"worker": "x"}, headers=auth, timeout=10).status_code == 404
    finally:
        server.stop()
