"""Micro policy + draft built by the project's own bootstrap (seconds on one core) for runtime integration tests."""

from __future__ import annotations

from pathlib import Path

from specrl.runtime.models.bootstrap import ensure_built
from specrl.runtime.models.recipes import Recipe
from specrl.runtime.paths import cache_dir
from specrl.runtime.rl.settings import RunSettings

MICRO = Recipe(name="micro-test", hidden_size=32, intermediate_size=64, num_layers=1, num_heads=2,
               steps=40, batch_tokens=2048, train_size=400, warmup_steps=5, eval_size=0,
               max_position_embeddings=256)
MICRO_DRAFT = Recipe(name="micro-test-draft", hidden_size=16, intermediate_size=32, num_layers=1, num_heads=2,
                     steps=20, batch_tokens=2048, warmup_steps=5, eval_size=0, teacher=MICRO, teacher_samples=64,
                     teacher_max_new_tokens=48, max_position_embeddings=256)


def micro_models() -> tuple[Path, Path]:
    root = cache_dir("test-models")
    return ensure_built(MICRO, root=root, threads=1), ensure_built(MICRO_DRAFT, root=root, threads=1)


def micro_settings(**changes) -> RunSettings:
    policy, draft = micro_models()
    base = RunSettings(job="micro", model=str(policy), draft_model=str(draft), method="draft_model",
                       num_speculative_tokens=3, dataset_size=64, group_size=2, prompts_per_step=4, steps=2,
                       lr=1e-3, max_new_tokens=24, eval_size=4, drafter_max_steps=2, chunk_prompts=1,
                       bucket_mb=1, rollouts=2, trainers=1, extra={"drafter_seconds": 2.0})
    return base.replace(**changes)
