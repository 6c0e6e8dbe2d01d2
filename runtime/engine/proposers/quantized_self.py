"""quantized_self: a weight-quantized copy of the policy drafts for the policy (EfficientRollout's idea): 4-bit
group-wise where the CPU has the kernel (a quarter of the target's bf16 bytes per draft token), else int8.

No extra model to train or sync: the drafter is re-quantized from the policy's current weights on every
`refresh` (the engine calls it after `load_policy_state`), so it never goes stale.

It drafts over the target's own KV cache, as layer_skip does: the drafter has the target's architecture, so the
target's K/V of every committed position is a valid (better) context for it, and there is nothing to prefill on
admission and nothing to catch up after a step. Its draft positions are written past the target's length, and the
verification forward overwrites each of them before it reads it. Any q stays lossless: the rejection sampler is
handed the very distribution each draft was sampled from. Where the quantized runner computes in another dtype
than the target's (4-bit bfloat16 kernels beside a float32 target), it keeps a cache of its own instead.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..model_runner import quantize_bits
from .base import DraftContext, Proposal, draft_over_target_cache
from .draft_model import DraftModelProposer

if TYPE_CHECKING:
    from ..engine import RolloutEngine


class QuantizedSelfProposer(DraftModelProposer):
    name = "quantized_self"

    def __init__(self, policy: nn.Module, bits: int | None = None) -> None:
        super().__init__(policy, quantize=quantize_bits(policy, bits))
        self.engine: RolloutEngine | None = None  # set when drafting over the target's cache

    def attach(self, engine: RolloutEngine) -> None:
        self.runner = self.build_runner(engine)
        if self.runner.dtype == engine.runner.dtype:
            self.engine = engine
        else:
            self.own_cache(engine)

    @property
    def shares_target_cache(self) -> bool:
        return self.engine is not None

    # With the target's cache, slot bookkeeping is the engine's: these have nothing of their own to do.
    def reset_slot(self, slot: int) -> None:
        if self.engine is None:
            super().reset_slot(slot)

    def move_slot(self, src: int, dst: int) -> None:
        if self.engine is None:
            super().move_slot(src, dst)

    def prefill(self, slot0: int, prompts: torch.Tensor, lens: list[int]) -> None:
        if self.engine is None:
            super().prefill(slot0, prompts, lens)

    def copy_prefix(self, src: list[int], dst: list[int], lens: list[int]) -> None:
        if self.engine is None:
            super().copy_prefix(src, dst, lens)

    def truncate(self, target_lens: list[int]) -> None:
        if self.engine is None:
            super().truncate(target_lens)

    def refresh(self, policy: nn.Module | None = None) -> None:
        if policy is not None:
            self.draft_model = policy
            if self.runner is not None:
                self.runner.model = policy
        if self.runner is not None:
            self.runner.refresh()  # re-quantize from the current policy weights

    def propose(self, ctx: DraftContext, gamma: int) -> Proposal:
        if self.engine is None:
            return super().propose(ctx, gamma)
        assert self.runner is not None
        return draft_over_target_cache(self.runner, self.engine.cache, ctx, gamma)
