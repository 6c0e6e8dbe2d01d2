"""The pinned vLLM's source tree, shared by the contract checks (downloaded once, cached in ~/.cache/specrl)."""

from __future__ import annotations

import pytest

from tests.contract.vllm_source import Source, SourceUnavailable, vllm_tree


@pytest.fixture(scope="session")
def src() -> Source:
    try:
        return Source(vllm_tree())
    except SourceUnavailable as exc:
        pytest.skip(f"vLLM contract NOT checked: {exc} (needs network access to PyPI once; cached afterwards)")
