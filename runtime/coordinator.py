"""The job coordinator: prompt queue, step loop (sync/async), long tail, drafter training, elastic membership.

It drives trainer and rollout workers that are Ray actors. In local mode (`specrl run`) the coordinator is
itself a Ray actor on a local Ray instance; in a cluster it runs in the coordinator pod, which is the Ray
head, and places each worker's actor on that worker's pod through a per-pod Ray custom resource.

One RL step:
1. the step's prompts (ids `s{step}-p{index}`) enter the ledger's queue;
2. idle rollout workers get chunks of prompts (only when their weights are fresh enough: version n for
   step n in sync mode, at most `maxStaleness` versions old in async mode);
3. when the queue is empty and few sequences are left (the long tail) the trainer, idle until its samples
   arrive, trains the drafter on the step's finished rollouts;
4. the complete groups get group-normalised advantages and are split over the trainer ranks;
5. trainer rank 0 broadcasts the new policy (and drafter) to every active rollout worker in one packed
   transfer through the sync side group, rebuilt whenever membership changed.
In async mode step n+1's rollouts start while step n trains, on the previous weights.

Drain: a draining worker gets no new chunk; the chunk it holds is its safe point — when it returns, the
worker retires. A worker that dies has its chunk requeued. The ledger proves nothing is lost or trained twice.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specrl.runtime.rl.settings import RunSettings
from specrl.runtime.scheduling import (
    LedgerError,
    Phase,
    PromptItem,
    PromptLedger,
    WorkerState,
    WorkerTable,
    chunk_size,
    is_long_tail,
    may_rollout,
    prompt_id,
    split_even,
    step_prompt_indices,
)

log = logging.getLogger(__name__)


@dataclass
class Placement:
    """How worker actors are placed: locally (no resources) or pinned to a pod's custom resource."""

    cluster: bool = False
    gpus_per_pod: int = 0  # spec.resources.gpusPerPod: each trainer/rollout actor holds its pod's GPUs

    def options(self, name: str, role: str) -> dict[str, Any]:
        import ray
        from specrl.runtime.devices import ray_num_gpus

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
        return opts


def role_resource(role: str) -> str:
    """The Ray custom resource a pod of `role` advertises (`specrl_rollout`, `specrl_trainer`)."""
    return f"specrl_{role}"


def pod_resource(name: str) -> str:
    """The Ray custom resource only the pod called `name` advertises: pins that worker's actor to it."""
    return f"specrl_pod_{name}"


def members_from_nodes(nodes: list[dict], job: str) -> list[tuple[str, str]]:
    """(worker name, role) for every alive Ray node that advertises a specrl pod resource of this job."""
    out = []
    for node in nodes:
        if not node.get("Alive", node.get("alive", False)):
            continue
        res = node.get("Resources", node.get("resources_total", {})) or {}
        for key in res:
            if key.startswith("specrl_pod_"):
                name = key.removeprefix("specrl_pod_")
                for role in ("trainer", "rollout"):
                    if name.startswith(f"{job}-{role}-"):
                        out.append((name, role))
    return sorted(set(out), key=lambda x: (x[1], _index_of(x[0])))


def _index_of(name: str) -> int:
    try:
        return int(name.rsplit("-", 1)[1])
    except (IndexError, ValueError):
        return 0


def acceptance_length(stats: dict[str, float]) -> float | None:
    drafts = stats.get("drafts", 0.0)
    return 1.0 + stats.get("accepted_tokens", 0.0) / drafts if drafts else None


def list_checkpoints(root: str | Path) -> list[Path]:
    """Complete checkpoints under `root` (folders `step-NNNNNN` holding trainer.pt), oldest first."""
    root = Path(root)
    if not root.is_dir():
        return []
    return sorted(p for p in root.glob("step-*") if (p / "trainer.pt").is_file())


def latest_checkpoint(root: str | Path | None) -> str | None:
    """The newest complete checkpoint under `root`: where a restarted job resumes."""
    found = list_checkpoints(root) if root else []
    return str(found[-1]) if found else None


def prune_checkpoints(root: Path, keep: int) -> None:
    import shutil

    for old in list_checkpoints(root)[: -max(1, keep)]:
        shutil.rmtree(old, ignore_errors=True)


@dataclass
class StepRecord:
    step: int
    weight_version: int
    reward_mean: float
    accuracy: float
    samples: int
    prompts: int
    tokens: int
    rollout_seconds: float
    long_tail_seconds: float
    train_seconds: float
    sync_seconds: float
    sync_bytes: int
    drafter_seconds: float
    drafter_steps: int
    drafter_where: str | None
    step_seconds: float
    tokens_per_s: float
    acceptance_length: float | None
    sd_share: float | None
    response_lengths: list[int] = field(default_factory=list)
    loss: float = 0.0
    clip_fraction: float = 0.0
    staleness_max: int = 0
    reward_errors: int = 0
    requeued: int = 0
    workers: dict[str, int] = field(default_factory=dict)
    eval_accuracy: float | None = None  # held-out greedy accuracy after this step (spec.algorithm.evalEvery)
    eval_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        from dataclasses import asdict

        return asdict(self)


class JobCoordinator:
    """See the module docstring. Thread-safe for `status()`/`drain()` while `run_step()` runs."""

    def __init__(self, settings: RunSettings, *, token: str | None = None, placement: Placement | None = None,
                 http_host: str | None = None, http_port: int | None = None, resume_from: str | None = None,
                 metrics_registry: Any = None) -> None:
        from specrl.runtime.metrics import RuntimeMetrics
        from specrl.runtime.rollout_worker import load_problem_split

        self.settings = settings
        self.token = token if token is not None else secrets.token_urlsafe(24)
        self.placement = placement or Placement()
        self.lock = threading.RLock()
        self.ledger = PromptLedger()
        self.table = WorkerTable()
        self.step = 0
        self.weight_version = 0  # version the trainers hold
        self.rollout_version = 0  # version every active rollout worker serves (after the last sync)
        self.phase = Phase.STARTING
        self.long_tail = False
        self.complete = False
        self.failed: str | None = None
        self.tokens_per_s = 0.0
        self.last_acceptance: float | None = None
        self.sd_enabled = settings.method != "none"
        self.reward_mean: float | None = None
        self.trainer_backlog = 0
        self.history: list[dict] = []
        self.trainers: dict[str, Any] = {}
        self.rollouts: dict[str, Any] = {}
        self._in_flight: dict[Any, tuple[str, list[PromptItem], float]] = {}  # ref -> (worker, items, t0)
        self._sync_epoch = -1
        self._members_changed = True
        self._results: dict[int, list[dict]] = {}
        self._chunk_stats: dict[int, list[dict]] = {}
        self._dead: set[str] = set()
        self._reward_errors: dict[str, int] = {}
        self._sync_members: list[str] = []
        self._pending_trainers: list[str] = []
        self.registry = metrics_registry
        self.cm = RuntimeMetrics(settings.job, settings.namespace, "coordinator", f"{settings.job}-coordinator",
                                      registry=metrics_registry)
        self.registry = self.cm.registry
        self._worker_metrics: dict[str, Any] = {}
        self._resume_from = resume_from
        train, _ = load_problem_split(settings)
        self.dataset_size = len(train)
        if not settings.dataset.startswith("builtin:"):
            from specrl.runtime.rl.task import load_jsonl

            # Malformed lines were skipped with a warning; the count stays visible on the dashboard.
            self.cm.dataset_malformed_lines.inc(load_jsonl(
                settings.dataset, prompt_field=settings.prompt_field, answer_field=settings.answer_field).malformed)
        self.http = None
        if http_port is not None:
            from specrl.runtime.coordinator_http import HttpServer

            self.http = HttpServer(self, self.token, host=http_host or "127.0.0.1", port=http_port).start()

    # ------------------------------------------------------------------ HTTP view (any thread)

    @property
    def url(self) -> str | None:
        return self.http.url if self.http else None

    def status(self) -> dict:
        with self.lock:
            s = self.settings
            queue = len(self.ledger.queue)
            active = self.ledger.in_flight_count() * s.group_size
            return {
                "job": s.job, "step": self.step, "weightVersion": self.weight_version, "phase": self.phase.value,
                "queueDepth": queue, "activeSequences": active, "stepBatchSize": s.step_batch,
                "longTail": self.long_tail, "trainerBacklog": self.trainer_backlog,
                "tokensPerSecond": round(self.tokens_per_s, 3), "acceptanceLength": self.last_acceptance,
                "specDecodeEnabled": self.sd_enabled, "rewardMean": self.reward_mean,
                "workers": self.table.as_status(), "complete": self.complete,
                # where the last step's time went: the operator's rebalance policy balances roles on it
                "lastStep": ({"rolloutSeconds": round(last["rollout_seconds"], 3),
                              "longTailSeconds": round(last["long_tail_seconds"], 3),
                              "trainSeconds": round(last["train_seconds"], 3)} if (last := self._last_record())
                             else None),
            }

    def _last_record(self) -> dict | None:
        return self.history[-1] if self.history else None

    def drain(self, worker: str) -> dict:
        with self.lock:
            rec = self.table.drain(worker)  # KeyError -> 404
            log.info("drain requested for %s (%s)", worker, rec.state.value)
            self._members_changed = True
            return {"worker": worker, "state": rec.state.value}

    def metrics(self) -> tuple[bytes, str]:
        from specrl.runtime.metrics import render

        with self.lock:
            m = self.cm
            m.queue_depth.set(len(self.ledger.queue))
            m.active_sequences.set(self.ledger.in_flight_count() * self.settings.group_size)
            m.long_tail.set(1 if self.long_tail else 0)
            m.weight_version.set(self.weight_version)
            m.trainer_backlog.set(self.trainer_backlog)
            m.spec_decode_enabled.set(1 if self.sd_enabled else 0)
        return render(self.registry)

    def _wm(self, name: str, role: str):
        from specrl.runtime.metrics import RuntimeMetrics

        if name not in self._worker_metrics:
            self._worker_metrics[name] = RuntimeMetrics(self.settings.job, self.settings.namespace, role, name,
                                                        registry=self.registry)
        return self._worker_metrics[name]

    # ------------------------------------------------------------------ membership

    def start(self, trainer_names: list[str] | None = None, rollout_names: list[str] | None = None) -> None:
        """Create the worker actors (default: the replicas of the spec) and restore a checkpoint if asked."""
        s = self.settings
        trainer_names = trainer_names or [f"{s.job}-trainer-{i}" for i in range(s.trainers)]
        rollout_names = rollout_names or [f"{s.job}-rollout-{i}" for i in range(s.rollouts)]
        self._start_trainers(trainer_names)
        for name in rollout_names:
            self.add_rollout_worker(name, ship_weights=False)
        import ray

        ray.get([a.ping.remote() for a in self.rollouts.values()])
        if self._resume_from:
            self._restore(self._resume_from)
        self.phase = Phase.ROLLOUT

    def _start_trainers(self, names: list[str]) -> None:
        import ray
        from specrl.runtime.rl.trainer import TrainerWorker

        cls = ray.remote(TrainerWorker)
        world = len(names)
        for rank, name in enumerate(names):
            with self.lock:
                self.table.add(name, "trainer")
            self.trainers[name] = cls.options(**self.placement.options(name, "trainer")).remote(
                self.settings, rank, world, name)
        first = self.trainers[names[0]]
        host, port = ray.get(first.node_address.remote())
        # each trainer picks the backend of its gradients' device (devices.collective_backend)
        ray.get([a.init_data_parallel.remote(host, port) for a in self.trainers.values()])

    def add_rollout_worker(self, name: str, ship_weights: bool = True) -> None:
        """A worker joins at a step boundary: it gets the current weights and the sync group is rebuilt."""
        import ray
        from specrl.runtime.rollout_worker import RolloutWorker

        actor = ray.remote(RolloutWorker).options(**self.placement.options(name, "rollout")).remote(
            self.settings, name)
        with self.lock:
            self.table.add(name, "rollout")
            self.rollouts[name] = actor
            self._members_changed = True
        self._wm(name, "rollout")
        if ship_weights and self.weight_version > 0:
            if self.settings.rollout_engine == "vllm":  # vLLM takes weights only over its NCCL transfer
                self._sync_weights(self.weight_version)
                return
            state = ray.get(self._trainer0().sync_state.remote())
            ray.get(actor.set_weights.remote(state, self.weight_version))

    def _trainer0(self):
        return next(iter(self.trainers.values()))

    def _retire(self, name: str, reason: str) -> None:
        with self.lock:
            if self.table.workers[name].state == WorkerState.RETIRED:
                return
            self.table.retire(name)
            self._members_changed = True
        actor = self.rollouts.pop(name, None)
        log.info("worker %s retired (%s)", name, reason)
        if actor is not None:
            import ray

            try:
                ray.kill(actor)
            except Exception as exc:  # noqa: BLE001 - it may be dead already
                log.debug("kill %s: %s", name, exc)
        wm = self._worker_metrics.pop(name, None)
        if wm is not None:
            wm.remove()

    # ------------------------------------------------------------------ the step loop

    def run(self, steps: int | None = None, on_step=None) -> list[dict]:
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
        if step in self._results or step >= self._planned_until():
            return
        s = self.settings
        idx = step_prompt_indices(step, s.prompts_per_step, self.dataset_size, s.seed)
        with self.lock:
            self.ledger.enqueue(PromptItem(prompt_id(step, i), step, i) for i in idx)
        self._results[step] = []
        self._chunk_stats[step] = []

    def _planned_until(self) -> int:
        return self.settings.steps

    def run_step(self) -> dict:
        """Run one RL step to completion (rollouts, drafter, training, sync); returns its record."""
        import ray

        s = self.settings
        step = self.step
        t_step = time.perf_counter()
        self._enqueue(step)
        if s.mode == "async":
            for ahead in range(1, s.staleness + 1):
                self._enqueue(step + ahead)
        with self.lock:
            self.phase = Phase.ROLLOUT
        t0 = time.perf_counter()
        tail_start: float | None = None
        drafter_ref = None
        drafter_t0 = 0.0
        drafter_info = {"steps": 0, "seconds": 0.0}
        sync_info = {"seconds": 0.0, "bytes": 0}

        def step_done() -> bool:
            with self.lock:
                return self.ledger.queued_for(step) == 0 and not any(
                    it.step == step for _, items, _ in self._in_flight.values() for it in items)

        while not step_done():
            self._handle_drains_and_joins()
            self._dispatch()
            with self.lock:
                queued = self.ledger.queued_for(step)
                active = sum(len(items) for _, items, _ in self._in_flight.values()
                             if items and items[0].step == step) * s.group_size
                tail = is_long_tail(queued, active, s.step_batch, s.long_tail_fraction)
                self.long_tail = tail
                if tail:
                    self.phase = Phase.LONG_TAIL
            if tail and tail_start is None:
                tail_start = time.perf_counter()
            if tail and drafter_ref is None and s.drafter_training and self._results[step]:
                drafter_ref = self._start_drafter(step, deadline_s=max(0.5, s.extra.get("drafter_seconds", 10.0)))
                drafter_t0 = time.perf_counter()
            if not self._in_flight:
                if not self._schedulable():
                    raise RuntimeError("no active rollout worker left to run the step")
                continue
            self._wait_chunks(timeout=0.25)
            self._update_rate(step, t0)
        rollout_seconds = time.perf_counter() - t0
        long_tail_seconds = time.perf_counter() - tail_start if tail_start is not None else 0.0
        with self.lock:
            self.long_tail = False
        if drafter_ref is not None:
            ref, where = drafter_ref
            try:
                out = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - a lost drafter round is not worth failing the step
                log.warning("drafter training on %s failed (%s); keeping the previous drafter", where, exc)
                out = {"steps": 0, "loss": float("nan")}
            if "state" in out:  # trained on a rollout worker: the master copy goes back to trainer rank 0
                ray.get(self._trainer0().load_drafter_state.remote(out["state"]))
            drafter_info = {"steps": int(out["steps"]), "seconds": time.perf_counter() - drafter_t0,
                            "where": where}
            if out["steps"]:
                role = "trainer" if where in self.trainers else "rollout"
                self._wm(where, role).drafter_train_steps.inc(out["steps"])
                self._wm(where, role).drafter_loss.set(out["loss"])

        # -- training
        samples = self._collect(step)
        with self.lock:
            self.phase = Phase.TRAINING
            self.trainer_backlog = len(samples)
        t_train = time.perf_counter()
        train_refs = self._start_training(step, samples)
        if s.mode == "async":
            # Rollouts for the next steps keep running on the old weights while the trainers work.
            while not all(r in ray.wait(train_refs, num_returns=len(train_refs), timeout=0)[0] for r in train_refs):
                self._handle_drains_and_joins()
                self._dispatch()
                self._wait_chunks(timeout=0.1)
        train_out = ray.get(train_refs)
        train_seconds = time.perf_counter() - t_train
        with self.lock:
            self.weight_version = step + 1
            self.trainer_backlog = 0
            self.ledger.mark_trained(sorted({x["prompt_id"] for x in samples}))
        self._account_training(samples, train_out, train_seconds)

        # -- weight sync (policy + drafter, one packed stream); trainer membership changes at this boundary
        with self.lock:
            self.phase = Phase.SYNCING
        self._handle_drains_and_joins()
        self._regroup_trainers()
        sync_info = self._sync_weights(step + 1)

        # -- bookkeeping
        rec = self._record(step, samples, train_out, rollout_seconds, long_tail_seconds, train_seconds,
                           sync_info, drafter_info, time.perf_counter() - t_step)
        if s.eval_every and (step + 1) % s.eval_every == 0:
            # After the sync, so the rollout worker decodes with the weights this step produced.
            ev = self.evaluate(True)
            rec["eval_accuracy"], rec["eval_seconds"] = ev["accuracy"], ev["seconds"]
            self.cm.eval_accuracy.set(ev["accuracy"])
        with self.lock:
            self.step = step + 1
            self.history.append(rec)
            self.phase = Phase.ROLLOUT
        del self._results[step]
        self._chunk_stats.pop(step, None)
        if s.checkpoint_dir and s.checkpoint_interval and (step + 1) % s.checkpoint_interval == 0:
            self.save_checkpoint(str(Path(s.checkpoint_dir) / f"step-{step + 1:06d}"))
        return rec

    # ------------------------------------------------------------------ rollouts

    def _schedulable(self) -> list[str]:
        with self.lock:
            return [n for n in self.table.active("rollout") if n in self.rollouts]

    def _dispatch(self) -> None:
        """Give every idle active rollout worker a chunk of the queue's front step, if its weights allow."""
        s = self.settings
        busy = {w for w, _, _ in self._in_flight.values()}
        with self.lock:
            idle = [n for n in self._schedulable() if n not in busy]
            if not idle or not self.ledger.queue:
                return
            front = self.ledger.queue[0].step
            if not may_rollout(front, self.rollout_version, s.staleness):
                return
            left = self.ledger.queued_for(front)
            n = chunk_size(left, len(idle), s.chunk_prompts)
            assignments = []
            for name in idle:
                items = self.ledger.take(name, n, step=front)
                if items:
                    assignments.append((name, items))
        for name, items in assignments:
            ref = self.rollouts[name].generate.remote([(it.prompt_id, it.index) for it in items], front)
            self._in_flight[ref] = (name, items, time.perf_counter())

    def _wait_chunks(self, timeout: float) -> None:
        import ray

        if not self._in_flight:
            time.sleep(min(timeout, 0.05))
            return
        ready, _ = ray.wait(list(self._in_flight), num_returns=1, timeout=timeout)
        for ref in ready:
            name, items, _t0 = self._in_flight.pop(ref)
            try:
                out = ray.get(ref)
            except Exception as exc:  # noqa: BLE001 - a dead or failed worker: requeue, never lose prompts
                log.warning("rollout worker %s failed (%s): requeueing %d prompt(s)", name,
                            type(exc).__name__, len(items))
                with self.lock:
                    back = self.ledger.requeue(name)
                self._wm(name, "rollout").prompts_requeued.inc(len(back))
                self.cm.prompts_requeued.inc(len(back))
                self._dead.add(name)
                self._retire(name, f"failed: {type(exc).__name__}")
                continue
            self._accept_chunk(name, items, out)
            with self.lock:
                draining = self.table.workers[name].state == WorkerState.DRAINING
            if draining:
                self._retire(name, "drained")

    def _accept_chunk(self, name: str, items: list[PromptItem], out: dict) -> None:
        step = items[0].step
        with self.lock:
            self.ledger.complete(name, [it.prompt_id for it in items])
        self._results[step].extend(out["samples"])
        self._chunk_stats[step].append({"stats": out["stats"], "seconds": out["seconds"], "tokens": out["tokens"],
                                        "weight_version": out["weight_version"], "reward_errors": 0})
        wm = self._wm(name, "rollout")
        wm.generated_tokens.inc(out["tokens"])
        wm.sequences_completed.inc(len(out["samples"]))
        for smp in out["samples"]:
            wm.response_length.observe(len(smp["response_ids"]))
        st = out["stats"]
        wm.spec_num_drafts.inc(max(0.0, st.get("drafts", 0.0)))
        wm.spec_num_draft_tokens.inc(max(0.0, st.get("draft_tokens", 0.0)))
        wm.spec_num_accepted_tokens.inc(max(0.0, st.get("accepted_tokens", 0.0)))
        wm.count_accepted_per_position(st)
        errors_now = int(out.get("reward_errors", 0))  # the worker's running total
        prev = self._reward_errors.get(name, 0)
        if errors_now > prev:
            wm.reward_errors.inc(errors_now - prev)
            self.cm.reward_errors.inc(errors_now - prev)
        self._reward_errors[name] = max(prev, errors_now)
        wm.weight_version.set(out["weight_version"])
        wm.weight_staleness.set(max(0, step - out["weight_version"]))
        acc = acceptance_length(st)
        with self.lock:
            if acc is not None:
                self.last_acceptance = round(acc, 4)

    def _update_rate(self, step: int, t0: float) -> None:
        tokens = sum(c["tokens"] for c in self._chunk_stats.get(step, []))
        elapsed = time.perf_counter() - t0
        with self.lock:
            self.tokens_per_s = tokens / elapsed if elapsed > 0 else 0.0

    def _handle_drains_and_joins(self) -> None:
        busy = {w for w, _, _ in self._in_flight.values()}
        with self.lock:
            idle_draining = [n for n in self.table.draining("rollout") if n not in busy]
        for name in idle_draining:
            self._retire(name, "drained")
        if self.placement.cluster:
            self._discover_joins()

    def _discover_joins(self) -> None:
        import ray

        for name, role in members_from_nodes(ray.nodes(), self.settings.job):
            if name in self._dead or (name in self.table.workers and
                                      self.table.workers[name].state != WorkerState.RETIRED):
                continue
            if role == "rollout":
                log.info("rollout worker %s joined", name)
                self.add_rollout_worker(name)
            elif name not in self._pending_trainers:
                log.info("trainer %s joined; it enters the data-parallel group at the next step boundary", name)
                self._pending_trainers.append(name)

    def add_trainer_worker(self, name: str) -> None:
        """A trainer joins at the next step boundary (it copies rank 0's weights and optimizer state)."""
        if name not in self._pending_trainers:
            self._pending_trainers.append(name)

    def _regroup_trainers(self) -> None:
        """Apply trainer drains and joins: one new data-parallel group over the remaining and new trainers."""
        import ray
        from specrl.runtime.rl.trainer import TrainerWorker

        with self.lock:
            draining = [n for n in self.table.draining("trainer") if n in self.trainers]
            joining = list(self._pending_trainers)
            self._pending_trainers.clear()
        if not draining and not joining:
            return
        keep = [n for n in self.trainers if n not in draining]
        if not keep and not joining:
            log.warning("not retiring %s: it is the last trainer", draining[-1])
            draining, keep = draining[:-1], [draining[-1]]
        source = self.trainers[keep[0]] if keep else self._trainer0()
        state = ray.get(source.export_state.remote())
        if self.trainers and next(iter(self.trainers)) in draining and "drafter" not in state:
            state = {**state, **{k: v for k, v in ray.get(self._trainer0().export_state.remote()).items()
                                 if k == "drafter"}}
        for name in draining:
            actor = self.trainers.pop(name)
            ray.kill(actor)
            with self.lock:
                self.table.retire(name)
            log.info("trainer %s retired (drained)", name)
            wm = self._worker_metrics.pop(name, None)
            if wm is not None:
                wm.remove()
        cls = ray.remote(TrainerWorker)
        for name in joining:
            with self.lock:
                self.table.add(name, "trainer")
            self.trainers[name] = cls.options(**self.placement.options(name, "trainer")).remote(
                self.settings, len(self.trainers), len(self.trainers) + 1, name)
        names = list(self.trainers)
        ray.get([self.trainers[n].close_sync_group.remote() for n in names if n in keep])
        host, port = ray.get(self.trainers[names[0]].node_address.remote())
        ray.get([self.trainers[n].regroup.remote(rank, len(names), host, port)
                 for rank, n in enumerate(names)])
        ray.get([self.trainers[n].import_state.remote(state) for n in names if n not in keep or n == names[0]])
        with self.lock:
            self._members_changed = True  # the weight-sync sender may have changed too

    # ------------------------------------------------------------------ drafter (TLT)

    def _start_drafter(self, step: int, deadline_s: float) -> tuple[Any, str]:
        """Train the drafter where capacity idles: a rollout worker with nothing left to decode in the long tail
        (sync mode), else the trainer, which waits for its samples anyway. (ref, where)."""
        import ray

        samples = self._results[step]
        seqs = [smp["prompt_ids"] + smp["response_ids"] for smp in samples]
        lens = [len(smp["prompt_ids"]) for smp in samples]
        max_steps = self.settings.drafter_max_steps
        busy = {w for w, _, _ in self._in_flight.values()}
        idle = [n for n in self._schedulable() if n not in busy]
        if idle and self.settings.mode == "sync":
            state = ray.get(self._trainer0().drafter_state.remote())
            if state is not None:
                return self.rollouts[idle[0]].train_drafter.remote(state, seqs, lens, max_steps, deadline_s), idle[0]
        name = self._trainer_names()[0]
        return self.trainers[name].train_drafter.remote(seqs, lens, max_steps, deadline_s), name

    # ------------------------------------------------------------------ training and sync

    def _trainer_names(self) -> list[str]:
        return list(self.trainers)

    def _collect(self, step: int) -> list[dict]:
        """The step's samples in prompt order with group-normalised advantages."""
        import torch
        from specrl.runtime.rl.grpo import group_advantages

        s = self.settings
        by_prompt: dict[str, list[dict]] = {}
        for smp in self._results[step]:
            by_prompt.setdefault(smp["prompt_id"], []).append(smp)
        ordered: list[dict] = []
        for pid in sorted(by_prompt, key=lambda p: int(p.split("-p")[1])):
            group = by_prompt[pid]
            if len(group) != s.group_size:
                raise LedgerError(f"prompt {pid} has {len(group)} samples, expected {s.group_size}")
            ordered.extend(group)
        if ordered:
            adv = group_advantages(torch.tensor([x["reward"] for x in ordered], dtype=torch.float64), s.group_size)
            for x, a in zip(ordered, adv.tolist()):
                x["advantage"] = float(a)
        return ordered

    def _start_training(self, step: int, samples: list[dict]) -> list:
        from specrl.runtime.rl.trainer import Sample

        s = self.settings
        groups = [samples[i:i + s.group_size] for i in range(0, len(samples), s.group_size)]
        shards = split_even(groups, len(self.trainers))
        total_tokens = sum(len(x["response_ids"]) for x in samples)
        refs = []
        for actor, shard in zip(self.trainers.values(), shards):
            batch = [Sample(**x) for g in shard for x in g]
            refs.append(actor.train_step.remote(batch, step, total_tokens))
        return refs

    def _account_training(self, samples: list[dict], train_out: list[dict], seconds: float) -> None:
        rewards = [x["reward"] for x in samples]
        mean = sum(rewards) / max(1, len(rewards))
        with self.lock:
            self.reward_mean = round(mean, 6)
        # Per-rank series from what each rank measured and returned (its own loss, time and samples).
        own = {o.get("worker"): o for o in train_out}
        for name in self.trainers:
            wm = self._wm(name, "trainer")
            o = own.get(name, {})
            wm.trainer_step.set(self.weight_version)
            wm.trainer_step_duration.observe(float(o.get("seconds", seconds)))
            wm.trainer_reward_mean.set(mean)
            wm.trainer_samples.inc(int(o.get("samples", 0)))
            if "loss" in o:
                wm.trainer_loss.set(o["loss"])
            wm.weight_version.set(self.weight_version)
        self.cm.trainer_reward_mean.set(mean)
        self.cm.trainer_step.set(self.weight_version)

    def _sync_weights(self, version: int) -> dict[str, float]:
        """One packed broadcast trainer rank 0 -> every active rollout worker; rebuild the group when needed."""
        import ray

        receivers = [n for n in self._schedulable()]
        if not receivers:
            with self.lock:
                self.rollout_version = version
            return {"seconds": 0.0, "bytes": 0}
        t0 = time.perf_counter()
        trainer = self._trainer0()
        if self._members_changed or self._sync_epoch < 0:
            self._sync_epoch += 1
            host, port = ray.get(trainer.sync_address.remote())
            world = len(receivers) + 1
            refs = [trainer.open_sync_group.remote(host, port, world, self._sync_epoch)]
            refs += [self.rollouts[n].open_sync_group.remote(host, port, rank, world, self._sync_epoch)
                     for rank, n in enumerate(receivers, start=1)]
            ray.get(refs)
            self._sync_members = receivers
            with self.lock:
                self._members_changed = False
        send = trainer.send_weights.remote(version)
        recvs = [self.rollouts[n].receive_weights.remote(version) for n in self._sync_members]
        out = ray.get(send)
        ray.get(recvs)
        seconds = time.perf_counter() - t0
        with self.lock:
            self.rollout_version = version
        self.cm.sync_duration.observe(out["seconds"])
        self.cm.sync_bytes.inc(out["bytes"])
        self.cm.weight_version.set(version)
        return {"seconds": seconds, "bytes": int(out["bytes"]) * len(recvs), "transfer_seconds": out["seconds"]}

    # ------------------------------------------------------------------ records and checkpoints

    def _record(self, step, samples, train_out, rollout_s, tail_s, train_s, sync_info, drafter_info,
                step_s) -> dict:
        chunks = self._chunk_stats.get(step, [])
        agg: dict[str, float] = {}
        for c in chunks:
            for k, v in c["stats"].items():
                agg[k] = agg.get(k, 0.0) + v
        tokens = sum(len(x["response_ids"]) for x in samples)
        sd_steps, ar_steps = agg.get("sd_steps", 0.0), agg.get("ar_steps", 0.0)
        sd_share = sd_steps / (sd_steps + ar_steps) if sd_steps + ar_steps else None
        rewards = [x["reward"] for x in samples]
        acc = acceptance_length(agg)
        with self.lock:
            self.sd_enabled = bool(sd_share) if sd_share is not None else self.settings.method != "none"
        rec = StepRecord(
            step=step, weight_version=step + 1,
            reward_mean=sum(rewards) / max(1, len(rewards)),
            accuracy=sum(1 for x in samples if x.get("correct")) / max(1, len(samples)),
            samples=len(samples), prompts=len(samples) // self.settings.group_size, tokens=tokens,
            rollout_seconds=rollout_s, long_tail_seconds=tail_s, train_seconds=train_s,
            sync_seconds=float(sync_info.get("seconds", 0.0)), sync_bytes=int(sync_info.get("bytes", 0)),
            drafter_seconds=float(drafter_info.get("seconds", 0.0)), drafter_steps=int(drafter_info.get("steps", 0)),
            drafter_where=drafter_info.get("where"),
            step_seconds=step_s, tokens_per_s=tokens / rollout_s if rollout_s > 0 else 0.0,
            acceptance_length=acc, sd_share=sd_share,
            response_lengths=[len(x["response_ids"]) for x in samples],
            loss=sum(o["loss"] for o in train_out),
            clip_fraction=sum(o["clip_fraction"] for o in train_out) / max(1, len(train_out)),
            staleness_max=max((step - x["weight_version"] for x in samples), default=0),
            reward_errors=sum(self._reward_errors.values()),
            requeued=self.ledger.requeued,
            workers={"rollout": len(self._schedulable()), "trainer": len(self.trainers)},
        )
        self.cm.long_tail_seconds.inc(tail_s)
        self.cm.generated_tokens.inc(tokens)
        return rec.to_dict()

    def cursor(self) -> dict:
        with self.lock:
            return {"step": self.step, "weight_version": self.weight_version, "ledger": self.ledger.snapshot(),
                    "history": list(self.history), "sync_epoch": self._sync_epoch}

    def save_checkpoint(self, directory: str) -> str:
        import ray

        cursor = self.cursor()
        ray.get([a.save_checkpoint.remote(directory, cursor) for a in self.trainers.values()])
        log.info("checkpoint written to %s", directory)
        prune_checkpoints(Path(directory).parent, self.settings.checkpoint_keep)
        return directory

    def _restore(self, directory: str) -> None:
        import ray

        cursors = ray.get([a.load_checkpoint.remote(directory) for a in self.trainers.values()])
        cursor = cursors[0]
        with self.lock:
            self.step = int(cursor["step"])
            self.weight_version = int(cursor["weight_version"])
            self.ledger = PromptLedger.restore(cursor["ledger"])
            self.history = list(cursor.get("history", []))
            self._results = {}
            self._chunk_stats = {}
            # Steps already queued before the checkpoint keep their prompts (they sit in the ledger's queue).
            for it in self.ledger.queue:
                self._results.setdefault(it.step, [])
                self._chunk_stats.setdefault(it.step, [])
        if self.settings.rollout_engine == "vllm":
            self._sync_weights(self.weight_version)
        else:
            state = ray.get(self._trainer0().sync_state.remote())
            ray.get([a.set_weights.remote(state, self.weight_version) for a in self.rollouts.values()])
        self.rollout_version = self.weight_version
        log.info("resumed from %s at step %d", directory, self.step)

    # ------------------------------------------------------------------ measurements

    def evaluate(self, use_sd: bool = True, split: str = "heldout", samples: int = 0) -> dict:
        """Greedy (`samples` 0) or `samples` seeded samples per problem at the job's temperature."""
        import ray

        name = self._schedulable()[0]
        return ray.get(self.rollouts[name].evaluate.remote(None, use_sd, split, samples))

    def compare_rollout(self, step: int | None = None) -> dict:
        """SD vs plain decoding on one worker for a full step batch, same weights and seeds, back to back."""
        import ray

        s = self.settings
        st = self.step if step is None else step
        idx = step_prompt_indices(st, s.prompts_per_step, self.dataset_size, s.seed + 7)
        items = [(f"bench-{i}", i) for i in idx]
        name = self._schedulable()[0]
        return ray.get(self.rollouts[name].compare_rollout.remote(items, st))

    def trainer_digest(self) -> str:
        import ray

        return ray.get(self._trainer0().digest.remote())

    def ledger_report(self) -> dict:
        with self.lock:
            return {"issued": self.ledger.issued, "trained": len(self.ledger.trained), "lost": self.ledger.lost(),
                    "requeued": self.ledger.requeued, "queued": len(self.ledger.queue),
                    "in_flight": self.ledger.in_flight_count(), "completed": len(self.ledger.completed),
                    "trained_ids": sorted(self.ledger.trained)}

    def worker_names(self) -> dict[str, list[str]]:
        with self.lock:
            return {"rollout": self.table.active("rollout"), "trainer": self.table.active("trainer"),
                    "retired": [w.name for w in self.table.workers.values() if w.state == WorkerState.RETIRED]}

    def shutdown(self) -> None:
        import ray

        if self.http is not None:
            self.http.stop()
            self.http = None
        for actor in list(self.rollouts.values()) + list(self.trainers.values()):
            try:
                ray.kill(actor)
            except Exception as exc:  # noqa: BLE001 - it may be dead already
                log.debug("kill at shutdown: %s", exc)
        self.rollouts.clear()
        self.trainers.clear()

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
