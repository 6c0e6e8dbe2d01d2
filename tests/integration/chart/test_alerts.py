"""The PrometheusRule alerts with the real promtool: syntax (`check rules`) and behaviour (`test rules`).

The rule file is the chart's rendered PrometheusRule (default thresholds), so what is tested is what ships.
Each alert gets a firing scenario and a healthy look-alike that must stay silent.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.chart.chart_support import helm_template, metric_names, rendered_rule_groups, run, tool

pytestmark = pytest.mark.integration

LBL = 'rljob_namespace="ml", rljob="grpo"'
ALERT_LABELS = {"rljob_namespace": "ml", "rljob": "grpo"}


def s(metric: str, values: str, role: str = "rollout", worker: str = "grpo-rollout-0", **extra: str) -> dict[str, str]:
    labels = f'{LBL}, role="{role}", worker="{worker}"' + "".join(f', {k}="{v}"' for k, v in extra.items())
    return {"series": f"{metric}{{{labels}}}", "values": values}


def cond(condition: str, reason: str, values: str) -> dict[str, str]:
    return {"series": f'specrl_operator_job_condition{{{LBL}, condition="{condition}", reason="{reason}"}}',
            "values": values}


@pytest.fixture(scope="module")
def rules_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    docs = helm_template(None, sets={"prometheusRule.enabled": "true",
                                     "prometheusRule.additionalAlertLabels.team": "ml"})
    path = tmp_path_factory.mktemp("rules") / "specrl-rules.yaml"
    path.write_text(yaml.safe_dump(rendered_rule_groups(docs)))
    return path


def test_promtool_check_rules(rules_file: Path) -> None:
    out = run([tool("promtool"), "check", "rules", str(rules_file)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS: 4 rules found" in out.stdout


def test_every_issue_alert_is_present(rules_file: Path) -> None:
    rules = yaml.safe_load(rules_file.read_text())["groups"][0]["rules"]
    assert {r["alert"] for r in rules} == {"SpecRLRolloutStalled", "SpecRLAcceptanceCollapsed",
                                            "SpecRLWeightSyncSlow", "SpecRLJobDegraded"}
    for r in rules:
        assert r["labels"]["severity"] in {"warning", "critical"} and r["labels"]["team"] == "ml"
        assert r["annotations"]["summary"] and r["annotations"]["description"]
        assert metric_names(r["expr"]), r["alert"]


def test_broken_rule_is_rejected(tmp_path: Path) -> None:
    # Guards test_promtool_check_rules: promtool really parses the expressions.
    bad = {"groups": [{"name": "x", "rules": [{"alert": "X", "expr": "sum by (job (up)"}]}]}
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(bad))
    assert run([tool("promtool"), "check", "rules", str(path)]).returncode != 0


# What the firing alerts must say (the rule templates rendered by Prometheus with the scenarios' values).
ANNOTATIONS = {
    "SpecRLRolloutStalled": {
        "summary": "RLJob rollouts are stalled.",
        "description": "RLJob ml/grpo has queued or running sequences but generated no token in the last 5 minutes."},
    "SpecRLAcceptanceCollapsed": {
        "summary": "Speculative-decoding acceptance rate collapsed.",
        "description": "RLJob ml/grpo accepts 10% of draft tokens; a stale drafter makes speculation slower than "
                       "plain decoding."},
    "SpecRLWeightSyncSlow": {
        "summary": "Weight sync is slow.",
        "description": "RLJob ml/grpo: 95th percentile of weight-sync duration is 1m 57s."},
    "SpecRLJobDegraded": {
        "summary": "RLJob is Degraded.",
        "description": "RLJob ml/grpo is Degraded (reason {reason}); see kubectl describe rljob -n ml grpo."},
}


def alert(name: str, at: str, firing: bool, reason: str = "", **labels: str) -> dict[str, Any]:
    annotations = {k: v.format(reason=reason) for k, v in ANNOTATIONS[name].items()}
    exp = [{"exp_labels": {**ALERT_LABELS, **labels}, "exp_annotations": annotations}] if firing else []
    return {"eval_time": at, "alertname": name, "exp_alerts": exp}


SCENARIOS: dict[str, dict[str, Any]] = {
    # 5 prompts queued, the token counter flat for 30 minutes: stalled after 5m rate window + 10m `for`.
    "rollout stalled": {
        "input_series": [
            s("specrl_rollout_queue_depth", "5x30", role="coordinator", worker="grpo-coordinator-0"),
            s("specrl_rollout_active_sequences", "0x30"),
            s("specrl_rollout_generated_tokens_total", "1000x30"),
        ],
        "alert_rule_test": [alert("SpecRLRolloutStalled", "8m", False),
                            alert("SpecRLRolloutStalled", "25m", True, severity="warning", team="ml")],
    },
    "rollout stalled: every rollout worker gone": {
        "input_series": [
            s("specrl_rollout_queue_depth", "5x30", role="coordinator", worker="grpo-coordinator-0"),
            s("specrl_rollout_active_sequences", "0x30", role="coordinator", worker="grpo-coordinator-0"),
        ],
        "alert_rule_test": [alert("SpecRLRolloutStalled", "25m", True, severity="warning", team="ml")],
    },
    # Started at t=0 and still loading the model: nothing generated yet, but younger than the 5m rate window, so
    # not even pending (a fresh counter has a single sample and no rate); if it never starts: pending from 5m,
    # firing from 15m.
    "rollout not started yet": {
        "input_series": [
            s("specrl_start_time_seconds", "0x30", role="coordinator", worker="grpo-coordinator-0"),
            s("specrl_start_time_seconds", "60x30"),
            s("specrl_rollout_queue_depth", "5x30", role="coordinator", worker="grpo-coordinator-0"),
            s("specrl_rollout_active_sequences", "0x30"),
            s("specrl_rollout_generated_tokens_total", "_x1 0x29"),
        ],
        "promql_expr_test": [{"expr": 'ALERTS{alertname="SpecRLRolloutStalled"}', "eval_time": t, "exp_samples": []}
                             for t in ("1m", "2m", "4m")],
        "alert_rule_test": [alert("SpecRLRolloutStalled", "14m", False),
                            alert("SpecRLRolloutStalled", "16m", True, severity="warning", team="ml")],
    },
    "rollout healthy": {
        "input_series": [
            s("specrl_rollout_queue_depth", "5x30", role="coordinator", worker="grpo-coordinator-0"),
            s("specrl_rollout_active_sequences", "8x30"),
            s("specrl_rollout_generated_tokens_total", "0+600x30"),
        ],
        "alert_rule_test": [alert("SpecRLRolloutStalled", "25m", False)],
    },
    "training phase, nothing queued": {
        "input_series": [
            s("specrl_rollout_queue_depth", "0x30", role="coordinator", worker="grpo-coordinator-0"),
            s("specrl_rollout_active_sequences", "0x30"),
            s("specrl_rollout_generated_tokens_total", "1000x30"),
        ],
        "alert_rule_test": [alert("SpecRLRolloutStalled", "25m", False)],
    },
    # 10 of 100 draft tokens accepted per minute with speculation on: rate 0.1 < 0.3 for > 15m.
    "acceptance collapsed": {
        "input_series": [
            s("specrl_spec_decode_num_accepted_tokens_total", "0+10x40"),
            s("specrl_spec_decode_num_draft_tokens_total", "0+100x40"),
            s("specrl_spec_decode_enabled", "1x40"),
        ],
        "alert_rule_test": [alert("SpecRLAcceptanceCollapsed", "12m", False),
                            alert("SpecRLAcceptanceCollapsed", "35m", True, severity="warning", team="ml")],
    },
    "acceptance healthy": {
        "input_series": [
            s("specrl_spec_decode_num_accepted_tokens_total", "0+80x40"),
            s("specrl_spec_decode_num_draft_tokens_total", "0+100x40"),
            s("specrl_spec_decode_enabled", "1x40"),
        ],
        "alert_rule_test": [alert("SpecRLAcceptanceCollapsed", "35m", False)],
    },
    "acceptance low but speculation switched off": {
        "input_series": [
            s("specrl_spec_decode_num_accepted_tokens_total", "0+10x40"),
            s("specrl_spec_decode_num_draft_tokens_total", "0+100x40"),
            s("specrl_spec_decode_enabled", "0x40"),
        ],
        "alert_rule_test": [alert("SpecRLAcceptanceCollapsed", "35m", False)],
    },
    # One sync a minute, each between 60 and 120 s: p95 ~ 117 s > 60 s.
    "weight sync slow": {
        "input_series": [
            s("specrl_weight_sync_duration_seconds_bucket", "0x60", le="30"),
            s("specrl_weight_sync_duration_seconds_bucket", "0x60", le="60"),
            s("specrl_weight_sync_duration_seconds_bucket", "0+1x60", le="120"),
            s("specrl_weight_sync_duration_seconds_bucket", "0+1x60", le="+Inf"),
        ],
        "alert_rule_test": [alert("SpecRLWeightSyncSlow", "10m", False),
                            alert("SpecRLWeightSyncSlow", "45m", True, severity="warning", team="ml")],
    },
    "weight sync fast": {
        "input_series": [
            s("specrl_weight_sync_duration_seconds_bucket", "0+1x60", le="1"),
            s("specrl_weight_sync_duration_seconds_bucket", "0+1x60", le="60"),
            s("specrl_weight_sync_duration_seconds_bucket", "0+1x60", le="+Inf"),
        ],
        "alert_rule_test": [alert("SpecRLWeightSyncSlow", "45m", False)],
    },
    # The operator exports the job's status conditions (1 = True) under their current reason.
    "job degraded": {
        "input_series": [cond("Degraded", "CoordinatorUnreachable", "1x30"), cond("Ready", "AllPodsRunning", "1x30")],
        "alert_rule_test": [alert("SpecRLJobDegraded", "3m", False),
                            alert("SpecRLJobDegraded", "15m", True, "CoordinatorUnreachable",
                                  severity="critical", team="ml")],
    },
    # Any reason counts, and a change of reason keeps the alert (and its `for`) going with the new reason.
    "job degraded, reason changes": {
        "input_series": [cond("Degraded", "CoordinatorUnreachable", "1x3 stale"),
                         cond("Degraded", "ImmutableFieldChanged", "_x3 1x27")],
        "alert_rule_test": [alert("SpecRLJobDegraded", "2m", False),
                            alert("SpecRLJobDegraded", "7m", True, "ImmutableFieldChanged",
                                  severity="critical", team="ml")],
    },
    "job healthy": {
        "input_series": [cond("Degraded", "AsExpected", "0x30"), cond("Ready", "AllPodsRunning", "1x30"),
                         cond("Rebalancing", "QueueBacklog", "1x30")],
        "alert_rule_test": [alert("SpecRLJobDegraded", "25m", False)],
    },
    # Degraded for 3 minutes (a coordinator restart), then back: shorter than `for`, never fires.
    "job degraded briefly": {
        "input_series": [cond("Degraded", "CoordinatorUnreachable", "0x5 1x3 stale"),
                         cond("Degraded", "AsExpected", "_x8 0x22")],
        "alert_rule_test": [alert("SpecRLJobDegraded", "10m", False), alert("SpecRLJobDegraded", "25m", False)],
    },
}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_promtool_rule_scenario(name: str, rules_file: Path, tmp_path: Path) -> None:
    scenario = {"interval": "1m", **SCENARIOS[name]}
    tests_file = tmp_path / "tests.yaml"
    tests_file.write_text(yaml.safe_dump({
        "rule_files": [str(rules_file)], "evaluation_interval": "1m", "tests": [scenario]}))
    out = run([tool("promtool"), "test", "rules", str(tests_file)])
    assert out.returncode == 0, f"{name}:\n{out.stdout}\n{out.stderr}"
