"""Pod entrypoints: `specrl worker coordinator|trainer|rollout --config FILE`.

The coordinator pod is the Ray head and runs the job's `JobCoordinator` (HTTP API on port 8000). Trainer and
rollout pods join its Ray cluster as worker nodes that advertise two custom resources: the role
(`specrl_trainer` / `specrl_rollout`) and the pod itself (`specrl_pod_<pod name>`); the coordinator pins each
worker actor to its pod through the second one, so `POST /drain {"worker": "<pod name>"}` names exactly one
actor. Rollout pods that appear later join at the next step boundary; pods that disappear have their prompts
requeued.

Environment (set by the operator in every pod; all optional locally except where noted):

=============================  ==================================================================================
`SPECRL_JOB`                   job name (metric label; worker names are `{job}-{role}-{index}`)
`SPECRL_NAMESPACE`             namespace (metric label)
`SPECRL_ROLE`                  coordinator | trainer | rollout (the CLI argument wins)
`SPECRL_WORKER`                this pod's name, e.g. `myjob-rollout-3` (required for trainer/rollout)
`SPECRL_WORKER_INDEX`          index within the role
`SPECRL_CONFIG`                the resolved job YAML (default for `--config`), /etc/specrl/job.yaml
`SPECRL_COORDINATOR_ADDR`      host:port of the coordinator Service (HTTP; workers wait for its /healthz)
`SPECRL_RAY_ADDRESS`           host:6379 of the coordinator's Ray head (required for trainer/rollout)
`SPECRL_COORDINATOR_TOKEN`     bearer token that protects POST /drain (from the job's Secret)
`SPECRL_SYNC_MASTER_ADDR`      trainer-0's stable DNS name (for tools; the sender hosts the store at its own
                               address, since after an elastic change rank 0 may be another trainer pod)
`SPECRL_SYNC_MASTER_PORT`      port the weight-sync store listens on in the sending trainer pod (declared on
                               the pod and the headless Service; without it a free port is used)
`SPECRL_CONNECT_TIMEOUT`       seconds a worker keeps retrying the coordinator before it gives up (default 300)
`SPECRL_HTTP_PORT`             coordinator HTTP port (default 8000)
`SPECRL_RAY_HEAD_PORT`         coordinator's Ray head port (default 6379)
=============================  ==================================================================================
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

log = logging.getLogger(__name__)

HEAD_PORT = 6379
HTTP_PORT = 8000


class WorkerError(Exception):
    """A configuration or connection problem, reported in one line with exit status 1."""


def backoff_delays(total_s: float, first: float = 0.5, factor: float = 2.0, cap: float = 10.0) -> list[float]:
    """Sleeps between connection attempts: exponential from `first`, capped, summing to at most `total_s`."""
    out, spent, d = [], 0.0, first
    while spent + d <= total_s:
        out.append(d)
        spent += d
        d = min(cap, d * factor)
    return out


def _split_addr(addr: str, what: str) -> tuple[str, int]:
    host, sep, port = addr.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise WorkerError(f"{what}: expected host:port, got {addr!r}")
    return host, int(port)


def wait_for_coordinator(coordinator_addr: str | None, ray_addr: str, timeout_s: float) -> None:
    """Retry with backoff until the coordinator answers (HTTP /healthz, else the Ray head's TCP port)."""
    ray_host, ray_port = _split_addr(ray_addr, "SPECRL_RAY_ADDRESS")
    last = ""
    for delay in [0.0, *backoff_delays(timeout_s)]:
        time.sleep(delay)
        try:
            if coordinator_addr:
                with urllib.request.urlopen(f"http://{coordinator_addr}/healthz", timeout=3) as r:
                    if r.status != 200:
                        raise OSError(f"/healthz answered {r.status}")
            with socket.create_connection((ray_host, ray_port), timeout=3):
                return
        except (OSError, urllib.error.URLError) as exc:
            last = str(getattr(exc, "reason", exc))
            log.info("coordinator not reachable yet (%s); retrying", last)
    where = f"{coordinator_addr} (HTTP) / {ray_addr} (Ray)" if coordinator_addr else ray_addr
    raise WorkerError(f"coordinator unreachable at {where} after {timeout_s:.0f}s: {last}")


def _ray_cli() -> str:
    exe = Path(sys.executable).with_name("ray")
    return str(exe) if exe.exists() else (shutil.which("ray") or "ray")


def _load(config: str):
    from specrl.runtime.api import JobValidationError, load_job
    from specrl.runtime.rl.settings import RunSettings

    if not Path(config).is_file():
        raise WorkerError(f"--config: no such file {config!r}")
    try:
        job = load_job(config)
        return RunSettings.from_job(job)
    except JobValidationError as exc:
        raise WorkerError(str(exc)) from None


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    role = args.role
    try:
        if role == "coordinator":
            return run_coordinator(args.config)
        return run_member(role, args.config)
    except WorkerError as exc:
        print(f"specrl worker {role}: {exc}", file=sys.stderr)
        return 1


def run_member(role: str, config: str) -> int:
    """Join the coordinator's Ray cluster as a node offering this pod's resources; block until stopped."""
    name = os.environ.get("SPECRL_WORKER")
    if not name:
        raise WorkerError("SPECRL_WORKER (this pod's name) is not set")
    ray_addr = os.environ.get("SPECRL_RAY_ADDRESS")
    if not ray_addr:
        raise WorkerError("SPECRL_RAY_ADDRESS (host:6379 of the coordinator) is not set")
    settings = _load(config)
    timeout = float(os.environ.get("SPECRL_CONNECT_TIMEOUT", "300"))
    wait_for_coordinator(os.environ.get("SPECRL_COORDINATOR_ADDR"), ray_addr, timeout)
    from specrl.runtime.coordinator import pod_resource, role_resource

    resources = {role_resource(role): 1, pod_resource(name): 1}
    cmd = [_ray_cli(), "start", f"--address={ray_addr}", f"--resources={json.dumps(resources)}", "--block",
           "--disable-usage-stats"]
    log.info("joining %s as %s (%s): %s", ray_addr, name, settings.job, " ".join(cmd))
    return subprocess.call(cmd)


def run_coordinator(config: str) -> int:
    """Be the Ray head, wait for the initial workers, run the job, keep serving /status until terminated."""
    settings = _load(config)
    import ray
    from specrl.runtime.coordinator import JobCoordinator, Placement, latest_checkpoint, members_from_nodes

    port = int(os.environ.get("SPECRL_RAY_HEAD_PORT", HEAD_PORT))
    subprocess.check_call([_ray_cli(), "start", "--head", f"--port={port}", "--num-cpus=0",
                           "--include-dashboard=false", "--disable-usage-stats",
                           f"--resources={json.dumps({'specrl_coordinator': 1})}"])
    ray.init(address=f"127.0.0.1:{port}")
    token = os.environ.get("SPECRL_COORDINATOR_TOKEN") or None
    if token is None:
        log.warning("SPECRL_COORDINATOR_TOKEN is not set: POST /drain will refuse every request")
    coord = JobCoordinator(settings, token=token or "", placement=Placement(cluster=True), http_host="0.0.0.0",
                           http_port=int(os.environ.get("SPECRL_HTTP_PORT", HTTP_PORT)),
                           resume_from=latest_checkpoint(settings.checkpoint_dir))  # a restarted pod resumes
    stop = {"flag": False}
    signal.signal(signal.SIGTERM, lambda *_: stop.update(flag=True))
    deadline = time.monotonic() + float(os.environ.get("SPECRL_CONNECT_TIMEOUT", "600"))
    while True:
        members = members_from_nodes(ray.nodes(), settings.job)
        trainers = [n for n, r in members if r == "trainer"]
        rollouts = [n for n, r in members if r == "rollout"]
        if len(trainers) >= settings.trainers and rollouts:
            break
        if time.monotonic() > deadline or stop["flag"]:
            coord.set_phase_failed("workers did not join")
            raise WorkerError(f"only {len(trainers)}/{settings.trainers} trainer(s) and {len(rollouts)} rollout "
                              "worker(s) joined the Ray cluster in time")
        time.sleep(2)
    coord.start(trainers[: settings.trainers], rollouts)
    try:
        coord.run()
    except Exception as exc:
        coord.set_phase_failed(f"{type(exc).__name__}: {exc}")
        log.exception("job failed")
        while not stop["flag"]:  # keep /status answering Failed for the operator
            time.sleep(1)
        return 1
    while not stop["flag"]:  # Complete: keep answering /status until the operator tears the job down
        time.sleep(1)
    coord.shutdown()
    return 0
