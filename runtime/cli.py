"""The `specrl` command line.

The parsers live here so the whole interface is visible in one place; every implementation is imported
lazily, so `specrl validate`, `specrl crd`, `specrl simulate` and `specrl operator` never import torch and work
on the base install (`pip install specrl`).

Exit codes, the same for every subcommand (as kubectl and helm do):
  0  success
  1  failure: invalid input (an RLJob, a scenario, a file that cannot be read), a failed run, a missing extra
  2  usage error: the command line itself is wrong (unknown option, bad value, conflicting options)
  130 interrupted (Ctrl-C); a worker pod stopped by SIGTERM in the middle of a job exits 143 (128 + SIGTERM)

Adding a subcommand: a parser block in `build_parser` and one entry in `HANDLERS` (plus `RUNTIME_COMMANDS` when
it needs torch).
"""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import math
import sys
from collections.abc import Callable
from typing import TypeVar

EXIT_OK, EXIT_FAILURE, EXIT_USAGE = 0, 1, 2

EXIT_CODES = "exit codes: 0 success, 1 failure (invalid input, failed run), 2 usage error, 130 interrupted (Ctrl-C)"

# subcommand -> "module:function"; the function takes the parsed argparse.Namespace and returns an exit code.
HANDLERS: dict[str, str] = {
    "run": "specrl.runtime.local:main",
    "validate": "specrl.runtime.validate:main",
    "crd": "specrl.runtime.crd:main",
    "operator": "specrl.operator.main:main",
    "bench rollout": "specrl.runtime.bench.rollout:main",
    "bench sync": "specrl.runtime.bench.sync:main",
    "bench prefetch": "specrl.runtime.bench.prefetch:main",
    "bench policy": "specrl.runtime.bench.policy:main",
    "simulate": "specrl.runtime.sim.cli:main",
    "worker": "specrl.runtime.worker:main",
    "export": "specrl.runtime.models.export:main",
}

# Subcommands that need the `runtime` extra; checked before the handler is imported, so that a base install
# gets one line instead of an ImportError from deep inside.
RUNTIME_COMMANDS = frozenset({"run", "bench rollout", "bench sync", "bench prefetch", "bench policy", "worker"})
# Top-level modules of the runtime extra (pyproject.toml [project.optional-dependencies] runtime).
RUNTIME_MODULES = ("torch", "transformers", "safetensors", "ray", "scipy", "matplotlib")
RUNTIME_HINT = "install the runtime extra: pip install 'specrl[runtime]'"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("specrl")
    except PackageNotFoundError:
        return "unknown (not installed)"


N = TypeVar("N", int, float)


def _number(text: str, cast: Callable[[str], N], kind: str) -> N:
    """`text` as an int or float; anything else is a usage error naming what was expected."""
    try:
        return cast(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be {kind}, got {text!r}") from None


def positive_int(text: str) -> int:
    """argparse type: an integer >= 1 (a bad value is a usage error, exit 2)."""
    value = _number(text, int, "an integer")
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def job_steps(text: str) -> int:
    """argparse type of `run --steps`: an override of spec.algorithm.steps, validated by that very field, so the
    command line cannot run a job the spec itself would reject."""
    value = positive_int(text)
    from pydantic import ValidationError

    from .api import AlgorithmSpec

    try:
        AlgorithmSpec.model_validate({"steps": value})
    except ValidationError as exc:
        msg = exc.errors(include_url=False)[0]["msg"].replace("Input should be", "must be")
        raise argparse.ArgumentTypeError(f"{msg} (the bound of spec.algorithm.steps), got {value}") from None
    return value


def positive_float(text: str) -> float:
    """argparse type: a finite number > 0 (nan, inf, 0 and negatives are usage errors)."""
    value = _number(text, float, "a number")
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a finite number > 0, got {text}")
    return value


def port(text: str) -> int:
    """argparse type: a TCP port, 0 meaning off."""
    value = _number(text, int, "an integer")
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"must be a port in 0..65535, got {value}")
    return value


def _command(sub: argparse._SubParsersAction, name: str, summary: str, description: str) -> argparse.ArgumentParser:
    """A subcommand whose --help starts with its own description and ends with the exit codes."""
    return sub.add_parser(name, help=summary, description=f"{summary}.\n\n{description}", epilog=EXIT_CODES,
                          formatter_class=argparse.RawDescriptionHelpFormatter)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specrl", description="Elastic, speculative RL post-training jobs on Kubernetes.",
        epilog=f"Run `specrl COMMAND --help` for a command's options.\n{EXIT_CODES}",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--version", action="version", version=f"specrl {_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    p = _command(sub, "run", "run an RLJob locally (Ray on this machine, CPU by default)",
                 "Runs the job's coordinator, trainer and rollout workers on a local Ray instance, the same code\n"
                 "path as the cluster. Writes OUT/summary.json, OUT/metrics.jsonl and PNG plots.\n"
                 "Needs the runtime extra: pip install 'specrl[runtime]'.")
    p.add_argument("job", metavar="JOB.yaml", help="RLJob YAML file holding exactly one RLJob")
    p.add_argument("--out", default=None, metavar="DIR", help="output folder (default: runs/<job name>)")
    p.add_argument("--steps", type=job_steps, default=None, metavar="N", help="override spec.algorithm.steps")
    p.add_argument("--no-progress", action="store_true", help="plain log lines instead of the live display")

    p = _command(sub, "validate", "validate RLJob YAML offline, the way the API server would",
                 "Prints one line per problem, FILE: NAME: FIELD.PATH: MESSAGE, and reports every problem it can\n"
                 "find in one pass (field types and bounds, unknown fields, cross-field rules of every part whose\n"
                 "own fields are valid). Reads files, directories (*.yaml, *.yml, *.json inside, recursively) and\n"
                 "- (standard input). Multi-document files and `kubectl get -o yaml` Lists are read; documents of\n"
                 "another kind (a Service beside the job) are skipped with a note, and so are a directory's files\n"
                 "holding only such documents (a file named on the command line, and a directory, must hold an\n"
                 "RLJob). A document without a kind is read as a broken RLJob, except in a directory's files when\n"
                 "it has neither metadata nor spec (a chart's values.yaml): that is skipped. Invalid RLJobs exit 1.")
    p.add_argument("files", nargs="+", metavar="FILE", help="YAML file, directory, or - for standard input")
    p.add_argument("-o", "--output", choices=("text", "json"), default="text",
                   help="text: one line per problem (default); json: one JSON object on stdout")

    p = _command(sub, "crd", "print the RLJob CustomResourceDefinition generated from the API models",
                 "The CRD is generated from runtime/api.py; crds/ and the chart's crds/ hold copies that are\n"
                 "never edited by hand.")
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="exit 1 when crds/ or the chart's copy is stale")
    mode.add_argument("--write", action="store_true", help="rewrite crds/ and the chart's copy")

    p = _command(sub, "operator", "run the kopf operator that reconciles RLJobs",
                 "Reconciles RLJobs into coordinator, trainer and rollout pods and moves GPUs between roles.\n"
                 "Credentials: the pod's service account, else KUBECONFIG or ~/.kube/config.")
    ns = p.add_mutually_exclusive_group()
    ns.add_argument("--namespace", "-n", action="append", dest="namespaces", metavar="NS",
                    help="watch this namespace (repeatable); default: all namespaces")
    ns.add_argument("--all-namespaces", "-A", action="store_true", help="watch every namespace (the default)")
    p.add_argument("--coordinator-url-template", default="http://{name}-coordinator.{namespace}.svc:8000",
                   metavar="T", help="URL of a job's coordinator; {name} and {namespace} are filled in")
    p.add_argument("--metrics-port", type=port, default=8080, metavar="PORT",
                   help="Prometheus /metrics port (0 disables)")
    p.add_argument("--health-port", type=port, default=8081, metavar="PORT",
                   help="liveness endpoint port (0 disables)")
    p.add_argument("--peering", default=None, metavar="NAME",
                   help="leader election through the kopf peering object NAME (run several replicas; "
                        "default: standalone, one replica)")
    p.add_argument("--default-job-image", default=None, metavar="IMAGE",
                   help="image of RLJob pods whose spec.resources.image is empty (e.g. an air-gapped mirror)")
    p.add_argument("--poll-interval", type=positive_float, default=10.0, metavar="SECONDS",
                   help="seconds between coordinator polls")
    p.add_argument("--verbose", "-v", action="store_true", help="debug logging")

    bench = _command(sub, "bench", "benchmarks (need the runtime extra)",
                     "Measured on this machine; medians over repeats. See README for the targets.")
    which = bench.add_subparsers(dest="bench", metavar="WHAT", required=True)
    for name, text in (("rollout", "speculative rollout engine vs plain decoding and HF generate"),
                       ("sync", "weight sync between two processes vs loopback TCP"),
                       ("prefetch", "the engine's one-row weight prefetch on vs off, by the weights' size"),
                       ("policy", "the adaptive policy's own cost on the long tail: it and its shadow vs fixed γ=6")):
        b = _command(which, name, text, "Prints a table; --json writes every measurement.")
        b.add_argument("--quick", action="store_true", help="smaller workload, for smoke tests")
        b.add_argument("--json", default=None, metavar="FILE", help="write the results as JSON")
        b.add_argument("--repeats", type=positive_int, default=None, metavar="N",
                       help="paired rounds per size, on and off (the geomean ratio is reported; default 20)"
                       if name == "prefetch" else "repetitions (the median is reported)")
        if name == "rollout":
            b.add_argument("--model", default=None, metavar="NAME",
                           help="a real checkpoint (e.g. builtin:smollm2-135m): chat prompts, every native proposer "
                                "vs plain decoding vs transformers, and the batch-1 roofline")
            b.add_argument("--seed", type=int, default=None, metavar="N",
                           help="first sampling seed of the engine runs (default: the workload's); a fixed "
                                "configuration samples the same texts whenever the seed is the same")
        if name == "policy":
            b.add_argument("--ring", action="store_true",
                           help="the rollout benchmark's other fixed configurations join the lockstep ring")
            b.add_argument("--serving", action="store_true",
                           help="the serving shape runs between repeats on the same controllers")
            b.add_argument("--by-batch", action="store_true",
                           help="also print the long tail per batch size: each configuration's rate, what the "
                                "policy ran, its cost per step, and the calibration against the steps")
        if name == "prefetch":
            b.add_argument("--model", default="builtin:smollm2-135m", metavar="NAME",
                           help="the checkpoint cut to its first N layers (default: %(default)s)")
            b.add_argument("--layers", default=None, metavar="N,N,...",
                           help="layer counts to measure ('all': the whole model; default: 1,3,5,7,9,11,14,18,all "
                                "up to the model's depth; --quick: 1,2)")

    p = _command(sub, "simulate", "simulate an RL job at cluster scale (a cost model; no torch needed)",
                 "Compares plain decoding, speculative decoding, the best static trainer/rollout split and the\n"
                 "operator's elastic policy for a scenario (a YAML file or a preset).")
    p.add_argument("scenario", nargs="?", default=None, metavar="SCENARIO.yaml", help="scenario YAML")
    p.add_argument("--preset", default=None, metavar="NAME", help="a built-in scenario (see --list)")
    p.add_argument("--list", action="store_true", help="list the presets and exit")
    p.add_argument("--json", default=None, metavar="FILE", help="write the report as JSON")
    p.add_argument("--plot", default=None, metavar="PNG", help="write a timeline plot (needs matplotlib)")
    p.add_argument("--from-bench", default=None, metavar="JSON",
                   help="predict the SD speedups `specrl bench rollout --json` measured, from its measured costs")

    p = _command(sub, "worker", "pod entrypoint of a job's coordinator, trainer or rollout worker",
                 "Started by the pods the operator creates; reads SPECRL_* environment variables.")
    p.add_argument("role", choices=["coordinator", "trainer", "rollout"], help="which part of the job this pod runs")
    p.add_argument("--config", required=True, metavar="FILE",
                   help="resolved job config (the ConfigMap's job.yaml)")
    _add_export(sub)
    return parser


def _missing_runtime_module() -> str | None:
    for name in RUNTIME_MODULES:
        try:
            if importlib.util.find_spec(name) is None:
                return name
        except (ImportError, ValueError):
            return name
    return None


def _add_export(sub: argparse._SubParsersAction) -> None:
    p = _command(sub, "export", "write a run's or checkpoint's trained policy as a plain Hugging Face folder",
                 "Copies the newest checkpoint's policy/ (safetensors, config, tokenizer) to OUT_DIR, optionally cast "
                 "to another dtype: a folder transformers and vLLM load unchanged.")
    p.add_argument("source", metavar="RUN_OR_CHECKPOINT",
                   help="a checkpoint (step-NNNNNN), a folder of checkpoints, or a run folder (specrl run --out)")
    p.add_argument("out", metavar="OUT_DIR", help="new folder for the HF model (config, safetensors, tokenizer)")
    p.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="cast the weights (default: as trained, float32)")


def _resolve(command: str) -> Callable[[argparse.Namespace], int]:
    module_name, func = HANDLERS[command].split(":")
    module = importlib.import_module(module_name)
    return getattr(module, func)


def _is_runtime_dependency(exc: ModuleNotFoundError) -> bool:
    return exc.name is not None and exc.name.split(".")[0] in RUNTIME_MODULES


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = f"bench {args.bench}" if args.command == "bench" else args.command
    if command in RUNTIME_COMMANDS and (missing := _missing_runtime_module()):
        print(f"specrl {command}: needs {missing!r}, which is not installed; {RUNTIME_HINT}", file=sys.stderr)
        return EXIT_FAILURE
    try:
        return int(_resolve(command)(args) or 0)
    except ModuleNotFoundError as exc:
        # An optional dependency imported lazily inside a handler (e.g. matplotlib for --plot).
        if not _is_runtime_dependency(exc):
            raise
        print(f"specrl {command}: needs {exc.name!r}, which is not installed; {RUNTIME_HINT}", file=sys.stderr)
        return EXIT_FAILURE
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
