"""Fixtures shared by every test folder; the Kubernetes ones are documented in tests/kube/__init__.py.

Imports of the toolchain are lazy so that pure unit tests do not pay for kmock, cel or jsonschema.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from tests.kube.kubectl import Kubectl
    from tests.kube.server import KubeServer

REPO_ROOT = Path(__file__).resolve().parents[1]


def pytest_configure(config: pytest.Config) -> None:
    # Hypothesis times each example against 200 ms by default: a wall-clock bound a loaded 2-core CI machine
    # breaks on pure functions. No property test here is about speed.
    try:
        from hypothesis import settings
    except ImportError:  # the operator-only environment
        return
    settings.register_profile("specrl", deadline=None)
    settings.load_profile("specrl")


@pytest.fixture
def repo_root() -> Path:
    return REPO_ROOT


@pytest.fixture
def kube() -> Iterator[KubeServer]:
    """The emulated API server with the RLJob CRD installed; fresh for every test."""
    from tests.kube.server import KubeServer

    server = KubeServer().start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def kubeconfig(kube: KubeServer, tmp_path: Path) -> Path:
    return kube.write_kubeconfig(tmp_path / "kubeconfig")


@pytest.fixture
def kube_env(kubeconfig: Path, tmp_path: Path) -> dict[str, str]:
    from tests.kube.kubectl import kube_env as make_env

    return make_env(kubeconfig, tmp_path / "kubectl-cache")


@pytest.fixture
def kubectl(kube_env: dict[str, str]) -> Kubectl:
    from tests.kube.kubectl import Kubectl

    return Kubectl(kube_env, cwd=REPO_ROOT)
