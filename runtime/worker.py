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
`SPECRL_RAY_START_ARGS`        extra options for this pod's `ray start` (shell words; default none). A pod is a
                               host of its own; several Ray nodes on one machine (tests) need distinct
                               `--temp-dir`, `--dashboard-agent-listen-port`, ... per node
=============================  ==================================================================================

Ray authentication is the same on every node of the job: token authentication with the job's token
(`SPECRL_COORDINATOR_TOKEN`, which every pod gets) as the Ray token, or explicitly disabled where there is no token.
Ray's own default depends on the node's home directory (a `~/.ray/auth_token` left by a local `ray.init` switches
a head to token mode, while joining nodes and drivers do not send one), so a head could refuse its own workers.
`RAY_AUTH_MODE` set in the environment wins.

Shutdown: SIGTERM ends every process a pod started, at once (Ray's own node drain on SIGTERM is off unless
`RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S` is set; POST /drain is the job's graceful path). The coordinator stops its
job (exit 143 when it was still running, 0 once complete), then the Ray head it runs as a child; a trainer or
rollout pod *is* `ray start --block` (exec), whose SIGTERM handler stops its node.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

if TYPE_CHECKING:
    from .rl.settings import RunSettings

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


# A DNS name or an IPv4 address, or an IPv6 address in brackets: what can stand before `:port` in a URL.
HOST = re.compile(r"[A-Za-z0-9._-]+|\[[0-9A-Fa-f:.]+\]")


def _addr_problem(addr: str) -> str | None:
    """Why `addr` is not host:port, if it is not: checked up front, since a bad one would otherwise be a URL
    error traceback, or be retried as `connection refused` for the whole connect timeout."""
    host, sep, port = addr.rpartition(":")
    if not sep or not HOST.fullmatch(host) or not port.isdigit():
        return f"expected host:port, got {addr!r}"
    if not 1 <= int(port) <= 65535:
        return f"port must be in 1..65535, got {addr!r}"
    return None


def _split_addr(addr: str, what: str) -> tuple[str, int]:
    if problem := _addr_problem(addr):
        raise WorkerError(f"{what}: {problem}")
    host, _sep, port = addr.rpartition(":")
    return host, int(port)


# WorkerEnv field -> the environment variable it is read from
ENV_VARS = {"connect_timeout": "SPECRL_CONNECT_TIMEOUT", "coordinator_addr": "SPECRL_COORDINATOR_ADDR",
            "ray_address": "SPECRL_RAY_ADDRESS", "ray_head_port": "SPECRL_RAY_HEAD_PORT",
            "http_port": "SPECRL_HTTP_PORT"}


class WorkerEnv(BaseModel):
    """The SPECRL_* settings of the table above that are numbers or addresses, validated before the pod starts
    anything. An empty variable counts as unset (a Kubernetes env entry without a value)."""

    model_config = ConfigDict(frozen=True, allow_inf_nan=False)

    connect_timeout: float | None = Field(None, gt=0, le=86_400, description="None: the role's default")
    coordinator_addr: str | None = None
    ray_address: str | None = None
    ray_head_port: int = Field(HEAD_PORT, ge=1, le=65535)
    http_port: int = Field(HTTP_PORT, ge=1, le=65535)

    @field_validator("coordinator_addr", "ray_address")
    @classmethod
    def _host_port(cls, addr: str | None) -> str | None:
        if addr is not None and (problem := _addr_problem(addr)):
            raise ValueError(problem)
        return addr

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> WorkerEnv:
        values: dict[str, Any] = {field: env[var] for field, var in ENV_VARS.items() if env.get(var)}
        try:
            return cls.model_validate(values)
        except ValidationError as exc:
            err = exc.errors(include_url=False)[0]
            var = ENV_VARS[str(err["loc"][0])]
            if err["type"] == "value_error":
                raise WorkerError(f"{var}: {err['ctx']['error']}") from None
            msg = err["msg"].replace("Input should be", "must be")
            raise WorkerError(f"{var}: {msg}, got {env[var]!r}") from None


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


def _extra_ray_args() -> list[str]:
    try:
        return shlex.split(os.environ.get("SPECRL_RAY_START_ARGS", ""))
    except ValueError as exc:
        raise WorkerError(f"SPECRL_RAY_START_ARGS: {exc}") from None


def pin_ray_auth(env: dict[str, str]) -> dict[str, str]:
    """The Ray auth settings every process of the job must share (see the module docstring); `env` unchanged.

    Returns the variables to add: token mode with the job token when there is one, else auth disabled.
    """
    if env.get("RAY_AUTH_MODE"):
        return {}
    token = env.get("SPECRL_COORDINATOR_TOKEN", "")
    if not token:
        return {"RAY_AUTH_MODE": "disabled"}
    out = {"RAY_AUTH_MODE": "token"}
    if not env.get("RAY_AUTH_TOKEN") and not env.get("RAY_AUTH_TOKEN_PATH"):
        out["RAY_AUTH_TOKEN"] = token
    return out


def _load(config: str) -> RunSettings:
    from .api import JobValidationError, load_job
    from .rl.settings import RunSettings

    if not Path(config).is_file():
        raise WorkerError(f"--config: no such file {config!r}")
    try:
        job = load_job(config)
        return RunSettings.from_job(job)
    except JobValidationError as exc:
        raise WorkerError(str(exc)) from None


def _preflight(settings: RunSettings, config: str) -> None:
    """The model-side checks `specrl run` makes, in the pod that loads the model, before it joins the cluster:
    a missing model, a tokenizer or draft vocabulary that does not fit, or a dtype this pod's device cannot run
    is one line in this pod's log (and a failed pod), not an actor traceback in the coordinator's. A hub model
    is downloaded here, into the pod's cache (a shared cache volume keeps it for the pods that follow)."""
    from .models.hub import preflight

    try:
        preflight(settings)
    except ValueError as exc:
        raise WorkerError(f"{config}: {exc}") from None


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    role = args.role
    # Before anything imports ray: the coordinator's driver and every `ray start` child read it from here.
    os.environ.update(pin_ray_auth(dict(os.environ)))
    # Ray drains a node on SIGTERM for up to 30 s, waiting for its leases (and for the GCS, the whole 30 s when
    # the head went first). The job's graceful path is the coordinator's POST /drain before a pod is deleted;
    # a pod that gets SIGTERM stops now instead of running into the kubelet's SIGKILL.
    os.environ.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
    try:
        env = WorkerEnv.from_env(os.environ)
        if role == "coordinator":
            return run_coordinator(args.config, env)
        return run_member(role, args.config, env)
    except WorkerError as exc:
        print(f"specrl worker {role}: {exc}", file=sys.stderr)
        return 1


def run_member(role: str, config: str, env: WorkerEnv | None = None) -> int:
    """Join the coordinator's Ray cluster as a node offering this pod's resources; block until stopped."""
    env = env or WorkerEnv.from_env(os.environ)
    name = os.environ.get("SPECRL_WORKER")
    if not name:
        raise WorkerError("SPECRL_WORKER (this pod's name) is not set")
    ray_addr = env.ray_address
    if not ray_addr:
        raise WorkerError("SPECRL_RAY_ADDRESS (host:6379 of the coordinator) is not set")
    settings = _load(config)
    _preflight(settings, config)
    timeout = env.connect_timeout if env.connect_timeout is not None else 300.0
    wait_for_coordinator(env.coordinator_addr, ray_addr, timeout)
    from .coordinator import pod_resource, role_resource

    resources = {role_resource(role): 1, pod_resource(name): 1}
    cmd = [_ray_cli(), "start", f"--address={ray_addr}", f"--resources={json.dumps(resources)}", "--block",
           "--disable-usage-stats", *_extra_ray_args()]
    log.info("joining %s as %s (%s): %s", ray_addr, name, settings.job, " ".join(cmd))
    logging.shutdown()
    # exec, not a child: SIGTERM must reach `ray start --block`, whose handler stops the raylet and its workers.
    # A Python parent would die on it (or, as PID 1 in the container, ignore it) and leave the node running.
    os.execvp(cmd[0], cmd)
    return 1  # not reached


class _Terminated(BaseException):
    """SIGTERM while the job runs: unwinds `coord.run()` to the cleanup (a BaseException, so that no
    `except Exception` on the way swallows it)."""


def _start_head(port: int, timeout_s: float = 120.0) -> subprocess.Popen:
    """`ray start --head --block` as a child, so that this process can stop the head it started."""
    cmd = [_ray_cli(), "start", "--head", f"--port={port}", "--num-cpus=0", "--include-dashboard=false",
           "--disable-usage-stats", f"--resources={json.dumps({'specrl_coordinator': 1})}", "--block",
           *_extra_ray_args()]
    log.info("starting the Ray head: %s", " ".join(cmd))
    head = subprocess.Popen(cmd)
    deadline = time.monotonic() + timeout_s
    while True:
        if head.poll() is not None:
            raise WorkerError(f"the Ray head (ray start --head) exited with status {head.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=1):
                return head  # GCS listens; ray.init waits for the head's raylet itself
        except OSError:
            if time.monotonic() > deadline:
                _stop_head(head)
                raise WorkerError(f"the Ray head did not listen on port {port} within {timeout_s:.0f}s") from None
            time.sleep(0.5)


def _stop_head(head: subprocess.Popen, timeout_s: float = 60.0) -> None:
    """SIGTERM: `ray start --block` stops GCS, raylet and agents; SIGKILL only if it hangs (its children
    share its fate through the kernel's parent-death signal)."""
    if head.poll() is None:
        head.terminate()
        try:
            head.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("the Ray head did not stop within %.0fs; killing it", timeout_s)
            head.kill()
            head.wait()


def run_coordinator(config: str, env: WorkerEnv | None = None) -> int:
    """Be the Ray head, wait for the initial workers, run the job, keep serving /status until terminated.

    Exit status: 0 after a complete job (the operator marks the job Complete), 1 when it failed or the workers
    never came, 143 when SIGTERM interrupted it (a failure the operator retries from the last checkpoint).
    """
    env = env or WorkerEnv.from_env(os.environ)
    settings = _load(config)
    stop = {"flag": False, "running": False}

    def on_sigterm(*_: object) -> None:
        stop["flag"] = True
        if stop["running"]:
            raise _Terminated()

    signal.signal(signal.SIGTERM, on_sigterm)
    port = env.ray_head_port
    head = _start_head(port)
    try:
        return _coordinate(settings, env, stop, on_sigterm)
    finally:
        import ray

        if ray.is_initialized():
            ray.shutdown()
        _stop_head(head)


def _coordinate(settings: RunSettings, env: WorkerEnv, stop: dict[str, bool], on_sigterm: Callable[..., None]) -> int:
    import ray

    from .coordinator import JobCoordinator, Placement, members_from_nodes

    ray.init(address=f"127.0.0.1:{env.ray_head_port}")
    # ray.init installs its own SIGTERM handler (sys.exit(15)): ours must come back, or a complete job exits 15.
    signal.signal(signal.SIGTERM, on_sigterm)
    token = os.environ.get("SPECRL_COORDINATOR_TOKEN") or None
    if token is None:
        log.warning("SPECRL_COORDINATOR_TOKEN is not set: POST /drain will refuse every request")
    placement = Placement(cluster=True, gpus_per_pod=settings.gpus_per_pod)
    # a restarted pod resumes: start() asks trainer rank 0 for the newest checkpoint
    coord = JobCoordinator(settings, token=token or "", placement=placement, http_host="0.0.0.0",
                           http_port=env.http_port)
    try:
        deadline = time.monotonic() + (env.connect_timeout if env.connect_timeout is not None else 600.0)
        while True:
            members = members_from_nodes(ray.nodes(), settings.job)
            trainers = [m.name for m in members if m.role == "trainer"]
            rollouts = [m.name for m in members if m.role == "rollout"]
            if len(trainers) >= settings.trainers and rollouts:
                break
            if time.monotonic() > deadline or stop["flag"]:
                coord.set_phase_failed("workers did not join")
                raise WorkerError(f"only {len(trainers)}/{settings.trainers} trainer(s) and {len(rollouts)} "
                                  "rollout worker(s) joined the Ray cluster in time")
            time.sleep(2)
        stop["running"] = True
        if stop["flag"]:  # SIGTERM between the check above and here
            raise _Terminated()
        try:
            coord.start(trainers[: settings.trainers], rollouts, {m.name: m.node_id for m in members})
            coord.run()
        except Exception as exc:
            stop["running"] = False
            coord.set_phase_failed(f"{type(exc).__name__}: {exc}")
            log.exception("job failed")
            while not stop["flag"]:  # keep /status answering Failed for the operator
                time.sleep(1)
            return 1
        stop["running"] = False
        log.info("job %s complete after %d step(s); serving /status until terminated", settings.job, coord.step)
        while not stop["flag"]:  # Complete: keep answering /status until the operator tears the job down
            time.sleep(1)
        return 0
    except _Terminated:
        stop["running"] = False
        if coord.complete:  # SIGTERM landed just after the last step: the job is done all the same
            return 0
        log.warning("SIGTERM while the job ran (step %d): stopping", coord.step)
        return 128 + signal.SIGTERM
    finally:
        stop["running"] = False
        coord.shutdown()
