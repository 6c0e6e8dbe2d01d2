"""n-gram (prompt lookup) proposer: model-free, deterministic, one-hot q.

For each row, find the most recent earlier occurrence of the sequence's last n tokens (n from ngram_max down to
ngram_min) and propose the tokens that followed it. Rows without a match propose nothing (length 0): the
step then degenerates to one AR token for that row, still verified exactly.
"""

from __future__ import annotations

import numpy as np
import torch
from specrl.runtime.engine.proposers.base import DraftContext, Proposal, Proposer


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
    name = "ngram"

    def __init__(self, n_min: int = 1, n_max: int = 4) -> None:
        self.n_min = n_min
        self.n_max = n_max

    def attach(self, engine) -> None:
        self.device = engine.device

    def propose(self, ctx: DraftContext, gamma: int) -> Proposal:
        rows = [ngram_lookup(t, self.n_min, self.n_max, gamma) for t in ctx.tokens]
        tokens = torch.tensor([r + [-1] * (gamma - len(r)) for r in rows], dtype=torch.int64, device=self.device)
        lens = torch.tensor([len(r) for r in rows], dtype=torch.int64, device=self.device)
        return Proposal(tokens=tokens, probs=None, lens=lens)
