"""The chart grants exactly what the operator calls: operator/rbac.py RBAC_RULES, split by scope.

Cluster-scoped resources (CRDs, namespaces) are always granted cluster-wide; the namespaced rules go into one
ClusterRole (all namespaces) or one Role per watched namespace. Peering rules appear only with --peering.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest
from specrl.operator.rbac import PEERING_RBAC_RULES, RBAC_RULES, WATCHED_NAMESPACES_RBAC_RULES

from tests.integration.chart.chart_support import CHART, CI_VALUES, Grant, by_kind, grants, helm_template

pytestmark = pytest.mark.integration

CLUSTER_SCOPED = {("apiextensions.k8s.io", "customresourcedefinitions"), ("", "namespaces"), ("", "nodes"),
                  ("kopf.dev", "clusterkopfpeerings")}
NAMESPACE = "specrl-system"
RELEASE = "specrl"


def split(rules: list[dict[str, Any]]) -> set[Grant]:
    """The operator's rules as (scope, group, resource, verb) grants."""
    out: set[Grant] = set()
    for g in grants(rules, "?"):
        _, group, res, verb = g
        out.add(("cluster" if (group, res) in CLUSTER_SCOPED else "namespaced", group, res, verb))
    return out


def operator_grants(docs: list[dict[str, Any]], sa: str) -> dict[str, set[Grant]]:
    """What the operator's ServiceAccount is bound to, per namespace ("*" = cluster-wide)."""
    roles: dict[tuple[str, ...], dict[str, Any]] = {("ClusterRole", d["metadata"]["name"]): d
                                                    for d in by_kind(docs, "ClusterRole")}
    roles |= {("Role", d["metadata"]["name"], d["metadata"]["namespace"]): d for d in by_kind(docs, "Role")}
    out: dict[str, set[Grant]] = {}
    for binding in by_kind(docs, "ClusterRoleBinding") + by_kind(docs, "RoleBinding"):
        if {"kind": "ServiceAccount", "name": sa, "namespace": NAMESPACE} not in binding["subjects"]:
            continue
        ref = binding["roleRef"]
        ns = binding["metadata"].get("namespace", "*")
        role = roles[(ref["kind"], ref["name"])] if ref["kind"] == "ClusterRole" else roles[
            ("Role", ref["name"], ns)]
        scope = "cluster" if ns == "*" else "namespaced"
        for g in grants(role["rules"], scope):
            if g[2] in {r for _, r in CLUSTER_SCOPED} and scope != "cluster":
                raise AssertionError(f"{binding['metadata']['name']}: cluster-scoped {g[2]} in a namespaced Role")
            out.setdefault(ns, set()).add(g)
    return out


def flatten(by_ns: dict[str, set[Grant]]) -> set[Grant]:
    """Cluster-wide namespaced grants count as 'namespaced' (they apply to every namespace)."""
    out = set()
    for grants_ in by_ns.values():
        for scope, group, res, verb in grants_:
            out.add(("cluster" if (group, res) in CLUSTER_SCOPED else "namespaced", group, res, verb))
    return out


def values(stem: str) -> Path:
    return next(p for p in CI_VALUES if p.stem == stem)


def test_all_namespaces_grants_exactly_the_operator_rules() -> None:
    docs = helm_template(None, release=RELEASE, namespace=NAMESPACE)
    by_ns = operator_grants(docs, "specrl")
    assert set(by_ns) == {"*"}, "all-namespaces mode must use ClusterRoleBindings only"
    assert flatten(by_ns) == split(RBAC_RULES)  # no namespaces list/watch: kopf runs cluster-wide


@pytest.mark.parametrize("stem", ["single-namespace-values", "multi-namespace-values"])
def test_watched_namespaces_get_roles_and_nothing_else(stem: str) -> None:
    import yaml

    path = values(stem)
    v = yaml.safe_load(path.read_text())
    docs = helm_template(path, release=RELEASE, namespace=NAMESPACE)
    by_ns = operator_grants(docs, "specrl")
    assert set(by_ns) == {"*", *v["watchNamespaces"]}
    expected = split(RBAC_RULES + WATCHED_NAMESPACES_RBAC_RULES)
    peering = bool(v.get("operator", {}).get("peering"))
    expected_ns = {g for g in expected if g[0] == "namespaced"}
    if peering:  # namespaced operators peer through KopfPeering objects in their namespaces
        expected_ns |= {g for g in split(PEERING_RBAC_RULES) if g[2] == "kopfpeerings"}
    for ns in v["watchNamespaces"]:
        assert {g for g in by_ns[ns]} == expected_ns, ns
    assert by_ns["*"] == {g for g in expected if g[0] == "cluster"}, "cluster-wide grants beyond discovery"


def test_cluster_wide_peering_adds_only_cluster_peerings() -> None:
    docs = helm_template(None, sets={"operator.peering": "specrl"}, release=RELEASE, namespace=NAMESPACE)
    got = flatten(operator_grants(docs, "specrl"))
    extra = got - split(RBAC_RULES)
    assert extra == {g for g in split(PEERING_RBAC_RULES) if g[2] == "clusterkopfpeerings"}


def test_no_rbac_renders_no_grants() -> None:
    docs = helm_template(values("no-rbac-values"), release=RELEASE, namespace=NAMESPACE)
    assert operator_grants(docs, "specrl-operator") == {}


def test_user_facing_aggregated_roles() -> None:
    docs = helm_template(None, release=RELEASE, namespace=NAMESPACE)
    roles = {d["metadata"]["name"]: d for d in by_kind(docs, "ClusterRole")}
    edit, view = roles["specrl-rljob-edit"], roles["specrl-rljob-view"]
    assert edit["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-edit"] == "true"
    assert view["metadata"]["labels"]["rbac.authorization.k8s.io/aggregate-to-view"] == "true"
    assert {v for r in view["rules"] for v in r["verbs"]} == {"get", "list", "watch"}
    # Users edit specs; only the operator writes status.
    assert not any("rljobs/status" in r["resources"] and set(r["verbs"]) - {"get", "list", "watch"}
                   for r in edit["rules"])


def test_helm_test_pod_needs_nothing_beyond_the_operator_rules() -> None:
    # The hook lists CRDs by name with the operator's ServiceAccount: `list` on CRDs must be granted.
    assert ("cluster", "apiextensions.k8s.io", "customresourcedefinitions", "list") in split(RBAC_RULES)


def readme_rbac_table() -> list[tuple[str, str, str, set[str]]]:
    """(scope, group, resource, verbs) per resource of the chart README's RBAC table."""
    text = (CHART / "README.md").read_text()
    table = text.split("### RBAC (least privilege)", 1)[1].split("\n\n", 2)[2].split("\n\n", 1)[0]
    rows = [[cell.strip() for cell in line.strip("|").split("|")] for line in table.splitlines()[2:]]
    out = []
    for group_cell, resource_cell, verbs_cell, _why in rows:
        (group,) = re.findall(r"`([^`]*)`", group_cell)
        scope = "cluster" if "(cluster)" in resource_cell else "namespaced"
        verbs = {v.strip() for v in verbs_cell.split(",")}
        for resource in re.findall(r"`([^`]+)`", resource_cell):
            out.append((scope, group.strip('"'), resource, verbs))
    return out


def test_readme_rbac_table_is_exactly_the_operator_rules() -> None:
    # NOTES.txt sends rbac.create=false users to this table: a missing row is a permission the operator lacks.
    table = readme_rbac_table()
    assert table, "no RBAC table in charts/specrl/README.md"
    got = {(scope, group, res, verb) for scope, group, res, verbs in table if group != "kopf.dev" for verb in verbs}
    assert got == split(RBAC_RULES + WATCHED_NAMESPACES_RBAC_RULES)
    peering = {("-", group, res, verb) for _, group, res, verbs in table if group == "kopf.dev" for verb in verbs}
    assert peering == grants(PEERING_RBAC_RULES, "-")
