"""A static, preallocated KV cache the engine controls.

Layout per layer: K and V of shape [slots, kv_heads, max_len, head_dim]. Active sequences always occupy the
slot prefix 0..n-1 (the engine compacts on finish by moving the last active slot into the hole), so every
attention call reads a *view* `K[s0:s1, :, :L]`: no gathers, no padding copies, no re-allocation per step.

Per-sequence lengths live in the engine (host ints); "rolling back" rejected speculative positions is just
setting a smaller length: the stale entries beyond it are masked out and overwritten by the next write.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from .model_runner import ForwardPlan


class StaticKVCache:
    def __init__(
        self,
        num_layers: int,
        slots: int,
        kv_heads: int,
        max_len: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        self.num_layers = num_layers
        self.slots = slots
        self.max_len = max_len
        self.kv_heads = kv_heads
        shape = (slots, kv_heads, max_len, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def write(self, layer: int, plan: ForwardPlan, k: torch.Tensor, v: torch.Tensor) -> None:
        """Store k/v [B, kv_heads, T, D] for the plan's slots at positions start[b] .. start[b]+T-1."""
        kc = self.k[layer]
        vc = self.v[layer]
        if plan.single_row_start is not None:
            # One row: a slice copy (the cheapest path; batch-1 decode and per-request prefill).
            p0 = plan.single_row_start
            t = k.shape[2]
            kc[plan.slot0, :, p0 : p0 + t].copy_(k[0])
            vc[plan.slot0, :, p0 : p0 + t].copy_(v[0])
            return
        # index_copy_ on a flat [slots*heads*len, D] view: advanced-index assignment with a slice between the
        # indices is ~1000x slower on CPU (it permutes the whole cache).
        idx = plan.flat_index
        if idx is None:
            assert plan.rows is not None  # a plan without a single row start has rows
            h = self.kv_heads
            heads = torch.arange(h, device=k.device).view(1, h, 1)
            idx = ((plan.rows[:, :1].unsqueeze(1) * h + heads) * self.max_len + plan.positions.unsqueeze(1)).reshape(-1)
            plan.flat_index = idx
        d = k.shape[-1]
        kc.view(-1, d).index_copy_(0, idx, k.reshape(-1, d))
        vc.view(-1, d).index_copy_(0, idx, v.reshape(-1, d))

    def view(self, layer: int, slot0: int, batch: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            self.k[layer][slot0 : slot0 + batch, :, :length],
            self.v[layer][slot0 : slot0 + batch, :, :length],
        )

    def move_slot(self, src: int, dst: int, length: int) -> None:
        """Copy the first `length` positions of slot src into slot dst (compaction after a sequence leaves)."""
        if src == dst or length <= 0:
            return
        for layer in range(self.num_layers):
            self.k[layer][dst, :, :length].copy_(self.k[layer][src, :, :length])
            self.v[layer][dst, :, :length].copy_(self.v[layer][src, :, :length])

    def copy_slots(self, src: list[int], dst: list[int], length: int) -> None:
        """Copy the first `length` positions of slot src[i] into slot dst[i] for every i, one gather and one
        scatter per layer (a shared prefill fanned out to its siblings). The sources are gathered before any
        write, so a slot may be both a source and a destination."""
        if not dst or length <= 0:
            return
        dev = self.k[0].device
        si = torch.tensor(src, dtype=torch.int64, device=dev)
        di = torch.tensor(dst, dtype=torch.int64, device=dev)
        for cache in (*self.k, *self.v):
            head = cache.narrow(2, 0, length)
            head.index_copy_(0, di, head.index_select(0, si))

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
