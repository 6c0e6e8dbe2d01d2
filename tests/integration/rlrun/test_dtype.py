"""spec.model.dtype end to end: "auto" (the default) decodes in the device's native dtype, an explicit float32
pins float32 in the rollout engines too; the trainer computes in float32 for both."""

from __future__ import annotations

import pytest
import torch

from tests.integration.rlrun.micro import micro_settings

pytestmark = pytest.mark.integration


def test_explicit_float32_is_pinned_and_auto_picks_the_device_dtype(micro) -> None:
    from specrl.runtime.api import parse_job
    from specrl.runtime.engine.model_runner import compute_dtype
    from specrl.runtime.rl.settings import RunSettings
    from specrl.runtime.rl.trainer import TrainerWorker
    from specrl.runtime.rollout_worker import RolloutWorker

    doc = {"apiVersion": "specrl.io/v1alpha1", "kind": "RLJob", "metadata": {"name": "j"}}
    assert RunSettings.from_job(parse_job(doc)).dtype == "auto"
    pinned = {**doc, "spec": {"model": {"dtype": "float32"}}}
    assert RunSettings.from_job(parse_job(pinned)).dtype == "float32"

    cpu = torch.device("cpu")
    for dtype, want in (("float32", torch.float32), ("auto", compute_dtype("auto", torch.float32, cpu))):
        s = micro_settings(dtype=dtype, rollouts=1)
        worker = RolloutWorker(s, "micro-rollout-0")
        assert worker.model is not None and worker.ar_engine is not None
        assert next(worker.model.parameters()).dtype == torch.float32
        assert worker.engine.runner.dtype == want and worker.ar_engine.runner.dtype == want, dtype
        assert TrainerWorker(s).compute_dtype == torch.float32
