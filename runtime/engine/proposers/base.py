"""What every proposer implements, and the per-step context the engine hands it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from ..sampling import BatchSamplingTensors, process_logits, sample_from_probs

if TYPE_CHECKING:
    from ..engine import RolloutEngine
    from ..kv_cache import StaticKVCache
    from ..model_runner import TransformerRunner


@dataclass
class DraftContext:
    """The active batch (slots 0..B-1) at the start of a speculative step."""

    tokens: list[list[int]]  # per row: prompt + generated so far; the last token is not yet in the target cache
    sampling: BatchSamplingTensors
    uniforms: torch.Tensor  # [B, gamma] float64, one per drafted position (from each request's own stream)

    @property
    def batch(self) -> int:
        return len(self.tokens)


@dataclass
class Proposal:
    tokens: torch.Tensor  # [B, gamma] int64 (-1 beyond a row's length)
    probs: torch.Tensor | None  # [B, gamma, V] fp32, the distribution each draft was sampled from; None = one-hot
    lens: torch.Tensor | None = None  # [B] int64 drafts per row; None = gamma for every row
    host_lens: list[int] | None = None  # the same lengths as host ints, when the proposer has them (no transfer)


class DraftCollector:
    """A proposer's drafts, one position at a time, from its logits [B, V] at that position.

    A greedy batch drafts the argmax with a one-hot q (`Proposal.probs` None: no [B, gamma, V] buffer, and the
    rejection sampler's one-hot path); otherwise each draft is sampled from its processed distribution with the
    row's uniform for that position, and the distributions are kept for the rejection sampler."""

    def __init__(self, ctx: DraftContext) -> None:
        self.ctx = ctx
        self.tokens: list[torch.Tensor] = []
        self.dists: list[torch.Tensor] = []

    def add(self, logits: torch.Tensor) -> torch.Tensor:
        """The next draft token per row [B] (int64)."""
        if self.ctx.sampling.all_greedy:
            d = logits.argmax(dim=-1)
        else:
            q = process_logits(logits, self.ctx.sampling)
            d = sample_from_probs(q, self.ctx.uniforms[:, len(self.tokens)])
            self.dists.append(q)
        self.tokens.append(d)
        return d

    def proposal(self) -> Proposal:
        return Proposal(tokens=torch.stack(self.tokens, dim=1),
                        probs=torch.stack(self.dists, dim=1) if self.dists else None)


def draft_over_target_cache(runner: TransformerRunner, cache: StaticKVCache, ctx: DraftContext, gamma: int,
                            num_layers: int | None = None) -> Proposal:
    """gamma drafts from a runner of the target's shape over the target's own KV cache (layer_skip, quantized_self).

    The target cache holds len(tokens) - 1 positions of each row: the drafter feeds the last token at len - 1, then
    each of its drafts after it. It writes K/V at positions the target has not committed, and the verification
    forward writes every one of them again before reading it."""
    n = [len(t) for t in ctx.tokens]
    tok = torch.tensor([[t[-1]] for t in ctx.tokens], dtype=torch.int64, device=runner.device)
    drafts = DraftCollector(ctx)
    for j in range(gamma):
        logits, _ = runner.forward(cache, 0, [x - 1 + j for x in n], tok, num_layers=num_layers)
        tok = drafts.add(logits[:, 0]).unsqueeze(1)
    return drafts.proposal()


class Proposer:
    """Base class. Slot-indexed state must follow the engine's slots (reset on join, move on compaction)."""

    name: str = "base"
    needs_hidden: bool = False  # True: the engine passes target hidden states via observe_target

    def attach(self, engine: RolloutEngine) -> None:
        """Allocate per-slot state for the engine's slots / max length (called once by the engine)."""

    def reset_slot(self, slot: int) -> None:
        """A new sequence now lives in `slot`."""

    def move_slot(self, src: int, dst: int) -> None:
        """The sequence in `src` moved to `dst` (compaction)."""

    def prefill(self, slot0: int, prompts: torch.Tensor, lens: list[int]) -> None:
        """Right after the target's prefill: `prompts` [B, T] (row b right-padded after lens[b] tokens) were just
        admitted into slots slot0..slot0+B-1; a drafter with its own cache can prefill them here."""

    def copy_prefix(self, src: list[int], dst: list[int], lens: list[int]) -> None:
        """Slot dst[i] now holds a sequence whose first lens[i] tokens (its prompt) are those of slot src[i]
        (shared prefill; src[i] may already have generated more): copy the per-slot state of those positions, as
        prefilling dst[i] would have built it. Read every source before writing (a slot can be both). State
        rebuilt from the tokens (the n-gram index) needs nothing."""

    def truncate(self, target_lens: list[int]) -> None:
        """After a step: row b's tokens are final up to target_lens[b] positions (the rest may be rolled back)."""

    def observe_target(self, hidden: torch.Tensor, starts: list[int], counts: list[int], slot0: int = 0) -> None:
        """Target normed hidden states [B, T, H] of slots slot0.. at positions starts[b]..starts[b]+counts[b]-1
        (only called when needs_hidden; counts[b] <= T: only the final positions of the sequence)."""

    def propose(self, ctx: DraftContext, gamma: int) -> Proposal:
        raise NotImplementedError

    def refresh_if_stale(self) -> None:
        """Called at the start of every generate(): rebuild derived weights if the drafter's own changed."""

    def refresh(self, policy: torch.nn.Module | None = None) -> None:
        """Follow a policy update (re-quantize, re-read shared weights, ...)."""
