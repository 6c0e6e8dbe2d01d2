"""Every dashboard query against a real Prometheus scraping a real `specrl run` and a real `specrl operator`.

* `promtool check rules` parses every panel, annotation and variable expression (wrapped as recording rules).
* End to end: `specrl run` of examples/tiny-local.yaml on the runtime tests' micro models (local mode: the
  coordinator's /metrics re-exports every worker's series) and `specrl operator` reconciling the same RLJob in the Kubernetes emulator, with its
  coordinator URL pointed at the local run's coordinator, are scraped every second by Prometheus (Debian
  package) with the default `honor_labels: false` and a `namespace` target label, as Kubernetes service
  discovery attaches one (the series' own `rljob`/`rljob_namespace` labels cannot collide with target labels). While the run lasts, every query is evaluated
  with the dashboard variables set as Grafana would (each namespace offered with its first job, and "All" =
  `.*`); each must return a series with a finite value at some point, under "All" and under a selected job.
  The chart's rendered alert rules are loaded into the same Prometheus: a second RLJob (coordinator unreachable,
  and its immutable `spec.resources.image` edited, so its `Degraded` condition is True) must turn
  SpecRLJobDegraded pending, the healthy job must not, and nothing may look stalled.

A short local run makes no rebalance (that needs the operator to drain a worker of the run, and local mode's
coordinator token is private): the rebalance panels show the operator's pre-created zeros, and the annotations,
which only mark positive increases, are listed in EVENT_ONLY_WHERE. `promtool test rules` checks every query of
the rebalance counter, exactly as shipped, on the series a rebalance produces.
"""

from __future__ import annotations

import importlib.util
import math
import os
import re
import subprocess
import sys
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.chart.chart_support import (
    REPO,
    Prometheus,
    dashboard_queries,
    helm_template,
    load_dashboards,
    metric_names,
    rendered_rule_groups,
    run,
    start_operator,
    stop,
    substitute,
    tool,
)

pytestmark = pytest.mark.integration

BOARDS = load_dashboards()
# Annotations mark completed elastic moves only (increase > 0); nothing else makes them non-empty.
EVENT_ONLY_WHERE = {"job.json: annotation 'Rebalances'", "operator.json: annotation 'Rebalances'"}
REBALANCES = "specrl_operator_rebalance_total"
RUN_STEPS = 25


def all_queries() -> list[tuple[str, str]]:
    out = []
    for name, board in BOARDS.items():
        out += [(q.where, q.expr) for q in dashboard_queries(board, name)]
        for var in board["templating"]["list"]:
            if var["type"] == "query":
                out.append((f"{name}: variable {var['name']}", var["query"]["query"]))
    return out


def test_every_expression_parses(tmp_path: Path) -> None:
    rules = []
    for i, (where, expr) in enumerate(all_queries()):
        if expr.startswith("label_values("):
            m = re.fullmatch(r"label_values\((.+), (\w+)\)", expr)
            assert m, f"{where}: malformed label_values"
            expr = m.group(1)
        rules.append({"record": f"specrl:dashboard_query:{i}",
                      "expr": substitute(expr, {"namespace": ".*", "rljob": ".*"})})
    path = tmp_path / "queries.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboards", "rules": rules}]}))
    out = run([tool("promtool"), "check", "rules", str(path)])
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"SUCCESS: {len(rules)} rules found" in out.stdout


class Tail:
    """Collects a subprocess' output in a thread; `wait_for(pattern)` returns the first match."""

    def __init__(self, proc: subprocess.Popen[str]) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(proc,), daemon=True)
        self._thread.start()

    def _read(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            self.lines.append(line)

    def text(self) -> str:
        return "".join(self.lines)[-5000:]

    def wait_for(self, pattern: str, proc: subprocess.Popen[str], timeout: float) -> re.Match[str]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for line in list(self.lines):
                if m := re.search(pattern, line):
                    return m
            if proc.poll() is not None:
                break
            time.sleep(0.2)
        raise AssertionError(f"no {pattern!r} from specrl run within {timeout:.0f} s:\n{self.text()}")


def scrape_labels(url: str) -> tuple[str, str]:
    with urllib.request.urlopen(url, timeout=5) as resp:
        body = resp.read().decode()
    m = re.search(r'^specrl_rollout_queue_depth\{([^}]*)\}', body, re.MULTILINE)
    assert m, f"{url} exports no specrl_rollout_queue_depth:\n{body[:2000]}"
    labels = dict(re.findall(r'(\w+)="([^"]*)"', m.group(1)))
    return labels["rljob_namespace"], labels["rljob"]


def micro_job(path: Path, steps: int) -> Path:
    """examples/tiny-local.yaml on the runtime tests' micro policy and drafter (built in seconds, then cached)."""
    spec = importlib.util.spec_from_file_location("specrl_rlrun_micro", REPO / "tests/integration/rlrun/micro.py")
    assert spec and spec.loader
    micro = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(micro)
    policy, draft = micro.micro_models()
    job = yaml.safe_load((REPO / "examples" / "tiny-local.yaml").read_text())
    job["metadata"] = {"name": "chart-e2e", "namespace": "localhost"}
    job["spec"]["model"]["name"] = str(policy)
    # A draft model and drafter training (the example speculates with n-gram): the drafter panels need data too.
    job["spec"]["speculative"].update(method="draft_model", draftModel=str(draft), numSpeculativeTokens=4,
                                      drafterTraining={"enabled": True, "learningRate": 1.0e-3, "interval": 1})
    # Fixed speculation: the adaptive controller may rightly keep the micro models on plain decoding for a whole
    # short run, and the acceptance panels need drafts to show anything.
    job["spec"]["speculative"]["adaptive"] = {"toggle": False, "draftLength": False, "strategy": False}
    job["spec"]["algorithm"].update(steps=steps, promptsPerStep=8, groupSize=2, maxNewTokens=32, evalEvery=2)
    job["spec"]["dataset"]["synthetic"]["size"] = 128
    path.write_text(yaml.safe_dump(job))
    return path


@pytest.mark.slow
def test_every_panel_returns_data(kube, tmp_path: Path) -> None:
    job_file = micro_job(tmp_path / "job.yaml", RUN_STEPS)
    specrl = str(Path(sys.executable).parent / "specrl")
    rules = tmp_path / "specrl-rules.yaml"
    rules.write_text(yaml.safe_dump(rendered_rule_groups(helm_template(None, sets={"prometheusRule.enabled": "true"}))))
    op = None
    with Prometheus([], rule_files=[rules]) as prom:
        run_proc = subprocess.Popen(
            [specrl, "run", str(job_file), "--no-progress", "--out", str(tmp_path / "run")],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
            env={**os.environ, "SPECRL_FORCE_PROGRESS": ""})
        tail = Tail(run_proc)
        try:
            coord = tail.wait_for(r"coordinator API (http://127\.0\.0\.1:(\d+))", run_proc, timeout=300)
            coord_url, coord_port = coord.group(1), int(coord.group(2))
            prom.set_targets([f"127.0.0.1:{coord_port}"])
            namespace, job = scrape_labels(f"{coord_url}/metrics")

            # The operator reconciles the same RLJob in the emulator and polls the real coordinator through
            # `http://{namespace}:<port>`: the run's namespace is "localhost", so that resolves; a second RLJob in
            # namespace "unreachable" has a coordinator nobody can reach (the Degraded / poll-error signal).
            assert namespace == "localhost", f"the run should label its series with its namespace, got {namespace}"
            kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
            op = start_operator(kubeconfig, tmp_path / "operator.log",
                                f"--coordinator-url-template=http://{{namespace}}:{coord_port}", "--poll-interval=1")
            prom.set_targets([f"127.0.0.1:{coord_port}", f"127.0.0.1:{op.metrics_port}"])
            body = yaml.safe_load(job_file.read_text())
            for ns, name in ((namespace, job), ("unreachable", f"{job}-lost")):
                kube.create("v1/namespaces", {"metadata": {"name": ns}})
                kube.create("specrl.io/v1alpha1/rljobs", {**body, "metadata": {"name": name, "namespace": ns}},
                            namespace=ns)
            degrade(kube, "unreachable", f"{job}-lost")

            prom.wait_for_scrapes(n=2, timeout=60)
            results, alerts = observe(prom, run_proc, tail, after_exit=6.0)
            metadata = prom.api("metadata")
        finally:
            stop(run_proc, timeout=30)
            if op is not None:
                stop(op.proc)

    def verdict(r: dict[str, Any]) -> str:
        return "ok   " if r["All"] and r["selected"] else "EMPTY"

    report = "\n".join(f"  {verdict(r)} {r['where']}  (All: {r['All']}, a selected job: {r['selected']}, "
                       f"max {r['series']} series)" for r in results.values())
    print("dashboard queries against the real run:\n" + report)
    errors = [f"{r['where']}: {r['error']}" for r in results.values() if r["error"]]
    assert not errors, "PromQL errors:\n" + "\n".join(errors)
    empty = [r for r in results.values() if verdict(r) == "EMPTY" and r["where"] not in EVENT_ONLY_WHERE]
    assert not empty, (f"{len(empty)} dashboard queries never returned a finite value:\n{report}\n"
                       f"run output:\n{tail.text()}\noperator:\n{op.output() if op else ''}")
    # The chart's alerts ran on the same data: the job whose coordinator nobody can reach is Degraded (pending:
    # a short run never outlasts `for: 5m`), the healthy one is not.
    print(f"alerts seen (name, job, state): {sorted(alerts)}")
    assert any(a[:2] == ("SpecRLJobDegraded", f"{job}-lost") for a in alerts), sorted(alerts)
    assert not any(a[:2] == ("SpecRLJobDegraded", job) for a in alerts), sorted(alerts)
    assert not any(a[0] == "SpecRLRolloutStalled" for a in alerts), sorted(alerts)
    for name in ("specrl_operator_allocation_gpus", "specrl_operator_job_condition", REBALANCES):
        assert name in metadata or name.removesuffix("_total") in metadata, f"{name} is not exported by the operator"


def degrade(kube: Any, namespace: str, name: str, timeout: float = 60) -> None:
    """Edit the job's immutable image once the operator has recorded the applied one: Degraded=True."""
    deadline = time.monotonic() + timeout
    while not ((kube.get("specrl.io/v1alpha1/rljobs", namespace, name) or {}).get("status") or {}).get("applied"):
        assert time.monotonic() < deadline, f"the operator never reconciled {namespace}/{name}"
        time.sleep(0.2)
    kube.patch("specrl.io/v1alpha1/rljobs", namespace, name, {"spec": {"resources": {"image": "example/edited:1"}}})


def observe(prom: Prometheus, run_proc: subprocess.Popen[str], tail: Tail,
            after_exit: float) -> tuple[dict[str, Any], set[tuple[str, str, str]]]:
    """Evaluate every query every ~2 s until the run has ended (plus `after_exit` s): the best result per query,
    and every (alert, job, state) Prometheus reported meanwhile."""
    results: dict[str, dict[str, Any]] = {}
    alerts: set[tuple[str, str, str]] = set()
    ended: float | None = None
    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        for name, board in BOARDS.items():
            for variables in [*discover(prom, board), {"namespace": ".*", "rljob": ".*"}]:
                choice = "All" if variables["rljob"] == ".*" else "selected"
                for q in dashboard_queries(board, name):
                    r = results.setdefault(q.where, {"where": q.where, "series": 0, "error": "",
                                                     "All": False, "selected": False, "exprs": set()})
                    expr = substitute(q.expr, variables)
                    r["exprs"].add(expr)
                    try:
                        series = prom.query(expr)
                    except Exception as exc:  # noqa: BLE001 - reported with the query, never raised mid-loop
                        r["error"] = f"{type(exc).__name__}: {exc}"
                        continue
                    r["series"] = max(r["series"], len(series))
                    if any(math.isfinite(float(s["value"][1])) for s in series):
                        r[choice] = True
        alerts |= {(a["labels"]["alertname"], a["labels"].get("rljob", ""), a["state"]) for a in prom.alerts()}
        if run_proc.poll() is not None:
            ended = ended or time.monotonic()
            if time.monotonic() - ended > after_exit:
                break
        time.sleep(2)
    assert run_proc.poll() == 0, f"specrl run failed ({run_proc.returncode}):\n{tail.text()}"
    return results, alerts


def discover(prom: Prometheus, board: dict[str, Any]) -> list[dict[str, str]]:
    """The variable settings a user can pick: each namespace the `namespace` query offers, with its first job."""
    queries = {v["name"]: v["query"]["query"] for v in board["templating"]["list"] if v["type"] == "query"}
    ns_query = re.fullmatch(r"label_values\((.+), (\w+)\)", queries["namespace"])
    job_query = re.fullmatch(r"label_values\((.+), (\w+)\)", queries["rljob"])
    assert ns_query and job_query, f"unexpected variable queries {queries}"
    ns_metric, ns_label = ns_query.groups()
    job_metric, job_label = job_query.groups()
    out = []
    for ns in sorted(prom.label_values(ns_label, ns_metric)):
        jobs = sorted(prom.label_values(job_label, substitute(job_metric, {"namespace": ns})))
        if jobs:
            out.append({"namespace": ns, "rljob": jobs[0]})
    return out


def test_event_queries_with_promtool(tmp_path: Path) -> None:
    """The rebalance panels and annotations (no rebalance happens in the short run) on series a rebalance produces.

    A rollout -> trainer move at minute 5 of job ml/grpo: its (rollout, trainer, LongTail) counter steps from 0 to 1
    while the other pre-created counters stay 0. Each dashboard expression, exactly as shipped (variables = All,
    $__rate_interval = 1m), must be positive for that move at minute 5, and nowhere positive at minute 3 or 9.
    """
    where = {q.where: q.expr for name, board in BOARDS.items() for q in dashboard_queries(board, name)}
    queries = {w: substitute(e, {"namespace": ".*", "rljob": ".*"}, rate_interval="1m") for w, e in where.items()
               if REBALANCES in metric_names(e)}
    assert set(EVENT_ONLY_WHERE) <= set(queries) and len(queries) == 4, sorted(queries)
    job = 'rljob_namespace="ml", rljob="grpo"'
    move = 'from_role="rollout", to_role="trainer", reason="LongTail"'
    series = [
        {"series": f"{REBALANCES}{{{job}, {move}}}", "values": "0x4 1x10"},
        {"series": f'{REBALANCES}{{{job}, from_role="trainer", to_role="rollout", reason="QueueBacklog"}}',
         "values": "0x14"},
    ]
    tests = []
    for w, expr in queries.items():
        counted = f"count by (reason, from_role, to_role) (({expr}) > 0)"
        tests.append({"interval": "1m", "input_series": series, "name": w, "promql_expr_test": [
            {"expr": counted, "eval_time": "5m", "exp_samples": [{"labels": f"{{{move}}}", "value": 1}]},
            {"expr": counted, "eval_time": "3m", "exp_samples": []},
            {"expr": counted, "eval_time": "9m", "exp_samples": []},
        ]})
    path = tmp_path / "tests.yaml"
    path.write_text(yaml.safe_dump({"rule_files": [], "evaluation_interval": "1m", "tests": tests}))
    out = run([tool("promtool"), "test", "rules", str(path)])
    assert out.returncode == 0, out.stdout + out.stderr
