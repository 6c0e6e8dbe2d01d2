"""GRPO on the real SmolLM2 checkpoint: on-policy ratio 1 with top-k/top-p, one step changes the weights and the
synced rollout copy reproduces the trainer, export -> from_pretrained gives the same logits, resume is
bit-identical. One trainer for the whole module (loading + AdamW state of 135M parameters is the cost)."""

from __future__ import annotations

import copy

import pytest
import torch
from specrl.runtime.engine import RolloutEngine, SamplingParams
from specrl.runtime.engine.model_runner import TransformerRunner
from specrl.runtime.rl.grpo import group_advantages
from specrl.runtime.rl.settings import RunSettings
from specrl.runtime.rl.trainer import Sample, TrainerWorker, pad_batch, weights_digest

pytestmark = pytest.mark.slow

TEMPERATURE, TOP_K, TOP_P = 1.0, 20, 0.9
PROMPTS = ["What is 3+4? Answer with just the number.", "What is 9-2? Answer with just the number."]


@pytest.fixture(scope="module")
def settings():
    return RunSettings(model="builtin:smollm2-135m", draft_model=None, method="none", group_size=2,
                       prompts_per_step=2, max_new_tokens=10, lr=1e-5, micro_batch=4, drafter_training=False,
                       torch_threads=2, temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P)


@pytest.fixture(scope="module")
def trainer(settings, smollm2_path):
    return TrainerWorker(settings)


@pytest.fixture(scope="module")
def rollout(smollm2):
    return RolloutEngine(copy.deepcopy(smollm2), max_batch_size=4, max_model_len=96)


def _samples(engine: RolloutEngine, tok, seed: int, rewards=(1.0, 0.0, 0.0, 1.0)) -> list[Sample]:
    prompts = [tok.prompt_ids(p) for p in PROMPTS for _ in range(2)]
    outs = engine.generate(prompts, [SamplingParams(max_new_tokens=10, seed=seed + i, stop_token_ids=tuple(tok.stop_ids),
                                                    temperature=TEMPERATURE, top_k=TOP_K, top_p=TOP_P)
                                     for i in range(len(prompts))])
    adv = group_advantages(torch.tensor(rewards), 2).tolist()
    return [Sample(prompt_id=f"p{i // 2}", prompt_ids=p, response_ids=list(o.token_ids), logprobs=list(o.logprobs),
                   reward=r, advantage=a) for i, (p, o, r, a) in enumerate(zip(prompts, outs, rewards, adv))]


def _ratios(trainer: TrainerWorker, samples: list[Sample], **override) -> torch.Tensor:
    batch = pad_batch(samples)
    s = trainer.settings.replace(**override) if override else trainer.settings
    from specrl.runtime.rl.trainer import response_logprobs

    with torch.no_grad():
        logp = response_logprobs(trainer.model, batch, s.temperature, s.top_k, s.top_p)
    return torch.exp(logp - batch["behaviour"])[batch["mask"] > 0]


def test_on_policy_ratio_is_one_with_top_k_and_top_p(trainer, rollout):
    samples = _samples(rollout, trainer.tokenizer, seed=0)
    ratios = _ratios(trainer, samples)
    assert ratios.numel() > 10
    assert float((ratios - 1).abs().max()) < 1e-3
    # The bug this guards against: temperature-only trainer log-probs against processed behaviour log-probs.
    assert float((_ratios(trainer, samples, top_k=0, top_p=1.0) - 1).abs().max()) > 1e-2


def test_grpo_step_then_sync_reproduces_the_trainer(trainer, rollout, tmp_path):
    samples = _samples(rollout, trainer.tokenizer, seed=10)
    before = weights_digest(trainer.model)
    out = trainer.train_step(samples, step=0, total_tokens=sum(len(s.response_ids) for s in samples))
    assert weights_digest(trainer.model) != before and out["grad_norm"] > 0
    assert out["worker"] == trainer.name and out["rank"] == 0 and out["tokens_per_s"] > 0
    # weight sync: the rollout copy takes the trainer's state; the engine picks it up and matches the trainer
    rollout.load_policy_state({k: v.detach().clone() for k, v in trainer.model.state_dict().items()})
    assert weights_digest(rollout.model) == weights_digest(trainer.model)
    ids = trainer.tokenizer.prompt_ids(PROMPTS[0])
    runner = TransformerRunner(rollout.model)
    with torch.inference_mode():
        native, _ = runner.forward(runner.new_cache(1, len(ids) + 1), 0, [0], torch.tensor([ids]))
        ref = trainer.model(torch.tensor([ids])).logits[0]
    assert float((native[0] - ref).abs().max()) < 1e-3
    assert float((_ratios(trainer, _samples(rollout, trainer.tokenizer, seed=20)) - 1).abs().max()) < 1e-3


def test_export_loads_in_transformers_and_resume_is_bit_identical(trainer, rollout, tmp_path):
    from specrl.runtime.coordinator.checkpoints import mark_complete
    from specrl.runtime.models.export import export_policy
    from transformers import AutoModelForCausalLM, AutoTokenizer

    samples = _samples(rollout, trainer.tokenizer, seed=30)
    tokens = sum(len(s.response_ids) for s in samples)
    ckpt = tmp_path / "ckpt" / "step-000001"
    cursor_saved = {"step": trainer.step}
    trainer.save_checkpoint(str(ckpt), cursor=cursor_saved)
    mark_complete(ckpt, cursor_saved)  # what the coordinator writes once every rank has saved
    saved = weights_digest(trainer.model)
    out = export_policy(ckpt.parent, tmp_path / "exported")
    plain = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert weights_digest(plain) == saved
    ids = torch.tensor([trainer.tokenizer.prompt_ids(PROMPTS[1])])
    with torch.inference_mode():
        assert torch.equal(plain(ids).logits, trainer.model(ids).logits)
    assert AutoTokenizer.from_pretrained(out).chat_template
    # resume: the step after the checkpoint, twice (continuing, then after loading the checkpoint)
    trainer.train_step(samples, step=1, total_tokens=tokens)
    continued = weights_digest(trainer.model)
    cursor = trainer.load_checkpoint(str(ckpt))
    assert cursor == cursor_saved and weights_digest(trainer.model) == saved
    trainer.train_step(samples, step=1, total_tokens=tokens)
    assert weights_digest(trainer.model) == continued
