"""quantized_self: a weight-quantized copy of the policy drafts for the policy (EfficientRollout's idea): 4-bit
group-wise where the CPU has the kernel (a quarter of the target's bf16 bytes per draft token), else int8.

No extra model to train or sync: the drafter is re-quantized from the policy's current weights on every
`refresh` (the engine calls it after `load_policy_state`), so it never goes stale.
"""

from __future__ import annotations

from torch import nn

from ..model_runner import quantize_bits
from .draft_model import DraftModelProposer


class QuantizedSelfProposer(DraftModelProposer):
    name = "quantized_self"

    def __init__(self, policy: nn.Module, bits: int | None = None) -> None:
        super().__init__(policy, quantize=quantize_bits(policy, bits))

    def refresh(self, policy: nn.Module | None = None) -> None:
        if policy is not None:
            self.draft_model = policy
            if self.runner is not None:
                self.runner.model = policy
        if self.runner is not None:
            self.runner.refresh()  # re-quantize from the current policy weights
