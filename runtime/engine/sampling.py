"""Sampling parameters and the one logits -> probabilities transform shared by AR sampling and the verifier.

Speculative decoding is lossless only if the verifier's target distribution p is *exactly* the distribution
plain decoding samples from, so both paths call `process_logits` and `sample_from_probs` below.

Order of processing (as vLLM): temperature, then top-k, then top-p, then softmax; all in fp32.
Conventions: `temperature == 0` means greedy (a one-hot distribution on the argmax; ties go to the lowest
token id), `top_k == 0` disables top-k (any other k must be >= 1), `top_p == 1` disables top-p.
Tokens tied with the k-th largest logit are all kept, so the result never depends on sort stability.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

import torch

LogprobsMode = Literal["processed", "raw"]


@dataclass(frozen=True)
class SamplingParams:
    """Per-request sampling settings (vLLM names). Invalid values raise ValueError naming the parameter.

    `logprobs_mode`: "processed" (default) returns log p(token) under the distribution the token was actually
    sampled from (after temperature/top-k/top-p — the behaviour policy, what importance ratios in RL need; for
    greedy requests this is log 1 = 0); "raw" returns log_softmax of the unprocessed target logits.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_new_tokens: int = 64
    stop_token_ids: tuple[int, ...] = field(default_factory=tuple)
    seed: int | None = None
    logprobs_mode: LogprobsMode = "processed"

    def __post_init__(self) -> None:
        # Accept lists for stop_token_ids (frozen dataclass: go through object.__setattr__).
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in (self.stop_token_ids or ())))
        t = self.temperature
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not (t >= 0.0) or t == float("inf"):
            raise ValueError(f"temperature: must be a finite number >= 0 (0 = greedy), got {t!r}")
        p = self.top_p
        if not isinstance(p, (int, float)) or isinstance(p, bool) or not (0.0 < p <= 1.0):
            raise ValueError(f"top_p: must be in (0, 1], got {p!r}")
        k = self.top_k
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ValueError(f"top_k: must be an integer >= 1, or 0 to disable top-k, got {k!r}")
        m = self.max_new_tokens
        if not isinstance(m, int) or isinstance(m, bool) or m < 1:
            raise ValueError(f"max_new_tokens: must be an integer >= 1, got {m!r}")
        if any(s < 0 for s in self.stop_token_ids):
            raise ValueError(f"stop_token_ids: token ids must be >= 0, got {list(self.stop_token_ids)!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)):
            raise ValueError(f"seed: must be an integer or None, got {self.seed!r}")
        if self.logprobs_mode not in ("processed", "raw"):
            raise ValueError(f"logprobs_mode: must be 'processed' or 'raw', got {self.logprobs_mode!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


@dataclass
class BatchSamplingTensors:
    """Per-row sampling settings as tensors, built once per batch composition (not per step)."""

    temperature: torch.Tensor  # [B] fp32, greedy rows hold 1.0 (their probs are replaced by one-hot)
    greedy: torch.Tensor  # [B] bool
    top_k: torch.Tensor  # [B] int64, 0 = off
    top_p: torch.Tensor  # [B] fp32
    any_greedy: bool
    all_greedy: bool
    any_top_k: bool
    any_top_p: bool
    all_temp_one: bool
    # expand(n) results, built once per batch composition instead of once per speculative step
    _expanded: dict[int, BatchSamplingTensors] = field(default_factory=dict, repr=False, compare=False)

    @staticmethod
    def build(params: list[SamplingParams], device: torch.device) -> BatchSamplingTensors:
        greedy = [p.greedy for p in params]
        temps = [1.0 if g else float(p.temperature) for p, g in zip(params, greedy)]
        return BatchSamplingTensors(
            temperature=torch.tensor(temps, dtype=torch.float32, device=device),
            greedy=torch.tensor(greedy, dtype=torch.bool, device=device),
            top_k=torch.tensor([p.top_k for p in params], dtype=torch.int64, device=device),
            top_p=torch.tensor([p.top_p for p in params], dtype=torch.float32, device=device),
            any_greedy=any(greedy),
            all_greedy=all(greedy),
            any_top_k=any(p.top_k > 0 and not g for p, g in zip(params, greedy)),
            any_top_p=any(p.top_p < 1.0 and not g for p, g in zip(params, greedy)),
            all_temp_one=all(t == 1.0 for t in temps),
        )

    def expand(self, n: int) -> BatchSamplingTensors:
        """Each row repeated n times (row-major), for [B, n, V] logits flattened to [B*n, V]."""
        if n == 1:
            return self
        hit = self._expanded.get(n)
        if hit is not None:
            return hit
        out = self._expanded[n] = BatchSamplingTensors(
            temperature=self.temperature.repeat_interleave(n),
            greedy=self.greedy.repeat_interleave(n),
            top_k=self.top_k.repeat_interleave(n),
            top_p=self.top_p.repeat_interleave(n),
            any_greedy=self.any_greedy,
            all_greedy=self.all_greedy,
            any_top_k=self.any_top_k,
            any_top_p=self.any_top_p,
            all_temp_one=self.all_temp_one,
        )
        return out


def process_logits(logits: torch.Tensor, st: BatchSamplingTensors) -> torch.Tensor:
    """Raw logits [N, V] -> processed probabilities [N, V] (fp32). Rows of `st` match rows of `logits`."""
    logits = logits.float()
    if st.all_greedy:
        return _one_hot_argmax(logits)
    if not st.all_temp_one:
        logits = logits / st.temperature.unsqueeze(1)
    if st.any_top_k or st.any_top_p:
        logits = _apply_top_k_top_p(logits, st)
    probs = torch.softmax(logits, dim=-1)
    if st.any_greedy:
        probs = torch.where(st.greedy.unsqueeze(1), _one_hot_argmax(logits), probs)
    return probs


def _one_hot_argmax(logits: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(logits)
    out.scatter_(1, logits.argmax(dim=-1, keepdim=True), 1.0)
    return out


def _apply_top_k_top_p(logits: torch.Tensor, st: BatchSamplingTensors) -> torch.Tensor:
    vocab = logits.shape[-1]
    sorted_logits, _ = torch.sort(logits, dim=-1, descending=True)
    keep_threshold = torch.full_like(logits[:, :1], float("-inf"))
    if st.any_top_k:
        k = st.top_k.clamp(max=vocab)
        kth = sorted_logits.gather(1, (k - 1).clamp(min=0).unsqueeze(1))
        keep_threshold = torch.where((k > 0).unsqueeze(1), kth, keep_threshold)
    if st.any_top_p:
        # Mass is computed after top-k (tokens below the top-k threshold contribute nothing).
        masked_sorted = sorted_logits.masked_fill(sorted_logits < keep_threshold, float("-inf"))
        sorted_probs = torch.softmax(masked_sorted, dim=-1)
        mass_before = torch.cumsum(sorted_probs, dim=-1) - sorted_probs
        # Keep the smallest prefix whose mass reaches top_p: rank i is kept iff the mass before it < top_p.
        kept = mass_before < st.top_p.unsqueeze(1)
        kept[:, 0] = True
        last_kept = kept.sum(dim=-1, keepdim=True) - 1
        pth = masked_sorted.gather(1, last_kept)
        pth = torch.where((st.top_p < 1.0).unsqueeze(1), pth, torch.full_like(pth, float("-inf")))
        keep_threshold = torch.maximum(keep_threshold, pth)
    return logits.masked_fill(logits < keep_threshold, float("-inf"))


def sample_from_probs(probs: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Inverse-CDF sampling: probs [N, V] fp32, uniforms [N] float64 in [0, 1) -> token ids [N] int64.

    One float64 uniform per token keeps every request's random stream independent of batch composition.
    Zero-probability tokens are never returned (their CDF interval is empty). The rows need not be normalised
    (the uniform is scaled by each row's total mass), so a residual is sampled without dividing it first.
    """
    cdf = torch.cumsum(probs, dim=-1, dtype=torch.float64)
    x = (uniforms * cdf[:, -1]).unsqueeze(1)
    idx = torch.searchsorted(cdf, x, right=True).squeeze(1)
    return idx.clamp_(max=probs.shape[-1] - 1)
