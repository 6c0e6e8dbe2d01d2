"""layer_skip: early exit of the target itself (first k layers + the target's final norm and lm_head).

Shares the target's weights AND its KV cache: for every token the target has processed, layers 0..k-1 hold
exactly what the early-exit drafter would compute, so the drafter needs no catch-up. Its draft positions
are written past the target's length and are overwritten by the verification forward, which covers them.
q is the processed distribution of the early-exit logits (sampled, returned for min(1, p/q)).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from torch import nn

from .base import DraftContext, Proposal, Proposer, draft_over_target_cache

if TYPE_CHECKING:
    from ..engine import RolloutEngine


class LayerSkipProposer(Proposer):
    name = "layer_skip"

    def __init__(self, num_layers: int | None = None) -> None:
        self.requested_layers = num_layers

    def attach(self, engine: RolloutEngine) -> None:
        self.engine = engine
        total = engine.runner.num_layers
        k = self.requested_layers if self.requested_layers is not None else max(1, total // 2)
        if not (1 <= k <= total):
            raise ValueError(f"layer_skip_layers: must be between 1 and {total}, got {k}")
        self.num_layers = k

    def refresh(self, policy: nn.Module | None = None) -> None:
        return None  # shares the target runner's (already refreshed) weights

    def propose(self, ctx: DraftContext, gamma: int) -> Proposal:
        return draft_over_target_cache(self.engine.runner, self.engine.cache, ctx, gamma, self.num_layers)
