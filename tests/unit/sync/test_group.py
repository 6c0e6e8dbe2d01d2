"""SyncGroup / WeightSender / WeightReceiver in one process: argument checks and the one-member group."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from specrl.runtime.metrics import RuntimeMetrics
from specrl.runtime.ports import free_port
from specrl.runtime.sync import (
    SyncError,
    SyncGroup,
    WeightReceiver,
    WeightSender,
    flatten_state,
    rendezvous_from_env,
)


@pytest.fixture
def solo() -> Iterator[SyncGroup]:
    group = SyncGroup.join(["j-trainer-0"], "j-trainer-0", host="127.0.0.1", port=free_port(), timeout_s=10)
    yield group
    group.close()


def test_rendezvous_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SPECRL_SYNC_MASTER_ADDR", raising=False)
    monkeypatch.delenv("SPECRL_SYNC_MASTER_PORT", raising=False)
    with pytest.raises(SyncError, match="SPECRL_SYNC_MASTER_ADDR"):
        rendezvous_from_env()
    monkeypatch.setenv("SPECRL_SYNC_MASTER_ADDR", "10.0.0.5")
    monkeypatch.setenv("SPECRL_SYNC_MASTER_PORT", "29500")
    assert rendezvous_from_env() == ("10.0.0.5", 29500)
    assert rendezvous_from_env("h", 1) == ("h", 1)
    monkeypatch.setenv("SPECRL_SYNC_MASTER_PORT", "x")
    with pytest.raises(SyncError, match="SPECRL_SYNC_MASTER_PORT must be an integer"):
        rendezvous_from_env()


def test_bad_arguments_are_named() -> None:
    with pytest.raises(SyncError, match="'mpi'"):
        SyncGroup.create("127.0.0.1", free_port(), rank=0, world_size=1, backend="mpi")
    with pytest.raises(SyncError, match="rank 3 is not in a group of 2"):
        SyncGroup.create("127.0.0.1", free_port(), rank=3, world_size=2)
    with pytest.raises(SyncError, match="'x' is not among"):
        SyncGroup.join(["a", "b"], "x", host="127.0.0.1", port=free_port())
    with pytest.raises(SyncError, match="duplicate"):
        SyncGroup.join(["a", "a"], "a", host="127.0.0.1", port=free_port())
    if not torch.cuda.is_available():
        with pytest.raises(SyncError, match="nccl"):
            SyncGroup.create("127.0.0.1", free_port(), rank=0, world_size=1, backend="nccl", timeout_s=5)


def test_one_member_group_sends_to_nobody_and_counts(solo: SyncGroup) -> None:
    m = RuntimeMetrics("j", "ns", "trainer", "j-trainer-0")
    sender = WeightSender(solo, bucket_mib=1 / 1024, metrics=m)
    state = {"policy/w": torch.randn(100, 30), "policy/b": torch.ones(5, dtype=torch.bfloat16)}
    stats = sender.send(state, version=3)
    assert stats.version == 3 and stats.bytes >= 100 * 30 * 4 and stats.buckets > 10 and stats.gbps > 0
    assert m.sync_bytes._value.get() == stats.bytes and m.weight_version._value.get() == 3
    flat = sender.send(flatten_state(state), version=4)
    assert flat.direct_buckets == flat.buckets  # zero-copy: nothing packed
    with pytest.raises(SyncError, match="non-negative int"):
        sender.send(state, version=-1)
    with pytest.raises(SyncError, match="unsupported dtype"):
        sender.send({"c": torch.ones(2, dtype=torch.complex64)}, version=5)
    assert m.sync_failures._value.get() == 0  # rejected before anything went on the wire


def test_roles_and_rebuild_rules(solo: SyncGroup) -> None:
    with pytest.raises(SyncError, match="cannot run on rank 0"):
        WeightReceiver(solo)
    with pytest.raises(SyncError, match="bucketMiB must be positive"):
        WeightSender(solo, bucket_mib=0)
    with pytest.raises(SyncError, match="new epoch > 0"):
        solo.rebuild(["j-trainer-0"], epoch=0)
    with pytest.raises(SyncError, match="must stay rank 0"):
        solo.rebuild(["j-rollout-0", "j-trainer-0"], epoch=1)
    solo.rebuild(["j-trainer-0"], epoch=1)  # same membership, new epoch: a fresh group
    assert solo.epoch == 1 and WeightSender(solo).send({"w": torch.ones(3)}, 1).bytes == 12
    solo.close()
    with pytest.raises(SyncError, match="closed"):
        solo.broadcast(torch.ones(1))


def test_a_new_epoch_can_host_on_the_same_declared_port() -> None:
    # The operator opens one port (SPECRL_SYNC_MASTER_PORT) for the sender: every membership change re-creates
    # the group there, right after the previous group's store was dropped.
    port = free_port()
    for epoch in range(3):
        group = SyncGroup.create("127.0.0.1", port, rank=0, world_size=1, epoch=epoch, timeout_s=10)
        group.close()
