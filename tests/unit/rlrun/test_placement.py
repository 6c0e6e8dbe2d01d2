"""Placement.start: an actor pinned to a Ray node the scheduler does not see yet is retried, not fatal."""

from __future__ import annotations

from typing import Any

import pytest
import ray
from ray.exceptions import ActorUnschedulableError
from specrl.runtime.coordinator import placement as placement_mod
from specrl.runtime.coordinator.placement import Placement

NODE = "ab" * 28  # a well-formed Ray node ID


class _Handle:
    def __init__(self, args: tuple) -> None:
        self.args = args


class _Remote:
    def __init__(self, created: list) -> None:
        self.created = created

    def options(self, **opts: Any) -> _Remote:
        self.created.append(opts)
        return self

    def remote(self, *args: Any) -> _Handle:
        return _Handle(args)


@pytest.fixture
def cluster(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Ray's actor creation and node list replaced by recorders (the retry logic is what is under test; the
    join test runs it against a real Ray cluster)."""
    state: dict[str, Any] = {"created": [], "unschedulable_for": 0, "alive": True, "slept": []}

    def serve(actor: Any, name: str, role: str, series: Any) -> None:
        if state["unschedulable_for"] > 0:
            state["unschedulable_for"] -= 1
            raise ActorUnschedulableError("The node specified via NodeAffinitySchedulingStrategy doesn't exist")

    monkeypatch.setattr(ray, "remote", lambda cls: _Remote(state["created"]))
    monkeypatch.setattr(ray, "cluster_resources", dict)
    monkeypatch.setattr(ray, "nodes", lambda: [{"NodeID": NODE, "Alive": state["alive"]}])
    monkeypatch.setattr(placement_mod, "serve_metrics_from", serve)
    monkeypatch.setattr(placement_mod.time, "sleep", lambda s: state["slept"].append(s))
    return state


def test_a_just_registered_node_is_retried_until_the_actor_is_placed(cluster: dict[str, Any]) -> None:
    cluster["unschedulable_for"] = 3
    actor = Placement(cluster=True).start(object, "j-trainer-0", "trainer", NODE, None, "settings", 0)
    assert actor.args == ("settings", 0)
    assert len(cluster["created"]) == 4  # three unschedulable attempts, then placed
    assert cluster["slept"] == [0.25, 0.5, 1.0]


def test_a_dead_node_is_not_retried(cluster: dict[str, Any]) -> None:
    cluster["unschedulable_for"] = 1
    cluster["alive"] = False
    with pytest.raises(ActorUnschedulableError):
        Placement(cluster=True).start(object, "j-trainer-0", "trainer", NODE, None)
    assert len(cluster["created"]) == 1 and cluster["slept"] == []


def test_retries_stop_at_the_deadline(cluster: dict[str, Any], monkeypatch: pytest.MonkeyPatch) -> None:
    cluster["unschedulable_for"] = 1000
    monkeypatch.setattr(placement_mod, "PLACE_TIMEOUT_S", 5.0)
    clock = iter(range(1000))  # one second per look at the clock
    monkeypatch.setattr(placement_mod.time, "monotonic", lambda: float(next(clock)))
    with pytest.raises(ActorUnschedulableError):
        Placement(cluster=True).start(object, "j-rollout-1", "rollout", NODE, None)
    assert 1 < len(cluster["created"]) <= 6


def test_local_actors_are_not_probed(cluster: dict[str, Any]) -> None:
    cluster["unschedulable_for"] = 1  # would raise if probed
    Placement(cluster=False).start(object, "local-trainer-0", "trainer", None, None)
    assert len(cluster["created"]) == 1
