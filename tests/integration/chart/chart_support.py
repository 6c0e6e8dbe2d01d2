"""Helpers of the chart, dashboard and alert tests: helm, the restricted Pod Security Standard, PromQL, Prometheus.

Imported by the conftest.py files of tests/unit/chart and tests/integration/chart (which put this folder on
sys.path); no fixtures here, only functions and one Prometheus harness class.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.parse
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from specrl.runtime.ports import free_port
from typing_extensions import Self

REPO = Path(__file__).resolve().parents[3]
CHART = REPO / "charts" / "specrl"
DASHBOARDS = CHART / "dashboards"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
INSTALL_HINT = "run `make tools` (helm v4 into .tools/helm; prometheus via apt-get as root)"


# ---- tools ---------------------------------------------------------------------------------------

def tool(name: str) -> str:
    """Path of a required binary: the repo's .tools/ first, then PATH. Fails loudly with the install hint."""
    local = REPO / ".tools" / name
    if local.is_file() and os.access(local, os.X_OK):
        return str(local)
    found = shutil.which(name)
    if found:
        return found
    raise RuntimeError(f"{name} not found: {INSTALL_HINT}")


def run(cmd: list[str], timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, check=False)


# ---- helm ----------------------------------------------------------------------------------------

def helm_args(values: Path | None = None, sets: Mapping[str, str] | None = None) -> list[str]:
    args: list[str] = []
    if values is not None:
        args += ["-f", str(values)]
    for key, value in (sets or {}).items():
        args += ["--set", f"{key}={value}"]
    return args


def helm_template(values: Path | None = None, sets: Mapping[str, str] | None = None,
                  release: str = "specrl", namespace: str = "specrl-system",
                  kube_version: str | None = None) -> list[dict[str, Any]]:
    """Render the chart (hooks and tests included) and parse every document."""
    cmd = [tool("helm"), "template", release, str(CHART), "--namespace", namespace, *helm_args(values, sets)]
    if kube_version:
        cmd += ["--kube-version", kube_version]
    out = run(cmd)
    if out.returncode != 0:
        raise AssertionError(f"helm template failed ({' '.join(cmd[2:])}):\n{out.stderr}")
    return [d for d in yaml.safe_load_all(out.stdout) if d]


def by_kind(docs: Iterable[dict[str, Any]], kind: str) -> list[dict[str, Any]]:
    return [d for d in docs if d.get("kind") == kind]


# ---- restricted Pod Security Standard ------------------------------------------------------------
# https://kubernetes.io/docs/concepts/security/pod-security-standards/ (baseline + restricted, latest version).

RESTRICTED_VOLUME_TYPES = frozenset({
    "configMap", "csi", "downwardAPI", "emptyDir", "ephemeral", "persistentVolumeClaim", "projected", "secret",
})
SAFE_SYSCTLS = frozenset({
    "kernel.shm_rmid_forced", "net.ipv4.ip_local_port_range", "net.ipv4.ip_unprivileged_port_start",
    "net.ipv4.tcp_syncookies", "net.ipv4.ping_group_range", "net.ipv4.ip_local_reserved_ports",
    "net.ipv4.tcp_keepalive_time", "net.ipv4.tcp_fin_timeout", "net.ipv4.tcp_keepalive_intvl",
    "net.ipv4.tcp_keepalive_probes",
})
ALLOWED_SELINUX_TYPES = frozenset({"", "container_t", "container_init_t", "container_kvm_t", "container_engine_t"})
SECCOMP_OK = frozenset({"RuntimeDefault", "Localhost"})


def pod_spec_of(obj: Mapping[str, Any]) -> dict[str, Any] | None:
    """The pod spec inside a Pod, a workload's template, or a CronJob's job template; None for other kinds."""
    kind = obj.get("kind")
    spec = obj.get("spec") or {}
    if kind == "Pod":
        return spec
    if kind in ("Deployment", "StatefulSet", "DaemonSet", "ReplicaSet", "Job"):
        return (spec.get("template") or {}).get("spec")
    if kind == "CronJob":
        return ((spec.get("jobTemplate") or {}).get("spec") or {}).get("template", {}).get("spec")
    return None


def restricted_violations(pod: Mapping[str, Any], where: str = "pod") -> list[str]:
    """Every way `pod` (a PodSpec) breaks the restricted Pod Security Standard, as readable lines."""
    out: list[str] = []
    psc = pod.get("securityContext") or {}
    for key in ("hostNetwork", "hostPID", "hostIPC"):
        if pod.get(key):
            out.append(f"{where}: spec.{key} must be unset or false")
    for vol in pod.get("volumes") or []:
        types = [k for k in vol if k != "name"]
        bad = [t for t in types if t not in RESTRICTED_VOLUME_TYPES]
        if bad:
            out.append(f"{where}: volume {vol.get('name')!r} has type {bad[0]} (restricted allows "
                       f"{', '.join(sorted(RESTRICTED_VOLUME_TYPES))})")
    for sysctl in psc.get("sysctls") or []:
        if sysctl.get("name") not in SAFE_SYSCTLS:
            out.append(f"{where}: sysctl {sysctl.get('name')} is not in the safe set")
    out += _selinux(psc.get("seLinuxOptions"), f"{where}: spec.securityContext")
    out += _apparmor(psc.get("appArmorProfile"), f"{where}: spec.securityContext")
    pod_seccomp = (psc.get("seccompProfile") or {}).get("type")
    if pod_seccomp is not None and pod_seccomp not in SECCOMP_OK:
        out.append(f"{where}: spec.securityContext.seccompProfile.type is {pod_seccomp}")
    if psc.get("runAsUser") == 0:
        out.append(f"{where}: spec.securityContext.runAsUser must not be 0")
    if psc.get("runAsNonRoot") is False:
        out.append(f"{where}: spec.securityContext.runAsNonRoot must not be false")

    containers = [("containers", c) for c in pod.get("containers") or []]
    containers += [("initContainers", c) for c in pod.get("initContainers") or []]
    containers += [("ephemeralContainers", c) for c in pod.get("ephemeralContainers") or []]
    if not pod.get("containers"):
        out.append(f"{where}: no containers")
    for group, c in containers:
        cw = f"{where}: {group}[{c.get('name')}]"
        sc = c.get("securityContext") or {}
        if sc.get("privileged"):
            out.append(f"{cw}: privileged must be unset or false")
        if sc.get("allowPrivilegeEscalation") is not False:
            out.append(f"{cw}: allowPrivilegeEscalation must be false")
        caps = sc.get("capabilities") or {}
        if "ALL" not in (caps.get("drop") or []):
            out.append(f"{cw}: capabilities.drop must include ALL")
        extra = [cap for cap in caps.get("add") or [] if cap != "NET_BIND_SERVICE"]
        if extra:
            out.append(f"{cw}: capabilities.add may only hold NET_BIND_SERVICE, has {extra}")
        non_root = sc.get("runAsNonRoot", psc.get("runAsNonRoot"))
        if non_root is not True:
            out.append(f"{cw}: runAsNonRoot must be true (container or pod level)")
        if sc.get("runAsUser") == 0:
            out.append(f"{cw}: runAsUser must not be 0")
        seccomp = (sc.get("seccompProfile") or {}).get("type", pod_seccomp)
        if seccomp not in SECCOMP_OK:
            out.append(f"{cw}: seccompProfile.type must be RuntimeDefault or Localhost (container or pod level), "
                       f"is {seccomp}")
        for port in c.get("ports") or []:
            if port.get("hostPort"):
                out.append(f"{cw}: hostPort {port['hostPort']} is not allowed")
        if sc.get("procMount") not in (None, "Default"):
            out.append(f"{cw}: procMount must be Default")
        out += _selinux(sc.get("seLinuxOptions"), f"{cw}.securityContext")
        out += _apparmor(sc.get("appArmorProfile"), f"{cw}.securityContext")
    return out


def _selinux(opts: Mapping[str, Any] | None, where: str) -> list[str]:
    if not opts:
        return []
    out = []
    if opts.get("type", "") not in ALLOWED_SELINUX_TYPES:
        out.append(f"{where}.seLinuxOptions.type {opts['type']} is not allowed")
    for key in ("user", "role"):
        if opts.get(key):
            out.append(f"{where}.seLinuxOptions.{key} must be unset")
    return out


def _apparmor(profile: Mapping[str, Any] | None, where: str) -> list[str]:
    if profile and profile.get("type") not in ("RuntimeDefault", "Localhost"):
        return [f"{where}.appArmorProfile.type must be RuntimeDefault or Localhost"]
    return []


# ---- RBAC ----------------------------------------------------------------------------------------

Grant = tuple[str, str, str, str]  # (scope "cluster"|"namespaced", apiGroup, resource, verb)


def grants(rules: Iterable[Mapping[str, Any]], scope: str) -> set[Grant]:
    out: set[Grant] = set()
    for rule in rules:
        for group in rule.get("apiGroups") or [""]:
            for res in rule.get("resources") or []:
                for verb in rule.get("verbs") or []:
                    out.add((scope, group, res, verb))
    return out


# ---- PromQL ----------------------------------------------------------------------------------------

_METRIC = re.compile(r"\bspecrl_[a-z0-9_]+\b")


def metric_names(expr: str) -> set[str]:
    """specrl metric names an expression reads (every specrl series is named specrl_*)."""
    return set(_METRIC.findall(expr))


@dataclass
class Query:
    where: str     # "job.json: panel 'Rollout throughput' target A"
    expr: str


def dashboard_queries(board: Mapping[str, Any], name: str) -> list[Query]:
    """Every PromQL expression of a dashboard: panel targets, annotations and variable queries."""
    out: list[Query] = []
    for panel in iter_panels(board.get("panels") or []):
        for target in panel.get("targets") or []:
            out.append(Query(f"{name}: panel {panel.get('title')!r} target {target.get('refId')}", target["expr"]))
    for ann in (board.get("annotations") or {}).get("list") or []:
        if ann.get("expr"):
            out.append(Query(f"{name}: annotation {ann.get('name')!r}", ann["expr"]))
    return out


def iter_panels(panels: Iterable[Mapping[str, Any]]) -> Iterator[Mapping[str, Any]]:
    for panel in panels:
        yield panel
        yield from iter_panels(panel.get("panels") or [])


def load_dashboards() -> dict[str, dict[str, Any]]:
    return {p.name: json.loads(p.read_text()) for p in sorted(DASHBOARDS.glob("*.json"))}


def substitute(expr: str, variables: Mapping[str, str], rate_interval: str = "30s") -> str:
    """What Grafana sends for `expr`: $variables replaced (regex values), $__rate_interval & co. filled in."""
    for key in ("__rate_interval", "__interval", "__range"):
        expr = expr.replace(f"${key}", rate_interval)
    for name, value in sorted(variables.items(), key=lambda kv: -len(kv[0])):
        expr = expr.replace(f"${{{name}}}", value).replace(f"${name}", value)
    return expr


# ---- Prometheus --------------------------------------------------------------------------------------

# What Kubernetes service discovery attaches to a pod target (besides `job` and `instance`).
TARGET_LABELS = {"namespace": "specrl-system", "pod": "scraped-pod"}


@dataclass
class Prometheus:
    """A real Prometheus (Debian package) on 127.0.0.1 scraping `host:port` targets every second.

    Targets come from a file_sd file, so `set_targets()` can add processes that start later (their ports are
    only known then). `honor_labels: false` (Prometheus' default, and the chart's) and every target labelled
    `namespace` the way Kubernetes service discovery labels a pod's target: a series that exported its own `job`
    or `namespace` would come out as `exported_job`/`exported_namespace`, and the dashboards would find nothing.
    """

    targets: list[str]
    scrape_interval: str = "1s"
    rule_files: list[Path] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    proc: subprocess.Popen[bytes] | None = None
    tmp: tempfile.TemporaryDirectory[str] | None = None

    def __enter__(self) -> Self:
        binary = tool("prometheus")
        self.tmp = tempfile.TemporaryDirectory(prefix="specrl-prom-")
        root = Path(self.tmp.name)
        config = {
            "global": {"scrape_interval": self.scrape_interval, "evaluation_interval": self.scrape_interval},
            "scrape_configs": [{"job_name": "specrl", "honor_labels": False, "metrics_path": "/metrics",
                                "file_sd_configs": [{"files": [str(root / "targets.json")],
                                                     "refresh_interval": "1s"}]}],
            "rule_files": [str(p) for p in self.rule_files],
        }
        (root / "prometheus.yml").write_text(yaml.safe_dump(config))
        self.set_targets(self.targets)
        check = run([tool("promtool"), "check", "config", str(root / "prometheus.yml")])
        assert check.returncode == 0, check.stdout + check.stderr
        self.log = open(root / "prometheus.log", "wb")
        self.proc = subprocess.Popen(
            [binary, f"--config.file={root / 'prometheus.yml'}", f"--storage.tsdb.path={root / 'data'}",
             f"--web.listen-address=127.0.0.1:{self.port}", "--storage.tsdb.retention.time=1h"],
            stdout=self.log, stderr=subprocess.STDOUT,
        )
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"prometheus exited: {self.logs()}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{self.port}/-/ready", timeout=1) as r:
                    if r.status == 200:
                        return self
            except OSError:
                time.sleep(0.2)
        raise RuntimeError(f"prometheus not ready in 30 s: {self.logs()}")

    def __exit__(self, *exc: object) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(timeout=10)
        self.log.close()
        if self.tmp is not None:
            self.tmp.cleanup()

    def set_targets(self, targets: list[str]) -> None:
        assert self.tmp is not None
        self.targets = list(targets)
        path = Path(self.tmp.name) / "targets.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps([{"targets": self.targets, "labels": TARGET_LABELS}]))
        tmp.rename(path)  # atomic: Prometheus never reads a half-written file

    def logs(self) -> str:
        assert self.tmp is not None
        path = Path(self.tmp.name) / "prometheus.log"
        return path.read_text(errors="replace")[-3000:] if path.exists() else ""

    def api(self, path: str, **params: str) -> Any:
        url = f"http://127.0.0.1:{self.port}/api/v1/{path}?{urllib.parse.urlencode(params)}"
        with urllib.request.urlopen(url, timeout=10) as resp:
            body = json.loads(resp.read())
        if body.get("status") != "success":
            raise AssertionError(f"prometheus {path} {params}: {body}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        return list(self.api("query", query=expr)["result"])

    def wait_for_scrapes(self, n: int = 3, timeout: float = 60) -> None:
        """Until every target is up and has been scraped `n` times (so rates have points to work with)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            up = self.query("up")
            scrapes = self.query("count_over_time(up[5m])")
            if (len(up) == len(self.targets) and all(r["value"][1] == "1" for r in up)
                    and all(float(r["value"][1]) >= n for r in scrapes)):
                return
            time.sleep(0.5)
        raise AssertionError(f"targets not scraped {n}x in {timeout}s: {self.api('targets')}")

    def alerts(self) -> list[dict[str, Any]]:
        """Pending and firing alerts: {"labels": {...}, "state": "pending"|"firing", ...}."""
        return list(self.api("alerts")["alerts"])

    def label_values(self, label: str, metric: str) -> list[str]:
        return list(self.api(f"label/{label}/values", **{"match[]": metric}))


@dataclass
class OperatorProc:
    proc: subprocess.Popen[bytes]
    metrics_port: int
    health_port: int
    log: Path

    @property
    def health_url(self) -> str:
        return f"http://127.0.0.1:{self.health_port}/healthz"

    def output(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]


def start_operator(kubeconfig: Path, log: Path, *extra: str) -> OperatorProc:
    """`specrl operator` as the chart runs it (all namespaces, metrics + health ports), against the emulator."""
    metrics_port, health_port = free_port(), free_port()
    env = {**os.environ, "KUBECONFIG": str(kubeconfig)}
    specrl = str(Path(sys.executable).parent / "specrl")
    handle = open(log, "wb")  # noqa: SIM115 (owned by the process; closed when the file object is collected)
    proc = subprocess.Popen(
        [specrl, "operator", "--all-namespaces", f"--metrics-port={metrics_port}",
         f"--health-port={health_port}", *extra],
        env=env, stdout=handle, stderr=subprocess.STDOUT, cwd=REPO)
    op = OperatorProc(proc, metrics_port, health_port, log)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"specrl operator exited with {proc.returncode}:\n{op.output()}")
        try:
            with urllib.request.urlopen(op.health_url, timeout=1) as resp:
                if resp.status == 200:
                    return op
        except OSError:
            time.sleep(0.3)
    stop(proc)
    raise AssertionError(f"specrl operator not live on {op.health_url} within 60 s:\n{op.output()}")


def stop(proc: subprocess.Popen[Any], timeout: float = 15) -> None:
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout=timeout)



@dataclass
class PanelResult:
    where: str
    expr: str
    series: int
    error: str = ""


def evaluate_dashboards(prom: Prometheus, boards: Mapping[str, Mapping[str, Any]],
                        variables: Mapping[str, str]) -> list[PanelResult]:
    """Run every panel and annotation query of `boards` with `variables` substituted; one result each."""
    results = []
    for name, board in boards.items():
        for q in dashboard_queries(board, name):
            expr = substitute(q.expr, variables)
            try:
                results.append(PanelResult(q.where, expr, len(prom.query(expr))))
            except Exception as exc:  # noqa: BLE001 - a PromQL error is a result too, reported with the query
                results.append(PanelResult(q.where, expr, 0, f"{type(exc).__name__}: {exc}"))
    return results


def rendered_rule_groups(docs: Iterable[dict[str, Any]]) -> dict[str, Any]:
    """The PrometheusRule of a rendered chart as a plain Prometheus rule file ({groups: [...]})."""
    rules = by_kind(docs, "PrometheusRule")
    assert len(rules) == 1, f"expected one PrometheusRule, got {len(rules)}"
    return {"groups": rules[0]["spec"]["groups"]}
