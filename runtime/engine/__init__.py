"""Speculative rollout engine (DESIGN §3): `RolloutEngine(model, speculative=SpeculativeConfig(...)).generate(...)`.

The names are loaded on first use (PEP 562), so that the torch-free parts of the package (`adaptive`,
`control`: the cost model the simulator shares) import on a base install without torch.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

_EXPORTS = {
    "Controller": "control", "Decision": "control", "FixedController": "control", "StepRecord": "control",
    "EngineStats": "engine", "RequestOutput": "engine", "RolloutEngine": "engine", "SpeculativeConfig": "engine",
    "SamplingParams": "sampling",
}

__all__ = ["Controller", "Decision", "EngineStats", "FixedController", "RequestOutput", "RolloutEngine",
           "SamplingParams", "SpeculativeConfig", "StepRecord"]

if TYPE_CHECKING:
    from .control import Controller, Decision, FixedController, StepRecord
    from .engine import EngineStats, RequestOutput, RolloutEngine, SpeculativeConfig
    from .sampling import SamplingParams


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(f"{__name__}.{_EXPORTS[name]}"), name)
    globals()[name] = value
    return value
