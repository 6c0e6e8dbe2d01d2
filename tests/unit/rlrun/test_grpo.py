"""GRPO loss maths, including a case computed by hand."""

import math

import pytest
import torch
from specrl.runtime.rl.grpo import GRPOLossConfig, group_advantages, grpo_loss, k3_kl, token_logprobs


def test_group_advantages_by_hand():
    r = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0])
    adv = group_advantages(r, 2)
    # groups (1,0) (0,1) (2,2): mean .5/.5/2, population std .5/.5/0
    expected = [1.0, -1.0, -1.0, 1.0, 0.0, 0.0]
    assert adv.tolist() == pytest.approx(expected, abs=1e-5)


def test_group_advantages_without_std_and_errors():
    r = torch.tensor([3.0, 1.0, 2.0, 2.0])
    assert group_advantages(r, 2, normalize_std=False).tolist() == [1.0, -1.0, 0.0, 0.0]
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(r, 3)
    with pytest.raises(ValueError, match="group_size"):
        group_advantages(r, 0)


def test_uniform_group_gives_zero_not_nan():
    adv = group_advantages(torch.ones(4), 4)
    assert torch.equal(adv, torch.zeros(4))


def test_loss_hand_computed_with_clipping():
    # Two sequences, response lengths 2 and 1; eps = 0.2.
    lp = torch.tensor([[math.log(0.6), math.log(0.3)], [math.log(0.2), 0.0]], requires_grad=True)
    old = torch.tensor([[math.log(0.4), math.log(0.3)], [math.log(0.4), 0.0]])
    mask = torch.tensor([[1.0, 1.0], [1.0, 0.0]])
    adv = torch.tensor([1.0, -1.0])
    out = grpo_loss(lp, old, adv, mask, GRPOLossConfig(clip_eps=0.2))
    # token 1: ratio 1.5, A=1 -> min(1.5, 1.2) = 1.2 (clipped)
    # token 2: ratio 1.0, A=1 -> 1.0
    # token 3: ratio 0.5, A=-1 -> min(-0.5, -0.8) = -0.8 (clipped)
    expected = -(1.2 + 1.0 - 0.8) / 3
    assert float(out.loss.detach()) == pytest.approx(expected, rel=1e-6)
    assert out.clip_fraction == pytest.approx(2 / 3)
    assert out.tokens == 3
    out.loss.backward()
    grad = lp.grad
    assert grad is not None
    # clipped tokens carry no gradient; token 2: d/dlp of -(ratio*A)/3 = -ratio/3 = -1/3
    assert grad[0, 0] == 0 and grad[1, 0] == 0
    assert float(grad[0, 1]) == pytest.approx(-1 / 3, rel=1e-6)
    assert grad[1, 1] == 0  # masked


def test_unclipped_gradient_is_policy_gradient():
    lp = torch.log(torch.tensor([[0.5, 0.25]])).requires_grad_(True)
    out = grpo_loss(lp, lp.detach(), torch.tensor([2.0]), torch.ones(1, 2))
    out.loss.backward()
    assert lp.grad is not None
    assert lp.grad[0].tolist() == pytest.approx([-1.0, -1.0])  # -A * ratio / n_tokens, ratio 1


def test_total_tokens_normalisation_makes_shards_add_up():
    torch.manual_seed(0)
    lp = torch.randn(4, 5).requires_grad_(True)
    old = lp.detach() + 0.05 * torch.randn(4, 5)
    mask = (torch.rand(4, 5) > 0.3).float()
    adv = torch.randn(4)
    full = grpo_loss(lp, old, adv, mask)
    total = int(mask.sum())
    a = grpo_loss(lp[:2], old[:2], adv[:2], mask[:2], total_tokens=total)
    b = grpo_loss(lp[2:], old[2:], adv[2:], mask[2:], total_tokens=total)
    assert float((a.loss + b.loss).detach()) == pytest.approx(float(full.loss.detach()), rel=1e-6)


def test_k3_kl_properties():
    lp = torch.log(torch.tensor([0.5, 0.1, 0.9]))
    assert torch.allclose(k3_kl(lp, lp), torch.zeros(3))
    ref = torch.log(torch.tensor([0.4, 0.3, 0.8]))
    kl = k3_kl(lp, ref)
    assert (kl >= 0).all()
    d = ref - lp
    assert torch.allclose(kl, torch.exp(d) - d - 1)


def test_kl_term_added():
    lp = torch.log(torch.tensor([[0.5]]))
    ref = torch.log(torch.tensor([[0.25]]))
    out = grpo_loss(lp, lp, torch.tensor([0.0]), torch.ones(1, 1), GRPOLossConfig(kl_coef=0.1), ref_logprobs=ref)
    d = math.log(0.25) - math.log(0.5)
    assert float(out.loss.detach()) == pytest.approx(0.1 * (math.exp(d) - d - 1), rel=1e-6)


def test_stale_policy_correction_truncated_weight():
    # behaviour (stale rollout) 0.2, proximal (trainer before update) 0.6 -> weight 3, truncated to cap 2.
    lp = torch.log(torch.tensor([[0.6]])).requires_grad_(True)
    behaviour = torch.log(torch.tensor([[0.2]]))
    out = grpo_loss(lp, behaviour, torch.tensor([1.0]), torch.ones(1, 1),
                    GRPOLossConfig(behaviour_weight_cap=2.0), proximal_logprobs=lp.detach())
    assert out.mean_behaviour_weight == pytest.approx(2.0)
    assert float(out.loss.detach()) == pytest.approx(-2.0)  # ratio vs proximal = 1, weight 2, A = 1
    # without a proximal policy the ratio against the stale behaviour would be 3 and clipped at 1.2
    plain = grpo_loss(lp, behaviour, torch.tensor([1.0]), torch.ones(1, 1))
    assert float(plain.loss.detach()) == pytest.approx(-1.2)


def test_shape_errors_name_the_argument():
    with pytest.raises(ValueError, match="advantages"):
        grpo_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(3), torch.ones(2, 3))
    with pytest.raises(ValueError, match="mask"):
        grpo_loss(torch.zeros(2, 3), torch.zeros(2, 3), torch.zeros(2), torch.ones(2, 2))


def test_token_logprobs_temperature():
    logits = torch.tensor([[2.0, 0.0]])
    tok = torch.tensor([0])
    assert float(token_logprobs(logits, tok)) == pytest.approx(math.log(math.exp(2) / (math.exp(2) + 1)))
    assert float(token_logprobs(logits, tok, 2.0)) == pytest.approx(math.log(math.e / (math.e + 1)))


def test_token_logprobs_with_top_k_top_p_have_finite_gradients_on_removed_tokens():
    logits = torch.tensor([[3.0, 2.0, -1.0, -5.0]], requires_grad=True)
    tokens = torch.tensor([3])  # removed by top-k 2 (a padding position can hold such a token)
    lp = token_logprobs(logits, tokens, 1.0, top_k=2, top_p=0.9)
    (lp * 0.0).sum().backward()
    assert logits.grad is not None and torch.isfinite(logits.grad).all()
    kept = token_logprobs(logits, torch.tensor([0]), 1.0, top_k=2)
    assert float(kept.detach()) == pytest.approx(math.log(math.exp(3) / (math.exp(3) + math.exp(2))), rel=1e-6)
