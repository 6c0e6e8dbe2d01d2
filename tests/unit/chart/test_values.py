"""values.yaml is fully documented (helm-docs `# --`), and values.schema.json describes exactly its keys."""

from __future__ import annotations

import json
import re
from typing import Any

import jsonschema
import pytest
import yaml

from tests.integration.chart.chart_support import CHART, CI_VALUES

VALUES_TEXT = (CHART / "values.yaml").read_text()
VALUES = yaml.safe_load(VALUES_TEXT)
SCHEMA = json.loads((CHART / "values.schema.json").read_text())


def leaf_paths(node: Any, prefix: str = "") -> list[str]:
    """Dotted paths of the keys a user sets: maps with schema properties are walked, everything else is a leaf."""
    if isinstance(node, dict) and node:
        out = []
        for key, value in node.items():
            out += leaf_paths(value, f"{prefix}.{key}" if prefix else key)
        return out
    return [prefix]


def documented_keys(text: str) -> set[str]:
    """Dotted paths of keys that have a `# --` comment block right above them (helm-docs style)."""
    out: set[str] = set()
    stack: list[tuple[int, str]] = []
    lines = text.splitlines()
    for i, line in enumerate(lines):
        m = re.match(r"^(\s*)([A-Za-z0-9_]+):", line)
        if not m:
            continue
        indent, key = len(m.group(1)), m.group(2)
        while stack and stack[-1][0] >= indent:
            stack.pop()
        path = ".".join([k for _, k in stack] + [key])
        stack.append((indent, key))
        j = i - 1
        while j >= 0 and lines[j].strip().startswith("#") and not lines[j].strip().startswith("# --"):
            j -= 1
        if j >= 0 and lines[j].strip().startswith("# --"):
            out.add(path)
    return out


def schema_node(path: str) -> dict[str, Any] | None:
    node: dict[str, Any] = SCHEMA
    for key in path.split("."):
        props = node.get("properties")
        if props is None or key not in props:
            return None
        node = props[key]
    return node


def test_every_leaf_is_documented() -> None:
    documented = documented_keys(VALUES_TEXT)
    # A leaf is documented on itself or on the free-form map it belongs to (e.g. resources.requests.cpu).
    missing = [p for p in leaf_paths(VALUES)
               if not any(p == d or p.startswith(d + ".") for d in documented)]
    assert not missing, f"values without a `# --` comment: {missing}"


def test_every_value_is_in_the_schema() -> None:
    missing = []
    for path in leaf_paths(VALUES):
        parts = path.split(".")
        # walk as far as the schema declares properties; below a free-form object anything goes
        if not any(schema_node(".".join(parts[:n])) is not None and
                   "properties" not in (schema_node(".".join(parts[:n])) or {"properties": 1})
                   for n in range(1, len(parts) + 1)) and schema_node(path) is None:
            missing.append(path)
    assert not missing, f"values missing from values.schema.json: {missing}"


def test_schema_has_no_stale_keys() -> None:
    def walk(node: dict[str, Any], values: Any, prefix: str) -> list[str]:
        out = []
        for key, sub in (node.get("properties") or {}).items():
            path = f"{prefix}.{key}" if prefix else key
            if not isinstance(values, dict) or key not in values:
                out.append(path)
            elif sub.get("properties"):
                out += walk(sub, values[key], path)
        return out

    assert walk(SCHEMA, VALUES, "") == []


@pytest.mark.parametrize("path", [None, *CI_VALUES], ids=lambda p: p.name if p else "default")
def test_values_validate_against_schema(path: Any) -> None:
    values = VALUES if path is None else merge(VALUES, yaml.safe_load(path.read_text()))
    jsonschema.validate(values, SCHEMA)


def merge(base: Any, over: Any) -> Any:
    if isinstance(base, dict) and isinstance(over, dict):
        return {**base, **{k: merge(base.get(k), v) for k, v in over.items()}}
    return over


@pytest.mark.parametrize(("override", "field"), [
    ({"watchNamespaces": ["Not_A_Namespace"]}, "watchNamespaces"),
    ({"image": {"pullPolicy": "Sometimes"}}, "pullPolicy"),
    ({"image": {"digest": "latest"}}, "digest"),
    ({"operator": {"metricsPort": 0}}, "metricsPort"),
    ({"prometheusRule": {"acceptanceCollapsed": {"threshold": 1.5}}}, "threshold"),
    ({"prometheusRule": {"rolloutStalled": {"for": "ten minutes"}}}, "for"),
    ({"metrics": {"podMonitor": {"portNames": []}}}, "portNames"),
    ({"unknownKey": 1}, "unknownKey"),
    ({"operator": {"typo": 1}}, "typo"),
])
def test_schema_rejects_bad_values(override: dict[str, Any], field: str) -> None:
    with pytest.raises(jsonschema.ValidationError) as err:
        jsonschema.validate(merge(VALUES, override), SCHEMA)
    assert field in str(err.value.message) or field in "/".join(map(str, err.value.absolute_path))
