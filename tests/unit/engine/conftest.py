"""Tiny random Llama/Qwen2 models for the engine tests (built from configs, no downloads)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

VOCAB = 16


@pytest.fixture(autouse=True)
def _one_intra_op_thread():
    """These tests run many tiny ops; on a shared, oversubscribed 2-core machine OpenMP spinning with 2 threads
    made them ~10x slower (measured). Restore the setting afterwards so other suites are unaffected."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def make_model(kind: str = "llama", layers: int = 2, hidden: int = 32, seed: int = 0, vocab: int = VOCAB,
               head_std: float = 0.35, init: float = 0.2) -> LlamaForCausalLM | Qwen2ForCausalLM:
    """A random model whose next-token distributions are peaked and depend on the context."""
    torch.manual_seed(seed)
    common: dict[str, Any] = {"vocab_size": vocab, "hidden_size": hidden, "intermediate_size": 2 * hidden, "num_hidden_layers": layers,
                  "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 128,
                  "initializer_range": init, "tie_word_embeddings": False}
    model = (Qwen2ForCausalLM(Qwen2Config(**common)) if kind == "qwen2" else LlamaForCausalLM(LlamaConfig(**common)))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0.0, init)
            elif "bias" in name:
                p.normal_(0.0, 0.3)
        model.lm_head.weight.normal_(0.0, head_std)
    return model.eval()


@pytest.fixture(scope="session")
def target() -> torch.nn.Module:
    return make_model("llama", layers=2, hidden=32, seed=0)


@pytest.fixture(scope="session")
def draft() -> torch.nn.Module:
    # Deliberately different from the target (other seed, one layer) so rejections happen often.
    return make_model("llama", layers=1, hidden=32, seed=1)


@pytest.fixture(scope="session")
def qwen_target() -> torch.nn.Module:
    return make_model("qwen2", layers=2, hidden=32, seed=2)


def reference_probs(logits: np.ndarray, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """Independent float64 implementation of temperature -> top-k -> top-p -> softmax (rows of logits)."""
    logits = np.asarray(logits, dtype=np.float64)
    out = np.zeros_like(logits)
    for r, row in enumerate(logits):
        if temperature == 0:
            out[r, int(np.argmax(row))] = 1.0
            continue
        z = row / temperature
        keep = np.ones_like(z, dtype=bool)
        if top_k > 0:
            kth = np.sort(z)[::-1][min(top_k, len(z)) - 1]
            keep &= z >= kth
        if top_p < 1.0:
            zz = np.where(keep, z, -np.inf)
            p = np.exp(zz - zz.max())
            p /= p.sum()
            order = np.argsort(-p, kind="stable")
            before = np.cumsum(p[order]) - p[order]
            cut = p[order][before < top_p].min()
            keep &= p >= cut
        zz = np.where(keep, z, -np.inf)
        p = np.exp(zz - zz.max())
        out[r] = p / p.sum()
    return out
