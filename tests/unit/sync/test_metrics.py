"""The runtime metric registry: names, labels, isolation, exposition."""

from __future__ import annotations

import re

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample
from specrl.runtime.metrics import FAMILY_NAMES, LABELS, METRIC_NAMES, METRICS, RuntimeMetrics, render

DESIGN_METRICS = {
    "specrl_rollout_queue_depth", "specrl_rollout_active_sequences", "specrl_rollout_long_tail",
    "specrl_rollout_generated_tokens_total", "specrl_rollout_sequences_completed_total",
    "specrl_rollout_response_length_tokens_bucket", "specrl_rollout_response_length_tokens_sum",
    "specrl_rollout_response_length_tokens_count",
    "specrl_spec_decode_num_drafts_total", "specrl_spec_decode_num_draft_tokens_total",
    "specrl_spec_decode_num_accepted_tokens_total", "specrl_spec_decode_enabled", "specrl_spec_decode_draft_length_tokens",
    "specrl_trainer_step", "specrl_trainer_step_duration_seconds_count", "specrl_trainer_reward_mean",
    "specrl_trainer_backlog_samples",
    "specrl_weight_sync_duration_seconds_bucket", "specrl_weight_sync_bytes_total", "specrl_weight_version",
    "specrl_drafter_train_steps_total", "specrl_drafter_loss",
}


def _samples(body: bytes) -> list[Sample]:
    return [s for fam in text_string_to_metric_families(body.decode()) for s in fam.samples]


def test_design_metrics_are_declared() -> None:
    assert DESIGN_METRICS <= METRIC_NAMES


def test_names_follow_prometheus_conventions() -> None:
    for spec in METRICS:
        assert re.fullmatch(r"specrl_[a-z_]+", spec.name), spec.name
        assert spec.name.endswith("_total") == (spec.kind == "counter"), spec.name
        if spec.kind == "histogram":
            assert list(spec.buckets) == sorted(spec.buckets) and len(spec.buckets) >= 8
    assert len({s.attr for s in METRICS}) == len(METRICS)
    assert len(FAMILY_NAMES) == len(METRICS)


def test_every_series_exists_from_the_first_scrape() -> None:
    m = RuntimeMetrics("demo", "ns1", "rollout", "demo-rollout-0")
    body, ctype = render(m.registry)
    assert ctype.startswith("text/plain")
    names = {s.name for s in _samples(body)}
    assert METRIC_NAMES <= names
    for s in _samples(body):
        if s.name in METRIC_NAMES:
            assert {k: s.labels[k] for k in LABELS} == m.labels


def test_values_and_labels_round_trip() -> None:
    m = RuntimeMetrics("demo", "ns1", "trainer", "demo-trainer-1")
    m.sync_bytes.inc(1 << 20)
    m.weight_version.set(7)
    m.response_length.observe(100)
    m.response_length.observe(5000)
    m.sync_duration.observe(0.3)
    by_name: dict[str, list[Sample]] = {}
    for s in _samples(m.render()):
        by_name.setdefault(s.name, []).append(s)
    assert by_name["specrl_weight_sync_bytes_total"][0].value == float(1 << 20)
    assert by_name["specrl_weight_version"][0].value == 7
    assert by_name["specrl_rollout_response_length_tokens_count"][0].value == 2
    assert by_name["specrl_rollout_response_length_tokens_sum"][0].value == 5100
    le128 = [s for s in by_name["specrl_rollout_response_length_tokens_bucket"] if s.labels["le"] == "128.0"]
    assert le128[0].value == 1


def test_registries_are_isolated_and_shareable() -> None:
    a = RuntimeMetrics("a", "ns", "rollout", "a-rollout-0")
    b = RuntimeMetrics("a", "ns", "rollout", "a-rollout-0")  # same labels, own registry: no collision
    a.generated_tokens.inc(5)
    assert b.generated_tokens._value.get() == 0

    shared = CollectorRegistry()
    w0 = RuntimeMetrics("j", "ns", "rollout", "j-rollout-0", registry=shared)
    w1 = RuntimeMetrics("j", "ns", "rollout", "j-rollout-1", registry=shared)
    w0.generated_tokens.inc(3)
    w1.generated_tokens.inc(4)
    toks = {s.labels["worker"]: s.value for s in _samples(render(shared)[0])
            if s.name == "specrl_rollout_generated_tokens_total"}
    assert toks == {"j-rollout-0": 3, "j-rollout-1": 4}
    w1.remove()
    workers = {s.labels["worker"] for s in _samples(render(shared)[0]) if s.name == "specrl_weight_version"}
    assert workers == {"j-rollout-0"}


def test_from_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECRL_JOB", "gsm")
    monkeypatch.setenv("SPECRL_NAMESPACE", "team")
    monkeypatch.setenv("SPECRL_ROLE", "rollout")
    monkeypatch.setenv("SPECRL_WORKER", "gsm-rollout-3")
    assert RuntimeMetrics.from_env().labels == {"rljob": "gsm", "rljob_namespace": "team", "role": "rollout",
                                                "worker": "gsm-rollout-3"}
    monkeypatch.delenv("SPECRL_WORKER")
    monkeypatch.setenv("SPECRL_WORKER_INDEX", "2")
    assert RuntimeMetrics.from_env(role="trainer").labels["worker"] == "gsm-trainer-2"


def test_empty_label_is_a_clear_error() -> None:
    with pytest.raises(ValueError, match="'worker'"):
        RuntimeMetrics("j", "ns", "rollout", "")


def test_accepted_tokens_per_position_like_vllm() -> None:
    m = RuntimeMetrics("j", "ns", "rollout", "j-rollout-0")
    # what rollout_worker.stats_delta gives for three drafts accepting 2, 1 and 0 tokens
    m.count_accepted_per_position({"accepted_tokens": 3.0, "accepted_tokens_pos_0": 2.0, "accepted_tokens_pos_1": 1.0,
                                   "accepted_tokens_pos_2": 0.0})
    per_pos = {s.labels["position"]: s.value for s in _samples(render(m.registry)[0])
               if s.name == "specrl_spec_decode_num_accepted_tokens_per_pos_total"}
    assert per_pos == {"0": 2.0, "1": 1.0}
    m.remove()
    assert not [s for s in _samples(render(m.registry)[0]) if s.name.startswith("specrl_spec_decode_num_accepted")]
