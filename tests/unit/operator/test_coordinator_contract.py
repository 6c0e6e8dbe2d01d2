"""The operator's coordinator client against the runtime's real coordinator HTTP layer (DESIGN §3).

`specrl.runtime.coordinator_http.HttpServer` serves a view; the view here is the runtime's real membership
table (`WorkerTable`) plus fixed step signals, so the drain and retire semantics are the coordinator's own.
"""

from __future__ import annotations

import pytest
from specrl.operator import actuator, children
from specrl.operator.coordinator_client import CoordinatorClient, CoordinatorError, DrainRejected
from specrl.operator.rebalance import Signals
from specrl.runtime.coordinator_http import STATUS_KEYS, HttpServer
from specrl.runtime.scheduling import WorkerTable


class View:
    def __init__(self) -> None:
        self.table = WorkerTable()
        for name, role in (("j-trainer-0", "trainer"), ("j-trainer-1", "trainer"), ("j-rollout-0", "rollout")):
            self.table.add(name, role)

    def status(self) -> dict:
        return {"job": "j", "step": 3, "weightVersion": 3, "phase": "Rollout", "queueDepth": 90,
                "activeSequences": 32, "stepBatchSize": 64, "longTail": False, "trainerBacklog": 0,
                "tokensPerSecond": 1234.5, "acceptanceLength": 2.7, "specDecodeEnabled": True, "rewardMean": 0.4,
                "workers": self.table.as_status(), "complete": False}

    def drain(self, worker: str) -> dict:
        rec = self.table.drain(worker)
        return {"worker": worker, "state": rec.state.value}

    def metrics(self) -> tuple[bytes, str]:
        return b"", "text/plain; version=0.0.4"


@pytest.fixture
def server():
    view = View()
    srv = HttpServer(view, token="t0k").start()
    yield view, srv
    srv.stop()


async def test_status_and_drain_against_the_real_http_layer(server):
    view, srv = server
    client = CoordinatorClient(srv.url + "/")  # no placeholders: one coordinator for every job
    try:
        data = await client.status("ns", "j")
        assert set(STATUS_KEYS) - {"job", "rewardMean"} <= set(data)  # what the operator reads, validated
        s = Signals.from_status(data)
        assert (s.queue_depth, s.step_batch_size, s.phase) == (90, 64, "Rollout")
        assert await client.drain("ns", "j", "j-trainer-1", "t0k") == "draining"
        assert Signals.from_status(await client.status("ns", "j")).draining == ("j-trainer-1",)
        assert await client.drain("ns", "j", "j-nobody-0", "t0k") == "gone"
        with pytest.raises(DrainRejected) as err:
            await client.drain("ns", "j", "j-trainer-0", "wrong")
        assert err.value.status == 401
        with pytest.raises(DrainRejected) as err:  # the last trainer: refused, with the coordinator's reason
            await client.drain("ns", "j", "j-trainer-0", "t0k")
        assert err.value.status == 409
        assert str(err.value).endswith("-> HTTP 409: j-trainer-0 is the last active trainer worker; the job cannot "
                                       "run without one"), str(err.value)
        # The actuator waits until the coordinator retires the worker at its safe point.
        owner = children.Owner("j", "ns", "u")
        assert not await actuator.wait_retired(client, owner, "j-trainer-1", timeout=0.3, poll=0.05)
        view.table.retire("j-trainer-1")
        assert await actuator.wait_retired(client, owner, "j-trainer-1", timeout=2, poll=0.05)
    finally:
        await client.close()


async def test_unreachable_coordinator_raises_and_backs_off():
    client = CoordinatorClient("http://127.0.0.1:9/{namespace}/{name}", timeout=0.5)
    try:
        with pytest.raises(CoordinatorError) as err:
            await client.status("ns", "j")
        assert "127.0.0.1:9/ns/j/status" in str(err.value)
        assert client.backing_off("ns", "j") is not None
        client.forget("ns", "j")
        assert client.backing_off("ns", "j") is None
    finally:
        await client.close()
