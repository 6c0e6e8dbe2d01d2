"""`specrl bench prefetch` measures the engine's one-row prefetch choice on the real checkpoint cut to N layers."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from specrl.runtime.bench.prefetch import layer_counts, verdict
from specrl.runtime.cli import main
from specrl.runtime.engine import cpu_kernels

from .conftest import SMOLLM2


def test_layer_counts_name_the_cut_or_say_which_entry_is_wrong() -> None:
    assert layer_counts(None, 30, quick=False) == [1, 3, 5, 7, 9, 11, 14, 18, 30]
    assert layer_counts(None, 6, quick=False) == [1, 3, 5, 6]
    assert layer_counts(None, 30, quick=True) == [1, 2]
    assert layer_counts("all, 4,4,1", 30, quick=False) == [1, 4, 30]
    for bad in ("0", "31", "x", "", "2,-1"):
        with pytest.raises(ValueError, match="--layers: .* from 1 to 30"):
            layer_counts(bad, 30, quick=False)


def test_the_verdict_reads_the_interval_not_the_median() -> None:
    faster = {"geomean": 1.03, "low": 1.01, "high": 1.05}
    slower = {"geomean": 0.97, "low": 0.95, "high": 0.99}
    either = {"geomean": 1.02, "low": 0.99, "high": 1.05}
    assert verdict(8192, faster) == "agrees" and verdict(0, faster) == "disagrees"
    assert verdict(0, slower) == "agrees" and verdict(8192, slower) == "disagrees"
    assert verdict(8192, either) == verdict(0, either) == verdict(0, None) == "tie"


@pytest.mark.slow
@pytest.mark.skipif(cpu_kernels.load() is None, reason="no bfloat16 kernels on this CPU: nothing prefetches")
def test_quick_prefetch_bench_on_the_real_checkpoint(tmp_path: Path, smollm2_path: Path) -> None:
    out = tmp_path / "prefetch.json"
    assert main(["bench", "prefetch", "--quick", "--model", SMOLLM2, "--json", str(out)]) == 0
    r = json.loads(out.read_text())
    assert r["model"] == SMOLLM2 and r["depth"] == 30 and r["rounds"] == 2
    one, two = r["sizes"]
    assert (one["layers"], two["layers"]) == (1, 2)
    # a layer more streams one layer's weights more; the engine's choice is the one its size calls for
    assert 0 < one["weight_bytes"] < two["weight_bytes"]
    for row in r["sizes"]:
        assert row["chosen"] == list(cpu_kernels.prefetch_distance(row["weight_bytes"]))
        assert all(len(v) == 2 and min(v) > 0 for v in row["per_round"].values())
        assert row["verdict"] == verdict(row["chosen"][0], row["one_row_vs_none"])
    # an entry past the model's depth: one line naming the option, exit 2
    assert main(["bench", "prefetch", "--quick", "--layers", "31"]) == 2
