"""Llama, Qwen2 and Qwen3 (q/k norm) through the native engine: runner logits == HF, greedy SD == AR, and one
clear error for anything else. Tiny random models built from configs (seconds)."""

from __future__ import annotations

import pytest
import torch
from specrl.runtime.engine import RolloutEngine, SamplingParams, SpeculativeConfig
from specrl.runtime.engine.model_runner import TransformerRunner

VOCAB = 32


def tiny(kind: str, seed: int = 0, dtype: torch.dtype = torch.float32) -> torch.nn.Module:
    from transformers import (
        LlamaConfig,
        LlamaForCausalLM,
        Qwen2Config,
        Qwen2ForCausalLM,
        Qwen3Config,
        Qwen3ForCausalLM,
    )

    torch.manual_seed(seed)
    common = {"vocab_size": VOCAB, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
              "tie_word_embeddings": False}
    cls, cfg = {"llama": (LlamaForCausalLM, LlamaConfig), "qwen2": (Qwen2ForCausalLM, Qwen2Config),
                "qwen3": (Qwen3ForCausalLM, Qwen3Config)}[kind]
    extra = {"head_dim": 8} if kind == "qwen3" else {}
    model = cls(cfg(**common, **extra))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.2)
            elif "norm" in name:  # non-trivial norm weights, so a skipped q/k norm cannot go unnoticed
                p.uniform_(0.5, 1.5)
            elif "bias" in name:
                p.normal_(0.0, 0.3)
    return model.to(dtype).eval()


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3"])
def test_runner_matches_hf_forward(kind: str) -> None:
    model = tiny(kind)
    runner = TransformerRunner(model)
    x = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = model(x).logits
        cache = runner.new_cache(2, 16)
        logits, _ = runner.forward(cache, 0, [0, 0], x[:, :5])
        errs = [float((logits - ref[:, :5]).abs().max())]
        for t in range(5, 9):
            logits, _ = runner.forward(cache, 0, [t, t], x[:, t:t + 1])
            errs.append(float((logits[:, 0] - ref[:, t]).abs().max()))
    assert max(errs) < 1e-4


@pytest.mark.parametrize("method", ["layer_skip", "quantized_self", "eagle", "ngram"])
def test_qwen3_greedy_speculation_equals_plain(method: str) -> None:
    model = tiny("qwen3", seed=4)
    prompts = [[1, 2, 3, 4], [5, 6, 7, 5, 6, 7, 5], [9]]
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    plain = RolloutEngine(model).generate(prompts, params)
    engine = RolloutEngine(model, SpeculativeConfig(method=method, num_speculative_tokens=3))
    spec = engine.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert engine.stats.sd_steps > 0


def test_unsupported_model_type_is_one_clear_error() -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_embd=16, n_layer=1, n_head=2))
    with pytest.raises(ValueError, match=r"native engine runs llama, qwen2, qwen3 causal LMs, got GPT2LMHeadModel"):
        TransformerRunner(model)
