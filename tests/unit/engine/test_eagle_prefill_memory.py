"""EAGLE prefill computes the LM head at the last prompt position only (hidden states everywhere)."""

from __future__ import annotations

import pytest
import torch
from specrl.runtime.engine import RolloutEngine, SamplingParams, SpeculativeConfig

from .conftest import make_model


def test_runner_all_hidden_matches_the_full_forward() -> None:
    engine = RolloutEngine(make_model(), speculative=SpeculativeConfig(method="none"))
    runner = engine.runner
    tokens = torch.randint(1, 16, (2, 7))
    last = torch.tensor([6, 3])
    full_logits, full_hidden = runner.forward(runner.new_cache(2, 16), 0, [0, 0], tokens)
    logits, hidden = runner.forward(runner.new_cache(2, 16), 0, [0, 0], tokens, last_index=last, all_hidden=True)
    assert logits.shape == (2, full_logits.shape[-1]) and hidden.shape == full_hidden.shape
    torch.testing.assert_close(logits, full_logits[torch.arange(2), last])
    torch.testing.assert_close(hidden, full_hidden)


def test_eagle_prefill_never_materialises_per_position_logits(monkeypatch: pytest.MonkeyPatch) -> None:
    engine = RolloutEngine(make_model(), speculative=SpeculativeConfig(method="eagle", num_speculative_tokens=3))
    rows: list[int] = []
    head = engine.runner.lm_head

    def counting_head(h: torch.Tensor) -> torch.Tensor:
        rows.append(h.numel() // h.shape[-1])
        return head(h)

    monkeypatch.setattr(engine.runner, "lm_head", counting_head)
    prompts = [[1 + i % 15 for i in range(30)], [1 + (3 * i) % 15 for i in range(20)]]  # 30- and 20-token prompts, batched in one prefill
    outs = engine.generate(prompts, SamplingParams(temperature=0.0, max_new_tokens=4, seed=0))
    assert all(len(o.token_ids) == 4 for o in outs)
    # prefill: 2 rows (one per prompt), never 2 x 30; verification: at most batch x (gamma + 1)
    assert rows and max(rows) <= 2 * (3 + 1), rows
