"""Weight sync orchestration: trainer rank 0 -> every active rollout worker, one packed transfer per step.

The side group (runtime/sync.py) cannot be resized: it is rebuilt, under a new epoch, whenever the sender or
the set of receivers differs from the group's.

Receivers that die: before a sync every receiver answers a ping (a dead one is left out and retired, its prompts
requeued). One that dies during the transfer makes the sender's collective fail fast (the peer's socket closes),
or, if it hangs, time out after `weightSync.timeoutSeconds` (the group's own timeout, also handed to NCCL, never
its 300 s watchdog default). Either way the sync is retried: the receivers are pinged again, the dead ones are left
out, the group is rebuilt over the survivors and the weights are sent again — at most `ATTEMPTS` times.
"""

from __future__ import annotations

import logging
import time

from .rollouts import RolloutPool
from .shared import Shared
from .trainers import TrainerGroup

log = logging.getLogger(__name__)

ATTEMPTS = 3
PING_TIMEOUT_S = 10.0


class SyncFailed(RuntimeError):
    """Weight sync did not succeed after leaving every dead receiver out `ATTEMPTS` times."""


class WeightSync:
    def __init__(self, shared: Shared, trainers: TrainerGroup, rollouts: RolloutPool) -> None:
        self.sh, self.trainers, self.rollouts = shared, trainers, rollouts
        self.epoch = -1
        self.members: list[str] = []
        self._built_for: tuple | None = None  # (trainer generation, receivers) the open group was built for

    def _open(self, receivers: list[str]) -> None:
        import ray

        self.epoch += 1
        self._built_for = None  # until every member joined
        trainer = self.trainers.first()
        # The sender's old store goes first: on a fixed port (the pod's declared sync port) a receiver that dials
        # while it still listens joins the old group, loses it a moment later, and the new one never fills.
        _get([trainer.close_sync_group.remote()], self.sh.settings.sync_timeout_s)
        host, port = ray.get(trainer.sync_address.remote())
        world = len(receivers) + 1
        refs = [trainer.open_sync_group.remote(host, port, world, self.epoch)]
        refs += [self.rollouts.actors[n].open_sync_group.remote(host, port, rank, world, self.epoch)
                 for rank, n in enumerate(receivers, start=1)]
        _get(refs, self.sh.settings.sync_timeout_s)
        self.members = receivers
        self._built_for = (self.trainers.generation, tuple(receivers))

    def _alive_receivers(self) -> list[str]:
        """The schedulable rollout workers that answer a ping; the others are retired as lost."""
        import ray

        names = self.rollouts.schedulable()
        refs = {n: self.rollouts.actors[n].ping.remote() for n in names}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=PING_TIMEOUT_S)
        alive = []
        for name, ref in refs.items():
            try:
                if ref not in ready:
                    raise TimeoutError(f"no answer within {PING_TIMEOUT_S:g}s")
                ray.get(ref)
                alive.append(name)
            except Exception as exc:  # noqa: BLE001 - dead, hung or unreachable: left out of the sync
                # a timeout is a hung worker (its pod lives: retired, the operator replaces it); an error is
                # a dead one (its pod failed and is being replaced: lost)
                self.rollouts.worker_lost(name, f"lost before weight sync: {type(exc).__name__}",
                                          died=not isinstance(exc, TimeoutError))
        return alive

    def sync(self, version: int) -> dict[str, float]:
        """Send `version` to every live rollout worker; returns {seconds, bytes, transfer_seconds, attempts}."""
        t0 = time.perf_counter()
        last: BaseException | None = None
        for attempt in range(1, ATTEMPTS + 1):
            receivers = self._alive_receivers()
            if not receivers:
                with self.sh.lock:
                    self.rollouts.version = version
                return {"seconds": 0.0, "bytes": 0}
            try:
                if self._built_for != (self.trainers.generation, tuple(receivers)):
                    self._open(receivers)
                out, n = self._transfer(version)
            except Exception as exc:  # noqa: BLE001 - a receiver (or the sender's link to it) failed: retry
                last = exc
                self._built_for = None
                self.sh.cm.sync_failures.inc()
                log.warning("weight sync of version %d failed (attempt %d/%d: %s); leaving dead receivers out "
                            "and rebuilding the group", version, attempt, ATTEMPTS, _first_line(exc))
                continue
            with self.sh.lock:
                self.rollouts.version = version
            cm = self.sh.cm
            cm.sync_duration.observe(out["seconds"])
            cm.sync_bytes.inc(out["bytes"])
            cm.weight_version.set(version)
            return {"seconds": time.perf_counter() - t0, "bytes": int(out["bytes"]) * n,
                    "transfer_seconds": out["seconds"], "attempts": attempt}
        raise SyncFailed(f"weight sync of version {version} failed {ATTEMPTS} times: {_first_line(last)}")

    def _transfer(self, version: int) -> tuple[dict, int]:
        send = self.trainers.first().send_weights.remote(version)
        recvs = [self.rollouts.actors[n].receive_weights.remote(version) for n in self.members]
        out = _get([send, *recvs], self.sh.settings.sync_timeout_s)[0]
        return out, len(recvs)


def _get(refs: list, timeout_s: float) -> list:
    """ray.get with a bound: the group's own timeout plus a margin for the actors' call overhead."""
    import ray

    return ray.get(refs, timeout=timeout_s + 30.0)


def _first_line(exc: BaseException | None) -> str:
    text = f"{type(exc).__name__}: {exc}" if exc is not None else "unknown"
    return text.strip().splitlines()[0][:300]
