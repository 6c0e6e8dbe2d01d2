"""The trainer group: the data-parallel trainer actors, their membership changes, and one GRPO step over them.

Trainers join and leave only at step boundaries (`regroup`): the drained ones leave, the joining ones copy the
weights and optimizer state of a remaining rank, and every member enters one new data-parallel group.
"""

from __future__ import annotations

import logging
from typing import Any

from ..scheduling import LedgerError, split_even
from .placement import Placement, kill_actors
from .recovery import TrainerHealth
from .shared import Shared

log = logging.getLogger(__name__)

HEALTH_TIMEOUT_S = 10.0


def _first_line(exc: BaseException) -> str:
    return (f"{type(exc).__name__}: {exc}".strip().splitlines() or [""])[0][:300]


def training_batch(samples: list[dict], group_size: int) -> list[dict]:
    """A step's samples in prompt order, each group complete, with group-normalised advantages."""
    import torch

    from ..rl.grpo import group_advantages

    by_prompt: dict[str, list[dict]] = {}
    for smp in samples:
        by_prompt.setdefault(smp["prompt_id"], []).append(smp)
    ordered: list[dict] = []
    for pid in sorted(by_prompt, key=lambda p: int(p.split("-p")[1])):
        group = by_prompt[pid]
        if len(group) != group_size:
            raise LedgerError(f"prompt {pid} has {len(group)} samples, expected {group_size}")
        ordered.extend(group)
    if ordered:
        adv = group_advantages(torch.tensor([x["reward"] for x in ordered], dtype=torch.float64), group_size)
        for x, a in zip(ordered, adv.tolist()):
            x["advantage"] = float(a)
    return ordered


class TrainerGroup:
    def __init__(self, shared: Shared, placement: Placement) -> None:
        self.sh = shared
        self.placement = placement
        self.actors: dict[str, Any] = {}
        self.pending: dict[str, str | None] = {}  # trainers that join at the next step boundary -> node ID
        self.generation = 0  # bumped whenever the group changes (the weight-sync sender may have changed)

    def names(self) -> list[str]:
        return list(self.actors)

    def first(self) -> Any:
        """Rank 0: it sends the weights and holds the drafter's master copy."""
        return next(iter(self.actors.values()))

    def _spawn(self, name: str, rank: int, world: int, node_id: str | None) -> None:
        from ..rl.trainer import TrainerWorker

        with self.sh.lock:
            self.sh.table.add(name, "trainer", node_id)
        self.actors[name] = self.placement.start(TrainerWorker, name, "trainer", node_id, self.sh.series,
                                                 self.sh.settings, rank, world, name)

    def start(self, names: list[str], node_ids: dict[str, str] | None = None) -> None:
        import ray

        for rank, name in enumerate(names):
            self._spawn(name, rank, len(names), (node_ids or {}).get(name))
        self._ready(names)
        host, port = ray.get(self.first().node_address.remote())
        # each trainer picks the backend of its gradients' device (devices.collective_backend)
        ray.get([a.init_data_parallel.remote(host, port) for a in self.actors.values()])

    def _ready(self, names: list[str]) -> None:
        """Wait until these new trainers have loaded their models: the group's rendezvous is bounded by the
        collective timeout (faultTolerance.collectiveTimeoutSeconds), which must not include a model load."""
        import ray

        ray.get([self.actors[n].ping.remote() for n in names])

    def request_join(self, name: str, node_id: str | None = None) -> None:
        self.pending.setdefault(name, node_id)

    def regroup(self) -> None:
        """Apply trainer drains and joins: one new data-parallel group over the remaining and new trainers."""
        import ray

        with self.sh.lock:
            draining = [n for n in self.sh.table.draining("trainer") if n in self.actors]
        if not draining and not self.pending:
            return
        keep = [n for n in self.actors if n not in draining]
        if not keep and not self.pending:
            log.warning("not retiring %s: it is the last trainer", draining[-1])
            draining, keep = draining[:-1], [draining[-1]]
        source = keep[0] if keep else next(iter(self.actors))
        state = ray.get(self.actors[source].export_state.remote())
        if self.actors and next(iter(self.actors)) in draining and "drafter" not in state:
            state = {**state, **{k: v for k, v in ray.get(self.first().export_state.remote()).items()
                                 if k == "drafter"}}
        for name in draining:
            ray.kill(self.actors.pop(name))
            with self.sh.lock:
                self.sh.table.retire(name)
            log.info("trainer %s retired (drained)", name)
            self.sh.series.drop(name)
        self.reform(state, source if source in self.actors else None)

    def reform(self, state: dict[str, Any] | None, source: str | None) -> None:
        """Spawn the pending joiners and form one new data-parallel group over every trainer; every member but
        `source` (whose state `state` is) then copies `state`. `state` None: the caller loads a checkpoint."""
        import ray

        kept = set(self.actors)
        joining = dict(self.pending)
        self.pending.clear()
        for name, node_id in joining.items():
            self._spawn(name, len(self.actors), len(self.actors) + 1, node_id)
        self._ready(list(joining))
        names = list(self.actors)
        if not names:
            raise RuntimeError("no trainer left to form the data-parallel group")
        ray.get([self.actors[n].close_sync_group.remote() for n in names if n in kept])
        host, port = ray.get(self.actors[names[0]].node_address.remote())
        ray.get([self.actors[n].regroup.remote(rank, len(names), host, port) for rank, n in enumerate(names)])
        if state is not None:
            # rank 0 too when it is not the source: it holds the drafter master copy the state carries
            ray.get([self.actors[n].import_state.remote(state) for n in names if n != source or n == names[0]])
        self.generation += 1

    # -- trainer death (recovery.py decides, these act) ---------------------------------------------------

    def health(self, timeout_s: float = HEALTH_TIMEOUT_S) -> list[TrainerHealth]:
        """Every trainer's health; one that does not answer within `timeout_s` counts as dead."""
        import ray

        refs = {n: a.health.remote() for n, a in self.actors.items()}
        ready, _ = ray.wait(list(refs.values()), num_returns=len(refs), timeout=timeout_s) if refs else ([], [])
        out = []
        for name, ref in refs.items():
            try:
                if ref not in ready:
                    raise TimeoutError(f"no answer within {timeout_s:g}s")
                h = ray.get(ref)
                out.append(TrainerHealth(name, True, int(h["weight_version"]), bool(h["torn"])))
            except Exception as exc:  # noqa: BLE001 - dead, hung or unreachable: out of the group
                hung = isinstance(exc, TimeoutError)
                log.warning("trainer %s is %s: %s", name, "hung" if hung else "lost", _first_line(exc))
                out.append(TrainerHealth(name, False, hung=hung))
        return out

    def drop(self, names: list[str], hung: frozenset[str] = frozenset()) -> None:
        """Forget dead trainers: their actors are killed (in case one is only hung) and their identities retired,
        so only a new pod (or, locally, a respawned actor) takes their place. A dead one is `lost` (its pod failed
        and is being recreated); one in `hung` is retired: its pod lives on, and the operator replaces it."""
        import ray

        for name in names:
            actor = self.actors.pop(name, None)
            if actor is not None:
                try:
                    ray.kill(actor)
                except Exception as exc:  # noqa: BLE001 - it is dead already
                    log.debug("kill %s: %s", name, exc)
            with self.sh.lock:
                self.sh.table.retire(name, lost=name not in hung)
            self.sh.series.drop(name)
            log.warning("trainer %s dropped from the group", name)

    def state_of(self, name: str) -> dict[str, Any]:
        import ray

        return ray.get(self.actors[name].export_state.remote())

    def start_training(self, step: int, samples: list[dict], retrained: bool = False) -> list:
        """Split the step's groups evenly over the ranks and start one GRPO update on each (Ray refs).
        `retrained`: the step was trained before the job rolled back to a checkpoint (metrics count it apart)."""
        from ..rl.trainer import Sample

        g = self.sh.settings.group_size
        groups = [samples[i:i + g] for i in range(0, len(samples), g)]
        shards = split_even(groups, len(self.actors))
        total_tokens = sum(len(x["response_ids"]) for x in samples)
        return [actor.train_step.remote([Sample(**x) for grp in shard for x in grp], step, total_tokens, retrained)
                for actor, shard in zip(self.actors.values(), shards)]

    def account(self, samples: list[dict], train_out: list[dict], seconds: float, weight_version: int,
                retrained: bool = False) -> float:
        """Export the step's trainer series; returns the mean reward."""
        rewards = [x["reward"] for x in samples]
        mean = sum(rewards) / max(1, len(rewards))
        # Per-rank series from what each rank measured and returned (its own loss, time and samples).
        own = {o.get("worker"): o for o in train_out}
        for name in self.actors:
            wm = self.sh.series.of(name, "trainer")
            o = own.get(name, {})
            wm.trainer_step.set(weight_version)
            wm.trainer_step_duration.observe(float(o.get("seconds", seconds)))
            wm.trainer_reward_mean.set(mean)
            wm.trainer_samples.inc(int(o.get("samples", 0)))
            if retrained:
                wm.trainer_samples_retrained.inc(int(o.get("samples", 0)))
            if "loss" in o:
                wm.trainer_loss.set(o["loss"])
            if "grad_norm" in o:
                wm.trainer_grad_norm.set(o["grad_norm"])
            wm.weight_version.set(weight_version)
        self.sh.cm.trainer_reward_mean.set(mean)
        self.sh.cm.trainer_step.set(weight_version)
        return mean

    def digest(self) -> str:
        import ray

        return ray.get(self.first().digest.remote())

    def shutdown(self) -> None:
        kill_actors(self.actors)
