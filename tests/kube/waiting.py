"""Bounded polling for integration tests: every wait ends, and a timeout says what was awaited."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any


def wait_for(predicate: Callable[[], Any], timeout: float, what: str, interval: float = 0.1,
             debug: Callable[[], Any] | None = None) -> Any:
    """The first truthy value of `predicate()`, polled every `interval` s; AssertionError after `timeout` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:g}s waiting for {what}" + (f": {debug()}" if debug else ""))
        time.sleep(interval)
