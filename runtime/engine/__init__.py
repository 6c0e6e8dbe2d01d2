"""Speculative rollout engine (DESIGN §3): `RolloutEngine(model, speculative=SpeculativeConfig(...)).generate(...)`."""

from specrl.runtime.engine.control import Controller, Decision, FixedController, StepRecord
from specrl.runtime.engine.engine import EngineStats, RequestOutput, RolloutEngine, SpeculativeConfig
from specrl.runtime.engine.sampling import SamplingParams

__all__ = ["Controller", "Decision", "EngineStats", "FixedController", "RequestOutput", "RolloutEngine",
           "SamplingParams", "SpeculativeConfig", "StepRecord"]
