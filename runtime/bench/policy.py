"""`specrl bench policy [--quick] [--repeats N] [--ring] [--serving] [--by-batch] [--json FILE]`: what the adaptive
policy itself costs on the long-tail workload, and where its choices lose.

The long-tail workload of `specrl bench rollout` alone (its models, prompts, sampling seeds and calibration), in
lockstep: plain decoding, draft_model γ=4 and γ=6, the adaptive policy, and the policy's **shadow**: fixed γ=6 with
a policy deciding (and learning) beside it, its decisions discarded, so that only the policy's own cost separates
the shadow from γ=6 (its texts are γ=6's: the same seeds, the same choices). Where the policy trails γ=6 and its
shadow does too, the policy's cost is the gap; where the shadow is at par, its choices are.

`--ring`: the rollout benchmark's other fixed configurations join the lockstep ring (ten engines, as there: each
50 ms slice finds every cache colder). `--serving`: between repeats the serving shape (a queue refilling 16 slots)
runs on the same controllers, as `bench rollout` runs it on its policy. Measured on the AMX Xeon (480 MiB L3): with
neither, the policy read 1.00x γ=6 over 12 repeats; with both (8 repeats), 0.955x, near its 0.93-0.95x in
`bench rollout`, and its shadow 1.005x: there the policy's choices lose, not its cost.

`--by-batch`: also print the long tail per batch size (every configuration's rate there, what the policy ran, the
speed it predicts there for its best proposer once the runs are over, its cost per step); the JSON always has it
(`by_batch`, with each policy's table and step costs at the end: `estimates_at_end`), and beside it the
calibration's plain step and verification costs per batch size against what the fixed configurations' steps measured
on the long tail (`calibration_vs_run`): where the policy does not run an option, the calibration prices it.

Reported on the common token mix (`rollout.mix_rates`: the plain runs' tokens per batch-size bucket, each timed at
the configuration's own rate there): each configuration against γ=6, pooled and per repeat, and per bucket; and
the controller's own CPU time per decode step (`rollout.Timeline`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..engine.adaptive import AdaptiveController, AdaptiveSettings
from ..engine.calibration import calibrate
from ..engine.control import Decision, FixedController, StepRecord
from ..engine.cost_model import CostModel, low_percentile
from . import rollout as R

REFERENCE = "draft_model-g6"
CORE = ("ar", "draft_model-g4", REFERENCE)


class Shadow:
    """Fixed `decision` at every step, with `policy` deciding and learning beside it (its choice discarded)."""

    def __init__(self, policy: AdaptiveController, decision: Decision) -> None:
        self.policy = policy
        self.decision = decision

    def decide(self, active_batch_size: int) -> Decision:
        self.policy.decide(active_batch_size)
        return self.decision

    def observe(self, decision: Decision, record: StepRecord) -> None:
        self.policy.observe(decision, record)

    def warm_proposers(self, active_batch_size: int) -> list[str]:
        self.policy.warm_proposers(active_batch_size)
        return [self.decision.method] if self.decision.method else []

    def stats(self) -> dict[str, Any]:
        return self.policy.stats()

    def decisions_by_batch_size(self) -> dict[int, dict[str, int]]:
        return self.policy.decisions_by_batch_size()


def run(quick: bool, repeats: int, ring: bool, serving: bool, progress: Callable[[str], None],
        advance: Callable[[], None]) -> dict[str, Any]:
    plan = R.Plan.make(quick, repeats)
    models = R.load_models(quick, progress)
    engine, available, _ = R.build_engine(models, progress)
    if "draft_model" not in available:
        raise ValueError(f"the draft model proposer could not be built (available: {available})")
    prompts = R.workload(plan.prompts)
    progress("calibrating the cost model")
    cal = calibrate(engine, prompts, methods=available, batch_sizes=plan.calibration_batch_sizes,
                    rounds=plan.calibration_rounds, steps=3 if quick else 10, clock=R.CLOCK, progress=progress)

    def policy() -> AdaptiveController:
        return AdaptiveController(available, cost_model=cal.cost_model, alpha_priors=cal.alpha,
                                  settings=AdaptiveSettings(clock=R.CLOCK))

    fixed = {name: (m, g) for name, m, g in R.FIXED_CONFIGS
             if (ring or name in CORE) and (m is None or m in available)}
    learners: dict[str, AdaptiveController | Shadow] = {
        "adaptive": policy(), "shadow": Shadow(policy(), Decision("draft_model", 6))}
    progress("building an engine per configuration")
    engines = {name: R.engine_like(models, available) for name in [*fixed, *learners]}
    runs: dict[str, list[R.RunResult]] = {name: [] for name in engines}
    # what each learner chose per batch size on the long tail (the shadow's: what its policy would have run)
    chosen: dict[str, dict[int, Counter[str]]] = {name: {} for name in learners}
    for r in range(repeats):
        params = R.sampling(len(prompts), plan.max_new_tokens, models.eos_id, offset=1000 * r, seed=plan.seed)
        controllers: dict[str, Any] = {name: FixedController(m, g) for name, (m, g) in fixed.items()}
        controllers.update(learners)
        progress(f"long-tail workload, repeat {r + 1}/{repeats}: {len(controllers)} configurations in lockstep")
        before = {name: _decisions(c) for name, c in learners.items()}
        for name, x in R.side_by_side(engines, controllers, prompts, params, rotate=r,
                                      step_size=R.ROLLOUT_STEP).items():
            runs[name].append(x)
        for name, c in learners.items():
            for b, counts in _decisions(c).items():
                chosen[name].setdefault(b, Counter()).update(counts - before[name].get(b, Counter()))
        if serving:
            progress(f"serving shape, repeat {r + 1}/{repeats}")
            R.side_by_side(engines, {"ar": FixedController(None), **learners}, prompts, params, rotate=r)
        advance()
    result = summarize(runs, fixed, repeats, {"ring": ring, "serving": serving, "quick": quick,
                                              "machine": R.machine_info(engine, None),
                                              "calibration": cal.summary()})
    result["by_batch"] = by_batch(runs, chosen)
    result["calibration_vs_run"] = calibration_vs_run(cal.cost_model, runs, fixed)
    for row in result["by_batch"]:
        row["estimates_at_end"] = {name: estimates_at(c if isinstance(c, AdaptiveController) else c.policy,
                                                      row["batch_size"]) for name, c in learners.items()}
    return result


def estimates_at(policy: AdaptiveController, batch: int) -> dict[str, Any]:
    """What the policy believes at this batch size once the runs are over: its table (each option's predicted
    speed against plain decoding, and γ), the plain step, and each draft length's verification and drafting in
    plain steps. Where its choices lost, these say whether a cost or the acceptance was mispriced."""
    costs = policy.costs
    gammas = policy.settings.gammas()
    out: dict[str, Any] = {"table": {("ar" if k is None else k): [round(speed, 3), d.gamma]
                                     for k, (speed, d) in policy.table(batch).items()}}
    if costs is not None:
        out["plain_ms"] = round(1e3 * costs.t_ar(batch), 3)
        out["verify_vs_plain"] = {g: round(v, 3) for g, v in costs.verify_ratios(batch, gammas).items()}
        out["draft_vs_plain"] = {m: {g: round(v, 3) for g, v in costs.draft_ratios(m, batch, gammas).items()}
                                 for m in policy.methods if costs.knows(m)}
    return out


def calibration_vs_run(costs: CostModel, runs: dict[str, list[R.RunResult]], fixed: dict[str, Any]
                       ) -> list[dict[str, Any]]:
    """Per batch size, the calibration's plain step and verification costs (in plain steps) beside what the fixed
    configurations' steps on the long tail measured (a low quantile of their forwards, `RunResult.forwards`: the
    plain configuration's plain steps, the draft model's rounds at each of its γ). Wherever the policy has not run
    an option lately its cost is the calibration's, moved by the level of what does run there: a calibration that
    prices verification high against a plain step leans the policy towards plain decoding until a speculation
    recheck times a verification (`adaptive.py`)."""
    plain_runs = [name for name, (m, _) in fixed.items() if m is None]
    verifiers = [name for name, (m, _) in fixed.items() if m == "draft_model"]
    gammas = sorted({fixed[name][1] for name in verifiers})
    sizes = sorted({b for name in plain_runs for x in runs[name] for b, k in x.forwards if k == 1})
    out = []
    for b in sizes:
        plain = [t for name in plain_runs for x in runs[name] for t in x.forwards.get((b, 1), [])]
        if len(plain) < 3:
            continue
        run_plain = low_percentile(plain, 0.25)
        calibrated = costs.verify_ratios(b, gammas)
        verify = {}
        for g in gammas:
            xs = [t for name in verifiers for x in runs[name] for t in x.forwards.get((b, g + 1), [])]
            verify[g] = {"calibration": round(calibrated[g], 3), "samples": len(xs),
                         "run": round(low_percentile(xs, 0.25) / run_plain, 3) if len(xs) >= 3 else None}
        out.append({"batch_size": b, "plain_ms": {"calibration": round(1e3 * costs.t_ar(b), 3),
                                                  "run": round(1e3 * run_plain, 3), "samples": len(plain)},
                    "verify_vs_plain": verify})
    return out


def _decisions(controller: AdaptiveController | Shadow) -> dict[int, Counter[str]]:
    return {b: Counter(c) for b, c in controller.decisions_by_batch_size().items()}


def by_batch(runs: dict[str, list[R.RunResult]], chosen: dict[str, dict[int, Counter[str]]]) -> list[dict[str, Any]]:
    """Per batch size the long tail visited: every configuration's tokens per CPU-second there (pooled over
    repeats), each learner's choices and decode steps there, and the policy's own CPU time per step there. The tail
    visits most sizes for a step or two per rollout step, so these rest on a few dozen steps each: they show what a
    bucket's ratio hides (a size where the policy decoded plainly while a fixed configuration ran 1.3x plain), not
    a measurement to quote alone."""
    sizes = sorted({b for rs in runs.values() for x in rs for b in x.by_batch})
    out = []
    for b in sizes:
        rates = {}
        for name, rs in runs.items():
            tokens = sum(x.by_batch.get(b, [0.0, 0.0, 0.0])[0] for x in rs)
            cpu = sum(x.by_batch.get(b, [0.0, 0.0, 0.0])[1] for x in rs)
            rates[name] = tokens / cpu if cpu > 0 else None
        steps = {name: sum(x.policy_by_batch.get(b, [0, 0.0])[0] for x in runs[name]) for name in chosen}
        policy = {name: 1e6 * sum(x.policy_by_batch.get(b, [0, 0.0])[1] for x in runs[name]) / steps[name]
                  if steps[name] else None for name in chosen}
        out.append({"batch_size": b, "tokens_per_cpu_s": rates,
                    "chosen": {name: dict(c.get(b, Counter()).most_common()) for name, c in chosen.items()},
                    "steps": steps, "policy_us_per_step": policy})
    return out


def summarize(runs: dict[str, list[R.RunResult]], fixed: dict[str, Any], repeats: int,
              info: dict[str, Any]) -> dict[str, Any]:
    """Every configuration against γ=6 on the common token mix: pooled, per repeat and per bucket."""
    pooled = R.mix_rates(runs, "ar")
    per_repeat = [R.mix_rates({n: rs[r:r + 1] for n, rs in runs.items()}, "ar")["tokens_per_cpu_s"]
                  for r in range(repeats)]
    rates, buckets = pooled["tokens_per_cpu_s"], pooled["tokens_per_cpu_s_by_bucket"]
    rows = {}
    for name, rs in runs.items():
        ratios = [p[name] / p[REFERENCE] for p in per_repeat if p[name] and p[REFERENCE]]
        rows[name] = {
            "tokens_per_cpu_s": rates[name],
            "tokens": [x.tokens for x in rs],  # per repeat (the shadow's are γ=6's: the same texts)
            "vs_reference": rates[name] / rates[REFERENCE] if rates[name] and rates[REFERENCE] else None,
            "vs_reference_per_repeat": [round(x, 3) for x in ratios],
            "vs_reference_median": statistics.median(ratios) if ratios else None,
            "vs_reference_by_bucket": [round(a / b, 3) if b else None
                                       for a, b in zip(buckets[name], buckets[REFERENCE])],
            "policy_us_per_step": R.med([1e6 * x.policy_cpu_seconds / x.steps for x in rs if x.steps]),
            "policy_cpu_share": R.med([x.policy_cpu_seconds / x.cpu_seconds for x in rs if x.cpu_seconds]),
        }
    return {**info, "repeats": repeats, "reference": REFERENCE, "configurations": list(runs),
            "fixed": list(fixed), "buckets": pooled["buckets"], "reference_tokens": pooled["reference_tokens"],
            "rows": rows}


def _table(result: dict[str, Any]) -> Any:
    from rich.table import Table

    buckets = " / ".join(f"{lo}" if lo == hi else f"{lo}–{hi}" for lo, hi in result["buckets"])
    t = Table(title=f"long-tail workload vs {result['reference']} (common token mix, {result['repeats']} repeats"
                    f"{', ring of ten' if result['ring'] else ''}{', serving between repeats' if result['serving'] else ''})")
    for col in ("configuration", "tok/CPU-s", "vs γ=6", "per repeat", f"by batch ({buckets})", "µs/step"):
        t.add_column(col)

    def f(x: float | None, nd: int = 3) -> str:
        return "n/a" if x is None else f"{x:.{nd}f}"

    for name, row in result["rows"].items():  # the names as `bench rollout` prints them
        per = row["vs_reference_per_repeat"]
        t.add_row(name, f(row["tokens_per_cpu_s"], 1), f(row["vs_reference"]),
                  f"{f(row['vs_reference_median'], 2)} ({f(min(per) if per else None, 2)}–"
                  f"{f(max(per) if per else None, 2)})",
                  " / ".join(f(x, 2) for x in row["vs_reference_by_bucket"]), f(row["policy_us_per_step"], 0))
    return t


def _batch_table(result: dict[str, Any]) -> Any:
    from rich.table import Table

    rows = result["by_batch"]
    names = [n for n in ("ar", "draft_model-g2", "draft_model-g4", REFERENCE, "adaptive", "shadow")
             if n in result["rows"]]
    t = Table(title="long tail per batch size (tok/CPU-s, pooled over repeats; a few dozen steps each)")

    def short(label: str) -> str:
        return label.replace("draft_model", "dm").replace("quantized_self", "qs").replace("layer_skip", "ls")

    for col in ("b", *(short(n) for n in names), "adaptive vs best fixed", "adaptive ran (top 3)",
                "its best proposer at end (predicted)", "µs/step"):
        t.add_column(col)
    for row in rows:
        rates = row["tokens_per_cpu_s"]
        best = max((v for k, v in rates.items() if k in result["fixed"] and v), default=None)
        ours = rates.get("adaptive")
        ran = ", ".join(f"{short(k)} x{n}" for k, n in list(row["chosen"].get("adaptive", {}).items())[:3])
        us = row["policy_us_per_step"].get("adaptive")
        table = {k: v for k, v in row["estimates_at_end"]["adaptive"]["table"].items() if k != "ar"}
        lead = max(table, key=lambda k: table[k][0], default=None)
        predicted = f"{short(lead)}:{table[lead][1]} {table[lead][0]:.2f}x plain" if lead else "n/a"
        t.add_row(str(row["batch_size"]), *("n/a" if rates.get(n) is None else f"{rates[n]:.0f}" for n in names),
                  "n/a" if not best or ours is None else f"{ours / best:.2f}", ran, predicted,
                  "n/a" if us is None else f"{us:.0f}")
    return t


def _calibration_table(result: dict[str, Any]) -> Any:
    from rich.table import Table

    rows = result["calibration_vs_run"]
    gammas = sorted({int(g) for row in rows for g in row["verify_vs_plain"]})
    t = Table(title="calibration vs the long tail's steps (plain step in ms; verification of γ+1 tokens in plain "
                    "steps; calibration / run)")
    for col in ("b", "plain ms", *(f"γ={g}" for g in gammas)):
        t.add_column(col)

    def pair(x: dict[str, Any], nd: int) -> str:
        run = x.get("run")
        return f"{x['calibration']:.{nd}f} / " + ("n/a" if run is None else f"{run:.{nd}f}")

    for row in rows:
        v = row["verify_vs_plain"]
        t.add_row(str(row["batch_size"]), pair(row["plain_ms"], 2),
                  *(pair(v[g], 2) if g in v else "n/a" for g in gammas))
    return t


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    quick = bool(getattr(args, "quick", False))
    repeats = getattr(args, "repeats", None) or (1 if quick else 12)
    torch.set_num_threads(R.bench_threads())
    R.quiet_transformers()
    with R.progress_bar(repeats, "loading") as (describe, advance, _):
        try:
            result = run(quick, repeats, bool(getattr(args, "ring", False)), bool(getattr(args, "serving", False)),
                         describe, advance)
        except ValueError as exc:
            print(f"specrl bench policy: {exc}", file=sys.stderr)
            return 2
    out = Console()
    out.print(_table(result))
    if getattr(args, "by_batch", False):
        out.print(_batch_table(result))
        out.print(_calibration_table(result))
    if getattr(args, "json", None):
        Path(args.json).write_text(json.dumps(result, indent=2, default=str))
        out.print(f"wrote {args.json}")
    return 0
