"""The `helm test` hook script, as the chart ships it, against the emulator and a real `specrl operator`.

In a cluster the hook pod reaches the API server with its ServiceAccount; here the same script falls back to
$KUBECONFIG (the emulator) and checks the live operator's /healthz on a local port.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.integration.chart.chart_support import by_kind, free_port, helm_template, start_operator, stop

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def script(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The script exactly as rendered into the hook ConfigMap."""
    (cm,) = [d for d in by_kind(helm_template(None), "ConfigMap") if d["metadata"]["name"].endswith("-test")]
    path = tmp_path_factory.mktemp("hook") / "helm-test.py"
    path.write_text(cm["data"]["helm-test.py"])
    return path


def run_hook(script: Path, kubeconfig: Path, health_url: str, timeout: str = "20") -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("KUBERNETES_SERVICE")}
    env |= {"KUBECONFIG": str(kubeconfig), "SPECRL_TEST_CRD": "rljobs.specrl.io",
            "SPECRL_TEST_HEALTH_URL": health_url, "SPECRL_TEST_TIMEOUT": timeout}
    return subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=120,
                          check=False)


def test_hook_passes_against_a_live_operator(kube, script: Path, tmp_path: Path) -> None:
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
    op = start_operator(kubeconfig, tmp_path / "operator.log")
    try:
        out = run_hook(script, kubeconfig, op.health_url)
    finally:
        stop(op.proc)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "ok: CRD rljobs.specrl.io is Established" in out.stdout
    assert f"ok: operator is live ({op.health_url} -> 200)" in out.stdout


def test_hook_fails_when_the_operator_is_down(kube, script: Path, tmp_path: Path) -> None:
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
    url = f"http://127.0.0.1:{free_port()}/healthz"
    out = run_hook(script, kubeconfig, url, timeout="1")
    assert out.returncode == 1
    assert "ok: CRD rljobs.specrl.io is Established" in out.stdout
    assert f"FAIL: operator liveness {url} unreachable" in out.stderr


def test_hook_fails_without_the_crd(script: Path, tmp_path: Path) -> None:
    from tests.kube.server import KubeServer

    with KubeServer(crds=[]) as kube:
        kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
        out = run_hook(script, kubeconfig, f"http://127.0.0.1:{free_port()}/healthz", timeout="1")
    assert out.returncode == 1
    assert "FAIL: CRD rljobs.specrl.io not found" in out.stderr
