"""`specrl run` of examples/tiny-local.yaml, shortened and on the micro policy: what the summary, the story and
the plots report (the held-out comparison with its interval and test, the long tail, SD vs plain decoding).

The numbers themselves (a gain, a speedup) belong to `make run` and the README, not to a timed test: here the
micro policy learns nothing in three steps, and the test checks that every measurement is made and consistent.
About 1 min at the load average of ~14 measured here (2 shared cores).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO = Path(__file__).resolve().parents[3]


def test_shortened_tiny_local_reports_the_story(local_ray, micro, tmp_path, capsys):
    from specrl.runtime.local import HELDOUT_SAMPLES, load_settings, run_job

    policy, _draft = micro
    _job, settings = load_settings(str(REPO / "examples" / "tiny-local.yaml"), steps=3)
    assert settings.method == "ngram" and settings.dataset_size >= 1000  # the job the README describes
    # Fixed speculation: the adaptive toggle may rightly keep the micro policy on plain decoding, and the
    # acceptance figures need speculative steps to report.
    settings = settings.replace(model=str(policy), prompts_per_step=4, group_size=4, max_new_tokens=24, eval_size=8,
                                eval_every=0, adaptive=False)
    summary = run_job(settings, tmp_path, progress=False)

    on_disk = json.loads((tmp_path / "summary.json").read_text())
    assert on_disk["steps"] == 3 and on_disk["prompts_lost"] == 0

    # held-out: the same seeded samples before and after, with intervals and a paired test
    h = on_disk["heldout"]
    assert h["n"] == 8 * HELDOUT_SAMPLES == on_disk["eval_samples"]
    assert h["problems"] == 8 and h["samples_per_problem"] == HELDOUT_SAMPLES
    assert h["temperature"] == settings.temperature
    for key in ("before", "after"):
        lo, hi = h[f"{key}_ci"]
        assert 0.0 <= lo <= h[key] <= hi <= 1.0
    lo, hi = h["difference_ci"]
    assert lo <= h["difference"] <= hi
    assert h["difference"] == pytest.approx((h["gained"] - h["lost"]) / h["n"])
    assert h["difference"] == pytest.approx(h["after"] - h["before"])
    assert 0.0 < h["p_value"] <= 1.0
    assert on_disk["accuracy_start"] == h["before"] and on_disk["accuracy_end"] == h["after"]
    # per difficulty: the levels of the job's mix that the 8 held-out problems drew, adding up to the whole
    by = h["by_difficulty"]
    assert set(by) <= set(settings.difficulty or {}) and sum(v["n"] for v in by.values()) == h["n"]
    assert sum(v["after"] * v["n"] for v in by.values()) == pytest.approx(h["after"] * h["n"])
    g = on_disk["greedy_heldout"]  # greedy: the same problems pair up exactly
    assert g["n"] == g["problems"] == 8 == on_disk["eval_problems"]
    assert (g["before"], g["after"]) == (on_disk["greedy_accuracy_start"], on_disk["greedy_accuracy_end"])
    assert g["difference"] == pytest.approx((g["gained"] - g["lost"]) / g["n"]) and 0.0 < g["p_value"] <= 1.0

    # the long tail: overall and per step, from the rollouts themselves
    rl = on_disk["response_length"]
    assert 1 <= rl["median"] <= rl["p95"] <= rl["max"] <= settings.max_new_tokens
    assert rl["tail_ratio"] == pytest.approx(rl["p95"] / rl["median"])
    for key in ("median", "p95", "max"):
        assert len(on_disk[f"response_length_{key}_per_step"]) == 3

    # speculation vs plain decoding side by side, and what it means for the whole step
    pairs = on_disk["sd_rollout_speedups"]
    assert on_disk["sd_rollout_speedup"] > 0 and 5 <= len(pairs) <= 41
    ci = on_disk["sd_rollout_speedup_interval"]  # the median of the pairs and its 90% interval
    assert min(pairs) <= ci["low"] <= ci["median"] == on_disk["sd_rollout_speedup"] <= ci["high"] <= max(pairs)
    assert on_disk["sd_rollout_acceptance_length"] >= 1.0
    assert 0 <= on_disk["sd_rollout_speculative_steps"] <= on_disk["sd_rollout_decode_steps"] > 0
    assert on_disk["greedy_sd_equals_ar"] is True
    assert 0.0 < on_disk["rollout_share"] < 1.0
    assert on_disk["step_seconds_sd_off_projected"] > 0 and on_disk["step_seconds_sd_on"] > 0
    assert len(on_disk["acceptance_length_per_step"]) == len(on_disk["sd_share_per_step"]) == 3

    # the user sees the same story: the printed lines and the plots
    out = capsys.readouterr().out
    assert "held-out accuracy" in out and "McNemar p=" in out and "greedy held-out accuracy" in out
    assert "p95" in out and "speculative vs plain decoding" in out and "rollout share" in out
    assert f"{on_disk['sd_rollout_speedup']:.2f}x [{ci['low']:.2f}, {ci['high']:.2f}]  ({len(pairs)} pairs" in out
    assert f"speculating in {on_disk['sd_rollout_speculative_steps']} of {on_disk['sd_rollout_decode_steps']}" in out
    for name in ("overview", "reward_accuracy", "response_lengths", "decode_timeline", "acceptance",
                 "time_breakdown"):
        assert (tmp_path / f"{name}.png").stat().st_size > 5_000, name
    assert summary["heldout"] == h
