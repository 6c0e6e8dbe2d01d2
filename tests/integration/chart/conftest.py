"""Fixtures of the chart tests. The helpers live in chart_support.py next to this file."""

from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
# tests/kube (the foundation's emulator) is imported as `tests.kube`: the repository root must be importable.
if str(HERE.parents[2]) not in sys.path:
    sys.path.insert(0, str(HERE.parents[2]))

from chart_support import REPO


@pytest.fixture
def kube() -> Iterator[object]:
    """The foundation's Kubernetes emulator over HTTP, with the chart's copy of the RLJob CRD installed."""
    import yaml

    from tests.kube.server import KubeServer

    crds = [yaml.safe_load(p.read_text()) for p in sorted((REPO / "charts/specrl/crds").glob("*.yaml"))]
    with KubeServer(crds=crds) as server:
        yield server
