"""Weight sync between real processes over gloo on loopback.

One run of three processes (trainer-0, rollout-0, rollout-1; see sync_worker.py `scenario_lifecycle`) goes
through versions 1..7: normal syncs to two receivers, a sender-side abort, a drain (3 -> 2 members) and a
re-join (2 -> 3), and a sender that dies mid-transfer. The tests below check what each member observed.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration

WORKER = Path(__file__).with_name("sync_worker.py")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_members(scenario: str, world: int, timeout: float = 90) -> dict[int, list[dict]]:
    port = _free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), scenario, str(r), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(world)]
    results: dict[int, list[dict]] = {}
    try:
        for rank, p in enumerate(procs):
            stdout, stderr = p.communicate(timeout=timeout)
            lines = [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]
            assert lines, f"rank {rank} of {scenario!r} printed no result (exit {p.returncode}):\n{stderr[-3000:]}"
            results[rank] = lines
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


@pytest.fixture(scope="module")
def lifecycle() -> dict[int, list[dict]]:
    return run_members("lifecycle", 3)


def test_sender_sees_every_version_and_membership(lifecycle: dict[int, list[dict]]) -> None:
    first, *rest = lifecycle[0]
    assert first["log"][2] == [3, "aborted", 3, True]
    assert [(v, what, world) for v, what, world, *_ in first["log"]] == [
        (1, "sent", 3), (2, "sent", 3), (3, "aborted", 3), (4, "sent", 3), (5, "sent", 2), (6, "sent", 3)]
    buckets, nbytes = first["log"][0][3], first["log"][0][4]
    assert buckets > 10  # many buckets, one tensor spans several of them
    assert first["sync_bytes"] == 5 * nbytes and first["failures"] == 1 and first["version_metric"] == 6
    assert rest == []  # the sender died in v7 as the scenario intends, and said nothing more


def test_two_receivers_get_identical_weights_after_each_swap(lifecycle: dict[int, list[dict]]) -> None:
    log0 = lifecycle[1][-1]["log"]
    assert log0[:2] == [[1, "ok", 3, True, True], [2, "ok", 3, True, True]]  # torch.equal, tied weights kept
    assert log0[3] == [4, "ok", 3, True, True]
    assert lifecycle[2][-1]["log"][:2] == log0[:2]


def test_aborted_transfer_keeps_old_weights(lifecycle: dict[int, list[dict]]) -> None:
    for rank in (1, 2):
        log = lifecycle[rank][-1]["log"]
        assert log[2] == [2, "kept", True, True, True]  # sender-side abort of v3: v2 stays installed, intact,
        #                                                the group stays usable (v4 then arrives on it)
        assert log[-1] == [6, "kept", True, True, False]  # sender died in v7: v6 stays; the group must be rebuilt
        assert lifecycle[rank][-1]["failures"] == 2 and lifecycle[rank][-1]["version_metric"] == 6


def test_rebuild_on_membership_change_3_2_3(lifecycle: dict[int, list[dict]]) -> None:
    r0, r1 = lifecycle[1][-1], lifecycle[2][-1]
    assert [e[:3] for e in r0["log"][4:6]] == [[5, "ok", 2], [6, "ok", 3]]
    assert [e[:3] for e in r1["log"][4:5]] == [[6, "ok", 3]]  # drained for v5, back for v6
    assert r0["epoch"] == r1["epoch"] == 2
