"""Where trainer rank 0 hosts the weight-sync store: the operator's declared port, at the trainer's own address."""

import pytest
from specrl.runtime.rl.trainer import TrainerWorker


@pytest.fixture
def here(monkeypatch: pytest.MonkeyPatch) -> TrainerWorker:
    """A trainer at 10.1.2.3 whose free port is 41234, without a model: only the address logic runs."""
    monkeypatch.setattr(TrainerWorker, "node_address", lambda self: ("10.1.2.3", 41234))
    return TrainerWorker.__new__(TrainerWorker)


def test_declared_port_at_own_address(here, monkeypatch):
    monkeypatch.setenv("SPECRL_SYNC_MASTER_ADDR", "job-trainer-0.job-workers.ml.svc")
    monkeypatch.setenv("SPECRL_SYNC_MASTER_PORT", "29500")
    # The host is this trainer's, not trainer-0's name: after a drain rank 0 may be another pod.
    assert here.sync_address() == ("10.1.2.3", 29500)


def test_free_port_without_the_operator(here, monkeypatch):
    monkeypatch.delenv("SPECRL_SYNC_MASTER_PORT", raising=False)
    assert here.sync_address() == ("10.1.2.3", 41234)


def test_bad_port_names_the_variable(here, monkeypatch):
    monkeypatch.setenv("SPECRL_SYNC_MASTER_PORT", "twenty")
    with pytest.raises(ValueError, match="SPECRL_SYNC_MASTER_PORT"):
        here.sync_address()
