"""Exact speculative sampling (Leviathan et al. 2023; Chen et al. 2023) for a batch with ragged draft lengths.

For row b with draft tokens d_1..d_n (n = draft_lens[b] <= gamma), target distributions p_1..p_{gamma+1}
(p_i is the processed target distribution for the position of d_i given everything before it) and draft
distributions q_1..q_n (what d_i was sampled from; one-hot for deterministic proposers):

* accept d_i while u_i * q_i(d_i) < p_i(d_i), i.e. with probability min(1, p_i(d_i) / q_i(d_i)); u_i ~ U[0,1)
  in float64;
* at the first rejection i, emit one token from the residual norm(max(0, p_i - q_i));
* if all n drafts are accepted, emit a bonus token from p_{n+1}.

Every emitted token is then distributed exactly as the target would sample it. When p is one-hot (greedy) the
accepted prefix is exactly the greedy continuation and the final token is the greedy token.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sampling import sample_from_probs


@dataclass
class RejectionResult:
    tokens: torch.Tensor  # [B, gamma + 1] int64: accepted drafts, then the final token, then -1 padding
    num_accepted: torch.Tensor  # [B] int64, number of accepted drafts (tokens emitted = num_accepted + 1)
    final_probs: torch.Tensor  # [B, V] fp32, the distribution the final token was drawn from


def rejection_sample(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    accept_uniforms: torch.Tensor,
    final_uniforms: torch.Tensor,
    draft_lens: torch.Tensor | None = None,
) -> RejectionResult:
    """target_probs [B, G+1, V] fp32; draft_tokens [B, G] int64; draft_probs [B, G, V] fp32 or None (one-hot q);
    accept_uniforms [B, G] float64; final_uniforms [B] float64; draft_lens [B] (default: all G)."""
    b, g1, _ = target_probs.shape
    g = g1 - 1
    if draft_tokens.shape != (b, g):
        raise ValueError(f"draft_tokens: expected shape {(b, g)}, got {tuple(draft_tokens.shape)}")
    dev = target_probs.device
    rows = torch.arange(b, device=dev)
    safe_tokens = draft_tokens.clamp(min=0)
    p_at = target_probs[:, :g].gather(2, safe_tokens.unsqueeze(2)).squeeze(2).double()
    if draft_probs is None:
        q_at = torch.ones_like(p_at)
    else:
        q_at = draft_probs.gather(2, safe_tokens.unsqueeze(2)).squeeze(2).double()
    accepted = accept_uniforms * q_at < p_at
    if draft_lens is not None:
        accepted &= torch.arange(g, device=dev).unsqueeze(0) < draft_lens.unsqueeze(1)
        lens = draft_lens
    else:
        lens = torch.full((b,), g, dtype=torch.int64, device=dev)
    num_accepted = torch.cumprod(accepted.to(torch.int64), dim=1).sum(dim=1)

    p_final = target_probs[rows, num_accepted]  # [B, V]
    rejected = num_accepted < lens
    # The residual is computed for every row (no `.any()`: on an accelerator that is a host sync per step).
    pos = num_accepted.clamp(max=max(g - 1, 0))
    if draft_probs is None:
        q_final = torch.zeros_like(p_final)
        if g > 0:
            q_final[rows, safe_tokens[rows, pos]] = 1.0
    else:
        q_final = draft_probs[rows, pos]
    residual = (p_final - q_final).clamp_(min=0.0)
    mass = residual.sum(dim=1, keepdim=True)
    # mass > 0 whenever a rejection can happen (p(d) < q(d) implies p != q); the guard only protects against
    # fp32 underflow, falling back to p itself.
    residual = torch.where(mass > 0, residual / mass.clamp(min=1e-30), p_final)
    final_probs = torch.where(rejected.unsqueeze(1), residual, p_final)
    final_tokens = sample_from_probs(final_probs, final_uniforms)

    out = torch.full((b, g1), -1, dtype=torch.int64, device=dev)
    ar = torch.arange(g1, device=dev).unsqueeze(0)
    if g > 0:
        out[:, :g] = torch.where(ar[:, :g] < num_accepted.unsqueeze(1), draft_tokens, out[:, :g])
    out[rows, num_accepted] = final_tokens
    return RejectionResult(tokens=out, num_accepted=num_accepted, final_probs=final_probs)
