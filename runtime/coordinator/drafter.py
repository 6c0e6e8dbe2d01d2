"""Drafter scheduling (TLT): train the drafter on idle capacity in the long tail of a step.

In sync mode a rollout worker with nothing left to decode trains a lent copy of the drafter master copy and
hands it back; otherwise the trainer rank 0, which waits for its samples anyway, trains it in place.
"""

from __future__ import annotations

import logging
import time
from typing import Any

from . import checkpoints
from .rollouts import RolloutPool
from .shared import Shared
from .trainers import TrainerGroup

log = logging.getLogger(__name__)

PING_TIMEOUT_S = 10.0  # a rollout worker that does not hand over its drafter copy within this is passed over


class DrafterScheduler:
    def __init__(self, shared: Shared, trainers: TrainerGroup, rollouts: RolloutPool) -> None:
        self.sh, self.trainers, self.rollouts = shared, trainers, rollouts
        self._running: tuple[Any, str] | None = None  # (ref, where)
        self._t0 = 0.0

    @property
    def running(self) -> bool:
        return self._running is not None

    def start(self, samples: list[dict], deadline_s: float) -> None:
        import ray

        seqs = [smp["prompt_ids"] + smp["response_ids"] for smp in samples]
        lens = [len(smp["prompt_ids"]) for smp in samples]
        max_steps = self.sh.settings.drafter_max_steps
        idle = self.rollouts.idle()
        self._t0 = time.perf_counter()
        if idle and self.sh.settings.mode == "sync":
            try:
                state = ray.get(self.trainers.first().drafter_state.remote())
            except Exception as exc:  # noqa: BLE001 - rank 0 died: the step's training recovers the trainers
                log.warning("no drafter round this step: trainer rank 0 is unreachable (%s)", type(exc).__name__)
                return
            if state is not None:
                ref = self.rollouts.actors[idle[0]].train_drafter.remote(state, seqs, lens, max_steps, deadline_s)
                self._running = (ref, idle[0])
                return
        name = self.trainers.names()[0]
        self._running = (self.trainers.actors[name].train_drafter.remote(seqs, lens, max_steps, deadline_s), name)

    def restore(self, checkpoint: str | None) -> str:
        """A new trainer rank 0 took over from one that died: it holds a drafter as loaded. It loads the drafter
        master copy of `checkpoint` (the newest complete one: weights, optimizer, replay buffer); when a rollout
        worker serves newer drafter weights (the last sync's), those replace the checkpoint's weights. Returns
        where the drafter weights now come from."""
        import ray

        first = self.trainers.first()
        version, where = -1, "loaded"
        if checkpoint and ray.get(first.load_drafter_checkpoint.remote(checkpoint)):
            version, where = checkpoints.checkpoint_version(checkpoint), checkpoint
        newest = self._newest_rollout_copy()
        if newest is not None and newest[1] > version:
            name, version, weights = newest
            state = ray.get(first.drafter_state.remote())
            ray.get(first.load_drafter_state.remote({**state, "model": weights}))
            where = f"{name} (version {version})"
        if where == "loaded":
            log.warning("trainer rank 0 died; no checkpoint or rollout worker holds its drafter: it starts again "
                        "from its loaded weights")
        else:
            log.info("drafter master copy restored from %s", where)
        return where

    def _newest_rollout_copy(self) -> tuple[str, int, dict[str, Any]] | None:
        """(worker, version, weights) of the newest drafter a live rollout worker serves; None if none answers."""
        import ray

        refs = {n: self.rollouts.actors[n].drafter_weights.remote() for n in self.rollouts.schedulable()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=PING_TIMEOUT_S) if refs else ([], [])
        best = None
        for name, ref in refs.items():
            try:
                got = ray.get(ref) if ref in ready else None
            except Exception as exc:  # noqa: BLE001 - a worker lost meanwhile: the pool finds out on its own
                log.debug("drafter weights from %s: %s", name, exc)
                continue
            if got is not None and (best is None or got[0] > best[1]):
                best = (name, got[0], got[1])
        return best

    def finish(self) -> dict:
        """Wait for the round started in this step; {steps, seconds, where}. A failed round keeps the old drafter."""
        import ray

        if self._running is None:
            return {"steps": 0, "seconds": 0.0}
        (ref, where), self._running = self._running, None
        try:
            out = ray.get(ref)
        except Exception as exc:  # noqa: BLE001 - a lost drafter round is not worth failing the step
            log.warning("drafter training on %s failed (%s); keeping the previous drafter", where, exc)
            out = {"steps": 0, "loss": float("nan")}
        if "state" in out:  # trained on a rollout worker: the master copy goes back to trainer rank 0
            try:
                ray.get(self.trainers.first().load_drafter_state.remote(out["state"]))
            except Exception as exc:  # noqa: BLE001 - rank 0 died: the round is lost with it
                log.warning("drafter round lost: trainer rank 0 is unreachable (%s)", type(exc).__name__)
                out = {"steps": 0, "loss": float("nan")}
        if out["steps"]:
            role = "trainer" if where in self.trainers.actors else "rollout"
            self.sh.series.of(where, role).drafter_train_steps.inc(out["steps"])
            self.sh.series.of(where, role).drafter_loss.set(out["loss"])
        return {"steps": int(out["steps"]), "seconds": time.perf_counter() - self._t0, "where": where}
