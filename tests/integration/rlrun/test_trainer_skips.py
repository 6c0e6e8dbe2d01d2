"""The trainer does not run samples whose loss is identically zero (advantage 0, no KL term), and the gradient is
the one training on every sample gives (compared as gradients: Adam's first steps are sign-like, so float-order
noise in near-zero components would show up at the learning rate's scale in the weights)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.integration.rlrun.micro import micro_settings

pytestmark = pytest.mark.integration


def _grad(p: torch.nn.Parameter) -> torch.Tensor:
    assert p.grad is not None
    return p.grad


def _samples(seed: int):
    from specrl.runtime.rl.trainer import Sample

    rng = random.Random(seed)
    out = []
    for g in range(6):  # groups 0 and 3 all scored the same: advantage 0 for their 4 samples
        for k in range(4):
            adv = 0.0 if g % 3 == 0 else rng.choice([-1.0, 1.0]) * rng.uniform(0.2, 1.5)
            response = [rng.randrange(3, 40) for _ in range(rng.randint(2, 12))]
            out.append(Sample(prompt_id=f"s0-p{g}", prompt_ids=[1] + [rng.randrange(3, 40) for _ in range(5)],
                              response_ids=response, logprobs=[-1.0] * len(response), reward=float(adv > 0),
                              advantage=adv))
    return out


@pytest.mark.parametrize("mini_batches", [1, 3])
def test_zero_advantage_samples_are_skipped_without_changing_the_update(micro, monkeypatch, mini_batches) -> None:
    import specrl.runtime.rl.trainer as trainer_module
    from specrl.runtime.rl.trainer import TrainerWorker

    s = micro_settings(lr=1e-2, micro_batch=4, mini_batches=mini_batches, drafter_training=False, method="none")
    samples = _samples(0)
    total = sum(len(x.response_ids) for x in samples)

    skipping = TrainerWorker(s)
    out = skipping.train_step(samples, step=0, total_tokens=total)
    assert out["samples_run"] == 16 and out["samples"] == 24

    monkeypatch.setattr(trainer_module, "contributes", lambda _sample: True)
    everything = TrainerWorker(s)
    ref = everything.train_step(samples, step=0, total_tokens=total)
    assert ref["samples_run"] == 24

    scale = max(float(_grad(p).abs().max()) for p in everything.model.parameters())
    assert scale > 0  # the update did something
    for (name, a), b in zip(skipping.model.named_parameters(), everything.model.parameters()):
        assert torch.allclose(_grad(a), _grad(b), rtol=1e-4, atol=1e-6 * scale), name

    # a step where nothing contributes still takes its optimizer step on zero gradients, as before: Adam's
    # momentum moves the weights the same way
    flat = [x for x in _samples(1) if x.advantage == 0.0]
    monkeypatch.undo()
    skipping.train_step(flat, 1, total)
    monkeypatch.setattr(trainer_module, "contributes", lambda _sample: True)
    everything.train_step(flat, 1, total)
    for (name, a), b in zip(skipping.model.named_parameters(), everything.model.parameters()):
        assert float(_grad(a).abs().max()) == 0.0 == float(_grad(b).abs().max()), name
