"""n-gram (prompt lookup) proposer: model-free, deterministic, one-hot q.

For each row, find the most recent earlier occurrence of the sequence's last n tokens (n from ngram_max down to
ngram_min) and propose the tokens that followed it. Rows without a match propose nothing (length 0): the
step then degenerates to one AR token for that row, still verified exactly.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch

from .base import DraftContext, Proposal, Proposer

if TYPE_CHECKING:
    from ..engine import RolloutEngine


def ngram_lookup(tokens: list[int], n_min: int, n_max: int, gamma: int) -> list[int]:
    """Continuation (<= gamma tokens) of the latest earlier match of the longest suffix n-gram, or []."""
    length = len(tokens)
    if length < 2:
        return []
    arr = np.asarray(tokens, dtype=np.int64)
    # Candidate starts where the last token recurs (vectorised; a Python scan costs ms per row at L ~ 1000).
    ends = np.flatnonzero(arr[:-1] == arr[-1])  # i such that tokens[i] == last token, i < length - 1
    for n in range(min(n_max, length - 1), n_min - 1, -1):
        starts = ends - (n - 1)
        starts = starts[starts >= 0]
        for i in starts[::-1]:
            i = int(i)
            if tokens[i : i + n] == tokens[length - n :]:
                cont = tokens[i + n : i + n + gamma]
                if cont:
                    return cont
    return []


class NgramProposer(Proposer):
    """Keeps, per slot, the latest end position of every n-gram seen so far (updated with the new tokens only),
    so a lookup costs O(n_max) per row instead of a scan of the whole sequence. Same result as `ngram_lookup`."""

    name = "ngram"

    def __init__(self, n_min: int = 1, n_max: int = 4) -> None:
        self.n_min = n_min
        self.n_max = n_max

    def attach(self, engine: RolloutEngine) -> None:
        self.device = engine.device
        self.index: list[dict[tuple[int, ...], int]] = [{} for _ in range(engine.max_batch_size)]
        self.indexed = [0] * engine.max_batch_size  # n-grams ending at positions < indexed[slot] are in the index

    # Both run for every admitted and every retired sequence, drafted or not: a slot never drafted for (an adaptive
    # policy that decodes plainly) has an empty index (`_lookup` leaves `indexed` > 0 wherever it indexed), so nothing
    # to do.
    def reset_slot(self, slot: int) -> None:
        if self.indexed[slot]:
            self.index[slot] = {}
            self.indexed[slot] = 0

    def move_slot(self, src: int, dst: int) -> None:
        if self.indexed[src] or self.indexed[dst]:
            self.index[dst], self.indexed[dst] = self.index[src], self.indexed[src]
            self.index[src], self.indexed[src] = {}, 0

    def _lookup(self, slot: int, tokens: list[int], gamma: int) -> list[int]:
        index = self.index[slot]
        last = len(tokens) - 1
        for end in range(self.indexed[slot], last):  # every position but the last: a match must precede it
            for n in range(self.n_min, min(self.n_max, end + 1) + 1):
                index[tuple(tokens[end - n + 1 : end + 1])] = end
        self.indexed[slot] = max(self.indexed[slot], last)
        for n in range(min(self.n_max, last), self.n_min - 1, -1):
            hit = index.get(tuple(tokens[last - n + 1 :]))
            if hit is not None:
                return tokens[hit + 1 : hit + 1 + gamma]
        return []

    def propose(self, ctx: DraftContext, gamma: int) -> Proposal:
        rows = [self._lookup(i, t, gamma) for i, t in enumerate(ctx.tokens)]
        tokens = torch.tensor([r + [-1] * (gamma - len(r)) for r in rows], dtype=torch.int64, device=self.device)
        host_lens = [len(r) for r in rows]
        lens = torch.tensor(host_lens, dtype=torch.int64, device=self.device)
        return Proposal(tokens=tokens, probs=None, lens=lens, host_lens=host_lens)
