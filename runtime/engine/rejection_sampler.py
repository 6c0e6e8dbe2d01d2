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
import torch.nn.functional as F

from .sampling import sample_from_probs


@dataclass
class RejectionResult:
    tokens: torch.Tensor  # [B, gamma + 1] int64: accepted drafts, then the final token, then -1 padding
    num_accepted: torch.Tensor  # [B] int64, number of accepted drafts (tokens emitted = num_accepted + 1)
    # [B, V] fp32: the final token's distribution, a residual row unnormalised (sampling scales by the mass)
    final_weights: torch.Tensor
    residual_rows: torch.Tensor | None = None  # [B] bool: rows whose final token came from the residual

    @property
    def final_probs(self) -> torch.Tensor:
        """[B, V] fp32, the distribution the final token was drawn from (normalised on demand, off the hot path)."""
        if self.residual_rows is None:
            return self.final_weights
        norm = self.final_weights / self.final_weights.sum(dim=1, keepdim=True)
        return torch.where(self.residual_rows.unsqueeze(1), norm, self.final_weights)


def rejection_sample(
    target_probs: torch.Tensor,
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor | None,
    accept_uniforms: torch.Tensor,
    final_uniforms: torch.Tensor,
    draft_lens: torch.Tensor | None = None,
) -> RejectionResult:
    """target_probs [B, G+1, V] fp32; draft_tokens [B, G] int64; draft_probs [B, G, V] fp32 or None (one-hot q);
    accept_uniforms [B, G] float64; final_uniforms [B] float64; draft_lens [B] (default: all G).

    No host synchronisation (no `.any()`/`.item()`): every row takes the same tensor path, and only one [B, V]
    row per sequence (the final position's) is touched beyond the [B, G] acceptance test."""
    b, g1, v = target_probs.shape
    g = g1 - 1
    if draft_tokens.shape != (b, g):
        raise ValueError(f"draft_tokens: expected shape {(b, g)}, got {tuple(draft_tokens.shape)}")
    dev = target_probs.device
    safe_tokens = draft_tokens.clamp(min=0).unsqueeze(2)
    # float32 probabilities meet the float64 uniforms by type promotion (exact: no explicit casts to pay for)
    p_at = target_probs[:, :g].gather(2, safe_tokens).squeeze(2)
    if draft_probs is None:
        accepted = accept_uniforms < p_at  # u * q(d) < p(d) with q(d) = 1
    else:
        accepted = accept_uniforms * draft_probs.gather(2, safe_tokens).squeeze(2) < p_at
    steps = torch.arange(g1, device=dev).unsqueeze(0)
    if draft_lens is not None:
        accepted &= steps[:, :g] < draft_lens.unsqueeze(1)
    num_accepted = torch.cumprod(accepted.to(torch.int64), dim=1).sum(dim=1)

    # Row b's final position is num_accepted[b]: one row of the flattened [B*(G+1), V] probabilities.
    rows = torch.arange(b, device=dev)
    p_final = target_probs.reshape(b * g1, v).index_select(0, rows * g1 + num_accepted)
    use_residual = None
    if g == 0:
        weights = p_final
    else:
        pos = num_accepted.clamp(max=g - 1)
        if draft_probs is None:
            # q is one-hot on the draft d: max(0, p - q) is p with p(d) zeroed (p(d) < 1 when d was rejected).
            residual = p_final.scatter(1, safe_tokens.squeeze(2).gather(1, pos.unsqueeze(1)), 0.0)
        else:
            q_final = draft_probs.reshape(b * g, v).index_select(0, rows * g + pos)
            residual = (p_final - q_final).clamp_(min=0.0)
        rejected = num_accepted < (draft_lens if draft_lens is not None else g)
        # mass > 0 whenever a rejection can happen (p(d) < q(d) implies p != q); the guard only protects against
        # fp32 underflow, falling back to p itself.
        use_residual = rejected & (residual.sum(dim=1) > 0)
        weights = torch.where(use_residual.unsqueeze(1), residual, p_final)
    final_tokens = sample_from_probs(weights, final_uniforms)

    out = torch.where(steps < num_accepted.unsqueeze(1), F.pad(draft_tokens, (0, 1), value=-1), -1)
    out.scatter_(1, num_accepted.unsqueeze(1), final_tokens.unsqueeze(1))
    return RejectionResult(tokens=out, num_accepted=num_accepted, final_weights=weights, residual_rows=use_residual)


def greedy_verify(target_logits: torch.Tensor, draft_tokens: torch.Tensor,
                  draft_lens: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`rejection_sample`'s (tokens, num_accepted) for rows whose target is greedy, without building p.

    With one-hot p on the argmax, d_i is accepted iff it is the argmax (u * q(d) < p(d) holds for u < 1, q <= 1
    exactly when p(d) = 1), and the final token, residual or bonus, is the argmax at the first position not
    accepted: the emitted tokens are the target's argmax up to and including that position, whatever the
    drafter and the uniforms. target_logits [B, G+1, V]; ties go to the lowest id, as in `process_logits`."""
    g = target_logits.shape[1] - 1
    best = target_logits.argmax(dim=-1)  # [B, G+1]
    accepted = draft_tokens == best[:, :g]
    steps = torch.arange(g + 1, device=target_logits.device).unsqueeze(0)
    if draft_lens is not None:
        accepted &= steps[:, :g] < draft_lens.unsqueeze(1)
    num_accepted = torch.cumprod(accepted.to(torch.int64), dim=1).sum(dim=1)
    return torch.where(steps <= num_accepted.unsqueeze(1), best, -1), num_accepted
