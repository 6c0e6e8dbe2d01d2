"""One member of a weight-sync group, run as a real process by test_sync_processes.py.

usage: python sync_worker.py SCENARIO RANK PORT
Prints one JSON line with what this member observed; exits non-zero on an unexpected error.
"""

from __future__ import annotations

import json
import os
import sys
import time
from unittest import mock

import torch
from specrl.runtime import sync
from specrl.runtime.metrics import RuntimeMetrics
from specrl.runtime.sync import (
    SyncAborted,
    SyncGroup,
    VersionedWeights,
    WeightReceiver,
    WeightSender,
    merge_states,
    receive_and_swap,
    split_states,
)

BUCKET_MIB = 1 / 64  # 16 KiB: many buckets, and tensors larger than a bucket


def make_state(version: int) -> dict[str, torch.Tensor]:
    """Policy + drafter with every dtype the sync must carry; values depend on the version."""
    g = torch.Generator().manual_seed(version)
    embed = torch.randn(300, 96, generator=g)  # 115 KB: larger than a bucket
    policy = {
        "embed.weight": embed,
        "lm_head.weight": embed,  # tied: sent once, received as two names of the same memory
        "layer.w": torch.randn(64, 33, generator=g).to(torch.bfloat16),
        "layer.w_t": torch.randn(40, 50, generator=g).t(),  # non-contiguous
        "layer.h": torch.randn(17, generator=g).half(),
        "q.int8": torch.randint(-128, 127, (1000,), generator=g, dtype=torch.int8),
        "mask": torch.rand(77, generator=g) > 0.5,
        "scalar": torch.tensor(float(version)),
        "empty": torch.zeros(0, 4),
        **{f"norm.{i}": torch.rand(300, generator=g) for i in range(40)},  # small ones: packed buckets
    }
    drafter = {"fc.weight": torch.randn(96, 192, generator=g), "norm.weight": torch.rand(96, generator=g)}
    return merge_states(policy=policy, drafter=drafter)


def check(got: dict[str, torch.Tensor], version: int) -> bool:
    want = make_state(version)
    return set(got) == set(want) and all(
        got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]) for k in want)


def out(**kw: object) -> None:
    print(json.dumps(kw), flush=True)


def _inject(fail_on_call: int, action) -> None:
    """Make the sender's packing step misbehave on its n-th call (an error, or the process dying)."""
    real_pack, calls = sync._pack, [0]

    def pack(*a, **k):
        calls[0] += 1
        if calls[0] == fail_on_call:
            sync._pack = real_pack
            action()
        return real_pack(*a, **k)

    sync._pack = pack


def _raise() -> None:
    raise RuntimeError("injected packing failure")


def scenario_lifecycle(rank: int, port: int) -> None:
    """trainer-0 sends, rollout-0/1 receive, through every situation a job meets:

    epoch 0, 3 members: v1, v2 ok; v3 aborted by a packing error on the sender; v4 ok on the same group.
    epoch 1, 2 members (rollout-1 drained): v5.   epoch 2, 3 members (rollout-1 joins again): v6.
    v7: rollout-1 dies in the middle; the others fail fast and keep v6.   epoch 3, 2 members: v8.
    v9: the sender process dies in the middle of the buckets; rollout-0 keeps v8.
    """
    names = ["j-trainer-0", "j-rollout-0", "j-rollout-1"]
    me = names[rank]
    role = "trainer" if rank == 0 else "rollout"
    m = RuntimeMetrics("j", "ns", role, me)
    group = SyncGroup.join(names, me, epoch=0, host="127.0.0.1", port=port, timeout_s=30)
    log: list[list] = []
    if rank == 0:
        sender = WeightSender(group, bucket_mib=BUCKET_MIB, metrics=m)

        def send(version: int) -> None:
            try:
                st = sender.send(make_state(version), version)
                log.append([version, "sent", group.world_size, st.buckets, st.bytes])
            except SyncAborted as exc:
                log.append([version, "aborted", group.world_size, exc.group_usable])

        send(1)
        send(2)
        _inject(2, _raise)
        send(3)
        send(4)
        group.rebuild(names[:2], epoch=1)
        send(5)
        group.rebuild(names, epoch=2)
        send(6)
        send(7)  # rollout-1 dies in the middle: we fail and close our end
        closed_after_7 = group.closed
        group.rebuild(names[:2], epoch=3)
        send(8)
        out(rank=rank, log=log, closed_after_7=closed_after_7, sync_bytes=m.sync_bytes._value.get(),
            failures=m.sync_failures._value.get(), version_metric=m.weight_version._value.get())
        _inject(2, lambda: os._exit(0))  # a crashed trainer: no trailer; the kernel closes its sockets
        send(9)
        out(rank=rank, error="the sender survived v9")
        return

    receiver = WeightReceiver(group, metrics=m)
    weights = VersionedWeights()

    def receive() -> None:
        held = weights.current()
        try:
            receive_and_swap(receiver, weights)
            version, state = weights.current()
            parts = split_states(state)
            tied = parts["policy"]["embed.weight"].data_ptr() == parts["policy"]["lm_head.weight"].data_ptr()
            log.append([version, "ok", group.world_size, check(state, version), tied])
        except SyncAborted as exc:
            # atomic: the very same (version, state) object is still installed, and its bytes are intact
            log.append([held[0], "kept", weights.current() is held, check(weights.current()[1], held[0]),
                        exc.group_usable])

    for _ in range(4):  # v1..v4 (v3 aborted)
        receive()
    if me == "j-rollout-1":
        group.close()  # drained; joins again for epoch 2 as a new member would
        group = SyncGroup.join(names, me, epoch=2, host="127.0.0.1", port=port, timeout_s=30)
        receiver = WeightReceiver(group, metrics=m)
    else:
        group.rebuild(names[:2], epoch=1)
        receive()  # v5
        group.rebuild(names, epoch=2)
    receive()  # v6
    if me == "j-rollout-1":
        out(rank=rank, log=log, epoch=group.epoch)
        with mock.patch.object(sync.Layout, "from_json", staticmethod(lambda raw: os._exit(0))):
            receive()  # v7: die after the header
        out(rank=rank, error="rollout-1 survived v7")
        return
    t0 = time.monotonic()
    receive()  # v7: a fellow receiver dies mid-transfer
    unblocked_s = time.monotonic() - t0
    closed_after_7 = group.closed
    group.rebuild(names[:2], epoch=3)
    receive()  # v8
    receive()  # v9: the sender dies
    out(rank=rank, log=log, epoch=group.epoch, failures=m.sync_failures._value.get(), closed_after_7=closed_after_7,
        unblocked_s=unblocked_s, version_metric=m.weight_version._value.get())


if __name__ == "__main__":
    torch.set_num_threads(1)
    scenario, rank, port = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    globals()[f"scenario_{scenario}"](rank, port)
