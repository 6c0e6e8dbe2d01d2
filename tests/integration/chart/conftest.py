"""Fixtures of the chart tests. The helpers live in chart_support.py next to this file."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
