"""Harness for the operator's end-to-end tests: the API emulator, a fake coordinator, the operator process.

* The emulator (``tests.kube.emulator.Emulator``: KMock plus API-server behaviour, CRD validation, GC) is
  served over HTTP from a background thread; a kubeconfig points kubectl and the operator at it.
* The fake coordinator speaks the coordinator contract (DESIGN §3) for every job at
  ``http://127.0.0.1:P/<namespace>/<name>``: ``GET /status`` returns the signals a test sets (a recorded
  trace), with ``workers`` taken from the job's pods in the emulator; ``POST /drain`` checks the bearer
  token against the job's Secret, marks the worker ``draining``, then ``retired`` after a short delay, and
  records whether the pod still existed when the drain arrived (drain-before-delete).
* The operator runs as a real subprocess: ``specrl operator`` (kopf) with that kubeconfig.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import kmock
import pytest
from aiohttp import web

ROOT = Path(__file__).resolve().parents[3]
if str(ROOT) not in sys.path:  # tests.kube is imported as a package from the repository root
    sys.path.insert(0, str(ROOT))

from specrl.runtime.ports import free_port

from tests.kube.nodes import Kubelet, NodeEmulator
from tests.kube.waiting import wait_for

BIN = Path(sys.executable).parent
KUBECTL = str(BIN / "kubectl")
SPECRL = str(BIN / "specrl")
PODS = kmock.resource("v1/pods")
RLJOBS = kmock.resource("specrl.io", "v1alpha1", "rljobs")
OPERATOR_AGENTS = ("kopf/", "specrl-operator/")


class FakeCoordinator:
    """The coordinator HTTP contract for many jobs, fed by the test (signals) and the emulator (workers)."""

    def __init__(self, env: KubeEnv) -> None:
        self.env = env
        self.signals: dict[tuple[str, str], dict[str, Any]] = {}
        self.states: dict[tuple[str, str], dict[str, str]] = {}  # worker -> draining|retired
        self.drains: list[dict[str, Any]] = []
        self.polls: dict[tuple[str, str], int] = {}
        self.retire_after = 0.3
        self.down: set[tuple[str, str]] = set()
        self.raw: dict[tuple[str, str], str] = {}  # a body served as is (garbage, NaN...) instead of the signals

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/{ns}/{name}/status", self._status)
        app.router.add_post("/{ns}/{name}/drain", self._drain)
        app.router.add_get("/{ns}/{name}/healthz", self._healthz)
        return app

    def set(self, ns: str, name: str, **signals: Any) -> None:
        base = {"phase": "Rollout", "queueDepth": 0, "activeSequences": 0, "stepBatchSize": 64, "longTail": False,
                "trainerBacklog": 0, "tokensPerSecond": 1000.0, "acceptanceLength": 2.5, "specDecodeEnabled": True,
                "rewardMean": 0.5, "step": 1, "weightVersion": 1, "complete": False}
        self.signals[(ns, name)] = {**base, **self.signals.get((ns, name), {}), **signals}

    async def _healthz(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def _status(self, request: web.Request) -> web.Response:
        key = (request.match_info["ns"], request.match_info["name"])
        self.polls[key] = self.polls.get(key, 0) + 1
        if key in self.down or key not in self.signals:
            return web.Response(status=503, text="coordinator not ready")
        if key in self.raw:
            return web.Response(text=self.raw[key], content_type="application/json")
        pods = self.env.emulator.list_objects(PODS, key[0], labels=f"specrl.io/job={key[1]}")
        states = self.states.setdefault(key, {})
        workers = []
        for p in pods:
            role = p["metadata"]["labels"].get("specrl.io/role")
            if role in ("trainer", "rollout"):
                workers.append({"name": p["metadata"]["name"], "role": role,
                                "state": states.get(p["metadata"]["name"], "active")})
        for name, state in states.items():
            if state == "retired" and not any(w["name"] == name for w in workers):
                workers.append({"name": name, "role": name.rsplit("-", 2)[-2], "state": "retired"})
        return web.json_response({"job": key[1], **self.signals[key], "workers": workers})

    async def _drain(self, request: web.Request) -> web.Response:
        key = (request.match_info["ns"], request.match_info["name"])
        secret = self.env.emulator._get(kmock.resource("v1/secrets"), key[0], f"{key[1]}-token") or {}
        token = (secret.get("stringData") or {}).get("token") or \
            base64.b64decode((secret.get("data") or {}).get("token", "")).decode()
        if request.headers.get("Authorization") != f"Bearer {token}" or not token:
            return web.json_response({"error": "bad token"}, status=401)
        worker = (await request.json())["worker"]
        pod = self.env.emulator._get(PODS, key[0], worker)
        if pod is None:
            return web.json_response({"error": f"unknown worker {worker}"}, status=404)
        self.drains.append({"job": key, "worker": worker, "pod_existed": True,
                            "request_index": len(self.env.emulator._requests), "time": time.time()})
        self.states.setdefault(key, {})[worker] = "draining"

        async def retire() -> None:
            await asyncio.sleep(self.retire_after)
            self.states[key][worker] = "retired"

        asyncio.get_running_loop().create_task(retire())
        return web.json_response({"worker": worker, "state": "draining"}, status=202)


class KubeEnv:
    """Emulator + fake coordinator on one background event loop, plus kubectl helpers."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.port, self.coord_port = free_port(), free_port()
        self.kubeconfig = tmp / "kubeconfig"
        self.kubeconfig.write_text(json.dumps({
            "apiVersion": "v1", "kind": "Config", "current-context": "emu",
            "clusters": [{"name": "emu", "cluster": {"server": f"http://127.0.0.1:{self.port}"}}],
            "users": [{"name": "emu", "user": {"token": "test-token"}}],
            "contexts": [{"name": "emu", "context": {"cluster": "emu", "user": "emu", "namespace": "default"}}],
        }))
        self.emulator = NodeEmulator()
        # Pods are bound to Ready nodes and reported Running and Ready, as kubelets would.
        self.kubelet = Kubelet(self.emulator)
        self.coordinator = FakeCoordinator(self)
        self.loop = asyncio.new_event_loop()
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        if not self._ready.wait(20):
            raise RuntimeError("the emulator did not start")

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self._serve())

    async def _serve(self) -> None:
        self._stop = asyncio.Event()
        runner = web.AppRunner(self.coordinator.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", self.coord_port).start()
        async with self.emulator, kmock.Server(self.emulator, port=self.port):
            await self.kubelet.start()
            self._ready.set()
            await self._stop.wait()
            await self.kubelet.stop()
        await runner.cleanup()

    def close(self) -> None:
        if self._stop is not None:
            self.loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)

    def call(self, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` on the emulator's loop (its state is not thread-safe) and return the result."""
        fut: Future[Any] = Future()

        def run() -> None:
            try:
                fut.set_result(fn())
            except BaseException as exc:  # noqa: BLE001 - handed to the caller
                fut.set_exception(exc)

        self.loop.call_soon_threadsafe(run)
        return fut.result(10)

    def run_async(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(30)

    # ---- reading state -------------------------------------------------------------------------------
    def pods(self, ns: str, job: str | None = None) -> dict[str, dict[str, Any]]:
        sel = f"specrl.io/job={job}" if job else None
        return {p["metadata"]["name"]: p for p in self.call(lambda: self.emulator.list_objects(PODS, ns, labels=sel))}

    def objects(self, resource: str, ns: str) -> dict[str, dict[str, Any]]:
        res = kmock.resource(resource)
        return {o["metadata"]["name"]: o for o in self.call(lambda: self.emulator.list_objects(res, ns))}

    def job(self, ns: str, name: str) -> dict[str, Any] | None:
        return self.call(lambda: self.emulator._get(RLJOBS, ns, name))

    def requests(self) -> list[Any]:
        return self.call(lambda: list(self.emulator._requests))

    @staticmethod
    def operator_writes(requests: list[Any], ns: str | None = None) -> list[str]:
        """``METHOD path`` of every non-read request the operator (kopf or its client) sent."""
        out = []
        for r in requests:
            agent = r.headers.get("User-Agent", "")
            method = str(getattr(r.method, "value", r.method)).upper()
            if not agent.startswith(OPERATOR_AGENTS) or method in ("GET", "HEAD"):
                continue
            path = str(r.url.path)
            if ns is None or f"/namespaces/{ns}/" in path:
                out.append(f"{method} {path}")
        return out

    @staticmethod
    def operator_requests(requests: list[Any], ns: str) -> list[str]:
        """Every request (reads included) the operator sent about objects in ``ns``."""
        out = []
        for r in requests:
            agent = r.headers.get("User-Agent", "")
            if agent.startswith(OPERATOR_AGENTS) and f"/namespaces/{ns}/" in str(r.url.path):
                out.append(f"{str(getattr(r.method, 'value', r.method)).upper()} {r.url.path}")
        return out

    def kubectl(self, *args: str, input: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
        proc = subprocess.run([KUBECTL, "--kubeconfig", str(self.kubeconfig), *args], input=input, text=True,
                              capture_output=True, timeout=180, check=False)
        if check and proc.returncode != 0:
            raise AssertionError(f"kubectl {' '.join(args)} failed ({proc.returncode}):\n{proc.stderr}")
        return proc


class OperatorProcess:
    def __init__(self, env: KubeEnv, poll_interval: float = 0.3, namespaces: tuple[str, ...] = ()) -> None:
        self.env = env
        self.namespaces = namespaces
        self.poll_interval = poll_interval
        self.proc: subprocess.Popen[str] | None = None
        self.log = env.tmp / "operator.log"
        self.metrics_port = 0
        self.health_port = 0

    def start(self) -> None:
        self.metrics_port, self.health_port = free_port(), free_port()
        env = {**os.environ, "KUBECONFIG": str(self.env.kubeconfig), "SPECRL_OPERATOR_RESTART_BACKOFF": "0.5",
               "SPECRL_OPERATOR_NODE_LOST_GRACE": "1", "SPECRL_OPERATOR_CREATE_BACKOFF": "0.5"}
        self.proc = subprocess.Popen(
            [SPECRL, "operator", *([a for ns in self.namespaces for a in ("-n", ns)] or ["--all-namespaces"]),
             "--coordinator-url-template", f"http://127.0.0.1:{self.env.coord_port}/{{namespace}}/{{name}}",
             "--metrics-port", str(self.metrics_port), "--health-port", str(self.health_port),
             "--poll-interval", str(self.poll_interval)],
            env=env, stdout=open(self.log, "a"), stderr=subprocess.STDOUT, text=True)  # noqa: SIM115 - the child owns it

        def healthy() -> bool:
            try:
                with socket.create_connection(("127.0.0.1", self.health_port), timeout=0.2):
                    return True
            except OSError:
                assert self.proc is not None and self.proc.poll() is None, self.tail()
                return False

        wait_for(healthy, 30, "the operator's liveness endpoint")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> int:
        """SIGTERM (graceful), as Kubernetes does; returns the exit code."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
                raise AssertionError("the operator did not stop within 20 s of SIGTERM")
        return int(self.proc.returncode)

    def tail(self, n: int = 60) -> str:
        try:
            return "\n".join(self.log.read_text().splitlines()[-n:])
        except OSError:
            return ""


@pytest.fixture(scope="module")
def kube(tmp_path_factory: pytest.TempPathFactory) -> Iterator[KubeEnv]:
    env = KubeEnv(tmp_path_factory.mktemp("kube"))
    try:
        env.kubectl("--validate=false", "apply", "-f", str(ROOT / "crds"))
        yield env
    finally:
        env.close()


@pytest.fixture(scope="module")
def operator(kube: KubeEnv) -> Iterator[OperatorProcess]:
    op = OperatorProcess(kube)
    op.start()
    try:
        yield op
    finally:
        if op.proc is not None and op.proc.poll() is None:
            op.stop()
