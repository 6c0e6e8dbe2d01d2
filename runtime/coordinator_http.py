"""The coordinator's HTTP API (DESIGN §3): GET /status, POST /drain, GET /metrics, GET /healthz.

POST /drain answers 202 (draining or already retired), 401 (token), 400 (body), 404 (unknown worker) or 409 with
the reason when the drain is refused (it would leave the job without a trainer or without a rollout worker).

A thin aiohttp adapter over a `CoordinatorView` (anything with `status()`, `drain(name)`, `metrics()`), run on
its own event loop in a background thread so the coordinator's step loop never waits on HTTP and vice versa.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import threading
from typing import Protocol

from aiohttp import web

from .ports import free_port

log = logging.getLogger(__name__)

STATUS_KEYS: tuple[str, ...] = (
    "job", "step", "weightVersion", "phase", "queueDepth", "activeSequences", "stepBatchSize", "longTail",
    "trainerBacklog", "tokensPerSecond", "acceptanceLength", "specDecodeEnabled", "rewardMean", "workers",
    "complete",
)


class CoordinatorView(Protocol):
    def status(self) -> dict: ...

    def drain(self, worker: str) -> dict:
        """Mark a worker for retirement; KeyError for an unknown name, ValueError (with the reason) when the
        drain is refused (the last active worker of its role)."""
        ...

    def metrics(self) -> tuple[bytes, str]: ...


def build_app(view: CoordinatorView, token: str | None) -> web.Application:
    async def status(_: web.Request) -> web.Response:
        return web.json_response(view.status())

    async def healthz(_: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def metrics(_: web.Request) -> web.Response:
        body, content_type = view.metrics()
        # aiohttp refuses a charset inside content_type; pass the full header instead.
        return web.Response(body=body, headers={"Content-Type": content_type})

    async def drain(request: web.Request) -> web.Response:
        given = request.headers.get("Authorization", "")
        expected = f"Bearer {token}" if token else None
        if expected is None or not hmac.compare_digest(given.encode(), expected.encode()):
            return web.json_response({"error": "missing or wrong bearer token"}, status=401,
                                     headers={"WWW-Authenticate": "Bearer"})
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return web.json_response({"error": "body must be JSON {\"worker\": \"<name>\"}"}, status=400)
        name = body.get("worker") if isinstance(body, dict) else None
        if not isinstance(name, str) or not name:
            return web.json_response({"error": "field 'worker': required, a worker name"}, status=400)
        try:
            result = view.drain(name)
        except KeyError:
            return web.json_response({"error": f"unknown worker {name!r}"}, status=404)
        except ValueError as exc:  # DrainRefused: the job would lose its last worker of a role
            return web.json_response({"error": str(exc)}, status=409)
        return web.json_response(result, status=202)

    app = web.Application()
    app.router.add_get("/status", status)
    app.router.add_get("/healthz", healthz)
    app.router.add_get("/metrics", metrics)
    app.router.add_post("/drain", drain)
    return app


class HttpServer:
    """Serve `build_app(view, token)` on host:port from a daemon thread; `stop()` shuts it down."""

    def __init__(self, view: CoordinatorView, token: str | None, host: str = "127.0.0.1", port: int = 0) -> None:
        self.view, self.token, self.host = view, token, host
        self.port = port or free_port(host)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self._ready = threading.Event()
        self._error: BaseException | None = None

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self) -> HttpServer:
        self._thread = threading.Thread(target=self._serve, name="specrl-coordinator-http", daemon=True)
        self._thread.start()
        self._ready.wait(30)
        if self._error is not None:
            raise RuntimeError(f"coordinator HTTP server could not listen on {self.host}:{self.port}: "
                               f"{self._error}") from None
        return self

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        try:
            self._runner = web.AppRunner(build_app(self.view, self.token), access_log=None)
            loop.run_until_complete(self._runner.setup())
            loop.run_until_complete(web.TCPSite(self._runner, self.host, self.port).start())
        except BaseException as exc:  # noqa: BLE001 - reported to start()
            self._error = exc
            self._ready.set()
            return
        self._ready.set()
        loop.run_forever()
        loop.run_until_complete(self._runner.cleanup())
        loop.close()

    def stop(self) -> None:
        if self._loop is not None and self._loop.is_running():
            self._loop.call_soon_threadsafe(self._loop.stop)
        if self._thread is not None:
            self._thread.join(10)
