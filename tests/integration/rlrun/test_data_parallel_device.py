"""Two data-parallel trainer processes over gloo: the gradient all-reduce runs on the gradients' own device.

Each rank trains on half of a batch; after the all-reduce both ranks hold bit-identical weights equal (to float
rounding) to one trainer stepping on the whole batch. The backend follows the device (gloo for CPU tensors); a
backend that cannot move this trainer's tensors (NCCL for CPU gradients, what a GPU job's coordinator used to
request while the model stayed on the CPU) is refused with a clear error instead of failing inside the collective.
"""

from __future__ import annotations

import multiprocessing as mp

import pytest
import torch
from specrl.runtime.devices import collective_backend, device_for, ray_num_gpus
from specrl.runtime.ports import free_port
from specrl.runtime.rl.trainer import Sample, TrainerWorker

from tests.integration.rlrun.micro import micro_settings

pytestmark = pytest.mark.integration


def _samples() -> list[Sample]:
    g = torch.Generator().manual_seed(0)
    out = []
    for i in range(4):
        prompt = torch.randint(3, 40, (5,), generator=g).tolist()
        resp = torch.randint(3, 40, (4 + i,), generator=g).tolist()
        out.append(Sample(prompt_id=f"p{i}", prompt_ids=prompt, response_ids=resp, logprobs=[-1.0] * len(resp),
                          reward=float(i % 2), advantage=1.0 if i % 2 else -1.0))
    return out


def _total_tokens(samples: list[Sample]) -> int:
    return sum(len(s.response_ids) for s in samples)


def _settings(world: int):
    return micro_settings(trainers=world, method="none", drafter_training=False)


def _rank(rank: int, port: int, queue: mp.Queue) -> None:
    torch.set_num_threads(1)
    trainer = TrainerWorker(_settings(2), rank=rank, world_size=2)
    trainer.init_data_parallel("127.0.0.1", port)
    samples = _samples()
    trainer.train_step(samples[rank::2], step=0, total_tokens=_total_tokens(samples))
    # numpy arrays pickle by value (torch tensors would be shared through a file descriptor of this exiting process)
    queue.put((rank, str(trainer.device), {k: v.numpy().copy() for k, v in trainer.model.state_dict().items()}))
    torch.distributed.destroy_process_group()


def test_device_rule_on_cpu() -> None:
    assert device_for(0) == torch.device("cpu")
    assert collective_backend("cpu") == "gloo" and collective_backend("cuda:1") == "nccl"
    assert ray_num_gpus(8, "trainer") == 8 and ray_num_gpus(8, "rollout") == 8 and ray_num_gpus(8, "coordinator") == 0
    with pytest.raises(ValueError, match="device: no collective backend for 'meta'"):
        collective_backend("meta")


@pytest.mark.slow
def test_two_trainers_all_reduce_on_their_own_device(micro) -> None:
    trainer = TrainerWorker(_settings(2), rank=0, world_size=2)
    assert trainer.device == torch.device("cpu")
    with pytest.raises(ValueError, match=r"backend: 'nccl' cannot all-reduce this trainer's cpu gradients"):
        trainer.init_data_parallel("127.0.0.1", 1, backend="nccl")
    # the reference: one trainer, the whole batch
    single = TrainerWorker(_settings(1), rank=0, world_size=1)
    samples = _samples()
    single.train_step(samples, step=0, total_tokens=_total_tokens(samples))
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank, args=(r, port, queue)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        results = {r: (dev, sd) for r, dev, sd in (queue.get(timeout=120) for _ in procs)}
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    assert [p.exitcode for p in procs] == [0, 0]
    assert results[0][0] == results[1][0] == "cpu"
    for name, ref in single.model.state_dict().items():
        a, b = torch.from_numpy(results[0][1][name]), torch.from_numpy(results[1][1][name])
        assert torch.equal(a, b), name  # ranks stay bit-identical
        torch.testing.assert_close(a, ref, rtol=1e-5, atol=1e-6)  # == one trainer stepping on the whole batch
