"""Check the simulator against the real engine: feed it what `specrl bench rollout --json` measured on this
machine (step costs, acceptance, response lengths) and compare its predicted SD speedups with the measured ones.

Only measured inputs go in (the engine's calibrated cost model, each configuration's measured acceptance
length, the workload's response lengths and batch size); the measured speedups are what comes out to compare.
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..engine.adaptive import alpha_from_mean_accepted
from .analysis import without_speculation
from .rl_sim import simulate
from .scenario import MAX_SEQUENCES, MAX_TOKENS, Calibration, Scenario, validation_problems


class _BenchPart(BaseModel):
    # the bench writes many more keys than the simulator reads
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)


class BenchWorkload(_BenchPart):
    batch_size: int = Field(ge=1, le=MAX_SEQUENCES)
    response_lengths: list[Annotated[int, Field(ge=0, le=MAX_TOKENS)]] | None = None
    prompt_tokens_mean: float = Field(16.0, ge=0, le=MAX_TOKENS)
    rollout_step: int | None = Field(None, ge=1)


class BenchConfig(_BenchPart):
    name: str
    method: str | None = None
    gamma: int | None = Field(None, ge=1, le=16)
    acceptance_length: float | None = Field(None, ge=1, le=17)
    speedup_vs_ar: float | None = Field(None, gt=0)


class BenchFile(_BenchPart):
    """What `--from-bench` reads of a `specrl bench rollout --json` file."""

    workload: BenchWorkload
    calibration: Calibration
    configs: list[BenchConfig]


def check_bench(bench: Any) -> None:
    """ValueError with one `field.path: message` line per problem when `bench` is not a bench rollout JSON."""
    if not isinstance(bench, dict):
        raise ValueError(f"expected a JSON object (what `specrl bench rollout --json` writes), got "  # noqa: TRY004
                         f"{'null' if bench is None else type(bench).__name__}")
    try:
        BenchFile.model_validate(bench)
    except ValidationError as exc:
        raise ValueError("; ".join(validation_problems(exc))) from None


def bench_lengths(bench: dict[str, Any]) -> list[int]:
    lengths = bench["workload"].get("response_lengths")
    if not lengths:
        raise ValueError("bench JSON: workload.response_lengths missing (re-run `specrl bench rollout --json`)")
    # an empty response still takes a prefill and a step: the simulator's shortest response is one token
    return [max(1, int(x)) for x in lengths]


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
    check_bench(bench)
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
