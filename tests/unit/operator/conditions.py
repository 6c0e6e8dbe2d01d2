"""A status condition the test requires (``get_condition`` returns None when there is none)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from specrl.operator.status import get_condition


def require_condition(status: Mapping[str, Any], type_: str) -> dict[str, Any]:
    """The condition of this type; fails the test, naming the conditions present, when there is none."""
    found = get_condition(status, type_)
    assert found is not None, f"no {type_} condition in {status.get('conditions')}"
    return found
