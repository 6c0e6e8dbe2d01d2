"""The real SmolLM2-135M-Instruct checkpoint (converted once into the specrl cache), loaded once per session."""

from __future__ import annotations

import pytest
import torch

SMOLLM2 = "builtin:smollm2-135m"


@pytest.fixture(scope="session")
def smollm2_path():
    from specrl.runtime.models.hub import resolve_model

    return resolve_model(SMOLLM2)  # fails with the install hint when the extra is missing


@pytest.fixture(scope="session")
def smollm2(smollm2_path):
    """float32 SmolLM2 in eval mode; tests must not modify it (deep-copy first)."""
    from specrl.runtime.models.hub import load_causal_lm

    torch.set_num_threads(2)
    return load_causal_lm(SMOLLM2, "float32")


@pytest.fixture(scope="session")
def smollm2_tok(smollm2_path):
    from specrl.runtime.models.hub import load_tokenizer

    return load_tokenizer(SMOLLM2)
