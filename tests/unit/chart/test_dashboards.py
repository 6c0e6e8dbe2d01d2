"""Dashboard JSON: generated from generate.py, structurally valid for Grafana, and only reading real metrics."""

from __future__ import annotations

import importlib.util
import re
import sys
from collections import Counter
from typing import Any

import pytest
from specrl.operator import metrics as operator_metrics
from specrl.runtime.metrics import METRIC_NAMES as RUNTIME_METRIC_NAMES

from tests.integration.chart.chart_support import (
    CHART,
    DASHBOARDS,
    dashboard_queries,
    iter_panels,
    load_dashboards,
    metric_names,
)

BOARDS = load_dashboards()
DS_REF = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}


def _generator() -> Any:
    spec = importlib.util.spec_from_file_location("specrl_dashboards_generate", DASHBOARDS / "generate.py")
    assert spec and spec.loader
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their annotations through sys.modules
    spec.loader.exec_module(module)
    return module


def operator_metric_names() -> set[str]:
    """Sample names of everything the operator's registry exports (counters with _total, histogram series)."""
    names: set[str] = set()
    for family in operator_metrics.REGISTRY.collect():
        if family.type == "counter":
            names.add(f"{family.name}_total")
        elif family.type == "histogram":
            names |= {f"{family.name}_bucket", f"{family.name}_sum", f"{family.name}_count"}
        else:
            names.add(family.name)
    return names


KNOWN = set(RUNTIME_METRIC_NAMES) | operator_metric_names()


def test_both_dashboards_exist() -> None:
    assert set(BOARDS) == {"job.json", "operator.json"}
    assert {b["title"] for b in BOARDS.values()} == {"specrl / job", "specrl / operator"}
    assert len({b["uid"] for b in BOARDS.values()}) == 2


def test_json_is_what_the_generator_writes(tmp_path: Any) -> None:
    gen = _generator()
    assert gen.main(["--out", str(tmp_path)]) == 0
    for name in BOARDS:
        assert (tmp_path / name).read_text() == (DASHBOARDS / name).read_text(), (
            f"{name} is stale: run python charts/specrl/dashboards/generate.py")
    assert gen.main(["--check"]) == 0


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_datasource_input_and_variables(name: str) -> None:
    board = BOARDS[name]
    assert [i["name"] for i in board["__inputs"]] == ["DS_PROMETHEUS"]
    assert board["__inputs"][0]["pluginId"] == "prometheus"
    variables = {v["name"]: v for v in board["templating"]["list"]}
    assert set(variables) == {"DS_PROMETHEUS", "namespace", "rljob"}
    assert variables["DS_PROMETHEUS"]["type"] == "datasource"
    assert variables["DS_PROMETHEUS"]["query"] == "prometheus"
    for var in ("namespace", "rljob"):
        v = variables[var]
        assert v["type"] == "query" and v["datasource"] == DS_REF
        assert v["includeAll"] and v["allValue"] == ".*" and v["multi"]
        assert v["query"]["query"].startswith("label_values(")
    # rljob depends on namespace, so picking a namespace narrows the job list.
    assert "$namespace" in variables["rljob"]["query"]["query"]


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_panels_structure(name: str) -> None:
    board = BOARDS[name]
    panels = list(iter_panels(board["panels"]))
    ids = [p["id"] for p in panels]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {[i for i, n in Counter(ids).items() if n > 1]}"
    assert all(isinstance(i, int) and i > 0 for i in ids)
    cells: set[tuple[int, int]] = set()
    for p in panels:
        g = p["gridPos"]
        assert 0 <= g["x"] and g["x"] + g["w"] <= 24, f"{p['title']}: gridPos out of the 24-column grid"
        for x in range(g["x"], g["x"] + g["w"]):
            for y in range(g["y"], g["y"] + g["h"]):
                assert (x, y) not in cells, f"{name}: panel {p['title']!r} overlaps another panel"
                cells.add((x, y))
        if p["type"] == "row":
            continue
        assert p["title"] and p["description"], f"{name}: panel {p.get('id')} needs a title and description"
        assert p["datasource"] == DS_REF, f"{p['title']}: datasource must be ${{DS_PROMETHEUS}}"
        assert p["targets"], f"{p['title']}: no targets"
        refs = [t["refId"] for t in p["targets"]]
        assert len(refs) == len(set(refs)), f"{p['title']}: duplicate refIds"
        for t in p["targets"]:
            assert t["datasource"] == DS_REF
            assert t["expr"].strip() and t["legendFormat"]
    assert sum(1 for p in panels if p["type"] != "row") >= 5


def test_job_dashboard_covers_the_issue() -> None:
    titles = " | ".join(p["title"].lower() for p in iter_panels(BOARDS["job.json"]["panels"]))
    for needle in ("throughput", "acceptance rate", "acceptance length", "speculative decoding on", "draft length",
                   "queue depth", "active sequences", "long-tail", "gpus per role", "rebalances by reason",
                   "conditions", "weight-sync duration", "weight-sync bandwidth", "step time", "backlog", "reward"):
        assert needle in titles, f"job dashboard has no {needle!r} panel"
    # Rebalances are read from the operator's counter (per job, with the reason), never inferred from allocations.
    annotations = [a for a in BOARDS["job.json"]["annotations"]["list"] if a.get("expr")]
    assert annotations and "specrl_operator_rebalance_total" in annotations[0]["expr"], "rebalance annotations missing"
    assert "reason" in annotations[0]["titleFormat"]
    gpus = next(p for p in iter_panels(BOARDS["job.json"]["panels"]) if p["title"] == "GPUs per role")
    assert "specrl_operator_allocation_gpus" in gpus["targets"][0]["expr"]
    titles = " | ".join(p["title"].lower() for p in iter_panels(BOARDS["operator.json"]["panels"]))
    for needle in ("reconcile rate", "reconcile latency", "rebalances by reason", "jobs by phase", "jobs by condition"):
        assert needle in titles, f"operator dashboard has no {needle!r} panel"


def test_acceptance_queries_are_vllm_style() -> None:
    exprs = {q.where: q.expr for q in dashboard_queries(BOARDS["job.json"], "job.json")}
    rate = next(e for w, e in exprs.items() if "acceptance rate" in w)
    length = next(e for w, e in exprs.items() if "acceptance length" in w)
    assert re.search(r"rate\(specrl_spec_decode_num_accepted_tokens_total.*\)\) / .*rate\("
                     r"specrl_spec_decode_num_draft_tokens_total", rate)
    assert length.startswith("1 + ") and "specrl_spec_decode_num_drafts_total" in length


def test_every_job_query_is_scoped_to_the_variables() -> None:
    for q in dashboard_queries(BOARDS["job.json"], "job.json"):
        assert 'rljob_namespace=~"$namespace"' in q.expr and 'rljob=~"$rljob"' in q.expr, q.where


@pytest.mark.parametrize("name", sorted(BOARDS))
def test_dashboard_metrics_exist_in_the_registries(name: str) -> None:
    unknown = {}
    for q in dashboard_queries(BOARDS[name], name):
        names = metric_names(q.expr)
        assert names, f"{q.where}: reads no specrl metric"
        if names - KNOWN:
            unknown[q.where] = sorted(names - KNOWN)
    assert not unknown, f"metrics used by the dashboards but exported by no registry: {unknown}"


def test_alert_metrics_exist_in_the_registries() -> None:
    text = (CHART / "templates" / "prometheusrule.yaml").read_text()
    names = metric_names(text)
    assert len(names) >= 6
    assert names <= KNOWN, f"alerts read unknown metrics: {sorted(names - KNOWN)}"


def test_known_set_is_not_trivially_wide() -> None:
    # Guards the two tests above: a typo'd name must not be in the set.
    assert "specrl_rollout_generated_tokens_total" in KNOWN
    assert "specrl_operator_reconcile_duration_seconds_bucket" in KNOWN
    assert "specrl_operator_jobs" in KNOWN
    for name in ("specrl_operator_allocation_gpus", "specrl_operator_job_condition", "specrl_operator_rebalance_total"):
        assert name in KNOWN
    assert "specrl_rollout_generated_token_total" not in KNOWN


def test_readme_describes_every_panel() -> None:
    readme = (CHART / "README.md").read_text()
    for board in BOARDS.values():
        for panel in iter_panels(board["panels"]):
            if panel["type"] != "row":
                assert f"**{panel['title']}**" in readme, f"charts/specrl/README.md does not describe {panel['title']!r}"


def test_operator_metric_labels_match_what_the_dashboards_group_by() -> None:
    # The per-job operator families carry rljob_namespace and rljob (the job dashboard's variables select on them).
    labels = {}
    operator_metrics.observe_job("ns-label-check", "j", {"phase": "Running", "allocation": {
        "trainer": {"replicas": 1, "gpus": 2}}, "conditions": [{"type": "Ready", "status": "True", "reason": "R"}]})
    operator_metrics.expect_rebalances("ns-label-check", "j", [("trainer", "rollout", "QueueBacklog")])
    try:
        for family in operator_metrics.REGISTRY.collect():
            for sample in family.samples:
                if sample.labels.get("rljob_namespace") == "ns-label-check":
                    labels[sample.name] = set(sample.labels)
    finally:
        operator_metrics.forget_job("ns-label-check", "j")
    assert labels["specrl_operator_allocation_gpus"] == {"rljob_namespace", "rljob", "role"}
    assert labels["specrl_operator_job_condition"] == {"rljob_namespace", "rljob", "condition", "reason"}
    assert labels["specrl_operator_rebalance_total"] == {"rljob_namespace", "rljob", "from_role", "to_role", "reason"}


def test_dashboards_show_what_goes_wrong_with_units() -> None:
    panels = {p["title"]: p for board in BOARDS.values() for p in iter_panels(board["panels"])}
    reads = {title: " ".join(t["expr"] for t in p.get("targets") or []) for title, p in panels.items()}
    for title, metric in (("Weight-sync failures", "specrl_weight_sync_failures_total"),
                          ("Reward errors", "specrl_reward_errors_total"),
                          ("Requeued prompts", "specrl_rollout_prompts_requeued_total"),
                          ("Weight staleness (versions)", "specrl_rollout_weight_staleness_versions"),
                          ("Malformed dataset lines", "specrl_dataset_malformed_lines_total"),
                          ("Pod failures", "specrl_operator_job_pod_failures"),
                          ("Trainer loss", "specrl_trainer_loss"),
                          ("Gradient norm", "specrl_trainer_grad_norm"),
                          ("Draft length (tokens)", "specrl_spec_decode_draft_length_tokens"),
                          ("Acceptance rate by draft position", "specrl_spec_decode_num_accepted_tokens_per_pos_total"),
                          ("Reconcile errors by reason", "specrl_operator_reconcile_errors_total"),
                          ("Reconciles in flight", "specrl_operator_reconciles_in_flight"),
                          ("Kubernetes API errors by verb and code", "specrl_operator_api_requests_total"),
                          ("Operator memory and CPU", "process_resident_memory_bytes")):
        assert metric in reads[title], title
    assert panels["Rollout throughput (tokens/s)"]["fieldConfig"]["defaults"]["unit"] == "suffix: tokens/s"
    # The first row of the job dashboard is the failures row.
    assert BOARDS["job.json"]["panels"][0]["title"] == "What goes wrong"
    # Nothing selects on the target labels `job`/`namespace` (they are the scrape job's and the pod's).
    for board in BOARDS.values():
        for q in dashboard_queries(board, "x"):
            assert not re.search(r"(?<![_a-z])(job|namespace)\s*(=~|=|!=)", q.expr), q.expr
