"""What the API server does to a custom resource before it stores it, done offline from a CRD.

`CRDSchema(crd).admit(obj)` runs the same steps as kube-apiserver for one served version: prune unknown
fields (or reject them with `fieldValidation=Strict`), drop nulls of non-nullable fields, apply schema
defaults, validate the openAPIV3Schema (via jsonschema) and evaluate every `x-kubernetes-validations` CEL
rule (via cel-python). It raises `AdmissionError` with `(field path, message)` causes, as a 422 would carry.

Used by the KMock emulator subclass (so `kubectl apply` of a bad RLJob is refused like on a cluster) and by
the CRD tests. Only what the RLJob CRD uses is supported (no transition rules, no `oldSelf`).
"""

from __future__ import annotations

import copy
import json
import re
from dataclasses import dataclass, field
from typing import Any

import celpy
import jsonschema
from specrl.runtime.crd import to_json_schema


class AdmissionError(Exception):
    """The object is invalid; `causes` holds (field path, message) pairs."""

    def __init__(self, causes: list[tuple[str, str]], *, unknown_fields: bool = False):
        self.causes = causes
        self.unknown_fields = unknown_fields  # strict decoding failed (a 400 on the server, not a 422)
        super().__init__("; ".join(f"{f}: {m}" for f, m in causes))


_MISSING = object()


def value_at(obj: Any, path: str) -> Any:
    """The value at a path like `spec.env[0].name` (a sentinel when absent)."""
    cur = obj
    for part in re.findall(r"[^.\[\]]+|\[\d+\]", path):
        if part.startswith("["):
            idx = int(part[1:-1])
            if not isinstance(cur, list) or idx >= len(cur):
                return _MISSING
            cur = cur[idx]
        elif isinstance(cur, dict) and part in cur:
            cur = cur[part]
        else:
            return _MISSING
    return cur


def _join(path: str, key: Any) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else str(key)


@dataclass
class CRDSchema:
    """One served version of a CRD: its schema, printer columns and subresources."""

    crd: dict[str, Any]
    version: str | None = None
    schema: dict[str, Any] = field(init=False)
    printer_columns: list[dict[str, Any]] = field(init=False)
    subresources: dict[str, Any] = field(init=False)
    _validator: Any = field(init=False, repr=False)
    _cel: dict[str, Any] = field(init=False, repr=False, default_factory=dict)
    _memo: dict[tuple[str, str], Any] = field(init=False, repr=False, default_factory=dict)

    def __post_init__(self) -> None:
        versions = self.crd["spec"]["versions"]
        chosen = next((v for v in versions if v["name"] == self.version), None) if self.version else \
            next((v for v in versions if v.get("storage")), versions[0])
        if chosen is None:
            raise KeyError(f"version {self.version} is not served by {self.crd['metadata']['name']}")
        self.version = chosen["name"]
        self.schema = chosen.get("schema", {}).get("openAPIV3Schema", {"type": "object",
                                                                      "x-kubernetes-preserve-unknown-fields": True})
        self.printer_columns = list(chosen.get("additionalPrinterColumns", []))
        self.subresources = dict(chosen.get("subresources") or {})
        self._validator = jsonschema.Draft4Validator(to_json_schema(self.schema))
        self._env = celpy.Environment()

    # ---------------------------------------------------------------------------------------------------
    def admit(self, obj: dict[str, Any], *, field_validation: str = "Strict", old: dict[str, Any] | None = None
              ) -> tuple[dict[str, Any], list[str]]:
        """(the object as it would be stored, warnings); raises AdmissionError.

        With `old` (an update), violations at fields whose value did not change are tolerated, as the API server
        does since validation ratcheting (1.30): an object stored under an older schema can still get status
        writes and unrelated edits.
        """
        obj = json.loads(json.dumps(obj))
        unknown: list[str] = []
        self._prune(self.schema, obj, "", unknown, top=True)
        warnings = [f'unknown field "{p}"' for p in unknown]
        if unknown and field_validation.lower() == "strict":
            raise AdmissionError([(p, "field not declared in schema") for p in unknown], unknown_fields=True)
        if field_validation.lower() == "ignore":
            warnings = []
        self._default(self.schema, obj, top=True)
        causes: list[tuple[str, str]] = []
        for err in sorted(self._schema_errors(obj, old), key=lambda e: list(map(str, e.absolute_path))):
            path = ""
            for key in err.absolute_path:
                path = _join(path, key)
            causes.append((path or "<root>", err.message))
        causes = self._ratchet(causes, obj, old)
        if not causes:
            causes += self._ratchet(self._check_list_maps(self.schema, obj, ""), obj, old)
        if not causes:
            causes += self._ratchet(self._check_cel(self.schema, obj, "", old), obj, old)
        if causes:
            raise AdmissionError(causes)
        return obj, warnings

    def _schema_errors(self, obj: dict[str, Any], old: dict[str, Any] | None) -> list[Any]:
        if old is None:
            return list(self._validator.iter_errors(obj))
        # An update: only the top-level parts that changed are validated (the rest would be ratcheted anyway).
        changed = {k: v for k, v in obj.items() if k in ("spec", "status") and old.get(k, _MISSING) != v}
        skeleton = {k: v for k, v in obj.items() if k not in ("spec", "status")}
        return list(self._validator.iter_errors({**skeleton, **changed}))

    @staticmethod
    def _ratchet(causes: list[tuple[str, str]], new: dict[str, Any], old: dict[str, Any] | None
                 ) -> list[tuple[str, str]]:
        if old is None:
            return causes
        return [c for c in causes if value_at(new, c[0]) != value_at(old, c[0])]

    # ---------------------------------------------------------------------------------------------------
    def _prune(self, schema: dict[str, Any], value: Any, path: str, unknown: list[str], top: bool = False) -> None:
        if isinstance(value, dict):
            props = schema.get("properties")
            extra = schema.get("additionalProperties")
            for key in list(value):
                if top and key in ("apiVersion", "kind", "metadata"):
                    continue
                sub = props.get(key) if props is not None else (extra if isinstance(extra, dict) else None)
                if value[key] is None and not (sub or {}).get("nullable"):
                    del value[key]  # nulls of non-nullable fields are dropped, not rejected
                    continue
                if sub is None:
                    if props is not None and not schema.get("x-kubernetes-preserve-unknown-fields"):
                        unknown.append(_join(path, key))
                        del value[key]
                    continue
                self._prune(sub, value[key], _join(path, key), unknown)
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                self._prune(schema["items"], item, _join(path, i), unknown)

    def _default(self, schema: dict[str, Any], value: Any, top: bool = False) -> None:
        if isinstance(value, dict):
            for key, sub in (schema.get("properties") or {}).items():
                if top and key == "metadata":
                    continue
                if key not in value and "default" in sub:
                    value[key] = copy.deepcopy(sub["default"])
                if key in value:
                    self._default(sub, value[key])
            extra = schema.get("additionalProperties")
            if isinstance(extra, dict) and "properties" not in schema:
                for item in value.values():
                    self._default(extra, item)
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            for item in value:
                self._default(schema["items"], item)

    def _check_list_maps(self, schema: dict[str, Any], value: Any, path: str) -> list[tuple[str, str]]:
        """`x-kubernetes-list-type: map` lists must not repeat a key (the server says "Duplicate value")."""
        causes: list[tuple[str, str]] = []
        if isinstance(value, list) and schema.get("x-kubernetes-list-type") == "map":
            keys = schema.get("x-kubernetes-list-map-keys", [])
            seen: set[tuple[Any, ...]] = set()
            for i, item in enumerate(value):
                key = tuple(item.get(k) for k in keys) if isinstance(item, dict) else (item,)
                if key in seen:
                    causes.append((_join(_join(path, i), keys[0] if len(keys) == 1 else ""),
                                   f"Duplicate value: {dict(zip(keys, key))}"))
                seen.add(key)
        if isinstance(value, dict):
            props = schema.get("properties") or {}
            for key, item in value.items():
                if key in props:
                    causes += self._check_list_maps(props[key], item, _join(path, key))
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                causes += self._check_list_maps(schema["items"], item, _join(path, i))
        return causes

    # ---------------------------------------------------------------------------------------------------
    def _program(self, rule: str) -> Any:
        if rule not in self._cel:
            self._cel[rule] = self._env.program(self._env.compile(rule))
        return self._cel[rule]

    def _evaluate(self, rule: str, schema: dict[str, Any], value: Any) -> Any:
        # celpy walks a parse tree in Python (~1 ms a rule): memoise by the value the rule sees.
        key = (rule, json.dumps(value, sort_keys=True, default=str))
        if key not in self._memo:
            if len(self._memo) > 50000:
                self._memo.clear()
            try:
                self._memo[key] = bool(self._program(rule).evaluate({"self": celpy.json_to_cel(_typed(schema, value))}))
            except Exception as exc:  # noqa: BLE001 - a rule that cannot run is reported like the server does
                self._memo[key] = exc
        return self._memo[key]

    def _check_cel(self, schema: dict[str, Any], value: Any, path: str, old: Any = _MISSING) -> list[tuple[str, str]]:
        causes: list[tuple[str, str]] = []
        if old is not _MISSING and old == value:
            return causes  # ratcheting: an unchanged subtree is not re-validated
        for rule in schema.get("x-kubernetes-validations", []):
            ok = self._evaluate(rule["rule"], schema, value)
            if isinstance(ok, Exception):
                causes.append((path or "<root>", f"rule {rule['rule']!r} failed to evaluate: {ok}"))
                continue
            if not bool(ok) or isinstance(ok, Exception):
                where = path + rule.get("fieldPath", "") if rule.get("fieldPath") else (path or "<root>")
                causes.append((where.lstrip("."), rule.get("message") or f"failed rule: {rule['rule']}"))
        def sub_old(key: Any) -> Any:
            if isinstance(old, dict) and not isinstance(key, int):
                return old.get(key, _MISSING)
            if isinstance(old, list) and isinstance(key, int) and key < len(old):
                return old[key]
            return _MISSING

        if isinstance(value, dict):
            for key, sub in (schema.get("properties") or {}).items():
                if key in value and not (path == "" and key == "metadata"):
                    causes += self._check_cel(sub, value[key], _join(path, key), sub_old(key))
            extra = schema.get("additionalProperties")
            if isinstance(extra, dict) and "properties" not in schema:
                for key, item in value.items():
                    causes += self._check_cel(extra, item, _join(path, key), sub_old(key))
        elif isinstance(value, list) and isinstance(schema.get("items"), dict):
            for i, item in enumerate(value):
                causes += self._check_cel(schema["items"], item, _join(path, i), sub_old(i))
        return causes


def _typed(schema: dict[str, Any], value: Any) -> Any:
    """JSON value -> value typed as CEL sees it on the server (`type: number` is always a double)."""
    if schema.get("type") == "number" and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if isinstance(value, dict):
        props = schema.get("properties") or {}
        more = schema.get("additionalProperties")
        extra: dict[str, Any] = more if isinstance(more, dict) else {}
        return {k: _typed(props.get(k, extra), v) for k, v in value.items()}
    if isinstance(value, list):
        item = schema.get("items")
        items: dict[str, Any] = item if isinstance(item, dict) else {}
        return [_typed(items, v) for v in value]
    return value
