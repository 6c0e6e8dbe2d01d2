"""Step-time model of rollout instances, drafters, training and weight sync.

Decode is memory-bound at small batch and compute-bound at large batch: one step costs
max(bytes read / achieved bandwidth, FLOPs / achieved FLOP/s) + a fixed and a per-sequence overhead.
Verifying gamma+1 draft tokens reads the weights once (dense) but does (gamma+1)x the FLOPs, which is why
speculation pays in the long tail and not at full batch. A `Calibration` (measured on a real machine)
replaces the roofline for the target step and the draft/verify ratios.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

from ..engine.adaptive import CostModel as EngineCostModel
from ..engine.adaptive import expected_tokens_per_round
from .hardware import GPU, ModelSpec
from .hardware import gpu as gpu_named
from .hardware import model as model_named
from .scenario import Calibration, Scenario


def accepted_length(alpha: float, gamma: int, per_position: list[float] | None = None) -> float:
    """Expected tokens emitted per speculative iteration: 1 + sum_i prod_{j<=i} a_j (bonus included).

    With a constant per-token acceptance this is the engine's L = (1 - alpha^(gamma+1)) / (1 - alpha).
    """
    if gamma <= 0:
        return 1.0
    if not per_position:
        return expected_tokens_per_round(alpha, gamma)
    rates = list(per_position[:gamma]) if per_position else []
    rates += [alpha] * (gamma - len(rates))
    total, run = 1.0, 1.0
    for a in rates:
        run *= a
        total += run
    return total


def predicted_speedup(length: float, gamma: int, draft_ratio: float, verify_ratio: float) -> float:
    """The engine's speedup = L / (gamma * r + v), for an accepted length L that may come from a per-position table."""
    return length / (gamma * draft_ratio + verify_ratio)


@dataclass(frozen=True)
class StepCosts:
    """Seconds of one target decode step, one draft step and one verify pass for a batch."""

    target: float
    draft: float
    verify: float


class CostModel:
    def __init__(self, scenario: Scenario) -> None:
        self.s = scenario
        self.gpu: GPU = gpu_named(scenario.cluster.gpu)
        self.model: ModelSpec = model_named(scenario.model)
        self.tp = scenario.rollout.tensor_parallel
        self.eff = scenario.rollout.efficiency
        spec = scenario.speculative
        self.draft_spec: ModelSpec | None = model_named(spec.draft_model) if spec.draft_model else None
        # measured costs (`calibration:` in the scenario) replace the roofline wherever they exist
        self.measured = _engine_cost_model(scenario.calibration) if scenario.calibration else None

    # -- forward passes ------------------------------------------------------------------------------------
    def _forward(self, m: ModelSpec, batch: int, ctx_sum: float, tokens_per_seq: int, weight_scale: float = 1.0,
                 kv_scale: float = 1.0, layer_scale: float = 1.0) -> float:
        """Roofline time of one forward over `batch` sequences, `tokens_per_seq` new tokens each."""
        tokens = batch * tokens_per_seq
        weights = m.weight_bytes_read(tokens) * weight_scale * layer_scale
        kv = m.kv_bytes_per_token * ctx_sum * kv_scale * layer_scale
        memory = (weights + kv) / (self.gpu.hbm_bytes_per_s * self.eff.bandwidth * self.tp)
        attn_flops = 4.0 * m.layers * m.hidden * ctx_sum * tokens_per_seq * layer_scale
        flops = 2.0 * m.active_params * tokens * layer_scale + attn_flops
        compute = flops / (self.gpu.flops * self.eff.decode_mfu * self.tp)
        return max(memory, compute)

    def _overhead(self, batch: int) -> float:
        return self.eff.step_overhead_ms * 1e-3 + self.eff.per_seq_overhead_us * 1e-6 * batch

    def target_step(self, batch: int, ctx_sum: float) -> float:
        if self.measured is not None:
            return self.measured.t_ar(batch)
        return self._forward(self.model, batch, ctx_sum, 1) + self._overhead(batch)

    def verify_step(self, batch: int, ctx_sum: float, gamma: int) -> float:
        """One verification pass, including the proposer's fixed per-round cost when it was measured."""
        if self.measured is not None:
            method = self.s.speculative.drafter
            extra = self.measured.round_overhead(method, batch) if method in self.measured.overhead else 0.0
            return (self.measured.v(batch, gamma) + extra) * self.measured.t_ar(batch)
        return self._forward(self.model, batch, ctx_sum, gamma + 1) + self._overhead(batch)

    def draft_step(self, batch: int, ctx_sum: float) -> float:
        """One drafted token for the whole batch, by the scenario's drafter kind."""
        if self.measured is not None:
            return self.measured.r(self.s.speculative.drafter, batch) * self.measured.t_ar(batch)
        spec, m = self.s.speculative, self.model
        kind = spec.drafter
        small = self.eff.step_overhead_ms * 1e-3 * 0.25  # drafters run inside the same graph launch
        if kind == "ngram":
            return small
        if kind == "draft_model":
            assert self.draft_spec is not None
            return self._forward(self.draft_spec, batch, ctx_sum, 1) + small
        if kind == "quantized_self":
            return self._forward(m, batch, ctx_sum, 1, weight_scale=spec.quant_bits / 16.0) + small
        if kind == "layer_skip":
            return self._forward(m, batch, ctx_sum, 1, layer_scale=spec.skip_fraction) + small
        return self._forward(self._head, batch, ctx_sum, 1) + small

    @cached_property
    def _head(self) -> ModelSpec:
        """eagle / eagle3 / mtp drafters: one transformer layer at the target's width plus the LM head."""
        m = self.model
        params_b = (m.layer_params + m.vocab * m.hidden) / 1e9
        return ModelSpec(name="head", params_b=params_b, active_params_b=params_b, layers=1, hidden=m.hidden,
                         kv_heads=m.kv_heads, head_dim=m.head_dim, vocab=m.vocab)

    def costs(self, batch: int, ctx_sum: float, gamma: int) -> StepCosts:
        return StepCosts(self.target_step(batch, ctx_sum), self.draft_step(batch, ctx_sum),
                         self.verify_step(batch, ctx_sum, gamma))

    def sd_iteration(self, batch: int, ctx_sum: float, gamma: int) -> float:
        c = self.costs(batch, ctx_sum, gamma)
        return gamma * c.draft + c.verify + self.s.speculative.overhead_ms * 1e-3

    def prefill(self, sequences: int, prompt_tokens: int) -> float:
        if sequences <= 0:
            return 0.0
        if self.measured is not None:
            # a prefill is one forward over prompt_tokens new tokens per sequence, which is what a verify pass
            # of gamma = prompt_tokens - 1 measures (linear in tokens beyond the calibrated gammas)
            return self.measured.v(sequences, prompt_tokens - 1) * self.measured.t_ar(sequences)
        flops = 2.0 * self.model.active_params * sequences * prompt_tokens
        return flops / (self.gpu.flops * self.eff.prefill_mfu * self.tp) + self._overhead(sequences)

    # -- training and sync ---------------------------------------------------------------------------------
    def train_step(self, tokens: float, gpus: int) -> float:
        t = self.s.training
        passes = 6.0 + (2.0 if t.recompute_logprobs else 0.0) + (2.0 if t.reference_model else 0.0)
        flops = passes * self.model.active_params * tokens
        return flops / (gpus * self.gpu.flops * t.mfu) + t.fixed_overhead_s

    def weight_sync(self, colocated: bool) -> float:
        bytes_ = self.model.params * self.model.bytes_per_param
        if self.s.speculative.drafter == "draft_model" and self.draft_spec is not None:
            bytes_ += self.draft_spec.params * self.draft_spec.bytes_per_param
        link = self.gpu.nvlink_gbps if colocated else self.gpu.network_gbps
        return bytes_ / (link * 1e9 * self.eff.sync_efficiency)


def _engine_cost_model(c: Calibration) -> EngineCostModel:
    """Rebuild the engine's cost model from its calibration summary (ratios are in units of a target step)."""
    target = {b: ms / 1e3 for b, ms in c.target_step_ms.items()}
    verify = {b: {1: t, **{g + 1: c.v[b][g] * t for g in c.v.get(b, {})}} for b, t in target.items()}
    def seconds(ratios: dict[str, dict[int, float]]) -> dict[str, dict[int, float]]:
        return {m: {b: x * target[b] for b, x in by_b.items() if b in target} for m, by_b in ratios.items()}

    return EngineCostModel(target_step=target, verify_step=verify, draft_step=seconds(c.r), overhead=seconds(c.overhead))
