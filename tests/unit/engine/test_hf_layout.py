"""The typed accessors of the Hugging Face layout the native engine reads (engine/hf_layout.py)."""

from __future__ import annotations

import pytest
import torch
from specrl.runtime.engine.hf_layout import config_of, output_embeddings
from specrl.runtime.engine.model_runner import decoder_of

from .conftest import make_model


def test_accessors_return_the_models_own_parts() -> None:
    model = make_model("llama", layers=1)
    assert config_of(model) is model.config
    assert output_embeddings(model) is model.lm_head
    dec = decoder_of(model)
    assert dec is model.model and dec.embed_tokens is model.model.embed_tokens
    assert dec.layers[0].self_attn.q_proj is model.model.layers[0].self_attn.q_proj


def test_a_module_that_is_not_a_causal_lm_is_refused_by_name() -> None:
    plain = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match="^model: Linear has no Hugging Face config"):
        config_of(plain)
    with pytest.raises(ValueError, match=r"^model: Linear has no linear output embeddings \(lm_head\)"):
        output_embeddings(plain)
    with pytest.raises(ValueError, match="^model: the native engine runs"):
        decoder_of(plain)
