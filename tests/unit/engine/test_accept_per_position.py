"""Per-position acceptance counts (vLLM's spec_decode_num_accepted_tokens_per_pos) add up to the accepted total."""

from __future__ import annotations

import itertools

from specrl.runtime.engine import RolloutEngine, SamplingParams, SpeculativeConfig
from specrl.runtime.engine.control import FixedController
from specrl.runtime.rollout_worker import stats_snapshot


def test_accepted_per_position_sums_to_accepted_tokens(target, draft) -> None:
    engine = RolloutEngine(target, SpeculativeConfig(method="draft_model", num_speculative_tokens=3),
                           draft_model=draft, max_batch_size=4)
    engine.generate([[1, 2, 3], [4, 5, 6, 7], [5]], SamplingParams(temperature=1.0, max_new_tokens=24, seed=0))
    per_pos = engine.stats.accepted_per_position
    assert sum(per_pos) == engine.stats.accepted_tokens > 0
    assert len(per_pos) <= 3 and all(a >= b for a, b in itertools.pairwise(per_pos))  # depth i needs depth i-1
    assert per_pos[0] <= engine.stats.drafts
    snap = stats_snapshot(engine.stats)
    assert [snap[f"accepted_tokens_pos_{i}"] for i in range(len(per_pos))] == [float(n) for n in per_pos]


def test_step_records_count_tested_and_accepted_drafts_per_position(target, draft) -> None:
    # what the adaptive policy estimates acceptance per position from: position j is tested only by rows that
    # accepted every draft before it, and its counts add up to the step's totals
    controller = FixedController("draft_model", 4, clock="wall")
    engine = RolloutEngine(target, SpeculativeConfig(method="draft_model", num_speculative_tokens=4),
                           draft_model=draft, max_batch_size=4, controller=controller)
    engine.generate([[1, 2, 3], [4, 5, 6, 7], [5], [2, 2]], SamplingParams(temperature=1.0, max_new_tokens=30, seed=1))
    sd = [r for r in controller.records or [] if r.gamma > 0]
    assert sd and any(0 < sum(r.accepted_at) < sum(r.tested_at) for r in sd)
    for r in sd:
        assert len(r.tested_at) == len(r.accepted_at) == r.gamma
        assert sum(r.tested_at) == r.tried_tokens and sum(r.accepted_at) == r.accepted_tokens
        assert r.tested_at[0] <= r.batch_size
        assert all(a <= t for a, t in zip(r.accepted_at, r.tested_at))
        assert all(later <= a for a, later in zip(r.accepted_at, r.tested_at[1:]))
