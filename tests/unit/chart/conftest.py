"""Fixtures of the chart tests. The helpers live in tests/integration/chart/chart_support.py."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "integration" / "chart"))
