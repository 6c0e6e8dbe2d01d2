"""`specrl run JOB.yaml [--out DIR] [--steps N] [--no-progress]`: the whole job on a local Ray instance.

Same code path as a cluster: the coordinator (here a Ray actor), trainer and rollout workers (Ray actors), the
gloo weight-sync side group, the coordinator's HTTP API on a free local port. Writes `summary.json`,
`metrics.jsonl` and PNG plots to the output folder.

Measurements (side by side, in this run, on this machine):
- accuracy_start/end: greedy decoding of held-out problems before the first and after the last step;
- trained_accuracy_start/end: the same on the first `eval_size` problems of the job's own dataset (what the
  updates train on: a small policy can learn those problems without getting better at new ones);
- rollout_accuracy_start/end: share of correct samples in the first and last step's rollouts (sampled, noisy);
- greedy_sd_equals_ar: the final greedy evaluation with speculation on and off, token for token;
- sd_rollout_speedup: one full step batch at the job's temperature on one rollout worker, with speculation and
  with plain decoding, same weights and seeds, back to back (wall time of the rollout phase only).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class JobError(Exception):
    """A problem with the job the user can fix; printed as one line, never a traceback."""


def load_settings(path: str, steps: int | None = None):
    from specrl.runtime.api import JobValidationError, load_job
    from specrl.runtime.rl.settings import RunSettings

    p = Path(path)
    if not p.is_file():
        raise JobError(f"{path}: no such file")
    try:
        job = load_job(p)
    except JobValidationError as exc:
        raise JobError(str(exc)) from None
    settings = RunSettings.from_job(job)
    if steps is not None:
        if steps < 1:
            raise JobError(f"--steps: must be >= 1, got {steps}")
        settings = settings.replace(steps=steps)
    return job, check_settings(settings, source=str(path), name=job.metadata.name)


def check_settings(settings, source: str = "<job>", name: str = ""):
    """Checks that need the machine (files, installed functions, devices); local-mode adjustments."""
    import torch
    from specrl.runtime.rl.reward import RewardLoadError, load_reward

    prefix = f"{source}: {name}: " if name else f"{source}: "
    if not settings.dataset.startswith("builtin:") and not Path(settings.dataset).is_file():
        raise JobError(f"{prefix}spec.dataset.path: dataset file {settings.dataset!r} does not exist")
    try:
        load_reward(settings.reward)
    except RewardLoadError as exc:
        raise JobError(f"{prefix}spec.reward.function: {exc}") from None
    if settings.sync_backend == "nccl" and not torch.cuda.is_available():
        # The local run is CPU-only: NCCL needs GPUs, gloo is the same protocol over TCP.
        settings = settings.replace(sync_backend="gloo")
    return settings


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    try:
        _job, settings = load_settings(args.job, getattr(args, "steps", None))
    except JobError as exc:
        print(f"specrl run: {exc}", file=sys.stderr)
        return 1
    out_dir = Path(args.out) if getattr(args, "out", None) else Path("runs") / settings.job
    try:
        summary = run_job(settings, out_dir, progress=not getattr(args, "no_progress", False))
    except JobError as exc:
        print(f"specrl run: {exc}", file=sys.stderr)
        return 1
    print(json.dumps({k: summary[k] for k in SUMMARY_HEADLINE if k in summary}, indent=1))
    print(f"wrote {out_dir}/summary.json, metrics.jsonl and plots")
    return 0 if summary.get("prompts_lost", 0) == 0 else 1


SUMMARY_HEADLINE = ("steps", "accuracy_start", "accuracy_end", "trained_accuracy_start",
                    "trained_accuracy_end", "reward_start", "reward_end", "acceptance_length",
                    "rollout_tokens_per_s", "sd_rollout_speedup", "greedy_sd_equals_ar", "weight_sync_seconds",
                    "prompts_lost", "wall_seconds")


def build_models(settings, progress: bool) -> None:
    """Build (or find cached) builtin models in the driver, with a progress bar, before any actor loads them."""
    from specrl.runtime.models.bootstrap import ensure_models

    names = [n for n in (settings.model, settings.draft_model) if n and n.startswith("builtin:")]
    if not names:
        return
    threads = max(1, _cores())
    if not progress:
        ensure_models(names, threads=threads)
        return
    from specrl.runtime.models.bootstrap import _rich_progress

    bar, update = _rich_progress()
    with bar:
        ensure_models(names, threads=threads, progress=update)


def start_ray() -> None:
    import ray

    if ray.is_initialized():
        return
    # Actors print nothing but warnings: the live table is the run's output.
    quiet = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error",
             "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TQDM_DISABLE": "1"}
    os.environ.update({k: v for k, v in quiet.items() if k != "OMP_NUM_THREADS"})
    ray.init(num_cpus=max(2, _cores()), include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING,
             configure_logging=True, runtime_env={"env_vars": quiet})


def run_job(settings, out_dir: Path, *, progress: bool = True, measure: bool = True,
            coordinator_options: dict | None = None) -> dict[str, Any]:
    """Run the job end to end and write the outputs; returns the summary."""
    import ray
    from specrl.runtime.coordinator import JobCoordinator
    from specrl.runtime.coordinator_http import free_port

    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    build_models(settings, progress)
    start_ray()
    opts = {"http_port": free_port(), **(coordinator_options or {})}
    from specrl.runtime.coordinator import latest_checkpoint

    resume = latest_checkpoint(settings.checkpoint_dir)
    if resume and "resume_from" not in opts:
        print(f"[specrl] resuming from checkpoint {resume}", flush=True)
        opts["resume_from"] = resume
    coord = ray.remote(JobCoordinator).options(num_cpus=0, max_concurrency=8).remote(settings, **opts)
    display = Display(settings, enabled=progress)
    metrics_path = out_dir / "metrics.jsonl"
    records: list[dict] = []
    summary: dict[str, Any] = {}
    try:
        display.note("starting workers")
        ray.get(coord.start.remote())
        url = ray.get(coord.get_url.remote())
        display.note(f"coordinator API {url}")
        eval_start = ray.get(coord.evaluate.remote(True)) if measure else None
        trained_start = ray.get(coord.evaluate.remote(True, "trained")) if measure else None
        first_step = ray.get(coord.status.remote())["step"]
        with display, metrics_path.open("w") as mf:
            for step in range(first_step, settings.steps):
                ref = coord.run_step.remote()
                while True:
                    done, _ = ray.wait([ref], timeout=0.5)
                    display.update_status(ray.get(coord.status.remote()))
                    if done:
                        break
                rec = ray.get(ref)
                records.append(rec)
                mf.write(json.dumps({k: v for k, v in rec.items() if k != "response_lengths"} |
                                    {"response_length_mean": _mean(rec["response_lengths"])}) + "\n")
                mf.flush()
                display.add_step(rec)
        ray.get(coord.finish.remote())
        measures: dict[str, Any] = {}
        if measure:
            display.note("final evaluation (greedy, SD on and off) and SD-vs-AR rollout comparison")
            eval_sd = ray.get(coord.evaluate.remote(True))
            eval_ar = ray.get(coord.evaluate.remote(False))
            trained_end = ray.get(coord.evaluate.remote(True, "trained"))
            cmp = ray.get(coord.compare_rollout.remote())
            measures = {"eval_start": eval_start, "eval_sd": eval_sd, "eval_ar": eval_ar, "compare": cmp,
                        "trained_start": trained_start, "trained_end": trained_end}
        ledger = ray.get(coord.ledger_report.remote())
        summary = summarize(settings, records, measures, ledger, time.perf_counter() - t_start)
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        write_plots(records, out_dir, summary)
    finally:
        try:
            ray.get(coord.shutdown.remote(), timeout=30)
        except Exception as exc:  # noqa: BLE001 - best effort on the way out
            log.debug("coordinator shutdown: %s", exc)
        ray.kill(coord)
    return summary


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def summarize(settings, records: list[dict], measures: dict, ledger: dict, wall: float) -> dict[str, Any]:
    from specrl.runtime.coordinator import acceptance_length

    acc_last = next((r["acceptance_length"] for r in reversed(records) if r["acceptance_length"] is not None), None)
    rollout_s = sum(r["rollout_seconds"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    syncs = [r["sync_seconds"] for r in records if r["sync_bytes"]]
    summary: dict[str, Any] = {
        "job": settings.job,
        "steps": len(records),
        "mode": settings.mode,
        "method": settings.method,
        "drafter_training": settings.drafter_training,
        "reward_start": records[0]["reward_mean"] if records else None,
        "reward_end": records[-1]["reward_mean"] if records else None,
        "rollout_accuracy_start": records[0]["accuracy"] if records else None,
        "rollout_accuracy_end": records[-1]["accuracy"] if records else None,
        "acceptance_length": acc_last,
        "acceptance_length_per_step": [r["acceptance_length"] for r in records],
        "eval_accuracy_per_step": {r["step"]: r["eval_accuracy"] for r in records
                                   if r.get("eval_accuracy") is not None},
        "rollout_tokens_per_s": tokens / rollout_s if rollout_s > 0 else 0.0,
        "weight_sync_seconds": statistics.median(syncs) if syncs else 0.0,
        "weight_sync_bytes": records[-1]["sync_bytes"] if records else 0,
        "long_tail_seconds": sum(r["long_tail_seconds"] for r in records),
        "drafter_train_steps": sum(r["drafter_steps"] for r in records),
        "prompts_issued": ledger["issued"],
        "prompts_trained": ledger["trained"],
        "prompts_requeued": ledger["requeued"],
        "prompts_lost": ledger["lost"],
        "reward_errors": records[-1]["reward_errors"] if records else 0,
        "wall_seconds": wall,
    }
    ev0, ev_sd, ev_ar, cmp = (measures.get(k) for k in ("eval_start", "eval_sd", "eval_ar", "compare"))
    if ev0:
        summary["accuracy_start"] = ev0["accuracy"]
    if ev_sd:
        summary["accuracy_end"] = ev_sd["accuracy"]
        summary["eval_problems"] = len(ev_sd["tokens"])
    for key in ("trained_start", "trained_end"):
        if measures.get(key):
            summary[f"trained_accuracy_{key.removeprefix('trained_')}"] = measures[key]["accuracy"]
    if ev_sd and ev_ar:
        summary["greedy_sd_equals_ar"] = ev_sd["tokens"] == ev_ar["tokens"]
        summary["eval_sd_seconds"] = ev_sd["seconds"]
        summary["eval_ar_seconds"] = ev_ar["seconds"]
    if cmp:
        summary["sd_rollout_speedup"] = cmp["speedup_median"]
        summary["sd_rollout_speedups"] = cmp["speedups"]
        summary["sd_rollout_seconds"] = cmp["sd_seconds"]
        summary["ar_rollout_seconds"] = cmp["ar_seconds"]
        summary["sd_rollout_acceptance_length"] = acceptance_length(cmp["sd_stats"])
        summary["sd_rollout_measurement"] = (
            f"one full step batch (promptsPerStep x groupSize) at the job's temperature on one rollout worker, "
            f"speculative vs plain decoding on the final weights with the same per-sample seeds, {cmp['repeats']} "
            "pairs in alternating order; median of the per-pair AR/SD wall-time ratios of generate()")
    if "accuracy_start" not in summary:
        summary["accuracy_start"] = summary["rollout_accuracy_start"]
        summary["accuracy_end"] = summary["rollout_accuracy_end"]
    return summary


# ---------------------------------------------------------------------------------------------- display


class Display:
    """A rich progress bar and a live table of steps; plain log lines with --no-progress."""

    COLUMNS = ("step", "reward", "acc", "eval", "tok/s", "accept", "SD on", "tail s", "sync s", "step s")

    def __init__(self, settings, enabled: bool = True) -> None:
        self.settings = settings
        self.enabled = enabled and sys.stdout.isatty() or (enabled and os.environ.get("SPECRL_FORCE_PROGRESS"))
        self.rows: list[tuple] = []
        self.live = None
        self.progress = None
        self.task = None
        self.status: dict = {}

    def note(self, text: str) -> None:
        print(f"[specrl] {text}", flush=True)

    def __enter__(self) -> Display:  # noqa: PYI034
        if self.enabled:
            from rich.live import Live
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(TextColumn("[bold]RL steps"), BarColumn(), MofNCompleteColumn(),
                                     TextColumn("{task.fields[phase]}"), TimeElapsedColumn())
            self.task = self.progress.add_task("steps", total=self.settings.steps, phase="Starting")
            self.live = Live(self._render(), refresh_per_second=4)
            self.live.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.live is not None:
            self.live.update(self._render())
            self.live.__exit__(*exc)

    def _render(self):
        from rich.console import Group
        from rich.table import Table

        table = Table(title=f"specrl run {self.settings.job} ({self.settings.mode}, {self.settings.method})")
        for c in self.COLUMNS:
            table.add_column(c, justify="right")
        for row in self.rows[-15:]:
            table.add_row(*row)
        st = self.status
        if st:
            table.caption = (f"phase {st.get('phase')}  queue {st.get('queueDepth')}  active "
                             f"{st.get('activeSequences')}  tok/s {st.get('tokensPerSecond', 0):.0f}  "
                             f"long tail {'yes' if st.get('longTail') else 'no'}")
        return Group(self.progress, table) if self.progress is not None else table

    def update_status(self, status: dict) -> None:
        self.status = status
        if self.progress is not None:
            self.progress.update(self.task, phase=status.get("phase", ""))
            self.live.update(self._render())

    def add_step(self, rec: dict) -> None:
        acc = rec["acceptance_length"]
        ev = rec.get("eval_accuracy")
        row = (str(rec["step"]), f"{rec['reward_mean']:.3f}", f"{rec['accuracy']:.3f}",
               "-" if ev is None else f"{ev:.3f}", f"{rec['tokens_per_s']:.0f}",
               "-" if acc is None else f"{acc:.2f}",
               "-" if rec["sd_share"] is None else f"{100 * rec['sd_share']:.0f}%",
               f"{rec['long_tail_seconds']:.1f}", f"{rec['sync_seconds']:.3f}", f"{rec['step_seconds']:.1f}")
        self.rows.append(row)
        if self.progress is not None:
            self.progress.update(self.task, advance=1)
            self.live.update(self._render())
        else:
            print("[specrl] " + "  ".join(f"{c}={v}" for c, v in zip(self.COLUMNS, row)), flush=True)


# ---------------------------------------------------------------------------------------------- plots


def write_plots(records: list[dict], out_dir: Path, summary: dict | None = None) -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not records:
        return []
    steps = [r["step"] for r in records]
    paths = []

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [r["reward_mean"] for r in records], marker="o", label="reward (mean)")
    ax.plot(steps, [r["accuracy"] for r in records], marker="s", label="accuracy (rollouts)")
    if summary and summary.get("eval_problems"):
        ax.plot([steps[0], steps[-1]], [summary["accuracy_start"], summary["accuracy_end"]], "k--", marker="D",
                label=f"greedy eval ({summary['eval_problems']} held-out), before/after")
    evals = [(r["step"], r["eval_accuracy"]) for r in records if r.get("eval_accuracy") is not None]
    if evals:
        ax.plot(*zip(*evals), "k:", marker="x", label="greedy eval, held-out (every evalEvery steps)")
    if summary and summary.get("trained_accuracy_end") is not None:
        ax.plot([steps[0], steps[-1]], [summary["trained_accuracy_start"], summary["trained_accuracy_end"]], ":",
                color="tab:green", marker="D", label="greedy eval (problems it trains on), before/after")
    ax.set_xlabel("RL step")
    ax.set_ylim(-0.05, 1.05)
    ax.legend(loc="upper left", fontsize="small")  # accuracies of a small policy stay in the lower half
    ax.set_title("Reward and accuracy per step")
    paths.append(_save(fig, out_dir / "reward_accuracy.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    lengths = [n for r in records for n in r["response_lengths"]]
    ax.hist(lengths, bins=min(40, max(5, len(set(lengths)))), color="tab:purple")
    ax.set_xlabel("response length (tokens)")
    ax.set_ylabel("sequences")
    ax.set_title("Response-length distribution (all steps)")
    paths.append(_save(fig, out_dir / "response_lengths.png"))

    fig, ax = plt.subplots(figsize=(6, 4))
    ax.plot(steps, [r["acceptance_length"] if r["acceptance_length"] is not None else float("nan") for r in records],
            marker="o")
    ax.set_xlabel("RL step")
    ax.set_ylabel("acceptance length (tokens per draft)")
    ax.set_title("Speculative acceptance per step")
    paths.append(_save(fig, out_dir / "acceptance.png"))

    fig, ax = plt.subplots(figsize=(7, 4))
    parts = [("rollout (excl. tail)", [r["rollout_seconds"] - r["long_tail_seconds"] for r in records]),
             ("long tail", [r["long_tail_seconds"] for r in records]),
             ("train", [r["train_seconds"] for r in records]),
             ("sync", [r["sync_seconds"] for r in records])]
    bottom = [0.0] * len(records)
    for name, values in parts:
        ax.bar(steps, values, bottom=bottom, label=name)
        bottom = [b + v for b, v in zip(bottom, values)]
    ax.set_xlabel("RL step")
    ax.set_ylabel("seconds")
    ax.set_title("Where time went per step (drafter training overlaps the tail)")
    ax.legend()
    paths.append(_save(fig, out_dir / "time_breakdown.png"))
    return paths


def _save(fig, path: Path) -> Path:
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:
        if ax.get_xlabel() == "RL step":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
