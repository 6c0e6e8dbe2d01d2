"""Generate the chart's Grafana dashboards (``job.json``, ``operator.json``) from one table of panels.

The JSON files next to this script are what the chart ships (``.Files.Get`` in templates/dashboards.yaml) and
what users import by hand; this script is their source, so ids, grid positions, datasource references and label
selectors stay consistent. Regenerate after editing::

    python charts/specrl/dashboards/generate.py          # rewrite the JSON
    python charts/specrl/dashboards/generate.py --check  # exit 1 when the JSON is stale (used by the tests)

Why a hand-written generator and not a library: grafana-foundation-sdk (Grafana's builders) is on PyPI, but as an
alpha (development status 3), for Python >= 3.11 (the project supports 3.10), with the types of Grafana 10.1 in
its latest PyPI release, and without the ``__inputs``/``__requires`` blocks a dashboard needs for a manual import
(we would post-process its output anyway). grafanalib's last release is from January 2024. What makes these
dashboards right is the panel table below, the PromQL helpers, and the tests that parse every expression with
promtool and run it on a real Prometheus; a library would replace only the ~100 lines of JSON layout
(``panel_json``, ``layout``, ``variable``, ``dashboard``), at the price of a dependency pinned to Grafana versions.

Conventions (those of vLLM's and kube-prometheus-stack's dashboards):

* datasource ``${DS_PROMETHEUS}``: declared in ``__inputs`` for a manual import, and as a datasource template
  variable of the same name so that the Grafana sidecar (which ignores ``__inputs``) resolves it too;
* labels ``rljob_namespace`` and ``rljob`` name the RLJob (never ``namespace``/``job``, which Prometheus sets on
  every target: the dashboards work with any scrape configuration, ``honor_labels`` true or false);
* template variables ``namespace`` and ``rljob`` (multi-value, "All" = ``.*``), used as
  ``rljob_namespace=~"$namespace", rljob=~"$rljob"`` in every selector;
* acceptance rate ``rate(accepted)/rate(draft_tokens)`` and acceptance length ``1 + rate(accepted)/rate(drafts)``,
  computed in PromQL as vLLM does; rates over ``$__rate_interval``.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
DS = {"type": "prometheus", "uid": "${DS_PROMETHEUS}"}
SEL = 'rljob_namespace=~"$namespace", rljob=~"$rljob"'
RATE = "$__rate_interval"
TOKENS_PER_S = "suffix: tokens/s"  # Grafana custom unit: Grafana has no built-in token unit
SCHEMA_VERSION = 39


@dataclass
class Target:
    expr: str
    legend: str


@dataclass
class Panel:
    title: str
    description: str
    targets: list[Target]
    unit: str = "short"
    kind: str = "timeseries"
    width: int = 8
    height: int = 8
    min: float | None = 0
    max: float | None = None
    stack: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class Row:
    title: str
    panels: list[Panel]


def rate(metric: str, by: str = "rljob_namespace, rljob", sel: str = SEL) -> str:
    return f"sum by ({by}) (rate({metric}{{{sel}}}[{RATE}]))"


def quantile(q: float, metric: str, by: str = "rljob_namespace, rljob", sel: str = SEL) -> str:
    return f"histogram_quantile({q}, sum by ({by}, le) (rate({metric}_bucket{{{sel}}}[{RATE}])))"


def mean_of_histogram(metric: str, by: str = "rljob_namespace, rljob", sel: str = SEL) -> str:
    return f"{rate(metric + '_sum', by, sel)} / {rate(metric + '_count', by, sel)}"


JOB_ROWS: list[Row] = [
    Row("What goes wrong", [
        Panel("Weight-sync failures",
              "Aborted weight syncs per second, by role; the receivers kept their previous weights (the rollout then "
              "runs on stale weights: see staleness).",
              [Target(f"sum by (rljob_namespace, rljob, role) (increase(specrl_weight_sync_failures_total{{{SEL}}}[{RATE}]))",
                      "{{rljob}} {{role}}")],
              kind="barchart-ts"),
        Panel("Reward errors",
              "Reward-function calls that raised (the sample got reward 0), per worker.",
              [Target(f"sum by (rljob_namespace, rljob, worker) (increase(specrl_reward_errors_total{{{SEL}}}[{RATE}]))",
                      "{{worker}}")],
              kind="barchart-ts"),
        Panel("Requeued prompts",
              "Prompts put back in the queue because their rollout worker was drained or died.",
              [Target(f"sum by (rljob_namespace, rljob) (increase(specrl_rollout_prompts_requeued_total{{{SEL}}}[{RATE}]))",
                      "{{rljob}}")],
              kind="barchart-ts"),
        Panel("Weight staleness (versions)",
              "Policy versions each rollout worker lags behind the trainer; async mode allows up to "
              "spec.maxStaleness, sync mode should stay at 0.",
              [Target(f"max by (rljob_namespace, rljob, worker) (specrl_rollout_weight_staleness_versions{{{SEL}}})",
                      "{{worker}}")]),
        Panel("Malformed dataset lines",
              "Dataset lines skipped because they could not be parsed (total since the workers started).",
              [Target(f"max by (rljob_namespace, rljob) (specrl_dataset_malformed_lines_total{{{SEL}}})", "{{rljob}}")]),
        Panel("Pod failures",
              "Failed worker pods the operator restarted, counted against spec.backoffLimit (the job fails beyond it).",
              [Target(f"max by (rljob_namespace, rljob) (specrl_operator_job_pod_failures{{{SEL}}})", "{{rljob}}")]),
    ]),
    Row("Rollout", [
        Panel("Rollout throughput (tokens/s)",
              "Response tokens generated per second by the job's rollout workers (all workers, and per worker).",
              [Target(rate("specrl_rollout_generated_tokens_total"), "{{rljob}} total"),
               Target(rate("specrl_rollout_generated_tokens_total", "rljob_namespace, rljob, worker"), "{{worker}}")],
              unit=TOKENS_PER_S),
        Panel("Speculative acceptance rate",
              "Share of proposed draft tokens the target accepted: rate(accepted) / rate(draft tokens), as vLLM "
              "computes it. Low values mean a stale or weak drafter.",
              [Target(f"{rate('specrl_spec_decode_num_accepted_tokens_total')} / "
                      f"{rate('specrl_spec_decode_num_draft_tokens_total')}", "{{rljob}}")],
              unit="percentunit", max=1),
        Panel("Mean acceptance length",
              "Tokens emitted per verify step of a sequence: 1 + rate(accepted) / rate(drafts). 1 means no "
              "speculative gain; the draft length plus one is the ceiling.",
              [Target(f"1 + {rate('specrl_spec_decode_num_accepted_tokens_total')} / "
                      f"{rate('specrl_spec_decode_num_drafts_total')}", "{{rljob}}")],
              unit="short", min=1),
        Panel("Speculative decoding on (share of rollout workers)",
              "Fraction of rollout workers with speculation switched on. The adaptive toggle turns it on when "
              "the active batch is small (memory-bound decode, e.g. the long tail) and off at large batch.",
              [Target(f'avg by (rljob_namespace, rljob) (specrl_spec_decode_enabled{{{SEL}, role="rollout"}})', "{{rljob}}")],
              unit="percentunit", max=1),
        Panel("Draft length (tokens)",
              "Speculative tokens per draft (gamma) per rollout worker, 0 while speculation is off; adapts to the "
              "running acceptance rate.",
              [Target(f'max by (rljob_namespace, rljob, worker) '
                      f'(specrl_spec_decode_draft_length_tokens{{{SEL}, role="rollout"}})', "{{worker}}")]),
        Panel("Acceptance rate by draft position",
              "Share of drafts whose token at position i (0 = first) was accepted, as vLLM's "
              "spec_decode_num_accepted_tokens_per_pos over num_drafts: where along the draft the drafter loses "
              "the target. Each position is at most the one before it.",
              [Target(f"{rate('specrl_spec_decode_num_accepted_tokens_per_pos_total', 'rljob_namespace, rljob, position')}"
                      f" / ignoring (position) group_left "
                      f"{rate('specrl_spec_decode_num_drafts_total')}", "{{rljob}} position {{position}}")],
              unit="percentunit", max=1),
        Panel("Rollout queue depth",
              "Prompts waiting in the coordinator queue. A growing queue pulls GPUs towards rollout.",
              [Target(f"sum by (rljob_namespace, rljob) (specrl_rollout_queue_depth{{{SEL}}})", "{{rljob}}")]),
        Panel("Active sequences",
              "Sequences being generated right now, per worker (stacked).",
              [Target(f"sum by (rljob_namespace, rljob, worker) (specrl_rollout_active_sequences{{{SEL}}})", "{{worker}}")],
              stack=True),
        Panel("Long-tail phase",
              "1 while the step is in its long tail (queue empty, few long sequences left): speculation pays off "
              "and idle capacity trains the drafter.",
              [Target(f"max by (rljob_namespace, rljob) (specrl_rollout_long_tail{{{SEL}}})", "{{rljob}}")],
              kind="state-timeline", max=1,
              extra={"mappings": [{"type": "value", "options": {
                  "0": {"text": "bulk", "color": "green", "index": 0},
                  "1": {"text": "long tail", "color": "orange", "index": 1}}}]}),
        Panel("Response length",
              "Median and 95th percentile of finished responses, in tokens; the gap is the long tail.",
              [Target(quantile(0.5, "specrl_rollout_response_length_tokens"), "p50 {{rljob}}"),
               Target(quantile(0.95, "specrl_rollout_response_length_tokens"), "p95 {{rljob}}")]),
    ]),
    Row("Resources", [
        Panel("GPUs per role",
              "GPUs the operator allocates to the trainer and rollout roles (replicas x gpusPerPod), drawn as steps. "
              "Annotations mark rebalances, with their reason.",
              [Target(f"sum by (rljob_namespace, rljob, role) (specrl_operator_allocation_gpus{{{SEL}}})",
                      "{{rljob}} {{role}}")],
              width=16, stack=False, extra={"drawStyle": "line", "lineInterpolation": "stepAfter"}),
        Panel("Rebalances by reason",
              "Pods the elastic rebalancer moved between roles, by reason and direction (0 while nothing moves).",
              [Target(f"sum by (rljob_namespace, rljob, reason, from_role, to_role) "
                      f"(increase(specrl_operator_rebalance_total{{{SEL}}}[{RATE}]))",
                      "{{rljob}} {{reason}}: {{from_role}} → {{to_role}}")],
              kind="barchart-ts"),
        Panel("Job conditions",
              "The RLJob's status conditions over time (True/False): Ready, Rebalancing (a move in flight), "
              "Degraded (coordinator unreachable or an immutable field edited), Suspended, Complete, Failed.",
              [Target(f"max by (rljob_namespace, rljob, condition) (specrl_operator_job_condition{{{SEL}}})",
                      "{{rljob}} {{condition}}")],
              kind="state-timeline", width=16, max=1,
              extra={"mappings": [{"type": "value", "options": {
                  "0": {"text": "False", "color": "transparent", "index": 0},
                  "1": {"text": "True", "color": "blue", "index": 1}}}]}),
        Panel("Sequences completed",
              "Finished rollout sequences per second.",
              [Target(rate("specrl_rollout_sequences_completed_total"), "{{rljob}}")]),
    ]),
    Row("Weight sync", [
        Panel("Weight-sync duration",
              "Time of one packed-bucket weight sync (policy and drafter): median, p95 and mean.",
              [Target(quantile(0.5, "specrl_weight_sync_duration_seconds"), "p50 {{rljob}}"),
               Target(quantile(0.95, "specrl_weight_sync_duration_seconds"), "p95 {{rljob}}"),
               Target(mean_of_histogram("specrl_weight_sync_duration_seconds"), "mean {{rljob}}")],
              unit="s"),
        Panel("Weight-sync bandwidth",
              "Bytes per second of weights moved by syncs, by role (trainer: sent, rollout: received).",
              [Target(rate("specrl_weight_sync_bytes_total", "rljob_namespace, rljob, role"), "{{rljob}} {{role}}")],
              unit="Bps"),
        Panel("Weight version",
              "Policy version each worker holds. Rollout workers lagging the trainer show async staleness.",
              [Target(f"max by (rljob_namespace, rljob, worker) (specrl_weight_version{{{SEL}}})", "{{worker}}")]),
    ]),
    Row("Training", [
        Panel("Trainer step time",
              "Wall time of one training step (forward, backward, optimizer): median and p95.",
              [Target(quantile(0.5, "specrl_trainer_step_duration_seconds"), "p50 {{rljob}}"),
               Target(quantile(0.95, "specrl_trainer_step_duration_seconds"), "p95 {{rljob}}")],
              unit="s"),
        Panel("Trainer backlog",
              "Samples waiting for a trainer. A growing backlog (async mode) pushes GPUs towards training.",
              [Target(f"sum by (rljob_namespace, rljob) (specrl_trainer_backlog_samples{{{SEL}}})", "{{rljob}}")]),
        Panel("Reward",
              "Mean reward of the samples of the last training step, and greedy accuracy on held-out problems at "
              "the last periodic evaluation (spec.algorithm.evalEvery).",
              [Target(f"avg by (rljob_namespace, rljob) (specrl_trainer_reward_mean{{{SEL}}})", "reward {{rljob}}"),
               Target(f"max by (rljob_namespace, rljob) (specrl_eval_accuracy_ratio{{{SEL}}})", "held-out accuracy {{rljob}}")],
              min=None),
        Panel("Trainer loss",
              "Policy (GRPO) loss of the last training step; a NaN or a sudden jump shows here first.",
              [Target(f"avg by (rljob_namespace, rljob) (specrl_trainer_loss{{{SEL}}})", "policy {{rljob}}")],
              min=None),
        Panel("Gradient norm",
              "L2 norm of the policy gradient before clipping at 1.0. A norm that keeps climbing warns of a run "
              "about to diverge before the reward does.",
              [Target(f"max by (rljob_namespace, rljob) (specrl_trainer_grad_norm{{{SEL}}})", "{{rljob}}")],
              min=None),
        Panel("Training step",
              "Last completed RL step.",
              [Target(f"max by (rljob_namespace, rljob) (specrl_trainer_step{{{SEL}}})", "{{rljob}}")]),
        Panel("Drafter training",
              "Drafter loss and drafter optimizer steps per second (it trains on idle long-tail capacity).",
              [Target(f"avg by (rljob_namespace, rljob) (specrl_drafter_loss{{{SEL}}})", "loss {{rljob}}"),
               Target(rate("specrl_drafter_train_steps_total"), "steps/s {{rljob}}")],
              min=None),
    ]),
]

OPERATOR_ROWS: list[Row] = [
    Row("Reconciliation", [
        Panel("Reconcile rate",
              "Reconciliations per second, by trigger (create/update handlers, the poll timer).",
              [Target(f"sum by (trigger) (rate(specrl_operator_reconcile_duration_seconds_count[{RATE}]))",
                      "{{trigger}}")],
              unit="ops"),
        Panel("Reconcile latency",
              "Wall time of one reconciliation of one RLJob: p50, p95, p99.",
              [Target(quantile(q, "specrl_operator_reconcile_duration_seconds", "trigger", ""), f"p{int(q * 100)} "
                      "{{trigger}}") for q in (0.5, 0.95, 0.99)],
              unit="s"),
        Panel("Reconcile errors by reason",
              "Reconciliations that raised (kopf retries them), by trigger and reason: the Kubernetes status reason "
              "of an API error (Conflict, Forbidden, ...) or the exception type.",
              # `or on () vector(0)`: a flat 0 while nothing failed (error series only exist once one happened).
              [Target(f"sum by (trigger, reason) (increase(specrl_operator_reconcile_errors_total[{RATE}])) "
                      "or on () vector(0)", "{{trigger}} {{reason}}")],
              kind="barchart-ts"),
        Panel("Reconciles in flight",
              "Reconciliations started and not finished, including those waiting for their job's lock (the queue).",
              [Target("sum (specrl_operator_reconciles_in_flight)", "in flight")]),
        Panel("Kubernetes API errors by verb and code",
              "Requests of the operator's own client answered with an HTTP error (code 0: no answer), per second. "
              "409 on create and 404 on delete are expected (the child exists / is gone already).",
              [Target(f'sum by (verb, code) (rate(specrl_operator_api_requests_total{{code!~"2.."}}[{RATE}])) '
                      "or on () vector(0)", "{{verb}} {{code}}")],
              unit="reqps"),
        Panel("Operator memory and CPU",
              "Resident memory and CPU of the operator process (its process_* metrics, selected by the scrape "
              "target that serves specrl_operator_*).",
              [Target("process_resident_memory_bytes * on (job, instance) group_left () "
                      "group by (job, instance) (specrl_operator_reconciles_in_flight)", "memory {{instance}}"),
               Target(f"rate(process_cpu_seconds_total[{RATE}]) * on (job, instance) group_left () "
                      "group by (job, instance) (specrl_operator_reconciles_in_flight)", "CPU {{instance}}")],
              unit="bytes", extra={"overrides": [{"matcher": {"id": "byRegexp", "options": "CPU.*"},
                                                  "properties": [{"id": "unit", "value": "percentunit"},
                                                                 {"id": "custom.axisPlacement", "value": "right"}]}]}),
        Panel("Kubernetes API writes",
              "Writes the operator sends to the API server for children and status, by verb and kind.",
              [Target(f"sum by (verb, kind) (rate(specrl_operator_api_writes_total[{RATE}]))", "{{verb}} {{kind}}")],
              unit="ops"),
    ]),
    Row("Jobs", [
        Panel("Jobs by phase",
              "RLJobs this operator serves, by phase.",
              [Target("sum by (phase) (specrl_operator_jobs)", "{{phase}}")],
              stack=True),
        Panel("Rebalances by reason",
              "Pods moved between roles by the elastic rebalancer, per reason and direction, summed over jobs.",
              [Target(f"sum by (reason, from_role, to_role) "
                      f"(increase(specrl_operator_rebalance_total{{{SEL}}}[{RATE}]))",
                      "{{reason}}: {{from_role}} → {{to_role}}")],
              kind="barchart-ts"),
        Panel("Coordinator poll errors",
              "Failed polls of a job coordinator's GET /status (a running job turns Degraded while they persist).",
              [Target(rate("specrl_operator_coordinator_errors_total"), "{{rljob_namespace}}/{{rljob}}")],
              unit="ops"),
        Panel("Jobs by condition",
              "RLJobs whose condition is True, per condition (Degraded is what SpecRLJobDegraded alerts on).",
              [Target(f"sum by (condition) (specrl_operator_job_condition{{{SEL}}})", "{{condition}}")]),
        Panel("GPUs per job and role",
              "GPUs allocated to each role of each job, stacked: the top line is every GPU specrl jobs hold.",
              [Target(f"sum by (rljob_namespace, rljob, role) (specrl_operator_allocation_gpus{{{SEL}}})",
                      "{{rljob_namespace}}/{{rljob}} {{role}}")],
              width=16, stack=True, extra={"lineInterpolation": "stepAfter"}),
    ]),
]


def panel_json(p: Panel, pid: int, x: int, y: int) -> dict[str, Any]:
    kind = "timeseries" if p.kind == "barchart-ts" else p.kind
    custom: dict[str, Any] = {"lineWidth": 1, "fillOpacity": 10, "showPoints": "never", "spanNulls": False}
    if p.kind == "barchart-ts":
        custom.update({"drawStyle": "bars", "fillOpacity": 80, "stacking": {"mode": "normal", "group": "A"}})
    elif p.stack:
        custom.update({"fillOpacity": 30, "stacking": {"mode": "normal", "group": "A"}})
    for key in ("drawStyle", "lineInterpolation"):
        if key in p.extra:
            custom[key] = p.extra[key]
    defaults: dict[str, Any] = {"unit": p.unit, "custom": custom if kind == "timeseries" else {}}
    if p.min is not None:
        defaults["min"] = p.min
    if p.max is not None:
        defaults["max"] = p.max
    if "mappings" in p.extra:
        defaults["mappings"] = p.extra["mappings"]
    return {
        "id": pid,
        "type": kind,
        "title": p.title,
        "description": p.description,
        "datasource": DS,
        "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y},
        "fieldConfig": {"defaults": defaults, "overrides": p.extra.get("overrides", [])},
        "options": {"legend": {"displayMode": "list", "placement": "bottom", "showLegend": True},
                    "tooltip": {"mode": "multi", "sort": "desc"}},
        "targets": [
            {"datasource": DS, "refId": chr(ord("A") + i), "expr": t.expr, "legendFormat": t.legend,
             "range": True, "instant": False, "editorMode": "code"}
            for i, t in enumerate(p.targets)
        ],
    }


def layout(rows: list[Row]) -> list[dict[str, Any]]:
    panels: list[dict[str, Any]] = []
    pid, y = 1, 0
    for row in rows:
        panels.append({"id": pid, "type": "row", "title": row.title, "collapsed": False,
                       "gridPos": {"h": 1, "w": 24, "x": 0, "y": y}, "panels": []})
        pid, y, x, row_h = pid + 1, y + 1, 0, 0
        for p in row.panels:
            if x + p.width > 24:
                x, y, row_h = 0, y + row_h, 0
            panels.append(panel_json(p, pid, x, y))
            pid, x, row_h = pid + 1, x + p.width, max(row_h, p.height)
        y += row_h
    return panels


def variable(name: str, label: str, query: str) -> dict[str, Any]:
    return {
        "name": name, "label": label, "type": "query", "datasource": DS,
        "definition": query, "query": {"query": query, "refId": f"{name}-var"},
        "refresh": 2, "sort": 1, "multi": True, "includeAll": True, "allValue": ".*",
        "current": {"selected": True, "text": ["All"], "value": ["$__all"]}, "options": [], "hide": 0, "regex": "",
    }


def dashboard(uid: str, title: str, description: str, rows: list[Row], var_metric: str,
              annotations: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "__inputs": [{"name": "DS_PROMETHEUS", "label": "Prometheus", "description": "Prometheus scraping specrl",
                      "type": "datasource", "pluginId": "prometheus", "pluginName": "Prometheus"}],
        "__requires": [
            {"type": "grafana", "id": "grafana", "name": "Grafana", "version": "10.0.0"},
            {"type": "datasource", "id": "prometheus", "name": "Prometheus", "version": "1.0.0"},
            {"type": "panel", "id": "timeseries", "name": "Time series", "version": ""},
            {"type": "panel", "id": "state-timeline", "name": "State timeline", "version": ""},
        ],
        "uid": uid,
        "title": title,
        "description": description,
        "tags": ["specrl"],
        "editable": True,
        "graphTooltip": 1,
        "schemaVersion": SCHEMA_VERSION,
        "version": 1,
        "refresh": "30s",
        "time": {"from": "now-3h", "to": "now"},
        "timepicker": {},
        "timezone": "browser",
        "links": [{"title": "specrl dashboards", "type": "dashboards", "tags": ["specrl"], "asDropdown": True}],
        "annotations": {"list": [
            {"builtIn": 1, "datasource": {"type": "grafana", "uid": "-- Grafana --"}, "enable": True, "hide": True,
             "iconColor": "rgba(0, 211, 255, 1)", "name": "Annotations & Alerts", "type": "dashboard"},
            *annotations,
        ]},
        "templating": {"list": [
            {"name": "DS_PROMETHEUS", "label": "Data source", "type": "datasource", "query": "prometheus",
             "current": {}, "hide": 0, "refresh": 1, "regex": "", "options": []},
            variable("namespace", "Namespace", f"label_values({var_metric}, rljob_namespace)"),
            variable("rljob", "RLJob", f'label_values({var_metric}{{rljob_namespace=~"$namespace"}}, rljob)'),
        ]},
        "panels": layout(rows),
    }


REBALANCE_ANNOTATION = {
    "name": "Rebalances", "enable": True, "hide": False, "iconColor": "orange", "datasource": DS,
    "expr": f"sum by (rljob_namespace, rljob, reason, from_role, to_role) "
            f"(increase(specrl_operator_rebalance_total{{{SEL}}}[2m])) > 0",
    "step": "1m", "titleFormat": "Rebalance {{reason}}",
    "textFormat": "{{rljob_namespace}}/{{rljob}}: {{from_role}} → {{to_role}}",
    "tagKeys": "rljob_namespace,rljob,reason", "useValueForTime": False,
}
OPERATOR_REBALANCE_ANNOTATION = {
    **REBALANCE_ANNOTATION,
    "expr": "sum by (rljob_namespace, rljob, reason, from_role, to_role) (increase(specrl_operator_rebalance_total[2m])) > 0",
}


def dashboards() -> dict[str, dict[str, Any]]:
    return {
        "job.json": dashboard(
            "specrl-job", "specrl / job",
            "One RLJob: rollout throughput and speculative decoding, queue and long tail, GPUs per role, "
            "rebalances and conditions, weight sync, training; first what goes wrong.", JOB_ROWS, "specrl_rollout_queue_depth", [REBALANCE_ANNOTATION]),
        "operator.json": dashboard(
            "specrl-operator", "specrl / operator",
            "The specrl operator: reconciliation rate and latency, rebalances, jobs by phase and condition, GPUs.", OPERATOR_ROWS,
            "specrl_operator_allocation_gpus", [OPERATOR_REBALANCE_ANNOTATION]),
    }


def render(board: dict[str, Any]) -> str:
    return json.dumps(board, indent=2, ensure_ascii=False) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a JSON file differs from the generator")
    parser.add_argument("--out", type=Path, default=HERE, help="folder to write (default: next to this script)")
    args = parser.parse_args(argv)
    stale = []
    for name, board in dashboards().items():
        path = args.out / name
        text = render(board)
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path))
        else:
            path.write_text(text)
            print(f"wrote {path}")
    if stale:
        print("stale dashboards (run python charts/specrl/dashboards/generate.py): " + ", ".join(stale),
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
