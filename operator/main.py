"""``specrl operator``: run the RLJob operator (kopf) with settings chosen on purpose.

The arguments are parsed in :mod:`specrl.runtime.cli`; :func:`main` receives them. Settings and why:

* **standalone** unless ``--peering NAME``: one replica (Deployment ``strategy: Recreate``) is the normal
  set-up. High availability (the chart's ``replicaCount`` > 1): every replica runs with ``--peering NAME``
  against a ``ClusterKopfPeering`` (all namespaces) or one ``KopfPeering`` per watched namespace of that name,
  which the chart creates; each instance gets a random priority, the highest one serves, the others wait and
  take over when the leader's heartbeat (60 s lifetime) stops. ``mandatory``: a replica whose peering object
  is missing refuses to run rather than reconcile unpeered next to another one.
* **default job image** ``--default-job-image`` (the chart's ``jobImage``): the image of jobs whose
  ``spec.resources.image`` is empty, e.g. an air-gapped mirror.
* **progress and diff-base in status** (``status.kopf``): kopf's bookkeeping rides on the status patch the
  operator sends anyway, instead of an extra metadata patch per change.
* **finalizer** ``specrl.io/operator`` (needed because each job has a timer; removed once the timer stops,
  which kopf re-checks every 2 s instead of its default 60 s).
* **events**: kopf's own per-handler chatter is off (posting level WARNING); the operator posts its own
  Events on every phase/condition transition, rebalance and pod failure.
* **watch timeouts**: the server closes a watch after 300 s and the client gives up after 330 s, so a
  silently stalled stream (load balancers, kopf #698) is re-established; API requests time out after 30 s.
* **liveness**: ``GET http://0.0.0.0:<--health-port>/healthz`` (kopf's probe endpoint, includes job count).
* **graceful shutdown**: SIGTERM/SIGINT stop the watches, cancel timers (a move in flight is resumed by the
  next operator from ``status.pendingMove``), and exit; a stuck shutdown is forced after 30 s.
* **metrics**: Prometheus ``/metrics`` on ``--metrics-port`` (``specrl_operator_*``).
"""

from __future__ import annotations

import argparse
import gc
import logging
import os
import random
import socket
import sys

import kopf
import yaml

from . import handlers
from . import metrics as m
from .children import DEFAULT_JOB_IMAGE_ENV
from .reconcile import OperatorConfig

FINALIZER = "specrl.io/operator"


def settings(args: argparse.Namespace) -> kopf.OperatorSettings:
    s = kopf.OperatorSettings()
    s.persistence.finalizer = FINALIZER
    s.persistence.progress_storage = kopf.StatusProgressStorage(field="status.kopf.progress")
    s.persistence.diffbase_storage = kopf.StatusDiffBaseStorage(field="status.kopf.last-handled-configuration")
    s.posting.level = logging.WARNING
    s.watching.server_timeout = 300
    s.watching.client_timeout = 330
    s.watching.connect_timeout = 10
    s.networking.request_timeout = 30
    s.networking.connect_timeout = 10
    s.process.ultimate_exiting_timeout = 30
    # A timer that is mid-tick when its job is deleted: re-check every 2 s (not kopf's 60 s) so that the
    # finalizer is released promptly; ticks are short unless a drain is in flight.
    s.background.cancellation_polling = 2
    s.peering.standalone = args.peering is None
    if args.peering is not None:
        s.peering.name = args.peering
        s.peering.mandatory = True
        s.peering.clusterwide = not args.namespaces
        s.peering.priority = random.randint(1, 10_000)  # equal priorities would freeze both instances
    return s


SERVICE_ACCOUNT_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


def credentials_problem() -> str | None:
    """Why the operator could not log in, checked before kopf starts (kopf would retry forever)."""
    if os.path.exists(SERVICE_ACCOUNT_TOKEN):
        return None
    env = os.environ.get("KUBECONFIG")
    paths = [p for p in (env or "").split(os.pathsep) if p] or [os.path.expanduser("~/.kube/config")]
    if not env and not os.path.exists(paths[0]):
        return "no Kubernetes credentials: run in a cluster (service account) or set KUBECONFIG"
    for path in paths:
        try:
            with open(os.path.expanduser(path), encoding="utf-8") as f:
                doc = yaml.safe_load(f) or {}
        except OSError as exc:
            return f"cannot read kubeconfig {path}: {exc.strerror or exc}"
        except UnicodeDecodeError as exc:
            return f"kubeconfig {path} is not UTF-8 text ({exc.reason} at byte {exc.start})"
        except yaml.YAMLError as exc:
            return f"kubeconfig {path} is not valid YAML: {str(exc).splitlines()[0]}"
        if not isinstance(doc, dict) or not doc.get("clusters"):
            return f"kubeconfig {path} defines no clusters"
    return None


def api_server() -> str | None:
    """The API server the operator talks to (for messages): in the cluster, the service's; else the kubeconfig's
    current context's cluster."""
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST"), os.environ.get("KUBERNETES_SERVICE_PORT")
    if os.path.exists(SERVICE_ACCOUNT_TOKEN) and host:
        return f"https://{host}:{port or 443}"
    path = next((p for p in os.environ.get("KUBECONFIG", "").split(os.pathsep) if p), "~/.kube/config")
    try:
        with open(os.path.expanduser(path), encoding="utf-8") as f:
            doc = yaml.safe_load(f)
        context = next(c["context"] for c in doc["contexts"] if c["name"] == doc["current-context"])
        return str(next(c["cluster"]["server"] for c in doc["clusters"] if c["name"] == context["cluster"]))
    except (OSError, ValueError, yaml.YAMLError, KeyError, TypeError, StopIteration):
        return None  # only a message loses its detail: kopf itself reported what it could not read


def unreachable_line(exc: OSError, server: str | None) -> str:
    """The last line of an operator that gave up on the API server after kopf's retries (kopf has logged each)."""
    host, port = getattr(exc, "host", None), getattr(exc, "port", None)
    where = server or (f"{host}:{port}" if host else "(unknown address)")
    reason = exc.strerror or str(exc) or type(exc).__name__
    return f"Kubernetes API server {where} unreachable: {reason}"


class _NoConnectionTracebacks(logging.Filter):
    """Without --verbose, a connection failure is logged as its one message line: kopf logs a traceback when it
    gives up, and asyncio another per orphaned task, for what the line already says (`Connect call failed`)."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.exc_info and isinstance(record.exc_info[1], OSError):
            if record.name == "asyncio":
                return False  # "Task exception was never retrieved": a copy of what kopf logged
            record.exc_info, record.exc_text = None, None
        return True


def port_problem(port: int) -> str | None:
    """Why this process cannot listen on `port` (another process does), checked before kopf starts: kopf would
    report it as a traceback only once it runs."""
    if not port:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as aiohttp does: TIME_WAIT is no conflict
        try:
            sock.bind(("0.0.0.0", port))
        except OSError as exc:
            return exc.strerror or str(exc)
    return None


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        stream=sys.stderr,
    )
    if not args.verbose:
        logging.getLogger("aiohttp.access").setLevel(logging.WARNING)
        for handler in logging.getLogger().handlers:
            handler.addFilter(_NoConnectionTracebacks())
    if args.metrics_port and args.metrics_port == args.health_port:
        print(f"specrl operator: --health-port: must differ from --metrics-port (both {args.health_port})",
              file=sys.stderr)
        return 2
    try:
        args.coordinator_url_template.format(name="job", namespace="ns")
    except (KeyError, IndexError, ValueError) as exc:
        print(f"specrl operator: --coordinator-url-template: only {{name}} and {{namespace}} may be filled in ({exc})",
              file=sys.stderr)
        return 2
    if args.default_job_image is not None:
        if not args.default_job_image.strip() or any(c.isspace() for c in args.default_job_image):
            print(f"specrl operator: --default-job-image: not an image reference: {args.default_job_image!r}",
                  file=sys.stderr)
            return 2
        # Read by children.image_of when a job names no image (the chart's `jobImage`).
        os.environ[DEFAULT_JOB_IMAGE_ENV] = args.default_job_image
    problem = credentials_problem()
    if problem:
        print(f"specrl operator: {problem}", file=sys.stderr)
        return 1
    config = OperatorConfig(coordinator_url_template=args.coordinator_url_template, poll_interval=args.poll_interval,
                            drain_poll=min(1.0, args.poll_interval))
    registry = kopf.OperatorRegistry()
    handlers.register(registry, config)
    if problem := port_problem(args.health_port):
        print(f"specrl operator: --health-port {args.health_port}: {problem}", file=sys.stderr)
        return 1
    try:
        m.serve(args.metrics_port)
    except OSError as exc:
        print(f"specrl operator: --metrics-port {args.metrics_port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    namespaces = list(args.namespaces or [])
    try:
        kopf.run(
            registry=registry,
            settings=settings(args),
            standalone=args.peering is None,
            peering_name=args.peering,
            liveness_endpoint=f"http://0.0.0.0:{args.health_port}/healthz" if args.health_port else None,
            clusterwide=not namespaces,
            namespaces=namespaces,
        )
    except OSError as exc:  # aiohttp's connection errors, timeouts: kopf has retried and logged each attempt
        gc.collect()  # orphaned kopf tasks log their copy of the error now, not after the line below
        print(f"specrl operator: {unreachable_line(exc, api_server())}", file=sys.stderr)
        return 1
    return 0
