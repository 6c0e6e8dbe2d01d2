"""Weight sync orchestration: trainer rank 0 -> every active rollout worker, one packed transfer per step.

The side group (runtime/sync.py) cannot be resized: it is rebuilt, under a new epoch, whenever the sender or
the set of receivers differs from the group's.
"""

from __future__ import annotations

import logging
import time

from specrl.runtime.coordinator.rollouts import RolloutPool
from specrl.runtime.coordinator.shared import Shared
from specrl.runtime.coordinator.trainers import TrainerGroup

log = logging.getLogger(__name__)


class WeightSync:
    def __init__(self, shared: Shared, trainers: TrainerGroup, rollouts: RolloutPool) -> None:
        self.sh, self.trainers, self.rollouts = shared, trainers, rollouts
        self.epoch = -1
        self.members: list[str] = []
        self._built_for: tuple | None = None  # (trainer generation, receivers) the open group was built for

    def _open(self, receivers: list[str]) -> None:
        import ray

        self.epoch += 1
        trainer = self.trainers.first()
        host, port = ray.get(trainer.sync_address.remote())
        world = len(receivers) + 1
        refs = [trainer.open_sync_group.remote(host, port, world, self.epoch)]
        refs += [self.rollouts.actors[n].open_sync_group.remote(host, port, rank, world, self.epoch)
                 for rank, n in enumerate(receivers, start=1)]
        ray.get(refs)
        self.members = receivers
        self._built_for = (self.trainers.generation, tuple(receivers))

    def sync(self, version: int) -> dict[str, float]:
        """Send `version` to every schedulable rollout worker; returns {seconds, bytes, transfer_seconds}."""
        import ray

        receivers = self.rollouts.schedulable()
        if not receivers:
            with self.sh.lock:
                self.rollouts.version = version
            return {"seconds": 0.0, "bytes": 0}
        t0 = time.perf_counter()
        if self._built_for != (self.trainers.generation, tuple(receivers)):
            self._open(receivers)
        send = self.trainers.first().send_weights.remote(version)
        recvs = [self.rollouts.actors[n].receive_weights.remote(version) for n in self.members]
        out = ray.get(send)
        ray.get(recvs)
        seconds = time.perf_counter() - t0
        with self.sh.lock:
            self.rollouts.version = version
        cm = self.sh.cm
        cm.sync_duration.observe(out["seconds"])
        cm.sync_bytes.inc(out["bytes"])
        cm.weight_version.set(version)
        return {"seconds": seconds, "bytes": int(out["bytes"]) * len(recvs), "transfer_seconds": out["seconds"]}
