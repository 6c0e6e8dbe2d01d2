"""vLLM backend: settings mapping and the recorded call sequence (vLLM cannot run here; see conftest's fake)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from specrl.runtime.api import SpeculativeSpec
from specrl.runtime.engine import SamplingParams
from specrl.runtime.engine.adaptive import AdaptiveController, AdaptiveSettings, CostModel
from specrl.runtime.engine.vllm_backend import (
    VLLMRolloutEngine,
    WeightUpdateInfo,
    schedule_from_controller,
    speculative_config_from_spec,
    validate_per_batch_size,
)


def spec(**kw: Any) -> SpeculativeSpec:
    return SpeculativeSpec.model_validate(kw)


def test_mapping_per_method() -> None:
    assert speculative_config_from_spec(None) is None
    assert speculative_config_from_spec(spec(method="none")) is None
    assert speculative_config_from_spec(spec(method="ngram", numSpeculativeTokens=3)) == {
        "method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    assert speculative_config_from_spec({"method": "ngram", "promptLookupMin": 1, "promptLookupMax": 3}) == {
        "method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
    assert speculative_config_from_spec(spec(method="draft_model", draftModel="/models/bench-draft"),
                                        draft_model_path="/ckpt/draft") == {
        "method": "draft_model", "model": "/ckpt/draft", "num_speculative_tokens": 4}
    assert speculative_config_from_spec(spec(method="eagle3", draftModel="org/head", numSpeculativeTokens=3)) == {
        "method": "eagle3", "model": "org/head", "num_speculative_tokens": 3}
    assert speculative_config_from_spec(spec(method="mtp", numSpeculativeTokens=1)) == {
        "method": "mtp", "num_speculative_tokens": 1}


def test_mapping_rejects_what_vllm_cannot_do() -> None:
    for method in ("layer_skip", "quantized_self"):
        with pytest.raises(ValueError, match=f"speculative.method: '{method}' runs on the native engine only"):
            speculative_config_from_spec(spec(method=method))
    with pytest.raises(ValueError, match="speculative.draftModel"):
        speculative_config_from_spec({"method": "eagle"})
    with pytest.raises(ValueError, match="promptLookupMin"):
        speculative_config_from_spec({"method": "ngram", "promptLookupMin": 4, "promptLookupMax": 2})


def test_per_batch_size_schedule_validation() -> None:
    assert validate_per_batch_size([[1, 4, 4], [5, 16, 2], [17, 256, 0]], 4) == [[1, 4, 4], [5, 16, 2],
                                                                                  [17, 256, 0]]
    with pytest.raises(ValueError, match=r"numSpeculativeTokensPerBatchSize\[1\]: K=5"):
        validate_per_batch_size([[1, 4, 4], [5, 8, 5]], 4)
    with pytest.raises(ValueError, match="ascending and disjoint"):
        validate_per_batch_size([[1, 4, 4], [4, 8, 2]], 4)
    with pytest.raises(ValueError, match="startBs"):
        validate_per_batch_size([[0, 4, 4]], 4)


def memory_bound_model() -> CostModel:
    target = {1: 7.3e-3, 16: 20.8e-3, 64: 60e-3}
    verify = {1: {1: 7.3e-3, 5: 7.3e-3 * 1.57}, 16: {1: 20.8e-3, 5: 20.8e-3 * 2.17}, 64: {1: 60e-3, 5: 60e-3 * 4.8}}
    return CostModel(target_step=target, verify_step=verify,
                     draft_step={"draft_model": {b: 0.06 * t for b, t in target.items()}})


def test_schedule_follows_the_calibrated_toggle() -> None:
    ctrl = AdaptiveController(["draft_model"], cost_model=memory_bound_model(), alpha_priors={"draft_model": 0.85},
                              settings=AdaptiveSettings(max_gamma=8, gamma=4))
    schedule = schedule_from_controller(ctrl, num_speculative_tokens=4, max_num_seqs=128)
    assert schedule[0][:2] == [1, schedule[0][1]] and schedule[0][2] == 4  # capped at the configured K
    assert schedule[-1][1] == 128 and schedule[-1][2] == 0  # large batches: off
    validate_per_batch_size(schedule, 4)
    ks = [k for _, _, k in schedule]
    assert ks == sorted(ks, reverse=True)  # K never grows with the batch size on this machine
    config = speculative_config_from_spec(spec(method="draft_model", draftModel="x"), per_batch_size=schedule,
                                          draft_model_path="/d")
    assert config is not None and config["num_speculative_tokens_per_batch_size"] == schedule


def test_engine_builds_llm_generates_and_converts(fake_vllm_module: Any, vllm_calls: list) -> None:
    ctrl = AdaptiveController(["draft_model"], cost_model=memory_bound_model(), alpha_priors={"draft_model": 0.85})
    engine = VLLMRolloutEngine("/ckpt/policy", spec(method="draft_model", draftModel="/models/bench-draft"),
                               draft_model_path="/ckpt/draft", controller=ctrl, max_num_seqs=32, enforce_eager=True)
    name, kwargs = vllm_calls[0]
    assert name == "LLM" and kwargs["model"] == "/ckpt/policy" and kwargs["enforce_eager"] is True
    assert kwargs["weight_transfer_config"].backend == "nccl"
    assert kwargs["logprobs_mode"] == "processed_logprobs" and kwargs["max_num_seqs"] == 32
    sc = kwargs["speculative_config"]
    assert sc["method"] == "draft_model" and sc["model"] == "/ckpt/draft"
    assert sc["num_speculative_tokens_per_batch_size"] == schedule_from_controller(ctrl, 4, 32)
    assert sc["num_speculative_tokens_per_batch_size"][-1][1] == 32
    params = SamplingParams(temperature=1.0, top_p=0.9, top_k=5, max_new_tokens=2, stop_token_ids=(2,), seed=7)
    outs = engine.generate([[1, 5, 9], [3, 4]], params)
    sent = vllm_calls[1][1]
    assert sent["prompts"] == [{"prompt_token_ids": [1, 5, 9]}, {"prompt_token_ids": [3, 4]}]
    sp = sent["sampling_params"]
    assert (sp.temperature, sp.top_p, sp.top_k, sp.max_tokens, sp.stop_token_ids, sp.seed, sp.logprobs) == (
        1.0, 0.9, 5, 2, [2], 7, 0)
    assert [o.token_ids for o in outs] == [[10, 11], [5, 6]]
    assert outs[0].logprobs == [-0.5, -1.5]  # the sampled token's entry, not the top-1 one
    assert outs[0].finish_reason == "length" and outs[1].prompt_token_ids == [3, 4]
    with pytest.raises(ValueError, match=r"prompts\[1\]"):
        engine.generate([[1], []], params)


def test_weight_update_sequence_includes_the_drafter(fake_vllm_module: Any, vllm_calls: list) -> None:
    engine = VLLMRolloutEngine("/p", spec(method="eagle3", draftModel="org/head"))
    with pytest.raises(RuntimeError, match="init_weight_transfer"):
        engine.update_weights(WeightUpdateInfo([], [], []))
    engine.init_weight_transfer("10.0.0.1", 29600, rank_offset=1, world_size=3)
    policy = WeightUpdateInfo.from_named_tensors([("model.embed_tokens.weight", torch.zeros(4, 2)),
                                                  ("lm_head.weight", torch.zeros(4, 2, dtype=torch.bfloat16))])
    draft = WeightUpdateInfo.from_named_tensors([("fc.weight", torch.zeros(2, 6))])
    with pytest.raises(ValueError, match="update_weights: draft"):
        engine.update_weights(policy, version=1)
    del vllm_calls[:]
    engine.update_weights(policy, draft, version=7)
    assert [c[0] for c in vllm_calls] == [
        "start_weight_update", "update_weights", "finish_weight_update",
        "start_draft_weight_update", "update_weights", "finish_weight_update"]
    assert vllm_calls[1][1] == {"update_info": {"names": ["model.embed_tokens.weight", "lm_head.weight"],
                                                "dtype_names": ["float32", "bfloat16"], "shapes": [[4, 2], [4, 2]]}}
    assert vllm_calls[4][1]["update_info"]["names"] == ["fc.weight"]
    assert vllm_calls[2][1] is None and vllm_calls[5][1] == "7"  # version committed with the drafter
    assert engine.llm.get_weight_version() == "7" and engine.weight_version == "7"


def test_weight_update_without_drafter_weights(fake_vllm_module: Any, vllm_calls: list) -> None:
    engine = VLLMRolloutEngine("/p", spec(method="ngram"))
    engine.init_weight_transfer("h", 1, 1, 2)
    assert vllm_calls[-1] == ("init_weight_transfer_engine", {"init_info": {
        "master_address": "h", "master_port": 1, "rank_offset": 1, "world_size": 2, "packed": True,
        "packed_buffer_size_bytes": 1 << 30, "packed_num_buffers": 2}})
    del vllm_calls[:]
    engine.update_weights(WeightUpdateInfo(["w"], ["float32"], [[1]]), version=2)
    assert [c[0] for c in vllm_calls] == ["start_weight_update", "update_weights", "finish_weight_update"]


def test_missing_vllm_is_a_clear_error(monkeypatch: Any) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "vllm", None)
    with pytest.raises(RuntimeError, match=r"vllm==0.33.0"):
        VLLMRolloutEngine("/p", spec(method="ngram"))


def test_spec_decode_counters_from_vllm_metrics(fake_vllm_module: Any) -> None:
    engine = VLLMRolloutEngine("/p", spec(method="ngram"))
    assert engine.llm._kwargs["disable_log_stats"] is False  # vllm.LLM disables stats by default
    assert engine.stats == {"drafts": 0, "draft_tokens": 0, "accepted_tokens": 0}
    engine.generate([[1, 2], [3]], SamplingParams(max_new_tokens=3))
    assert engine.stats == {"drafts": 6, "draft_tokens": 12, "accepted_tokens": 6}


def test_sender_broadcasts_device_tensors_with_vllms_producer(fake_vllm_module: Any, vllm_calls: list) -> None:
    from specrl.runtime.engine.vllm_backend import VLLMWeightSender

    sender = VLLMWeightSender("10.0.0.1", 29600, world_size=3)
    assert vllm_calls[0] == ("trainer_init", {"init_info": {"master_address": "10.0.0.1", "master_port": 29600,
                                                            "world_size": 3}, "rank": 0})
    w = torch.ones(2, 3)
    info = sender.send([("lm_head.weight", w)])
    assert info.request() == {"update_info": {"names": ["lm_head.weight"], "dtype_names": ["float32"],
                                              "shapes": [[2, 3]]}}
    assert sender.group._broadcasts[0][1] is w  # the tensor itself: no host copy, no clone
