"""Where worker actors run: the one place that builds Ray actor options.

Locally every actor lands on the local Ray instance. In a cluster each worker's actor is pinned to the pod it
stands for: to that pod's Ray node by node ID when the coordinator knows it (a pod recreated under the same
name is another node), else through the pod's custom resource.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


def role_resource(role: str) -> str:
    """The Ray custom resource a pod of `role` advertises (`specrl_rollout`, `specrl_trainer`)."""
    return f"specrl_{role}"


def pod_resource(name: str) -> str:
    """The Ray custom resource only the pod called `name` advertises: pins that worker's actor to it."""
    return f"specrl_pod_{name}"


@dataclass
class Placement:
    """How worker actors are placed: locally (no resources) or pinned to a pod (its node, its resource)."""

    cluster: bool = False
    gpus_per_pod: int = 0  # spec.resources.gpusPerPod: each trainer/rollout actor holds its pod's GPUs

    def options(self, name: str, role: str, node_id: str | None = None) -> dict[str, Any]:
        import ray

        from ..devices import ray_num_gpus

        # Rollout actors take the weight transfer on a second thread while a chunk decodes (async mode);
        # trainer calls stay serial so drafter training and the GRPO step never overlap.
        opts: dict[str, Any] = {"num_cpus": 0, "max_concurrency": 4 if role == "rollout" else 1,
                                "max_restarts": 0}
        if self.cluster:
            opts["resources"] = {pod_resource(name): 0.001}
            # Ray then sets CUDA_VISIBLE_DEVICES for the actor: its local rank 0 is cuda:0 (devices.device_for).
            # A cluster with no GPU at all (pods run on CPU nodes) could never place such an actor: run on CPU.
            gpus = ray_num_gpus(self.gpus_per_pod, role)
            if gpus and not ray.cluster_resources().get("GPU", 0):
                log.warning("gpusPerPod=%d but the Ray cluster has no GPUs: %s runs on the CPU", gpus, name)
                gpus = 0
            opts["num_gpus"] = gpus
            if node_id:
                from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

                opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(node_id, soft=False)
        return opts


    def start(self, cls: type, name: str, role: str, node_id: str | None, series: Any, *args: Any) -> Any:
        """Start `name`'s worker actor of class `cls` with `args`; in a cluster, pinned to its pod and serving the
        pod's own metrics."""
        import ray

        actor: Any = ray.remote(cls).options(**self.options(name, role, node_id)).remote(*args)
        if self.cluster:
            serve_metrics_from(actor, name, role, series)
        return actor


def kill_actors(actors: dict[str, Any]) -> None:
    """Kill every actor of `actors` (best effort: some may be dead already) and forget them."""
    import ray

    for actor in list(actors.values()):
        try:
            ray.kill(actor)
        except Exception as exc:  # noqa: BLE001 - it may be dead already
            log.debug("kill at shutdown: %s", exc)
    actors.clear()


def serve_metrics_from(actor: Any, name: str, role: str, series: Any) -> None:
    """Have a pod's worker actor serve its own series on the pod's metrics port (metrics.serve_own_metrics);
    when it does, the coordinator stops exporting those series for it."""
    import ray

    from ..metrics import serve_own_metrics

    if ray.get(actor.__ray_call__.remote(serve_own_metrics, role)) is not None:
        series.serves_own(name)
