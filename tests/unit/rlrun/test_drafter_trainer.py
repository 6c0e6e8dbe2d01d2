"""TLT drafter training: distilling the current policy along its rollouts raises speculative acceptance."""

import torch
from specrl.runtime.rl.drafter_trainer import DrafterTrainer
from transformers import LlamaConfig, LlamaForCausalLM


def _llama(hidden, layers, seed):
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=24, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=64)
    return LlamaForCausalLM(cfg)


def _acceptance(policy, draft, seqs, n_prompt):
    """Mean over response positions of sum_x min(p(x), q(x)): the per-token acceptance probability."""
    ids = torch.tensor(seqs)
    with torch.no_grad():
        p = torch.softmax(policy(input_ids=ids).logits[:, n_prompt - 1:-1], -1)
        q = torch.softmax(draft(input_ids=ids).logits[:, n_prompt - 1:-1], -1)
    return float(torch.minimum(p, q).sum(-1).mean())


def test_distillation_on_rollouts_raises_acceptance_and_state_round_trips():
    torch.set_num_threads(1)
    policy = _llama(32, 2, 0).eval()
    with torch.no_grad():  # a peaked policy, like a trained one (a random one is near-uniform)
        policy.lm_head.weight.mul_(40.0)
    draft = _llama(16, 1, 1)
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(4, 24, (32, 4), generator=g)
    # rollouts sampled from the policy at temperature 1
    seqs = prompts.clone()
    with torch.no_grad():
        for _ in range(12):
            probs = torch.softmax(policy(input_ids=seqs).logits[:, -1], -1)
            seqs = torch.cat([seqs, torch.multinomial(probs, 1, generator=g)], 1)
    rollouts = seqs.tolist()
    before = _acceptance(policy, draft, rollouts, 4)
    trainer = DrafterTrainer(draft, lr=3e-3, seed=0, batch_size=16)
    out = trainer.train(rollouts, [4] * len(rollouts), max_steps=60, deadline_s=60, teacher=policy)
    after = _acceptance(policy, draft, rollouts, 4)
    assert out["steps"] == 60 and trainer.steps_total == 60
    assert 1 - after < 0.6 * (1 - before), (before, after)  # the rejection rate fell by > 40%

    again = DrafterTrainer(_llama(16, 1, 1), lr=3e-3, seed=0)
    again.load_state_dict(trainer.state_dict())
    for a, b in zip(again.model.state_dict().values(), trainer.model.state_dict().values()):
        assert torch.equal(a, b)
    assert list(again.buffer) == list(trainer.buffer)


def test_without_teacher_falls_back_to_cross_entropy_and_respects_budget():
    draft = _llama(16, 1, 2)
    trainer = DrafterTrainer(draft, lr=1e-3)
    out = trainer.train([[1, 5, 6, 7, 8]], [2], max_steps=3, deadline_s=30)
    assert out["steps"] == 3 and out["loss"] > 0
    assert trainer.train([], [], max_steps=0, deadline_s=30)["steps"] == 0
