"""Engine behaviour: runner == HF math, greedy SD == AR for every proposer, logprobs, batching, seeds, errors."""

from __future__ import annotations

from typing import Any, Literal, TypedDict

import numpy as np
import pytest
import torch
from specrl.runtime.engine import (
    Decision,
    FixedController,
    RolloutEngine,
    SamplingParams,
    SpeculativeConfig,
    StepRecord,
)
from specrl.runtime.engine.model_runner import Int4Dense, TransformerRunner, native_bf16
from specrl.runtime.engine.proposers import QuantizedSelfProposer
from specrl.runtime.engine.proposers.draft_model import DraftModelProposer
from specrl.runtime.engine.proposers.eagle import EagleProposer

from .conftest import VOCAB, make_model, reference_probs


class Knobs(TypedDict):
    """Sampling knobs shared by the engine's SamplingParams and the float64 reference."""

    temperature: float
    top_k: int
    top_p: float

PROPOSERS = ["draft_model", "ngram", "layer_skip", "quantized_self", "eagle"]
PROMPTS = [[1, 2, 3], [4, 5, 6, 7, 8, 9, 1, 2, 3], [5], [2, 2, 2, 2, 2, 2, 2], [9, 8, 7, 6, 5], [3, 1, 4, 1, 5, 9]]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_runner_matches_hf_forward(kind: str) -> None:
    model = make_model(kind, layers=2, seed=3)
    runner = TransformerRunner(model)
    cache = runner.new_cache(4, 32)
    x = torch.randint(0, VOCAB, (3, 10), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        ref = model(x).logits
        logits, _ = runner.forward(cache, 0, [0, 0, 0], x[:, :6])
        errs = [(logits - ref[:, :6]).abs().max()]
        for t in range(6, 9):
            logits, _ = runner.forward(cache, 0, [t] * 3, x[:, t : t + 1])
            errs.append((logits[:, 0] - ref[:, t]).abs().max())
        # a single row verifying two positions at once, from slot 1
        logits, _ = runner.forward(cache, 1, [8], x[1:2, 8:10])
        errs.append((logits[0] - ref[1, 8:10]).abs().max())
    assert max(float(e) for e in errs) < 1e-4


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("method", PROPOSERS)
def test_greedy_sd_equals_ar(kind: str, method: str, target, qwen_target, draft) -> None:
    model = target if kind == "llama" else qwen_target
    plain = SamplingParams(temperature=0.0, max_new_tokens=24, logprobs_mode="raw")
    ar_free = RolloutEngine(model, max_batch_size=4).generate(PROMPTS, plain)
    # A stop token that really occurs mid-way in some outputs (ragged finishes, both finish reasons).
    stop = ar_free[0].token_ids[5]
    params = SamplingParams(temperature=0.0, max_new_tokens=24, stop_token_ids=(stop,), logprobs_mode="raw")
    ar = RolloutEngine(model, max_batch_size=4).generate(PROMPTS, params)
    engine = RolloutEngine(model, SpeculativeConfig(method=method, num_speculative_tokens=3), draft_model=draft,
                           max_batch_size=4)
    sd = engine.generate(PROMPTS, params)
    assert {o.finish_reason for o in ar} == {"stop", "length"}
    for a, s in zip(ar, sd):
        assert s.token_ids == a.token_ids
        assert s.finish_reason == a.finish_reason
        np.testing.assert_allclose(s.logprobs, a.logprobs, atol=1e-4)
    assert engine.stats.sd_steps > 0 and engine.stats.draft_tokens > 0
    assert engine.stats.generated_tokens == sum(len(o.token_ids) for o in sd)


def _teacher_forced_logprobs(model, prompt, tokens, cfg) -> np.ndarray:
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens])).logits[0, len(prompt) - 1 : -1].double().numpy()
    probs = reference_probs(logits, cfg["temperature"], cfg["top_k"], cfg["top_p"])
    return np.log(probs[np.arange(len(tokens)), tokens])


@pytest.mark.parametrize("method", PROPOSERS)
def test_sampled_logprobs_are_the_targets(method: str, target, draft) -> None:
    """SD logprobs equal the target's (processed) logprobs of the same tokens, as AR's do (within 1e-4)."""
    cfg: Knobs = {"temperature": 0.9, "top_k": 8, "top_p": 0.95}
    params = [SamplingParams(max_new_tokens=12, seed=i, **cfg) for i in range(len(PROMPTS))]
    sd = RolloutEngine(target, SpeculativeConfig(method=method, num_speculative_tokens=3), draft_model=draft,
                       max_batch_size=4).generate(PROMPTS, params)
    ar = RolloutEngine(target, max_batch_size=4).generate(PROMPTS, params)
    for prompt, s, a in zip(PROMPTS, sd, ar):
        np.testing.assert_allclose(s.logprobs, _teacher_forced_logprobs(target, prompt, s.token_ids, cfg), atol=1e-4)
        np.testing.assert_allclose(a.logprobs, _teacher_forced_logprobs(target, prompt, a.token_ids, cfg), atol=1e-4)
    raw = [SamplingParams(max_new_tokens=8, seed=1, logprobs_mode="raw")]
    out = RolloutEngine(target, SpeculativeConfig(method=method), draft_model=draft).generate([PROMPTS[1]], raw)[0]
    np.testing.assert_allclose(out.logprobs, _teacher_forced_logprobs(target, PROMPTS[1], out.token_ids,
                                                                      {"temperature": 1.0, "top_k": 0, "top_p": 1.0}),
                               atol=1e-4)


def test_continuous_batching_and_per_request_seeds(target, draft) -> None:
    prompts = [[(i * 3 + j) % VOCAB for j in range(1 + i % 5)] for i in range(11)]
    params = [SamplingParams(max_new_tokens=4 + (i * 7) % 13, seed=100 + i, stop_token_ids=(0,)) for i in range(11)]
    engine = RolloutEngine(target, max_batch_size=3)
    outs = engine.generate(prompts, params)
    assert [o.request_id for o in outs] == list(range(11))
    assert [o.prompt_token_ids for o in outs] == prompts
    for o, p in zip(outs, params):
        assert 1 <= len(o.token_ids) <= p.max_new_tokens and len(o.logprobs) == len(o.token_ids)
        assert o.finish_reason == ("stop" if o.token_ids[-1] == 0 else "length")
        assert 0 not in o.token_ids[:-1]
    # AR results do not depend on the batch composition: each request alone gives the same tokens.
    for i in (0, 5, 10):
        alone = RolloutEngine(target, max_batch_size=1).generate([prompts[i]], params[i])[0]
        assert alone.token_ids == outs[i].token_ids
    # Speculative runs are reproducible for the same seeds and batch layout.
    sd = [RolloutEngine(target, SpeculativeConfig(method="draft_model", num_speculative_tokens=2),
                        draft_model=draft, max_batch_size=3).generate(prompts, params) for _ in range(2)]
    assert [o.token_ids for o in sd[0]] == [o.token_ids for o in sd[1]]
    assert engine.stats.requests_completed == 11
    # A per-call cap below max_batch_size: never more active sequences, the same tokens as batches of that size.
    capped = RolloutEngine(target, max_batch_size=8)
    assert [o.token_ids for o in capped.generate(prompts, params, max_batch=3)] == [o.token_ids for o in outs]
    assert max(r.batch_size for r in capped.stats.steps) == 3
    with pytest.raises(ValueError, match="max_batch"):
        capped.generate(prompts, params, max_batch=0)


def test_length_limit_of_the_context(target) -> None:
    engine = RolloutEngine(target, SpeculativeConfig(method="ngram", num_speculative_tokens=4), max_model_len=12)
    out = engine.generate([[1, 2, 1, 2, 1, 2, 1, 2, 1, 2]], SamplingParams(temperature=0.0, max_new_tokens=50))[0]
    assert len(out.token_ids) == 2 and out.finish_reason == "length"


class _Recorder:
    """A controller alternating AR and speculative steps with varying gamma (exercises catch-up paths)."""

    def __init__(self, method: str) -> None:
        self.method = method
        self.calls = 0
        self.records: list[StepRecord] = []

    def decide(self, active_batch_size: int) -> Decision:
        self.calls += 1
        return Decision(None) if self.calls % 3 == 0 else Decision(self.method, 1 + self.calls % 4)

    def observe(self, decision: Decision, record: StepRecord) -> None:
        # a speculative decision runs plainly when every row ends within one token (draft length capped at budget)
        assert record.method == decision.method or (record.method is None and record.gamma == 0)
        self.records.append(record)


@pytest.mark.parametrize("method", PROPOSERS)
def test_controller_hook_switching_is_still_exact(method: str, target, draft) -> None:
    params = SamplingParams(temperature=0.0, max_new_tokens=20)
    ar = RolloutEngine(target, max_batch_size=3).generate(PROMPTS, params)
    ctl = _Recorder(method)
    engine = RolloutEngine(target, SpeculativeConfig(method=method), draft_model=draft, max_batch_size=3,
                           controller=ctl)
    sd = engine.generate(PROMPTS, params)
    assert [o.token_ids for o in sd] == [o.token_ids for o in ar]
    assert {r.method for r in ctl.records} == {None, method}
    assert all(r.gamma <= 1 + c % 4 for c, r in enumerate(ctl.records, 1) if r.method)
    assert len(engine.stats.steps) == len(ctl.records) == engine.stats.ar_steps + engine.stats.sd_steps
    assert sum(r.emitted_tokens for r in ctl.records) + len(PROMPTS) == engine.stats.generated_tokens
    assert engine.stats.target_forwards == engine.stats.ar_steps + engine.stats.sd_steps + engine.stats.prefill_forwards


class _ColdStart(_Recorder):
    """Plain decoding for the first steps with no drafter warm, then the proposer: it catches up from the prompt."""

    def decide(self, active_batch_size: int) -> Decision:
        self.calls += 1
        return Decision(None) if self.calls <= 4 else Decision(self.method, 1 + self.calls % 4)

    def warm_proposers(self, active_batch_size: int) -> tuple[str, ...]:
        return ()


@pytest.mark.parametrize("method", ["draft_model", "quantized_self"])
def test_a_cold_drafter_catches_up_from_the_prompt(method: str, target, draft, monkeypatch) -> None:
    # GRPO-style duplicates admitted while the drafter is cold share a prefill it never ran: the copies must not
    # claim a prompt the source does not hold.
    prompts = [PROMPTS[1], PROMPTS[1], PROMPTS[0], PROMPTS[1], PROMPTS[4], PROMPTS[4]]
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    ar = RolloutEngine(target, max_batch_size=3).generate(prompts, params)
    prefills: list[int] = []
    cls = type(RolloutEngine(target, SpeculativeConfig(method=method), draft_model=draft).proposers[method])
    original = cls.prefill

    def counted(self: Any, slot0: int, inp: torch.Tensor, lens: list[int]) -> None:
        prefills.append(len(lens))
        original(self, slot0, inp, lens)

    monkeypatch.setattr(cls, "prefill", counted)
    ctl = _ColdStart(method)
    engine = RolloutEngine(target, SpeculativeConfig(method=method, extra_methods=("ngram",)), draft_model=draft,
                           max_batch_size=3, controller=ctl)
    sd = engine.generate(prompts, params)
    assert [o.token_ids for o in sd] == [o.token_ids for o in ar]
    assert prefills == [] and engine.stats.sd_steps > 0
    cold = engine.stats.accepted_tokens
    # with the drafter named warm it is prefilled on every admission, as before, and drafts the same tokens (greedy
    # outputs alone could not tell: verification corrects any draft, so a drafter reading a prompt it never saw
    # would show only as fewer accepted drafts)
    ctl = _ColdStart(method)
    ctl.warm_proposers = lambda active_batch_size: (method,)  # type: ignore[method-assign]
    engine = RolloutEngine(target, SpeculativeConfig(method=method, extra_methods=("ngram",)), draft_model=draft,
                           max_batch_size=3, controller=ctl)
    assert [o.token_ids for o in engine.generate(prompts, params)] == [o.token_ids for o in ar]
    assert prefills and sum(prefills) <= len(prompts)
    # quantized_self drafts row by row alike only through the AVX2 4-bit kernel: the int8 drafter scales activations
    # per call over every row drafted together, and on CPUs with native bf16 more than two rows go to ATen's int4
    # kernel, so a catch-up in other company drafts differently there (test_shared_prefill)
    row_invariant = method == "draft_model" or (not native_bf16() and Int4Dense.available(torch.device("cpu")))
    if row_invariant:
        assert engine.stats.accepted_tokens == cold > 0


def test_policy_update_refreshes_engine_and_drafters(target) -> None:
    new = make_model("llama", layers=2, seed=7)
    params = SamplingParams(temperature=0.0, max_new_tokens=10)
    policy = make_model("llama", layers=2, seed=0)
    engine = RolloutEngine(policy, SpeculativeConfig(method="quantized_self", extra_methods=("layer_skip", "eagle")))
    probe = torch.randn(1, policy.config.hidden_size, generator=torch.Generator().manual_seed(0))

    def quantized_qkv() -> torch.Tensor:
        with torch.inference_mode():
            proposer = engine.proposers["quantized_self"]
            assert isinstance(proposer, QuantizedSelfProposer) and proposer.runner is not None
            return proposer.runner.layers[0].qkv(probe.to(proposer.runner.dtype)).float()

    before = quantized_qkv()
    engine.load_policy_state(new.state_dict())
    expected = RolloutEngine(new).generate(PROMPTS, params)
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == [o.token_ids for o in expected]
    assert not torch.allclose(before, quantized_qkv(), atol=1e-3)  # re-quantized from the new weights
    # In-place edits of the HF model (e.g. an optimizer step in local mode) are picked up automatically.
    with torch.no_grad():
        for p_new, p in zip(target.parameters(), policy.parameters()):
            p.copy_(p_new)
    expected = RolloutEngine(target).generate(PROMPTS, params)
    assert [o.token_ids for o in engine.generate(PROMPTS, params)] == [o.token_ids for o in expected]
    with pytest.raises(ValueError, match="state_dict"):
        engine.load_policy_state({"nope": torch.zeros(1)})
    # Pushed eagle-head weights land in the proposer (and its fused inference copy).
    from specrl.runtime.engine.proposers.eagle import EagleHead

    trained = EagleHead.from_target(policy)
    with torch.no_grad():
        trained.fc.weight.fill_(0.25)
    engine.load_drafter_state(trained.state_dict(), method="eagle")
    eagle = engine.proposers["eagle"]
    assert isinstance(eagle, EagleProposer)
    assert torch.allclose(eagle.runner.fc(torch.ones(1, trained.fc.in_features)),
                       trained.fc(torch.ones(1, trained.fc.in_features)))
    with pytest.raises(ValueError, match="^method:"):
        engine.load_drafter_state({}, method="draft_model")


@pytest.mark.parametrize(
    ("kwargs", "name"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"temperature": float("nan")}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_p": 1.5}, "top_p"),
        ({"top_k": -1}, "top_k"),
        ({"top_k": 0.5}, "top_k"),
        ({"max_new_tokens": 0}, "max_new_tokens"),
        ({"stop_token_ids": [-3]}, "stop_token_ids"),
        ({"seed": "x"}, "seed"),
        ({"logprobs_mode": "both"}, "logprobs_mode"),
    ],
)
def test_invalid_sampling_params_name_the_parameter(kwargs: dict, name: str) -> None:
    with pytest.raises(ValueError, match=f"^{name}:"):
        SamplingParams(**kwargs)


def test_bad_requests_name_the_problem(target) -> None:
    engine = RolloutEngine(target, max_model_len=16)
    ok = SamplingParams(max_new_tokens=2)
    for prompts, params, pattern in [
        ([[]], ok, r"prompts\[0\]"),
        ([[1, 2], []], ok, r"prompts\[1\]"),
        ([list(range(16))], ok, r"prompts\[0\].*max_model_len"),
        ([[1, VOCAB]], ok, r"prompts\[0\].*vocabulary"),
        ([[1]], [ok, ok], "params"),
        ("abc", ok, "prompts"),
    ]:
        with pytest.raises(ValueError, match=pattern):
            engine.generate(prompts, params)  # type: ignore[arg-type]  # bad input on purpose
    assert engine.stats.generated_tokens == 0  # nothing ran: no partial state
    with pytest.raises(ValueError, match="^method:"):
        SpeculativeConfig(method="medusa")
    with pytest.raises(ValueError, match="^num_speculative_tokens:"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=0)
    with pytest.raises(ValueError, match="^draft_model:"):
        RolloutEngine(target, SpeculativeConfig(method="draft_model"))
    with pytest.raises(ValueError, match="^max_batch_size:"):
        RolloutEngine(target, max_batch_size=0)
    with pytest.raises(ValueError, match="^controller:"):
        RolloutEngine(target, controller=type("C", (), {"decide": lambda s, b: Decision("ngram", 2),
                                                       "observe": lambda s, d, r: None})()).generate([[1]], ok)


def test_eagle_head_trains_on_rollouts_and_acceptance_rises() -> None:
    from specrl.runtime.engine.proposers.eagle import EagleHead, train_step

    model = make_model("llama", layers=2, seed=0, head_std=0.6)
    head = EagleHead.from_target(model)
    prompts = [[i % VOCAB, (i * 5) % VOCAB] for i in range(48)]
    params = SamplingParams(max_new_tokens=20)

    # One engine throughout: the head is trained in place and the engine must pick that up by itself.
    engine = RolloutEngine(model, SpeculativeConfig(method="eagle", num_speculative_tokens=3), eagle_head=head,
                           max_batch_size=16, seed=0)

    def acceptance() -> float:
        engine.stats.reset()
        engine.generate(prompts[:24], params)
        return engine.stats.acceptance_length or 0.0

    fresh = acceptance()
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    rollouts = RolloutEngine(model, max_batch_size=48, seed=1)
    losses = []
    for _ in range(40):
        outs = rollouts.generate(prompts, params)
        losses.append(train_step(head, opt, model, torch.tensor([o.prompt_token_ids + o.token_ids for o in outs])))
    assert losses[-1] < 0.6 * losses[0]
    assert acceptance() > fresh + 0.2


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_eagle_training_forward_matches_the_inference_runner(kind: str) -> None:
    from specrl.runtime.engine.proposers.eagle import EagleHead, _EagleRunner, target_features

    model = make_model(kind, layers=2, seed=0)
    head = EagleHead.from_target(model)
    with torch.no_grad():
        for p in head.parameters():
            p.add_(torch.randn_like(p) * 0.1)
    toks = torch.randint(0, VOCAB, (2, 9), generator=torch.Generator().manual_seed(0))
    feats = target_features(model, toks)
    with torch.no_grad():
        pred = head(feats[:, :-1], toks[:, 1:], model.model.embed_tokens.weight)
    runner = _EagleRunner(head, TransformerRunner(model))
    with torch.inference_mode():
        _, g = runner.step(runner.new_cache(2, 32), [0, 0], feats[:, :-1], toks[:, 1:])
    assert float((g - pred).abs().max()) < 1e-5


def test_ngram_lookup_matches_a_plain_scan() -> None:
    import random

    from specrl.runtime.engine.proposers.ngram import ngram_lookup

    def plain(tokens: list[int], n_min: int, n_max: int, gamma: int) -> list[int]:
        for n in range(min(n_max, len(tokens) - 1), n_min - 1, -1):
            for i in range(len(tokens) - n - 1, -1, -1):
                if tokens[i : i + n] == tokens[len(tokens) - n :] and tokens[i + n : i + n + gamma]:
                    return tokens[i + n : i + n + gamma]
        return []

    rng = random.Random(0)
    for _ in range(2000):
        toks = [rng.randint(0, 4) for _ in range(rng.randint(1, 30))]
        assert ngram_lookup(toks, 1, 4, 3) == plain(toks, 1, 4, 3)
    assert ngram_lookup([1, 2, 3, 9, 1, 2], 1, 3, 5) == [3, 9, 1, 2]
    assert ngram_lookup([1, 2, 3], 1, 3, 2) == []


def test_mixed_logprob_modes_in_one_continuous_batch(target, draft) -> None:
    cfg: Knobs = {"temperature": 0.8, "top_k": 5, "top_p": 1.0}
    modes: list[Literal["processed", "raw"]] = ["processed", "raw", "raw", "processed", "raw"]
    params = [SamplingParams(max_new_tokens=6, seed=i, logprobs_mode=m, **cfg) for i, m in enumerate(modes)]
    for method in ("none", "draft_model"):
        outs = RolloutEngine(target, SpeculativeConfig(method=method), draft_model=draft,
                             max_batch_size=2).generate(PROMPTS[:5], params)
        for prompt, out, mode in zip(PROMPTS, outs, modes):
            ref_cfg = cfg if mode == "processed" else {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
            np.testing.assert_allclose(out.logprobs, _teacher_forced_logprobs(target, prompt, out.token_ids, ref_cfg),
                                       atol=1e-4)


def test_incremental_ngram_index_matches_the_scan() -> None:
    import random

    from specrl.runtime.engine.proposers.ngram import NgramProposer, ngram_lookup

    class _Engine:
        device = torch.device("cpu")
        max_batch_size = 2

    rng = random.Random(1)
    for _ in range(200):
        proposer = NgramProposer(1, 4)
        proposer.attach(_Engine())  # type: ignore[arg-type]  # the two fields attach() reads
        toks = [rng.randrange(5) for _ in range(rng.randrange(1, 6))]
        for _ in range(30):  # the sequence grows by 1..3 tokens per step, as accepted drafts append
            gamma = rng.randrange(1, 6)
            assert proposer._lookup(1, toks, gamma) == ngram_lookup(toks, 1, 4, gamma)
            toks += [rng.randrange(5) for _ in range(rng.randrange(1, 4))]
        proposer.move_slot(1, 0)
        assert proposer._lookup(0, toks, 3) == ngram_lookup(toks, 1, 4, 3) and proposer.index[1] == {}


def test_draft_length_is_capped_at_each_rows_budget(target, draft) -> None:
    engine = RolloutEngine(target, SpeculativeConfig(method="draft_model", num_speculative_tokens=6),
                           draft_model=draft, max_batch_size=2)
    params = SamplingParams(temperature=1.0, max_new_tokens=4, seed=3)
    outs = engine.generate([[1, 2, 3]], params)
    assert len(outs[0].token_ids) == 4
    # the prefill emits token 1; then at most 3 more: gamma <= 2 on the first step, and never past the budget
    assert all(r.gamma <= 2 for r in engine.stats.steps if r.method)
    assert engine.stats.draft_tokens <= 3
    # in a batch, the step's γ follows the longest budget and each row drafts at most its own
    engine.stats.reset()
    outs = engine.generate([[1, 2, 3], [4, 5]], [SamplingParams(temperature=1.0, max_new_tokens=n, seed=n)
                                                 for n in (3, 12)])
    assert [len(o.token_ids) for o in outs] == [3, 12]
    first = next(r for r in engine.stats.steps if r.method)
    assert first.gamma == 6 and first.draft_tokens <= 6 + 1


@pytest.mark.skipif(not __import__("specrl.runtime.engine.model_runner", fromlist=["native_bf16"]).native_bf16(),
                    reason="this CPU has no native bfloat16 kernels; the engine runs float32 there")
@pytest.mark.parametrize("method", PROPOSERS)
def test_bfloat16_engine_greedy_sd_equals_ar(method: str, target, draft) -> None:
    """dtype="auto" runs bfloat16 here (oneDNN pre-packed weights); speculation stays exact against plain
    decoding in the same dtype."""
    params = SamplingParams(temperature=0.0, max_new_tokens=16)
    ar_engine = RolloutEngine(target, max_batch_size=4, dtype="auto")
    assert ar_engine.runner.dtype == torch.bfloat16
    ar = ar_engine.generate(PROMPTS, params)
    sd = RolloutEngine(target, SpeculativeConfig(method=method, num_speculative_tokens=3), draft_model=draft,
                       max_batch_size=4, dtype="auto").generate(PROMPTS, params)
    assert [o.token_ids for o in sd] == [o.token_ids for o in ar]


def test_ragged_forward_reads_only_up_to_the_longest_real_row(target) -> None:
    """A right-padded row beside a long one: keys up to the longest *real* end, padding written to scratch."""
    runner = TransformerRunner(target)
    plan = runner.plan(0, [30, 0], 9, lens=[1, 9], cache_len=40)
    assert plan.kv_len == 31  # not max(starts) + width = 39
    assert plan.positions[0].tolist() == [30] + [39] * 8 and plan.positions[1].tolist() == list(range(9))
    with pytest.raises(ValueError, match="max_model_len"):
        runner.plan(0, [39, 0], 2, lens=[1, 2], cache_len=40)  # the scratch position must stay free


def test_a_catch_up_after_rows_accepted_differently_is_one_unpadded_forward(target, draft, monkeypatch) -> None:
    """Rows that accepted every draft feed the drafter two unseen tokens, the others one: every row then feeds two,
    the shorter ones from a position their cache holds, so the forward is not ragged (a padded forward takes the
    unfused path: 541 against 229 us for the benchmark's draft model at batch 8). Outputs stay the target's."""
    prompts = [PROMPTS[1], PROMPTS[0], PROMPTS[4]]
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=3)
    ar = RolloutEngine(target, max_batch_size=3).generate(prompts, [SamplingParams(temperature=0.0,
                                                                                   max_new_tokens=24)] * 3)
    engine = RolloutEngine(target, SpeculativeConfig(method="draft_model", num_speculative_tokens=3),
                           draft_model=draft, max_batch_size=3)
    drafter = engine.proposers["draft_model"]
    assert isinstance(drafter, DraftModelProposer) and drafter.runner is not None
    widths: list[tuple[int, bool]] = []  # per catch-up forward: (tokens per row, padded)
    inner = drafter.runner.forward

    def forward(cache: Any, slot0: int, starts: list[int], tokens: torch.Tensor, **kw: Any) -> Any:
        if kw.get("last_index") is not None and cache is drafter.cache and max(starts) > 0:
            widths.append((tokens.shape[1], kw.get("lens") is not None))
        return inner(cache, slot0, starts, tokens, **kw)

    monkeypatch.setattr(drafter.runner, "forward", forward)
    engine.generate(prompts, [params] * 3)
    assert any(w == 2 for w, _ in widths) and not any(padded for _, padded in widths)
    greedy = SamplingParams(temperature=0.0, max_new_tokens=24)
    assert [o.token_ids for o in engine.generate(prompts, [greedy] * 3)] == [o.token_ids for o in ar]


@pytest.mark.parametrize("method", ["draft_model", "eagle"])
def test_catch_up_of_a_late_joiner_fits_the_context(method: str, target, draft) -> None:
    """A long prompt joins beside a long-running row: the drafter's ragged catch-up forward spans both, and the
    context needs no headroom beyond max_model_len (it used to address max(starts) + widest chunk)."""
    prompts = [[1, 2, 3], [4, 5, 6], [(3 * i) % VOCAB for i in range(30)]]
    params = [SamplingParams(temperature=0.0, max_new_tokens=n) for n in (40, 30, 8)]
    ar = RolloutEngine(target, max_batch_size=2, max_model_len=48).generate(prompts, params)
    engine = RolloutEngine(target, SpeculativeConfig(method=method, num_speculative_tokens=3), draft_model=draft,
                           max_batch_size=2, max_model_len=48)
    sd = engine.generate(prompts, params)
    assert [o.token_ids for o in sd] == [o.token_ids for o in ar]
    assert [len(o.token_ids) for o in sd] == [40, 30, 8]


def test_rollout_worker_engine_dtype_follows_the_bench() -> None:
    """The rollout worker's engines resolve spec.model.dtype "auto" as the bench does (bf16 where native kernels
    exist); an explicit dtype, float32 included, is pinned."""
    from specrl.runtime.devices import decode_dtype
    from specrl.runtime.engine.model_runner import compute_dtype

    cpu = torch.device("cpu")
    assert compute_dtype(decode_dtype("auto", cpu), torch.float32, cpu) == compute_dtype("auto", torch.float32, cpu)
    for pinned in ("float32", "bfloat16", "float16"):
        assert decode_dtype(pinned, cpu) == pinned


def test_rollout_worker_context_is_prompt_plus_budget() -> None:
    from specrl.runtime.rl.tokenizer import CharTokenizer
    from specrl.runtime.rollout_worker import max_model_len

    tok = CharTokenizer()
    problems = [type("P", (), {"prompt": "1+2="})(), type("P", (), {"prompt": "12+34="})()]
    n = max_model_len(problems, tok, 16)
    assert n == len(tok.prompt_ids("12+34=")) + 16
    assert max_model_len(problems, tok, 16, model_positions=10) == 10


def test_rollout_worker_engine_holds_a_whole_step_unless_the_kv_cache_would_not_fit() -> None:
    from types import SimpleNamespace

    from specrl.runtime.rollout_worker import engine_slots

    # tiny-shaped: 2 layers x 4 heads x 32 dims, 200 positions, bf16: 51 KB a slot
    tiny = SimpleNamespace(num_attention_heads=4, num_key_value_heads=4, hidden_size=128, num_hidden_layers=2)
    assert engine_slots(384, 200, tiny, 2) == 384
    # SmolLM2-shaped (30 layers, 3 KV heads of 64) at 8192 positions in float32: ~377 MB a slot
    smol = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3, hidden_size=576, num_hidden_layers=30,
                           head_dim=64)
    per_slot = 2 * 30 * 3 * 64 * 8192 * 4
    assert engine_slots(512, 8192, smol, 4, budget=64 * per_slot) == 64
    assert engine_slots(512, 8192, smol, 4, budget=per_slot) == 16  # never below 16 concurrent sequences
    assert engine_slots(4, 8192, smol, 4) == 4

@pytest.mark.parametrize("method", ["draft_model", "ngram", "quantized_self"])
def test_acceptance_accounting_is_per_drafting_row(method: str, target, draft) -> None:
    """accepted <= drafted <= γ·rows per step; acceptance length = 1 + accepted / (rows that drafted) never exceeds
    1 + the largest γ that ran, whatever the budgets, stops and γ caps per row do (so a 7.0 reported under
    numSpeculativeTokens=3 needs a γ above 3, which the adaptive controller may pick up to maxDraftTokens)."""
    prompts = [[(i * 5 + j) % VOCAB for j in range(1 + (i * 7) % 9)] for i in range(9)]
    params = [SamplingParams(temperature=t, max_new_tokens=3 + (i * 5) % 17, seed=i, stop_token_ids=(0,))
              for i in range(9) for t in (0.0, 1.0)][:9]
    ctl = _Recorder(method)
    engine = RolloutEngine(target, SpeculativeConfig(method=method, num_speculative_tokens=3), draft_model=draft,
                           max_batch_size=3, controller=ctl)
    engine.generate(prompts, params)
    s = engine.stats
    sd = [r for r in ctl.records if r.method]
    assert sd and all(r.accepted_tokens <= r.draft_tokens <= r.gamma * r.batch_size for r in sd)
    assert all(r.tried_tokens <= r.draft_tokens and r.accepted_tokens <= r.tried_tokens for r in sd)
    assert s.draft_tokens == sum(r.draft_tokens for r in sd) and s.accepted_tokens == sum(r.accepted_tokens
                                                                                           for r in sd)
    assert sum(s.accepted_per_position) == s.accepted_tokens
    assert s.drafts <= sum(r.batch_size for r in sd)
    length = s.acceptance_length
    assert length is not None and 1.0 <= length <= 1 + max(r.gamma for r in sd)


def test_calibration_times_only_the_steps_that_ran_the_decision(target) -> None:
    """A drafter accepted every time ends a run with a plain step (every row within one token of its budget): that
    step drafted nothing and must not make drafting look free (it made the adaptive policy pick the slowest
    proposer on the long-tail bench)."""
    from specrl.runtime.engine.calibration import calibrate

    engine = RolloutEngine(target, SpeculativeConfig(method="draft_model"), draft_model=target, max_batch_size=2)
    cal = calibrate(engine, PROMPTS[:2], methods=["draft_model"], batch_sizes=(1, 2), gammas=(2, 4), steps=3,
                    rounds=1)
    assert cal.alpha["draft_model"] > 0.99  # the draft is the target: p == q, every draft accepted
    for b in (1, 2):
        assert cal.cost_model.round_cost("draft_model", 2, b) > cal.cost_model.v(b, 2)


def test_calibration_times_the_verification_at_every_draft_length(target) -> None:
    """The verify cost is measured at every γ the policy may choose, not interpolated between the two the draft
    costs are fitted from: the CPU kernels take a forward's rows in chunks, so it is a staircase in the rows."""
    from specrl.runtime.engine.calibration import calibrate

    engine = RolloutEngine(target, SpeculativeConfig(method="draft_model", extra_methods=("ngram",),
                                                     max_speculative_tokens=4),
                           draft_model=target, max_batch_size=2)
    cal = calibrate(engine, PROMPTS[:2], methods=["ngram", "draft_model"], batch_sizes=(1, 2), gammas=(2,),
                    steps=3, rounds=1)
    for b in (1, 2):
        assert sorted(cal.cost_model.verify_step[b]) == [1, 2, 3, 4, 5]  # k = γ + 1 for γ = 1..4, and the plain step
    assert set(cal.cost_model.draft_round["draft_model"][1]) == {2}  # the extra lengths time only the verification
    skipped = calibrate(engine, PROMPTS[:2], methods=["draft_model"], batch_sizes=(1,), gammas=(2,), steps=3,
                        rounds=1, verify_gammas=())
    assert sorted(skipped.cost_model.verify_step[1]) == [1, 3]


def test_calibration_times_every_verify_length_where_rows_end_apart(target, draft) -> None:
    """A drafter that disagrees with the target moves its rows at different speeds, so the last rounds of a run
    draft less on the rows near their token budget. Those rounds neither time the drafter nor keep it from timing
    the verification at every length (at batch 4 and up nearly every run ended so, and only the two lengths every
    proposer ran were timed)."""
    from specrl.runtime.engine.calibration import calibrate

    engine = RolloutEngine(target, SpeculativeConfig(method="draft_model", max_speculative_tokens=4),
                           draft_model=draft, max_batch_size=4)
    cal = calibrate(engine, PROMPTS[:4], methods=["draft_model"], batch_sizes=(4,), gammas=(2,), steps=6, rounds=1)
    assert sorted(cal.cost_model.verify_step[4]) == [1, 2, 3, 4, 5]


def test_calibration_times_every_verify_length_after_one_proposer() -> None:
    """A forward costs more after a drafter that streams memory of its own, so the verify lengths come from one
    proposer's rounds: pooled over every proposer, the lengths all of them ran were timed after the free n-gram
    drafting and made a dip in the costs that the policy's estimates spread to every other length."""
    from specrl.runtime.engine.calibration import _verify_lengths

    verify = {("ngram", 2): {3: [1.0, 1.1], 7: [2.0]},
              ("draft_model", 2): {3: [1.3, 1.2, 1.4], 4: [1.6], 7: [2.5]},
              ("eagle", 2): {9: [3.0]}}
    methods = ["draft_model", "ngram", "eagle"]
    assert _verify_lengths(verify, methods, 2, "draft_model") == {3: 1.2, 4: 1.6, 7: 2.5, 9: 3.0}
    assert _verify_lengths(verify, methods, 2, None) == {3: 1.1, 4: 1.6, 7: 2.0, 9: 3.0}  # no full drafter: pooled
    assert _verify_lengths(verify, methods, 4, "draft_model") == {}


@pytest.mark.parametrize("method", ["none", "draft_model", "ngram"])
@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_one_host_transfer_per_decode_step(method: str, temperature: float, target, draft,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Every decode step (AR or speculative, greedy or sampled) reads device data on the host exactly once: on an
    accelerator each read is a synchronisation, and at small batch they would cost more than the math."""
    reads: list[str] = []
    for name in ("tolist", "item", "__bool__", "__int__", "__float__", "__index__", "numpy"):
        original = getattr(torch.Tensor, name)

        def counted(self: torch.Tensor, *a: object, _original: Any = original, _name: str = name, **k: object) -> Any:
            reads.append(_name)
            return _original(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, name, counted)

    per_step: list[int] = []

    class Counting(FixedController):
        def decide(self, active_batch_size: int) -> Decision:
            reads.clear()
            return super().decide(active_batch_size)

        def observe(self, decision: Decision, record: StepRecord) -> None:
            per_step.append(len(reads))

    engine = RolloutEngine(target, SpeculativeConfig(method=method, num_speculative_tokens=3),
                           draft_model=draft if method == "draft_model" else None, max_batch_size=3,
                           controller=Counting(None if method == "none" else method, 3))
    prompts = [[1, 2, 3, 1, 2], [4, 5], [6, 7, 6, 7, 6]]
    engine.generate(prompts, SamplingParams(temperature=temperature, max_new_tokens=12, seed=1))
    assert per_step and set(per_step) == {1}, per_step


@pytest.mark.skipif(__import__("specrl.runtime.engine.model_runner", fromlist=["native_bf16"]).native_bf16(),
                    reason="CPUs with native bf16 keep F.linear for float32 (only the lossless checks' reference)")
def test_float32_dense_rows_do_not_depend_on_the_row_count() -> None:
    # On CPUs without native bf16 the engine runs float32 through `Dense`: a row must come out bit-identical alone
    # and in a batch of any size, else a verification computes a token differently from the plain step it replaces.
    from specrl.runtime.engine.model_runner import Dense

    torch.manual_seed(0)
    for k, n in ((64, 128), (128, 384), (512, 1536)):
        dense = Dense(torch.randn(n, k), torch.randn(n))
        x = torch.randn(40, k)
        alone = torch.cat([dense(x[i:i + 1]) for i in range(40)])
        for m in (2, 3, 5, 16, 40):
            assert torch.equal(dense(x[:m]), alone[:m]), (k, n, m)


def test_acceptance_counts_only_drafts_inside_the_text() -> None:
    # A drafter identical to the target agrees with it past a stop token too; those drafts are no text and must
    # not count as accepted (the policy weighs where texts end through `StepRecord.stopped` instead). Per row,
    # accepted drafts are its emitted tokens less the bonus, or all of them when it stopped on an accepted draft.
    target, same = make_model(seed=5), make_model(seed=5)
    engine = RolloutEngine(target, SpeculativeConfig(method="draft_model", num_speculative_tokens=6),
                           draft_model=same, max_batch_size=4)
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(24)]
    outs = engine.generate(prompts, [SamplingParams(temperature=1.0, max_new_tokens=30, stop_token_ids=(3,),
                                                    seed=i) for i in range(24)])
    steps = [r for r in engine.stats.steps if r.method]
    for r in steps:
        assert r.emitted_tokens - r.batch_size <= r.accepted_tokens <= r.emitted_tokens - r.batch_size + r.stopped
        assert sum(r.tested_at) == r.tried_tokens and sum(r.accepted_at) == r.accepted_tokens
    # every stop after the prefill's first token is counted once, by the step that emitted it
    assert sum(r.stopped for r in engine.stats.steps) == sum(
        1 for o in outs if o.finish_reason == "stop" and len(o.token_ids) > 1) > 0
    # the same weights: every draft tested inside the text is accepted
    assert sum(r.accepted_tokens for r in steps) == sum(r.tried_tokens for r in steps) > 0
