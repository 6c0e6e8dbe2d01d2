"""A `rolloutEngine: vllm` job's rollout worker and trainer, against the contract-checked fake of vLLM.

The worker builds `VLLMRolloutEngine` from the policy folder and the spec, rolls out through it (target logprobs,
finish reasons, vLLM's spec-decode counters), joins vLLM's NCCL transfer group and refreshes policy and drafter
through vLLM's weight-update API; the trainer streams exactly the tensors the worker's update announces, with
vLLM's own packed producer. (vLLM cannot run here; `tests/contract` pins the fake to vLLM's real source.)
"""

from __future__ import annotations

import pytest
import torch
from specrl.runtime.engine.vllm_backend import VLLMRolloutEngine, named_weights
from specrl.runtime.rl.trainer import TrainerWorker

from tests.contract import fake_vllm
from tests.integration.rlrun.micro import micro_settings

pytestmark = pytest.mark.integration


def test_rollout_worker_builds_and_refreshes_the_vllm_engine(micro, monkeypatch: pytest.MonkeyPatch) -> None:
    from specrl.runtime.rollout_worker import RolloutWorker

    fake_vllm.install(monkeypatch)
    settings = micro_settings(rollout_engine="vllm", gpus_per_pod=1, method="draft_model", adaptive=False,
                              dtype="float32")  # pinned: vLLM and the trainer's stream use it as given
    worker = RolloutWorker(settings, "micro-rollout-0")
    assert isinstance(worker.engine, VLLMRolloutEngine) and worker.model is None  # vLLM holds the weights
    name, llm_kwargs = fake_vllm.CALLS[0]
    assert name == "LLM" and llm_kwargs["model"] == settings.model and llm_kwargs["dtype"] == "float32"
    assert llm_kwargs["speculative_config"] == {"method": "draft_model", "model": settings.draft_model,
                                                "num_speculative_tokens": 3}

    out = worker.generate([("p0", 0), ("p1", 1)], step=0)
    assert len(out["samples"]) == 2 * settings.group_size
    first = out["samples"][0]
    assert first["logprobs"] == [-0.5, -1.5, -2.5][: len(first["response_ids"])]  # the sampled tokens' entries
    assert first["finish_reason"] in ("stop", "length")
    assert out["stats"]["drafts"] > 0 and out["stats"]["accepted_tokens"] > 0  # vLLM's counters, as deltas
    with pytest.raises(RuntimeError, match="use_sd=False"):
        worker.generate([("p0", 0)], step=0, use_sd=False)
    with pytest.raises(RuntimeError, match="only over vLLM's NCCL transfer"):
        worker.set_weights({}, version=1)

    worker.open_sync_group("10.0.0.1", 29600, rank=1, world_size=2, epoch=0)
    assert fake_vllm.CALLS[-1][0] == "init_weight_transfer_engine"
    assert fake_vllm.CALLS[-1][1]["init_info"]["rank_offset"] == 1
    with pytest.raises(ValueError, match="expected_version"):
        worker.receive_weights()
    del fake_vllm.CALLS[:]
    got = worker.receive_weights(4)
    assert [c[0] for c in fake_vllm.CALLS] == ["start_weight_update", "update_weights", "finish_weight_update",
                                               "start_draft_weight_update", "update_weights",
                                               "finish_weight_update"]
    assert fake_vllm.CALLS[-1][1] == "4" and worker.weight_version == 4 and got["version"] == 4
    policy_info = fake_vllm.CALLS[1][1]["update_info"]
    draft_info = fake_vllm.CALLS[4][1]["update_info"]

    # The trainer streams exactly what the worker announced, policy then drafter, with vLLM's producer.
    del fake_vllm.CALLS[:]
    trainer = TrainerWorker(settings, rank=0, world_size=1)
    trainer.open_sync_group("10.0.0.1", 29600, world_size=2, epoch=0)
    sent = trainer.send_weights(4)
    streams = [c[1]["names"] for c in fake_vllm.CALLS if c[0] == "packed_nccl_broadcast_producer"]
    assert streams == [policy_info["names"], draft_info["names"]]
    mine = named_weights(trainer.model, torch.float32)
    assert [list(t.shape) for _, t in mine] == policy_info["shapes"]
    assert sent["bytes"] == got["bytes"] > 0
    trainer.close_sync_group()
    worker.close_sync_group()
    assert ("shutdown_weight_transfer_engine", None) in fake_vllm.CALLS and ("destroy", None) in fake_vllm.CALLS
