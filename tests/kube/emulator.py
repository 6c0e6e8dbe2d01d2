"""A KMock `KubernetesEmulator` that behaves enough like kube-apiserver for kopf, kubectl and helm.

KMock 0.8 stores objects as plain JSON and merges patches; this subclass adds what a real API server does
and what the operator relies on (the gaps listed in shared/TESTING.md):

- metadata: `uid`, `creationTimestamp`, `generation` (bumped only when something outside metadata/status
  changes), a global, monotonically increasing `resourceVersion`; `generateName`;
- lists with `kind: <Kind>List`, `apiVersion` and the list's `resourceVersion`; label selectors (equality
  and set-based) and field selectors on list, watch and deletecollection;
- watch resuming from `resourceVersion` (events are replayed from a bounded log), `timeoutSeconds`;
- patch types: JSON merge patch, JSON patch, strategic merge patch (lists of named items merged by name,
  `$`-directives dropped), server-side apply (as a merge), `PUT` replace, `resourceVersion` preconditions
  (409 Conflict), `dryRun=All`;
- the status subresource: writes to the main resource ignore `status`, writes to `/status` change only
  `status`; deletion with finalizers (`deletionTimestamp`, removal when the last finalizer goes);
- ownerReference garbage collection (background; `propagationPolicy: Orphan` honoured), namespace deletion
  removing the namespace's objects, 404 for objects in namespaces that do not exist;
- CustomResourceDefinitions: creating one (e.g. `kubectl apply -f crds/`) serves its resource (discovery,
  short names, categories, status subresource) and validates its objects like the server (pruning or
  strict unknown fields, defaults, openAPIV3Schema, CEL rules; see `schema.py`); `kubectl get` gets
  server-side Tables with the CRD's printer columns;
- OpenAPI v3 for custom resources: `kubectl explain rljob.spec...` works, and plain `kubectl apply -f job.yaml`
  (no `--validate=false`) validates RLJobs server-side with strict field validation. Built-in kinds have no
  OpenAPI here: apply them with `--validate=false`. `kubectl create <kind>` sends protobuf (answered 415).
- core discovery at `/api/v1` reports `groupVersion: v1`; Namespace objects at `/api/v1/namespaces/<name>`;
  Services get a `clusterIP`, Pods start `Pending`, Namespaces are `Active`;
- speed: KMock's reaction matching re-filters every past request (quadratic); this subclass consults only the
  reactions a test added and dispatches the rest directly (a few ms a request after thousands of requests).

Every request is still recorded in `emulator.requests` (KMock), and KMock reactions still take precedence
(e.g. `emulator['post /api/v1/namespaces/default/pods'] << 403` to inject a failure); state changes happen
only in the fallback handlers, so an intercepted request changes nothing, as on a real server.
"""

from __future__ import annotations

import asyncio
import collections
import datetime as dt
import json
import re
import secrets
import uuid
from collections.abc import AsyncIterator, Callable, Iterable
from typing import Any

import aiohttp.web
import attrs
import jsonpatch
import kmock
import yaml
from kmock._internal import parsing, rendering
from kmock._internal.k8s import (
    KubernetesError,
    KubernetesObjectNotFoundError,
    KubernetesResourceNotFoundError,
)

from tests.kube.schema import AdmissionError, CRDSchema

VERBS = ["create", "delete", "deletecollection", "get", "list", "patch", "update", "watch"]

# (group/version/plural, kind, namespaced, short names, subresources) of the built-in kinds the operator,
# kopf, kubectl and helm touch. Custom resources come from CRD objects (see `register_crd`).
BUILTINS: list[tuple[str, str, bool, tuple[str, ...], tuple[str, ...]]] = [
    ("v1/namespaces", "Namespace", False, ("ns",), ("status",)),
    ("v1/nodes", "Node", False, ("no",), ("status",)),
    ("v1/pods", "Pod", True, ("po",), ("status", "log", "eviction")),
    ("v1/services", "Service", True, ("svc",), ("status",)),
    ("v1/endpoints", "Endpoints", True, ("ep",), ()),
    ("v1/configmaps", "ConfigMap", True, ("cm",), ()),
    ("v1/secrets", "Secret", True, (), ()),
    ("v1/serviceaccounts", "ServiceAccount", True, ("sa",), ()),
    ("v1/persistentvolumeclaims", "PersistentVolumeClaim", True, ("pvc",), ("status",)),
    ("v1/events", "Event", True, ("ev",), ()),
    ("events.k8s.io/v1/events", "Event", True, ("ev",), ()),
    ("apps/v1/deployments", "Deployment", True, ("deploy",), ("status", "scale")),
    ("apps/v1/statefulsets", "StatefulSet", True, ("sts",), ("status", "scale")),
    ("apps/v1/replicasets", "ReplicaSet", True, ("rs",), ("status", "scale")),
    ("rbac.authorization.k8s.io/v1/roles", "Role", True, (), ()),
    ("rbac.authorization.k8s.io/v1/rolebindings", "RoleBinding", True, (), ()),
    ("rbac.authorization.k8s.io/v1/clusterroles", "ClusterRole", False, (), ()),
    ("rbac.authorization.k8s.io/v1/clusterrolebindings", "ClusterRoleBinding", False, (), ()),
    ("coordination.k8s.io/v1/leases", "Lease", True, (), ()),
    ("policy/v1/poddisruptionbudgets", "PodDisruptionBudget", True, ("pdb",), ("status",)),
    ("apiextensions.k8s.io/v1/customresourcedefinitions", "CustomResourceDefinition", False,
     ("crd", "crds"), ("status",)),
]
IN_ALL = {"v1/pods", "v1/services", "apps/v1/deployments", "apps/v1/statefulsets", "apps/v1/replicasets"}
DEFAULT_NAMESPACES = ("default", "kube-system", "kube-public")
TABLE_ACCEPT = re.compile(r"as=Table")
_NAMESPACE_PATH = re.compile(r"^/api/v1/namespaces(?:/([^/]+))?(?:/(status|finalize))?/?$")


def _clone(obj: Any) -> Any:
    """A deep copy of JSON data (several times faster than copy.deepcopy)."""
    return json.loads(json.dumps(obj))


def _now() -> str:
    return dt.datetime.now(tz=dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _gv(res: kmock.resource) -> str:
    return f"{res.group}/{res.version}" if res.group else str(res.version)


def _status(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> KubernetesError:
    return KubernetesError(status=code, reason=reason, message=message, details=details or {})


# KMock routes resource (and object) requests here only when the URL names one; these say so to the type checker.
def _resource_of(request: rendering.Request) -> kmock.resource:
    if request.resource is None:
        raise _status(404, "NotFound", f"{request.url.path} names no resource")
    return request.resource


def _name_of(request: rendering.Request) -> str:
    if request.name is None:
        raise _status(404, "NotFound", f"{request.url.path} names no object")
    return request.name


def human_age(created: str | None) -> str:
    """Age like kubectl prints it (`45s`, `3m12s`, `17m`, `5h3m`, `2d`)."""
    if not created:
        return "<unknown>"
    try:
        then = dt.datetime.strptime(created, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=dt.timezone.utc)
    except ValueError:
        return "<invalid>"
    s = max(0, int((dt.datetime.now(tz=dt.timezone.utc) - then).total_seconds()))
    if s < 120:
        return f"{s}s"
    m = s // 60
    if m < 10:
        return f"{m}m{s % 60}s" if s % 60 else f"{m}m"
    if m < 180:
        return f"{m}m"
    h = m // 60
    if h < 8:
        return f"{h}h{m % 60}m" if m % 60 else f"{h}h"
    if h < 48:
        return f"{h}h"
    return f"{h // 24}d"


# ------------------------------------------------------------------------------------------------------------
# Selectors

_SET_EXPR = re.compile(r"^\s*([^\s!=()]+)\s+(in|notin)\s+\(([^)]*)\)\s*$")


def _split_selector(text: str) -> list[str]:
    parts, depth, cur = [], 0, ""
    for ch in text:
        if ch == "(":
            depth += 1
        elif ch == ")":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    if cur.strip():
        parts.append(cur)
    return [p.strip() for p in parts if p.strip()]


def label_selector(text: str | None) -> Callable[[dict[str, str]], bool]:
    """A predicate over labels for a Kubernetes label selector string; raises ValueError when malformed."""
    if not text:
        return lambda labels: True
    # Each predicate takes the labels; the lambdas bind their clause through default arguments.
    tests: list[Callable[..., bool]] = []
    for part in _split_selector(text):
        if m := _SET_EXPR.match(part):
            key, op, values = m.group(1), m.group(2), {v.strip() for v in m.group(3).split(",") if v.strip()}
            if op == "in":
                tests.append(lambda lb, k=key, vs=values: k in lb and lb[k] in vs)
            else:
                tests.append(lambda lb, k=key, vs=values: k not in lb or lb[k] not in vs)
        elif "!=" in part:
            key, value = (s.strip() for s in part.split("!=", 1))
            tests.append(lambda lb, k=key, v=value: lb.get(k) != v)
        elif "=" in part:
            key, value = (s.strip() for s in part.replace("==", "=").split("=", 1))
            tests.append(lambda lb, k=key, v=value: lb.get(k) == v)
        elif part.startswith("!"):
            tests.append(lambda lb, k=part[1:].strip(): k not in lb)  # noqa: B008 - bound per clause
        elif re.fullmatch(r"[A-Za-z0-9._/-]+", part):
            tests.append(lambda lb, k=part: k in lb)
        else:
            raise ValueError(f"unable to parse requirement: {part!r}")
    return lambda labels: all(t(labels) for t in tests)


def _field(obj: dict[str, Any], dotted: str) -> Any:
    cur: Any = obj
    for key in dotted.strip(".").split("."):
        if not isinstance(cur, dict):
            return None
        cur = cur.get(key)
    return cur


def field_selector(text: str | None) -> Callable[[dict[str, Any]], bool]:
    if not text:
        return lambda obj: True
    tests = []
    for part in _split_selector(text):
        neg = "!=" in part
        key, value = (s.strip() for s in part.replace("==", "=").split("!=" if neg else "=", 1))
        tests.append(lambda o, k=key, v=value, n=neg: (str(_field(o, k) if _field(o, k) is not None else "") != v)
                     if n else (str(_field(o, k) if _field(o, k) is not None else "") == v))
    return lambda obj: all(t(obj) for t in tests)


# ------------------------------------------------------------------------------------------------------------
# Patches


def merge_patch(target: Any, patch: Any) -> Any:
    """RFC 7386 JSON merge patch."""
    if not isinstance(patch, dict):
        return _clone(patch)
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if value is None:
            out.pop(key, None)
        else:
            out[key] = merge_patch(out.get(key), value)
    return out


_MERGE_KEYS = ("name", "containerPort", "port", "mountPath", "type", "uid", "ip", "devicePath")


def strategic_merge_patch(target: Any, patch: Any) -> Any:
    """Strategic merge patch, approximated: named-item lists merge by their key, `$` directives are dropped."""
    if not isinstance(patch, dict):
        if isinstance(patch, list) and isinstance(target, list):
            key = next((k for k in _MERGE_KEYS if patch and all(isinstance(i, dict) and k in i for i in patch)
                        and all(isinstance(i, dict) and k in i for i in target)), None)
            if key is not None:
                merged = [_clone(i) for i in target]
                index = {i[key]: n for n, i in enumerate(merged)}
                for item in patch:
                    if item.get("$patch") == "delete":
                        merged = [m for m in merged if m[key] != item[key]]
                        index = {i[key]: n for n, i in enumerate(merged)}
                    elif item[key] in index:
                        merged[index[item[key]]] = strategic_merge_patch(merged[index[item[key]]], item)
                    else:
                        merged.append(strategic_merge_patch({}, item))
                        index[item[key]] = len(merged) - 1
                return merged
        return _clone(patch)
    if patch.get("$patch") == "replace":
        return {k: v for k, v in patch.items() if not k.startswith("$")}
    out = dict(target) if isinstance(target, dict) else {}
    for key, value in patch.items():
        if key.startswith("$"):
            continue
        if value is None:
            out.pop(key, None)
        else:
            out[key] = strategic_merge_patch(out.get(key), value)
    return out


# ------------------------------------------------------------------------------------------------------------
# The emulator


@attrs.define(eq=False)  # hashed by identity: kept in a set
class _Watcher:
    resource: kmock.resource
    namespace: str | None
    name: str | None
    labels: Callable[[dict[str, str]], bool]
    fields: Callable[[dict[str, Any]], bool]
    queue: asyncio.Queue[dict[str, Any] | None] = attrs.field(factory=asyncio.Queue)

    def wants(self, obj: dict[str, Any]) -> bool:
        meta = obj.get("metadata", {})
        return ((self.namespace is None or meta.get("namespace") == self.namespace)
                and (self.name is None or meta.get("name") == self.name)
                and self.labels(meta.get("labels") or {}) and self.fields(obj))


@attrs.define(kw_only=True)
class Emulator(kmock.KubernetesEmulator):
    """KMock's emulator with the API-server behaviour described in the module docstring."""

    strict_namespaces: bool = True  # 404 for objects in namespaces that do not exist, as on a cluster
    event_log_size: int = 20000  # watch events kept for resuming from a resourceVersion

    _rv: int = attrs.field(default=0, init=False)
    _schemas: dict[kmock.resource, CRDSchema] = attrs.field(factory=dict, init=False)
    _watchers: set[_Watcher] = attrs.field(factory=set, init=False)
    _log: collections.deque[tuple[int, kmock.resource, dict[str, Any]]] = attrs.field(init=False)
    _mutex: asyncio.Lock = attrs.field(factory=asyncio.Lock, init=False)
    _ips: int = attrs.field(default=10, init=False)
    _own_payloads: set[int] = attrs.field(factory=set, init=False)

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        self._log = collections.deque(maxlen=self.event_log_size)
        # Above KMock's own fallbacks (`** 1`), below every reaction a test declares.
        (self.fallback ** 1)["get", re.compile(r"^/api/v1/?$")] << self._serve_core_v1
        (self.fallback ** 1)["get", re.compile(r"^/openapi/v3/?$")] << self._serve_openapi_root
        (self.fallback ** 1)["get", re.compile(r"^/openapi/v3/apis/[^/]+/[^/]+/?$")] << self._serve_openapi_gv
        self.fallback[kmock.method.PUT] << self._serve_replace
        self.fallback[kmock.method.DELETE] << self._serve_delete
        for path, kind, namespaced, short, subs in BUILTINS:
            self.resources[path] = kmock.ResourceInfo(kind=kind, singular=kind.lower(), namespaced=namespaced,
                                                      verbs=set(VERBS), shortnames=set(short),
                                                      subresources=set(subs),
                                                      categories={"all"} if path in IN_ALL else set())
        self._own_payloads = {id(p) for p in self._payloads}  # everything registered so far is ours
        for ns in DEFAULT_NAMESPACES:
            self._store(kmock.resource("v1/namespaces"), None, ns, self._stamp({
                "apiVersion": "v1", "kind": "Namespace", "metadata": {"name": ns},
                "spec": {"finalizers": ["kubernetes"]}, "status": {"phase": "Active"}}))

    # --------------------------------------------------------------------------------------------------
    # Bypass KMock's own state handling: reactions first, then our fallbacks change the state.
    #
    # KMock decides by testing `request in reaction` for every reaction, and that re-filters every request the
    # server has ever seen: quadratic, ~100 ms per request after a few hundred. So only the reactions a test
    # added are consulted that way (usually none); everything else is dispatched directly.
    async def _handle(self, request: rendering.Request) -> Any:
        if "protobuf" in request.headers.get("Content-Type", ""):
            raise _status(415, "UnsupportedMediaType", "the emulator speaks JSON only: use `kubectl apply -f` "
                          "(`kubectl create <kind>` sends protobuf)")
        reactions = [p for p in self._payloads if id(p) not in self._own_payloads]
        if reactions:
            width = max(len(p.priorities) for p in reactions)
            ranked = sorted(reactions, key=lambda p: tuple(-x for x in p.priorities) + (0,) * (width - len(p.priorities)))
            for payload in ranked:
                if request in payload._source and not payload._disabled.is_set():
                    try:
                        return await payload(request)
                    except rendering.ReactionMismatchError:
                        payload._disabled.set()
                    except NotImplementedError:
                        pass
        result = await self._dispatch(request)
        if isinstance(result, aiohttp.web.StreamResponse):
            return result
        response = result if isinstance(result, rendering.Response) else rendering.Response(payload=result)
        return await response(request)

    async def _dispatch(self, request: rendering.Request) -> Any:
        path = request.url.path.rstrip("/") or "/"
        if request.resource is None or request.resource.plural is None:
            if request.method != kmock.method.GET:
                raise _status(405, "MethodNotAllowed", f"{request.method.value} {path} is not supported")
            if path == "/api/v1":
                return await self._serve_core_v1(request)
            if path == "/openapi/v3":
                return await self._serve_openapi_root(request)
            if re.fullmatch(r"/openapi/v3/apis/[^/]+/[^/]+", path):
                return await self._serve_openapi_gv(request)
            if re.fullmatch(r"/apis/[^/]+/[^/]+", path) or re.fullmatch(r"/api/[^/]+", path):
                return await self._serve_version(request)
            if re.fullmatch(r"/apis/[^/]+", path):
                return await self._serve_group(request)
            handler = {"/version": self._serve_server_version, "/apis": self._serve_apis, "/api": self._serve_api,
                       "/": self._serve_root}.get(path)
            if handler is None:
                raise _status(404, "NotFound", "the server could not find the requested resource")
            return await handler(request)
        action, method = request.action, request.method
        if action == kmock.action.WATCH:
            return await self._serve_watch(request)
        if action == kmock.action.LIST:
            return await self._serve_list(request)
        if action == kmock.action.FETCH:
            return await self._serve_fetch(request)
        if action == kmock.action.CREATE:
            return await self._serve_create(request)
        if action == kmock.action.UPDATE:
            return await self._serve_update(request)
        if method == kmock.method.PUT:
            return await self._serve_replace(request)
        if method == kmock.method.DELETE:
            return await self._serve_delete(request)
        raise _status(405, "MethodNotAllowed", f"{method.value} {path} is not supported")

    # KMock parses /api/v1/namespaces[/<name>[/status]] as a namespace *scope* (and fails on the bare list
    # path), so Namespace objects are addressed here before its parser sees them.
    async def __call__(self, raw_request: aiohttp.web.BaseRequest) -> aiohttp.web.StreamResponse:
        match = _NAMESPACE_PATH.match(raw_request.path)
        if match is None:
            return await super().__call__(raw_request)
        body = await raw_request.read()
        text = body.decode("utf-8", "replace")
        try:
            data = json.loads(text) if text.strip() else None
        except ValueError:
            data = None
        name, sub = match.group(1), match.group(2)
        method = kmock.method(raw_request.method)
        query = dict(raw_request.query)
        action = parsing.guess_k8s(parsing.ParsedPath("", "v1", "namespaces", None, name, sub), method, query)
        request = rendering.Request(
            id=len(self._requests), raw_request=raw_request, url=raw_request.url, method=raw_request.method,
            params=query, headers=dict(raw_request.headers), cookies=dict(raw_request.cookies), data=data,
            body=body, text=text, action=action, resource=kmock.resource("", "v1", "namespaces"), namespace=None,
            name=name, subresource=sub)
        self._requests.append(request)
        try:
            return await self._handle(request)
        except rendering.StreamingError as exc:  # a watch that failed after its headers went out
            raw_response = exc.args[0]
            cause = exc.__cause__
            await self._stream_error(cause if isinstance(cause, Exception) else exc, raw_response)
            await raw_response.write_eof()
            return raw_response
        except Exception as exc:  # noqa: BLE001 - rendered as a Kubernetes Status, as KMock does
            if self._errors:
                self._errors[-1].append(exc)
            return await self._render_error(exc)

    # e.g. /api/v1: KMock reports groupVersion "/v1" there.
    async def _serve_core_v1(self, request: rendering.Request) -> dict[str, Any]:
        body = await self._serve_version(request)
        body["groupVersion"] = "v1"
        return body

    # Subresources are listed with their own verbs and without the parent's short names and categories
    # (otherwise kubectl warns that `rlj` could also mean `rljobs/status`).
    async def _serve_version(self, request: rendering.Request) -> dict[str, Any]:
        body = await super()._serve_version(request)
        assert isinstance(body, dict), body  # KMock renders the discovery document as a plain dict
        for entry in body.get("resources", []):
            if "/" in entry["name"]:
                sub = entry["name"].split("/", 1)[1]
                entry["shortNames"], entry["categories"] = [], []
                entry["verbs"] = {"status": ["get", "patch", "update"], "scale": ["get", "patch", "update"],
                                  "log": ["get"], "eviction": ["create"]}.get(sub, ["get"])
        return body

    # OpenAPI v3 for the custom resources, so `kubectl explain rljob.spec...` and client-side checks work.
    def _openapi_docs(self) -> dict[str, dict[str, Any]]:
        docs: dict[str, dict[str, Any]] = {}
        for res, schema in self._schemas.items():
            info = self.resources[res]
            gv = f"apis/{res.group}/{res.version}"
            prefix = ".".join(reversed((res.group or "").split("."))) + f".{res.version}"
            doc = docs.setdefault(gv, {"openapi": "3.0.0", "info": {"title": "Kubernetes", "version": "v1.37.0"},
                                       "paths": {}, "components": {"schemas": {}}})
            gvk = [{"group": res.group, "version": res.version, "kind": info.kind}]
            scope = "namespaces/{namespace}/" if info.namespaced else ""
            ref = {"$ref": f"#/components/schemas/{prefix}.{info.kind}"}
            ok = {"200": {"description": "OK", "content": {"application/json": {"schema": ref}}}}
            # kubectl looks for `fieldValidation` on these operations to use server-side validation.
            params = [{"name": "fieldValidation", "in": "query", "schema": {"type": "string", "uniqueItems": True}},
                      {"name": "dryRun", "in": "query", "schema": {"type": "string", "uniqueItems": True}}]
            doc["paths"][f"/{gv}/{scope}{res.plural}/{{name}}"] = {
                "get": {"x-kubernetes-action": "get", "x-kubernetes-group-version-kind": gvk[0], "responses": ok},
                "put": {"x-kubernetes-action": "put", "x-kubernetes-group-version-kind": gvk[0], "responses": ok,
                        "parameters": params},
                "patch": {"x-kubernetes-action": "patch", "x-kubernetes-group-version-kind": gvk[0],
                          "responses": ok, "parameters": params}}
            doc["paths"][f"/{gv}/{scope}{res.plural}"] = {
                "post": {"x-kubernetes-action": "post", "x-kubernetes-group-version-kind": gvk[0],
                         "responses": ok, "parameters": params}}
            doc["components"]["schemas"][f"{prefix}.{info.kind}"] = {
                **_clone(schema.schema), "x-kubernetes-group-version-kind": gvk}
            doc["components"]["schemas"][f"{prefix}.{info.kind}List"] = {
                "type": "object", "description": f"A list of {info.kind}.",
                "properties": {"apiVersion": {"type": "string"}, "kind": {"type": "string"},
                               "metadata": {"type": "object"},
                               "items": {"type": "array", "items": _clone(schema.schema)}},
                "x-kubernetes-group-version-kind": [{**gvk[0], "kind": f"{info.kind}List"}]}
        return docs

    async def _serve_openapi_root(self, request: rendering.Request) -> dict[str, Any]:
        docs = self._openapi_docs()
        return {"paths": {gv: {"serverRelativeURL": f"/openapi/v3/{gv}?hash={abs(hash(dumps(doc))):X}"}
                          for gv, doc in docs.items()}}

    async def _serve_openapi_gv(self, request: rendering.Request) -> dict[str, Any]:
        gv = request.url.path.removeprefix("/openapi/v3/").strip("/")
        docs = self._openapi_docs()
        if gv not in docs:
            raise KubernetesObjectNotFoundError()
        return docs[gv]

    # --------------------------------------------------------------------------------------------------
    # Helpers

    def info(self, res: kmock.resource) -> kmock.ResourceInfo:
        if res not in self.resources:
            raise KubernetesResourceNotFoundError()
        return self.resources[res]

    def _key(self, res: kmock.resource, namespace: str | None, name: str) -> tuple[Any, str | None, str]:
        return (res, namespace if self.info(res).namespaced else None, name)

    def _get(self, res: kmock.resource, namespace: str | None, name: str) -> dict[str, Any] | None:
        key = self._key(res, namespace, name)
        if key not in self.objects or self.objects[key].deleted:
            return None
        return _clone(self.objects[key].raw)

    def _store(self, res: kmock.resource, namespace: str | None, name: str, obj: dict[str, Any] | None) -> None:
        key = self._key(res, namespace, name)
        if obj is None:
            if key in self.objects and not self.objects[key].deleted:
                self.objects[key].delete()
        elif key in self.objects:
            self.objects[key].history.append(obj)
        else:
            self.objects[key] = obj

    def _items(self, res: kmock.resource, namespace: str | None = None,
               keep: Callable[[dict[str, Any]], bool] | None = None) -> list[dict[str, Any]]:
        out = []
        for (r, ns, _name), obj in self.objects.items():
            if r == res and not obj.deleted and (namespace is None or ns == namespace):
                raw = obj.raw
                if keep is None or keep(raw):
                    out.append(_clone(raw))
        return sorted(out, key=lambda o: (o["metadata"].get("namespace") or "", o["metadata"]["name"]))

    def _next_rv(self) -> str:
        self._rv += 1
        return str(self._rv)

    def _stamp(self, obj: dict[str, Any]) -> dict[str, Any]:
        meta = obj.setdefault("metadata", {})
        meta["uid"] = str(uuid.uuid4())
        meta["creationTimestamp"] = _now()
        meta["generation"] = 1
        meta["resourceVersion"] = self._next_rv()
        meta.pop("deletionTimestamp", None)
        meta.pop("managedFields", None)
        return obj

    def _not_found(self, res: kmock.resource, name: str) -> KubernetesError:
        what = f"{res.plural}.{res.group}" if res.group else str(res.plural)
        return KubernetesError(status=404, reason="NotFound", message=f'{what} "{name}" not found',
                               details={"name": name, "group": res.group, "kind": res.plural})

    def _emit(self, res: kmock.resource, kind: str, obj: dict[str, Any]) -> None:
        event = {"type": kind, "object": _clone(obj)}
        self._log.append((int(obj["metadata"]["resourceVersion"]), res, event))
        for w in list(self._watchers):
            if w.resource == res and w.wants(obj):
                w.queue.put_nowait(event)

    def _admit(self, res: kmock.resource, obj: dict[str, Any], params: dict[str, str],
               old: dict[str, Any] | None = None) -> tuple[dict[str, Any], list[str]]:
        schema = self._schemas.get(res)
        if schema is None:
            return obj, []
        try:
            return schema.admit(obj, field_validation=params.get("fieldValidation", "Warn"), old=old)
        except AdmissionError as exc:
            kind = self.info(res).kind
            name = obj.get("metadata", {}).get("name", "")
            if exc.unknown_fields:
                fields = ", ".join(f'unknown field "{f}"' for f, _m in exc.causes)
                raise _status(400, "BadRequest", f"strict decoding error: {fields}") from None
            causes = [{"reason": "FieldValueInvalid", "message": f"Invalid value: {m}", "field": f}
                      for f, m in exc.causes]
            text = ", ".join(f"{f}: Invalid value: {m}" for f, m in exc.causes)
            raise _status(422, "Invalid", f'{kind}.{res.group} "{name}" is invalid: [{text}]',
                          {"name": name, "group": res.group, "kind": kind, "causes": causes}) from None

    def _has_status_subresource(self, res: kmock.resource) -> bool:
        return "status" in self.info(res).subresources

    # --------------------------------------------------------------------------------------------------
    # CRDs

    def register_crd(self, crd: dict[str, Any]) -> None:
        """Serve the CRD's resources (all served versions), as the API server does once it is Established."""
        spec = crd["spec"]
        names = spec["names"]
        for version in spec["versions"]:
            if not version.get("served", True):
                continue
            res = kmock.resource(spec["group"], version["name"], names["plural"])
            self.resources[res] = kmock.ResourceInfo(
                kind=names["kind"], singular=names.get("singular", names["kind"].lower()),
                namespaced=spec.get("scope", "Namespaced") == "Namespaced", verbs=set(VERBS),
                shortnames=set(names.get("shortNames", [])), categories=set(names.get("categories", [])),
                subresources=set((version.get("subresources") or {}).keys()))
            self._schemas[res] = CRDSchema(crd, version["name"])

    def _crd_established(self, crd: dict[str, Any]) -> dict[str, Any]:
        now = _now()
        names = crd["spec"]["names"]
        crd["status"] = {
            "acceptedNames": {k: v for k, v in names.items()},
            "storedVersions": [v["name"] for v in crd["spec"]["versions"] if v.get("storage")],
            "conditions": [
                {"type": "NamesAccepted", "status": "True", "reason": "NoConflicts", "lastTransitionTime": now,
                 "message": "no conflicts found"},
                {"type": "Established", "status": "True", "reason": "InitialNamesAccepted",
                 "lastTransitionTime": now, "message": "the initial names have been accepted"},
            ],
        }
        return crd

    # --------------------------------------------------------------------------------------------------
    # Core operations (used by the HTTP handlers and by test helpers)

    async def create(self, res: kmock.resource, namespace: str | None, body: Any, *,
                     params: dict[str, str] | None = None) -> dict[str, Any]:
        params = params or {}
        if not isinstance(body, dict):
            raise _status(400, "BadRequest", "the body of the request must be a JSON object")
        info = self.info(res)
        obj = _clone(body)
        meta = obj.setdefault("metadata", {})
        if not isinstance(meta, dict):
            raise _status(400, "BadRequest", "metadata must be an object")
        obj.setdefault("apiVersion", _gv(res))
        obj.setdefault("kind", info.kind)
        if obj["kind"] != info.kind or obj["apiVersion"] != _gv(res):
            raise _status(400, "BadRequest", f"the API version in the data ({obj['apiVersion']}) and kind "
                          f"({obj['kind']}) do not match the resource {_gv(res)}/{res.plural}")
        if info.namespaced:
            ns = namespace or meta.get("namespace")
            if namespace and meta.get("namespace") and meta["namespace"] != namespace:
                raise _status(400, "BadRequest", "the namespace of the provided object does not match the "
                              "namespace sent on the request")
            if not ns:
                raise _status(400, "BadRequest", "a namespace is required for namespaced resources")
            meta["namespace"] = ns
            if self.strict_namespaces and self._get(kmock.resource("v1/namespaces"), None, ns) is None:
                raise _status(404, "NotFound", f'namespaces "{ns}" not found',
                              {"name": ns, "kind": "namespaces"})
        else:
            meta.pop("namespace", None)
        if not meta.get("name"):
            if meta.get("generateName"):
                meta["name"] = meta["generateName"] + secrets.token_hex(3)[:5]
            else:
                raise _status(422, "Invalid", f"{info.kind} is invalid: metadata.name: Required value: name or "
                              "generateName is required")
        name = meta["name"]
        async with self._mutex:
            if self._get(res, meta.get("namespace"), name) is not None:
                what = f"{res.plural}.{res.group}" if res.group else str(res.plural)
                raise _status(409, "AlreadyExists", f'{what} "{name}" already exists',
                              {"name": name, "group": res.group, "kind": res.plural})
            if self._has_status_subresource(res) and res.plural != "pods":
                obj.pop("status", None)  # status is only written through /status
            obj, _warnings = self._admit(res, obj, params)
            self._defaults_for_kind(res, obj)
            self._stamp(obj)
            if params.get("dryRun") == "All":
                self._rv -= 1
                return obj
            if res.plural == "customresourcedefinitions":
                self.register_crd(obj)
                self._crd_established(obj)
            self._store(res, meta.get("namespace"), name, obj)
            self._emit(res, "ADDED", obj)
            return obj

    def _defaults_for_kind(self, res: kmock.resource, obj: dict[str, Any]) -> None:
        if res.group == "" and res.plural == "pods":
            status = obj.setdefault("status", {})
            status.setdefault("phase", "Pending")
            status.setdefault("qosClass", "BestEffort")
        elif res.group == "" and res.plural == "services":
            spec = obj.setdefault("spec", {})
            spec.setdefault("type", "ClusterIP")
            if spec.get("clusterIP") is None:
                self._ips += 1
                spec["clusterIP"] = f"10.96.{self._ips // 250}.{self._ips % 250 + 1}"
                spec["clusterIPs"] = [spec["clusterIP"]]
        elif res.group == "" and res.plural == "namespaces":
            obj.setdefault("status", {})["phase"] = "Active"
        elif res.group == "" and res.plural == "secrets":
            obj.setdefault("type", "Opaque")

    async def update(self, res: kmock.resource, namespace: str | None, name: str, *,
                     patch: Any = None, replace: dict[str, Any] | None = None, content_type: str = "",
                     subresource: str | None = None, params: dict[str, str] | None = None) -> dict[str, Any]:
        """PATCH (patch + content_type) or PUT (replace) of an object or its status."""
        params = params or {}
        if subresource not in (None, "status"):
            raise _status(404, "NotFound", f"subresource {subresource!r} is not supported by the emulator")
        async with self._mutex:
            old = self._get(res, namespace, name)
            if old is None:
                if "apply-patch" in content_type and subresource is None:
                    pass  # server-side apply creates
                else:
                    raise self._not_found(res, name)
        if old is None:
            return await self.create(res, namespace, patch, params=params)
        async with self._mutex:
            old = self._get(res, namespace, name)
            if old is None:
                raise self._not_found(res, name)
            if replace is not None:
                if not isinstance(replace, dict):
                    raise _status(400, "BadRequest", "the body of the request must be a JSON object")
                new = _clone(replace)
                want_rv = (replace.get("metadata") or {}).get("resourceVersion")
            else:
                new, want_rv = self._apply_patch(old, patch, content_type)
            if want_rv and want_rv != old["metadata"]["resourceVersion"]:
                raise _status(409, "Conflict", f'Operation cannot be fulfilled on {res.plural} "{name}": the object '
                              "has been modified; please apply your changes to the latest version and try again")
            if subresource == "status":
                merged = _clone(old)
                if "status" in new:
                    merged["status"] = new["status"]
                else:
                    merged.pop("status", None)
                new = merged
            elif self._has_status_subresource(res):
                if "status" in old:
                    new["status"] = old["status"]
                else:
                    new.pop("status", None)
            # The server owns these; clients cannot change them.
            meta = new.setdefault("metadata", {})
            for key in ("uid", "creationTimestamp", "name", "namespace", "generation", "deletionTimestamp",
                        "deletionGracePeriodSeconds"):
                if key in old["metadata"]:
                    meta[key] = old["metadata"][key]
                else:
                    meta.pop(key, None)
            meta.pop("managedFields", None)
            meta["resourceVersion"] = old["metadata"]["resourceVersion"]
            new["apiVersion"], new["kind"] = old["apiVersion"], old["kind"]
            new, _warnings = self._admit(res, new, params, old=old)
            meta = new["metadata"]
            if new == old:
                return old  # no-op: no new resourceVersion, no event
            if {k: v for k, v in new.items() if k not in ("metadata", "status")} != \
                    {k: v for k, v in old.items() if k not in ("metadata", "status")}:
                meta["generation"] = int(old["metadata"].get("generation", 1)) + 1
            meta["resourceVersion"] = self._next_rv()
            if params.get("dryRun") == "All":
                self._rv -= 1
                return new
            if res.plural == "customresourcedefinitions" and subresource is None:
                self.register_crd(new)
                self._crd_established(new)
            self._store(res, namespace, name, new)
            self._emit(res, "MODIFIED", new)
            if meta.get("deletionTimestamp") and not meta.get("finalizers"):
                await self._remove(res, new, cascade=True)
            return new

    def _apply_patch(self, old: dict[str, Any], patch: Any, content_type: str) -> tuple[dict[str, Any], str | None]:
        ctype = content_type.split(";")[0].strip().lower()
        try:
            if ctype == "application/json-patch+json":
                if not isinstance(patch, list):
                    raise _status(400, "BadRequest", "a JSON patch must be a list of operations")
                new = jsonpatch.apply_patch(old, patch, in_place=False)
                return new, None
            if not isinstance(patch, dict):
                raise _status(400, "BadRequest", "the patch must be a JSON object")
            want_rv = (patch.get("metadata") or {}).get("resourceVersion")
            if ctype == "application/strategic-merge-patch+json":
                return strategic_merge_patch(old, patch), want_rv
            return merge_patch(old, patch), want_rv  # merge-patch, apply-patch (as a merge), unknown
        except (jsonpatch.JsonPatchException, jsonpatch.JsonPointerException) as exc:
            raise _status(422, "Invalid", f"the JSON patch could not be applied: {exc}") from None

    # Shadows KMock's HTTP-client helper delete(url), which nothing calls on the emulator.
    async def delete(self, res: kmock.resource, namespace: str | None, name: str, *,  # type: ignore[override]
                     propagation: str | None = None, params: dict[str, str] | None = None) -> dict[str, Any]:
        params = params or {}
        async with self._mutex:
            obj = self._get(res, namespace, name)
            if obj is None:
                raise self._not_found(res, name)
            if params.get("dryRun") == "All":
                return obj
            meta = obj["metadata"]
            if meta.get("finalizers"):
                if not meta.get("deletionTimestamp"):
                    meta["deletionTimestamp"] = _now()
                    meta["deletionGracePeriodSeconds"] = 0
                    meta["resourceVersion"] = self._next_rv()
                    self._store(res, namespace, name, obj)
                    self._emit(res, "MODIFIED", obj)
                return obj
            await self._remove(res, obj, cascade=propagation != "Orphan")
            return obj

    async def _remove(self, res: kmock.resource, obj: dict[str, Any], *, cascade: bool) -> None:
        """Delete for good (the caller holds the mutex), then collect what it owned."""
        meta = obj["metadata"]
        obj = _clone(obj)
        obj["metadata"]["resourceVersion"] = self._next_rv()
        self._store(res, meta.get("namespace"), meta["name"], None)
        self._emit(res, "DELETED", obj)
        if res.group == "" and res.plural == "namespaces":
            for (r, ns, n), stored in list(self.objects.items()):
                if ns == meta["name"] and not stored.deleted:
                    await self._remove(r, _clone(stored.raw), cascade=True)
        if cascade:
            await self._collect_garbage()

    async def _collect_garbage(self) -> None:
        """Delete every object whose owners are all gone (background propagation)."""
        while True:
            alive = {o.raw["metadata"].get("uid") for o in self.objects.values() if not o.deleted}
            orphans = []
            for (r, _ns, _n), stored in list(self.objects.items()):
                if stored.deleted:
                    continue
                refs = stored.raw.get("metadata", {}).get("ownerReferences") or []
                if refs and not any(ref.get("uid") in alive for ref in refs):
                    orphans.append((r, _clone(stored.raw)))
            if not orphans:
                return
            progressed = False
            for r, obj in orphans:
                meta = obj["metadata"]
                if meta.get("finalizers"):
                    if not meta.get("deletionTimestamp"):
                        meta["deletionTimestamp"] = _now()
                        meta["resourceVersion"] = self._next_rv()
                        self._store(r, meta.get("namespace"), meta["name"], obj)
                        self._emit(r, "MODIFIED", obj)
                    continue
                self._store(r, meta.get("namespace"), meta["name"], None)
                obj["metadata"]["resourceVersion"] = self._next_rv()
                self._emit(r, "DELETED", obj)
                progressed = True
            if not progressed:
                return

    def list_objects(self, res: kmock.resource, namespace: str | None = None, *, labels: str | None = None,
                     fields: str | None = None) -> list[dict[str, Any]]:
        try:
            lsel, fsel = label_selector(labels), field_selector(fields)
        except ValueError as exc:
            raise _status(400, "BadRequest", str(exc)) from None
        return self._items(res, namespace if self.info(res).namespaced else None,
                           lambda o: lsel(o["metadata"].get("labels") or {}) and fsel(o))

    # --------------------------------------------------------------------------------------------------
    # HTTP fallbacks

    async def _serve_list(self, request: rendering.Request) -> Any:
        res = _resource_of(request)
        info = self.info(res)
        async with self._mutex:
            items = self.list_objects(res, request.namespace, labels=request.params.get("labelSelector"),
                                      fields=request.params.get("fieldSelector"))
            rv = str(self._rv)
        if self._wants_table(request):
            return self._table(res, items, rv)
        return {"apiVersion": _gv(res), "kind": f"{info.kind}List", "metadata": {"resourceVersion": rv},
                "items": items}

    async def _serve_fetch(self, request: rendering.Request) -> Any:
        if request.subresource not in (None, "status"):
            raise _status(404, "NotFound", f"subresource {request.subresource!r} is not supported by the emulator")
        res, name = _resource_of(request), _name_of(request)
        async with self._mutex:
            obj = self._get(res, request.namespace, name)
        if obj is None:
            raise self._not_found(res, name)
        if self._wants_table(request):
            return self._table(res, [obj], obj["metadata"]["resourceVersion"])
        return obj

    async def _serve_create(self, request: rendering.Request) -> Any:
        if request.subresource:
            raise _status(405, "MethodNotAllowed", f"POST to {request.subresource!r} is not supported by the emulator")
        obj = await self.create(_resource_of(request), request.namespace, request.data, params=dict(request.params))
        return rendering.Response(status=201, payload=obj)

    async def _serve_update(self, request: rendering.Request) -> Any:
        data = request.data
        ctype = request.headers.get("Content-Type", "")
        if data is None and request.text:
            try:
                data = yaml.safe_load(request.text)
            except yaml.YAMLError as exc:
                raise _status(400, "BadRequest", f"the patch is neither JSON nor YAML: {exc}") from None
        return await self.update(_resource_of(request), request.namespace, _name_of(request), patch=data,
                                 content_type=ctype, subresource=request.subresource, params=dict(request.params))

    async def _serve_replace(self, request: rendering.Request) -> Any:
        if request.resource is None or request.name is None:
            raise NotImplementedError
        body = request.data
        if isinstance(body, dict) and (body.get("metadata") or {}).get("name") not in (None, request.name):
            raise _status(400, "BadRequest", "the name of the object does not match the name on the URL")
        async with self._mutex:
            exists = self._get(request.resource, request.namespace, request.name) is not None
        if not exists and request.subresource is None:
            obj = await self.create(request.resource, request.namespace, body, params=dict(request.params))
            return rendering.Response(status=201, payload=obj)
        return await self.update(request.resource, request.namespace, request.name, replace=body,
                                 subresource=request.subresource, params=dict(request.params))

    async def _serve_delete(self, request: rendering.Request) -> Any:
        if request.resource is None:
            raise NotImplementedError
        body = request.data if isinstance(request.data, dict) else {}
        propagation = body.get("propagationPolicy") or request.params.get("propagationPolicy")
        if body.get("orphanDependents") is True:
            propagation = "Orphan"
        if request.name is None:  # deletecollection
            async with self._mutex:
                victims = self.list_objects(request.resource, request.namespace,
                                            labels=request.params.get("labelSelector"),
                                            fields=request.params.get("fieldSelector"))
            for obj in victims:
                meta = obj["metadata"]
                try:
                    await self.delete(request.resource, meta.get("namespace"), meta["name"], propagation=propagation,
                                      params=dict(request.params))
                except KubernetesError:
                    pass  # deleted meanwhile
            return {"apiVersion": "v1", "kind": "Status", "metadata": {}, "status": "Success"}
        return await self.delete(request.resource, request.namespace, request.name, propagation=propagation,
                                 params=dict(request.params))

    # KMock renders a Response as well as a bare stream; the Response carries the content type.
    async def _serve_watch(self, request: rendering.Request) -> rendering.Response:  # type: ignore[override]
        # kubectl decodes the stream by its content type (KMock's default is application/octet-stream).
        return rendering.Response(headers={"Content-Type": "application/json"}, payload=self._watch_stream(request))

    async def _watch_stream(self, request: rendering.Request) -> AsyncIterator[Any]:
        yield b""  # send the headers now: the client waits for them before it reads events
        res = _resource_of(request)
        try:
            watcher = _Watcher(res, request.namespace if self.info(res).namespaced else None, request.name,
                               label_selector(request.params.get("labelSelector")),
                               field_selector(request.params.get("fieldSelector")))
        except ValueError as exc:
            raise _status(400, "BadRequest", str(exc)) from None
        since = request.params.get("resourceVersion", "")
        timeout = request.params.get("timeoutSeconds")
        table = self._wants_table(request)
        async with self._mutex:
            oldest = self._log[0][0] if self._log else self._rv + 1
            if since.isdigit() and int(since) > 0 and int(since) >= oldest - 1:
                backlog = [ev for rv, r, ev in self._log if r == res and rv > int(since) and watcher.wants(ev["object"])]
            else:  # "" or "0": the current state first, as ADDED events
                backlog = [{"type": "ADDED", "object": o} for o in self._items(res, watcher.namespace)
                           if watcher.wants(o)]
            self._watchers.add(watcher)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + float(timeout) if timeout else None
        try:
            for event in backlog:
                yield self._watch_event(res, event, table)
            while True:
                remaining = None if deadline is None else deadline - loop.time()
                if remaining is not None and remaining <= 0:
                    return
                try:
                    change = await asyncio.wait_for(watcher.queue.get(), remaining)
                except asyncio.TimeoutError:
                    return
                if change is None:  # the server is shutting down
                    return
                yield self._watch_event(res, change, table)
        finally:
            self._watchers.discard(watcher)

    def close_watches(self) -> None:
        """End every open watch stream (clients see a normal end of stream), e.g. before shutting down."""
        for watcher in list(self._watchers):
            watcher.queue.put_nowait(None)

    def _watch_event(self, res: kmock.resource, event: dict[str, Any], table: bool) -> dict[str, Any]:
        if not table:
            return event
        obj = event["object"]
        return {"type": event["type"], "object": self._table(res, [obj], obj["metadata"]["resourceVersion"])}

    # --------------------------------------------------------------------------------------------------
    # Server-side printing (kubectl get)

    @staticmethod
    def _wants_table(request: rendering.Request) -> bool:
        return bool(TABLE_ACCEPT.search(request.headers.get("Accept", "")))

    def _table(self, res: kmock.resource, items: Iterable[dict[str, Any]], rv: str) -> dict[str, Any]:
        schema = self._schemas.get(res)
        columns = [{"name": "Name", "type": "string", "format": "name", "description": "Name", "priority": 0}]
        extra: list[dict[str, Any]] = []
        if schema is not None:
            extra = [c for c in schema.printer_columns]
            if not any(c["jsonPath"] == ".metadata.creationTimestamp" for c in extra):
                extra.append({"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"})
        elif res.group == "" and res.plural == "pods":
            extra = [{"name": "Status", "type": "string", "jsonPath": ".status.phase"},
                     {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
        else:
            extra = [{"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"}]
        for col in extra:
            columns.append({"name": col["name"], "type": col["type"], "format": col.get("format", ""),
                            "description": col.get("description", ""), "priority": col.get("priority", 0)})
        rows = []
        for obj in items:
            cells: list[Any] = [obj["metadata"]["name"]]
            for col in extra:
                value = _field(obj, col["jsonPath"])
                cells.append(human_age(value) if col["type"] == "date" else value)
            partial = {"apiVersion": "meta.k8s.io/v1", "kind": "PartialObjectMetadata", "metadata": obj["metadata"]}
            rows.append({"cells": cells, "object": partial})
        return {"apiVersion": "meta.k8s.io/v1", "kind": "Table", "metadata": {"resourceVersion": rv},
                "columnDefinitions": columns, "rows": rows}


def dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True)
