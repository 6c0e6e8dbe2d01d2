"""Recipes: everything that determines a built policy (architecture, data, schedule), hashed into its cache name.

A recipe either trains on the task's worked solutions (`teacher=None`: supervised warm-up) or distills
a teacher (`teacher="builtin:…"`): the teacher samples responses at temperature 1 — what RL rollouts
look like — and the student is trained on the teacher's full next-token distributions along those
samples (forward KL), which is what speculative-decoding acceptance rewards.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

from ..rl.task import DEFAULT_MIX
from ..rl.tokenizer import CharTokenizer

# Bump when the training code changes what a recipe produces, so caches built by older code are not reused.
BUILD_CODE_VERSION = 1


@dataclass(frozen=True)
class Recipe:
    name: str
    # architecture (transformers.LlamaConfig)
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int | None = None
    max_position_embeddings: int = 512
    # data: the builtin arithmetic task
    difficulty: tuple[tuple[str, float], ...] = tuple(DEFAULT_MIX.items())
    train_size: int = 20000
    data_seed: int = 1000
    # optimisation
    steps: int = 500
    batch_tokens: int = 4096        # padded tokens per batch (batches are length-bucketed)
    lr: float = 3e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 50
    weight_decay: float = 0.01
    seed: int = 0
    # bf16 autocast for the forward pass (weights and optimizer stay fp32); used only where the CPU has
    # native bf16 matmuls (AMX / AVX512-BF16), otherwise the build falls back to fp32 and says so
    bf16_autocast: bool = False
    # distillation (draft models): teacher recipe name; responses sampled from it at temperature 1
    teacher: str | Recipe | None = None
    teacher_samples: int = 0
    teacher_max_new_tokens: int = 192
    # block expansion (LLaMA-Pro): start from this recipe's trained weights, each of its layers followed by copies
    # whose output projections (o_proj, down_proj) are zero, so the grown model computes exactly what the base
    # does until the SFT steps above train every layer
    grow_from: str | None = None
    # evaluation after the build (recorded in build_info.json; not part of the identity)
    eval_size: int = field(default=200, compare=False)
    description: str = field(default="", compare=False)

    def __post_init__(self) -> None:
        if self.hidden_size % self.num_heads:
            raise ValueError(f"recipe {self.name}: hidden_size {self.hidden_size} is not divisible by "
                             f"num_heads {self.num_heads}")
        if self.grow_from is not None and self.teacher is not None:
            raise ValueError(f"recipe {self.name}: grow_from and teacher are exclusive")
        if self.teacher is not None and self.teacher_samples <= 0:
            raise ValueError(f"recipe {self.name}: teacher_samples must be > 0 when teacher is set")

    @property
    def difficulty_mix(self) -> dict[str, float]:
        return dict(self.difficulty)

    def identity(self) -> dict[str, Any]:
        """What the digest covers: every field that changes the trained weights, plus code and vocab versions."""
        d = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.compare}
        if isinstance(self.teacher, Recipe):  # the teacher's own digest is mixed in by digest()
            d["teacher"] = self.teacher.name
        d["code_version"] = BUILD_CODE_VERSION
        d["vocab"] = hashlib.sha256("\x00".join(CharTokenizer().id_to_token).encode()).hexdigest()[:16]
        return d

    def digest(self, teacher_digest: str | None = None, base_digest: str | None = None) -> str:
        payload = self.identity()
        if teacher_digest is not None:
            payload["teacher_digest"] = teacher_digest
        if base_digest is not None:
            payload["base_digest"] = base_digest
        return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()[:12]

    def approx_parameters(self, vocab_size: int = 100) -> int:
        head_dim = self.hidden_size // self.num_heads
        kv = (self.num_kv_heads or self.num_heads) * head_dim
        attn = 2 * self.hidden_size * self.hidden_size + 2 * self.hidden_size * kv
        mlp = 3 * self.hidden_size * self.intermediate_size
        return self.num_layers * (attn + mlp + 2 * self.hidden_size) + 2 * vocab_size * self.hidden_size + self.hidden_size

    def replace(self, **changes: Any) -> Recipe:
        return dataclasses.replace(self, **changes)


BUILTIN_RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        # Small batches and many steps: what this policy must learn first is to copy operands from the prompt
        # (an induction-style circuit that appears after enough optimizer steps, not enough tokens), and at a
        # fixed CPU budget a narrower model gets ~2x the steps. A fifth of the warm-up is hard problems: the
        # policy must write their long worked solutions (the rollouts' long tail), even where it gets the
        # arithmetic wrong, and it must keep writing them at temperature 1, where RL has room to sharpen it.
        # Two layers, not four: at the same CPU budget (~160-180 CPU-seconds on one thread) a 2-layer model gets
        # 3000 steps instead of 1800 and solves 54% greedy / 48% at T=1 of the job's mix instead of 34% / 28.5%
        # (build_info.json of both, 200 held-out problems).
        Recipe(
            name="tiny",
            description="local-run policy: ~0.45M params, 2 layers, SFT warm-up on the worked solutions of all sizes",
            hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4, max_position_embeddings=256,
            difficulty=(("easy", 0.8), ("medium", 0.1), ("hard", 0.1)),
            steps=3000, batch_tokens=1024, lr=3e-3, warmup_steps=60,
        ),
        Recipe(
            name="tiny-draft",
            description="draft for tiny: 1 layer, distilled from tiny's temperature-1 samples on the default mix",
            hidden_size=96, intermediate_size=256, num_layers=1, num_heads=3,
            steps=400, batch_tokens=4096, lr=3e-3, warmup_steps=30,
            teacher="tiny", teacher_samples=2400,
        ),
        # The main job's policy: tiny grown 2x wider and 3x deeper (6 layers x 256), then 400 SFT steps. A decode
        # step of this width and depth costs several times a 2-layer x 128 step (1.9 vs 0.4 ms at batch 1, one
        # thread), so tiny, which it starts from and stays close to, drafts for it cheaply with high acceptance.
        # Grown, not trained from scratch: from scratch, ~4 minutes of bf16 SFT (1000 steps) of the same shape
        # solved 8% greedy / 4% at T=1; growing keeps tiny's 3000-step warm-up.
        Recipe(
            name="small",
            description="main-job policy: ~5.2M params, 6 layers x 256, tiny grown (HyperCloning width, LLaMA-Pro "
                        "depth), then SFT",
            hidden_size=256, intermediate_size=768, num_layers=6, num_heads=8, max_position_embeddings=256,
            difficulty=(("easy", 0.8), ("medium", 0.1), ("hard", 0.1)), data_seed=2000,
            steps=400, batch_tokens=1024, lr=5e-4, warmup_steps=30, bf16_autocast=True, grow_from="tiny",
        ),
        Recipe(
            name="bench",
            description="engine benchmark target: ~27M params Llama, SFT on the task",
            hidden_size=512, intermediate_size=1536, num_layers=8, num_heads=8,
            steps=320, batch_tokens=2048, lr=2e-3, warmup_steps=30, bf16_autocast=True,
        ),
        Recipe(
            name="bench-draft",
            description="draft for bench: 2 narrow layers, distilled from bench's temperature-1 samples",
            hidden_size=128, intermediate_size=384, num_layers=2, num_heads=4,
            steps=300, batch_tokens=4096, lr=3e-3, warmup_steps=30,
            teacher="bench", teacher_samples=400, teacher_max_new_tokens=128,
        ),
    )
}


def resolve_recipe(name: str) -> Recipe:
    """`builtin:tiny` or `tiny` -> its recipe; a clear error listing the builtins otherwise."""
    key = name.removeprefix("builtin:")
    if key not in BUILTIN_RECIPES:
        raise ValueError(f"model: unknown builtin {name!r}; builtins: "
                         + ", ".join(f"builtin:{k}" for k in BUILTIN_RECIPES))
    return BUILTIN_RECIPES[key]
