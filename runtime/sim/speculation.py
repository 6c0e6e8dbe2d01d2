"""The engine's speculation policy as the simulator runs it: when to speculate and with which draft length.

Same rule as the engine's adaptive controller: predicted speedup L/(gamma*r+v) from the cost model at the
current active batch, speculate only above 1 + margin, pick gamma that maximises it ("adaptive").
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from .cost_model import CostModel, accepted_length, predicted_speedup
from .scenario import Speculative


@dataclass(frozen=True)
class Choice:
    gamma: int           # 0 = plain decoding
    tokens_per_iter: float
    seconds_per_iter: float


class SpeculationPolicy:
    def __init__(self, spec: Speculative, costs: CostModel) -> None:
        self.spec = spec
        self.costs = costs
        self._memo: dict[tuple[int, int, float], Choice] = {}

    def length(self, alpha: float, gamma: int) -> float:
        return accepted_length(alpha, gamma, self.spec.acceptance.per_position or None)

    def choose(self, batch: int, ctx_sum: float, alpha: float) -> Choice:
        """Memoised on (batch, context within 1%, alpha): a step has millions of identical decisions."""
        key = (batch, int(math.log1p(ctx_sum) * 100), alpha)
        hit = self._memo.get(key)
        if hit is None:
            hit = self._memo[key] = self._choose(batch, ctx_sum, alpha)
        return hit

    def _choose(self, batch: int, ctx_sum: float, alpha: float) -> Choice:
        ar = Choice(0, 1.0, self.costs.target_step(batch, ctx_sum))
        if self.spec.drafter == "none":
            return ar
        gammas = [self.spec.num_speculative_tokens] if self.spec.policy != "adaptive" else self.spec.gamma_choices
        best, best_gain = ar, 1.0
        for g in gammas:
            c = self.costs.costs(batch, ctx_sum, g)
            verify = c.verify + self.spec.overhead_ms * 1e-3
            gain = predicted_speedup(self.length(alpha, g), g, c.draft / c.target, verify / c.target)
            if gain > best_gain:
                best, best_gain = Choice(g, self.length(alpha, g), g * c.draft + verify), gain
        if self.spec.policy == "always":
            g = self.spec.num_speculative_tokens
            return Choice(g, self.length(alpha, g), self.costs.sd_iteration(batch, ctx_sum, g))
        return best if best_gain > 1.0 + self.spec.toggle_margin else ar
