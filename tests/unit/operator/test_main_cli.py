"""`specrl operator` refuses bad set-ups with one clear line (kopf would retry forever): exit 1 for a bad
environment, 2 for a bad command line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

SPECRL = str(Path(sys.executable).parent / "specrl")


@pytest.mark.parametrize("setup,expected,code", [
    ("missing", "cannot read kubeconfig", 1),
    ("bad-yaml", "is not valid YAML", 1),
    ("no-clusters", "defines no clusters", 1),
    ("bad-template", "--coordinator-url-template", 2),
])
def test_operator_rejects_bad_setups(tmp_path: Path, setup: str, expected: str, code: int):
    kc = tmp_path / "kubeconfig"
    args = [SPECRL, "operator", "--metrics-port", "0", "--health-port", "0"]
    if setup == "bad-yaml":
        kc.write_text("a: [")
    elif setup == "no-clusters":
        kc.write_text("apiVersion: v1\nkind: Config\n")
    elif setup == "bad-template":
        kc.write_text("clusters: [{name: x, cluster: {server: 'http://127.0.0.1:1'}}]\n")
        args += ["--coordinator-url-template", "http://{job}.svc"]
    proc = subprocess.run(args, env={"KUBECONFIG": str(kc), "HOME": str(tmp_path), "PATH": "/usr/bin:/bin"},
                          capture_output=True, text=True, timeout=60, check=False)
    assert proc.returncode == code, proc.stderr
    assert expected in proc.stderr and "Traceback" not in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1
