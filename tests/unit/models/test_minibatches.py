"""PPO-style mini-batches and epochs per RL step, and per-rank statistics from the trainer (tiny model, seconds)."""

from __future__ import annotations

import torch
from specrl.runtime.rl.settings import RunSettings
from specrl.runtime.rl.tokenizer import CharTokenizer
from specrl.runtime.rl.trainer import Sample, TrainerWorker


def _folder(tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    tok = CharTokenizer()
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, num_key_value_heads=1)).save_pretrained(tmp_path)
    tok.save_pretrained(tmp_path)
    return tmp_path


def _samples(tok: CharTokenizer) -> list[Sample]:
    out = []
    for i, (text, adv) in enumerate([("12", 1.0), ("7", -1.0), ("30", 1.0), ("4", -1.0)]):
        ids = tok.encode(f"A:{text}", add_eos=True)
        out.append(Sample(prompt_id=f"p{i // 2}", prompt_ids=tok.encode("Q:1+2=?", add_bos=True), response_ids=ids,
                          logprobs=[-4.0] * len(ids), reward=float(adv > 0), advantage=adv))
    return out


def test_mini_batches_and_epochs_take_that_many_updates(tmp_path):
    folder = _folder(tmp_path)
    tok = CharTokenizer()
    base = RunSettings(model=str(folder), draft_model=None, method="none", lr=0.05, drafter_training=False)
    samples = _samples(tok)
    total = sum(len(s.response_ids) for s in samples)
    one = TrainerWorker(base).train_step(samples, 0, total)
    assert one["updates"] == 1 and len(one["grad_norms"]) == 1
    many = TrainerWorker(base.replace(mini_batches=2, epochs=2)).train_step(samples, 0, total)
    assert many["updates"] == 4 and len(many["grad_norms"]) == 4
    assert many["tokens"] == one["tokens"] == total  # every token once per epoch
    # behaviour log-probs (-4) are far from the policy's: the clipped ratio is active
    assert many["clip_fraction"] > 0
    assert many["worker"].endswith("trainer-0") and many["rank"] == 0 and many["samples"] == 4
