"""Every pod serves its own /metrics (issue 12.3): a worker process exports the series it produces on the pod's
declared port, and the coordinator then stops exporting those for it (each series reaches Prometheus once)."""

from __future__ import annotations

import types

import httpx
from prometheus_client import CollectorRegistry, generate_latest
from specrl.runtime.coordinator.records import WorkerSeries
from specrl.runtime.metrics import serve_own_metrics
from specrl.runtime.ports import free_port


def test_a_worker_process_serves_its_own_series_on_the_declared_port(monkeypatch):
    port = free_port()
    monkeypatch.setenv("SPECRL_METRICS_PORT", str(port))
    monkeypatch.setenv("SPECRL_JOB", "j")
    monkeypatch.setenv("SPECRL_NAMESPACE", "ns")
    monkeypatch.setenv("SPECRL_WORKER", "j-rollout-3")
    worker = types.SimpleNamespace(metrics=None, engine=types.SimpleNamespace(controller=None))
    assert serve_own_metrics(worker, "rollout") == port
    worker.metrics.generated_tokens.inc(7)
    body = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=10).text
    line = next(x for x in body.splitlines() if x.startswith("specrl_rollout_generated_tokens_total{"))
    assert 'worker="j-rollout-3"' in line and 'role="rollout"' in line and line.endswith(" 7.0")
    assert "specrl_rollout_queue_depth{" not in body  # the coordinator's series, not this process's


def test_without_a_declared_port_nothing_is_served(monkeypatch):
    monkeypatch.delenv("SPECRL_METRICS_PORT", raising=False)
    worker = types.SimpleNamespace(metrics=None)
    assert serve_own_metrics(worker, "trainer") is None and worker.metrics is None


def test_the_coordinator_leaves_a_self_serving_workers_own_series_to_it():
    reg = CollectorRegistry()
    series = WorkerSeries("j", "ns", reg)
    series.serves_own("j-rollout-0")
    pod = series.of("j-rollout-0", "rollout")
    pod.generated_tokens.inc(5)  # the pod exports this itself
    pod.prompts_requeued.inc(2)  # only the coordinator knows this
    local = series.of("j-rollout-1", "rollout")  # no port: the coordinator exports everything for it
    local.generated_tokens.inc(4)
    text = generate_latest(reg).decode()
    assert 'specrl_rollout_prompts_requeued_total{rljob="j",rljob_namespace="ns",role="rollout",worker="j-rollout-0"} 2.0' \
        in text
    tokens = [x for x in text.splitlines() if x.startswith("specrl_rollout_generated_tokens_total{")]
    assert tokens == [('specrl_rollout_generated_tokens_total{rljob="j",rljob_namespace="ns",role="rollout",'
                      'worker="j-rollout-1"} 4.0')]
    assert 'specrl_start_time_seconds{rljob="j",rljob_namespace="ns",role="rollout",worker="j-rollout-0"}' not in text
