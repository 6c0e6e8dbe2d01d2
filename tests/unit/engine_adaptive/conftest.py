"""Fixtures: the recording fake of vLLM's API (tests/contract/fake_vllm.py, checked against vLLM's real source)."""

from __future__ import annotations

import types
from typing import Any

import pytest

from tests.contract import fake_vllm


@pytest.fixture
def fake_vllm_module(monkeypatch: Any) -> types.ModuleType:
    return fake_vllm.install(monkeypatch)


@pytest.fixture
def vllm_calls() -> list[tuple[str, Any]]:
    return fake_vllm.CALLS
