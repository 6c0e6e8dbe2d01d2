"""The join: `kubectl apply` -> the real operator -> Pods -> real `specrl worker` processes -> a drained move -> Complete.

Everything is the product except the cluster: the Kubernetes API stand-in (tests/kube: KMock with API-server
behaviour, the RLJob CRD from runtime/api.py) and a local kubelet (tests/kube/pod_runner.py) that starts every
Pod the operator creates as the process its spec says — `specrl worker coordinator|trainer|rollout` with the
pod's env (Secrets via valueFrom, a ConfigMap via envFrom), its ConfigMap mounted as files, a PVC for the model
cache, its own HOME and ports — and writes phase, readiness and exit code back to the pod's status. The operator
is `specrl operator` as a subprocess; the job is driven with the real kubectl; the rebalance is decided by the
operator from the coordinator's real `GET /status` and executed against the coordinator's real `POST /drain`.

Stages, each checked through `kubectl get rlj` (its printer columns) and the pods:
1. apply a CPU job with elasticity on (2 trainers, 1 rollout worker): four pods Running, the job Running;
2. the rollout queue backs up, the operator moves a trainer to rollout: drain, retire, delete, create, join, and
   the new rollout worker completes chunks;
3. the last trainer's process is killed: the pod fails, the operator recreates it; the coordinator, with no
   trainer left, waits for it, loads the newest complete checkpoint from the shared checkpoint volume into it
   and rolls the job back to that checkpoint (coordinator/recovery.py);
4. the job reaches Complete with every step's prompts trained on exactly once (the coordinator's ledger).

The job is paced by its size: enough real steps that both events fit inside it on this machine under load. Every
wait fails at once, naming the stage, when the job completes or fails before the event it waits for.

Pod logs stay in a folder printed at the start (and kept after the test); `make e2e` runs this test alone.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml
from specrl.runtime.ports import free_port

from tests.kube.kubectl import Kubectl, kube_env
from tests.kube.pod_runner import PodRunner, RunningPod
from tests.kube.server import KubeServer

pytestmark = [pytest.mark.integration, pytest.mark.slow]

NS, JOB = "join", "jn"
# 300 steps ended before the second rollout pod joined on a 2-core Zen 5 (about 10 s of training there)
STEPS, PROMPTS, GROUP, TRAINERS = 600, 8, 2, 2
CHECKPOINT_EVERY = 20
TIMEOUT_S = 240.0  # a bound per stage; the job's own end (complete or failed) ends every wait sooner
BIN = Path(sys.executable).parent
HF_TOKEN = "hf_join_test_secret"


def _job(policy: Path, draft: Path, checkpoints: Path) -> dict[str, Any]:
    return {
        "apiVersion": "specrl.io/v1alpha1", "kind": "RLJob", "metadata": {"name": JOB, "namespace": NS},
        "spec": {
            # Host paths stand for models baked into the image: the process reads job.yaml verbatim.
            "model": {"name": str(policy), "dtype": "float32"},
            "algorithm": {"steps": STEPS, "promptsPerStep": PROMPTS, "groupSize": GROUP, "maxNewTokens": 48,
                          "learningRate": 1.0e-3, "seed": 0},
            "dataset": {"type": "synthetic", "synthetic": {"size": 64}},
            "speculative": {"method": "draft_model", "draftModel": str(draft), "numSpeculativeTokens": 3},
            "resources": {
                "image": "specrl:local", "gpusPerPod": 0,
                "rollout": {"replicas": 1, "minReplicas": 1},
                "podTemplate": {
                    "env": [{"name": "HF_TOKEN", "valueFrom": {"secretKeyRef": {"name": "hf-token", "key": "token"}}},
                            {"name": "POD_UID", "valueFrom": {"fieldRef": {"fieldPath": "metadata.uid"}}}],
                    "envFrom": [{"configMapRef": {"name": "node-settings"}}],
                    "volumes": [{"name": "model-cache", "persistentVolumeClaim": {"claimName": "model-cache"}}],
                    "volumeMounts": [{"name": "model-cache", "mountPath": "/var/cache/specrl"}],
                },
                "coordinator": {"podTemplate": {"resources": {"requests": {"cpu": "100m"}}}},
                # Only trainers write checkpoints: the shared (ReadWriteMany) claim is theirs alone.
                "trainer": {"replicas": TRAINERS, "minReplicas": 1, "podTemplate": {
                    "volumes": [{"name": "checkpoints", "persistentVolumeClaim": {"claimName": "checkpoints"}}],
                    "volumeMounts": [{"name": "checkpoints", "mountPath": str(checkpoints)}]}},
            },
            "checkpoint": {"path": str(checkpoints), "interval": CHECKPOINT_EVERY},
            # One move (the cooldown outlasts the job), decided on the first poll that sees the queue back up.
            "elastic": {"enabled": True, "cooldownSeconds": 3600, "hysteresis": 1, "queueHighWatermark": 1,
                        "queueLowWatermark": 0, "drainTimeoutSeconds": 20},
            "weightSync": {"backend": "gloo"},
            "backoffLimit": 3,
        },
    }


def _get_json(url: str) -> Any:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return json.loads(r.read())
    except (OSError, urllib.error.URLError, ValueError):
        return None


def _get_text(url: str) -> str:
    try:
        with urllib.request.urlopen(url, timeout=3) as r:
            return r.read().decode()
    except (OSError, urllib.error.URLError):
        return ""


@dataclass
class Join:
    kube: KubeServer
    kubectl: Kubectl
    runner: PodRunner
    operator: subprocess.Popen
    operator_log: Path
    coordinator_url: str
    logs: Path
    last_status: dict[str, Any] | None = None

    def fail(self, why: str) -> None:
        op = self.operator_log.read_text(errors="replace").splitlines()[-40:] if self.operator_log.exists() else []
        pytest.fail(f"{why}\n--- operator ---\n" + "\n".join(op) + "\n" + self.runner.logs()
                    + f"\n(pod logs: {self.logs})", pytrace=False)

    def rlj(self) -> dict[str, str]:
        """`kubectl get rlj` as the columns a person sees."""
        out = self.kubectl("get", "rlj", JOB, "-n", NS).stdout.splitlines()
        return dict(zip(out[0].split(), out[1].split(), strict=False))

    def events(self) -> list[str]:
        """Reasons of the operator's events about the job."""
        items = self.kubectl.json("get", "events", "-n", NS)["items"]
        return [e.get("reason", "") for e in items if (e.get("involvedObject") or {}).get("name") == JOB]

    def pods(self) -> dict[str, dict[str, Any]]:
        items = self.kubectl.json("get", "pods", "-n", NS, "-l", f"specrl.io/job={JOB}")["items"]
        return {p["metadata"]["name"]: p for p in items}

    def status(self) -> dict[str, Any] | None:
        st = _get_json(f"{self.coordinator_url}/status")
        if st is not None:
            self.last_status = st
        return st

    def wait(self, predicate: Callable[[], Any], what: str, timeout: float = TIMEOUT_S, interval: float = 0.5,
             before_end: bool = True, progress: Callable[[], Any] | None = None) -> Any:
        """Poll `predicate` until it is truthy. With `before_end`, a job that completes or fails first fails the
        test at once (the event can no longer happen inside this job). `last_status` is fresh in `predicate`.
        With `progress`, `timeout` bounds the time without progress: each change of its value restarts it (a slow
        machine takes longer to the end of the job, but never stalls)."""
        deadline = time.monotonic() + timeout
        seen = progress() if progress is not None else None
        while time.monotonic() < deadline:
            if self.operator.poll() is not None:
                self.fail(f"the operator exited ({self.operator.returncode}) while waiting for {what}")
            self.status()  # every poll refreshes last_status, which tells when the job ended
            value = predicate()
            if value:
                return value
            if progress is not None and (now := progress()) != seen:
                seen, deadline = now, time.monotonic() + timeout
            st = self.last_status or {}
            if before_end and (st.get("complete") or st.get("phase") in ("Complete", "Failed")):
                self.fail(f"the job ended ({st.get('phase')}, step {st.get('step')} of {STEPS}) before {what}"
                          + ("; it ran too fast for this machine: raise STEPS" if st.get("complete") else "")
                          + f"; coordinator status {st}")
            time.sleep(interval)
        self.fail(f"timed out after {timeout:.0f}s {'without progress ' if progress else ''}waiting for {what}; "
                  f"coordinator status {self.last_status}")
        return None


def _running(pods: dict[str, dict[str, Any]]) -> set[str]:
    return {n for n, p in pods.items() if (p.get("status") or {}).get("phase") == "Running"
            and not p["metadata"].get("deletionTimestamp")}


def _workers(status: dict[str, Any] | None) -> dict[str, str]:
    return {w["name"]: w["state"] for w in (status or {}).get("workers") or []}


def _came_back(states: list[str]) -> bool:
    """A worker that left (dead, retired, absent) is active again later in `states`."""
    gone = next((i for i, s in enumerate(states) if s != "active"), None)
    return gone is not None and "active" in states[gone + 1:]


def _series(metrics: str, name: str) -> dict[str, float]:
    """worker label -> value of every `name{...}` sample."""
    out = {}
    for line in metrics.splitlines():
        if line.startswith(name + "{"):
            worker = re.search(r'worker="([^"]+)"', line)
            out[worker.group(1) if worker else ""] = float(line.rsplit(" ", 1)[1])
    return out


@pytest.fixture(scope="module")
def join() -> Iterator[Join]:
    from specrl.runtime.paths import cache_dir

    from tests.integration.rlrun.micro import micro_models

    micro_models()  # built (or found in the cache) before any pod starts
    # Ray puts Unix sockets under each pod's temp dir: keep the root short (107-byte socket path limit).
    root = Path(tempfile.mkdtemp(prefix="jn", dir="/tmp"))
    logs = Path(os.environ.get("SPECRL_E2E_LOGS") or tempfile.mkdtemp(prefix="specrl-e2e-logs-"))
    print(f"\n[join] pod logs: {logs}", flush=True)

    def node_env(pod: dict[str, Any], pod_root: Path) -> dict[str, str]:
        # What differs between hosts and pods that the runner's port translation does not cover: Ray's own
        # per-node temp dir and the fixed-default ports of its agents.
        temp = tempfile.mkdtemp(prefix="r", dir=root)
        args = [f"--temp-dir={temp}", f"--dashboard-agent-listen-port={free_port()}"]
        if pod["metadata"]["labels"].get("specrl.io/role") == "coordinator":
            args.append(f"--ray-client-server-port={free_port()}")
        return {"SPECRL_RAY_START_ARGS": " ".join(args), "SPECRL_CONNECT_TIMEOUT": "180",
                "PYTHONUNBUFFERED": "1"}

    kube = KubeServer().start()
    kubeconfig = kube.write_kubeconfig(root / "kubeconfig", namespace=NS)
    kubectl = Kubectl(kube_env(kubeconfig, root / "kubecache"), timeout=60)
    # The model-cache claim is pre-provisioned with this machine's cache (where the micro models were built).
    # The checkpoint claim starts empty; it is mounted where spec.checkpoint.path says (the same path on this host,
    # as the process reads job.yaml verbatim).
    (root / "checkpoints").mkdir()
    runner = PodRunner(kube.url, root / "pods", logs, namespace=NS,
                       claims={"model-cache": cache_dir(), "checkpoints": root / "checkpoints"},
                       path_prefix=[str(BIN)], node_env=node_env)
    http_port = runner.service_port(NS, f"{JOB}-coordinator", 8000)
    operator_log = logs / "operator.log"
    operator = None
    try:
        runner.start()
        env = {**os.environ, "KUBECONFIG": str(kubeconfig), "SPECRL_OPERATOR_RESTART_BACKOFF": "0.5"}
        with open(operator_log, "ab") as out:
            operator = subprocess.Popen(
                [str(BIN / "specrl"), "operator", "-n", NS, "--coordinator-url-template", f"http://127.0.0.1:{http_port}",
                 "--metrics-port", str(free_port()), "--health-port", str(free_port()), "--poll-interval", "1"],
                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        yield Join(kube, kubectl, runner, operator, operator_log, f"http://127.0.0.1:{http_port}", logs)
    finally:
        if operator is not None and operator.poll() is None:
            operator.send_signal(signal.SIGTERM)
            try:
                operator.wait(20)
            except subprocess.TimeoutExpired:
                operator.kill()
                operator.wait(5)
        runner.stop()
        kube.stop()
        shutil.rmtree(root, ignore_errors=True)
        print(f"[join] pod logs kept in {logs}", flush=True)


def test_apply_rebalance_kill_and_complete(join: Join) -> None:
    t0 = time.monotonic()
    k = join.kubectl
    k("--validate=false", "apply", "-f", "-", input=yaml.safe_dump_all([
        {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NS}},
        {"apiVersion": "v1", "kind": "Secret", "metadata": {"name": "hf-token", "namespace": NS},
         "type": "Opaque", "stringData": {"token": HF_TOKEN}},
        {"apiVersion": "v1", "kind": "ConfigMap", "metadata": {"name": "node-settings", "namespace": NS},
         "data": {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}},
    ]))
    checkpoints = join.runner.claims["checkpoints"]
    k("apply", "-f", "-", input=yaml.safe_dump(_job(*_models(), checkpoints)))  # server-side validated (the CRD)
    t_, r_ = f"{JOB}-trainer-", f"{JOB}-rollout-"

    # ---- 1. the pods Running as `specrl worker` processes; the job Running ---------------------------------
    first = {f"{JOB}-coordinator-0", *(f"{t_}{i}" for i in range(TRAINERS)), f"{r_}0"}
    join.wait(lambda: _running(join.pods()) >= first, "the job's pods Running")
    trainer = join.runner.running(NS, f"{t_}0")
    assert trainer is not None and trainer.argv[1:] == ["worker", "trainer", "--config",
                                                        f"{trainer.root}/volumes/config/job.yaml"]
    assert trainer.env["HF_TOKEN"] == HF_TOKEN  # valueFrom secretKeyRef, resolved by the "kubelet"
    assert trainer.env["OMP_NUM_THREADS"] == "1"  # envFrom configMapRef
    assert trainer.env["POD_UID"] == join.pods()[f"{t_}0"]["metadata"]["uid"]  # fieldRef
    assert trainer.env["SPECRL_CACHE_DIR"] == str(join.runner.claims["model-cache"])  # the shared cache claim
    assert HF_TOKEN not in json.dumps(join.kubectl.json("get", "rlj", JOB, "-n", NS))
    mounts = {v["name"] for v in join.pods()[f"{JOB}-coordinator-0"]["spec"].get("volumes") or []}
    assert "checkpoints" not in mounts and "model-cache" in mounts  # the trainer override is the trainers' only
    join.wait(lambda: join.rlj().get("PHASE") == "Running", "kubectl get rlj: Running")
    cols = join.rlj()
    assert (cols["TRAINER"], cols["ROLLOUT"]) == (str(TRAINERS), "1"), cols
    startup_s = time.monotonic() - t0

    # ---- 2. the rollout queue backs up: the operator moves the last trainer to rollout ----------------------
    t1 = time.monotonic()
    victim, newcomer = f"{t_}{TRAINERS - 1}", f"{r_}1"
    seen: list[str] = []  # the victim's states in /status, in order, while its pod exists

    def moved() -> dict[str, Any] | None:
        st = join.last_status
        state = _workers(st).get(victim)
        if state and (not seen or seen[-1] != state) and join.runner.running(NS, victim) is not None:
            seen.append(state)
        if _came_back(seen):
            join.fail(f"drained {victim} was put back to work before its pod was deleted (its states {seen})")
        return st if _workers(st).get(newcomer) == "active" else None

    join.wait(moved, f"{newcomer} joining the job", interval=0.1)
    last = join.kubectl.json("get", "rlj", JOB, "-n", NS)["status"]["lastRebalance"]
    assert (last["fromRole"], last["toRole"]) == ("trainer", "rollout"), last
    assert last["reason"] in ("QueueBacklog", "StepBalance"), last  # rollout is the bottleneck either way
    # the new pod may join while the old one still terminates
    join.wait(lambda: victim not in join.pods() and join.runner.history(NS, victim)[0].exit_code is not None,
              f"{victim}'s pod deleted and its process ended")
    assert seen[:1] == ["active"] and {"draining", "retired"} & set(seen), seen  # drained via the real POST /drain
    assert "DrainTimeout" not in join.events()  # it retired at its safe point; the operator did not force it
    join.wait(lambda: (c := join.rlj()) and (c["TRAINER"], c["ROLLOUT"]) == (str(TRAINERS - 1), "2"),
              f"kubectl get rlj: {TRAINERS - 1} / 2")
    # the new pod does work: its own /metrics count the sequences it rolled out
    newcomer_metrics = f"http://127.0.0.1:{join.runner.running(NS, newcomer).ports[9090]}/metrics"  # type: ignore[union-attr]
    join.wait(lambda: sum(_series(_get_text(newcomer_metrics), "specrl_rollout_sequences_completed_total").values()),
              f"{newcomer} completing rollouts")
    move_s = time.monotonic() - t1

    # ---- 3. the last trainer's process dies mid-job: recreated, it loads the newest checkpoint ------------
    t2 = time.monotonic()
    target = f"{t_}0"
    join.wait(lambda: list(checkpoints.glob("step-*/COMPLETE")), "a complete checkpoint on the shared volume")
    old: RunningPod = join.runner.running(NS, target)  # type: ignore[assignment]
    # Counted from here: a pod that crashed earlier (a port taken, say) and came back is already in the count.
    restarts = int(join.kubectl.json("get", "rlj", JOB, "-n", NS)["status"].get("restarts") or 0)
    old.crash()
    step_at_kill = int((join.status() or {}).get("step", 0))
    # With no trainer left no checkpoint can complete after this: the recovery must load the newest one.
    newest = max(int(m.parent.name.removeprefix("step-")) for m in checkpoints.glob("step-*/COMPLETE"))
    join.wait(lambda: (r := join.runner.running(NS, target)) is not None and r.uid != old.uid,
              f"{target} recreated by the operator")
    assert old.exit_code == 137
    join.wait(lambda: join.kubectl.json("get", "rlj", JOB, "-n", NS)["status"].get("restarts") == restarts + 1,
              "the restart counted once in the RLJob's status")
    states: list[str] = []

    def rejoined() -> dict[str, Any] | None:
        st = join.last_status or {}
        state = _workers(st).get(target, "absent")
        if not states or states[-1] != state:
            states.append(state)
        # The recovery is recorded once the replacement is in the group (its retired spell may be shorter than a
        # poll when the pod was back before the death was noticed).
        recs = [r for r in st.get("trainerRecoveries") or [] if target in r["lost"]]
        return recs[-1] if recs and state == "active" else None

    rec = join.wait(rejoined, f"the recreated {target} rejoining", interval=0.2)
    assert (rec["action"], rec["lost"]) == ("restore", [target]), rec  # no trainer survived: the checkpoint
    restored = int(Path(rec["source"]).name.removeprefix("step-"))
    assert Path(rec["source"]).parent == checkpoints and restored % CHECKPOINT_EVERY == 0, rec
    assert restored == newest and step_at_kill - CHECKPOINT_EVERY <= restored <= step_at_kill + 1, (
        restored, newest, step_at_kill)
    cols = join.rlj()
    assert (cols["TRAINER"], cols["ROLLOUT"]) == (str(TRAINERS - 1), "2"), cols
    kill_s = time.monotonic() - t2

    # ---- 4. Complete, every step's prompts trained on exactly once ------------------------------------------
    t3 = time.monotonic()
    # Hundreds of steps are left here: the bound is on a stall, not on this machine's speed.
    final = join.wait(lambda: (st := join.last_status or {}).get("complete") and st, "the coordinator: complete",
                      before_end=False, progress=lambda: (join.last_status or {}).get("step"))
    join.wait(lambda: join.rlj().get("PHASE") == "Complete", "kubectl get rlj: Complete", before_end=False)
    cols = join.rlj()
    assert cols["STEP"] == str(STEPS), cols
    assert final.get("complete") and final.get("step") == STEPS and final.get("weightVersion") == STEPS, final
    # The ledger refuses to train a prompt twice (the job would have Failed); after the rollback it holds the
    # restored ledger plus the steps run again: every prompt of every step exactly once, none lost or dropped.
    assert final["ledger"] == {"issued": STEPS * PROMPTS, "trained": STEPS * PROMPTS, "dropped": 0, "lost": 0}, final
    assert [r["action"] for r in final["trainerRecoveries"]] == ["restore"], final["trainerRecoveries"]
    print(f"[join] startup {startup_s:.0f}s, move {move_s:.0f}s, kill+restore {kill_s:.0f}s, "
          f"to Complete {time.monotonic() - t3:.0f}s, total {time.monotonic() - t0:.0f}s; "
          f"moved trainer's states {seen}, killed trainer's states {states}, restored step {restored} "
          f"(killed at {step_at_kill}); logs {join.logs}")


def _models() -> tuple[Path, Path]:
    from tests.integration.rlrun.micro import micro_models

    return micro_models()
