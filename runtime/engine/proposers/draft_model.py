"""Draft-model proposer: a small causal LM (Llama/Qwen2, same tokenizer/vocab) with its own static KV cache.

Drafts are *sampled* from the draft's processed distribution q (same temperature/top-k/top-p as the request)
and q is returned, so the verifier can accept with min(1, p/q). The draft cache lags the sequence after
all-accepted steps and AR steps; `propose` first catches up on every token the draft has not seen (one forward,
every row as wide as the widest: a row with fewer unseen tokens re-feeds some its cache holds; right-padded only
where that cannot be, a catch-up from the prompt), then drafts gamma tokens one forward at a time. A drafter the
controller does not expect to run is not prefilled on admission (`Controller.warm_proposers`): that catch-up then
starts at the prompt.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from ..hf_layout import config_of
from ..model_runner import TransformerRunner
from .base import DraftCollector, DraftContext, Proposal, Proposer

if TYPE_CHECKING:
    from ..engine import RolloutEngine


class DraftModelProposer(Proposer):
    name = "draft_model"

    def __init__(self, draft_model: nn.Module, quantize: int = 0) -> None:
        self.draft_model = draft_model
        self.quantize = quantize
        self.runner: TransformerRunner | None = None
        self.lens: list[int] = []

    def attach(self, engine: RolloutEngine) -> None:
        self.runner = self.build_runner(engine)
        self.own_cache(engine)

    def build_runner(self, engine: RolloutEngine) -> TransformerRunner:
        vocab_size = config_of(self.draft_model).vocab_size
        if vocab_size != engine.vocab_size:
            raise ValueError(f"{self.name}: vocab_size {vocab_size} differs from the target's {engine.vocab_size}")
        runner = TransformerRunner(self.draft_model, quantize=self.quantize, max_positions=engine.cache_len,
                                   dtype=engine.runner.dtype)
        if runner.device != engine.device:
            raise ValueError(f"{self.name}: on {runner.device}, the target is on {engine.device}")
        return runner

    def own_cache(self, engine: RolloutEngine) -> None:
        assert self.runner is not None
        self.cache = self.runner.new_cache(engine.max_batch_size, engine.cache_len)
        self.lens = [0] * engine.max_batch_size

    def reset_slot(self, slot: int) -> None:
        self.lens[slot] = 0

    def move_slot(self, src: int, dst: int) -> None:
        self.cache.move_slot(src, dst, self.lens[src])
        self.lens[dst] = self.lens[src]

    def prefill(self, slot0: int, prompts: torch.Tensor, lens: list[int]) -> None:
        # Eagerly, with the target's: a prefill shared by identical prompts is then shared by the drafter too (the
        # lazy catch-up in `propose` would prefill every sibling again).
        assert self.runner is not None, "attach() first"
        last = torch.tensor([n - 1 for n in lens], dtype=torch.int64, device=self.runner.device)
        self.runner.forward(self.cache, slot0, [0] * len(lens), prompts, last_index=last, lens=lens)
        for b, n in enumerate(lens):
            self.lens[slot0 + b] = n

    def copy_prefix(self, src: list[int], dst: list[int], lens: list[int]) -> None:
        # A source prefilled on admission holds at least its prompt (`truncate` never cuts below it); one that was
        # not (a cold drafter) holds what it has caught up on so far, maybe nothing: the rest is caught up later.
        held = [min(self.lens[s], n) for s, n in zip(src, lens)]
        if max(held, default=0) > 0:
            self.cache.copy_slots(src, dst, max(held))
        for d, n in zip(dst, held):
            self.lens[d] = n

    def truncate(self, target_lens: list[int]) -> None:
        for b, n in enumerate(target_lens):
            self.lens[b] = min(self.lens[b], n)

    def refresh(self, policy: nn.Module | None = None) -> None:
        if self.runner is not None:
            self.runner.refresh()

    def refresh_if_stale(self) -> None:
        if self.runner is not None:
            self.runner.refresh_if_stale()  # draft weights pushed in place with the policy

    def propose(self, ctx: DraftContext, gamma: int) -> Proposal:
        assert self.runner is not None, "attach() first"
        runner = self.runner
        b = ctx.batch
        dev = runner.device
        # Catch up on unseen tokens: row b feeds at least tokens[lens[b]:], which always includes the last one.
        starts = [self.lens[i] for i in range(b)]
        width = max(len(ctx.tokens[i]) - starts[i] for i in range(b))
        if width <= runner.FEW_TOKENS and all(len(ctx.tokens[i]) >= width for i in range(b)):
            # Every row feeds `width` tokens, a row with fewer unseen ones from earlier: it recomputes positions its
            # cache already holds (the same tokens). A ragged forward takes the unfused per-op path: for the
            # benchmark's draft model at batch 8 the catch-up after rows accepted different counts took 541 us a
            # call that way and 229 us fused, and a round's drafting at γ=4 fell from 1.16 to 0.85 ms.
            starts = [len(ctx.tokens[i]) - width for i in range(b)]
        chunks = [ctx.tokens[i][starts[i]:] for i in range(b)]
        lens = None
        if width == 1:
            inp = torch.tensor(chunks, dtype=torch.int64, device=dev)
            last = None
        elif all(len(c) == width for c in chunks):  # no padding: the runner's fused decode path takes it
            inp = torch.tensor(chunks, dtype=torch.int64, device=dev)
            last = torch.full((b,), width - 1, dtype=torch.int64, device=dev)
        else:
            lens = [len(c) for c in chunks]
            inp = torch.tensor([c + [0] * (width - len(c)) for c in chunks], dtype=torch.int64, device=dev)
            last = torch.tensor([n - 1 for n in lens], dtype=torch.int64, device=dev)
        logits, _ = runner.forward(self.cache, 0, starts, inp, last_index=last, lens=lens)
        if last is None:
            logits = logits[:, 0]
        n = [len(t) for t in ctx.tokens]
        drafts = DraftCollector(ctx)
        for j in range(gamma):
            d = drafts.add(logits)
            if j + 1 < gamma:
                # d_{j+1} sits at position n-1+j+1 = n+j.
                logits, _ = runner.forward(self.cache, 0, [x + j for x in n], d.unsqueeze(1))
                logits = logits[:, 0]
        for i in range(b):
            self.lens[i] = n[i] + gamma - 1
        return drafts.proposal()
