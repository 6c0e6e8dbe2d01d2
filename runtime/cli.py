"""The `specrl` command line.

The parsers live here so the whole interface is visible in one place; every implementation is imported
lazily, so `specrl validate` and `specrl operator` never import torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Callable

# subcommand -> "module:function"; the function takes the parsed argparse.Namespace and returns an exit code.
HANDLERS: dict[str, str] = {
    "run": "specrl.runtime.local:main",
    "validate": "specrl.runtime.validate:main",
    "crd": "specrl.runtime.crd:main",
    "operator": "specrl.operator.main:main",
    "bench rollout": "specrl.runtime.bench.rollout:main",
    "bench sync": "specrl.runtime.bench.sync:main",
    "simulate": "specrl.runtime.sim.cli:main",
    "worker": "specrl.runtime.worker:main",
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specrl", description="Elastic, speculative RL jobs on Kubernetes.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = sub.add_parser("run", help="run an RLJob locally (Ray on this machine, CPU by default)")
    p.add_argument("job", help="RLJob YAML file")
    p.add_argument("--out", default=None, help="output folder (default: runs/<job name>)")
    p.add_argument("--steps", type=int, default=None, help="override spec.algorithm.steps")
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of the live display")

    p = sub.add_parser("validate", help="validate RLJob YAML files (exit 2 on any problem)")
    p.add_argument("files", nargs="+", metavar="FILE")

    p = sub.add_parser("crd", help="print the RLJob CustomResourceDefinition generated from the API models")
    p.add_argument("--check", action="store_true", help="exit 1 when crds/ or the chart's copy is stale")
    p.add_argument("--write", action="store_true", help="rewrite crds/ and the chart's copy")

    p = sub.add_parser("operator", help="run the kopf operator that reconciles RLJobs")
    ns = p.add_mutually_exclusive_group()
    ns.add_argument("--namespace", "-n", action="append", dest="namespaces", metavar="NS",
                    help="watch this namespace (repeatable); default: all namespaces")
    ns.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (the default)")
    p.add_argument("--coordinator-url-template", default="http://{name}-coordinator.{namespace}.svc:8000",
                   help="URL of a job's coordinator; {name} and {namespace} are filled in")
    p.add_argument("--metrics-port", type=int, default=8080, help="Prometheus /metrics port (0 disables)")
    p.add_argument("--health-port", type=int, default=8081, help="liveness endpoint port (0 disables)")
    p.add_argument("--peering", default=None, help="kopf peering name for hot standby (default: standalone)")
    p.add_argument("--poll-interval", type=float, default=10.0, help="seconds between coordinator polls")
    p.add_argument("--verbose", "-v", action="store_true")

    bench = sub.add_parser("bench", help="benchmarks").add_subparsers(dest="bench", metavar="WHAT", required=True)
    for name, text in (("rollout", "speculative rollout engine vs AR and HF"), ("sync", "weight sync vs loopback")):
        b = bench.add_parser(name, help=text)
        b.add_argument("--quick", action="store_true", help="smaller workload, for smoke tests")
        b.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
        b.add_argument("--repeats", type=int, default=None, help="repetitions (median is reported)")

    p = sub.add_parser("simulate", help="simulate an RL job at cluster scale")
    p.add_argument("scenario", nargs="?", default=None, help="scenario YAML")
    p.add_argument("--preset", default=None, help="a built-in scenario (see --list)")
    p.add_argument("--list", action="store_true", help="list presets")
    p.add_argument("--json", default=None, metavar="FILE")
    p.add_argument("--plot", default=None, metavar="PNG", help="write a timeline plot")
    p.add_argument("--from-bench", default=None, metavar="JSON",
                   help="predict the SD speedups `specrl bench rollout --json` measured, from its measured costs")

    p = sub.add_parser("worker", help="pod entrypoint of a job's coordinator, trainer or rollout worker")
    p.add_argument("role", choices=["coordinator", "trainer", "rollout"])
    p.add_argument("--config", required=True, help="resolved job config (the ConfigMap's job.yaml)")
    return parser


def _resolve(command: str) -> Callable[[argparse.Namespace], int]:
    module_name, func = HANDLERS[command].split(":")
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as exc:
        if exc.name and (exc.name == module_name or module_name.startswith(exc.name + ".")):
            raise SystemExit(f"specrl {command}: not available in this build ({module_name} is missing)") from None
        raise SystemExit(
            f"specrl {command}: missing dependency {exc.name!r}; install the runtime extra: pip install 'specrl[runtime]'"
        ) from None
    return getattr(module, func)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = f"bench {args.bench}" if args.command == "bench" else args.command
    try:
        return int(_resolve(command)(args) or 0)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
