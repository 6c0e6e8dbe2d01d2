"""`specrl bench sync --quick --json FILE` end to end (two real processes, real sockets, real gloo)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.integration


def test_bench_sync_quick_writes_the_keys(tmp_path: Path) -> None:
    out = tmp_path / "sync.json"
    proc = subprocess.run([sys.executable, "-m", "specrl.runtime.cli", "bench", "sync", "--quick", "--repeats", "2",
                           "--json", str(out)], check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads(out.read_text())
    for key in ("bytes", "seconds", "gbps", "loopback_gbps", "fraction_of_loopback", "buckets", "bucket_mib",
                "repeats", "samples", "loopback_samples", "configs", "packed_fraction_of_loopback"):
        assert key in result, key
    assert result["verified"] is True and result["repeats"] == 2 and len(result["samples"]) == 2
    assert result["bytes"] > 40e6 and result["gbps"] > 0 and result["loopback_gbps"] > 0
    assert result["fraction_of_loopback"] == pytest.approx(result["gbps"] / result["loopback_gbps"], rel=1e-6)
    assert {c["mode"] for c in result["configs"]} == {"packed", "zero-copy"}
    assert all(v > 0 for c in result["configs"] for v in c["cpu_s_per_gb"].values())
    assert "sync/TCP" in proc.stdout  # the table


def test_bench_sync_rejects_bad_repeats() -> None:
    proc = subprocess.run([sys.executable, "-m", "specrl.runtime.cli", "bench", "sync", "--repeats", "0"],
                          check=False, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "argument --repeats: must be >= 1, got 0" in proc.stderr and "Traceback" not in proc.stderr
