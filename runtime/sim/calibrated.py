"""Check the simulator against the real engine: feed it what `specrl bench rollout --json` measured on this
machine (step costs, acceptance, response lengths) and compare its predicted SD speedups with the measured ones.

Only measured inputs go in (the engine's calibrated cost model, each configuration's measured acceptance
length, the workload's response lengths and batch size); the measured speedups are what comes out to compare.
"""

from __future__ import annotations

from typing import Any

from ..engine.adaptive import alpha_from_mean_accepted
from .analysis import without_speculation
from .rl_sim import simulate
from .scenario import Scenario


def bench_lengths(bench: dict[str, Any]) -> list[int]:
    lengths = bench["workload"].get("response_lengths")
    if not lengths:
        raise ValueError("bench JSON: workload.response_lengths missing (re-run `specrl bench rollout --json`)")
    return [int(x) for x in lengths]


def scenario_from_bench(bench: dict[str, Any], method: str = "none", gamma: int = 1, alpha: float = 0.0,
                        lengths: list[int] | None = None) -> Scenario:
    """One rollout step of the bench's workload: `lengths` (default: all of its responses) admitted together."""
    wl = bench["workload"]
    lengths = lengths or bench_lengths(bench)
    return Scenario.model_validate({
        "name": f"cpu-calibrated-{method}-{gamma}",
        "cluster": {"gpu": "CPU", "gpus": 1},
        "model": "Qwen3-0.6B",  # only names the model; calibrated costs replace its roofline
        "placement": "colocated",
        "rollout": {"tensor_parallel": 1, "max_batch": int(wl["batch_size"])},
        "workload": {"steps": 1, "prompts_per_step": len(lengths), "group_size": 1,
                     "prompt_tokens": max(1, round(wl.get("prompt_tokens_mean", 16))),
                     "response": {"distribution": "empirical", "lengths": lengths, "exact": True,
                                  "max": max(lengths), "min": 1}},
        "speculative": {"drafter": method, "num_speculative_tokens": gamma, "policy": "always",
                        "overhead_ms": 0.0, "acceptance": {"alpha": min(alpha, 0.999)},
                        **({"draft_model": "Qwen3-0.6B"} if method == "draft_model" else {})},
        "calibration": bench["calibration"],
    })


def predict_bench(bench: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per fixed speculative configuration the bench measured: measured vs predicted speedup."""
    rows = []
    ar_time: float | None = None
    # the bench decodes its workload as rollout steps of `rollout_step` prompts, one after the other (older JSON:
    # one queue through `batch_size` slots, i.e. a single step)
    lengths = bench_lengths(bench)
    step = int(bench["workload"].get("rollout_step") or len(lengths))
    chunks = [lengths[i:i + step] for i in range(0, len(lengths), step)]
    for cfg in bench["configs"]:
        method, gamma = cfg.get("method"), cfg.get("gamma")
        if not method or method == "none" or not gamma or cfg.get("speedup_vs_ar") is None:
            continue
        if method not in bench["calibration"].get("r", {}):
            continue
        length = cfg.get("acceptance_length") or 1.0
        alpha = alpha_from_mean_accepted(length - 1.0, gamma)
        steps = [scenario_from_bench(bench, method, gamma, alpha, chunk) for chunk in chunks]
        if ar_time is None:
            ar_time = sum(simulate(without_speculation(s)).rollout_seconds for s in steps)
        predicted = ar_time / sum(simulate(s).rollout_seconds for s in steps)
        measured = float(cfg["speedup_vs_ar"])
        rows.append({"name": cfg["name"], "method": method, "gamma": gamma, "acceptance_length": length,
                     "measured_speedup": measured, "predicted_speedup": predicted,
                     "relative_error": predicted / measured - 1.0})
    return rows
