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
    json.dumps(result, default=str)


def test_bench_policy_cli(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from specrl.runtime.cli import main

    out = tmp_path / "policy.json"
    assert main(["bench", "policy", "--quick", "--ring", "--by-batch", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["ring"] and len(result["rows"]) > 5 and "shadow" in result["rows"]
    printed = capsys.readouterr().out
    assert "vs γ=6" in printed and "per batch size" in printed and result["by_batch"]
