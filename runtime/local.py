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
  with plain decoding, same weights and seeds, back to back (wall time of the rollout phase only); the median of
  the pairs' ratios, with its distribution-free 90% interval (sd_rollout_speedup_interval).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .cores import available_cores

if TYPE_CHECKING:
    from types import TracebackType

    from rich.live import Live
    from rich.progress import Progress, TaskID

    from .rl.settings import RunSettings

log = logging.getLogger(__name__)


# samples per held-out problem in the before/after evaluation at the job's temperature (x spec eval_size problems)
HELDOUT_SAMPLES = 4


class JobError(Exception):
    """A problem with the job the user can fix; printed as one line, never a traceback."""


def load_settings(path: str, steps: int | None = None) -> tuple[Any, RunSettings]:
    from .api import JobValidationError, load_job
    from .rl.settings import RunSettings

    p = Path(path)
    if not p.is_file():
        raise JobError(f"{path}: {'is a directory' if p.is_dir() else 'no such file'}")
    try:
        job = load_job(p)
    except JobValidationError as exc:
        raise JobError(str(exc)) from None
    settings = RunSettings.from_job(job)
    if steps is not None:
        from .cli import job_steps

        try:
            steps = job_steps(str(steps))
        except argparse.ArgumentTypeError as exc:
            raise JobError(f"--steps: {exc}") from None
        settings = settings.replace(steps=steps)
    return job, check_settings(settings, source=str(path), name=job.metadata.name)


def out_dir_problem(out_dir: Path) -> str | None:
    """Why the output folder cannot be used, if it cannot: it, or a folder above it, is an existing file."""
    from .paths import file_in_the_way

    if (blocker := file_in_the_way(out_dir)) is None:
        return None
    return f"{str(out_dir)!r} exists and is not a directory" if blocker == out_dir else \
        f"{str(blocker)!r} is not a directory"


def check_settings(settings: RunSettings, source: str = "<job>", name: str = "") -> RunSettings:
    """Checks that need the machine (files, installed functions, devices); local-mode adjustments."""
    import torch

    from .rl.reward import RewardLoadError, load_reward
    from .rl.task import DatasetError, load_jsonl

    prefix = f"{source}: {name}: " if name else f"{source}: "
    if not settings.dataset.startswith("builtin:"):
        # Loaded here, not only in the rollout workers: a file without one usable line would otherwise kill an
        # actor after Ray has started, as a page of ActorDiedError.
        try:
            load_jsonl(settings.dataset, prompt_field=settings.prompt_field, answer_field=settings.answer_field)
        except (DatasetError, OSError) as exc:
            reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
            raise JobError(f"{prefix}spec.dataset.path: {reason}") from None
    try:
        load_reward(settings.reward)
    except RewardLoadError as exc:
        raise JobError(f"{prefix}spec.reward.function: {exc}") from None
    from .models.hub import preflight

    try:
        preflight(settings)  # model folder, architecture, tokenizer, draft vocabulary, dtype on the device
    except ValueError as exc:
        raise JobError(f"{prefix}{exc}") from None
    if settings.sync_backend == "nccl" and not torch.cuda.is_available():
        # The local run is CPU-only: NCCL needs GPUs, gloo is the same protocol over TCP.
        settings = settings.replace(sync_backend="gloo")
    return settings


def local_threads(settings: RunSettings, cores: int) -> int:
    """Torch threads per trainer when every worker shares this machine. Sync mode alternates the phases (rollouts,
    then training), so training may use every core; async mode overlaps them, and so does drafter training, which
    runs on the trainers while the rollouts decode: then the cores are split between all workers. Rollout workers
    keep one thread: a decode step is a chain of small ops, and splitting them over threads doubled the decode time
    of tiny-local's rollouts (0.24 -> 0.46 s of decode steps, the Ray processes beside it preempting a thread
    that the others then wait for)."""
    overlap = settings.mode == "async" or settings.drafter_training
    sharing = settings.trainers + settings.rollouts if overlap else max(settings.trainers, settings.rollouts)
    return max(1, cores // max(1, sharing))


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    out = getattr(args, "out", None)
    option = "--out" if out else "output folder"
    # An explicit --out is checked before the job (whose checks load models); the default needs the job's name.
    if out and (problem := out_dir_problem(Path(out))):
        print(f"specrl run: {option}: {problem}", file=sys.stderr)
        return 1
    try:
        _job, settings = load_settings(args.job, getattr(args, "steps", None))
    except JobError as exc:
        print(f"specrl run: {exc}", file=sys.stderr)
        return 1
    out_dir = Path(out) if out else Path("runs") / settings.job
    if problem := out_dir_problem(out_dir):
        print(f"specrl run: {option}: {problem}", file=sys.stderr)
        return 1
    try:
        # Created only now that every check has passed: a failed check leaves nothing behind.
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"specrl run: {option}: cannot create {str(out_dir)!r}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    try:
        summary = run_job(settings, out_dir, progress=not getattr(args, "no_progress", False))
    except JobError as exc:
        print(f"specrl run: {exc}", file=sys.stderr)
        return 1
    print(f"wrote {out_dir}/summary.json, metrics.jsonl and plots (overview.png first)")
    return 0 if summary.get("prompts_lost", 0) == 0 else 1


def build_models(settings: RunSettings, progress: bool) -> None:
    """Build (or find cached) builtin models in the driver, with a progress bar, before any actor loads them."""
    from .models.bootstrap import ensure_models

    names = [n for n in (settings.model, settings.draft_model) if n and n.startswith("builtin:")]
    if not names:
        return
    threads = available_cores()
    if not progress:
        ensure_models(names, threads=threads)
        return
    from .models.bootstrap import _rich_progress

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
    ray.init(num_cpus=max(2, available_cores()), include_dashboard=False, log_to_driver=True, logging_level=logging.WARNING,
             configure_logging=True, runtime_env={"env_vars": quiet})


def run_job(settings: RunSettings, out_dir: Path, *, progress: bool = True, measure: bool = True,
            coordinator_options: dict | None = None) -> dict[str, Any]:
    """Run the job end to end and write the outputs; returns the summary."""
    import ray

    from .coordinator import JobCoordinator
    from .ports import free_port

    out_dir.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    settings = settings.replace(trainer_threads=local_threads(settings, available_cores()))
    build_models(settings, progress)
    start_ray()
    opts = {"http_port": free_port(), **(coordinator_options or {})}
    # Ray types an actor handle's methods as Any (and `.remote()` of an actor class as handle-or-class)
    coord: Any = ray.remote(JobCoordinator).options(num_cpus=0, max_concurrency=8).remote(settings, **opts)
    display = Display(settings, enabled=progress)
    metrics_path = out_dir / "metrics.jsonl"
    records: list[dict] = []
    summary: dict[str, Any] = {}
    try:
        display.note("starting workers")
        ray.get(coord.start.remote())  # resumes from the newest complete checkpoint of spec.checkpoint.path
        resumed = ray.get(coord.resumed_from.remote())
        if resumed:
            display.note(f"resumed from checkpoint {resumed}")
        url = ray.get(coord.get_url.remote())
        display.note(f"coordinator API {url}")
        if measure:
            display.note(f"held-out evaluation before training ({settings.eval_size} problems x {HELDOUT_SAMPLES} "
                         f"samples at T={settings.temperature:g}, and greedy)")
        # Plain decoding for the sampled evaluations: a sample's random stream then depends on its seed alone (the
        # adaptive toggle's choices change how speculative steps consume it), so before/after samples are paired.
        heldout_start = ray.get(coord.evaluate.remote(False, "heldout", HELDOUT_SAMPLES)) if measure else None
        eval_start = ray.get(coord.evaluate.remote(True)) if measure else None
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
                mf.write(metrics_line(rec))
                mf.flush()
                display.add_step(rec)
        ray.get(coord.finish.remote())
        measures: dict[str, Any] = {}
        if measure:
            display.note("final evaluation (held-out sampled; greedy with SD on and off) and SD-vs-AR rollout "
                         "comparison")
            heldout_end = ray.get(coord.evaluate.remote(False, "heldout", HELDOUT_SAMPLES))
            eval_sd = ray.get(coord.evaluate.remote(True))
            eval_ar = ray.get(coord.evaluate.remote(False))
            cmp = ray.get(coord.compare_rollout.remote())
            measures = {"heldout_start": heldout_start, "heldout_end": heldout_end, "eval_start": eval_start,
                        "eval_sd": eval_sd, "eval_ar": eval_ar, "compare": cmp}
        ledger = ray.get(coord.ledger_report.remote())
        summary = summarize(settings, records, measures, ledger, time.perf_counter() - t_start)
        (out_dir / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        write_plots(records, out_dir, summary, measures.get("compare"))
        display.story(summary)
    finally:
        try:
            ray.get(coord.shutdown.remote(), timeout=30)
        except Exception as exc:  # noqa: BLE001 - best effort on the way out
            log.debug("coordinator shutdown: %s", exc)
        ray.kill(coord)
    return summary


def metrics_line(record: dict[str, Any]) -> str:
    """One step's line of metrics.jsonl: the coordinator's step record plus its mean response length. The lengths
    themselves stay: `specrl simulate` takes a job's empirical lengths from them (`workload.response.metrics_file`),
    and without them that option could never read a real run's file."""
    return json.dumps(record | {"response_length_mean": _mean(record["response_lengths"])}) + "\n"


def _mean(xs: list[float]) -> float:
    return float(sum(xs) / len(xs)) if xs else 0.0


def summarize(settings: RunSettings, records: list[dict], measures: dict, ledger: dict, wall: float) -> dict[str, Any]:
    from .coordinator import acceptance_length
    from .rl.significance import grouped_comparison, length_profile, paired_comparison

    acc_last = next((r["acceptance_length"] for r in reversed(records) if r["acceptance_length"] is not None), None)
    rollout_s = sum(r["rollout_seconds"] for r in records)
    step_s = sum(r["step_seconds"] for r in records)
    tokens = sum(r["tokens"] for r in records)
    syncs = [r["sync_seconds"] for r in records if r["sync_bytes"]]
    per_step = [length_profile(r["response_lengths"]) for r in records]
    summary: dict[str, Any] = {
        "job": settings.job,
        "steps": len(records),
        "mode": settings.mode,
        "method": settings.method,
        "drafter_training": settings.drafter_training,
        "checkpoint_dir": settings.checkpoint_dir,  # where `specrl export RUN_DIR OUT` finds the policy
        "reward_start": records[0]["reward_mean"] if records else None,
        "reward_end": records[-1]["reward_mean"] if records else None,
        "reward_per_step": [r["reward_mean"] for r in records],
        "rollout_accuracy_start": records[0]["accuracy"] if records else None,
        "rollout_accuracy_end": records[-1]["accuracy"] if records else None,
        "acceptance_length": acc_last,
        "acceptance_length_per_step": [r["acceptance_length"] for r in records],
        "sd_share_per_step": [r["sd_share"] for r in records],
        "eval_accuracy_per_step": {r["step"]: r["eval_accuracy"] for r in records
                                   if r.get("eval_accuracy") is not None},
        # the long tail: every rollout of the run, and each step's own profile
        "response_length": length_profile([n for r in records for n in r["response_lengths"]]),
        "response_length_median_per_step": [p["median"] for p in per_step],
        "response_length_p95_per_step": [p["p95"] for p in per_step],
        "response_length_max_per_step": [p["max"] for p in per_step],
        "rollout_tokens_per_s": tokens / rollout_s if rollout_s > 0 else 0.0,
        # where the time goes: the rollout phase's share of the whole step (training, sync and evaluation are
        # the rest; held-out evaluations every evalEvery steps are not part of a step)
        "rollout_share": rollout_s / step_s if step_s > 0 else 0.0,
        "step_seconds_median": statistics.median(r["step_seconds"] for r in records) if records else 0.0,
        "rollout_seconds_median": statistics.median(r["rollout_seconds"] for r in records) if records else 0.0,
        "train_seconds_median": statistics.median(r["train_seconds"] for r in records) if records else 0.0,
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
    h0, h1 = measures.get("heldout_start"), measures.get("heldout_end")
    if h0 and h1:
        cmp_h = paired_comparison(h0["correct"], h1["correct"])
        summary["heldout"] = {
            **cmp_h, "problems": h1["problems"], "samples_per_problem": h1["samples_per_problem"],
            "temperature": h1["temperature"],
            "measurement": (f"held-out problems (never trained on), {h1['samples_per_problem']} samples each at the "
                            f"job's temperature {h1['temperature']:g}, with per-sample seeds fixed by (job seed, "
                            "problem, sample), before the first and after the last step; 95% Wilson intervals, "
                            "a normal interval on the paired difference and McNemar's exact test"),
        }
        if any(h1.get("difficulty") or ()):
            summary["heldout"]["by_difficulty"] = grouped_comparison(h0["correct"], h1["correct"], h1["difficulty"])
        summary["accuracy_start"], summary["accuracy_end"] = cmp_h["before"], cmp_h["after"]
        summary["accuracy_ci_start"], summary["accuracy_ci_end"] = cmp_h["before_ci"], cmp_h["after_ci"]
        summary["accuracy_gain"], summary["accuracy_gain_ci"] = cmp_h["difference"], cmp_h["difference_ci"]
        summary["accuracy_p_value"] = cmp_h["p_value"]
        summary["eval_samples"] = cmp_h["n"]
    ev0, ev_sd, ev_ar, cmp = (measures.get(k) for k in ("eval_start", "eval_sd", "eval_ar", "compare"))
    if ev0:
        summary["greedy_accuracy_start"] = ev0["accuracy"]
    if ev_sd:
        summary["greedy_accuracy_end"] = ev_sd["accuracy"]
        summary["eval_problems"] = len(ev_sd["tokens"])
    if ev0 and ev_sd:
        # greedy decoding is deterministic: the same problems before and after pair up exactly
        summary["greedy_heldout"] = {
            **paired_comparison(ev0["correct"], ev_sd["correct"]), "problems": len(ev_sd["correct"]),
            "measurement": "greedy decoding of the same held-out problems before the first and after the last step; "
                           "95% Wilson intervals, a normal interval on the paired difference and McNemar's exact test"}
    if ev_sd and ev_ar:
        summary["greedy_sd_equals_ar"] = ev_sd["tokens"] == ev_ar["tokens"]
        summary["eval_sd_seconds"] = ev_sd["seconds"]
        summary["eval_ar_seconds"] = ev_ar["seconds"]
    if cmp:
        speedup = cmp["speedup_median"]
        summary["sd_rollout_speedup"] = speedup
        summary["sd_rollout_speedups"] = cmp["speedups"]
        summary["sd_rollout_speedup_interval"] = cmp.get("speedup_interval")
        summary["sd_rollout_seconds"] = cmp["sd_seconds"]
        summary["ar_rollout_seconds"] = cmp["ar_seconds"]
        summary["sd_rollout_acceptance_length"] = acceptance_length(cmp["sd_stats"])
        if cmp.get("sd_trace"):  # the decode steps of the last pair: how many of them the policy speculated in
            summary["sd_rollout_decode_steps"] = len(cmp["sd_trace"])
            summary["sd_rollout_speculative_steps"] = sum(1 for step in cmp["sd_trace"] if step[1])
        if cmp.get("policy_at_batch_1"):
            summary["sd_policy_at_batch_1"] = cmp["policy_at_batch_1"]
        if cmp.get("response_lengths"):
            summary["sd_rollout_response_length"] = length_profile(cmp["response_lengths"])
        summary["sd_rollout_measurement"] = (
            f"one full step batch (promptsPerStep x groupSize) at the job's temperature on one rollout worker, "
            f"speculative vs plain decoding on the final weights with the same per-sample seeds, {cmp['repeats']} "
            "pairs in alternating order (at least 5, more while they took under 6 s); median of the per-pair AR/SD "
            "wall-time ratios of generate(), with its distribution-free 90% interval (order statistics)")
        if records and speedup and speedup > 0:
            # Same steps with the rollout phase at plain-decoding speed: measured train/sync/tail-overlap time plus
            # each step's rollout time scaled by the side-by-side ratio (a projection, not a second run).
            off = [r["step_seconds"] + r["rollout_seconds"] * (speedup - 1) for r in records]
            summary["step_seconds_sd_on"] = summary["step_seconds_median"]
            summary["step_seconds_sd_off_projected"] = statistics.median(off)
            summary["step_speedup_projected"] = statistics.median(off) / summary["step_seconds_median"]
    if "accuracy_start" not in summary:
        summary["accuracy_start"] = summary["rollout_accuracy_start"]
        summary["accuracy_end"] = summary["rollout_accuracy_end"]
    return summary


def _paired(c: dict[str, Any]) -> str:
    """A paired before/after comparison (significance.paired_comparison) in one line."""
    (b0, b1), (a0, a1), (lo, hi) = c["before_ci"], c["after_ci"], c["difference_ci"]
    return (f"{c['before']:.3f} [{b0:.3f}, {b1:.3f}] -> {c['after']:.3f} [{a0:.3f}, {a1:.3f}]; "
            f"gain {c['difference']:+.3f} [{lo:+.3f}, {hi:+.3f}], McNemar p={c['p_value']:.2g}")


def story_lines(summary: dict[str, Any]) -> list[str]:
    """What the run showed, in a few lines: held-out gain, the long tail, speculation's effect, the time split."""
    lines = []
    h = summary.get("heldout")
    if h:
        lines.append(f"held-out accuracy ({h['n']} samples: {h['problems']} unseen problems x {h['samples_per_problem']}"
                     f" at T={h['temperature']:g}): {_paired(h)}")
        if h.get("by_difficulty"):
            lines.append("  by difficulty: " + ", ".join(
                f"{k} {v['before']:.2f} -> {v['after']:.2f} (n={v['n']})" for k, v in h["by_difficulty"].items()))
    if summary.get("reward_start") is not None:
        lines.append(f"reward (rollouts, mean of first/last 5 steps): {_mean(summary['reward_per_step'][:5]):.3f} -> "
                     f"{_mean(summary['reward_per_step'][-5:]):.3f}")
    rl = summary.get("response_length")
    if rl and rl["max"]:
        lines.append(f"response lengths (tokens, all rollouts): median {rl['median']:.0f}, p95 {rl['p95']:.0f}, "
                     f"max {rl['max']:.0f}  (p95 = {rl['tail_ratio']:.1f}x the median: the long tail)")
    if "sd_rollout_speedup" in summary:
        acc = summary.get("sd_rollout_acceptance_length")
        ci = summary.get("sd_rollout_speedup_interval")
        lines.append(f"rollout phase, speculative vs plain decoding (same weights and seeds): "
                     f"{summary['sd_rollout_speedup']:.2f}x"
                     + (f" [{ci['low']:.2f}, {ci['high']:.2f}]" if ci else "")
                     + f"  ({len(summary['sd_rollout_speedups'])} pairs, {summary['sd_rollout_seconds']:.2f} s vs "
                     f"{summary['ar_rollout_seconds']:.2f} s"
                     + (f", acceptance length {acc:.2f}" if acc else "")
                     + (f", speculating in {summary['sd_rollout_speculative_steps']} of "
                        f"{summary['sd_rollout_decode_steps']} decode steps" if "sd_rollout_decode_steps" in summary
                        else "") + ")")
        at_one = summary.get("sd_policy_at_batch_1")
        if summary.get("sd_rollout_speculative_steps") == 0 and at_one:
            m, (speed, gamma) = max(at_one.items(), key=lambda kv: kv[1][0])
            lines.append(f"  speculation never paid here: at batch 1, where every long tail ends, the policy predicts "
                         f"{m} (γ={gamma}) at {speed:.2f}x plain decoding, so it decoded plainly throughout; the gap "
                         "above is its own bookkeeping (and noise)")
    if summary.get("steps"):
        line = f"rollout share of the step: {100 * summary['rollout_share']:.0f}%"
        if "step_seconds_sd_off_projected" in summary:
            line += (f"; step time {summary['step_seconds_sd_on']:.2f} s with speculation, "
                     f"{summary['step_seconds_sd_off_projected']:.2f} s without (projected: "
                     f"{summary['step_speedup_projected']:.2f}x)")
        lines.append(line)
    g = summary.get("greedy_heldout")
    if g:
        lines.append(f"greedy held-out accuracy ({g['problems']} unseen problems): {_paired(g)}")
    if "greedy_sd_equals_ar" in summary:
        lines.append(f"greedy held-out outputs token-identical with speculation on and off: "
                     f"{'yes' if summary['greedy_sd_equals_ar'] else 'NO'}")
    return lines


# ---------------------------------------------------------------------------------------------- display


class Display:
    """A rich progress bar and a live table of steps; plain log lines with --no-progress."""

    # fits an 80-column terminal: lengths as median/p95/max, seconds of the rollout phase, training, whole step
    COLUMNS = ("step", "reward", "acc", "eval", "len", "accept", "SD on", "roll s", "train s", "step s")

    def __init__(self, settings: RunSettings, enabled: bool = True) -> None:
        self.settings = settings
        self.enabled = enabled and sys.stdout.isatty() or (enabled and os.environ.get("SPECRL_FORCE_PROGRESS"))
        self.rows: list[tuple] = []
        self.live: Live | None = None
        self.progress: Progress | None = None
        self.task: TaskID | None = None
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

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self.live is not None:
            self.live.update(self._render())
            self.live.__exit__(exc_type, exc, tb)

    def _render(self) -> Any:
        from rich import box
        from rich.console import Group
        from rich.table import Table

        table = Table(title=f"specrl run {self.settings.job} ({self.settings.mode}, {self.settings.method}); "
                            "len = response tokens median/p95/max", box=box.SIMPLE_HEAD, pad_edge=False,
                      collapse_padding=True)
        for c in self.COLUMNS:
            table.add_column(c, justify="right", no_wrap=True, min_width=len(c))
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
        if self.progress is not None and self.task is not None and self.live is not None:
            self.progress.update(self.task, phase=status.get("phase", ""))
            self.live.update(self._render())

    def add_step(self, rec: dict) -> None:
        from .rl.significance import length_profile

        acc = rec["acceptance_length"]
        ev = rec.get("eval_accuracy")
        lp = length_profile(rec["response_lengths"])
        row = (str(rec["step"]), f"{rec['reward_mean']:.3f}", f"{rec['accuracy']:.3f}",
               "-" if ev is None else f"{ev:.3f}", f"{lp['median']:.0f}/{lp['p95']:.0f}/{lp['max']:.0f}",
               "-" if acc is None else f"{acc:.2f}",
               "-" if rec["sd_share"] is None else f"{100 * rec['sd_share']:.0f}%",
               f"{rec['rollout_seconds']:.1f}", f"{rec['train_seconds']:.1f}", f"{rec['step_seconds']:.1f}")
        self.rows.append(row)
        if self.progress is not None and self.task is not None and self.live is not None:
            self.progress.update(self.task, advance=1)
            self.live.update(self._render())
        else:
            print("[specrl] " + "  ".join(f"{c}={v}" for c, v in zip(self.COLUMNS, row)), flush=True)

    def story(self, summary: dict) -> None:
        """The run's findings after the table (plain lines: they stay in a terminal's scrollback and in logs)."""
        print(flush=True)
        for line in story_lines(summary):
            print(f"[specrl] {line}", flush=True)


# ---------------------------------------------------------------------------------------------- plots


def write_plots(records: list[dict], out_dir: Path, summary: dict | None = None,
                compare: dict | None = None) -> list[Path]:
    """`overview.png` (every panel, the run at a glance) and one PNG per panel."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if not records:
        return []
    summary = summary or {}
    panels: list[tuple[str, Callable[[Any, list[dict], dict, dict | None], None]]] = [
        ("reward_accuracy", _plot_reward), ("response_lengths", _plot_lengths),
              ("acceptance", _plot_acceptance), ("time_breakdown", _plot_time)]
    if compare and compare.get("sd_trace"):
        panels.insert(2, ("decode_timeline", _plot_timeline))
    fig, axes = plt.subplots(2, 3, figsize=(18, 9))
    flat = list(axes.flat)
    for ax, (_name, fn) in zip(flat, panels):
        fn(ax, records, summary, compare)
    for ax in flat[len(panels):]:
        ax.axis("off")
        ax.text(0.0, 1.0, "\n".join(_wrap(line) for line in story_lines(summary)), va="top", fontsize=9,
                family="monospace", transform=ax.transAxes)
    fig.suptitle(f"specrl run {summary.get('job', '')}: {len(records)} GRPO steps, speculation "
                 f"{summary.get('method', '')}", fontsize=13)
    paths = [_save(fig, out_dir / "overview.png")]
    for name, fn in panels:
        fig, ax = plt.subplots(figsize=(7, 4.5))
        fn(ax, records, summary, compare)
        paths.append(_save(fig, out_dir / f"{name}.png"))
    return paths


def _wrap(line: str, width: int = 70) -> str:
    import textwrap

    return "\n".join(textwrap.wrap(line, width, subsequent_indent="  "))


def _plot_reward(ax: Any, records: list[dict], summary: dict, _compare: dict | None) -> None:
    steps = [r["step"] for r in records]
    rewards = [r["reward_mean"] for r in records]
    ax.plot(steps, rewards, ".", color="tab:blue", alpha=0.4, label="reward per step (rollouts)")
    k = max(1, len(rewards) // 8)
    smooth = [_mean(rewards[max(0, i - k + 1):i + 1]) for i in range(len(rewards))]
    ax.plot(steps, smooth, "-", color="tab:blue", label=f"reward, mean of the last {k} steps")
    xs = [steps[0] - 0.5, steps[-1] + 0.5]
    for key, fmt, color, what in (("heldout", "D--", "k", "held-out accuracy, {n} samples"),
                                  ("greedy_heldout", "s--", "tab:green", "greedy held-out accuracy, {n} problems")):
        h = summary.get(key)
        if not h:
            continue
        ys = [h["before"], h["after"]]
        err = [[y - ci[0] for y, ci in zip(ys, (h["before_ci"], h["after_ci"]))],
               [ci[1] - y for y, ci in zip(ys, (h["before_ci"], h["after_ci"]))]]
        ax.errorbar(xs, ys, yerr=err, fmt=fmt, color=color, capsize=5,
                    label=what.format(n=h["n"]) + f" (95% CI); p={h['p_value']:.2g}")
    evals = [(r["step"], r["eval_accuracy"]) for r in records if r.get("eval_accuracy") is not None]
    if evals:
        ax.plot(*zip(*evals), "k:", marker="x", label="greedy held-out (every evalEvery steps)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("reward / accuracy")
    ax.set_ylim(-0.02, 1.02)
    ax.legend(loc="upper left", fontsize="small")
    ax.set_title("Reward per step; held-out accuracy before and after")


def _plot_lengths(ax: Any, records: list[dict], _summary: dict, _compare: dict | None) -> None:
    from .rl.significance import length_profile

    steps = [r["step"] for r in records]
    prof = [length_profile(r["response_lengths"]) for r in records]
    for key, style in (("max", "tab:red"), ("p95", "tab:orange"), ("median", "tab:green")):
        ax.plot(steps, [p[key] for p in prof], marker=".", color=style, label=key)
    ax.set_xlabel("RL step")
    ax.set_ylabel("response length (tokens)")
    ax.set_yscale("log")
    ax.legend(loc="upper left", fontsize="small")
    ax.set_title("The long tail: response lengths per step")


def _plot_timeline(ax: Any, _records: list[dict], summary: dict, compare: dict | None) -> None:
    """Active batch over decode time for one step batch, speculative and plain, side by side."""
    assert compare is not None
    for key, label, color in (("ar_trace", "plain decoding", "tab:gray"), ("sd_trace", "speculative", "tab:blue")):
        trace = compare[key]
        t, xs, ys, on = 0.0, [], [], []
        for batch, sd_on, _emitted, seconds in trace:
            xs.append(t)
            ys.append(batch)
            on.append(sd_on)
            t += seconds
        ax.step(xs, ys, where="post", color=color, label=f"{label}: {t:.2f} s of decode steps")
        if key == "sd_trace" and any(on):
            ax.fill_between(xs, 0, ys, where=on, step="post", color=color, alpha=0.25,
                            label="speculation on")
    ax.set_xlabel("decode time within the step's rollout (s)")
    ax.set_ylabel("active sequences")
    ax.legend(loc="upper right", fontsize="small")
    speedup = summary.get("sd_rollout_speedup")
    ax.set_title("One step's rollout, SD vs plain" + (f": {speedup:.2f}x" if speedup else ""))


def _plot_acceptance(ax: Any, records: list[dict], _summary: dict, _compare: dict | None) -> None:
    steps = [r["step"] for r in records]
    ax.plot(steps, [r["acceptance_length"] if r["acceptance_length"] is not None else float("nan")
                    for r in records], marker="o", color="tab:purple", label="acceptance length")
    ax.set_xlabel("RL step")
    ax.set_ylabel("tokens per speculative step")
    ax.set_ylim(bottom=0)
    if all(r["acceptance_length"] is None for r in records):
        ax.text(0.5, 0.5, "no speculative decode step in any step\n(the toggle kept plain decoding)",
                ha="center", va="center", transform=ax.transAxes)
    twin = ax.twinx()
    twin.plot(steps, [100 * r["sd_share"] if r["sd_share"] is not None else float("nan") for r in records],
              ":", color="tab:gray", label="decode steps speculating (%)")
    twin.set_ylim(0, 105)
    twin.set_ylabel("% of decode steps speculating")
    lines = ax.get_lines() + twin.get_lines()
    ax.legend(lines, [x.get_label() for x in lines], loc="lower right", fontsize="small")
    ax.set_title("Speculative acceptance per step")


def _plot_time(ax: Any, records: list[dict], summary: dict, _compare: dict | None) -> None:
    steps = [r["step"] for r in records]
    parts = [("rollout (excl. tail)", [r["rollout_seconds"] - r["long_tail_seconds"] for r in records]),
             ("rollout: long tail", [r["long_tail_seconds"] for r in records]),
             ("train", [r["train_seconds"] for r in records]),
             ("sync + rest", [max(0.0, r["step_seconds"] - r["rollout_seconds"] - r["train_seconds"])
                              for r in records])]
    if len(records) > 60:  # bars narrower than a pixel alias away (a 400-step run showed a gap): stacked areas
        ax.stackplot(steps, *(values for _, values in parts), labels=[name for name, _ in parts], step="mid")
    else:
        bottom = [0.0] * len(records)
        for name, values in parts:
            ax.bar(steps, values, bottom=bottom, label=name)
            bottom = [b + v for b, v in zip(bottom, values)]
    speedup = summary.get("sd_rollout_speedup")
    if speedup:
        ax.plot(steps, [r["step_seconds"] + r["rollout_seconds"] * (speedup - 1) for r in records], "k--",
                label=f"step without speculation (rollout x{speedup:.2f}, projected)")
    ax.set_xlabel("RL step")
    ax.set_ylabel("seconds")
    share = summary.get("rollout_share")
    ax.set_title("Where time went per step" + (f" (rollout {100 * share:.0f}%)" if share else ""))
    ax.legend(loc="upper left", fontsize="small")


def _save(fig: Any, path: Path) -> Path:
    from matplotlib.ticker import MaxNLocator

    for ax in fig.axes:
        if ax.get_xlabel() == "RL step":
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    import matplotlib.pyplot as plt

    plt.close(fig)
    return path
