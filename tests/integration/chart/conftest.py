"""Fixtures of the chart tests. The helpers live in chart_support.py next to this file."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.integration.chart.chart_support import REPO


@pytest.fixture
def kube() -> Iterator[object]:
    """The foundation's Kubernetes emulator over HTTP, with the chart's copy of the RLJob CRD installed."""
    import yaml

    from tests.kube.server import KubeServer

    crds = [yaml.safe_load(p.read_text()) for p in sorted((REPO / "charts/specrl/crds").glob("*.yaml"))]
    with KubeServer(crds=crds) as server:
        yield server
