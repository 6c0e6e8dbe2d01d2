"""Shared prefill: identical prompts admitted together are prefilled once, and nothing a request sees changes."""

from __future__ import annotations

import pytest
import torch
from specrl.runtime.engine import RolloutEngine, SamplingParams, SpeculativeConfig
from specrl.runtime.engine.kv_cache import StaticKVCache
from specrl.runtime.engine.model_runner import Int4Dense
from specrl.runtime.engine.proposers.eagle import EagleHead

# Groups of identical prompts (GRPO), a lone prompt, a prompt that is a prefix of another (not a repeat), and 15
# requests for 4 slots: several admission waves, groups split across them.
BASE = [[1, 2, 3, 4, 5], [7, 7, 2], [3, 1, 4, 1, 5, 9, 2, 6], [5], [1, 2, 3]]
PROMPTS = [BASE[0]] * 4 + [BASE[1]] * 3 + [BASE[2]] + [BASE[3]] * 2 + [BASE[1]] * 3 + [BASE[4]] * 2


def _params(temperature: float) -> list[SamplingParams]:
    return [SamplingParams(temperature=temperature, top_k=8 if i % 3 == 0 else 0, max_new_tokens=6 + i % 5,
                           seed=100 + i, logprobs_mode="raw" if i % 4 == 1 else "processed")
            for i in range(len(PROMPTS))]


@pytest.fixture(scope="module")
def eagle_head(target) -> EagleHead:
    torch.manual_seed(3)
    return EagleHead.from_target(target)  # one head for both engines (a default head is freshly random per engine)


def _run(target, draft, head, method: str, temperature: float, share: bool, slots: int = 4
         ) -> tuple[list, RolloutEngine]:
    engine = RolloutEngine(target, SpeculativeConfig(method=method, num_speculative_tokens=3), draft_model=draft,
                           eagle_head=head, max_batch_size=slots, share_prefill=share, dtype=torch.float32)
    outs = engine.generate(PROMPTS, _params(temperature))
    return [(o.token_ids, o.logprobs, o.finish_reason) for o in outs], engine


@pytest.mark.parametrize("method", ["none", "ngram", "draft_model", "quantized_self", "layer_skip", "eagle"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_sharing_changes_no_token_and_no_logprob(method: str, temperature: float, target, draft,
                                                    eagle_head) -> None:
    plain, off = _run(target, draft, eagle_head, method, temperature, share=False)
    shared, on = _run(target, draft, eagle_head, method, temperature, share=True)
    if not (method == "quantized_self" and not Int4Dense.available(torch.device("cpu"))):
        assert shared == plain  # token ids, logprobs (bit for bit) and finish reasons
    elif temperature == 0.0:
        # The int8 drafter (CPUs without 4-bit kernels) quantizes activations per call, over every row drafted
        # together, so its proposals depend on which rows share a step; the verification then covers other
        # positions, and the float32 per-op attention rounds the same position differently in another block
        # (last bits). Greedy tokens stay exactly the same. (At temperature 1 other proposals consume a request's
        # random stream differently: the same law — the lossless tests — not the same draws.)
        assert [(t, f) for t, _, f in shared] == [(t, f) for t, _, f in plain]
        for (_, a, _), (_, b, _) in zip(shared, plain):
            assert a == pytest.approx(b, abs=1e-5)
    assert off.stats.prefill_rows == len(PROMPTS)
    assert on.stats.prefill_rows < off.stats.prefill_rows
    # a wave saves its forward only when every joiner in it copies; which joiners share a wave follows when the
    # others finish (each drafter's acceptance), so fewer forwards is not guaranteed, fewer rows is
    assert on.stats.prefill_forwards <= off.stats.prefill_forwards
    if method != "none":
        assert on.stats.sd_steps > 0


def test_one_admission_prefills_each_distinct_prompt_once(target, draft, eagle_head) -> None:
    plain, _ = _run(target, draft, eagle_head, "draft_model", 1.0, share=False, slots=16)
    shared, on = _run(target, draft, eagle_head, "draft_model", 1.0, share=True, slots=16)
    assert shared == plain
    assert (on.stats.prefill_forwards, on.stats.prefill_rows) == (1, len(BASE))


def test_copy_slots_reads_every_source_before_writing() -> None:
    cache = StaticKVCache(num_layers=2, slots=4, kv_heads=1, max_len=6, head_dim=2, dtype=torch.float32,
                          device=torch.device("cpu"))
    for layer in range(2):
        for s in range(4):
            cache.k[layer][s].fill_(s)
            cache.v[layer][s].fill_(10 + s)
    cache.copy_slots([0, 1, 1], [1, 2, 3], length=4)  # slot 1 is a source and a destination
    for layer in range(2):
        assert [cache.k[layer][s, 0, 0, 0].item() for s in range(4)] == [0, 0, 1, 1]
        assert [cache.v[layer][s, 0, 3, 1].item() for s in range(4)] == [10, 10, 11, 11]
        assert cache.k[layer][3, 0, 4:].eq(3).all()  # positions past `length` untouched
