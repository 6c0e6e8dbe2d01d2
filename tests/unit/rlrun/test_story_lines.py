"""The local run's closing lines (`local.story_lines`): what a user reads after `specrl run`."""

from specrl.runtime.local import story_lines


def _summary(speculative_steps: int) -> dict:
    return {"sd_rollout_speedup": 0.95, "sd_rollout_speedups": [0.94, 0.95, 0.96],
            "sd_rollout_speedup_interval": {"low": 0.94, "median": 0.95, "high": 0.96},
            "sd_rollout_seconds": 0.11, "ar_rollout_seconds": 0.105, "sd_rollout_decode_steps": 148,
            "sd_rollout_speculative_steps": speculative_steps,
            "sd_policy_at_batch_1": {"ngram": [0.41, 1], "draft_model": [0.87, 3]}}


def test_a_comparison_without_speculation_says_why_with_the_policys_best_prediction():
    lines = story_lines(_summary(0))
    assert any("0.95x [0.94, 0.96]" in line and "speculating in 0 of 148" in line for line in lines)
    (why,) = [line for line in lines if "never paid" in line]
    assert "draft_model (γ=3) at 0.87x plain decoding" in why  # the best of the proposers, not the first


def test_a_comparison_that_speculated_adds_no_excuse():
    assert not any("never paid" in line for line in story_lines(_summary(12)))
    no_policy = _summary(0)
    del no_policy["sd_policy_at_batch_1"]  # a fixed configuration: no predictions to quote
    assert not any("never paid" in line for line in story_lines(no_policy))
