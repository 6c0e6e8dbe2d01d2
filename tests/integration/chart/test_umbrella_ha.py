"""The chart as a subchart of an umbrella chart (`global` values), high availability (replicas, kopf peering
objects and their CRDs and RBAC, PodDisruptionBudget), and the default job image — `helm lint` and
`helm template` on the real chart."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml

from tests.integration.chart.chart_support import CHART, by_kind, helm_template, run, tool

pytestmark = pytest.mark.integration


def _umbrella(tmp_path: Path) -> Path:
    version = yaml.safe_load((CHART / "Chart.yaml").read_text())["version"]
    root = tmp_path / "platform"
    (root / "charts").mkdir(parents=True)
    shutil.copytree(CHART, root / "charts" / "specrl")
    (root / "Chart.yaml").write_text(yaml.safe_dump({
        "apiVersion": "v2", "name": "platform", "version": "1.0.0",
        "dependencies": [{"name": "specrl", "version": version, "repository": "file://charts/specrl"}]}))
    # What umbrella charts (and kube-prometheus-stack-style stacks) pass down to every subchart.
    (root / "values.yaml").write_text(yaml.safe_dump({
        "global": {"imageRegistry": "registry.internal", "imagePullSecrets": [{"name": "regcred"}]},
        "specrl": {"replicaCount": 2, "metrics": {"serviceMonitor": {"enabled": True}}}}))
    return root


def test_umbrella_chart_with_global_values_lints_and_renders(tmp_path: Path) -> None:
    root = _umbrella(tmp_path)
    lint = run([tool("helm"), "lint", str(root)])
    assert lint.returncode == 0, lint.stdout + lint.stderr
    out = run([tool("helm"), "template", "stack", str(root), "--namespace", "platform"])
    assert out.returncode == 0, out.stderr
    docs = [d for d in yaml.safe_load_all(out.stdout) if d]
    (deploy,) = by_kind(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 2
    assert by_kind(docs, "ServiceMonitor") and by_kind(docs, "PodDisruptionBudget")


def _args(docs: list[dict]) -> list[str]:
    (deploy,) = by_kind(docs, "Deployment")
    return deploy["spec"]["template"]["spec"]["containers"][0]["args"]


def test_one_replica_is_standalone() -> None:
    docs = helm_template()
    (deploy,) = by_kind(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 1 and deploy["spec"]["strategy"]["type"] == "Recreate"
    assert not any(a.startswith(("--peering", "--default-job-image")) for a in _args(docs))
    assert not by_kind(docs, "PodDisruptionBudget") and not by_kind(docs, "ClusterKopfPeering")
    rules = [r for role in by_kind(docs, "ClusterRole") for r in role.get("rules") or []]
    assert not any("kopf.dev" in r["apiGroups"] for r in rules)


def test_high_availability_all_namespaces() -> None:
    docs = helm_template(sets={"replicaCount": "3", "jobImage": "registry.internal/specrl:0.1.0"})
    (deploy,) = by_kind(docs, "Deployment")
    assert deploy["spec"]["replicas"] == 3 and deploy["spec"]["strategy"]["type"] == "RollingUpdate"
    args = _args(docs)
    assert "--peering=specrl" in args and "--default-job-image=registry.internal/specrl:0.1.0" in args
    (peering,) = by_kind(docs, "ClusterKopfPeering")
    assert peering["metadata"]["name"] == "specrl" and peering["apiVersion"] == "kopf.dev/v1"
    (pdb,) = by_kind(docs, "PodDisruptionBudget")
    assert pdb["spec"]["minAvailable"] == 1
    assert pdb["spec"]["selector"]["matchLabels"] == deploy["spec"]["selector"]["matchLabels"]
    rules = [r for role in by_kind(docs, "ClusterRole") for r in role.get("rules") or []]
    assert any(r["apiGroups"] == ["kopf.dev"] and r["resources"] == ["clusterkopfpeerings"]
               and {"get", "list", "watch", "patch"} <= set(r["verbs"]) for r in rules)
    # The CRDs of the peering objects ship with the chart (installed before the templates).
    crds = {yaml.safe_load(p.read_text())["spec"]["names"]["kind"] for p in (CHART / "crds").glob("kopf.dev_*.yaml")}
    assert crds == {"ClusterKopfPeering", "KopfPeering"}


def test_high_availability_watched_namespaces() -> None:
    docs = helm_template(sets={"replicaCount": "2", "watchNamespaces": "{team-a,team-b}"})
    peerings = by_kind(docs, "KopfPeering")
    assert {(p["metadata"]["namespace"], p["metadata"]["name"]) for p in peerings} == {
        ("team-a", "specrl"), ("team-b", "specrl")}
    for role in by_kind(docs, "Role"):
        if role["metadata"]["namespace"] in ("team-a", "team-b"):
            assert any(r["resources"] == ["kopfpeerings"] for r in role["rules"]), role["metadata"]
    assert not by_kind(docs, "ClusterKopfPeering")


@pytest.mark.parametrize(("sets", "spec"), [
    ({}, {"minAvailable": 1}),
    ({"podDisruptionBudget.maxUnavailable": "0"}, {"maxUnavailable": 0}),  # explicit zeros are settings
    ({"podDisruptionBudget.minAvailable": "0"}, {"minAvailable": 0}),
    ({"podDisruptionBudget.maxUnavailable": "50%"}, {"maxUnavailable": "50%"}),
    ({"podDisruptionBudget.minAvailable": "2"}, {"minAvailable": 2}),
])
def test_pod_disruption_budget_keeps_explicit_values(sets: dict[str, str], spec: dict[str, object]) -> None:
    (pdb,) = by_kind(helm_template(sets={"replicaCount": "2", **sets}), "PodDisruptionBudget")
    assert {k: v for k, v in pdb["spec"].items() if k != "selector"} == spec


@pytest.mark.parametrize("sets", [{"replicaCount": "0"}, {"jobImage": "has space"}, {"podDisruptionBudget.bogus": "1"}])
def test_schema_refuses_bad_values(sets: dict[str, str]) -> None:
    with pytest.raises(AssertionError, match="values don't meet the specifications|schema"):
        helm_template(sets=sets)
