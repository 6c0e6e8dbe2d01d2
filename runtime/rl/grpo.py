"""GRPO loss: group-normalised advantages, clipped importance ratio, optional KL (k3), token-level mean.

Pure tensor functions, no model and no I/O, so the maths is testable by hand.

Three policies appear in an (a)synchronous RL step:
- behaviour: the weights the rollout worker sampled with (its logprobs come back with every token);
- proximal: the trainer's weights at the start of this update (equal to behaviour in sync mode);
- current: the weights being optimised.
The PPO ratio is current/proximal and is clipped; the stale-policy correction is a detached, truncated
importance weight proximal/behaviour (decoupled PPO, as AReaL does), so async rollouts that are a few
versions old are re-weighted instead of trusted blindly. In sync mode proximal == behaviour and the weight is 1.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


def group_advantages(rewards: torch.Tensor, group_size: int, *, normalize_std: bool = True,
                     eps: float = 1e-6) -> torch.Tensor:
    """(r - mean of its group) / (std of its group + eps); groups are consecutive runs of `group_size`.

    A group whose rewards are all equal carries no signal and gets advantage 0 (not NaN).
    """
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.dim() != 1 or rewards.numel() % group_size:
        raise ValueError(f"rewards must be 1-D with a multiple of group_size={group_size} entries, "
                         f"got shape {tuple(rewards.shape)}")
    grouped = rewards.double().view(-1, group_size)
    centred = grouped - grouped.mean(dim=1, keepdim=True)
    if normalize_std and group_size > 1:
        # Population std (unbiased=False) matches the GRPO paper's normalisation on small groups.
        centred = centred / (grouped.std(dim=1, unbiased=False, keepdim=True) + eps)
    return centred.view(-1).to(rewards.dtype if rewards.is_floating_point() else torch.float32)


def k3_kl(logprobs: torch.Tensor, ref_logprobs: torch.Tensor) -> torch.Tensor:
    """Per-token unbiased, non-negative KL(current || reference) estimator: exp(d) - d - 1, d = ref - cur."""
    d = ref_logprobs - logprobs
    return torch.exp(d) - d - 1.0


@dataclass(frozen=True)
class GRPOLossConfig:
    clip_eps: float = 0.2
    clip_eps_high: float | None = None  # asymmetric upper clip (DAPO's clip-higher); None = clip_eps
    kl_coef: float = 0.0
    behaviour_weight_cap: float = 2.0  # truncation of proximal/behaviour in async mode


@dataclass
class GRPOLossOutput:
    loss: torch.Tensor
    clip_fraction: float
    kl: float
    mean_ratio: float
    mean_behaviour_weight: float
    tokens: int


def grpo_loss(
    logprobs: torch.Tensor,
    behaviour_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    config: GRPOLossConfig = GRPOLossConfig(),
    *,
    proximal_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    total_tokens: int | None = None,
) -> GRPOLossOutput:
    """Token-level GRPO loss.

    Shapes: logprobs/behaviour/proximal/ref/mask [B, T] (mask 1 on response tokens), advantages [B].
    `total_tokens` is the token count the sum is divided by; pass the count across all data-parallel ranks
    so that summing the ranks' gradients gives exactly the single-process gradient.
    """
    if logprobs.shape != behaviour_logprobs.shape or logprobs.shape != mask.shape:
        raise ValueError(f"logprobs {tuple(logprobs.shape)}, behaviour_logprobs {tuple(behaviour_logprobs.shape)} "
                         f"and mask {tuple(mask.shape)} must have the same shape")
    if advantages.shape != logprobs.shape[:1]:
        raise ValueError(f"advantages must have shape [{logprobs.shape[0]}], got {tuple(advantages.shape)}")
    mask = mask.to(logprobs.dtype)
    proximal = behaviour_logprobs if proximal_logprobs is None else proximal_logprobs
    ratio = torch.exp(logprobs - proximal.detach())
    high = config.clip_eps if config.clip_eps_high is None else config.clip_eps_high
    adv = advantages.to(logprobs.dtype).unsqueeze(1)
    unclipped = ratio * adv
    clipped = torch.clamp(ratio, 1.0 - config.clip_eps, 1.0 + high) * adv
    per_token = -torch.minimum(unclipped, clipped)
    if proximal_logprobs is not None:
        behaviour_weight = torch.exp(proximal.detach() - behaviour_logprobs.detach()).clamp(
            max=config.behaviour_weight_cap)
        per_token = per_token * behaviour_weight
    else:
        behaviour_weight = torch.ones_like(ratio)
    kl_value = torch.zeros((), dtype=logprobs.dtype)
    if ref_logprobs is not None and config.kl_coef:
        kl = k3_kl(logprobs, ref_logprobs.detach())
        per_token = per_token + config.kl_coef * kl
        kl_value = (kl * mask).sum() / mask.sum().clamp(min=1)
    n_local = int(mask.sum().item())
    denom = float(total_tokens if total_tokens is not None else max(n_local, 1))
    loss = (per_token * mask).sum() / denom
    with torch.no_grad():
        was_clipped = (unclipped != clipped).to(mask.dtype) * mask
        n = mask.sum().clamp(min=1)
        return GRPOLossOutput(
            loss=loss,
            clip_fraction=float(was_clipped.sum() / n),
            kl=float(kl_value),
            mean_ratio=float((ratio * mask).sum() / n),
            mean_behaviour_weight=float((behaviour_weight * mask).sum() / n),
            tokens=n_local,
        )


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float = 1.0, top_k: int = 0,
                   top_p: float = 1.0) -> torch.Tensor:
    """log p(tokens[t]) under the distribution the rollout engine samples from and reports logprobs for.

    The engine's `process_logits` (temperature, then top-k, then top-p, softmax, fp32) is applied here too, so
    on-policy importance ratios are exactly 1 with top-k/top-p on (the mask is a function of the logits, the
    gradient flows through the kept logits). Shapes: logits [..., V], tokens [...].
    """
    from ..engine.sampling import BatchSamplingTensors, SamplingParams, process_logits

    if temperature <= 0:
        raise ValueError(f"temperature: must be > 0 for RL log-probabilities, got {temperature!r}")
    shape = tokens.shape
    flat = logits.reshape(-1, logits.shape[-1])
    st = BatchSamplingTensors.build([SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)],
                                    flat.device).expand(flat.shape[0])
    if not (st.any_top_k or st.any_top_p):  # log_softmax: the same numbers as log(softmax), more stable grads
        scaled = flat.float() / temperature if temperature != 1.0 else flat.float()
        return torch.log_softmax(scaled, dim=-1).gather(-1, tokens.reshape(-1, 1)).view(shape)
    picked = process_logits(flat, st).gather(-1, tokens.reshape(-1, 1))
    # Padding positions may hold a token top-k/top-p removed (p = 0): the clamp keeps log and its gradient finite
    # there; a sampled token always has p > 0 and never reaches the clamp.
    return picked.clamp_min(torch.finfo(torch.float32).tiny).log().view(shape)
