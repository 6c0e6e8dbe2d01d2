"""Plumbing shared by the RLJob models (`api.py`) and the Kubernetes pod fields they embed (`podspec.py`).

A strict camelCase base model (unknown fields and wrong types are refused, as the API server's strict field
validation does), the CEL-rule attachment `crd.py` copies into `x-kubernetes-validations`, the one-error
carrier for cross-field rules with their relative field paths, and Kubernetes quantities.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field
from pydantic.alias_generators import to_camel
from pydantic_core import PydanticCustomError

QUANTITY = re.compile(r"^[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+|[KMGTPE]i?|[mkMGTPE]|n|u)?$")
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
# Bounds on strings, lists and maps: the API server refuses CRDs whose CEL rules have an unbounded estimated cost.
MAX_REF, MAX_PATH, MAX_VALUE, MAX_ITEMS = 256, 4096, 32768, 64


class _Strict(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        strict=True,
        validate_default=False,
        use_attribute_docstrings=False,
    )


# CEL rules attached to a model's schema; crd.py copies them into x-kubernetes-validations.
def _cel(*rules: tuple[str, str, str | None]) -> dict[str, Any]:
    out = []
    for rule, message, field_path in rules:
        entry: dict[str, Any] = {"rule": rule, "message": message}
        if field_path:
            entry["fieldPath"] = field_path
        out.append(entry)
    return {"x-kubernetes-validations": out}


def _raise(problems: list[tuple[str, str]]) -> None:
    """Raise one pydantic error carrying every (relative camelCase field path, message) of a model."""
    if problems:
        summary = "; ".join(f"{field}: {message}" for field, message in problems)
        raise PydanticCustomError("rljob_rule", "{summary}", {"summary": summary, "problems": problems})


def _quantity(value: Any) -> Any:
    # Kubernetes accepts `cpu: 2` and `cpu: "2"` alike (int-or-string); keep the string form.
    if isinstance(value, bool):
        return value
    if isinstance(value, int):
        return str(value)
    return value


Quantity = Annotated[
    str,
    BeforeValidator(_quantity),
    Field(pattern=QUANTITY.pattern, json_schema_extra={"x-kubernetes-int-or-string": True}),
]
