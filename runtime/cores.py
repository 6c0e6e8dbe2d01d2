"""The CPU cores this process may run on (its affinity mask, which a container's cpuset narrows)."""

from __future__ import annotations

import os


def available_cores() -> int:
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
