"""vLLM rollout backend (GPU images): RLJob speculative settings -> vLLM, outputs -> ours, native weight transfer.

Written against **vLLM 0.33.0**, the version the `vllm` extra pins: the RL weight-transfer API of ``vllm.LLM``
(``init_weight_transfer_engine`` / ``start_weight_update`` / ``update_weights`` / ``finish_weight_update``, and
``start_draft_weight_update`` so the drafter follows the policy — a stale drafter makes SD slower than none), the
dense NCCL transfer (``vllm.distributed.weight_transfer``: the packed wire format is agreed once in the init info,
each update carries only names, dtypes and shapes), ``SpeculativeConfig`` (including
``num_speculative_tokens_per_batch_size``) and the ``vllm:spec_decode_*`` counters of ``LLM.get_metrics()``.

vLLM needs CUDA, so this module never runs against a real vLLM here. What pins it: `tests/contract/` downloads the
pinned wheel, reads its source with ``ast`` and fails when a class, method, keyword, payload key or
``speculative_config`` key used here (or by the fake the unit tests drive) does not exist with that signature.

`import vllm` happens only when a `VLLMRolloutEngine` or `VLLMWeightSender` is built, so the module imports anywhere.
"""

from __future__ import annotations

import importlib
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .adaptive import AdaptiveController

TARGET_VLLM = "0.33.0"  # the `vllm` extra's pin; tests/contract reads this version's source
VLLM_METHODS: tuple[str, ...] = ("draft_model", "ngram", "eagle", "eagle3", "mtp")
NATIVE_ONLY_METHODS: tuple[str, ...] = ("layer_skip", "quantized_self")
# methods whose drafter has parameters of its own that must follow the policy
METHODS_WITH_DRAFT_WEIGHTS: tuple[str, ...] = ("draft_model", "eagle", "eagle3", "mtp")


def _get(obj: Any, *names: str, default: Any = None) -> Any:
    """Read a setting from a pydantic model / object (snake_case) or a raw mapping (snake or camelCase)."""
    for name in names:
        if isinstance(obj, Mapping):
            if obj.get(name) is not None:
                return obj[name]
            camel = name.split("_")[0] + "".join(p.title() for p in name.split("_")[1:])
            if obj.get(camel) is not None:
                return obj[camel]
        elif getattr(obj, name, None) is not None:
            return getattr(obj, name)
    return default


def validate_per_batch_size(schedule: Sequence[Sequence[int]], num_speculative_tokens: int) -> list[list[int]]:
    """Check a ``[[start_bs, end_bs, K], ...]`` schedule as vLLM does: inclusive, ascending, disjoint, 0 <= K <= max."""
    out: list[list[int]] = []
    previous_end = 0
    for i, entry in enumerate(schedule):
        if len(entry) != 3:
            raise ValueError(f"speculative.numSpeculativeTokensPerBatchSize[{i}]: expected [startBs, endBs, K], "
                             f"got {list(entry)!r}")
        start, end, k = (int(x) for x in entry)
        if start < 1 or end < start:
            raise ValueError(f"speculative.numSpeculativeTokensPerBatchSize[{i}]: need 1 <= startBs <= endBs, "
                             f"got {start}..{end}")
        if start <= previous_end:
            raise ValueError(f"speculative.numSpeculativeTokensPerBatchSize[{i}]: ranges must be ascending and "
                             f"disjoint ({start} <= previous end {previous_end})")
        if not 0 <= k <= num_speculative_tokens:
            raise ValueError(f"speculative.numSpeculativeTokensPerBatchSize[{i}]: K={k} must lie in "
                             f"[0, numSpeculativeTokens={num_speculative_tokens}]")
        out.append([start, end, k])
        previous_end = end
    return out


def schedule_from_controller(controller: AdaptiveController, num_speculative_tokens: int,
                             max_num_seqs: int = 256) -> list[list[int]]:
    """vLLM's per-batch-size K from our calibrated toggle (+ acceptance-aware γ), capped at the configured K."""
    merged: list[list[int]] = []
    for start, end, k in controller.per_batch_size_gamma(max_batch=max_num_seqs):
        k = min(k, num_speculative_tokens)
        if merged and merged[-1][2] == k:
            merged[-1][1] = end
        else:
            merged.append([start, end, k])
    return merged


def speculative_config_from_spec(speculative: Any, *, draft_model_path: str | None = None,
                                 per_batch_size: Sequence[Sequence[int]] | None = None) -> dict[str, Any] | None:
    """The ``speculative_config`` dict for ``vllm.LLM`` from the RLJob's ``spec.speculative`` (None = no SD).

    ``draft_model_path`` is where the rollout worker wrote the drafter checkpoint (draft_model / eagle / eagle3);
    ``per_batch_size`` is usually `schedule_from_controller(...)`.
    """
    if speculative is None or _get(speculative, "enabled", default=True) is False:
        return None
    method = _get(speculative, "method", default="none")
    if method in (None, "none"):
        return None
    if method in NATIVE_ONLY_METHODS:
        raise ValueError(f"speculative.method: {method!r} runs on the native engine only; vLLM has no such "
                         f"proposer (use one of {', '.join(VLLM_METHODS)} with the vLLM backend)")
    if method not in VLLM_METHODS:
        raise ValueError(f"speculative.method: unknown method {method!r} for the vLLM backend "
                         f"(expected one of {', '.join(VLLM_METHODS)})")
    k = int(_get(speculative, "num_speculative_tokens", default=4))
    if k < 1:
        raise ValueError(f"speculative.numSpeculativeTokens: must be >= 1, got {k}")
    config: dict[str, Any] = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        lo = int(_get(speculative, "prompt_lookup_min", default=_get(_get(speculative, "ngram", default={}),
                                                                      "prompt_lookup_min", default=2)))
        hi = int(_get(speculative, "prompt_lookup_max", default=_get(_get(speculative, "ngram", default={}),
                                                                      "prompt_lookup_max", default=max(lo, 5))))
        if not 1 <= lo <= hi:
            raise ValueError(f"speculative.promptLookupMin/Max: need 1 <= min <= max, got {lo}, {hi}")
        config.update(prompt_lookup_min=lo, prompt_lookup_max=hi)
    elif method in ("draft_model", "eagle", "eagle3"):
        path = draft_model_path or _get(speculative, "draft_model", "model")
        if not path or not isinstance(path, str):
            raise ValueError(f"speculative.draftModel: method {method!r} needs the drafter's checkpoint path "
                             f"for vLLM")
        config["model"] = path
    elif method == "mtp":
        path = draft_model_path or _get(speculative, "draft_model", "model")
        if path:
            config["model"] = path  # optional: the target checkpoint carries the MTP head by default
    schedule = per_batch_size if per_batch_size is not None else _get(speculative,
                                                                       "num_speculative_tokens_per_batch_size")
    if schedule:
        config["num_speculative_tokens_per_batch_size"] = validate_per_batch_size(schedule, k)
    return config


def sampling_params_to_vllm(params: Any, vllm: Any) -> Any:
    """Our `SamplingParams` -> ``vllm.SamplingParams`` (logprobs=0: the sampled token's logprob only)."""
    return vllm.SamplingParams(
        temperature=float(params.temperature),
        top_p=float(params.top_p),
        top_k=int(params.top_k),  # 0 disables top-k in both
        max_tokens=int(params.max_new_tokens),
        stop_token_ids=list(params.stop_token_ids),
        seed=params.seed,
        logprobs=0,
    )


def _finish_reason(reason: str | None) -> str:
    # vLLM reports "stop" (EOS or stop token), "length" or "abort"; ours uses the same words
    return reason or "length"


def _sampled_logprobs(token_ids: Sequence[int], logprobs: Any) -> list[float]:
    """The sampled token's logprob per position from vLLM's per-position ``{token_id: Logprob}`` entries."""
    if logprobs is None:
        raise ValueError("vLLM output has no logprobs: the request must be sent with logprobs=0")
    out: list[float] = []
    for position, (token, entry) in enumerate(zip(token_ids, logprobs)):
        item = entry.get(token) if isinstance(entry, Mapping) else None
        if item is None:
            raise ValueError(f"vLLM output: no logprob for sampled token {token} at position {position}")
        value: Any = getattr(item, "logprob", item)  # a Logprob, or the bare float of older vLLM versions
        out.append(float(value))
    return out


def to_request_output(output: Any, request_id: int) -> Any:
    """One ``vllm.RequestOutput`` -> our `RequestOutput` (generated tokens only, target logprobs, finish reason)."""
    from . import RequestOutput  # the engine package is torch-heavy; import late

    completion = output.outputs[0]
    token_ids = [int(t) for t in completion.token_ids]
    return RequestOutput(request_id=request_id, prompt_token_ids=[int(t) for t in output.prompt_token_ids],
                         token_ids=token_ids, logprobs=_sampled_logprobs(token_ids, completion.logprobs),
                         finish_reason=_finish_reason(completion.finish_reason))


@dataclass
class WeightUpdateInfo:
    """Metadata of one streamed weight set (vLLM's NCCL ``update_info``): the receiver allocates from it."""

    names: list[str]
    dtype_names: list[str]
    shapes: list[list[int]]

    def __post_init__(self) -> None:
        if not (len(self.names) == len(self.dtype_names) == len(self.shapes)):
            raise ValueError(f"WeightUpdateInfo: names/dtype_names/shapes differ in length "
                             f"({len(self.names)}, {len(self.dtype_names)}, {len(self.shapes)})")

    @property
    def nbytes(self) -> int:
        import math

        import torch

        return sum(math.prod(shape) * getattr(torch, dt).itemsize for dt, shape in zip(self.dtype_names, self.shapes))

    @classmethod
    def from_named_tensors(cls, named: Sequence[tuple[str, Any]]) -> WeightUpdateInfo:
        return cls(names=[n for n, _ in named], dtype_names=[str(t.dtype).removeprefix("torch.") for _, t in named],
                   shapes=[list(t.shape) for _, t in named])

    def request(self) -> dict[str, Any]:
        # vLLM's NCCLWeightTransferUpdateInfo holds exactly these three lists (packing is agreed at init)
        return {"update_info": {"names": self.names, "dtype_names": self.dtype_names, "shapes": self.shapes}}


def named_weights(module: Any, dtype: Any = None) -> list[tuple[str, Any]]:
    """What one weight update streams, in order: the module's parameters (tied ones once), in the wire `dtype`.

    The trainer sends exactly this and a rollout worker derives the same list from the model's config on the meta
    device (`weight_update_info_for`), so both sides agree on names, shapes and dtypes without a metadata round
    trip. A parameter already in `dtype` goes out as is (no copy).
    """
    return [(n, p.detach() if dtype is None else p.detach().to(dtype)) for n, p in module.named_parameters()]


def weight_update_info_for(model_path: str, dtype: Any) -> WeightUpdateInfo:
    """The metadata of `named_weights` for the model at `model_path` (HF folder or id), without its weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        skeleton = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return WeightUpdateInfo.from_named_tensors(named_weights(skeleton, dtype))


@dataclass(frozen=True)
class TransferWire:
    """The packed-broadcast parameters trainer and vLLM workers must agree on (sent once, in the init info)."""

    packed: bool = True
    buffer_size_bytes: int = 1 << 30  # vLLM's DEFAULT_PACKED_BUFFER_SIZE_BYTES
    num_buffers: int = 2  # vLLM's DEFAULT_PACKED_NUM_BUFFERS


# vLLM's spec-decode counters (vllm/v1/spec_decode/metrics.py) -> our stats keys (RolloutEngine.stats names)
SPEC_DECODE_COUNTERS: dict[str, str] = {
    "vllm:spec_decode_num_drafts": "drafts",
    "vllm:spec_decode_num_draft_tokens": "draft_tokens",
    "vllm:spec_decode_num_accepted_tokens": "accepted_tokens",
}


class VLLMRolloutEngine:
    """`RolloutEngine`'s interface on top of ``vllm.LLM`` (GPU only; see the module docstring)."""

    def __init__(self, model: str, speculative: Any = None, *, draft_model_path: str | None = None,
                 controller: AdaptiveController | None = None, max_num_seqs: int = 256,
                 weight_transfer_backend: str = "nccl", logprobs_mode: str = "processed_logprobs",
                 wire: TransferWire = TransferWire(), **llm_kwargs: Any) -> None:
        try:
            self._vllm = importlib.import_module("vllm")
            config_module = importlib.import_module("vllm.config")
        except ImportError as exc:
            raise RuntimeError(f"the vLLM backend needs vllm=={TARGET_VLLM} (a CUDA machine): "
                               f"pip install 'specrl[vllm]' ({exc})") from None
        self.method = _get(speculative, "method", default="none") if speculative is not None else "none"
        per_bs = None
        if controller is not None and speculative is not None and self.method not in (None, "none"):
            per_bs = schedule_from_controller(controller, int(_get(speculative, "num_speculative_tokens", default=4)),
                                              max_num_seqs)
        self.speculative_config = speculative_config_from_spec(speculative, draft_model_path=draft_model_path,
                                                               per_batch_size=per_bs)
        # logprobs_mode "processed_logprobs": the sampled token's logprob under the processed target distribution
        # (temperature, top-k/p), what the native engine returns and GRPO's importance ratio needs.
        # disable_log_stats=False: vllm.LLM turns stats off by default, and get_metrics() then has no spec counters.
        kwargs: dict[str, Any] = dict(model=model, max_num_seqs=max_num_seqs, logprobs_mode=logprobs_mode,
                                      disable_log_stats=False,
                                      weight_transfer_config=config_module.WeightTransferConfig(
                                          backend=weight_transfer_backend), **llm_kwargs)
        if self.speculative_config is not None:
            kwargs["speculative_config"] = self.speculative_config
        self.wire = wire
        self.llm = self._vllm.LLM(**kwargs)
        self.weight_version: str | None = None
        self._transfer_ready = False
        # vllm.LLM is driven from one thread at a time: a weight update waits for the running generate() (so no
        # request mixes versions) and the trainer's broadcast waits in NCCL meanwhile.
        self._lock = threading.Lock()

    # -- rollouts -----------------------------------------------------------------------------------------

    def generate(self, prompts: list[list[int]], params: Any) -> list[Any]:
        if not prompts:
            return []
        for i, p in enumerate(prompts):
            if not p:
                raise ValueError(f"prompts[{i}]: empty prompt")
        many = isinstance(params, (list, tuple))
        if many and len(params) != len(prompts):
            raise ValueError(f"params: {len(params)} sampling params for {len(prompts)} prompts")
        sp = [sampling_params_to_vllm(p, self._vllm) for p in params] if many else \
            sampling_params_to_vllm(params, self._vllm)
        with self._lock:
            outputs = self.llm.generate([{"prompt_token_ids": list(p)} for p in prompts], sp, use_tqdm=False)
        return [to_request_output(o, i) for i, o in enumerate(outputs)]

    @property
    def stats(self) -> dict[str, int]:
        """vLLM's cumulative spec-decode counters under the native engine's stats names (0 without SD)."""
        out = dict.fromkeys(SPEC_DECODE_COUNTERS.values(), 0)
        for metric in self.llm.get_metrics():
            key = SPEC_DECODE_COUNTERS.get(metric.name)
            if key is not None:  # one counter per engine index (data-parallel engines): sum them
                out[key] += int(metric.value)
        return out

    # -- weights ------------------------------------------------------------------------------------------

    def init_weight_transfer(self, master_address: str, master_port: int, rank_offset: int, world_size: int) -> None:
        """Join the trainer's transfer group (the trainer is rank 0; our workers start at `rank_offset`)."""
        self.llm.init_weight_transfer_engine({"init_info": {
            "master_address": master_address, "master_port": int(master_port), "rank_offset": int(rank_offset),
            "world_size": int(world_size), "packed": self.wire.packed,
            "packed_buffer_size_bytes": self.wire.buffer_size_bytes, "packed_num_buffers": self.wire.num_buffers}})
        self._transfer_ready = True

    def close_weight_transfer(self) -> None:
        """Leave the trainer's transfer group (membership changed); inference continues on the current weights."""
        if self._transfer_ready:
            self.llm.shutdown_weight_transfer_engine()
            self._transfer_ready = False

    def update_weights(self, policy: WeightUpdateInfo, draft: WeightUpdateInfo | None = None,
                       version: int | str | None = None, *, drafter_frozen: bool = False) -> None:
        """Receive a new policy, then (when the proposer has parameters) the drafter, as one versioned update.

        The trainer streams the policy once and then replays the drafter's stream; the version is committed on the
        last ``finish_weight_update`` so no request sees a new policy with a stale drafter's version.
        """
        if not self._transfer_ready:
            raise RuntimeError("update_weights: call init_weight_transfer(...) first")
        if draft is None and self.method in METHODS_WITH_DRAFT_WEIGHTS and not drafter_frozen:
            raise ValueError(f"update_weights: draft: proposer {self.method!r} has its own weights; pass the "
                             f"drafter's WeightUpdateInfo, or drafter_frozen=True when no one trains it (a stale "
                             f"drafter makes SD slower than none)")
        if draft is not None and self.method not in METHODS_WITH_DRAFT_WEIGHTS:
            raise ValueError(f"update_weights: draft: proposer {self.method!r} has no weights to update")
        tag = None if version is None else str(version)
        with self._lock:
            self.llm.start_weight_update()
            self.llm.update_weights(policy.request())
            if draft is not None:
                self.llm.finish_weight_update()
                self.llm.start_draft_weight_update()
                self.llm.update_weights(draft.request())
            self.llm.finish_weight_update(weight_version=tag)
        self.weight_version = tag

    def refresh_drafter(self) -> None:
        raise RuntimeError("refresh_drafter: with the vLLM backend the drafter follows the policy through "
                           "update_weights(policy, draft=...)")


class VLLMWeightSender:
    """Trainer rank 0's side of vLLM's NCCL weight transfer: packed broadcasts straight from device tensors.

    Uses vLLM's own rendezvous (``nccl_common.trainer_init``) and producer (``packed_nccl_broadcast_producer``), so
    the wire format is by construction what `VLLMRolloutEngine.update_weights` unpacks on the workers. The trainer
    calls `send` for the policy, then for the drafter, while the workers run the matching ``update_weights``.
    """

    def __init__(self, master_address: str, master_port: int, world_size: int,
                 wire: TransferWire = TransferWire()) -> None:
        try:
            common = importlib.import_module("vllm.distributed.weight_transfer.nccl_common")
            packed = importlib.import_module("vllm.distributed.weight_transfer.packed_tensor")
        except ImportError as exc:
            raise RuntimeError(f"sending weights to vLLM needs vllm=={TARGET_VLLM} in the trainer image: "
                               f"pip install 'specrl[vllm]' ({exc})") from None
        if not wire.packed:
            raise ValueError("VLLMWeightSender: wire.packed must be True (one packed stream per update)")
        self.wire = wire
        self._producer = packed.packed_nccl_broadcast_producer
        self.group = common.trainer_init({"master_address": master_address, "master_port": int(master_port),
                                          "world_size": int(world_size)}, rank=0)

    def send(self, named: Sequence[tuple[str, Any]]) -> WeightUpdateInfo:
        """Broadcast `named` tensors (on their own device, no copies) and return the metadata workers need."""
        info = WeightUpdateInfo.from_named_tensors(named)
        self._producer(iterator=iter(named), group=self.group, src=0, post_iter_func=lambda item: item[1],
                       buffer_size_bytes=self.wire.buffer_size_bytes, num_buffers=self.wire.num_buffers)
        return info

    def close(self) -> None:
        """Release the NCCL communicator (membership changed: a new group is opened on a new port)."""
        if self.group is not None:
            self.group.destroy()
            self.group = None
