"""The chart with the real Helm v4 binary: lint, render, Kubernetes schemas, restricted PSS, values wiring.

One `helm template` per values file (default + charts/specrl/ci/*.yaml), cached for the module.
"""

from __future__ import annotations

import os
import subprocess
from functools import cache
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from tests.integration.chart.chart_support import (
    CHART,
    CI_VALUES,
    by_kind,
    helm_template,
    pod_spec_of,
    restricted_violations,
    run,
    tool,
)

pytestmark = pytest.mark.integration

CASES: list[Path | None] = [None, *CI_VALUES]
IDS = ["default", *(p.stem for p in CI_VALUES)]
NAMESPACE = "specrl-system"
# The chart's kubeVersion floor and the newest schemas kubernetes-validate ships.
KUBE_VERSIONS = ("1.28.0", "1.35.0")
MONITORING_KINDS = {"ServiceMonitor", "PodMonitor", "PrometheusRule"}
CHART_META = yaml.safe_load((CHART / "Chart.yaml").read_text())


@cache
def rendered(values: Path | None) -> list[dict[str, Any]]:
    return helm_template(values, namespace=NAMESPACE)


def ci_values(stem: str) -> Path:
    return next(p for p in CI_VALUES if p.stem == stem)


def values_of(path: Path | None) -> dict[str, Any]:
    return yaml.safe_load(path.read_text()) if path else {}


def test_helm_is_v4() -> None:
    out = run([tool("helm"), "version", "--short"])
    assert out.returncode == 0 and out.stdout.startswith("v4."), out.stdout + out.stderr


def test_ci_matrix_is_complete() -> None:
    assert {p.stem for p in CI_VALUES} >= {
        "single-namespace-values", "multi-namespace-values", "no-rbac-values", "monitoring-off-values",
        "custom-image-values"}


@pytest.mark.parametrize("values", CASES, ids=IDS)
def test_lint_strict(values: Path | None) -> None:
    cmd = [tool("helm"), "lint", "--strict", str(CHART), "--namespace", NAMESPACE]
    if values:
        cmd += ["-f", str(values)]
    out = run(cmd)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "0 chart(s) failed" in out.stdout


@pytest.mark.parametrize("values", CASES, ids=IDS)
def test_renders_at_the_kube_version_floor(values: Path | None) -> None:
    docs = helm_template(values, namespace=NAMESPACE, kube_version=CHART_META["kubeVersion"].lstrip(">=").split("-")[0])
    assert by_kind(docs, "Deployment")


def test_kube_version_below_floor_is_refused() -> None:
    with pytest.raises(AssertionError, match="kubeVersion|incompatible"):
        helm_template(None, namespace=NAMESPACE, kube_version="1.25.0")


@pytest.mark.parametrize("values", CASES, ids=IDS)
def test_builtin_objects_validate_strictly(values: Path | None) -> None:
    docs = rendered(values)
    checked = 0
    for doc in docs:
        if doc["kind"] in MONITORING_KINDS or doc["apiVersion"].startswith("kopf.dev/"):
            continue  # custom resources: kubernetes-validate has no schema; checked structurally elsewhere
        for version in KUBE_VERSIONS:
            try:
                kubernetes_validate.validate(doc, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                pytest.fail(f"{doc['kind']}/{doc['metadata']['name']} invalid for Kubernetes {version}: "
                            f"{exc.message} at {'/'.join(map(str, exc.path))}")
        checked += 1
    assert checked >= 3


def unknown_fields(given: Any, parsed: Any, path: str = "") -> list[str]:
    """Keys of `given` that the model dropped (the generated models ignore unknown fields instead of failing)."""
    out: list[str] = []
    if isinstance(given, dict) and isinstance(parsed, dict):
        for key, value in given.items():
            if key not in parsed:
                out.append(f"{path}.{key}".lstrip("."))
            else:
                out += unknown_fields(value, parsed[key], f"{path}.{key}")
    elif isinstance(given, list) and isinstance(parsed, list):
        for i, (a, b) in enumerate(zip(given, parsed)):
            out += unknown_fields(a, b, f"{path}[{i}]")
    return out


@pytest.mark.parametrize("values", CASES, ids=IDS)
def test_monitoring_objects_match_the_prometheus_operator_schema(values: Path | None) -> None:
    # Models generated from the Prometheus Operator's CRDs (types, enums, required fields); unknown keys are
    # found by comparing what the model kept with what the chart rendered.
    from cloudcoil.models.prometheus_operator import v1

    for doc in rendered(values):
        if doc["kind"] not in MONITORING_KINDS:
            continue
        model = getattr(v1, doc["kind"]).model_validate(doc)
        kept = model.model_dump(by_alias=True, exclude_unset=True, mode="json")
        unknown = unknown_fields(doc, kept)
        assert not unknown, f"{doc['kind']}/{doc['metadata']['name']}: unknown fields {unknown}"


def test_monitoring_schema_check_catches_mistakes() -> None:
    from cloudcoil.models.prometheus_operator import v1
    from pydantic import ValidationError

    (sm,) = by_kind(rendered(ci_values("monitoring-on-values")), "ServiceMonitor")
    endpoint = sm["spec"]["endpoints"][0]
    typo = {**sm, "spec": {**sm["spec"], "endpoints": [{**endpoint, "honourLabels": True}]}}
    kept = v1.ServiceMonitor.model_validate(typo).model_dump(by_alias=True, exclude_unset=True, mode="json")
    assert unknown_fields(typo, kept) == ["spec.endpoints[0].honourLabels"]
    with pytest.raises(ValidationError):
        v1.ServiceMonitor.model_validate({**sm, "spec": {**sm["spec"], "endpoints": [{**endpoint,
                                                                                      "honorLabels": "maybe"}]}})


def test_validator_is_strict() -> None:
    # Guards the test above: an unknown field in a rendered Deployment is rejected.
    dep = dict(by_kind(rendered(None), "Deployment")[0])
    dep["spec"] = {**dep["spec"], "replicaz": 2}
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(dep, KUBE_VERSIONS[-1], strict=True)


@pytest.mark.parametrize("values", CASES, ids=IDS)
def test_every_pod_spec_is_restricted(values: Path | None) -> None:
    specs = [(f"{d['kind']}/{d['metadata']['name']}", pod_spec_of(d)) for d in rendered(values)]
    pods = [(w, p) for w, p in specs if p is not None]
    assert pods, "no pod specs rendered"
    problems = [line for where, pod in pods for line in restricted_violations(pod, where)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("values", CASES, ids=IDS)
def test_standard_labels_and_namespaces(values: Path | None) -> None:
    cluster_scoped = {"ClusterKopfPeering", "ClusterRole", "ClusterRoleBinding"}
    for doc in rendered(values):
        meta = doc["metadata"]
        labels = meta.get("labels") or {}
        for key in ("app.kubernetes.io/name", "app.kubernetes.io/instance", "app.kubernetes.io/managed-by",
                    "app.kubernetes.io/version", "helm.sh/chart"):
            assert key in labels, f"{doc['kind']}/{meta['name']}: label {key} missing"
        if doc["kind"] in cluster_scoped:
            assert "namespace" not in meta
        else:
            assert meta.get("namespace"), f"{doc['kind']}/{meta['name']}: no namespace"


@pytest.mark.parametrize("values", CASES, ids=IDS)
def test_operator_deployment(values: Path | None) -> None:
    v = values_of(values)
    (dep,) = by_kind(rendered(values), "Deployment")
    spec = dep["spec"]
    replicas = v.get("replicaCount", 1)
    assert spec["replicas"] == replicas
    assert spec["strategy"]["type"] == ("Recreate" if replicas == 1 else "RollingUpdate")
    pod = spec["template"]["spec"]
    (c,) = pod["containers"]
    assert c["command"] == ["specrl", "operator"]
    args = c["args"]
    namespaces = v.get("watchNamespaces") or []
    if namespaces:
        assert [a for a in args if a.startswith("--namespace=")] == [f"--namespace={n}" for n in namespaces]
        assert "--all-namespaces" not in args
    else:
        assert "--all-namespaces" in args and not any(a.startswith("--namespace") for a in args)
    op = v.get("operator", {})
    metrics_port, health_port = op.get("metricsPort", 8080), op.get("healthPort", 8081)
    assert f"--metrics-port={metrics_port}" in args and f"--health-port={health_port}" in args
    peering = op.get("peering") or (dep["metadata"]["name"] if replicas > 1 else "")
    assert ("--peering=" + peering in args) if peering else not any("--peering" in a for a in args)
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports == {"metrics": metrics_port, "health": health_port}
    probe = c["livenessProbe"]
    assert probe["httpGet"] == {"path": "/healthz", "port": "health"}
    assert c["securityContext"]["readOnlyRootFilesystem"] is True
    mounts = {m["mountPath"]: m["name"] for m in c["volumeMounts"]}
    assert "emptyDir" in next(vol for vol in pod["volumes"] if vol["name"] == mounts["/tmp"])
    assert c["resources"].get("requests") and c["resources"].get("limits")
    assert "readinessProbe" not in c


@pytest.mark.parametrize("sets", [{"operator.healthPort": "8080"}, {"operator.metricsPort": "8081"}])
def test_metrics_and_health_ports_must_differ(sets: dict[str, str]) -> None:
    # One port for both: the operator would bind it twice and the Service would list it twice.
    with pytest.raises(AssertionError, match="operator.metricsPort and operator.healthPort must differ"):
        helm_template(sets=sets)


def test_operator_args_parse_with_the_real_cli() -> None:
    # Every flag the chart passes must be accepted by `specrl operator` (no typo'd flag crash-loops the pod).
    from specrl.runtime.cli import build_parser

    for values in CASES:
        (dep,) = by_kind(rendered(values), "Deployment")
        c = dep["spec"]["template"]["spec"]["containers"][0]
        args = build_parser().parse_args(c["command"][1:] + c["args"])
        assert args.command == "operator"
        v = values_of(values)
        assert (args.namespaces or []) == (v.get("watchNamespaces") or [])
        assert args.metrics_port == v.get("operator", {}).get("metricsPort", 8080)


def test_default_image_is_the_operator_image_at_app_version() -> None:
    (dep,) = by_kind(rendered(None), "Deployment")
    image = dep["spec"]["template"]["spec"]["containers"][0]["image"]
    assert image == f"ghcr.io/specrl/specrl-operator:{CHART_META['appVersion']}"
    images = yaml.safe_load(CHART_META["annotations"]["artifacthub.io/images"])
    assert {i["image"] for i in images} == {image, f"ghcr.io/specrl/specrl:{CHART_META['appVersion']}"}


def test_runtime_image_matches_the_api_default() -> None:
    from specrl.runtime.api import DEFAULT_IMAGE

    images = yaml.safe_load(CHART_META["annotations"]["artifacthub.io/images"])
    assert DEFAULT_IMAGE in {i["image"] for i in images}


def test_custom_image_and_resources() -> None:
    v = values_of(ci_values("custom-image-values"))
    docs = rendered(ci_values("custom-image-values"))
    (dep,) = by_kind(docs, "Deployment")
    assert dep["metadata"]["name"] == "rl-operator"
    pod = dep["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["image"] == f"{v['image']['repository']}@{v['image']['digest']}"
    assert c["imagePullPolicy"] == "Always"
    assert c["resources"] == v["resources"]
    assert pod["imagePullSecrets"] == [{"name": "regcred"}]
    assert pod["tolerations"] == v["tolerations"] and pod["nodeSelector"] == v["nodeSelector"]
    assert pod["priorityClassName"] == "system-cluster-critical"
    assert {"name": "KOPF_LOG_FORMAT", "value": "json"} in c["env"]
    (test_pod,) = [d for d in by_kind(docs, "Pod") if d["metadata"]["annotations"]["helm.sh/hook"] == "test"]
    assert test_pod["spec"]["containers"][0]["image"] == c["image"]
    (svc,) = by_kind(docs, "Service")
    assert {p["name"]: p["port"] for p in svc["spec"]["ports"]} == {"metrics": 9090, "health": 9091}


def test_monitoring_toggles() -> None:
    on = rendered(ci_values("monitoring-on-values"))
    assert {d["kind"] for d in on} >= MONITORING_KINDS
    for kind in MONITORING_KINDS:
        (obj,) = by_kind(on, kind)
        assert obj["metadata"]["labels"]["release"] == "prometheus", kind
    off = rendered(ci_values("monitoring-off-values"))
    assert not {d["kind"] for d in off} & MONITORING_KINDS
    assert not [d for d in by_kind(off, "ConfigMap") if "grafana_dashboard" in d["metadata"]["labels"]]
    assert not by_kind(off, "Pod"), "tests.enabled=false still renders the helm test pod"
    default = rendered(None)
    assert not {d["kind"] for d in default} & MONITORING_KINDS, "monitors need CRDs: off by default"


def test_service_monitor_targets_the_operator_service() -> None:
    docs = rendered(ci_values("monitoring-on-values"))
    (sm,) = by_kind(docs, "ServiceMonitor")
    (svc,) = by_kind(docs, "Service")
    (dep,) = by_kind(docs, "Deployment")
    assert sm["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    assert svc["spec"]["selector"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert dep["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]
    (endpoint,) = sm["spec"]["endpoints"]
    assert endpoint["port"] in {p["name"] for p in svc["spec"]["ports"]}
    assert endpoint["honorLabels"] is False  # rljob/rljob_namespace never collide with target labels
    assert sm["spec"]["namespaceSelector"] == {"matchNames": [NAMESPACE]}


def test_pod_monitor_selects_the_pods_the_operator_creates() -> None:
    from specrl.operator import children

    docs = rendered(ci_values("monitoring-on-values"))
    (pm,) = by_kind(docs, "PodMonitor")
    assert pm["spec"]["selector"] == {"matchExpressions": [{"key": children.LABEL_JOB, "operator": "Exists"}]}
    assert pm["spec"]["namespaceSelector"] == {"any": True}
    ports = {e["port"] for e in pm["spec"]["podMetricsEndpoints"]}
    assert all(e["honorLabels"] is False and e["path"] == "/metrics" for e in pm["spec"]["podMetricsEndpoints"])
    # The operator's job pods expose these port names: workers `metrics`, the coordinator its `http` API port.
    assert ports == {"metrics", "http"}
    (dep,) = by_kind(docs, "Deployment")
    assert children.LABEL_JOB not in dep["spec"]["template"]["metadata"]["labels"], "PodMonitor would scrape the operator"
    multi = rendered(ci_values("multi-namespace-values"))
    (pm,) = by_kind(multi, "PodMonitor")
    assert pm["spec"]["namespaceSelector"] == {"matchNames": ["team-a", "team-b", "research"]}


def test_pod_monitor_port_names_match_the_operators_pods() -> None:
    # The pods come from the operator's own builders (specrl.operator.children), not from a copy here.
    import inspect

    from specrl.operator import children

    source = inspect.getsource(children)
    for name in ('"metrics"', '"http"'):
        assert f'"name": {name}' in source, f"operator pods expose no port named {name}"


def test_dashboards_configmaps() -> None:
    docs = rendered(ci_values("multi-namespace-values"))
    maps = [d for d in by_kind(docs, "ConfigMap") if "grafana_dashboard" in d["metadata"]["labels"]]
    assert len(maps) == 2
    for cm in maps:
        assert cm["metadata"]["namespace"] == "monitoring"
        assert cm["metadata"]["labels"]["grafana_dashboard"] == "specrl"
        assert cm["metadata"]["annotations"] == {"grafana_folder": "specrl"}
        ((key, body),) = cm["data"].items()
        assert key.endswith(".json")
        source = (CHART / "dashboards" / key.removeprefix("specrl-")).read_text()
        assert body == source.rstrip("\n"), f"{key}: ConfigMap content differs from dashboards/{key}"
    default = rendered(None)
    maps = [d for d in by_kind(default, "ConfigMap") if d["metadata"]["labels"].get("grafana_dashboard") == "1"]
    assert {m["metadata"]["namespace"] for m in maps} == {NAMESPACE} and len(maps) == 2


def test_no_rbac() -> None:
    docs = rendered(ci_values("no-rbac-values"))
    kinds = {d["kind"] for d in docs}
    assert not kinds & {"ClusterRole", "ClusterRoleBinding", "Role", "RoleBinding", "ServiceAccount"}
    (dep,) = by_kind(docs, "Deployment")
    assert dep["spec"]["template"]["spec"]["serviceAccountName"] == "specrl-operator"


def test_helm_test_hook() -> None:
    docs = rendered(None)
    hooks = [d for d in docs if (d["metadata"].get("annotations") or {}).get("helm.sh/hook") == "test"]
    assert {d["kind"] for d in hooks} == {"Pod", "ConfigMap"}
    (pod,) = by_kind(hooks, "Pod")
    (cm,) = by_kind(hooks, "ConfigMap")
    assert cm["data"]["helm-test.py"] == (CHART / "files" / "helm-test.py").read_text().rstrip("\n")
    c = pod["spec"]["containers"][0]
    env = {e["name"]: e["value"] for e in c["env"]}
    (svc,) = by_kind(docs, "Service")
    assert env["SPECRL_TEST_HEALTH_URL"] == f"http://{svc['metadata']['name']}.{NAMESPACE}.svc:8081/healthz"
    assert env["SPECRL_TEST_CRD"] == "rljobs.specrl.io"
    assert pod["spec"]["restartPolicy"] == "Never"
    assert c["command"] == ["python", "/specrl-test/helm-test.py"]


def test_chart_crd_is_the_generated_one() -> None:
    top = sorted((CHART.parents[1] / "crds").glob("*.yaml"))
    # kopf's peering CRDs (kopf.dev_*) ship only with the chart: they are kopf's, not generated from runtime/api.py.
    ours = sorted((CHART / "crds").glob("specrl.io_*.yaml"))
    assert [p.name for p in top] == [p.name for p in ours] and ours
    for a, b in zip(top, ours):
        assert a.read_bytes() == b.read_bytes(), f"{b} differs from {a}: run `specrl crd --write`"
    (crd,) = [yaml.safe_load(p.read_text()) for p in ours]
    assert crd["metadata"]["name"] == "rljobs.specrl.io"
    for version in KUBE_VERSIONS:
        kubernetes_validate.validate(crd, version, strict=True)
    # Helm picks it up from crds/ (installed before the templates, never upgraded).
    out = run([tool("helm"), "template", "specrl", str(CHART), "--include-crds", "-s", "crds/" + ours[0].name])
    assert out.returncode == 0 and "kind: CustomResourceDefinition" in out.stdout, out.stderr


@pytest.mark.parametrize("values", CASES, ids=IDS)
def test_notes_render(values: Path | None, tmp_path: Path) -> None:
    # `helm install --dry-run=client` renders NOTES.txt without a cluster (no kubeconfig is read).
    cmd = [tool("helm"), "install", "specrl", str(CHART), "--dry-run=client", "--namespace", NAMESPACE]
    if values:
        cmd += ["-f", str(values)]
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False,
                         env={**os.environ, "KUBECONFIG": str(tmp_path / "none"), "HELM_CACHE_HOME": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    notes = out.stdout.split("NOTES:", 1)[1]
    (dep,) = by_kind(rendered(values), "Deployment")
    assert f"rollout status deployment/{dep['metadata']['name']}" in notes
    assert "kubectl apply --server-side --force-conflicts" in notes
    namespaces = values_of(values).get("watchNamespaces")
    assert (", ".join(namespaces) if namespaces else "every namespace") in notes
