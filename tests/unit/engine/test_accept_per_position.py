"""Per-position acceptance counts (vLLM's spec_decode_num_accepted_tokens_per_pos) add up to the accepted total."""

from __future__ import annotations

import itertools

from specrl.runtime.engine import RolloutEngine, SamplingParams, SpeculativeConfig
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
