"""layer_skip: early exit of the target itself (first k layers + the target's final norm and lm_head).

Shares the target's weights AND its KV cache: for every token the target has processed, layers 0..k-1 hold
exactly what the early-exit drafter would compute, so the drafter needs no catch-up. Its draft positions
are written past the target's length and are overwritten by the verification forward, which covers them.
q is the processed distribution of the early-exit logits (sampled, returned for min(1, p/q)).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from .base import DraftCollector, DraftContext, Proposal, Proposer

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
        runner = self.engine.runner
        cache = self.engine.cache
        dev = runner.device
        n = [len(t) for t in ctx.tokens]
        tok = torch.tensor([[t[-1]] for t in ctx.tokens], dtype=torch.int64, device=dev)
        drafts = DraftCollector(ctx)
        for j in range(gamma):
            logits, _ = runner.forward(cache, 0, [x - 1 + j for x in n], tok, num_layers=self.num_layers)
            tok = drafts.add(logits[:, 0]).unsqueeze(1)
        return drafts.proposal()
