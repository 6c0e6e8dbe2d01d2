"""`specrl bench policy`: the adaptive policy and its shadow beside fixed γ=6 on the long-tail workload."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("transformers")


def test_bench_policy_quick_runs_the_shadow_as_gamma_6(tmp_path: Path) -> None:
    from specrl.runtime.bench.policy import run

    seen: list[str] = []
    result = run(True, 2, ring=False, serving=True, progress=seen.append, advance=lambda: None)
    rows = result["rows"]
    assert list(rows) == ["ar", "draft_model-g4", "draft_model-g6", "adaptive", "shadow"]
    assert rows["draft_model-g6"]["vs_reference"] == 1.0 and rows["draft_model-g6"]["vs_reference_per_repeat"] == [1.0, 1.0]
    # the shadow decodes γ=6 at every step, so it samples γ=6's very texts; the policy beside it costs CPU time
    assert rows["shadow"]["tokens"] == rows["draft_model-g6"]["tokens"]
    assert rows["shadow"]["policy_us_per_step"] > rows["draft_model-g6"]["policy_us_per_step"]
    assert rows["adaptive"]["policy_us_per_step"] > 0 and 0 < rows["adaptive"]["policy_cpu_share"] < 1
    assert all(len(r["vs_reference_by_bucket"]) == len(result["buckets"]) for r in rows.values())
    assert any("serving shape" in s for s in seen) and result["serving"] and not result["ring"]
    # per batch size: what each learner chose there adds up to the decode steps its runs timed there
    sizes = [row["batch_size"] for row in result["by_batch"]]
    assert sizes == sorted(sizes) and sizes[0] == 1
    for row in result["by_batch"]:
        assert set(row["tokens_per_cpu_s"]) == set(rows)
        for name in ("adaptive", "shadow"):
            assert sum(row["chosen"][name].values()) == row["steps"][name]
            assert (row["policy_us_per_step"][name] is None) == (row["steps"][name] == 0)
    assert sum(row["steps"]["adaptive"] for row in result["by_batch"]) > 0
    # and what each policy believes there at the end: plain decoding at 1.0 in its table, a cost for every length
    for row in result["by_batch"]:
        for name in ("adaptive", "shadow"):
            believed = row["estimates_at_end"][name]
            assert believed["table"]["ar"] == [1.0, 0] and believed["plain_ms"] > 0
            assert sorted(believed["verify_vs_plain"]) == list(range(1, 9))
    # the calibration beside the long tail's own steps: every batch size the plain runs timed three times, each
    # verification the draft model's fixed γ ran there in full rounds
    compared = result["calibration_vs_run"]
    assert compared and all(row["plain_ms"]["calibration"] > 0 and row["plain_ms"]["run"] > 0 for row in compared)
    assert all(sorted(row["verify_vs_plain"]) == [4, 6] for row in compared)
    timed = [v for row in compared for v in row["verify_vs_plain"].values() if v["run"] is not None]
    assert timed and all(v["samples"] >= 3 and v["run"] > 0 for v in timed)
    json.dumps(result, default=str)


def test_calibration_vs_run_reads_whole_forwards_against_the_plain_step() -> None:
    from specrl.runtime.bench.policy import calibration_vs_run
    from specrl.runtime.bench.rollout import RunResult, forward_tokens
    from specrl.runtime.engine.control import StepRecord
    from specrl.runtime.engine.cost_model import CostModel

    def rec(gamma: int, drafted: int) -> StepRecord:
        return StepRecord(step=0, method="draft_model" if gamma else None, gamma=gamma, batch_size=4,
                          draft_tokens=drafted, accepted_tokens=0, emitted_tokens=4, seconds=1.0, draft_seconds=0.1,
                          target_seconds=0.9)

    # a round some row drafted less in is a shorter forward: left out, as the calibration leaves it out
    assert [forward_tokens(rec(0, 0)), forward_tokens(rec(2, 8)), forward_tokens(rec(2, 7))] == [1, 3, 0]

    def result(forwards: dict[tuple[int, int], list[float]]) -> RunResult:
        return RunResult(tokens=1, seconds=1.0, cpu_seconds=1.0, acceptance_length=None, forwards_per_token=1.0,
                         tail_seconds=0.0, forwards=forwards)

    runs = {"ar": [result({(4, 1): [2e-3, 2e-3, 2e-3, 9e-3]}), result({(4, 1): [2e-3]})],
            "draft_model-g2": [result({(4, 3): [3e-3] * 3})], "draft_model-g4": [result({(4, 5): [5e-3] * 2})]}
    costs = CostModel(target_step={4: 1e-3}, verify_step={4: {3: 2e-3, 5: 3e-3}})
    [row] = calibration_vs_run(costs, runs, {"ar": (None, 0), "draft_model-g2": ("draft_model", 2),
                                             "draft_model-g4": ("draft_model", 4)})
    assert row["batch_size"] == 4 and row["plain_ms"] == {"calibration": 1.0, "run": 2.0, "samples": 5}
    assert row["verify_vs_plain"][2] == {"calibration": 2.0, "samples": 3, "run": 1.5}
    assert row["verify_vs_plain"][4] == {"calibration": 3.0, "samples": 2, "run": None}  # too few to read


def test_bench_policy_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from specrl.runtime.cli import main

    out = tmp_path / "policy.json"
    assert main(["bench", "policy", "--quick", "--ring", "--by-batch", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["ring"] and len(result["rows"]) > 5 and "shadow" in result["rows"]
    printed = capsys.readouterr().out
    assert "vs γ=6" in printed and "per batch size" in printed and result["by_batch"]
    assert "calibration vs the long tail" in printed and result["calibration_vs_run"]
