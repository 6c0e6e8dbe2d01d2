"""quantized_self: an int8 weight-only copy of the policy drafts for the policy (EfficientRollout's idea).

No extra model to train or sync: the drafter is re-quantized from the policy's current weights on every
`refresh` (the engine calls it after `load_policy_state`), so it never goes stale.
"""

from __future__ import annotations

from torch import nn

from .draft_model import DraftModelProposer


class QuantizedSelfProposer(DraftModelProposer):
    name = "quantized_self"

    def __init__(self, policy: nn.Module) -> None:
        super().__init__(policy, int8=True)

    def refresh(self, policy: nn.Module | None = None) -> None:
        if policy is not None:
            self.draft_model = policy
            if self.runner is not None:
                self.runner.model = policy
        if self.runner is not None:
            self.runner.refresh()  # re-quantize from the current policy weights
