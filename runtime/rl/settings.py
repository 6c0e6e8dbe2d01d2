"""The flat view of an RLJob that the runtime's workers read.

`specrl.runtime.api.RLJob` is the one source of truth for the spec; `RunSettings.from_job` maps it onto the
few values the coordinator, trainers and rollout workers need, so those modules do not reach deep into the
spec tree and a worker can be handed a small picklable object.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any


@dataclass(frozen=True)
class RunSettings:
    job: str = "local"
    namespace: str = "default"
    model: str = "builtin:tiny"
    dtype: str = "auto"  # spec.model.dtype; devices.weights_dtype / decode_dtype resolve "auto"
    revision: str | None = None
    chat_template: bool = True
    system_prompt: str | None = None
    draft_model: str | None = "builtin:tiny-draft"
    method: str = "draft_model"
    num_speculative_tokens: int = 4
    adaptive: bool = False  # the spec's adaptive controller (calibrated at worker start); from_job sets it
    dataset: str = "builtin:arithmetic"
    dataset_size: int = 2000
    difficulty: dict[str, float] | None = None
    prompt_field: str = "prompt"   # JSONL keys (spec.dataset.promptField / answerField)
    answer_field: str = "answer"
    reward: str = "builtin:exact_match"
    group_size: int = 4
    prompts_per_step: int = 8
    steps: int = 10
    lr: float = 1e-5
    clip_eps: float = 0.2
    kl_coef: float = 0.0
    max_new_tokens: int = 64
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    mini_batches: int = 1  # optimizer steps per RL step (PPO-style mini-batches)
    epochs: int = 1        # passes over the step's samples
    mode: str = "sync"
    max_staleness: int = 0
    long_tail_fraction: float = 0.25
    drafter_training: bool = True
    drafter_lr: float = 1e-3
    drafter_max_steps: int = 16
    trainers: int = 1
    rollouts: int = 1
    sync_backend: str = "gloo"
    rollout_engine: str = "native"  # native | vllm (spec.rolloutEngine)
    gpus_per_pod: int = 0  # GPUs each trainer/rollout actor holds (spec.resources.gpusPerPod; 0 = CPU)
    bucket_mb: int = 64
    checkpoint_dir: str | None = None
    checkpoint_interval: int = 0
    checkpoint_keep: int = 3
    seed: int = 0
    eval_every: int = 0  # held-out greedy eval after every N steps (0 = only before/after, in `specrl run`)
    eval_size: int = 256  # held-out greedy eval before/after: large enough that a few-point rise is not noise
    micro_batch: int = 16
    chunk_prompts: int = 0  # prompts per rollout assignment; 0: see `rollout_chunk`
    torch_threads: int = 1
    trainer_threads: int = 0  # the trainers' intra-op threads (0: torch_threads)
    reward_timeout_s: float = 30.0
    sync_timeout_s: float = 120.0
    chunk_timeout_s: float = 900.0
    collective_timeout_s: float = 300.0  # the trainers' data-parallel group (spec.faultTolerance)
    prompt_retries: int = 2
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def rollout_chunk(self) -> int:
        """Most prompts one rollout assignment holds. By default the native engine takes the step's prompts spread
        over the idle workers, one generate() each, so continuous batching sees the whole batch and its long tail
        once (chunks of 2 prompts decoded every chunk's own tail at small batch), and it reports its progress while
        it decodes (`RolloutWorker.decoding`). vLLM reports none during a generate, so its chunks stay at 2 prompts:
        the hang clock and the long-tail signal come from chunk completions there."""
        if self.chunk_prompts:
            return self.chunk_prompts
        return 2 if self.rollout_engine == "vllm" else self.prompts_per_step

    def replace(self, **changes: Any) -> RunSettings:
        return replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @property
    def step_batch(self) -> int:
        """Sequences per step (prompts × group size)."""
        return self.prompts_per_step * self.group_size

    @property
    def staleness(self) -> int:
        return self.max_staleness if self.mode == "async" else 0

    @classmethod
    def from_job(cls, job: Any) -> RunSettings:
        """Map an `RLJob` (specrl.runtime.api) onto the runtime's settings."""
        return settings_from_job(job)


def settings_from_job(job: Any) -> RunSettings:
    """Map a validated `specrl.runtime.api.RLJob` onto the runtime's settings."""
    from ..api import collective_timeout

    spec = job.spec
    alg, ds, sp, res = spec.algorithm, spec.dataset, spec.speculative, spec.resources
    if ds.type == "jsonl":
        dataset, size, difficulty = str(ds.path), 0, None
    else:
        d = ds.synthetic.difficulty
        dataset, size = "builtin:arithmetic", ds.synthetic.size
        difficulty = {"easy": d.easy, "medium": d.medium, "hard": d.hard}
    reward = spec.reward.function if spec.reward.type == "function" else f"builtin:{spec.reward.type}"
    backend = spec.weight_sync.backend or ("nccl" if res.gpus_per_pod > 0 and _has_cuda() else "gloo")
    return RunSettings(
        job=job.metadata.name,
        namespace=job.metadata.namespace or "default",
        model=spec.model.name,
        dtype=spec.model.dtype,
        revision=spec.model.revision,
        chat_template=spec.model.chat_template,
        system_prompt=spec.model.system_prompt,
        draft_model=sp.draft_model,
        method=sp.method,
        num_speculative_tokens=sp.num_speculative_tokens,
        adaptive=sp.method != "none" and (sp.adaptive.toggle or sp.adaptive.draft_length or sp.adaptive.strategy),
        dataset=dataset,
        dataset_size=size,
        difficulty=difficulty,
        prompt_field=ds.prompt_field,
        answer_field=ds.answer_field,
        reward=str(reward),
        group_size=alg.group_size,
        prompts_per_step=alg.prompts_per_step,
        steps=alg.steps,
        lr=alg.learning_rate,
        clip_eps=alg.clip_ratio,
        kl_coef=alg.kl_coef,
        max_new_tokens=alg.max_new_tokens,
        temperature=alg.temperature,
        top_p=alg.top_p,
        top_k=alg.top_k,
        mini_batches=alg.mini_batches,
        epochs=alg.epochs,
        mode=spec.mode,
        max_staleness=spec.max_staleness,
        long_tail_fraction=spec.elastic.long_tail_fraction,
        drafter_training=sp.drafter_training.enabled and sp.method != "none",
        drafter_lr=sp.drafter_training.learning_rate,
        trainers=res.trainer.replicas,
        rollouts=res.rollout.replicas,
        sync_backend=backend,
        rollout_engine=spec.rollout_engine,
        gpus_per_pod=res.gpus_per_pod,
        bucket_mb=spec.weight_sync.bucket_mib,
        checkpoint_dir=spec.checkpoint.path,
        checkpoint_interval=spec.checkpoint.interval if spec.checkpoint.path else 0,
        checkpoint_keep=spec.checkpoint.keep,
        seed=alg.seed,
        eval_every=alg.eval_every,
        eval_size=alg.eval_size,
        reward_timeout_s=spec.reward.timeout_seconds,
        sync_timeout_s=spec.weight_sync.timeout_seconds,
        chunk_timeout_s=spec.fault_tolerance.rollout_chunk_timeout_seconds,
        prompt_retries=spec.fault_tolerance.prompt_retries,
        collective_timeout_s=collective_timeout(spec.fault_tolerance.collective_timeout_seconds,
                                                spec.progress_deadline_seconds),
        extra={"speculative": sp.model_dump(by_alias=True, exclude_none=True)},
    )


def _has_cuda() -> bool:
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:
        return False
