"""Serve the emulator over HTTP from a background thread, so subprocesses (kopf, kubectl, helm) can use it.

    with KubeServer() as kube:                   # binds 127.0.0.1 on a free port
        kube.write_kubeconfig(tmp_path / "kubeconfig")
        kube.create("v1/configmaps", {"metadata": {"name": "x", "namespace": "default"}, "data": {}})
        kube.get("specrl.io/v1alpha1/rljobs", "default", "tiny-local")
        kube.request_counts()                    # Counter of (METHOD, path) for efficiency tests

The emulator runs in its own event loop; the helpers here are thread-safe and synchronous (they submit
coroutines to that loop), raise `KubeError` with the HTTP status on API errors, and emit the same watch
events as HTTP clients would cause.
"""

from __future__ import annotations

import asyncio
import builtins
import collections
import threading
from collections.abc import Coroutine
from pathlib import Path
from typing import Any, TypeVar

import kmock
import yaml
from kmock._internal.k8s import KubernetesError
from specrl.runtime.crd import build_crd
from typing_extensions import Self

from tests.kube.emulator import Emulator

T = TypeVar("T")


class KubeError(Exception):
    """An API error raised by a helper: `.status` (HTTP code), `.reason`, `.message`."""

    def __init__(self, status: int, reason: str | None, message: str | None):
        self.status, self.reason, self.message = status, reason, message
        super().__init__(f"{status} {reason}: {message}")


def _resource(res: str | kmock.resource) -> kmock.resource:
    return res if isinstance(res, kmock.resource) else kmock.resource(res)


class KubeServer:
    """The KMock emulator, HTTP-served on 127.0.0.1 from a daemon thread.

    `crds`: CRD objects to install at start (default: the RLJob CRD generated from `specrl.runtime.api`).
    """

    def __init__(self, *, crds: list[dict[str, Any]] | None = None, port: int | None = None,
                 strict_namespaces: bool = True):
        self._crds = [build_crd()] if crds is None else crds
        self._port = port
        self._strict_namespaces = strict_namespaces
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._error: BaseException | None = None
        self.emulator: Emulator | None = None
        self.port: int = 0

    # --------------------------------------------------------------------------------------------------
    def start(self) -> Self:
        self._thread = threading.Thread(target=self._run, name="kube-emulator", daemon=True)
        self._thread.start()
        if not self._ready.wait(30):
            raise RuntimeError("the Kubernetes emulator did not start within 30 s")
        if self._error is not None:
            raise RuntimeError(f"the Kubernetes emulator failed to start: {self._error!r}") from self._error
        return self

    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._serve())
        except BaseException as exc:  # noqa: BLE001 - reported to the starting thread
            self._error = exc
            self._ready.set()
        finally:
            loop.close()

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        emulator = Emulator(strict_namespaces=self._strict_namespaces)
        async with emulator, kmock.Server(emulator, port=self._port) as server:
            for crd in self._crds:
                await emulator.create(kmock.resource("apiextensions.k8s.io/v1/customresourcedefinitions"), None, crd)
            self.emulator = emulator
            self.port = server.port
            self._ready.set()
            await self._stop.wait()
            emulator.close_watches()
            await asyncio.sleep(0.05)  # let the streams finish before the server closes

    def stop(self) -> None:
        if self._loop is not None and self._stop is not None and self._thread is not None \
                and self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(15)

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # --------------------------------------------------------------------------------------------------
    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def kubeconfig(self, namespace: str = "default") -> dict[str, Any]:
        return {
            "apiVersion": "v1",
            "kind": "Config",
            "clusters": [{"name": "emulator", "cluster": {"server": self.url}}],
            "users": [{"name": "tester", "user": {"token": "emulator-token"}}],
            "contexts": [{"name": "emulator", "context": {"cluster": "emulator", "user": "tester",
                                                         "namespace": namespace}}],
            "current-context": "emulator",
        }

    def write_kubeconfig(self, path: str | Path, namespace: str = "default") -> Path:
        path = Path(path)
        path.write_text(yaml.safe_dump(self.kubeconfig(namespace)), encoding="utf-8")
        return path

    def call(self, coro: Coroutine[Any, Any, T], timeout: float = 30) -> T:
        """Run a coroutine in the emulator's loop; API errors become KubeError."""
        assert self._loop is not None, "start() first"
        try:
            return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)
        except KubernetesError as exc:
            raise KubeError(exc.status, exc.reason, exc.message) from None

    # --------------------------------------------------------------------------------------------------
    # Object helpers (same semantics as the HTTP API)

    def create(self, resource: str | kmock.resource, obj: dict[str, Any], namespace: str | None = None
               ) -> dict[str, Any]:
        """Create like `kubectl apply` would: a namespaced object without a namespace goes to `default`."""
        assert self.emulator is not None
        res = _resource(resource)
        if namespace is None and not (obj.get("metadata") or {}).get("namespace") and res in self.emulator.resources \
                and self.emulator.resources[res].namespaced:
            namespace = "default"
        return self.call(self.emulator.create(res, namespace, obj))

    def get(self, resource: str | kmock.resource, namespace: str | None, name: str) -> dict[str, Any] | None:
        """The object, or None when it does not exist."""
        assert self.emulator is not None
        emu = self.emulator

        async def _get() -> dict[str, Any] | None:
            return emu._get(_resource(resource), namespace, name)

        return self.call(_get())

    def list(self, resource: str | kmock.resource, namespace: str | None = None, *,
             labels: str | None = None, fields: str | None = None) -> list[dict[str, Any]]:
        assert self.emulator is not None
        emu = self.emulator

        async def _list() -> list[dict[str, Any]]:
            return emu.list_objects(_resource(resource), namespace, labels=labels, fields=fields)

        return self.call(_list())

    def patch(self, resource: str | kmock.resource, namespace: str | None, name: str, patch: dict[str, Any],
              *, subresource: str | None = None) -> dict[str, Any]:
        """A JSON merge patch (use subresource="status" to change status, e.g. to play the kubelet)."""
        assert self.emulator is not None
        return self.call(self.emulator.update(_resource(resource), namespace, name, patch=patch,
                                              content_type="application/merge-patch+json",
                                              subresource=subresource))

    def delete(self, resource: str | kmock.resource, namespace: str | None, name: str, *,
               propagation: str | None = None) -> dict[str, Any]:
        assert self.emulator is not None
        return self.call(self.emulator.delete(_resource(resource), namespace, name, propagation=propagation))

    # --------------------------------------------------------------------------------------------------
    # Request accounting

    def requests(self) -> builtins.list[tuple[str, str, str]]:
        """Every request so far as (METHOD, path, query string), in order."""
        assert self.emulator is not None
        return [(str(r.method.value), r.url.path, r.url.query_string) for r in list(self.emulator._requests)]  # KMock's request log

    def request_counts(self, *, include_watches: bool = True) -> collections.Counter[tuple[str, str]]:
        """Counter of (METHOD, path); watches are counted as ("WATCH", path)."""
        counts: collections.Counter[tuple[str, str]] = collections.Counter()
        for method, path, query in self.requests():
            watch = method == "GET" and "watch=true" in query
            if watch and not include_watches:
                continue
            counts[("WATCH" if watch else method, path)] += 1
        return counts

    def mark(self) -> int:
        """The number of requests so far: pass it to `requests_since` to count what an action caused."""
        assert self.emulator is not None
        return len(self.emulator._requests)

    def requests_since(self, mark: int) -> builtins.list[tuple[str, str, str]]:
        return self.requests()[mark:]
