"""A recording fake of the slice of vLLM the backend uses; `test_vllm_contract` checks it against vLLM's real source.

Every class and method here exists in the pinned vLLM with compatible parameters, and every data class holds only
fields the real one has (checked), so a backend that runs against this fake calls vLLM's API as it is. Each call is
recorded twice: in ``CALLS`` as ``(name, payload)`` for the unit tests' sequence assertions, and in ``SIGNED`` as
``(qualified name, number of positional args, keyword names)`` for the contract check to bind against the real
signatures.
"""

from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from typing import Any

CALLS: list[tuple[str, Any]] = []
SIGNED: list[tuple[str, int, tuple[str, ...]]] = []


def _sign(name: str, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
    SIGNED.append((name, len(args), tuple(kwargs)))


class SamplingParams:  # vllm.SamplingParams (a msgspec Struct: keyword construction)
    def __init__(self, **kwargs: Any) -> None:
        _sign("vllm.SamplingParams", (), kwargs)
        self.temperature = kwargs.get("temperature", 1.0)
        self.top_p = kwargs.get("top_p", 1.0)
        self.top_k = kwargs.get("top_k", 0)
        self.max_tokens = kwargs.get("max_tokens", 16)
        self.stop_token_ids = kwargs.get("stop_token_ids")
        self.seed = kwargs.get("seed")
        self.logprobs = kwargs.get("logprobs")


@dataclass
class Logprob:  # vllm.logprobs.Logprob
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


@dataclass
class CompletionOutput:  # vllm.outputs.CompletionOutput
    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[dict[int, Logprob]] | None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class RequestOutput:  # vllm.outputs.RequestOutput (only the attributes the backend reads)
    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int] | None,
                 prompt_logprobs: Any, outputs: list[CompletionOutput], finished: bool) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.outputs = outputs
        self.finished = finished


@dataclass
class WeightTransferConfig:  # vllm.config.WeightTransferConfig
    backend: str = "nccl"


@dataclass
class Metric:  # vllm.v1.metrics.reader.Metric
    name: str
    labels: dict[str, str]


@dataclass
class Counter(Metric):  # vllm.v1.metrics.reader.Counter
    value: int


@dataclass
class Gauge(Metric):
    value: float


class LLM:  # vllm.LLM (entrypoints/llm.py, with RLOfflineMixin's weight-transfer methods)
    def __init__(self, model: str, **kwargs: Any) -> None:
        _sign("vllm.LLM.__init__", (), {"model": model, **kwargs})
        self._model = model
        self._kwargs = kwargs
        self._weight_version = "0"
        self._drafts = self._draft_tokens = self._accepted = 0
        CALLS.append(("LLM", {"model": model, **kwargs}))

    def generate(self, prompts: Any, sampling_params: Any = None, *, use_tqdm: bool = True) -> list[RequestOutput]:
        _sign("vllm.LLM.generate", (prompts,), {"sampling_params": sampling_params, "use_tqdm": use_tqdm})
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
            outs.append(RequestOutput(str(i), None, list(ids), None,
                                      [CompletionOutput(0, "", tokens, None, lps, reason)], True))
            if "speculative_config" in self._kwargs:  # a deterministic stand-in for vLLM's spec-decode counters
                self._drafts += n
                self._draft_tokens += 2 * n
                self._accepted += n
        return outs

    def get_metrics(self) -> list[Metric]:
        _sign("vllm.LLM.get_metrics", (), {})
        return [Counter("vllm:spec_decode_num_drafts", {}, self._drafts),
                Counter("vllm:spec_decode_num_draft_tokens", {}, self._draft_tokens),
                Counter("vllm:spec_decode_num_accepted_tokens", {}, self._accepted),
                Gauge("vllm:num_requests_running", {}, 0.0)]

    def init_weight_transfer_engine(self, request: Any) -> None:
        _sign("vllm.LLM.init_weight_transfer_engine", (request,), {})
        CALLS.append(("init_weight_transfer_engine", request))

    def shutdown_weight_transfer_engine(self) -> None:
        _sign("vllm.LLM.shutdown_weight_transfer_engine", (), {})
        CALLS.append(("shutdown_weight_transfer_engine", None))

    def start_weight_update(self) -> None:
        _sign("vllm.LLM.start_weight_update", (), {})
        CALLS.append(("start_weight_update", None))

    def start_draft_weight_update(self) -> None:
        _sign("vllm.LLM.start_draft_weight_update", (), {})
        CALLS.append(("start_draft_weight_update", None))

    def update_weights(self, request: Any) -> None:
        _sign("vllm.LLM.update_weights", (request,), {})
        CALLS.append(("update_weights", request))

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        _sign("vllm.LLM.finish_weight_update", (), {"weight_version": weight_version})
        CALLS.append(("finish_weight_update", weight_version))
        if weight_version is not None:
            self._weight_version = weight_version

    def get_weight_version(self) -> str:
        _sign("vllm.LLM.get_weight_version", (), {})
        return self._weight_version


# -- trainer side (vllm.distributed.weight_transfer) -------------------------------------------------------------


class PyNcclCommunicator:  # vllm.distributed.device_communicators.pynccl.PyNcclCommunicator (what we call)
    def __init__(self, group: Any, device: Any) -> None:
        self._broadcasts: list[tuple[str, Any]] = []

    def destroy(self) -> None:
        _sign("vllm.PyNcclCommunicator.destroy", (), {})
        CALLS.append(("destroy", None))


def trainer_init(init_info: Any, rank: int = 0) -> PyNcclCommunicator:  # nccl_common.trainer_init
    _sign("vllm.distributed.weight_transfer.nccl_common.trainer_init", (init_info,), {"rank": rank})
    CALLS.append(("trainer_init", {"init_info": init_info, "rank": rank}))
    return PyNcclCommunicator(group=None, device="cuda:0")


def packed_nccl_broadcast_producer(iterator: Any, group: Any, src: int, post_iter_func: Any,
                                   buffer_size_bytes: int = 1 << 30, num_buffers: int = 2) -> None:
    _sign("vllm.distributed.weight_transfer.packed_tensor.packed_nccl_broadcast_producer", (),
          {"iterator": iterator, "group": group, "src": src, "post_iter_func": post_iter_func,
           "buffer_size_bytes": buffer_size_bytes, "num_buffers": num_buffers})
    sent = [(name, post_iter_func((name, t))) for name, t in iterator]
    group._broadcasts.extend(sent)
    CALLS.append(("packed_nccl_broadcast_producer", {"names": [n for n, _ in sent], "src": src,
                                                     "buffer_size_bytes": buffer_size_bytes,
                                                     "num_buffers": num_buffers}))


# what the contract check compares with the real source: fake object -> (real module, real name)
REAL_NAMES: dict[str, tuple[str, str]] = {
    "LLM": ("vllm", "LLM"),
    "SamplingParams": ("vllm", "SamplingParams"),
    "Logprob": ("vllm.logprobs", "Logprob"),
    "CompletionOutput": ("vllm.outputs", "CompletionOutput"),
    "RequestOutput": ("vllm.outputs", "RequestOutput"),
    "WeightTransferConfig": ("vllm.config", "WeightTransferConfig"),
    "Metric": ("vllm.v1.metrics.reader", "Metric"),
    "Counter": ("vllm.v1.metrics.reader", "Counter"),
    "Gauge": ("vllm.v1.metrics.reader", "Gauge"),
    "trainer_init": ("vllm.distributed.weight_transfer.nccl_common", "trainer_init"),
    "PyNcclCommunicator": ("vllm.distributed.device_communicators.pynccl", "PyNcclCommunicator"),
    "packed_nccl_broadcast_producer": ("vllm.distributed.weight_transfer.packed_tensor",
                                       "packed_nccl_broadcast_producer"),
}


def install(monkeypatch: Any) -> types.ModuleType:
    """Put the fake in ``sys.modules`` as ``vllm`` and the submodules the backend imports; returns ``vllm``."""
    CALLS.clear()
    SIGNED.clear()
    modules = {name: types.ModuleType(name) for name in (
        "vllm", "vllm.config", "vllm.distributed", "vllm.distributed.weight_transfer",
        "vllm.distributed.weight_transfer.nccl_common", "vllm.distributed.weight_transfer.packed_tensor")}
    contents: dict[str, dict[str, Any]] = {
        "vllm": {"LLM": LLM, "SamplingParams": SamplingParams, "config": modules["vllm.config"]},
        "vllm.config": {"WeightTransferConfig": WeightTransferConfig},
        "vllm.distributed.weight_transfer.nccl_common": {"trainer_init": trainer_init},
        "vllm.distributed.weight_transfer.packed_tensor": {
            "packed_nccl_broadcast_producer": packed_nccl_broadcast_producer},
    }
    for name, attrs in contents.items():
        vars(modules[name]).update(attrs)
    vllm = modules["vllm"]
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    return vllm
