"""`specrl simulate [SCENARIO.yaml | --preset NAME] [--json FILE] [--plot PNG] [--list]`.

A cost model: imports no torch, so it runs on the base install (`--plot` needs matplotlib).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from .analysis import Report, evaluate
from .hardware import gpu as gpu_named
from .scenario import list_presets, load_scenario


def _table(report: Report) -> Table:
    s = report.scenario
    t = Table(title=f"{s.name} — {s.model} on {s.cluster.gpus}x {s.cluster.gpu}, {s.mode}, {s.placement}, "
                    f"drafter {s.speculative.drafter} ({s.speculative.policy})")
    for col in ("run", "rollout s/step", "step s", "trainer GPU·h", "rollout GPU·h", "rollout idle in tail",
                "SD share", "vs AR", "vs static split"):
        t.add_column(col, justify="right" if col != "run" else "left")
    rows = [("AR", report.ar), ("SD", report.sd),
            (f"SD, best static split ({report.static_trainer_gpus} trainer GPUs)", report.static),
            ("SD, elastic (operator policy)", report.elastic)]
    for name, r in rows:
        n = len(r.steps)
        t.add_row(name, f"{r.rollout_seconds / n:.1f}", f"{r.total_seconds / n:.1f}",
                  f"{r.gpu_seconds('trainer') / 3600:.1f}", f"{r.gpu_seconds('rollout') / 3600:.1f}",
                  f"{r.tail_idle_fraction():.0%}", f"{sum(x.sd_share for x in r.steps) / n:.0%}",
                  f"{report.ar.total_seconds / r.total_seconds:.2f}x",
                  f"{report.static.total_seconds / r.total_seconds:.2f}x")
    return t


def output_problem(option: str, path: str | None) -> str | None:
    """Why an output file cannot be written, checked before simulating: a failed write after minutes of
    simulation would lose the results."""
    if path is None:
        return None
    p = Path(path)
    parent = p.parent
    if p.is_dir():
        return f"{option}: {path!r} is a directory"
    if not parent.is_dir():
        return f"{option}: folder {str(parent)!r} does not exist" if not parent.exists() else \
            f"{option}: {str(parent)!r} is not a directory"
    if not os.access(p if p.exists() else parent, os.W_OK):
        return f"{option}: {path!r} is not writable"
    return None


def _write(option: str, path: str, text: str) -> bool:
    try:
        Path(path).write_text(text)
    except OSError as exc:
        print(f"specrl simulate: {option}: cannot write {path!r}: {exc.strerror or exc}", file=sys.stderr)
        return False
    return True


def main(args: argparse.Namespace) -> int:
    console = Console(width=max(150, Console().width))
    for option, path in (("--json", args.json), ("--plot", args.plot)):
        if problem := output_problem(option, path):
            print(f"specrl simulate: {problem}", file=sys.stderr)
            return 1
    if args.from_bench:
        return _from_bench(console, args)
    if args.list:
        for name in list_presets():
            console.print(f"{name}: {load_scenario(preset=name).description.strip()}")
        return 0
    # Usage errors (exit 2): what to simulate is missing, ambiguous or unknown; a bad scenario file is a failure (1).
    usage = None
    if (args.scenario is None) == (args.preset is None):
        usage = "give either a scenario file or --preset NAME (see --list)"
    elif args.preset is not None and args.preset not in list_presets():
        usage = f"--preset: unknown preset {args.preset!r}; known: {', '.join(list_presets())}"
    if usage:
        print(f"specrl simulate: {usage}", file=sys.stderr)
        return 2
    try:
        scenario = load_scenario(args.scenario, args.preset)
        gpu_named(scenario.cluster.gpu)
    except ValueError as exc:
        print(f"specrl simulate: {exc}", file=sys.stderr)
        return 1
    with console.status(f"simulating {scenario.name} (AR, SD, split sweep, elastic)…"):
        report = evaluate(scenario)
    console.print(_table(report))
    console.print(f"rollout speedup {report.rollout_speedup:.2f}x · end-to-end {report.end_to_end_speedup:.2f}x · "
                  f"elastic vs best static split {report.elastic_vs_static_speedup:.2f}x")
    moves = report.to_json(args.preset)["runs"]["elastic"]["moves"]
    if moves:
        console.print(f"elastic moves: {', '.join(moves[:8])}{' …' if len(moves) > 8 else ''}")
    if args.json and not _write("--json", args.json, json.dumps(report.to_json(args.preset), indent=2)):
        return 1
    if args.plot:
        from .plot import timeline

        try:
            console.print(f"timeline: {timeline(report, args.plot)}")
        except OSError as exc:
            print(f"specrl simulate: --plot: cannot write {args.plot!r}: {exc.strerror or exc}", file=sys.stderr)
            return 1
    return 0


def _from_bench(console: Console, args: argparse.Namespace) -> int:
    from .calibrated import predict_bench

    try:
        text = Path(args.from_bench).read_text(encoding="utf-8")
    except OSError as exc:
        print(f"specrl simulate: --from-bench: cannot read {args.from_bench!r}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    except UnicodeDecodeError:
        print(f"specrl simulate: --from-bench: {args.from_bench}: not UTF-8 text", file=sys.stderr)
        return 1
    try:
        bench = json.loads(text)
    except json.JSONDecodeError as exc:
        print(f"specrl simulate: --from-bench: {args.from_bench}: invalid JSON at line {exc.lineno}, column "
              f"{exc.colno}: {exc.msg}", file=sys.stderr)
        return 1
    try:
        rows = predict_bench(bench)
    except ValueError as exc:  # check_bench names the fields; a ValidationError of a derived scenario too
        print(f"specrl simulate: --from-bench: {args.from_bench}: {exc}", file=sys.stderr)
        return 1
    t = Table(title=f"simulator vs measured on this machine ({args.from_bench})")
    for col in ("config", "acceptance length", "measured speedup", "predicted speedup", "error"):
        t.add_column(col, justify="left" if col == "config" else "right")
    for r in rows:
        t.add_row(r["name"], f"{r['acceptance_length']:.2f}", f"{r['measured_speedup']:.2f}x",
                  f"{r['predicted_speedup']:.2f}x", f"{r['relative_error']:+.0%}")
    console.print(t)
    if args.json and not _write("--json", args.json, json.dumps({"from_bench": args.from_bench, "configs": rows},
                                                                 indent=2)):
        return 1
    return 0
