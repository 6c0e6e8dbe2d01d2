"""quantized_self drafts over the target's own KV cache where it computes in the target's dtype (nothing to
prefill on admission, nothing to catch up after a step), and over a cache of its own where it does not; greedy
decoding stays token-for-token plain decoding either way, through continuous batching and shared prefills."""

from __future__ import annotations

import torch
from specrl.runtime.engine import RolloutEngine, SamplingParams, SpeculativeConfig
from specrl.runtime.engine.model_runner import native_bf16
from specrl.runtime.engine.proposers import QuantizedSelfProposer

from .conftest import make_model

PROMPTS = [[1, 2, 3], [4, 5, 6, 7], [1, 2, 3], [9, 8], [5, 5, 5, 5, 5]]


def greedy_equal(model: torch.nn.Module, dtype: str, bits: int | None) -> RolloutEngine:
    params = SamplingParams(temperature=0.0, max_new_tokens=14)
    plain = RolloutEngine(model, max_batch_size=3, dtype=dtype).generate(PROMPTS, params)
    engine = RolloutEngine(model, SpeculativeConfig(method="quantized_self", num_speculative_tokens=3,
                                                    quantized_bits=bits), max_batch_size=3, dtype=dtype)
    got = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in plain]
    assert engine.stats.accepted_tokens > 0
    assert isinstance(engine.proposers["quantized_self"], QuantizedSelfProposer)
    return engine


def test_drafts_over_the_target_cache() -> None:
    # int8 computes in the target's dtype on every CPU; the 4-bit kernels compute in bfloat16 where the CPU has
    # AVX512-BF16 (a bfloat16 target then shares its cache with them), in float32 elsewhere
    four_bit = "bfloat16" if native_bf16() else "float32"
    for dtype, bits in (("float32", 8), (four_bit, None)):
        engine = greedy_equal(make_model("llama", layers=2, hidden=64, seed=4, head_std=0.5), dtype, bits)
        # rejected drafts left the drafter's K/V past the target's length: the verifications overwrote them
        assert engine.stats.draft_tokens > engine.stats.accepted_tokens
        drafter = engine.proposers["quantized_self"]
        assert isinstance(drafter, QuantizedSelfProposer) and drafter.shares_target_cache, (dtype, bits)
        assert getattr(drafter, "cache", None) is None  # no cache of its own was allocated


def test_keeps_its_own_cache_in_another_dtype() -> None:
    # bfloat16 weights quantized to int8 compute in bfloat16; the target runs float32 here
    model = make_model("llama", layers=2, hidden=64, seed=4, head_std=0.5)
    for p in model.parameters():
        p.data = p.data.to(torch.bfloat16)
    drafter = greedy_equal(model, "float32", 8).proposers["quantized_self"]
    assert isinstance(drafter, QuantizedSelfProposer) and not drafter.shares_target_cache
    assert drafter.cache.k[0].dtype == torch.bfloat16
