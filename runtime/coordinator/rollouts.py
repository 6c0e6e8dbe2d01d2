"""Rollout scheduling: the rollout worker actors, which chunk of prompts each one holds, and what came back.

Idle active workers get chunks of the queue's front step when their weights are fresh enough (`may_rollout`).
A draining worker gets no new chunk; the chunk it holds is its safe point — when it returns, the worker retires.

Failures are told apart by what Ray reports:
- worker death (the actor or its node is gone: `RayActorError`, a crashed worker process, a lost node): the
  worker retires and its chunk goes back to the front of the queue, uncounted against the prompts;
- task error (the worker is alive, its `generate` raised: a bug, one bad prompt): the worker stays; every
  prompt of the chunk counts one failure and is retried alone, at most `promptRetries` times, then dropped
  with a counted reason, and the step trains without it;
- a chunk without progress (no new decode step) for `rolloutChunkTimeoutSeconds`: the worker is hung; it is
  killed and retired, its chunk requeued, the timeout counted.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

from ..scheduling import PromptItem, WorkerState, chunk_size, may_rollout
from .placement import Placement, kill_actors
from .records import acceptance_length
from .shared import Shared

LIVE_COUNT_TIMEOUT_S = 0.5  # how long a busy worker may take to say how far its chunk got

log = logging.getLogger(__name__)


@dataclass
class Chunk:
    worker: str
    items: list[PromptItem]
    started: float
    progressed: float = 0.0  # when the worker last reported a new decode step for it (the hang clock)
    steps: int = -1  # decode steps the worker had reported

    def __post_init__(self) -> None:
        self.progressed = self.progressed or self.started


class RolloutPool:
    def __init__(self, shared: Shared, placement: Placement) -> None:
        self.sh = shared
        self.placement = placement
        self.actors: dict[str, Any] = {}
        self.in_flight: dict[Any, Chunk] = {}  # Ray object ref -> the chunk it computes
        self.results: dict[int, list[dict]] = {}  # step -> samples returned so far
        self.chunk_stats: dict[int, list[dict]] = {}
        self.reward_totals: dict[tuple[str, str], int] = {}  # (worker, reward_errors|reward_timeouts) -> total
        self.version = 0  # weight version every active rollout worker serves (after the last sync)
        self.last_acceptance: float | None = None
        self.tokens_per_s = 0.0
        self.chunks_done = 0  # chunks taken in so far (async mode: how many came in while the trainers worked)

    # -- membership -----------------------------------------------------------------------------------

    def add(self, name: str, initial: tuple[dict, int] | None = None, node_id: str | None = None) -> None:
        """Start `name`'s actor (on Ray node `node_id`, in a cluster); `initial` (state, version) hands it the
        current weights directly."""
        import ray

        from ..rollout_worker import RolloutWorker

        with self.sh.lock:
            self.sh.table.add(name, "rollout", node_id)
        actor: Any = self.placement.start(RolloutWorker, name, "rollout", node_id, self.sh.series,
                                          self.sh.settings, name)
        with self.sh.lock:
            self.actors[name] = actor
        self.sh.series.of(name, "rollout")
        if initial is not None:
            state, version = initial
            ray.get(actor.set_weights.remote(state, version))

    def ping_all(self) -> None:
        import ray

        ray.get([a.ping.remote() for a in self.actors.values()])

    def schedulable(self) -> list[str]:
        with self.sh.lock:
            return [n for n in self.sh.table.active("rollout") if n in self.actors]

    def busy(self) -> set[str]:
        return {c.worker for c in self.in_flight.values()}

    def idle(self) -> list[str]:
        busy = self.busy()
        return [n for n in self.schedulable() if n not in busy]

    def retire(self, name: str, reason: str, lost: bool = False) -> None:
        with self.sh.lock:
            if self.sh.table.workers[name].state.gone:
                return
            self.sh.table.retire(name, lost=lost)
        actor = self.actors.pop(name, None)
        log.info("worker %s retired (%s)", name, reason)
        if actor is not None:
            import ray

            try:
                ray.kill(actor)
            except Exception as exc:  # noqa: BLE001 - it may be dead already
                log.debug("kill %s: %s", name, exc)
        self.sh.series.drop(name)

    def retire_idle_draining(self) -> None:
        busy = self.busy()
        with self.sh.lock:
            idle_draining = [n for n in self.sh.table.draining("rollout") if n not in busy]
        for name in idle_draining:
            self.retire(name, "drained")

    # -- steps ----------------------------------------------------------------------------------------

    def open_step(self, step: int) -> None:
        self.results.setdefault(step, [])
        self.chunk_stats.setdefault(step, [])

    def close_step(self, step: int) -> None:
        self.results.pop(step, None)
        self.chunk_stats.pop(step, None)

    def step_done(self, step: int) -> bool:
        with self.sh.lock:
            return self.sh.ledger.queued_for(step) == 0 and not any(
                it.step == step for c in self.in_flight.values() for it in c.items)

    def active_sequences(self, step: int) -> int:
        """Sequences of `step` still decoding. A worker decodes its whole chunk as one continuously batched
        generate, so only it knows how many are left: each busy worker is asked (its engine's last decode batch);
        one that does not answer within LIVE_COUNT_TIMEOUT_S counts its whole chunk."""
        import ray

        group = self.sh.settings.group_size
        asked = [(c, self.actors[c.worker].decoding.remote()) for c in list(self.in_flight.values())
                 if c.items and c.items[0].step == step and c.worker in self.actors]
        total = 0
        for chunk, ref in asked:
            try:
                live = ray.get(ref, timeout=LIVE_COUNT_TIMEOUT_S)
            except Exception:  # noqa: BLE001 - busy past the timeout, or gone: the chunk's own size
                total += len(chunk.items) * group
                continue
            total += min(int(live["sequences"]), len(chunk.items) * group)
            if live["steps"] != chunk.steps:  # a decode step since the last answer: not hung, however long it runs
                chunk.steps, chunk.progressed = int(live["steps"]), time.perf_counter()
        return total

    def dispatch(self) -> None:
        """Give every idle active rollout worker a chunk of the queue's front step, if its weights allow."""
        s = self.sh.settings
        with self.sh.lock:
            idle = self.idle()
            ledger = self.sh.ledger
            if not idle or not ledger.queue:
                return
            front = ledger.queue[0].step
            if not may_rollout(front, self.version, s.staleness):
                return
            n = chunk_size(ledger.queued_for(front), len(idle), s.rollout_chunk)
            assignments = []
            for name in idle:
                items = ledger.take(name, n, step=front)
                if items:
                    assignments.append((name, items))
        for name, items in assignments:
            ref = self.actors[name].generate.remote([(it.prompt_id, it.index) for it in items], front)
            self.in_flight[ref] = Chunk(name, items, time.perf_counter())

    def wait(self, timeout: float) -> None:
        """Take in the chunks that finish within `timeout` (see the module docstring for failures)."""
        import ray
        from ray.exceptions import RayTaskError

        if not self.in_flight:
            time.sleep(min(timeout, 0.05))
            return
        ready, _ = ray.wait(list(self.in_flight), num_returns=1, timeout=timeout)
        for ref in ready:
            chunk = self.in_flight.pop(ref)
            name = chunk.worker
            try:
                out = ray.get(ref)
            except RayTaskError as exc:
                self._task_failed(chunk, exc)
                continue
            except Exception as exc:  # noqa: BLE001 - anything else Ray raises means the worker is gone
                self.worker_lost(name, f"died: {type(exc).__name__}", died=True)
                continue
            self._accept(name, chunk.items, out)
            with self.sh.lock:
                draining = self.sh.table.workers[name].state == WorkerState.DRAINING
            if draining:
                self.retire(name, "drained")
        self._expire_hung()

    def worker_lost(self, name: str, reason: str, died: bool = False) -> None:
        """`name` is gone (dead, hung, unreachable): its prompts go back to the queue, it retires for good
        (`died`: lost, its pod is being replaced; a hung one is retired, the operator replaces its pod)."""
        for ref in [r for r, c in self.in_flight.items() if c.worker == name]:
            del self.in_flight[ref]
        with self.sh.lock:
            back = self.sh.ledger.requeue(name)
        if back:
            log.warning("rollout worker %s %s: requeueing %d prompt(s)", name, reason, len(back))
        self.sh.series.of(name, "rollout").prompts_requeued.inc(len(back))
        self.sh.cm.prompts_requeued.inc(len(back))
        self.retire(name, reason, lost=died)

    def _task_failed(self, chunk: Chunk, exc: BaseException) -> None:
        cause = getattr(exc, "cause", None) or exc
        reason = f"{type(cause).__name__}: {str(cause).splitlines()[0] if str(cause) else ''}"[:200]
        with self.sh.lock:
            again, dropped = self.sh.ledger.fail(chunk.worker, self.sh.settings.prompt_retries, reason)
        log.warning("rollout of %d prompt(s) on %s raised %s; retrying %d alone, dropping %d", len(chunk.items),
                    chunk.worker, reason, len(again), len(dropped))
        self.sh.series.of(chunk.worker, "rollout").rollout_task_errors.inc()
        self.sh.cm.rollout_task_errors.inc()
        self.sh.cm.prompts_dropped.inc(len(dropped))
        self.sh.cm.prompts_requeued.inc(len(again))

    def _expire_hung(self) -> None:
        """Retire workers whose chunk made no progress within the timeout: no new decode step reported (a chunk
        is a worker's whole share of a step, which may rightly decode for longer than that), or, from workers that
        report none, no result. Its prompts count a failure too: a prompt that hangs every worker it lands on
        must not take the whole pool down, so it is retried alone, then dropped."""
        limit = self.sh.settings.chunk_timeout_s
        now = time.perf_counter()
        for chunk in [c for c in self.in_flight.values() if now - c.progressed > limit]:
            with self.sh.lock:
                again, dropped = self.sh.ledger.fail(chunk.worker, self.sh.settings.prompt_retries,
                                                     f"rollout chunk made no progress for {limit:g}s")
            self.sh.cm.rollout_chunk_timeouts.inc()
            self.sh.cm.prompts_requeued.inc(len(again))
            self.sh.cm.prompts_dropped.inc(len(dropped))
            self.worker_lost(chunk.worker, f"hung: no progress on its chunk for {limit:g}s")

    def _accept(self, name: str, items: list[PromptItem], out: dict) -> None:
        step = items[0].step
        with self.sh.lock:
            self.sh.ledger.complete(name, [it.prompt_id for it in items])
        self.chunks_done += 1
        self.results[step].extend(out["samples"])
        self.chunk_stats[step].append({"stats": out["stats"], "seconds": out["seconds"], "tokens": out["tokens"],
                                       "weight_version": out["weight_version"]})
        wm = self.sh.series.of(name, "rollout")
        wm.generated_tokens.inc(out["tokens"])
        wm.sequences_completed.inc(len(out["samples"]))
        for smp in out["samples"]:
            wm.response_length.observe(len(smp["response_ids"]))
        st = out["stats"]
        wm.spec_num_drafts.inc(max(0.0, st.get("drafts", 0.0)))
        wm.spec_num_draft_tokens.inc(max(0.0, st.get("draft_tokens", 0.0)))
        wm.spec_num_accepted_tokens.inc(max(0.0, st.get("accepted_tokens", 0.0)))
        wm.count_accepted_per_position(st)
        for key, attr in (("reward_errors", "reward_errors"), ("reward_timeouts", "reward_timeouts")):
            now = int(out.get(key, 0))  # the worker's running total
            prev = self.reward_totals.get((name, key), 0)
            if now > prev:
                getattr(wm, attr).inc(now - prev)
                getattr(self.sh.cm, attr).inc(now - prev)
            self.reward_totals[(name, key)] = max(prev, now)
        wm.weight_version.set(out["weight_version"])
        wm.weight_staleness.set(max(0, step - out["weight_version"]))
        acc = acceptance_length(st)
        with self.sh.lock:
            if acc is not None:
                self.last_acceptance = round(acc, 4)

    def reward_count(self, key: str) -> int:
        return sum(v for (_, k), v in self.reward_totals.items() if k == key)

    def update_rate(self, step: int, t0: float) -> None:
        tokens = sum(c["tokens"] for c in self.chunk_stats.get(step, []))
        elapsed = time.perf_counter() - t0
        with self.sh.lock:
            self.tokens_per_s = tokens / elapsed if elapsed > 0 else 0.0

    # -- one worker's measurements ----------------------------------------------------------------------

    def call_any(self, method: str, *args: Any) -> Any:
        """Run `method` on the first active rollout worker and return its result."""
        import ray

        name = self.schedulable()[0]
        return ray.get(getattr(self.actors[name], method).remote(*args))

    def shutdown(self) -> None:
        kill_actors(self.actors)

