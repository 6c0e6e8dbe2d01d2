"""A local kubelet for the Kubernetes API stand-in: runs each Pod the operator creates as a local process.

`PodRunner` follows the Pods over the API (HTTP, like a kubelet; it lists them every `tick`, 0.25 s, rather than
holding a watch, which keeps it simple and immune to dropped streams) and starts each new one as the process its
single container's `command` + `args` say, with:

* its `env` resolved as the kubelet does: literal values, `valueFrom` (`secretKeyRef`, `configMapKeyRef`,
  `fieldRef`: metadata.name/namespace/uid/labels, status.podIP, spec.nodeName) and `envFrom` (ConfigMaps and
  Secrets, with `prefix`); a missing Secret or ConfigMap keeps the pod Pending until it exists;
* its volumes as directories under a per-pod root: `configMap` and `secret` volumes as one file per key
  (or per `items` entry), `emptyDir` as a fresh directory, `persistentVolumeClaim` as one directory per claim
  shared by every pod (ReadWriteMany; `claims=` pre-provisions a claim with an existing directory, as a
  PersistentVolume that already holds data);
* its own HOME (under the pod root) and its own ports: one host stands in for many pod IPs, so the runner
  translates. Every `<svc>.<ns>.svc[:port]` and `<pod>.<subdomain>.<ns>.svc[:port]` in an env value or argument
  becomes `127.0.0.1[:host port]` (a Service's port goes to its targetPort on the selected pod), and the
  container ports a pod declares get host ports of their own, passed in through the image's listen-port
  variables (`PORT_ENV`; a Service that selects several pods on one targetPort cannot be stood for this way:
  only one of them could listen). Absolute paths in env values and arguments that lie under a `mountPath` are
  remapped to the pod root (the process still reads files *inside* mounted files verbatim);
* phase, `Ready`/`ContainersReady` conditions (from the container's httpGet readinessProbe, when it has one)
  and the container's state and exit code written back to the pod's status (`Running`, then `Succeeded` on
  exit 0 or `Failed`), with `restartPolicy: Never` semantics: an exited container is never restarted.

A deleted pod gets SIGTERM for its process group, then SIGKILL for everything left in its session after the
grace period; every pod's output goes to its own log file (`<namespace>_<pod>_<uid8>.log` in `log_dir`, so a
pod recreated under the same name gets a new file). Processes run in sessions of their own, and the runner only
ever signals those sessions.

Used by the join test (tests/integration/join): the real operator, the real `specrl worker` entrypoints, the
real kubectl, on one machine.
"""

from __future__ import annotations

import base64
import datetime as dt
import json
import logging
import os
import re
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specrl.runtime.ports import free_port

log = logging.getLogger(__name__)

# Listen ports of the specrl image and the variables that move them (worker.py): a pod that declares the
# container port, or carries the variable, gets the variable set to its own host port.
PORT_ENV = {8000: "SPECRL_HTTP_PORT", 6379: "SPECRL_RAY_HEAD_PORT"}
PORT_VARS = ("SPECRL_METRICS_PORT", "SPECRL_SYNC_MASTER_PORT")
_DNS = re.compile(r"\b((?:[a-z0-9](?:[-a-z0-9]*[a-z0-9])?\.){1,2}[a-z0-9](?:[-a-z0-9]*[a-z0-9])?)"
                  r"\.svc(?:\.cluster\.local)?(?::(\d+))?\b")
HOST = "127.0.0.1"


def _now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def processes_in_sessions(sessions: set[int]) -> dict[int, str]:
    """pid -> command line of every live (non-zombie) process in one of `sessions`."""
    out = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        rest = stat.rsplit(")", 1)[1].split()
        if rest[0] != "Z" and int(rest[3]) in sessions:
            out[int(entry.name)] = cmd or stat.split("(", 1)[1].rsplit(")", 1)[0]
    return out


class PodNotReady(Exception):
    """The pod cannot start yet (a Secret, ConfigMap or Service it needs is missing)."""


@dataclass
class RunningPod:
    """One pod's process and what the runner set up for it."""

    namespace: str
    name: str
    uid: str
    container: str
    root: Path
    log: Path
    proc: subprocess.Popen
    env: dict[str, str]
    argv: list[str]
    ports: dict[int, int]  # container port -> host port
    readiness_port: int | None
    readiness_path: str = "/healthz"
    ready: bool = False
    exit_code: int | None = None
    deleted: bool = False
    status_written: str = ""
    started_at: str = field(default_factory=_now)
    finished_at: str = ""

    @property
    def sid(self) -> int:
        return self.proc.pid  # start_new_session: the leader's pid is the session id

    def crash(self) -> None:
        """The container dies at once, as when its node kills its cgroup: SIGKILL to every process in its session.
        Not only its process group: Ray puts each worker (the trainer actor, say) in a group of its own, and a worker
        left alive goes on training for a step or two until it notices its raylet is gone."""
        deadline = time.monotonic() + 10
        while (left := processes_in_sessions({self.sid})) and time.monotonic() < deadline:
            for pid in left:
                try:
                    os.kill(pid, signal.SIGKILL)
                except OSError:
                    pass
            time.sleep(0.05)  # returns once they are gone: nothing of the pod writes after this

    def tail(self, n: int = 40) -> str:
        try:
            lines = self.log.read_text(errors="replace").splitlines()
        except OSError:
            lines = []
        return f"--- pod {self.name} ({self.log}, exit {self.exit_code}) ---\n" + "\n".join(lines[-n:])


class PodRunner:
    """Run the Pods of `namespace` (all namespaces when None) that an API server at `server` holds."""

    def __init__(self, server: str, root: Path, log_dir: Path, *, namespace: str | None = None,
                 token: str = "test-token", claims: Mapping[str, Path] | None = None,
                 path_prefix: list[str] | None = None,
                 node_env: Callable[[dict[str, Any], Path], dict[str, str]] | None = None,
                 grace_seconds: float = 20.0, tick: float = 0.25) -> None:
        self.server = server.rstrip("/")
        self.root, self.log_dir = root, log_dir
        self.namespace = namespace
        self.token = token
        self.claims = {k: Path(v) for k, v in (claims or {}).items()}
        self.path_prefix = path_prefix or []  # where the image's executables live (prepended to PATH)
        self.node_env = node_env
        self.grace_seconds, self.tick = grace_seconds, tick
        self.pods: dict[tuple[str, str, str], RunningPod] = {}  # (ns, name, uid)
        self.failed_to_start: dict[tuple[str, str, str], str] = {}
        self._service_ports: dict[tuple[str, str, int], int] = {}
        self._pod_ports: dict[tuple[str, str, int], int] = {}
        self._lock = threading.RLock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.root.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)

    # ------------------------------------------------------------------ API access
    def _request(self, method: str, path: str, body: Any = None, content_type: str = "application/json") -> Any:
        data = json.dumps(body).encode() if body is not None else None
        req = urllib.request.Request(f"{self.server}{path}", data=data, method=method,
                                     headers={"Authorization": f"Bearer {self.token}", "Content-Type": content_type,
                                              "User-Agent": "specrl-pod-runner/1", "Accept": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as r:
            return json.loads(r.read() or b"null")

    def _get(self, path: str) -> Any:
        try:
            return self._request("GET", path)
        except urllib.error.HTTPError as exc:
            if exc.code == 404:
                return None
            raise

    def _list_pods(self) -> list[dict[str, Any]]:
        base = f"/api/v1/namespaces/{self.namespace}/pods" if self.namespace else "/api/v1/pods"
        return list((self._get(base) or {}).get("items") or [])

    def _patch_status(self, pod: RunningPod, status: dict[str, Any]) -> None:
        text = json.dumps(status, sort_keys=True)
        if text == pod.status_written or pod.deleted:
            return
        try:
            current = self._get(f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}")
            if current is None or current["metadata"].get("uid") != pod.uid:
                return  # gone, or replaced by a new pod under the same name
            self._request("PATCH", f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/status",
                          {"status": status}, "application/merge-patch+json")
            pod.status_written = text
        except (OSError, urllib.error.URLError) as exc:
            log.warning("pod runner: status of %s not written (%s)", pod.name, exc)

    # ------------------------------------------------------------------ ports and names
    def service_port(self, namespace: str, service: str, target_port: int) -> int:
        """The host port that stands for `service`'s `target_port` (stable; allocated on first use)."""
        with self._lock:
            key = (namespace, service, target_port)
            if key not in self._service_ports:
                self._service_ports[key] = free_port(HOST)
            return self._service_ports[key]

    def pod_port(self, namespace: str, pod: str, port: int) -> int:
        """The host port that stands for `pod`'s container port `port`: its Service's, when a (non-headless)
        Service selects the pod with that targetPort, so that clients and the pod agree in any start order."""
        with self._lock:
            for svc in self._services_selecting(namespace, pod):
                for p in (svc.get("spec") or {}).get("ports") or []:
                    if int(p.get("targetPort") or p["port"]) == port:
                        return self.service_port(namespace, svc["metadata"]["name"], port)
            key = (namespace, pod, port)
            if key not in self._pod_ports:
                self._pod_ports[key] = free_port(HOST)
            return self._pod_ports[key]

    def _services_selecting(self, namespace: str, pod_name: str) -> list[dict[str, Any]]:
        pod = self._get(f"/api/v1/namespaces/{namespace}/pods/{pod_name}")
        labels = (pod or {}).get("metadata", {}).get("labels") or {}
        out = []
        for svc in (self._get(f"/api/v1/namespaces/{namespace}/services") or {}).get("items") or []:
            spec = svc.get("spec") or {}
            selector = spec.get("selector") or {}
            if spec.get("clusterIP") != "None" and selector and all(labels.get(k) == v for k, v in selector.items()):
                out.append(svc)
        return out

    def _resolve_dns(self, text: str) -> str:
        def one(m: re.Match[str]) -> str:
            parts, port = m.group(1).split("."), m.group(2)
            if len(parts) == 3:  # <pod>.<subdomain>.<ns>: the pod itself
                pod, _sub, ns = parts
                return f"{HOST}:{self.pod_port(ns, pod, int(port))}" if port else HOST
            svc_name, ns = parts
            if not port:
                return HOST
            svc = self._get(f"/api/v1/namespaces/{ns}/services/{svc_name}")
            if svc is None:
                raise PodNotReady(f"service {ns}/{svc_name} does not exist yet")
            for p in (svc.get("spec") or {}).get("ports") or []:
                if int(p["port"]) == int(port):
                    return f"{HOST}:{self.service_port(ns, svc_name, int(p.get('targetPort') or p['port']))}"
            raise PodNotReady(f"service {ns}/{svc_name} has no port {port}")

        return _DNS.sub(one, text)

    # ------------------------------------------------------------------ volumes, env
    def _object(self, ns: str, kind: str, name: str) -> dict[str, Any]:
        obj = self._get(f"/api/v1/namespaces/{ns}/{kind}/{name}")
        if obj is None:
            raise PodNotReady(f"{kind[:-1]} {ns}/{name} does not exist")
        return obj

    def _data(self, ns: str, kind: str, name: str, optional: bool = False) -> dict[str, str]:
        try:
            obj = self._object(ns, kind, name)
        except PodNotReady:
            if optional:
                return {}
            raise
        data = {k: str(v) for k, v in (obj.get("data") or {}).items()}
        if kind == "secrets":
            data = {k: base64.b64decode(v).decode() for k, v in data.items()}
            data.update({k: str(v) for k, v in (obj.get("stringData") or {}).items()})
        return data

    def _volumes(self, pod: dict[str, Any], root: Path) -> dict[str, Path]:
        ns = pod["metadata"]["namespace"]
        out: dict[str, Path] = {}
        for vol in pod["spec"].get("volumes") or []:
            name = vol["name"]
            if "persistentVolumeClaim" in vol:
                claim = vol["persistentVolumeClaim"]["claimName"]
                path = self.claims.get(claim) or self.root / "claims" / ns / claim
            else:
                path = root / "volumes" / name
            path.mkdir(parents=True, exist_ok=True)
            files: dict[str, str] = {}
            if "configMap" in vol:
                src = vol["configMap"]
                files = self._data(ns, "configmaps", src["name"], bool(src.get("optional")))
                items = src.get("items")
            elif "secret" in vol:
                src = vol["secret"]
                files = self._data(ns, "secrets", src["secretName"], bool(src.get("optional")))
                items = src.get("items")
            if files:
                chosen = {i["path"]: files[i["key"]] for i in items} if items else files
                for rel, content in chosen.items():
                    (path / rel).parent.mkdir(parents=True, exist_ok=True)
                    (path / rel).write_text(content)
            out[name] = path
        return out

    def _mounts(self, container: dict[str, Any], volumes: dict[str, Path]) -> list[tuple[str, Path]]:
        mounts = []
        for m in container.get("volumeMounts") or []:
            host = volumes[m["name"]] / m["subPath"] if m.get("subPath") else volumes[m["name"]]
            mounts.append((m["mountPath"].rstrip("/") or "/", host))
        return sorted(mounts, key=lambda m: -len(m[0]))  # the deepest mount wins

    @staticmethod
    def _map_path(value: str, mounts: list[tuple[str, Path]]) -> str:
        for mount, host in mounts:
            if value == mount or value.startswith(mount + "/"):
                return str(host) + value[len(mount):]
        return value

    def _field(self, pod: dict[str, Any], path: str) -> str:
        meta = pod["metadata"]
        simple = {"metadata.name": meta["name"], "metadata.namespace": meta["namespace"],
                  "metadata.uid": meta.get("uid", ""), "status.podIP": HOST, "status.hostIP": HOST,
                  "spec.nodeName": "local-node", "spec.serviceAccountName": pod["spec"].get("serviceAccountName", "")}
        if path in simple:
            return simple[path]
        m = re.fullmatch(r"metadata\.(labels|annotations)\['(.+)'\]", path)
        if m:
            return str((meta.get(m.group(1)) or {}).get(m.group(2), ""))
        raise PodNotReady(f"fieldRef {path!r} is not supported by the pod runner")

    def _env(self, pod: dict[str, Any], container: dict[str, Any]) -> dict[str, str]:
        ns = pod["metadata"]["namespace"]
        env: dict[str, str] = {}
        for src in container.get("envFrom") or []:
            prefix = src.get("prefix", "")
            if "configMapRef" in src:
                ref = src["configMapRef"]
                data = self._data(ns, "configmaps", ref["name"], bool(ref.get("optional")))
            else:
                ref = src["secretRef"]
                data = self._data(ns, "secrets", ref["name"], bool(ref.get("optional")))
            env.update({prefix + k: v for k, v in data.items()})
        for var in container.get("env") or []:
            if "valueFrom" not in var:
                env[var["name"]] = var.get("value", "")
                continue
            vf = var["valueFrom"]
            if "secretKeyRef" in vf or "configMapKeyRef" in vf:
                kind, ref = ("secrets", vf["secretKeyRef"]) if "secretKeyRef" in vf else ("configmaps", vf["configMapKeyRef"])
                data = self._data(ns, kind, ref["name"], bool(ref.get("optional")))
                if ref["key"] in data:
                    env[var["name"]] = data[ref["key"]]
                elif not ref.get("optional"):
                    raise PodNotReady(f"{kind[:-1]} {ns}/{ref['name']} has no key {ref['key']!r}")
            elif "fieldRef" in vf:
                env[var["name"]] = self._field(pod, vf["fieldRef"]["fieldPath"])
            else:
                raise PodNotReady(f"valueFrom {sorted(vf)} is not supported by the pod runner")
        return env

    # ------------------------------------------------------------------ lifecycle
    def _start(self, pod: dict[str, Any]) -> RunningPod:
        meta, spec = pod["metadata"], pod["spec"]
        ns, name, uid = meta["namespace"], meta["name"], meta["uid"]
        (container,) = spec["containers"]
        root = self.root / f"{name}-{uid[:8]}"
        home = root / "home"
        home.mkdir(parents=True, exist_ok=True)
        env = self._env(pod, container)  # raises PodNotReady before anything is written for a missing object
        mounts = self._mounts(container, self._volumes(pod, root))
        ports = {int(p["containerPort"]): self.pod_port(ns, name, int(p["containerPort"]))
                 for p in container.get("ports") or []}
        env = {k: self._map_path(self._resolve_dns(v), mounts) for k, v in env.items()}
        for port, host_port in ports.items():
            if port in PORT_ENV:
                env[PORT_ENV[port]] = str(host_port)
        for var in PORT_VARS:
            if env.get(var, "").isdigit():
                env[var] = str(ports.get(int(env[var])) or self.pod_port(ns, name, int(env[var])))
        argv = [self._map_path(self._resolve_dns(a), mounts)
                for a in [*(container.get("command") or []), *(container.get("args") or [])]]
        base = {k: v for k, v in os.environ.items() if not k.startswith(("SPECRL_", "RAY_", "KUBECONFIG"))}
        base["PATH"] = os.pathsep.join([*self.path_prefix, base.get("PATH", "")])
        full = {**base, **env, "HOME": str(home), "HOSTNAME": spec.get("hostname") or name}
        if self.node_env is not None:
            full.update(self.node_env(pod, root))
        probe = (container.get("readinessProbe") or {}).get("httpGet")
        log_path = self.log_dir / f"{ns}_{name}_{uid[:8]}.log"
        with open(log_path, "ab") as out:
            out.write(f"# pod runner: {' '.join(argv)}\n# ports {ports}\n".encode())
            out.flush()
            proc = subprocess.Popen(argv, cwd=home, env=full, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        return RunningPod(ns, name, uid, container["name"], root, log_path, proc, full, argv, ports,
                          ports.get(int(probe["port"])) if probe else None,
                          probe.get("path", "/") if probe else "/")

    def _status(self, pod: RunningPod) -> dict[str, Any]:
        container = {"name": pod.container, "image": "local", "imageID": "",
                     "restartCount": 0, "ready": pod.ready and pod.exit_code is None}
        if pod.exit_code is None:
            phase = "Running"
            container |= {"started": True, "state": {"running": {"startedAt": pod.started_at}}}
        else:
            phase = "Succeeded" if pod.exit_code == 0 else "Failed"
            reason = "Completed" if pod.exit_code == 0 else "Error"
            container |= {"started": False, "state": {"terminated": {"exitCode": pod.exit_code, "reason": reason,
                                                                    "startedAt": pod.started_at,
                                                                    "finishedAt": pod.finished_at}}}
        ready = "True" if container["ready"] else "False"
        return {"phase": phase, "podIP": HOST, "hostIP": HOST, "startTime": pod.started_at,
                "conditions": [{"type": "PodScheduled", "status": "True"}, {"type": "Initialized", "status": "True"},
                               {"type": "ContainersReady", "status": ready}, {"type": "Ready", "status": ready}],
                "containerStatuses": [container]}

    def _probe(self, pod: RunningPod) -> bool:
        if pod.readiness_port is None:
            return True
        try:
            with urllib.request.urlopen(f"http://{HOST}:{pod.readiness_port}{pod.readiness_path}", timeout=1) as r:
                return 200 <= r.status < 400
        except (OSError, urllib.error.URLError):
            return False

    def _end(self, pod: RunningPod) -> None:
        """Stop a pod's process: SIGTERM to its group, then SIGKILL to whatever is left in its session."""
        if pod.proc.poll() is None:
            try:
                os.killpg(pod.proc.pid, signal.SIGTERM)
            except OSError:
                pass
            try:
                pod.proc.wait(self.grace_seconds)
            except subprocess.TimeoutExpired:
                pass
        self._kill_session(pod)
        if pod.exit_code is None:  # a deleted pod's status is gone with it; its history keeps how it ended
            code = pod.proc.returncode
            pod.exit_code = 128 - code if code < 0 else code
            pod.finished_at = _now()

    def _kill_session(self, pod: RunningPod) -> None:
        for pid in processes_in_sessions({pod.sid}):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        if pod.proc.poll() is None:
            pod.proc.kill()
        pod.proc.wait(10)

    def sync_once(self) -> None:
        """One kubelet pass: start new pods, end deleted ones, write every running pod's status."""
        listed = {(p["metadata"]["namespace"], p["metadata"]["name"], p["metadata"].get("uid", "")): p
                  for p in self._list_pods()}
        with self._lock:
            known = dict(self.pods)
        for key, pod in known.items():
            if key not in listed and not pod.deleted:
                pod.deleted = True
                threading.Thread(target=self._end, args=(pod,), daemon=True).start()
        for key, obj in listed.items():
            if key in known or obj["metadata"].get("deletionTimestamp"):
                continue
            try:
                started = self._start(obj)
            except PodNotReady as exc:
                self.failed_to_start[key] = str(exc)
                continue
            self.failed_to_start.pop(key, None)
            with self._lock:
                self.pods[key] = started
        for pod in list(self.pods.values()):
            if pod.deleted:
                continue
            if pod.exit_code is None:
                code = pod.proc.poll()
                if code is not None:
                    # The container is gone: so is everything it started (a container's processes share its fate).
                    pod.exit_code = 128 - code if code < 0 else code
                    pod.finished_at = _now()
                    self._kill_session(pod)
                else:
                    pod.ready = self._probe(pod)
            self._patch_status(pod, self._status(pod))

    def _loop(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync_once()
            except Exception as exc:  # noqa: BLE001 - a kubelet keeps going; the test reads the log
                log.warning("pod runner pass failed: %r", exc)
            self._stop.wait(self.tick)

    def start(self) -> PodRunner:
        self._thread = threading.Thread(target=self._loop, name="pod-runner", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(30)
        for pod in list(self.pods.values()):
            self.grace_seconds = min(self.grace_seconds, 5.0)
            self._end(pod)

    # ------------------------------------------------------------------ for tests
    def running(self, namespace: str, name: str) -> RunningPod | None:
        """The live (not deleted) process of pod `name`, if any."""
        with self._lock:
            hits = [p for (ns, n, _), p in self.pods.items() if (ns, n) == (namespace, name) and not p.deleted]
        return hits[-1] if hits else None

    def history(self, namespace: str, name: str) -> list[RunningPod]:
        """Every process pod `name` ran as, oldest first (a recreated pod is a new entry)."""
        with self._lock:
            return [p for (ns, n, _), p in self.pods.items() if (ns, n) == (namespace, name)]

    def logs(self) -> str:
        return "\n".join(p.tail() for p in self.pods.values())
