"""The operator metrics a controller's users expect beside the per-job ones: reconcile errors by reason,
in-flight reconciles, API requests by verb and code (errors are the codes >= 400), process and GC collectors."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from aiohttp import web
from prometheus_client import generate_latest
from specrl.operator import metrics as m
from specrl.operator.kube import ApiError, KubeClient


def _value(name: str, **labels: str) -> float:
    return m.REGISTRY.get_sample_value(name, labels) or 0.0


def test_process_and_gc_collectors_are_exported() -> None:
    text = generate_latest(m.REGISTRY).decode()
    for family in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_open_fds",
                   "python_gc_objects_collected_total", "python_info"):
        assert f"\n{family}" in text, family


async def test_reconciling_counts_in_flight_duration_and_errors_by_reason() -> None:
    before = _value("specrl_operator_reconcile_errors_total", trigger="timer", reason="Conflict")
    count = _value("specrl_operator_reconcile_duration_seconds_count", trigger="timer")
    gate = asyncio.Event()

    async def reconcile(exc: BaseException | None) -> None:
        with m.reconciling("timer"):
            await gate.wait()
            if exc is not None:
                raise exc

    tasks = [asyncio.create_task(reconcile(e)) for e in (None, ApiError(409, "PATCH", "/x", "conflict"),
                                                         ValueError("bad"))]
    await asyncio.sleep(0.01)
    assert _value("specrl_operator_reconciles_in_flight") == 3
    gate.set()
    results = await asyncio.gather(*tasks, return_exceptions=True)
    assert isinstance(results[1], ApiError) and isinstance(results[2], ValueError)
    assert _value("specrl_operator_reconciles_in_flight") == 0
    assert _value("specrl_operator_reconcile_errors_total", trigger="timer", reason="Conflict") == before + 1
    assert _value("specrl_operator_reconcile_errors_total", trigger="timer", reason="ValueError") >= 1
    assert _value("specrl_operator_reconcile_duration_seconds_count", trigger="timer") == count + 3
    # A cancelled reconcile (shutdown) is no error.
    cancelled = asyncio.create_task(reconcile(None))
    gate.clear()
    await asyncio.sleep(0.01)
    cancelled.cancel()
    with pytest.raises(asyncio.CancelledError):
        await cancelled
    assert _value("specrl_operator_reconcile_errors_total", trigger="timer", reason="CancelledError") == 0
    assert _value("specrl_operator_reconciles_in_flight") == 0


async def test_api_requests_by_verb_and_code() -> None:
    async def forbidden(_request: web.Request) -> web.Response:
        return web.json_response({"kind": "Status", "reason": "Forbidden"}, status=403)

    async def created(_request: web.Request) -> web.Response:
        return web.json_response({"kind": "ConfigMap"}, status=201)

    app = web.Application()
    app.router.add_post("/api/v1/namespaces/ns/configmaps", created)
    app.router.add_delete("/api/v1/namespaces/ns/configmaps/x", forbidden)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    kube = KubeClient(SimpleNamespace(server=f"http://127.0.0.1:{port}"))
    ok = _value("specrl_operator_api_requests_total", verb="create", code="201")
    denied = _value("specrl_operator_api_requests_total", verb="delete", code="403")
    try:
        await kube._request("POST", kube.url("ConfigMap", "ns"), {"metadata": {"name": "x"}})
        with pytest.raises(ApiError):
            await kube._request("DELETE", kube.url("ConfigMap", "ns", "x"))
    finally:
        await kube.close()
        await runner.cleanup()
    assert _value("specrl_operator_api_requests_total", verb="create", code="201") == ok + 1
    assert _value("specrl_operator_api_requests_total", verb="delete", code="403") == denied + 1
    unreachable = KubeClient(SimpleNamespace(server=f"http://127.0.0.1:{port}"), timeout=2)
    before = _value("specrl_operator_api_requests_total", verb="get", code="0")
    try:
        with pytest.raises(Exception):  # noqa: B017 - whatever aiohttp raises for a refused connection
            await unreachable._request("GET", unreachable.url("ConfigMap", "ns", "x"))
    finally:
        await unreachable.close()
    assert _value("specrl_operator_api_requests_total", verb="get", code="0") == before + 1
