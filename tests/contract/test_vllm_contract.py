"""The vLLM backend and its unit tests' fake, checked against the real source of the vLLM the `vllm` extra pins.

vLLM cannot run here (CUDA), so the backend is driven against `fake_vllm`; this check reads the pinned wheel's
source (`vllm_source`, never imported) and fails when a call, keyword, payload key, ``speculative_config`` key,
method name, attribute or counter the backend or the fake uses does not exist there. First run downloads the wheel
(~336 MB, ~30 s here) into ~/.cache/specrl; later runs parse the cached sources (~2 s).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import re
from typing import Any

import pytest
import torch
from specrl.runtime.engine import SamplingParams
from specrl.runtime.engine.vllm_backend import (
    SPEC_DECODE_COUNTERS,
    TARGET_VLLM,
    VLLM_METHODS,
    TransferWire,
    VLLMRolloutEngine,
    VLLMWeightSender,
    WeightUpdateInfo,
)

from tests.contract import fake_vllm
from tests.contract.vllm_source import Signature, Source, pinned_version

NCCL = "vllm.distributed.weight_transfer.nccl_engine"
COMMON = "vllm.distributed.weight_transfer.nccl_common"
PACKED = "vllm.distributed.weight_transfer.packed_tensor"


def signature_of(src: Source, qualname: str) -> Signature:
    """'vllm.LLM.generate' / 'vllm.SamplingParams' / 'vllm.a.b.function' -> the real signature."""
    if qualname.startswith("vllm.LLM."):
        sig = src.cls("vllm", "LLM").method(qualname.rpartition(".")[2])
        if sig is None:
            raise LookupError(f"vllm.LLM has no method {qualname.rpartition('.')[2]}")
        return sig
    if qualname == "vllm.SamplingParams":
        return src.cls("vllm", "SamplingParams").constructor()
    if qualname == "vllm.PyNcclCommunicator.destroy":
        sig = src.cls("vllm.distributed.device_communicators.pynccl", "PyNcclCommunicator").method("destroy")
        assert sig is not None
        return sig
    module, _, name = qualname.rpartition(".")
    return src.function(module, name)


def call_problems(src: Source, qualname: str, n_positional: int, keywords: tuple[str, ...]) -> list[str]:
    try:
        sig = signature_of(src, qualname)
    except (LookupError, TypeError) as exc:
        return [str(exc)]
    if qualname == "vllm.LLM.__init__":
        # LLM(**kwargs) forwards what its own signature does not name to EngineArgs (entrypoints/llm.py)
        engine_args = src.cls("vllm.engine.arg_utils", "EngineArgs").fields()
        unknown = [k for k in keywords if k not in sig.names and k not in engine_args]
        return [f"vllm.LLM has no keyword {k!r} (neither LLM.__init__ nor EngineArgs)" for k in unknown] + \
            sig.bind(n_positional, [k for k in keywords if k in sig.names])
    return sig.bind(n_positional, keywords)


def payload_problems(src: Source, module: str, cls: str, payload: dict[str, Any]) -> list[str]:
    """vLLM builds `cls(**payload)` from a request dict (WeightTransferEngine.parse_*_info, SpeculativeConfig)."""
    return src.cls(module, cls).constructor().bind(0, list(payload))


def drive_backend(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every path of the backend against the fake: each vLLM method, generate, counters, weight transfer."""
    fake_vllm.install(monkeypatch)
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=5, max_new_tokens=3, stop_token_ids=(2,), seed=1)
    for method in VLLM_METHODS:
        spec = {"method": method, "draftModel": "/ckpt/draft", "promptLookupMin": 2,
                "numSpeculativeTokensPerBatchSize": [[1, 8, 4], [9, 256, 0]]}  # every key the mapping can emit
        engine = VLLMRolloutEngine("/ckpt/policy", spec, max_num_seqs=64, enforce_eager=True,
                                   gpu_memory_utilization=0.85, dtype="bfloat16", seed=0)
        engine.generate([[1, 2, 3], [4]], [params, params])
        assert set(engine.stats) == set(SPEC_DECODE_COUNTERS.values())
        engine.init_weight_transfer("10.0.0.1", 29600, rank_offset=1, world_size=2)
        info = WeightUpdateInfo.from_named_tensors([("model.embed_tokens.weight", torch.zeros(4, 2))])
        engine.update_weights(info, draft=info if method != "ngram" else None, version=3)
        assert engine.llm.get_weight_version() == "3"
        engine.close_weight_transfer()
    sender = VLLMWeightSender("10.0.0.1", 29600, world_size=2)
    sender.send([("lm_head.weight", torch.zeros(4, 2))])
    sender.close()


def test_pin_is_what_the_backend_targets() -> None:
    assert pinned_version() == TARGET_VLLM


def test_every_backend_call_binds_to_vllms_signatures(src: Source, monkeypatch: pytest.MonkeyPatch) -> None:
    drive_backend(monkeypatch)
    called = {name for name, _, _ in fake_vllm.SIGNED}
    assert {"vllm.LLM.__init__", "vllm.LLM.generate", "vllm.LLM.update_weights", "vllm.LLM.start_draft_weight_update",
            "vllm.LLM.finish_weight_update", "vllm.LLM.init_weight_transfer_engine", "vllm.LLM.get_metrics",
            "vllm.LLM.shutdown_weight_transfer_engine",
            "vllm.SamplingParams", f"{COMMON}.trainer_init", f"{PACKED}.packed_nccl_broadcast_producer"} <= called
    problems = sorted({p for name, n, kw in fake_vllm.SIGNED for p in call_problems(src, name, n, kw)})
    assert not problems, "the vLLM backend calls what vLLM does not have:\n" + "\n".join(problems)


def test_payloads_and_values_are_what_vllm_parses(src: Source, monkeypatch: pytest.MonkeyPatch) -> None:
    drive_backend(monkeypatch)
    problems: list[str] = []
    methods = src.literal_values("vllm.config.speculative", "SpeculativeMethod")
    problems += [f"speculative method {m!r} not in vLLM's SpeculativeMethod" for m in VLLM_METHODS if m not in methods]
    for name, payload in fake_vllm.CALLS:
        if name == "LLM":
            sc = payload.get("speculative_config")
            if sc is not None:
                problems += payload_problems(src, "vllm.config.speculative", "SpeculativeConfig", sc)
            modes = src.literal_values("vllm.config.model", "LogprobsMode")
            if payload["logprobs_mode"] not in modes:
                problems.append(f"logprobs_mode {payload['logprobs_mode']!r} not in {sorted(modes)}")
            wtc = dataclasses.asdict(payload["weight_transfer_config"])
            problems += payload_problems(src, "vllm.config", "WeightTransferConfig", wtc)
            registered = re.findall(r"register_engine\(\s*'(\w+)'", src.text("vllm.distributed.weight_transfer.factory"))
            if wtc["backend"] not in registered:
                problems.append(f"weight transfer backend {wtc['backend']!r} not registered ({registered})")
        elif name == "init_weight_transfer_engine":
            problems += payload_problems(src, COMMON, "NCCLWeightTransferInitInfo", payload["init_info"])
        elif name == "update_weights":
            problems += payload_problems(src, NCCL, "NCCLWeightTransferUpdateInfo", payload["update_info"])
        elif name == "trainer_init":
            fn = src.find(COMMON, "trainer_init")[1]
            read = {n.slice.value for n in ast.walk(fn) if isinstance(n, ast.Subscript)
                    and isinstance(n.slice, ast.Constant) and isinstance(n.slice.value, str)
                    and ast.unparse(n.value) == "init_info"}
            if set(payload["init_info"]) != read:
                problems.append(f"trainer_init reads init_info keys {sorted(read)}, we send "
                                f"{sorted(payload['init_info'])}")
    assert not problems, "payloads vLLM would reject:\n" + "\n".join(sorted(set(problems)))


def test_wire_defaults_and_counters_match_vllm(src: Source) -> None:
    tree = src.module(PACKED)
    consts = {t.id: n.value for n in tree.body if isinstance(n, ast.Assign) for t in n.targets
              if isinstance(t, ast.Name) and t.id.startswith("DEFAULT_PACKED")}
    evaluated = {k: eval(compile(ast.Expression(v), "<const>", "eval"), {"__builtins__": {}})  # digits and * only
                 for k, v in consts.items() if re.fullmatch(r"[\d\s*]+", ast.unparse(v))}
    wire = TransferWire()
    assert (wire.buffer_size_bytes, wire.num_buffers) == (evaluated["DEFAULT_PACKED_BUFFER_SIZE_BYTES"],
                                                          evaluated["DEFAULT_PACKED_NUM_BUFFERS"])
    metrics_text = src.text("vllm.v1.spec_decode.metrics")
    for name in SPEC_DECODE_COUNTERS:
        assert f"'{name}'" in metrics_text, f"vLLM no longer exports the counter {name}"
    assert "value" in src.cls("vllm.v1.metrics.reader", "Counter").fields()
    assert "name" in src.cls("vllm.v1.metrics.reader", "Metric").fields()


def _fake_signature(obj: Any, method: bool) -> inspect.Signature:
    sig = inspect.signature(obj)
    return sig.replace(parameters=list(sig.parameters.values())[1:]) if method else sig


def _compare(fake: inspect.Signature, real: Signature, what: str) -> list[str]:
    problems = []
    kinds = inspect.Parameter
    named = {n: p for n, p in fake.parameters.items() if p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)}
    for n, p in named.items():
        if n not in real.names and not real.var_keyword:
            problems.append(f"fake {what} has parameter {n!r}, vLLM's {real.qualname} does not")
        elif p.kind == kinds.KEYWORD_ONLY and n in real.positional_only:
            problems.append(f"fake {what}: {n!r} is keyword-only, positional-only in vLLM")
    fake_var_kw = any(p.kind == kinds.VAR_KEYWORD for p in fake.parameters.values())
    for n in real.required_positional + real.required_keyword_only:
        if n not in named and not fake_var_kw:
            problems.append(f"fake {what} lacks vLLM's required parameter {n!r}")
    return problems


def test_the_fake_is_vllms_surface(src: Source) -> None:
    """The unit tests' fake: every class/function exists in vLLM, its methods and fields are vLLM's."""
    problems: list[str] = []
    for fake_name, (module, real_name) in fake_vllm.REAL_NAMES.items():
        obj = getattr(fake_vllm, fake_name)
        if not inspect.isclass(obj):
            problems += _compare(_fake_signature(obj, False), src.function(module, real_name), fake_name)
            continue
        real = src.cls(module, real_name)
        attrs = real.attributes()
        if dataclasses.is_dataclass(obj):
            problems += [f"fake {fake_name}.{f.name}: vLLM's {real.name} has no such field"
                         for f in dataclasses.fields(obj) if f.name not in attrs]
        elif "__init__" in vars(obj):  # attributes the fake's __init__ sets must be vLLM's (private ones are ours)
            init = ast.parse(inspect.getsource(obj.__init__).strip())
            set_here = {t.attr for t in ast.walk(init) if isinstance(t, ast.Attribute) and isinstance(t.ctx, ast.Store)
                        and isinstance(t.value, ast.Name) and t.value.id == "self"}
            problems += [f"fake {fake_name}.{a}: vLLM's {real.name} has no such attribute"
                         for a in sorted(set_here) if not a.startswith("_") and a not in attrs]
        for name, member in vars(obj).items():
            if not inspect.isfunction(member) or (name.startswith("_") and name != "__init__"):
                continue
            real_sig = real.constructor() if name == "__init__" else real.method(name)
            if real_sig is None:
                problems.append(f"fake {fake_name}.{name}: vLLM's {real.name} has no such method")
                continue
            problems += _compare(_fake_signature(member, True), real_sig, f"{fake_name}.{name}")
    assert not problems, "the fake drifted from vLLM:\n" + "\n".join(problems)


def test_the_check_catches_drift(src: Source) -> None:
    """What the check must reject: calls and payloads vLLM 0.33 does not accept (so a pass means something)."""
    assert call_problems(src, "vllm.LLM.__init__", 0, ("model", "speculative_model"))
    assert call_problems(src, "vllm.LLM.generate", 1, ("use_tqdm", "prompt_token_ids"))
    assert call_problems(src, "vllm.LLM.update_weights_from_tensor", 0, ())
    assert call_problems(src, "vllm.SamplingParams", 0, ("max_new_tokens",))
    # the update payload before this check existed: `packed` moved to the init info in vLLM 0.33
    assert payload_problems(src, NCCL, "NCCLWeightTransferUpdateInfo",
                            {"names": [], "dtype_names": [], "shapes": [], "packed": True})
    assert payload_problems(src, COMMON, "NCCLWeightTransferInitInfo", {"master_address": "h", "master_port": 1})
    assert payload_problems(src, "vllm.config.speculative", "SpeculativeConfig", {"num_lookahead_slots": 2})
    assert "layer_skip" not in src.literal_values("vllm.config.speculative", "SpeculativeMethod")
