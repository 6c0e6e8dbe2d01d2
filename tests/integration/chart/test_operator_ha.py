"""High availability as the chart sets it up (`replicaCount: 2`): two real `specrl operator` processes with the
chart's `--peering` argument, against the emulator holding the chart's CRDs (RLJob and kopf's peering CRDs) and
the peering object the chart renders. Exactly one reconciles; when it stops, the standby takes over."""

from __future__ import annotations

import re
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.integration.chart.chart_support import REPO, by_kind, helm_template, start_operator, stop
from tests.kube.waiting import wait_for

pytestmark = pytest.mark.integration

RLJOBS = "specrl.io/v1alpha1/rljobs"
PEERINGS = "kopf.dev/v1/clusterkopfpeerings"


def _reconciles(metrics_url: str) -> float:
    with urllib.request.urlopen(metrics_url, timeout=5) as resp:
        text = resp.read().decode()
    return sum(float(v) for v in re.findall(r"^specrl_operator_reconcile_duration_seconds_count\{[^}]*\} (\S+)$",
                                            text, re.MULTILINE))


def _job(name: str) -> dict[str, Any]:
    body = yaml.safe_load((REPO / "examples" / "tiny-local.yaml").read_text())
    return {**body, "metadata": {"name": name, "namespace": "ml"}}


@pytest.mark.slow
def test_two_replicas_one_active_and_fail_over(kube, tmp_path: Path) -> None:
    docs = helm_template(sets={"replicaCount": "2"})
    (peering,) = by_kind(docs, "ClusterKopfPeering")
    (deploy,) = by_kind(docs, "Deployment")
    peering_arg = next(a for a in deploy["spec"]["template"]["spec"]["containers"][0]["args"]
                       if a.startswith("--peering="))
    kube.create(PEERINGS, {k: peering[k] for k in ("apiVersion", "kind", "metadata")})
    kube.create("v1/namespaces", {"metadata": {"name": "ml"}})
    kubeconfig = kube.write_kubeconfig(tmp_path / "kubeconfig")
    ops = [start_operator(kubeconfig, tmp_path / f"operator-{i}.log", peering_arg, "--poll-interval=1")
           for i in range(2)]
    try:
        # Both announce themselves in the peering object's status.
        wait_for(lambda: len((kube.get(PEERINGS, None, peering["metadata"]["name"]) or {}).get("status") or {}) == 2,
                 60, "both replicas in the peering object", interval=0.5)
        kube.create(RLJOBS, _job("first"), namespace="ml")
        wait_for(lambda: ((kube.get(RLJOBS, "ml", "first") or {}).get("status") or {}).get("phase"),
                 60, "the first job reconciled", interval=0.5)
        time.sleep(3)  # a few timer ticks: a second active operator would reconcile too
        counts = [_reconciles(f"http://127.0.0.1:{op.metrics_port}/metrics") for op in ops]
        assert sorted(c > 0 for c in counts) == [False, True], counts
        leader = counts.index(max(counts))
        stop(ops[leader].proc)  # SIGTERM: kopf leaves the peering, the standby resumes at once
        standby = ops[1 - leader]
        kube.create(RLJOBS, _job("second"), namespace="ml")
        wait_for(lambda: ((kube.get(RLJOBS, "ml", "second") or {}).get("status") or {}).get("phase"),
                 90, "the standby reconciled the second job", interval=0.5)
        assert _reconciles(f"http://127.0.0.1:{standby.metrics_port}/metrics") > 0
    finally:
        for op in ops:
            stop(op.proc)
