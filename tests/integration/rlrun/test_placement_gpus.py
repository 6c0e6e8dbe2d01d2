"""Ray placement of a GPU job's actors: trainer and rollout request their pod's GPUs (`num_gpus`), the
coordinator none; a Ray cluster with no GPU at all (pods on CPU nodes) places them on the CPU instead of never."""

from __future__ import annotations

import pytest
from specrl.runtime.coordinator import Placement

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("cluster_gpus", [2, 0])
def test_actors_request_the_pods_gpus(cluster_gpus: int) -> None:
    ray = pytest.importorskip("ray")
    if ray.is_initialized():
        ray.shutdown()
    ray.init(num_cpus=1, num_gpus=cluster_gpus, include_dashboard=False, logging_level="WARNING")
    try:
        placement = Placement(cluster=True, gpus_per_pod=1)
        for role in ("trainer", "rollout"):
            opts = placement.options(f"job-{role}-0", role)
            assert opts["num_gpus"] == (1 if cluster_gpus else 0)
            assert opts["resources"] == {f"specrl_pod_job-{role}-0": 0.001}
        assert Placement(cluster=True, gpus_per_pod=0).options("job-rollout-0", "rollout")["num_gpus"] == 0
        assert "num_gpus" not in Placement().options("job-rollout-0", "rollout")  # local mode: the CPU
    finally:
        ray.shutdown()
