"""Where trainer rank 0 hosts the weight-sync store: the operator's declared port, at the trainer's own address."""

from types import SimpleNamespace

import pytest
from specrl.runtime.rl.trainer import TrainerWorker

HERE = SimpleNamespace(node_address=lambda: ("10.1.2.3", 41234))


def test_declared_port_at_own_address(monkeypatch):
    monkeypatch.setenv("SPECRL_SYNC_MASTER_ADDR", "job-trainer-0.job-workers.ml.svc")
    monkeypatch.setenv("SPECRL_SYNC_MASTER_PORT", "29500")
    # The host is this trainer's, not trainer-0's name: after a drain rank 0 may be another pod.
    assert TrainerWorker.sync_address(HERE) == ("10.1.2.3", 29500)


def test_free_port_without_the_operator(monkeypatch):
    monkeypatch.delenv("SPECRL_SYNC_MASTER_PORT", raising=False)
    assert TrainerWorker.sync_address(HERE) == ("10.1.2.3", 41234)


def test_bad_port_names_the_variable(monkeypatch):
    monkeypatch.setenv("SPECRL_SYNC_MASTER_PORT", "twenty")
    with pytest.raises(ValueError, match="SPECRL_SYNC_MASTER_PORT"):
        TrainerWorker.sync_address(HERE)
