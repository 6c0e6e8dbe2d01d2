"""Fixtures: a recorded fake of the vLLM >= 0.25 API surface the vLLM backend uses (vLLM itself needs CUDA).

Signatures follow vLLM's public API: ``vllm.LLM(model=..., speculative_config=..., weight_transfer_config=...,
**engine_args)``, ``LLM.generate(prompts, sampling_params, use_tqdm=...)`` returning ``RequestOutput`` objects with
``outputs[0].token_ids / .logprobs (list of {token_id: Logprob}) / .finish_reason``, the RLHF mixin's
``init_weight_transfer_engine(request)``, ``start_weight_update()``, ``start_draft_weight_update()``,
``update_weights(request)``, ``finish_weight_update(weight_version=None)``, and ``vllm.config.WeightTransferConfig``.
Every call is appended to ``CALLS`` so tests can assert the exact sequence.
"""

from __future__ import annotations

import types
from dataclasses import dataclass, field
from typing import Any

CALLS: list[tuple[str, Any]] = []


@dataclass
class SamplingParams:
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    max_tokens: int | None = 16
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: int | None = None


@dataclass
class Logprob:
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    finished: bool = True


@dataclass
class WeightTransferConfig:
    backend: str = "nccl"


class LLM:
    def __init__(self, model: str, **kwargs: Any) -> None:
        self.model = model
        self.kwargs = kwargs
        self._weight_version = "0"
        CALLS.append(("LLM", {"model": model, **kwargs}))

    def generate(self, prompts: Any, sampling_params: Any = None, *, use_tqdm: bool = True, **kwargs: Any) -> list:
        CALLS.append(("generate", {"prompts": prompts, "sampling_params": sampling_params}))
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        outs = []
        for i, (prompt, sp) in enumerate(zip(prompts, params)):
            ids = prompt["prompt_token_ids"]
            n = min(sp.max_tokens, 3)
            tokens = [(ids[-1] + j + 1) % 50 for j in range(n)]
            # a "top-1" extra entry proves the converter picks the sampled token, not the first key
            lps = [{99: Logprob(-0.01, 1), t: Logprob(-0.5 - j, 2)} for j, t in enumerate(tokens)]
            reason = "length" if n == sp.max_tokens else "stop"
            outs.append(RequestOutput(str(i), list(ids), [CompletionOutput(0, "", tokens, None, lps, reason)]))
        return outs

    def init_weight_transfer_engine(self, request: Any) -> None:
        CALLS.append(("init_weight_transfer_engine", request))

    def start_weight_update(self) -> None:
        CALLS.append(("start_weight_update", None))

    def start_draft_weight_update(self) -> None:
        CALLS.append(("start_draft_weight_update", None))

    def update_weights(self, request: Any) -> None:
        CALLS.append(("update_weights", request))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        CALLS.append(("finish_weight_update", weight_version))
        if weight_version is not None:
            self._weight_version = weight_version

    def get_weight_version(self) -> str:
        return self._weight_version


def install(monkeypatch: Any) -> types.ModuleType:
    """Put the fake in sys.modules as `vllm` and `vllm.config`; returns the `vllm` module."""
    CALLS.clear()
    vllm = types.ModuleType("vllm")
    config = types.ModuleType("vllm.config")
    vllm.LLM = LLM  # type: ignore[attr-defined]
    vllm.SamplingParams = SamplingParams  # type: ignore[attr-defined]
    vllm.config = config  # type: ignore[attr-defined]
    config.WeightTransferConfig = WeightTransferConfig  # type: ignore[attr-defined]
    monkeypatch.setitem(__import__("sys").modules, "vllm", vllm)
    monkeypatch.setitem(__import__("sys").modules, "vllm.config", config)
    return vllm


import pytest


@pytest.fixture
def fake_vllm(monkeypatch: Any) -> types.ModuleType:
    return install(monkeypatch)


@pytest.fixture
def vllm_calls() -> list[tuple[str, Any]]:
    return CALLS
