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

# Kubernetes' own quantity pattern (the one controller-gen puts on resource.Quantity fields): the CRD carries it
# too, so "lots" or "5K" (decimal kilo is k) fail on `kubectl apply`, not when the operator creates the pods.
QUANTITY = re.compile(r"^(\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))(([KMGTPE]i)|[numkMGTPE]|([eE](\+|-)?(([0-9]+(\.[0-9]*)?)|(\.[0-9]+))))?$")
ENV_NAME = re.compile(r"^[-._a-zA-Z][-._a-zA-Z0-9]*$")
DNS1123_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
DNS1123_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
# Label keys (and annotation keys, resource names) are qualified names: [DNS subdomain prefix '/'] name, the name
# at most 63 characters; label values at most 63 characters of the same set, or empty (apimachinery's rules).
MAX_LABEL = 63
LABEL_NAME = re.compile(r"^([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]$")
LABEL_VALUE = re.compile(r"^(([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9])?$")
# The same for CEL rules on map keys (which the schema cannot constrain): RE2, with the name's length in the
# pattern; `[.]` since CEL strings have no `\.` escape. The prefix's 253-character bound is left to pydantic.
QUALIFIED_NAME_CEL = ("^([a-z0-9]([-a-z0-9]*[a-z0-9])?([.][a-z0-9]([-a-z0-9]*[a-z0-9])?)*/)?"
                      "([A-Za-z0-9][-A-Za-z0-9_.]{0,61})?[A-Za-z0-9]$")
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


# The pattern is repeated for the schema: pydantic leaves a constraint behind a BeforeValidator out of it.
Quantity = Annotated[
    str,
    BeforeValidator(_quantity),
    Field(pattern=QUANTITY.pattern, json_schema_extra={"x-kubernetes-int-or-string": True,
                                                       "pattern": QUANTITY.pattern}),
]


LabelValue = Annotated[str, Field(max_length=MAX_LABEL, pattern=LABEL_VALUE.pattern)]
