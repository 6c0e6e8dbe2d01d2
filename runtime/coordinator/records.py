"""Step records (one row of `metrics.jsonl` per RL step) and the per-worker metric series the coordinator keeps."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any, ClassVar


def acceptance_length(stats: dict[str, float]) -> float | None:
    drafts = stats.get("drafts", 0.0)
    return 1.0 + stats.get("accepted_tokens", 0.0) / drafts if drafts else None


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
    overlap_chunks: int = 0  # rollout chunks of later steps that finished while this step trained (async)
    dropped: int = 0  # prompts dropped so far (their rollout raised promptRetries + 1 times)
    workers: dict[str, int] = field(default_factory=dict)
    eval_accuracy: float | None = None  # held-out greedy accuracy after this step (spec.algorithm.evalEvery)
    eval_seconds: float | None = None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class StepTimes:
    rollout: float
    long_tail: float
    train: float
    total: float


def chunk_totals(chunks: list[dict]) -> dict[str, float]:
    """Engine statistics of a step: the sum over its chunks."""
    agg: dict[str, float] = {}
    for c in chunks:
        for k, v in c["stats"].items():
            agg[k] = agg.get(k, 0.0) + v
    return agg


def sd_share(agg: dict[str, float]) -> float | None:
    """Share of decode steps that speculated (None when nothing was decoded)."""
    sd_steps, ar_steps = agg.get("sd_steps", 0.0), agg.get("ar_steps", 0.0)
    return sd_steps / (sd_steps + ar_steps) if sd_steps + ar_steps else None


def build_record(step: int, group_size: int, samples: list[dict], chunks: list[dict], train_out: list[dict],
                 times: StepTimes, sync_info: dict, drafter_info: dict, *, reward_errors: int, requeued: int,
                 dropped: int, overlap_chunks: int, workers: dict[str, int]) -> StepRecord:
    agg = chunk_totals(chunks)
    tokens = sum(len(x["response_ids"]) for x in samples)
    rewards = [x["reward"] for x in samples]
    return StepRecord(
        step=step, weight_version=step + 1,
        reward_mean=sum(rewards) / max(1, len(rewards)),
        accuracy=sum(1 for x in samples if x.get("correct")) / max(1, len(samples)),
        samples=len(samples), prompts=len(samples) // group_size, tokens=tokens,
        rollout_seconds=times.rollout, long_tail_seconds=times.long_tail, train_seconds=times.train,
        sync_seconds=float(sync_info.get("seconds", 0.0)), sync_bytes=int(sync_info.get("bytes", 0)),
        drafter_seconds=float(drafter_info.get("seconds", 0.0)), drafter_steps=int(drafter_info.get("steps", 0)),
        drafter_where=drafter_info.get("where"),
        step_seconds=times.total, tokens_per_s=tokens / times.rollout if times.rollout > 0 else 0.0,
        acceptance_length=acceptance_length(agg), sd_share=sd_share(agg),
        response_lengths=[len(x["response_ids"]) for x in samples],
        loss=sum(o["loss"] for o in train_out),
        clip_fraction=sum(o["clip_fraction"] for o in train_out) / max(1, len(train_out)),
        staleness_max=max((step - x["weight_version"] for x in samples), default=0),
        reward_errors=reward_errors, requeued=requeued, dropped=dropped, overlap_chunks=overlap_chunks,
        workers=workers,
    )


class WorkerSeries:
    """The metric series the coordinator exports on behalf of each worker (labels role/worker), in its registry.

    For a worker that serves its own /metrics (a pod, see `metrics.serve_own_metrics`) the series its process
    produces go to a private registry instead, so that Prometheus sees each series once. A retired worker's
    series are dropped, so it does not linger on dashboards.
    """

    def __init__(self, job: str, namespace: str, registry: Any) -> None:
        self.job, self.namespace, self.registry = job, namespace, registry
        self._by_name: dict[str, _Series] = {}
        self._self_serving: set[str] = set()

    def serves_own(self, name: str) -> None:
        """`name` serves its own series from now on (call before its first `of`)."""
        self._self_serving.add(name)
        self._by_name.pop(name, None)

    def of(self, name: str, role: str) -> _Series:
        from prometheus_client import CollectorRegistry

        from ..metrics import WORKER_OWNED, RuntimeMetrics

        if name not in self._by_name:
            exported = RuntimeMetrics(self.job, self.namespace, role, name, registry=self.registry)
            private = None
            owned = WORKER_OWNED.get(role, frozenset())
            if name in self._self_serving:
                private = RuntimeMetrics(self.job, self.namespace, role, name, registry=CollectorRegistry())
                # RuntimeMetrics binds every family to the worker's labels; the pod exports these itself.
                exported.remove_families(owned | {"start_time", "eval_accuracy"})
            self._by_name[name] = _Series(exported, private, owned)
        return self._by_name[name]

    def drop(self, name: str) -> None:
        series = self._by_name.pop(name, None)
        if series is not None:
            series.exported.remove()
        self._self_serving.discard(name)


class _Series:
    """A worker's RuntimeMetrics as the coordinator writes them: the worker's own series to `private` when the
    worker serves them itself, everything else to `exported`."""

    def __init__(self, exported: Any, private: Any, owned: frozenset[str]) -> None:
        self.exported, self.private, self.owned = exported, private, owned

    # methods that write a family (RuntimeMetrics.count_accepted_per_position)
    _WRITES: ClassVar[dict[str, str]] = {"count_accepted_per_position": "spec_num_accepted_tokens_per_pos"}

    def __getattr__(self, attr: str) -> Any:
        family = self._WRITES.get(attr, attr)
        target = self.private if self.private is not None and family in self.owned else self.exported
        return getattr(target, attr)
