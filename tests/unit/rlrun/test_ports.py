import socket

import pytest
from specrl.runtime import ports


def test_ports_come_from_below_the_ephemeral_range_and_are_never_handed_out_twice() -> None:
    top = ports.ephemeral_low()
    picked = ports.free_ports(50)
    assert len(set(picked)) == 50
    assert all(ports.LOW <= p < top for p in picked), (top, picked)
    with socket.socket() as s:  # free means a server can bind it
        s.bind(("127.0.0.1", picked[0]))


def test_a_taken_port_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        taken = held.getsockname()[1]
        real, draws = ports._rng.randrange, [taken]
        monkeypatch.setattr(ports, "ephemeral_low", lambda: 65536)
        monkeypatch.setattr(ports, "LOW", 1024)
        monkeypatch.setattr(ports._rng, "randrange", lambda lo, hi: draws.pop() if draws else real(lo, hi))
        assert ports.free_port() != taken
        assert not draws  # the taken port was drawn first, and refused


def test_a_low_ephemeral_range_falls_back_to_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    kernel_low = ports.ephemeral_low()
    monkeypatch.setattr(ports, "ephemeral_low", lambda: ports.LOW + 10)
    port = ports.free_port()
    assert 0 < port < 65536
    assert port >= kernel_low  # the kernel's pick, not one from the 10 ports below its range
