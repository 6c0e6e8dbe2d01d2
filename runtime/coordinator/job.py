"""The job coordinator: the step loop (sync/async) over the trainer group, the rollout pool, the drafter
scheduler and weight sync, plus the view the HTTP API serves (`status`, `drain`, `metrics`).

It drives trainer and rollout workers that are Ray actors. In local mode (`specrl run`) the coordinator is
itself a Ray actor on a local Ray instance; in a cluster it runs in the coordinator pod, which is the Ray
head, and places each worker's actor on that worker's pod (placement.py). The same `run_step` runs both.

One RL step:
1. the step's prompt draws (ids `s{step}-p{draw}`) enter the ledger's queue;
2. idle rollout workers get chunks of prompts (only when their weights are fresh enough: version n for
   step n in sync mode, at most `maxStaleness` versions old in async mode);
3. when the queue is empty and few sequences are left (the long tail) the trainer, idle until its samples
   arrive, trains the drafter on the step's finished rollouts;
4. the complete groups get group-normalised advantages and are split over the trainer ranks;
5. trainer rank 0 broadcasts the new policy (and drafter) to every active rollout worker in one packed
   transfer through the sync side group, rebuilt whenever membership changed.
In async mode step n+1's rollouts start while step n trains, on the previous weights.

The ledger proves nothing is lost or trained twice. A trainer that dies is dropped and the group re-formed from
a survivor, or the job rolls back to its newest complete checkpoint (recovery.py decides, `_recover_trainers`
acts); rollout workers that die are handled by the pool (rollouts.py).
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from typing import Any, TypeVar

from ..rl.settings import RunSettings
from ..scheduling import (
    Phase,
    PromptLedger,
    WorkerTable,
    is_long_tail,
    step_items,
    step_prompt_indices,
)
from . import checkpoints
from .drafter import DrafterScheduler
from .membership import joiners, members_from_nodes
from .placement import Placement
from .records import StepTimes, WorkerSeries, build_record
from .recovery import Action, Recovery, plan_recovery
from .rollouts import RolloutPool
from .shared import Shared
from .trainers import TrainerGroup, training_batch
from .weight_sync import WeightSync

log = logging.getLogger(__name__)
T = TypeVar("T")

RECOVERY_ATTEMPTS = 3  # trainer recoveries in a row within one step before the job gives up
REPLACEMENT_WAIT_S = 600.0  # how long a job with no trainer left waits for a recreated trainer pod


class RolledBack(Exception):
    """The job went back to a checkpoint (every trainer was lost): the step in progress is abandoned."""


class TrainerLost(RuntimeError):
    """Trainers died and the job cannot recover (see recovery.plan_recovery for why)."""


class JobCoordinator:
    """See the module docstring. Thread-safe for `status()`/`drain()` while `run_step()` runs."""

    def __init__(self, settings: RunSettings, *, token: str | None = None, placement: Placement | None = None,
                 http_host: str | None = None, http_port: int | None = None, resume_from: str | None = None,
                 metrics_registry: Any = None) -> None:
        from ..metrics import RuntimeMetrics
        from ..rollout_worker import load_problem_split

        self.settings = settings
        self.token = token if token is not None else secrets.token_urlsafe(24)
        self.placement = placement or Placement()
        cm = RuntimeMetrics(settings.job, settings.namespace, "coordinator", f"{settings.job}-coordinator",
                            registry=metrics_registry)
        self.registry = cm.registry
        self.sh = Shared(settings, cm, WorkerSeries(settings.job, settings.namespace, cm.registry))
        self.lock = self.sh.lock
        self.cm = cm
        self.trainer_group = TrainerGroup(self.sh, self.placement)
        self.pool = RolloutPool(self.sh, self.placement)
        self.weight_sync = WeightSync(self.sh, self.trainer_group, self.pool)
        self.drafter = DrafterScheduler(self.sh, self.trainer_group, self.pool)
        self.step = 0
        self.weight_version = 0  # version the trainers hold
        # Steps below this were trained once already: after a rollback to a checkpoint they are trained again
        # (the restored ledger counts them once; specrl_trainer_samples_retrained_total counts the repeat).
        self.trained_through = 0
        self.phase = Phase.STARTING
        self.long_tail = False
        # Sequences the rollout workers decode right now, by their own live counts (None: outside a step's rollout
        # phase, where the chunks in flight are the estimate).
        self.decoding: int | None = None
        self.last_samples: list[dict] = []  # the last trained step's rollouts (drafter training material)
        self.complete = False
        self.failed: str | None = None
        self.sd_enabled = settings.method != "none"
        self.reward_mean: float | None = None
        self.trainer_backlog = 0
        self.history: list[dict] = []
        self.recoveries: list[dict] = []  # one entry per trainer recovery: step, action, lost trainers, source
        self._resume_from = resume_from
        train, _ = load_problem_split(settings)
        self.dataset_size = len(train)
        if not settings.dataset.startswith("builtin:"):
            from ..rl.task import load_jsonl

            # Malformed lines were skipped with a warning; the count stays visible on the dashboard.
            cm.dataset_malformed_lines.inc(load_jsonl(
                settings.dataset, prompt_field=settings.prompt_field, answer_field=settings.answer_field).malformed)
        self.http = None
        if http_port is not None:
            from ..coordinator_http import HttpServer

            self.http = HttpServer(self, self.token, host=http_host or "127.0.0.1", port=http_port).start()

    # ------------------------------------------------------------------ views of the parts

    @property
    def ledger(self) -> PromptLedger:
        return self.sh.ledger

    @property
    def table(self) -> WorkerTable:
        return self.sh.table

    @property
    def trainers(self) -> dict[str, Any]:
        return self.trainer_group.actors

    @property
    def rollouts(self) -> dict[str, Any]:
        return self.pool.actors

    @property
    def rollout_version(self) -> int:
        return self.pool.version

    # ------------------------------------------------------------------ HTTP view (any thread)

    @property
    def url(self) -> str | None:
        return self.http.url if self.http else None

    def status(self) -> dict:
        with self.lock:
            s = self.settings
            last = self.history[-1] if self.history else None
            return {
                "job": s.job, "step": self.step, "weightVersion": self.weight_version, "phase": self.phase.value,
                "queueDepth": len(self.ledger.queue), "activeSequences": self.ledger.in_flight_count() * s.group_size,
                "stepBatchSize": s.step_batch,
                "longTail": self.long_tail, "trainerBacklog": self.trainer_backlog,
                "tokensPerSecond": round(self.pool.tokens_per_s, 3), "acceptanceLength": self.pool.last_acceptance,
                "specDecodeEnabled": self.sd_enabled, "rewardMean": self.reward_mean,
                "workers": self.table.as_status(), "complete": self.complete,
                "ledger": {"issued": self.ledger.issued, "trained": len(self.ledger.trained),
                           "dropped": len(self.ledger.dropped), "lost": self.ledger.lost()},
                "trainerRecoveries": list(self.recoveries),
                # where the last step's time went: the operator's rebalance policy balances roles on it
                "lastStep": ({"rolloutSeconds": round(last["rollout_seconds"], 3),
                              "longTailSeconds": round(last["long_tail_seconds"], 3),
                              "trainSeconds": round(last["train_seconds"], 3)} if last else None),
            }

    def drain(self, worker: str) -> dict:
        with self.lock:
            rec = self.table.drain(worker)  # KeyError -> 404
            log.info("drain requested for %s (%s)", worker, rec.state.value)
            return {"worker": worker, "state": rec.state.value}

    def metrics(self) -> tuple[bytes, str]:
        from ..metrics import render

        with self.lock:
            m = self.cm
            m.queue_depth.set(len(self.ledger.queue))
            live = self.decoding
            m.active_sequences.set(live if live is not None else self.ledger.in_flight_count() * self.settings.group_size)
            m.long_tail.set(1 if self.long_tail else 0)
            m.weight_version.set(self.weight_version)
            m.trainer_backlog.set(self.trainer_backlog)
            m.spec_decode_enabled.set(1 if self.sd_enabled else 0)
        return render(self.registry)

    # ------------------------------------------------------------------ membership

    def start(self, trainer_names: list[str] | None = None, rollout_names: list[str] | None = None,
              node_ids: dict[str, str] | None = None) -> None:
        """Create the worker actors (default: the replicas of the spec; in a cluster on the Ray nodes `node_ids`
        names), restore a checkpoint if asked, and ship the trainers' weights to every rollout worker."""
        s = self.settings
        node_ids = node_ids or {}
        self.trainer_group.start(trainer_names or [f"{s.job}-trainer-{i}" for i in range(s.trainers)], node_ids)
        for name in rollout_names or [f"{s.job}-rollout-{i}" for i in range(s.rollouts)]:
            self.pool.add(name, node_id=node_ids.get(name))
        self.pool.ping_all()
        if self._resume_from is None:  # a restarted job (or coordinator pod) resumes from the newest checkpoint
            self._resume_from = checkpoints.find_latest(self.trainer_group.first(), s.checkpoint_dir)
        if self._resume_from:
            self._restore(self._resume_from)
        # Version 0 (or the resumed version) goes out like every later one: a pod that resolved another revision
        # of the model, or a rollout worker that loaded it differently, never rolls out with its own copy.
        self.weight_sync.sync(self.weight_version)
        self.phase = Phase.ROLLOUT

    def add_rollout_worker(self, name: str, node_id: str | None = None) -> None:
        """A worker joins: it gets the trainers' current weights at once; the sync group is rebuilt."""
        import ray

        if self.settings.rollout_engine == "vllm":  # vLLM takes weights only over its NCCL transfer
            self.pool.add(name, node_id=node_id)
            self.weight_sync.sync(self.weight_version)
            return
        state = self._with_trainers(lambda: ray.get(self.trainer_group.first().sync_state.remote()))
        self.pool.add(name, (state, self.weight_version), node_id)

    def add_trainer_worker(self, name: str, node_id: str | None = None) -> None:
        """A trainer joins at the next step boundary (it copies rank 0's weights and optimizer state)."""
        self.trainer_group.request_join(name, node_id)

    def _handle_drains_and_joins(self) -> None:
        self.pool.retire_idle_draining()
        if self.placement.cluster:
            self._discover_joins()

    def _discover_joins(self) -> None:
        import ray

        for m in joiners(members_from_nodes(ray.nodes(), self.settings.job), self.table):
            if m.role == "rollout":
                if not self.trainer_group.actors:
                    continue  # it gets its weights from a trainer: it joins once one is back
                log.info("rollout worker %s joined (node %s)", m.name, m.node_id)
                self.add_rollout_worker(m.name, m.node_id)
            elif m.name not in self.trainer_group.pending:
                log.info("trainer %s joined (node %s); it enters the data-parallel group at the next step boundary",
                         m.name, m.node_id)
                self.trainer_group.request_join(m.name, m.node_id)

    # ------------------------------------------------------------------ the step loop

    def run(self, steps: int | None = None, on_step: Callable[[dict], object] | None = None) -> list[dict]:
        total = self.settings.steps if steps is None else steps
        while self.step < total:
            rec = self.run_step()
            if on_step is not None:
                on_step(rec)
        self.finish()
        return self.history

    def finish(self) -> None:
        with self.lock:
            self.phase = Phase.COMPLETE
            self.complete = True
            self.long_tail = False

    def _enqueue(self, step: int) -> None:
        if step in self.pool.results or step >= self.settings.steps:
            return
        s = self.settings
        with self.lock:
            self.ledger.enqueue(step_items(step, s.prompts_per_step, self.dataset_size, s.seed))
        self.pool.open_step(step)

    def _set_phase(self, phase: Phase) -> None:
        with self.lock:
            self.phase = phase

    def run_step(self) -> dict:
        """Run one RL step to completion (rollouts, drafter, training, sync); returns its record. When every
        trainer was lost and the job went back to a checkpoint, the step run is the one after it."""
        while True:
            try:
                return self._run_step()
            except RolledBack:
                continue

    def _run_step(self) -> dict:
        s = self.settings
        step = self.step
        t_step = time.perf_counter()
        self._enqueue(step)
        if s.mode == "async":
            for ahead in range(1, s.staleness + 1):
                self._enqueue(step + ahead)
        self._set_phase(Phase.ROLLOUT)
        rollout_s, tail_s = self._rollouts(step)
        drafter_info = self.drafter.finish()

        samples = training_batch(self.pool.results[step], s.group_size)
        if not samples:
            with self.lock:
                reasons = sorted({r for pid, r in self.ledger.dropped.items() if pid.startswith(f"s{step}-")})
            raise RuntimeError(f"every prompt of step {step} was dropped after failing its rollout: "
                               f"{'; '.join(reasons)[:300]}")
        with self.lock:
            self.phase = Phase.TRAINING
            self.trainer_backlog = len(samples)
        t_train = time.perf_counter()
        chunks_before = self.pool.chunks_done
        retrained = step < self.trained_through
        train_out = self._train(step, samples, retrained)
        train_s = time.perf_counter() - t_train
        overlap_chunks = self.pool.chunks_done - chunks_before
        with self.lock:
            self.weight_version = step + 1
            self.trainer_backlog = 0
            self.ledger.mark_trained(sorted({x["prompt_id"] for x in samples}))
        self.trained_through = max(self.trained_through, step + 1)
        mean = self.trainer_group.account(samples, train_out, train_s, self.weight_version, retrained)
        with self.lock:
            self.reward_mean = round(mean, 6)

        # weight sync (policy + drafter, one packed stream); trainer membership changes at this boundary
        self._set_phase(Phase.SYNCING)
        self._handle_drains_and_joins()
        self._with_trainers(self.trainer_group.regroup)
        sync_info = self._with_trainers(lambda: self.weight_sync.sync(step + 1))

        rec = self._record(step, samples, train_out, StepTimes(rollout_s, tail_s, train_s,
                                                               time.perf_counter() - t_step),
                           sync_info, drafter_info, overlap_chunks)
        if s.eval_every and (step + 1) % s.eval_every == 0:
            # After the sync, so the rollout worker decodes with the weights this step produced.
            ev = self.evaluate(True)
            rec["eval_accuracy"], rec["eval_seconds"] = ev["accuracy"], ev["seconds"]
            self.cm.eval_accuracy.set(ev["accuracy"])
        with self.lock:
            self.step = step + 1
            self.history.append(rec)
            self.phase = Phase.ROLLOUT
        self.last_samples = samples
        self.pool.close_step(step)
        if s.checkpoint_dir and s.checkpoint_interval and (step + 1) % s.checkpoint_interval == 0:
            path = str(checkpoints.checkpoint_path(s.checkpoint_dir, step + 1))
            self._with_trainers(lambda: self.save_checkpoint(path))
        return rec

    def _rollouts(self, step: int) -> tuple[float, float]:
        """Dispatch and collect the step's chunks; the drafter starts in its long tail. (seconds, tail seconds)."""
        s = self.settings
        t0 = time.perf_counter()
        tail_start: float | None = None
        while not self.pool.step_done(step):
            self._handle_drains_and_joins()
            self.pool.dispatch()
            active = self.pool.active_sequences(step)  # asks the busy workers: outside the lock
            with self.lock:
                tail = is_long_tail(self.ledger.queued_for(step), active, s.step_batch, s.long_tail_fraction)
                self.long_tail = tail
                self.decoding = active
                if tail:
                    self.phase = Phase.LONG_TAIL
            if tail and tail_start is None:
                tail_start = time.perf_counter()
            # The drafter distils the freshest rollouts there are: this step's finished ones or, while a worker
            # still holds its whole chunk, the previous step's (one weight version older).
            recent = self.pool.results[step] or self.last_samples
            if tail and not self.drafter.running and s.drafter_training and recent:
                self.drafter.start(recent, deadline_s=max(0.5, s.extra.get("drafter_seconds", 10.0)))
            if not self.pool.in_flight:
                if not self.pool.schedulable():
                    raise RuntimeError("no active rollout worker left to run the step")
                continue
            self.pool.wait(timeout=0.25)
            self.pool.update_rate(step, t0)
        with self.lock:
            self.long_tail = False
            self.decoding = None
        end = time.perf_counter()
        return end - t0, end - tail_start if tail_start is not None else 0.0

    def _train(self, step: int, samples: list[dict], retrained: bool = False) -> list[dict]:
        """The GRPO update on every trainer rank. A trainer that dies meanwhile is dropped and the group reformed
        (recovery.py): the step is trained again on the same samples, or counts as trained when the survivors
        already applied it, or the job goes back to a checkpoint (RolledBack)."""
        import ray

        for _attempt in range(RECOVERY_ATTEMPTS):
            refs = self.trainer_group.start_training(step, samples, retrained)
            try:
                return self._gather_training(refs)
            except Exception as exc:  # noqa: BLE001 - a trainer death is recovered; anything else is re-raised
                # Let the other ranks return before asking for their health (a trainer answers one call at a
                # time). Their all-reduce with a dead peer fails fast (its socket closed), with a hung one after
                # the group's timeout; a rank still computing meets the broken group at its next all-reduce.
                ray.wait(refs, num_returns=len(refs), timeout=self.settings.collective_timeout_s)
                plan = self._recover_trainers(exc)
                if plan.action == Action.APPLIED:
                    return [out for out in (_result_or_none(r) for r in refs) if out is not None]
        raise TrainerLost(f"step {step}: trainers kept dying ({RECOVERY_ATTEMPTS} recoveries in a row)")

    def _gather_training(self, refs: list) -> list[dict]:
        """Every rank's result of one GRPO update; the first rank that fails raises at once, while a peer may
        still hang (a frozen trainer never returns: its peers' all-reduce times out, and they fail)."""
        import ray

        pending = list(refs)
        while pending:
            # Async mode: rollouts for the next steps keep running on the old weights while the trainers work.
            poll = 0.0 if self.settings.mode == "async" else 1.0
            ready, pending = ray.wait(pending, num_returns=len(pending), timeout=poll)
            for ref in ready:
                ray.get(ref)  # a failed rank raises here
            if pending and self.settings.mode == "async":
                self._handle_drains_and_joins()
                self.pool.dispatch()
                self.pool.wait(timeout=0.1)
        return ray.get(refs)

    def _with_trainers(self, call: Callable[[], T]) -> T:
        """`call()`, and again after a trainer recovery if it failed because a trainer died."""
        for _attempt in range(RECOVERY_ATTEMPTS):
            try:
                return call()
            except RolledBack:
                raise
            except Exception as exc:  # noqa: BLE001 - a trainer death is recovered; anything else is re-raised
                self._recover_trainers(exc)
        return call()

    def _recover_trainers(self, cause: BaseException) -> Recovery:
        """After `cause`: drop the dead trainers and reseed the group (recovery.py). Re-raises `cause` when every
        trainer is alive (it was not a trainer death); raises RolledBack after going back to a checkpoint and
        TrainerLost when there is nothing to recover from."""
        tg, s = self.trainer_group, self.settings
        health = tg.health()
        dead = [h.name for h in health if not h.alive]
        if not dead:
            raise cause
        drafter_lost = bool(tg.actors) and tg.names()[0] in dead  # rank 0 held the drafter master copy
        log.warning("trainer(s) %s died (%s); recovering", ", ".join(dead), str(cause).splitlines()[0][:200])
        tg.drop(dead, frozenset(h.name for h in health if h.hung))
        if not self.placement.cluster:
            for name in dead:  # locally nothing recreates a pod: a new actor takes the dead one's place
                tg.request_join(name)
        elif tg.actors:
            self._discover_joins()  # a recreated pod may be there already
        alive = [h for h in health if h.alive]
        # with no trainer left to look at the volume, the plan decides on where checkpoints would be
        where = (checkpoints.find_latest(tg.actors[alive[0].name], s.checkpoint_dir) if alive
                 else (s.checkpoint_dir or None))
        plan = plan_recovery(health, self.weight_version, where, list(tg.pending))
        formed = False
        if plan.action in (Action.WAIT, Action.RESTORE) and not alive:
            if plan.action == Action.WAIT:
                self._wait_for_trainer(plan.reason)
            tg.reform(None, None)
            formed = True
            plan = plan_recovery(health, self.weight_version,
                                 checkpoints.find_latest(tg.first(), s.checkpoint_dir), list(tg.actors))
        log.warning("trainer recovery: %s (%s)", plan.action.value, plan.reason)
        with self.lock:
            self.recoveries.append({"step": self.step, "action": plan.action.value, "lost": list(plan.dead),
                                    "hung": [h.name for h in health if h.hung],
                                    "source": plan.source, "reason": plan.reason})
        if plan.action == Action.FAIL:
            raise TrainerLost(plan.reason)
        assert plan.source is not None  # every action but FAIL names its source
        if plan.action in (Action.CONTINUE, Action.APPLIED):
            tg.reform(tg.state_of(plan.source), plan.source)
            from ..rl.trainer import trains_drafter

            if drafter_lost and trains_drafter(s):
                where = self.drafter.restore(checkpoints.find_latest(tg.first(), s.checkpoint_dir))
                with self.lock:
                    self.recoveries[-1]["drafter"] = where
            return plan
        if not formed:
            tg.reform(None, None)
        self._restore(plan.source)
        self.weight_sync.sync(self.weight_version)
        raise RolledBack(plan.source)

    def _wait_for_trainer(self, why: str) -> None:
        """No trainer is left: wait (bounded) until one joins (the operator recreates the pod)."""
        log.warning("%s", why)
        deadline = time.monotonic() + REPLACEMENT_WAIT_S
        while not self.trainer_group.pending:
            if time.monotonic() > deadline:
                raise TrainerLost(f"{why}: no trainer joined within {REPLACEMENT_WAIT_S:g}s")
            if self.placement.cluster:
                self._discover_joins()
            time.sleep(1.0)

    def _record(self, step: int, samples: list[dict], train_out: list[dict], times: StepTimes, sync_info: dict,
                drafter_info: dict, overlap_chunks: int) -> dict:
        rec = build_record(step, self.settings.group_size, samples, self.pool.chunk_stats.get(step, []), train_out,
                           times, sync_info, drafter_info, reward_errors=self.pool.reward_count("reward_errors"),
                           requeued=self.ledger.requeued, dropped=len(self.ledger.dropped),
                           overlap_chunks=overlap_chunks,
                           workers={"rollout": len(self.pool.schedulable()), "trainer": len(self.trainers)})
        with self.lock:
            self.sd_enabled = bool(rec.sd_share) if rec.sd_share is not None else self.settings.method != "none"
        self.cm.long_tail_seconds.inc(times.long_tail)
        self.cm.generated_tokens.inc(rec.tokens)
        return rec.to_dict()

    # ------------------------------------------------------------------ checkpoints

    def cursor(self) -> dict:
        with self.lock:
            return {"step": self.step, "weight_version": self.weight_version, "ledger": self.ledger.snapshot(),
                    "history": list(self.history), "sync_epoch": self.weight_sync.epoch}

    def save_checkpoint(self, directory: str) -> str:
        checkpoints.save(list(self.trainers.values()), directory, self.cursor(), self.settings.checkpoint_keep)
        log.info("checkpoint written to %s", directory)
        return directory

    def _restore(self, directory: str) -> None:
        cursor = checkpoints.load(list(self.trainers.values()), directory)
        with self.lock:
            self.step = int(cursor["step"])
            self.weight_version = int(cursor["weight_version"])
            self.sh.ledger = PromptLedger.restore(cursor["ledger"])
            self.history = list(cursor.get("history", []))
            self.pool.results.clear()
            self.pool.chunk_stats.clear()
            self.pool.in_flight.clear()  # chunks of the abandoned timeline (async mode) are not taken back in
            # Steps already queued before the checkpoint keep their prompts (they sit in the ledger's queue).
            for it in self.ledger.queue:
                self.pool.open_step(it.step)
        log.info("resumed from %s at step %d", directory, self.step)

    # ------------------------------------------------------------------ measurements

    def evaluate(self, use_sd: bool = True, split: str = "heldout", samples: int = 0) -> dict:
        """Greedy (`samples` 0) or `samples` seeded samples per problem at the job's temperature."""
        return self.pool.call_any("evaluate", None, use_sd, split, samples)

    def compare_rollout(self, step: int | None = None) -> dict:
        """SD vs plain decoding on one worker for a full step batch, same weights and seeds, back to back."""
        s = self.settings
        st = self.step if step is None else step
        idx = step_prompt_indices(st, s.prompts_per_step, self.dataset_size, s.seed + 7)
        return self.pool.call_any("compare_rollout", [(f"bench-{i}", i) for i in idx], st)

    def trainer_digest(self) -> str:
        return self.trainer_group.digest()

    def ledger_report(self) -> dict:
        with self.lock:
            led = self.ledger
            return {"issued": led.issued, "trained": len(led.trained), "lost": led.lost(),
                    "requeued": led.requeued, "dropped": len(led.dropped), "queued": len(led.queue), "in_flight": led.in_flight_count(),
                    "completed": len(led.completed), "trained_ids": sorted(led.trained)}

    def worker_names(self) -> dict[str, list[str]]:
        with self.lock:
            return {"rollout": self.table.active("rollout"), "trainer": self.table.active("trainer"),
                    "retired": [w.name for w in self.table.workers.values() if w.state.gone]}

    def shutdown(self) -> None:
        if self.http is not None:
            self.http.stop()
            self.http = None
        self.pool.shutdown()
        self.trainer_group.shutdown()

    # Ray actor accessors (attributes are not reachable through an actor handle)

    def resumed_from(self) -> str | None:
        """The checkpoint this job resumed from (None: it started from scratch)."""
        return self._resume_from or None

    def get_url(self) -> str | None:
        return self.url

    def get_token(self) -> str:
        return self.token

    def get_history(self) -> list[dict]:
        return list(self.history)

    def set_phase_failed(self, message: str) -> None:
        with self.lock:
            self.phase = Phase.FAILED
            self.failed = message


def _result_or_none(ref: Any) -> dict | None:
    import ray

    try:
        return ray.get(ref, timeout=0)
    except Exception:  # noqa: BLE001 - the dead rank's result
        return None
