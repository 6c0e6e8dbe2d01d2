"""Each distinct prompt of an admission is prefilled once and its K/V copied into its repeats' slots (GRPO asks for
every prompt groupSize times): the outputs are those of a prefill per request."""

from __future__ import annotations

import pytest
import torch
from specrl.runtime.engine import RolloutEngine, SamplingParams, SpeculativeConfig

from .conftest import VOCAB, make_model


def _requests() -> tuple[list[list[int]], list[SamplingParams]]:
    groups = [[1, 5, 3], [2, 7, 7, 4, 9, 1], [3], [1, 5, 3, 8]]  # a prefix of another prompt is not a repeat
    prompts = [list(p) for p in groups for _ in range(3)] + [[6, 6, 2]]
    assert max(max(p) for p in prompts) < VOCAB
    params = [SamplingParams(temperature=0.0 if i % 5 == 0 else 1.0, max_new_tokens=6 + i % 7, seed=100 + i,
                             stop_token_ids=(0,)) for i in range(len(prompts))]
    return prompts, params


@pytest.mark.parametrize("method", ["none", "ngram", "draft_model"])
@pytest.mark.parametrize("max_batch", [4, 16])  # admissions in waves, and all at once
def test_shared_prefill_gives_the_outputs_of_a_prefill_per_request(method: str, max_batch: int,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    target, draft = make_model(seed=0), make_model(layers=1, seed=1)
    prompts, params = _requests()
    outs = {}
    prefilled = {}
    for share in (False, True):
        engine = RolloutEngine(target, SpeculativeConfig(method=method, num_speculative_tokens=3),
                               draft_model=draft if method == "draft_model" else None, max_batch_size=max_batch,
                               share_prefill=share)
        rows: list[int] = []
        forward = engine.runner.forward

        def counting(cache, slot0, starts, tokens, *args, _forward=forward, _rows=rows, **kwargs):
            if kwargs.get("last_index") is not None:  # a prefill
                _rows.append(tokens.shape[0])
            return _forward(cache, slot0, starts, tokens, *args, **kwargs)

        monkeypatch.setattr(engine.runner, "forward", counting)
        outs[share] = engine.generate(prompts, params)
        prefilled[share] = sum(rows)
    assert prefilled[False] == len(prompts)
    # all at once: 5 distinct prompts; with 4 slots, repeats are shared only within one admission
    assert prefilled[True] == 5 if max_batch == 16 else 5 <= prefilled[True] < len(prompts)
    for a, b in zip(outs[False], outs[True]):
        assert a.request_id == b.request_id and a.prompt_token_ids == b.prompt_token_ids
        assert a.token_ids == b.token_ids and a.finish_reason == b.finish_reason
        assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)


def test_prefill_rows_put_one_of_each_prompt_first() -> None:
    from specrl.runtime.engine.engine import _Seq

    seqs = [_Seq(i, list(p), len(p), SamplingParams(), torch.Generator()) for i, p in
            enumerate([[1, 2], [3], [1, 2], [3], [4]])]
    assert RolloutEngine._prefill_rows(seqs[-1:] + seqs[1:2]) is None  # all distinct
    served = RolloutEngine._prefill_rows(seqs)
    assert served is not None
    order, rows = served
    assert order == [0, 1, 4, 2, 3] and rows == [0, 1, 2, 0, 1]
    assert all(seqs[order[k]].tokens == seqs[order[rows[k]]].tokens for k in range(len(order)))
