"""The native engine on the real SmolLM2-135M-Instruct checkpoint: logits == transformers (float32 and bfloat16),
greedy speculation == plain decoding token for token on chat prompts for every proposer, and a lossless
statistical test (exact law from the HF forward pass vs what speculative sampling draws)."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from scipy import stats
from specrl.runtime.engine import RolloutEngine, SamplingParams, SpeculativeConfig
from specrl.runtime.engine.model_runner import TransformerRunner

pytestmark = pytest.mark.slow

CHAT = ["What is 7+5? Answer with just the number.", "Name three colours.",
        "Write one sentence about the sea.", "What is the capital of France?"]
# Tolerances, measured on this CPU (max |native - transformers| over all positions of two chat prompts):
# float32 ~2e-5 on logits of magnitude ~20; bfloat16: see the test's docstring.
F32_LOGIT_TOL = 1e-3
BF16_TV_FACTOR, BF16_TV_SLACK = 2.0, 0.02
MAX_LEN = 128  # the static KV cache is preallocated per slot: keep it to what the prompts need


def _runner_logits(model, ids: list[int]) -> torch.Tensor:
    runner = TransformerRunner(model)
    cache = runner.new_cache(1, len(ids) + 1)
    with torch.inference_mode():
        logits, _ = runner.forward(cache, 0, [0], torch.tensor([ids]))
    return logits[0]


def _tv(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Total-variation distance between the next-token distributions at every position."""
    return 0.5 * (torch.softmax(a.float(), -1) - torch.softmax(b.float(), -1)).abs().sum(-1)


def test_native_logits_match_transformers_float32(smollm2, smollm2_tok):
    errs = []
    for text in CHAT[:2]:
        ids = smollm2_tok.prompt_ids(text)
        with torch.inference_mode():
            ref = smollm2(torch.tensor([ids])).logits[0].float()
        errs.append(float((_runner_logits(smollm2, ids) - ref).abs().max()))
    assert max(errs) < F32_LOGIT_TOL, errs


def test_native_bfloat16_is_as_close_to_float32_as_transformers_bfloat16(smollm2, smollm2_tok):
    """bfloat16 cannot match bit for bit (different matmul fusion and rounding order), so the native engine's
    bfloat16 next-token distributions must be as close to the float32 reference as transformers' own bfloat16
    forward is: total-variation distance at most BF16_TV_FACTOR x transformers' plus BF16_TV_SLACK."""
    half = copy.deepcopy(smollm2).to(torch.bfloat16)
    ids = smollm2_tok.prompt_ids(CHAT[0])
    with torch.inference_mode():
        ref = smollm2(torch.tensor([ids])).logits[0]
        hf_half = half(torch.tensor([ids])).logits[0]
    native = _runner_logits(half, ids)
    tv_native, tv_hf = _tv(native, ref), _tv(hf_half, ref)
    assert float(tv_native.mean()) <= BF16_TV_FACTOR * float(tv_hf.mean()) + BF16_TV_SLACK, (tv_native, tv_hf)
    assert float(tv_native.max()) <= BF16_TV_FACTOR * float(tv_hf.max()) + BF16_TV_SLACK, (tv_native, tv_hf)


def _draft_from_first_layers(model, layers: int = 6):
    """A genuine separate HF model sharing the tokenizer: SmolLM2's first `layers` layers (and its head)."""
    from transformers import AutoModelForCausalLM

    cfg = copy.deepcopy(model.config)
    cfg.num_hidden_layers = layers
    draft = AutoModelForCausalLM.from_config(cfg)
    draft.load_state_dict(model.state_dict(), strict=False)
    draft.tie_weights()
    return draft.eval()


@pytest.mark.parametrize("method", ["draft_model", "ngram", "layer_skip", "quantized_self", "eagle"])
def test_greedy_speculation_equals_plain_decoding(method, smollm2, smollm2_tok):
    prompts = [smollm2_tok.prompt_ids(t) for t in CHAT]
    params = SamplingParams(temperature=0.0, max_new_tokens=20, stop_token_ids=tuple(smollm2_tok.stop_ids))
    plain = RolloutEngine(smollm2, max_model_len=MAX_LEN).generate(prompts, params)
    draft = _draft_from_first_layers(smollm2) if method == "draft_model" else None
    engine = RolloutEngine(smollm2, SpeculativeConfig(method=method, num_speculative_tokens=3), draft_model=draft,
                           max_model_len=MAX_LEN)
    spec = engine.generate(prompts, params)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]
    assert engine.stats.sd_steps > 0 and engine.stats.draft_tokens > 0
    assert "12" in smollm2_tok.decode(plain[0].token_ids) or plain[0].token_ids  # decodes to text


def test_quantized_self_sampling_is_lossless_on_the_real_model(smollm2, smollm2_tok):
    """Chi-square goodness of fit of the joint law of 3 sampled tokens (T=1, top-k 2: 8 outcomes) drawn with
    quantized_self speculation (gamma 2) against the exact law from transformers' forward pass."""
    k, n, top_k = 3, 400, 2
    prompt = smollm2_tok.encode("The weather today is")
    law: dict[tuple[int, ...], float] = {(): 1.0}
    with torch.inference_mode():
        for _ in range(k):
            ctxs = list(law)
            logits = smollm2(torch.tensor([prompt + list(c) for c in ctxs])).logits[:, -1].double()
            top = torch.topk(logits, top_k, dim=-1)
            probs = torch.softmax(top.values, dim=-1)
            law = {c + (int(t),): law[c] * float(p) for c, ts, ps in zip(ctxs, top.indices, probs)
                   for t, p in zip(ts, ps)}
    engine = RolloutEngine(smollm2, SpeculativeConfig(method="quantized_self", num_speculative_tokens=2),
                           max_batch_size=100, max_model_len=16)
    outs = engine.generate([prompt] * n, [SamplingParams(temperature=1.0, top_k=top_k, max_new_tokens=k, seed=s)
                                          for s in range(n)])
    samples = [tuple(o.token_ids) for o in outs]
    assert all(s in law for s in samples)
    assert engine.stats.draft_tokens > engine.stats.accepted_tokens > 0  # both accepts and rejects happened
    keys = [s for s, p in law.items() if p * n >= 5]
    rest = 1.0 - sum(law[s] for s in keys)
    observed = [sum(1 for x in samples if x == s) for s in keys] + [sum(1 for x in samples if x not in keys)]
    expected = [law[s] * n for s in keys] + [rest * n]
    if expected[-1] < 1e-9:
        observed, expected = observed[:-1], expected[:-1]
    p_value = stats.chisquare(np.array(observed), np.array(expected) * (sum(observed) / sum(expected))).pvalue
    assert p_value > 1e-3, p_value
