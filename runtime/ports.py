"""Free TCP ports for servers that start a moment after the port is picked.

Asking the kernel for port 0 and closing the socket hands out an *ephemeral* port: the same range the kernel
draws from for every outgoing connection. Between the pick and the server's bind, any process on the host
that connects somewhere (Ray starts a dozen that do) can be given that port as its local end, and the server
then fails with "Address already in use". Picking from below the ephemeral range removes that race: the
kernel never assigns those ports by itself, so only another explicit pick can take one.
"""

from __future__ import annotations

import random
import socket
import threading
from pathlib import Path

# Ray's workers listen on 10002-19999 by default; start above them.
LOW = 20000
_EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_DEFAULT_EPHEMERAL_LOW = 32768  # Linux's default; macOS and Windows start higher

_handed_out: set[int] = set()
_lock = threading.Lock()
_rng = random.Random()


def ephemeral_low() -> int:
    """The first port of the kernel's ephemeral range (its default where the kernel does not say)."""
    try:
        return int(_EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _DEFAULT_EPHEMERAL_LOW


def _bindable(host: str, port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing on `host` is bound to, from below the ephemeral range, never the same twice in a process.

    Falls back to a kernel-assigned port when the range below the ephemeral one is too small to search (a
    host configured with a low ephemeral range)."""
    top = ephemeral_low()
    with _lock:
        for _ in range(200 if top - LOW >= 1000 else 0):
            port = _rng.randrange(LOW, top)
            if port not in _handed_out and _bindable(host, port):
                _handed_out.add(port)
                return port
        while True:
            with socket.socket() as s:
                s.bind((host, 0))
                port = int(s.getsockname()[1])
            if port not in _handed_out:
                _handed_out.add(port)
                return port


def free_ports(n: int, host: str = "127.0.0.1") -> list[int]:
    """`n` distinct free ports."""
    return [free_port(host) for _ in range(n)]
