"""`specrl bench rollout --quick --model builtin:smollm2-135m` runs end to end on the real checkpoint and reports
what the targets are computed from: the roofline, the best native speculation (fixed or adaptive) against plain
decoding and against transformers' assisted generation."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from specrl.runtime.cli import main

from .conftest import SMOLLM2


@pytest.mark.slow
def test_quick_real_model_bench(tmp_path: Path, smollm2_path: Path) -> None:
    out = tmp_path / "bench.json"
    assert main(["bench", "rollout", "--quick", "--model", SMOLLM2, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    rows = r["engine"]
    assert [row["batch_size"] for row in rows] == [1, 2]
    bs1 = rows[0]
    assert bs1["tokens_per_s"]["plain"] > 0 and bs1["best_sd"] not in ("plain", "adaptive")
    best = r["best_native_sd_bs1"]
    # the best native speculation is the fastest of the fixed configurations and the adaptive policy
    native = {n: v for n, v in bs1["tokens_per_s"].items() if n != "plain"}
    assert best["config"] == max(native, key=lambda n: native[n]) and best["tokens_per_s"] == native[best["config"]]
    assert best["vs_plain"] == pytest.approx(native[best["config"]] / bs1["tokens_per_s"]["plain"])
    assert r["targets"]["best_sd_vs_engine_plain_bs1"]["value"] == best["vs_plain"]
    assert r["targets"]["best_sd_vs_hf_assisted_bs1"]["value"] == pytest.approx(
        best["tokens_per_s"] / r["hf_bs1_tokens_per_s"]["assisted_int8"])
    assert 0 < r["targets"]["roofline_fraction_bs1"]["value"] < 1.5
    assert len(r["roofline"]["fraction_per_run"]) == r["repeats"]  # one per plain batch-1 run
    assert r["model"]["name"] == SMOLLM2 and r["workload"]["chat_template"] is True
