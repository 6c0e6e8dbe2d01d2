"""The pod entrypoints as real, separate processes: `specrl worker coordinator|trainer|rollout` on localhost.

Three OS processes play the three pods of a job, with the environment the operator gives them
(runtime/worker.py): the coordinator starts a Ray head and serves HTTP, the trainer and rollout pods wait for it
and join its Ray cluster as nodes advertising their role and pod resources, and the coordinator runs a tiny
GRPO job on actors pinned to those nodes. Then SIGTERM must end every process each "pod" started.

Each process gets its own session (start_new_session), its own HOME and its own Ray temp dir and ports, as
separate pods would: the test only ever signals processes in those three sessions, never another Ray instance
on the machine. The coordinator's HOME holds a `~/.ray/auth_token`, as `specrl run` leaves one behind; Ray
alone would then put the head in token mode while the joining nodes send no token.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from specrl.runtime.ports import free_ports

from tests.kube.pod_runner import processes_in_sessions

pytestmark = [pytest.mark.integration, pytest.mark.slow]

SPECRL = [sys.executable, "-m", "specrl.runtime.cli"]
JOB = "wcl"
NAMESPACE = "specrl-test"
STEPS = 2
JOB_TIMEOUT_S = 240.0  # generous on 2 loaded cores; a healthy run takes well under a minute
STOP_TIMEOUT_S = 45.0


@dataclass
class Pod:
    """One `specrl worker ROLE` process standing in for a pod; its session holds everything it starts."""

    name: str
    proc: subprocess.Popen
    log: Path
    metrics_port: int = 0
    sid: int = field(init=False)

    def __post_init__(self) -> None:
        self.sid = self.proc.pid  # start_new_session: the leader's pid is the session id

    def tail(self, n: int = 60) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        return f"--- {self.name} (exit {self.proc.poll()}) ---\n" + "\n".join(lines[-n:])


def _write_job(path: Path, policy: Path, draft: Path, steps: int) -> Path:
    path.write_text(f"""\
apiVersion: specrl.io/v1alpha1
kind: RLJob
metadata: {{name: {JOB}, namespace: {NAMESPACE}}}
spec:
  model: {{name: "{policy}", dtype: float32}}
  algorithm: {{name: grpo, steps: {steps}, promptsPerStep: 4, groupSize: 2, maxNewTokens: 24, learningRate: 1.0e-3,
              seed: 0}}
  dataset: {{type: synthetic, synthetic: {{size: 32}}}}
  reward: {{type: exact_match}}
  mode: sync
  speculative:
    method: draft_model
    draftModel: "{draft}"
    numSpeculativeTokens: 3
  resources: {{gpusPerPod: 0, trainer: {{replicas: 1}}, rollout: {{replicas: 1}}}}
  weightSync: {{backend: gloo}}
""")
    return path


def _get(url: str, timeout: float = 5.0) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _post(url: str, body: dict, headers: dict[str, str] | None = None) -> int:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=5) as r:
            return r.status
    except urllib.error.HTTPError as exc:
        return exc.code


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    # Ray puts Unix sockets under its temp dir; pytest's tmp_path is too long for the 107-byte socket path limit.
    d = Path(tempfile.mkdtemp(prefix="srl", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


@dataclass
class Cluster:
    pods: list[Pod]  # the pods that must keep running (a pod that exits fails the wait)
    url: str
    token: str
    launch: Callable[[str, str], Pod] = field(repr=False)  # start another pod (role, pod name)

    @property
    def sessions(self) -> set[int]:
        return {p.sid for p in self.pods}

    def delete(self, pod: Pod) -> None:
        """SIGTERM `pod` as the kubelet does when the operator deletes it, and stop watching it."""
        self.terminate([pod])
        self.pods.remove(pod)

    def fail(self, why: str) -> None:
        pytest.fail(f"{why}\n" + "\n".join(p.tail() for p in self.pods), pytrace=False)

    def wait_status(self, done: Callable[[dict], bool], what: str) -> dict:
        """Poll GET /status until `done(status)`; fail with every pod's output if a pod exits first."""
        t0 = time.monotonic()
        status: dict = {}
        while time.monotonic() - t0 < JOB_TIMEOUT_S:
            for p in self.pods:
                if p.proc.poll() is not None:
                    self.fail(f"{p.name} exited with {p.proc.returncode} while waiting for {what} "
                              f"(status {status})")
            try:
                code, body = _get(f"{self.url}/status")
                status = json.loads(body) if code == 200 else status
            except (OSError, ValueError):
                pass  # not listening yet
            if status.get("phase") == "Failed":
                self.fail(f"the job failed while waiting for {what}: {status}")
            if done(status):
                return status
            time.sleep(1)
        self.fail(f"no {what} after {JOB_TIMEOUT_S:.0f}s: {status}")
        return status

    def terminate(self, pods: list[Pod]) -> None:
        """SIGTERM `pods`; each must exit within STOP_TIMEOUT_S."""
        for p in pods:
            p.proc.send_signal(signal.SIGTERM)
        for p in pods:
            try:
                p.proc.wait(STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.fail(f"{p.name} still running {STOP_TIMEOUT_S:.0f}s after SIGTERM")

    def assert_all_gone(self, since: float, tolerate: tuple[str, ...] = ()) -> None:
        """Every process of every pod ends within STOP_TIMEOUT_S of `since` (except command names `tolerate`)."""
        left: dict[int, str] = {}
        while time.monotonic() - since < STOP_TIMEOUT_S:
            left = {pid: cmd for pid, cmd in processes_in_sessions(self.sessions).items() if cmd not in tolerate}
            if not left:
                return
            time.sleep(0.5)
        raise AssertionError(f"processes left {STOP_TIMEOUT_S:.0f}s after SIGTERM: {left}")


@pytest.fixture
def cluster(micro, tmp_path: Path, short_tmp: Path, request: pytest.FixtureRequest) -> Iterator[Cluster]:
    """The pods of a job, started together as the operator would: coordinator, one trainer, rollout workers.

    Indirect parameter: the job's steps, or (steps, rollout pods)."""
    from specrl.runtime.paths import cache_dir

    policy, draft = micro
    param = getattr(request, "param", STEPS)
    steps, rollouts = param if isinstance(param, tuple) else (param, 1)
    job = _write_job(tmp_path / "job.yaml", policy, draft, steps)
    http_port, head_port, *node_ports = free_ports(2 + (2 + rollouts) * 3)
    token = secrets.token_urlsafe(24)
    base = {k: v for k, v in os.environ.items() if not k.startswith(("RAY_", "SPECRL_"))}
    base.update({
        "SPECRL_JOB": JOB, "SPECRL_NAMESPACE": NAMESPACE, "SPECRL_COORDINATOR_TOKEN": token,
        "SPECRL_COORDINATOR_ADDR": f"127.0.0.1:{http_port}", "SPECRL_RAY_ADDRESS": f"127.0.0.1:{head_port}",
        "SPECRL_HTTP_PORT": str(http_port), "SPECRL_RAY_HEAD_PORT": str(head_port),
        "SPECRL_CONNECT_TIMEOUT": "120", "SPECRL_CACHE_DIR": str(cache_dir()),
        "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1",
    })
    pods: list[Pod] = []  # every pod ever started, for the cleanup

    def launch(role: str, worker: str, ports: list[int] | None = None) -> Pod:
        n = len(pods)
        agent_port, extra_port, metrics_port = ports or free_ports(3)
        home = short_tmp / f"home-{n}"
        (home / ".ray").mkdir(parents=True)
        if role == "coordinator":  # what a local `ray.init` leaves behind; see the module docstring
            (home / ".ray" / "auth_token").write_text(secrets.token_hex(32))
        # One host, several Ray nodes: each needs its own temp dir (session files, sockets) and the ports
        # Ray otherwise takes at fixed defaults (dashboard agent 52365; Ray client server 10001 on the head).
        ray_args = [f"--temp-dir={short_tmp / f'ray-{n}'}", f"--dashboard-agent-listen-port={agent_port}"]
        if role == "coordinator":
            ray_args.append(f"--ray-client-server-port={extra_port}")
        env = {**base, "HOME": str(home), "SPECRL_ROLE": role, "SPECRL_WORKER": worker,
               "SPECRL_WORKER_INDEX": worker.rsplit("-", 1)[-1], "SPECRL_RAY_START_ARGS": " ".join(ray_args)}
        if role != "coordinator":  # the port the operator declares on worker pods
            env["SPECRL_METRICS_PORT"] = str(metrics_port)
        log = tmp_path / f"{worker}-{n}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([*SPECRL, "worker", role, "--config", str(job)], cwd=tmp_path, env=env,
                                    stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        pods.append(Pod(role, proc, log, metrics_port))
        return pods[-1]

    try:
        roles = [("coordinator", f"{JOB}-coordinator"), ("trainer", f"{JOB}-trainer-0")]
        roles += [("rollout", f"{JOB}-rollout-{i}") for i in range(rollouts)]
        for i, (role, worker) in enumerate(roles):
            launch(role, worker, node_ports[3 * i: 3 * i + 3])
        yield Cluster(list(pods), f"http://127.0.0.1:{http_port}", token, launch)
    finally:
        # Whatever went wrong: kill what is left in our own sessions only (never `ray stop`, which would end
        # every Ray instance on the machine).
        sessions = {p.sid for p in pods}
        for p in pods:
            if p.proc.poll() is None:
                p.proc.kill()
        for pid in processes_in_sessions(sessions):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for p in pods:
            p.proc.wait(10)


def test_pod_entrypoints_run_a_job_as_separate_processes(cluster: Cluster):
    url, token = cluster.url, cluster.token
    coordinator = cluster.pods[0]

    # ---- the job runs to completion on the two worker nodes
    t0 = time.monotonic()
    status = cluster.wait_status(lambda st: bool(st.get("complete")), "a complete job")
    job_seconds = time.monotonic() - t0
    assert status["phase"] == "Complete" and status["job"] == JOB
    assert status["step"] == STEPS and status["weightVersion"] == STEPS  # two GRPO steps, two weight syncs
    workers = {(w["name"], w["role"], w["state"]) for w in status["workers"]}
    assert workers == {(f"{JOB}-trainer-0", "trainer", "active"), (f"{JOB}-rollout-0", "rollout", "active")}
    assert isinstance(status["rewardMean"], float) and status["lastStep"]["trainSeconds"] > 0

    # Placement(cluster=True) pinned each actor to its pod's node: the actor processes are children of
    # that node's raylet, so they live in that pod's session and nowhere else.
    actors = {p.name: " ".join(processes_in_sessions({p.sid}).values()) for p in cluster.pods}
    assert "ray::TrainerWorker" in actors["trainer"] and "ray::RolloutWorker" not in actors["trainer"], actors
    assert "ray::RolloutWorker" in actors["rollout"] and "ray::TrainerWorker" not in actors["rollout"], actors
    assert "ray::TrainerWorker" not in actors["coordinator"], actors  # the head offers no CPU
    assert "ray::RolloutWorker" not in actors["coordinator"], actors

    # ---- Prometheus text with the job's labels: every pod serves the series its own process produces (the worker
    # pods on their declared metrics port), the coordinator what only it knows; no series comes from two places
    labels = f'rljob="{JOB}",rljob_namespace="{NAMESPACE}"'

    def scrape(target: str) -> list[str]:
        code, body = _get(target)
        assert code == 200
        return [ln for ln in body.decode().splitlines() if labels in ln and not ln.startswith("#")]

    coord_series = scrape(f"{url}/metrics")
    pod_series = {p.name: scrape(f"http://127.0.0.1:{p.metrics_port}/metrics") for p in cluster.pods[1:]}

    def value(series: list[str], name: str, worker: str) -> float:
        hits = [ln for ln in series if ln.startswith(name + "{") and f'worker="{worker}"' in ln]
        assert len(hits) == 1, f"{name} for {worker}: {hits} in:\n" + "\n".join(series)
        return float(hits[0].rsplit(" ", 1)[1])

    rollout, trainer = pod_series["rollout"], pod_series["trainer"]
    assert value(rollout, "specrl_rollout_generated_tokens_total", f"{JOB}-rollout-0") > 0
    assert value(rollout, "specrl_rollout_sequences_completed_total", f"{JOB}-rollout-0") == STEPS * 4 * 2
    # the version it decodes with: the last sync is staged and swapped in before its next rollout
    assert value(rollout, "specrl_weight_version", f"{JOB}-rollout-0") == STEPS - 1
    assert value(trainer, "specrl_trainer_step", f"{JOB}-trainer-0") == STEPS
    assert value(trainer, "specrl_weight_sync_bytes_total", f"{JOB}-trainer-0") > 0
    assert value(coord_series, "specrl_weight_version", f"{JOB}-coordinator") == STEPS
    assert value(coord_series, "specrl_rollout_weight_staleness_versions", f"{JOB}-rollout-0") == 0
    everywhere = [ln.rsplit(" ", 1)[0] for ln in coord_series + rollout + trainer]  # name and labels
    assert len(everywhere) == len(set(everywhere)), "a series is exported twice"

    # ---- POST /drain needs the job's token; with it, an unknown worker is a 404 (and drains nothing)
    target = {"worker": f"{JOB}-rollout-0"}
    assert _post(f"{url}/drain", target) == 401
    assert _post(f"{url}/drain", target, {"Authorization": "Bearer not-the-token"}) == 401
    assert _post(f"{url}/drain", {"worker": f"{JOB}-rollout-9"}, {"Authorization": f"Bearer {token}"}) == 404

    # ---- SIGTERM, as Kubernetes sends it to every pod of a deleted job, ends everything each pod started
    assert len(processes_in_sessions(cluster.sessions)) > 3  # the Ray nodes' own processes (GCS, raylets, agents, actors)
    t_stop = time.monotonic()
    cluster.terminate(cluster.pods)
    cluster.assert_all_gone(t_stop)
    assert coordinator.proc.returncode == 0  # a complete job: the operator marks the job Complete
    print(f"job {job_seconds:.1f}s, stop {time.monotonic() - t_stop:.1f}s, exits "
          f"{[p.proc.returncode for p in cluster.pods]}")


@pytest.mark.parametrize("cluster", [1000], indirect=True)  # far more steps than the test waits for
def test_sigterm_stops_a_running_coordinator(cluster: Cluster):
    """An evicted coordinator pod stops mid-job, exits non-zero (the operator counts a failure and resumes from
    the last checkpoint) and takes its Ray head with it; the worker pods' nodes stay until they are stopped."""
    coordinator, *members = cluster.pods
    cluster.wait_status(lambda st: st.get("step", 0) >= 1, "a first step")
    t_stop = time.monotonic()
    cluster.terminate([coordinator])
    assert coordinator.proc.returncode == 128 + signal.SIGTERM
    stopped = time.monotonic() - t_stop
    assert stopped < 30, f"the coordinator took {stopped:.0f}s to stop"
    assert not processes_in_sessions({coordinator.sid}), "the Ray head outlived the coordinator"
    assert all(p.proc.poll() is None for p in members)  # the operator, not the coordinator, ends worker pods
    cluster.terminate(members)
    # Ray itself (2.60, plain `ray start --block` too) leaves a worker node's two agents behind when the node
    # is stopped after its head is gone: the raylet exits, the agents are orphaned and ignore SIGTERM. In a pod
    # they end with the container; here the fixture kills them. Everything else must be gone.
    cluster.assert_all_gone(t_stop, tolerate=("ray::DashboardAgent", "ray::RuntimeEnvAgent"))


@pytest.mark.parametrize("cluster", [(1000, 2)], indirect=True)  # far more steps than the test waits for
def test_membership_follows_the_pod_not_its_name(cluster: Cluster):
    """Issue 12.3 with real pods: a drained worker stays retired while its pod still runs (the operator deletes it
    only after it saw `retired`), the pod recreated under the same name is a new member and gets work, and the
    job's last trainer cannot be drained (409)."""
    old = cluster.pods[3]  # coordinator, trainer, rollout-0, rollout-1
    name = f"{JOB}-rollout-1"
    auth = {"Authorization": f"Bearer {cluster.token}"}

    def state(st: dict) -> str | None:
        return {w["name"]: w["state"] for w in st.get("workers", [])}.get(name)

    cluster.wait_status(lambda st: st.get("step", 0) >= 1 and state(st) == "active", "both rollout pods at work")
    assert _post(f"{cluster.url}/drain", {"worker": f"{JOB}-trainer-0"}, auth) == 409
    assert _post(f"{cluster.url}/drain", {"worker": name}, auth) == 202
    step = cluster.wait_status(lambda st: state(st) == "retired", "the drained worker retired")["step"]
    st = cluster.wait_status(lambda st: st["step"] >= step + 2, "two more steps")
    assert state(st) == "retired" and old.proc.poll() is None  # its node is alive, and it is not put back to work

    cluster.delete(old)
    new = cluster.launch("rollout", name)
    cluster.pods.append(new)
    step = cluster.wait_status(lambda st: state(st) == "active", "the recreated pod joined")["step"]
    cluster.wait_status(lambda st: st["step"] >= step + 2, "steps with the new member")
    assert "ray::RolloutWorker" in " ".join(processes_in_sessions({new.sid}).values())  # its actor runs on the new pod
    code, body = _get(f"http://127.0.0.1:{new.metrics_port}/metrics")
    assert code == 200 and f'specrl_rollout_sequences_completed_total{{rljob="{JOB}"' in body.decode()
    cluster.terminate(cluster.pods)
