"""The coordinator's decisions as pure functions and plain state: prompt ledger, workers, long tail, staleness.

Nothing here touches Ray, torch or the network, so every rule (nothing lost, nothing trained twice,
drain at a safe point, when the long tail starts, which weights a rollout may use) is unit-testable.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum


class WorkerState(str, Enum):
    ACTIVE = "active"
    DRAINING = "draining"
    RETIRED = "retired"
    # Died (its process or node is gone): the pod has failed and is being replaced, so the operator must not
    # delete a pod for it — by the time it reads the state, the pod under that name may be the replacement.
    LOST = "lost"

    @property
    def gone(self) -> bool:
        return self in (WorkerState.RETIRED, WorkerState.LOST)


class Phase(str, Enum):
    STARTING = "Starting"
    ROLLOUT = "Rollout"
    LONG_TAIL = "LongTail"
    TRAINING = "Training"
    SYNCING = "Syncing"
    COMPLETE = "Complete"
    FAILED = "Failed"


@dataclass(frozen=True)
class PromptItem:
    """One draw of a prompt in one RL step.

    `prompt_id` (`s{step}-p{draw}`) names the draw, not the dataset row: when the dataset size is not a
    multiple of promptsPerStep a step that wraps into the next epoch may draw a row twice, and each draw is
    its own group of samples.
    """

    prompt_id: str
    step: int
    index: int  # row of the dataset
    draw: int = 0  # position among the step's draws (the order groups are trained in)


def prompt_id(step: int, draw: int) -> str:
    return f"s{step}-p{draw}"


def step_items(step: int, prompts_per_step: int, dataset_size: int, seed: int) -> list[PromptItem]:
    """The step's draws, in order, each with a job-unique id (see `PromptItem`)."""
    return [PromptItem(prompt_id(step, k), step, idx, k)
            for k, idx in enumerate(step_prompt_indices(step, prompts_per_step, dataset_size, seed))]


class LedgerError(RuntimeError):
    """A rule of the ledger would be broken (a prompt trained twice, completed by a worker not holding it)."""


@dataclass
class PromptLedger:
    """Every prompt of the job from enqueue to training, with who holds it.

    Invariant, checked by `check()`: every issued prompt is in exactly one of queued, in flight (held by
    one worker), completed-not-trained, trained, or dropped. A drained or dead worker's prompts go back to the
    front of the queue, so a step never loses a prompt and never trains one twice. A prompt whose rollout
    itself fails (a task error, not a worker death) is retried a bounded number of times, then dropped with
    a reason.
    """

    queue: deque[PromptItem] = field(default_factory=deque)
    in_flight: dict[str, dict[str, PromptItem]] = field(default_factory=dict)  # worker -> id -> item
    completed: dict[str, PromptItem] = field(default_factory=dict)
    trained: set[str] = field(default_factory=set)
    dropped: dict[str, str] = field(default_factory=dict)  # id -> reason
    failures: dict[str, int] = field(default_factory=dict)  # id -> failed rollout attempts so far
    issued: int = 0
    requeued: int = 0

    def enqueue(self, items: Iterable[PromptItem]) -> None:
        for item in items:
            self.queue.append(item)
            self.issued += 1

    def take(self, worker: str, n: int, *, step: int | None = None) -> list[PromptItem]:
        """Assign up to `n` queued prompts (of `step` only, when given) to `worker`; a suspect prompt goes alone."""
        out: list[PromptItem] = []
        while self.queue and len(out) < n:
            nxt = self.queue[0]
            if (step is not None and nxt.step != step) or (out and self.suspect(nxt)):
                break
            item = self.queue.popleft()
            out.append(item)
            self.in_flight.setdefault(worker, {})[item.prompt_id] = item
            if self.suspect(item):
                break
        return out

    def complete(self, worker: str, prompt_ids: Iterable[str]) -> list[PromptItem]:
        held = self.in_flight.get(worker, {})
        done = []
        for pid in prompt_ids:
            item = held.pop(pid, None)
            if item is None:
                raise LedgerError(f"worker {worker!r} returned prompt {pid!r} it does not hold")
            self.completed[pid] = item
            done.append(item)
        if not held:
            self.in_flight.pop(worker, None)
        return done

    def requeue(self, worker: str) -> list[PromptItem]:
        """Put everything `worker` holds back at the front of the queue (in its original order)."""
        held = self.in_flight.pop(worker, {})
        items = sorted(held.values(), key=lambda it: (it.step, it.draw))
        self.queue.extendleft(reversed(items))
        self.requeued += len(items)
        return items

    def fail(self, worker: str, retries: int, reason: str) -> tuple[list[PromptItem], list[PromptItem]]:
        """`worker`'s rollout of what it holds failed: prompts that failed at most `retries` times go back to
        the front of the queue, the others are dropped with `reason`. Returns (requeued, dropped)."""
        held = sorted(self.in_flight.pop(worker, {}).values(), key=lambda it: (it.step, it.draw))
        again, dropped = [], []
        for it in held:
            n = self.failures[it.prompt_id] = self.failures.get(it.prompt_id, 0) + 1
            if n > retries:
                self.dropped[it.prompt_id] = reason
                dropped.append(it)
            else:
                again.append(it)
        self.queue.extendleft(reversed(again))
        self.requeued += len(again)
        return again, dropped

    def suspect(self, item: PromptItem) -> bool:
        """A prompt whose rollout failed before: it runs alone, so it cannot take good prompts down with it."""
        return item.prompt_id in self.failures

    def mark_trained(self, prompt_ids: Iterable[str]) -> None:
        ids = list(prompt_ids)
        twice = [pid for pid in ids if pid in self.trained]
        if twice:
            raise LedgerError(f"prompts trained twice: {twice[:5]}")
        missing = [pid for pid in ids if pid not in self.completed]
        if missing:
            raise LedgerError(f"prompts trained before completion: {missing[:5]}")
        for pid in ids:
            self.trained.add(pid)
            del self.completed[pid]

    def queued_for(self, step: int) -> int:
        return sum(1 for it in self.queue if it.step == step)

    def in_flight_count(self) -> int:
        return sum(len(v) for v in self.in_flight.values())

    def completed_for(self, step: int) -> list[PromptItem]:
        return sorted((it for it in self.completed.values() if it.step == step), key=lambda it: it.draw)

    def lost(self) -> int:
        """Issued prompts that are nowhere (0 unless a bug lost them)."""
        return (self.issued - len(self.queue) - self.in_flight_count() - len(self.completed) - len(self.trained)
                - len(self.dropped))

    def check(self) -> None:
        ids = [it.prompt_id for it in self.queue]
        ids += [pid for held in self.in_flight.values() for pid in held]
        ids += list(self.completed) + list(self.trained) + list(self.dropped)
        if len(ids) != len(set(ids)):
            raise LedgerError("a prompt is in two places at once")
        if len(ids) != self.issued:
            raise LedgerError(f"{self.issued - len(ids)} prompt(s) lost")

    # -- checkpointing ---------------------------------------------------------------------------------

    def snapshot(self) -> dict:
        """Checkpoint form, taken at a step boundary. Prompts of later steps still in flight or completed but
        not trained (async mode runs ahead) are saved as queued: a resumed job rolls them out again, on the
        weights it resumed with, and trains each exactly once."""
        pending = [it for held in self.in_flight.values() for it in held.values()] + list(self.completed.values())
        queue = sorted(pending, key=lambda it: (it.step, it.draw)) + list(self.queue)
        return {"queue": [[it.prompt_id, it.step, it.index, it.draw] for it in queue],
                "trained": sorted(self.trained), "dropped": dict(self.dropped), "failures": dict(self.failures),
                "issued": self.issued, "requeued": self.requeued}

    @classmethod
    def restore(cls, data: dict) -> PromptLedger:
        led = cls()
        led.queue = deque(PromptItem(*row) for row in data["queue"])
        led.trained = set(data["trained"])
        led.dropped = dict(data.get("dropped", {}))
        led.failures = {k: int(v) for k, v in data.get("failures", {}).items()}
        led.issued = int(data["issued"])
        led.requeued = int(data.get("requeued", 0))
        return led


# -- decisions ----------------------------------------------------------------------------------------


def step_prompt_indices(step: int, prompts_per_step: int, dataset_size: int, seed: int) -> list[int]:
    """Dataset indices of a step: a deterministic pass over a seeded permutation (epochs wrap around).

    Depends only on its arguments, so a resumed job draws exactly the prompts the uninterrupted one would.
    """
    import random

    if dataset_size <= 0:
        raise ValueError("dataset is empty")
    out: list[int] = []
    perms: dict[int, list[int]] = {}  # one shuffle per epoch the step touches (at most two), not one per prompt
    start = step * prompts_per_step
    for pos in range(start, start + prompts_per_step):
        epoch, offset = divmod(pos, dataset_size)
        if epoch not in perms:
            perm = list(range(dataset_size))
            random.Random(f"specrl-epoch:{seed}:{epoch}").shuffle(perm)
            perms[epoch] = perm
        out.append(perms[epoch][offset])
    return out


def is_long_tail(queue_depth: int, active_sequences: int, step_batch: int, fraction: float) -> bool:
    """The long tail: nothing left to hand out and only a few sequences still decoding.

    Few active sequences means small decode batches — memory-bound, where speculation pays and where
    rollout capacity sits idle (so it may train the drafter instead).
    """
    return queue_depth == 0 and 0 < active_sequences <= fraction * step_batch


def may_rollout(step: int, weight_version: int, max_staleness: int) -> bool:
    """Whether rollouts for `step` may run on weights `weight_version` (the policy after that many updates).

    Sync mode is max_staleness 0: step n runs on version n exactly. Async mode lets rollouts run ahead on
    weights at most `max_staleness` versions old.
    """
    return 0 <= step - weight_version <= max_staleness


def chunk_size(prompts_left: int, idle_workers: int, max_chunk: int) -> int:
    """Prompts per assignment: at most `max_chunk`, and spread so idle workers all get work."""
    if idle_workers <= 0 or prompts_left <= 0:
        return 0
    return max(1, min(max_chunk, -(-prompts_left // idle_workers)))


class DrainRefused(ValueError):
    """A drain that would leave the job without a worker of a role (the HTTP layer answers 409)."""


@dataclass
class WorkerRecord:
    name: str
    role: str  # rollout | trainer
    state: WorkerState = WorkerState.ACTIVE
    weight_version: int = -1
    identity: str | None = None  # the pod's Ray node ID in a cluster; None locally (the name is the identity)


@dataclass
class WorkerTable:
    """Membership. Changes take effect at step boundaries (joins) or safe points (drains).

    A worker is its identity, not its name: a retired identity stays retired for good (the pod it runs on may
    live on for a while), and a pod recreated under the same name has a new identity and joins as a new member.
    """

    workers: dict[str, WorkerRecord] = field(default_factory=dict)
    retired_identities: set[str] = field(default_factory=set)

    def add(self, name: str, role: str, identity: str | None = None) -> WorkerRecord:
        if name in self.workers and not self.workers[name].state.gone:
            raise ValueError(f"worker {name!r} already exists")
        if identity is not None and identity in self.retired_identities:
            raise ValueError(f"worker {name!r} on {identity} was retired; only a new pod may join under its name")
        rec = WorkerRecord(name, role, identity=identity)
        self.workers[name] = rec
        return rec

    def drain(self, name: str) -> WorkerRecord:
        """Mark for retirement; unknown names raise KeyError (404), the last active worker of a role DrainRefused."""
        rec = self.workers[name]
        if rec.state == WorkerState.ACTIVE:
            if self.active(rec.role) == [name]:
                raise DrainRefused(f"{name} is the last active {rec.role} worker; the job cannot run without one")
            rec.state = WorkerState.DRAINING
        return rec

    def retire(self, name: str, lost: bool = False) -> None:
        """Out of the job for good: `lost` when it died (its pod is being replaced), else retired (its pod may
        live on until the operator deletes it)."""
        rec = self.workers[name]
        rec.state = WorkerState.LOST if lost else WorkerState.RETIRED
        if rec.identity is not None:
            self.retired_identities.add(rec.identity)

    def active(self, role: str) -> list[str]:
        return [w.name for w in self.workers.values() if w.role == role and w.state == WorkerState.ACTIVE]

    def draining(self, role: str | None = None) -> list[str]:
        return [w.name for w in self.workers.values()
                if w.state == WorkerState.DRAINING and (role is None or w.role == role)]

    def as_status(self) -> list[dict]:
        return [{"name": w.name, "role": w.role, "state": w.state.value} for w in self.workers.values()]


def split_even(items: Sequence, parts: int) -> list[list]:
    """Contiguous, near-equal split (first parts one longer), deterministic: data-parallel shards."""
    n = len(items)
    out, start = [], 0
    for i in range(parts):
        size = n // parts + (1 if i < n % parts else 0)
        out.append(list(items[start:start + size]))
        start += size
    return out
