"""Weight sync between real processes over gloo on loopback.

One run of three processes (trainer-0, rollout-0, rollout-1; see sync_worker.py `scenario_lifecycle`) goes
through versions 1..9: normal syncs to two receivers, a sender-side abort, a drain (3 -> 2 members) and a
re-join (2 -> 3), a receiver that dies mid-transfer, and a sender that dies mid-transfer. The tests below
check what each member observed.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from specrl.runtime.ports import free_port

pytestmark = pytest.mark.integration

WORKER = Path(__file__).with_name("sync_worker.py")


def run_members(scenario: str, world: int, timeout: float = 120) -> dict[int, list[dict]]:
    port = free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    procs = [subprocess.Popen([sys.executable, str(WORKER), scenario, str(r), str(port)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for r in range(world)]
    results: dict[int, list[dict]] = {}
    try:
        for rank, p in enumerate(procs):
            stdout, stderr = p.communicate(timeout=timeout)
            results[rank] = [json.loads(ln) for ln in stdout.splitlines() if ln.startswith("{")]
            results[rank].append({"stderr": stderr[-3000:], "exit": p.returncode})
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    return results


@pytest.fixture(scope="module")
def lifecycle() -> dict[int, list[dict]]:
    return run_members("lifecycle", 3)


def report(lifecycle: dict[int, list[dict]], rank: int) -> dict:
    lines = lifecycle[rank]
    assert len(lines) >= 2, f"rank {rank} printed no result:\n{lines[-1]['stderr']}"
    return lines[0]


def test_sender_sees_every_version_and_membership(lifecycle: dict[int, list[dict]]) -> None:
    sender = report(lifecycle, 0)
    log = sender["log"]
    assert [(v, what, world) for v, what, world, *_ in log] == [
        (1, "sent", 3), (2, "sent", 3), (3, "aborted", 3), (4, "sent", 3), (5, "sent", 2), (6, "sent", 3),
        (7, "aborted", 3), (8, "sent", 2)]
    assert log[2][3] is True and log[6][3] is False  # clean abort keeps the group; a dead peer breaks it
    assert sender["closed_after_7"]  # ... and the sender closed its end so nobody waits for a timeout
    buckets, nbytes = log[0][3], log[0][4]
    assert buckets > 10  # many buckets, one tensor spans several of them
    assert sender["sync_bytes"] == 6 * nbytes and sender["failures"] == 2 and sender["version_metric"] == 8
    assert len(lifecycle[0]) == 2  # the sender died in v9 as the scenario intends, and said nothing more


def test_two_receivers_get_identical_weights_after_each_swap(lifecycle: dict[int, list[dict]]) -> None:
    log0 = report(lifecycle, 1)["log"]
    assert log0[:2] == [[1, "ok", 3, True, True], [2, "ok", 3, True, True]]  # torch.equal, tied weights kept
    assert log0[3] == [4, "ok", 3, True, True]
    assert report(lifecycle, 2)["log"][:2] == log0[:2]


def test_aborted_transfer_keeps_old_weights(lifecycle: dict[int, list[dict]]) -> None:
    for rank in (1, 2):
        # sender-side abort of v3: the same v2 state object stays installed, intact, and the group stays usable
        assert report(lifecycle, rank)["log"][2] == [2, "kept", True, True, True]
    r0 = report(lifecycle, 1)
    assert r0["log"][6] == [6, "kept", True, True, False]  # rollout-1 died in v7: v6 stays; group rebuilt
    assert r0["closed_after_7"] and r0["unblocked_s"] < 15  # failed fast, not at the 30 s timeout
    assert r0["log"][7] == [8, "ok", 2, True, True]
    assert r0["log"][8] == [8, "kept", True, True, False]  # the sender died in v9: v8 stays, intact
    assert r0["failures"] == 3 and r0["version_metric"] == 8


def test_rebuild_on_membership_change_3_2_3_2(lifecycle: dict[int, list[dict]]) -> None:
    r0, r1 = report(lifecycle, 1), report(lifecycle, 2)
    assert [e[:3] for e in r0["log"][4:6]] == [[5, "ok", 2], [6, "ok", 3]]
    assert [e[:3] for e in r1["log"][4:5]] == [[6, "ok", 3]]  # drained for v5, back for v6
    assert r0["epoch"] == 3 and r1["epoch"] == 2
    assert len(lifecycle[2]) == 2  # rollout-1 died in v7 as the scenario intends, and said nothing more
