"""The local kubelet of the join test on its own: a Pod in the API stand-in becomes a process with the pod's env,
files, ports and HOME; its status follows the process; deleting the pod ends the process. A few seconds."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kube.pod_runner import PodRunner, processes_in_sessions
from tests.kube.server import KubeServer
from tests.kube.waiting import wait_for

pytestmark = pytest.mark.integration

NS = "runner"
# The "container": writes what it sees, serves one HTTP port (the readiness probe), then waits or exits.
PROGRAM = """
import http.server, json, os, pathlib, subprocess, sys, threading
if os.environ.get("CHILD_OUT"):  # a worker in a process group of its own, as Ray starts its workers
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], process_group=0)
    pathlib.Path(os.environ["CHILD_OUT"]).write_text(str(child.pid))
seen = {"env": dict(os.environ), "cwd": os.getcwd(),
        "config": pathlib.Path(sys.argv[1]).read_text(), "token": pathlib.Path(sys.argv[2]).read_text()}
pathlib.Path(os.environ["OUT"]).write_text(json.dumps(seen))
srv = http.server.HTTPServer(("127.0.0.1", int(os.environ["SPECRL_HTTP_PORT"])), http.server.SimpleHTTPRequestHandler)
threading.Thread(target=srv.serve_forever, daemon=True).start()
threading.Event().wait(float(os.environ.get("LIFETIME", "600")))
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
"""


def _pod(name: str, out: Path, **env: str) -> dict[str, Any]:
    # One host stands in for every pod IP, so a Service's port maps to one pod: only "p" is behind x-svc.
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": NS, "labels": {"app": "x" if name == "p" else name}},
        "spec": {
            "restartPolicy": "Never",
            "containers": [{
                "name": "main", "image": "local",
                "command": [sys.executable, "-c", PROGRAM, "/etc/app/settings.yaml", "/var/run/creds/token"],
                "env": [{"name": "OUT", "value": str(out)},
                        {"name": "PEER", "value": "x-svc.runner.svc:80"},
                        {"name": "SELF", "value": f"{name}.x-headless.runner.svc"},
                        {"name": "DATA", "value": "/data/train.jsonl"},
                        {"name": "TOKEN", "valueFrom": {"secretKeyRef": {"name": "creds", "key": "token"}}},
                        {"name": "ME", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
                        *({"name": k, "value": v} for k, v in env.items())],
                "envFrom": [{"prefix": "CFG_", "configMapRef": {"name": "settings"}}],
                "ports": [{"containerPort": 8000}],
                "readinessProbe": {"httpGet": {"path": "/", "port": 8000}},
                "volumeMounts": [{"name": "settings", "mountPath": "/etc/app"},
                                 {"name": "creds", "mountPath": "/var/run/creds"},
                                 {"name": "data", "mountPath": "/data"}],
            }],
            "volumes": [{"name": "settings", "configMap": {"name": "settings"}},
                        {"name": "creds", "secret": {"secretName": "creds"}},
                        {"name": "data", "persistentVolumeClaim": {"claimName": "data"}}],
        },
    }


@pytest.fixture
def env(tmp_path: Path) -> Iterator[tuple[KubeServer, PodRunner]]:
    kube = KubeServer().start()
    runner = PodRunner(kube.url, tmp_path / "pods", tmp_path / "logs", namespace=NS, grace_seconds=5)
    try:
        kube.create("v1/namespaces", {"metadata": {"name": NS}})
        kube.create("v1/configmaps", {"metadata": {"name": "settings", "namespace": NS},
                                      "data": {"settings.yaml": "a: 1\n", "MODE": "fast"}})
        kube.create("v1/secrets", {"metadata": {"name": "creds", "namespace": NS}, "type": "Opaque",
                                   "data": {"token": "czNjcmV0"}})  # base64("s3cret")
        kube.create("v1/services", {"metadata": {"name": "x-svc", "namespace": NS},
                                    "spec": {"selector": {"app": "x"}, "ports": [{"port": 80, "targetPort": 8000}]}})
        yield kube, runner
    finally:
        runner.stop()
        kube.stop()


def test_a_pod_runs_as_a_process_with_its_env_files_and_ports(env, tmp_path: Path) -> None:
    kube, runner = env
    out = tmp_path / "seen.json"
    kube.create("v1/pods", _pod("p", out, LIFETIME="600"))
    runner.sync_once()
    pod = runner.running(NS, "p")
    assert pod is not None
    seen = json.loads(wait_for(lambda: out.exists() and out.read_text(), 30, "the process's report"))
    e = seen["env"]
    assert e["TOKEN"] == "s3cret" and e["ME"] == "p" and e["CFG_MODE"] == "fast"  # valueFrom, fieldRef, envFrom
    assert seen["config"] == "a: 1\n" and seen["token"] == "s3cret"  # ConfigMap and Secret volumes as files
    port = runner.service_port(NS, "x-svc", 8000)
    assert e["PEER"] == f"127.0.0.1:{port}" and e["SPECRL_HTTP_PORT"] == str(port)  # Service -> its pod's port
    assert e["SELF"] == "127.0.0.1"  # pod DNS name through the headless service
    assert e["DATA"] == f"{runner.root}/claims/{NS}/data/train.jsonl"  # mountPath remapped under the runner
    assert e["HOME"] == seen["cwd"] == str(pod.root / "home")

    def status() -> dict[str, Any]:
        runner.sync_once()
        return kube.get("v1/pods", NS, "p")["status"]

    st = wait_for(lambda: (s := status()).get("phase") == "Running" and
                  {c["type"]: c["status"] for c in s.get("conditions", [])}.get("Ready") == "True" and s,
                  30, "Running and Ready")
    assert st["containerStatuses"][0]["state"]["running"]

    kube.delete("v1/pods", NS, "p")
    runner.sync_once()
    wait_for(lambda: pod.proc.poll() is not None, 30, "the process to end after the pod was deleted")
    wait_for(lambda: not processes_in_sessions({pod.sid}), 30, "nothing left in the pod's session")
    assert (tmp_path / "logs" / f"{NS}_p_{pod.uid[:8]}.log").exists()


def test_a_crashed_pod_takes_every_process_of_its_session_down(env, tmp_path: Path) -> None:
    """`RunningPod.crash` is a container's death: the workers in process groups of their own go with it (a kill of
    the pod's process group alone left the join test's Ray trainer worker training on after its pod was gone)."""
    kube, runner = env
    child_out = tmp_path / "child.pid"
    kube.create("v1/pods", _pod("c", tmp_path / "c.json", CHILD_OUT=str(child_out)))
    runner.sync_once()
    pod = runner.running(NS, "c")
    assert pod is not None
    child = int(wait_for(lambda: child_out.exists() and child_out.read_text(), 30, "the child's pid"))
    assert os.getpgid(child) != os.getpgid(pod.proc.pid) and os.getsid(child) == pod.sid
    pod.crash()
    assert not processes_in_sessions({pod.sid})  # gone when crash returns, the other group too

    def failed() -> dict[str, Any] | None:
        runner.sync_once()
        st = kube.get("v1/pods", NS, "c")["status"]
        return st if st.get("phase") == "Failed" else None

    term = wait_for(failed, 30, "the pod Failed")["containerStatuses"][0]["state"]["terminated"]
    assert term["exitCode"] == 137


def test_exit_codes_become_the_pod_phase(env, tmp_path: Path) -> None:
    kube, runner = env
    kube.create("v1/pods", _pod("ok", tmp_path / "ok.json", LIFETIME="0", EXIT_CODE="0"))
    kube.create("v1/pods", _pod("bad", tmp_path / "bad.json", LIFETIME="0", EXIT_CODE="3"))

    def phases() -> dict[str, str]:
        runner.sync_once()
        return {n: (kube.get("v1/pods", NS, n).get("status") or {}).get("phase", "") for n in ("ok", "bad")}

    wait_for(lambda: phases() == {"ok": "Succeeded", "bad": "Failed"}, 30, "Succeeded and Failed")
    term = kube.get("v1/pods", NS, "bad")["status"]["containerStatuses"][0]["state"]["terminated"]
    assert term["exitCode"] == 3 and term["reason"] == "Error"


def test_a_pod_waits_for_a_missing_secret(env, tmp_path: Path) -> None:
    kube, runner = env
    pod = _pod("w", tmp_path / "w.json")
    pod["spec"]["containers"][0]["env"].append({"name": "X", "valueFrom": {"secretKeyRef": {"name": "later", "key": "k"}}})
    kube.create("v1/pods", pod)
    runner.sync_once()
    assert runner.running(NS, "w") is None and "later" in next(iter(runner.failed_to_start.values()))
    kube.create("v1/secrets", {"metadata": {"name": "later", "namespace": NS}, "stringData": {"k": "v"}})
    runner.sync_once()
    assert runner.running(NS, "w") is not None
