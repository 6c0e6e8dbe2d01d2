"""`specrl bench prefetch`: whether the engine's one-row weight-stream prefetch pays, by the weights' size.

The bfloat16 kernels can prefetch each weight stream in software; on the Zen 4 EPYC that paid only for one-row
steps of models not much larger than the L3, so the engine chooses per model (`cpu_kernels.prefetch_distance`).
This checks the choice on this machine: a real checkpoint cut to its first N layers for a range of N (so the
weights a step streams go from under twice the L3 to many times it), plain greedy decoding at batch 1 of the same
chat prompts with one-row tiles prefetched 8 KB ahead and without, in alternating order. Per size: the geomean of
the paired ratios with its 90% interval, the engine's choice, and whether the choice is the faster side (a tie
where the interval holds 1). Every other tile keeps the engine's setting: a batch-1 step runs one-row tiles only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from ..engine import RolloutEngine, SamplingParams, cpu_kernels
from ..engine.model_runner import decoder_of
from ..rl.significance import ratio_interval
from .rollout import REAL_PROMPTS, bench_threads, machine_info, progress_bar, quiet_transformers

AHEAD = 8192  # the one distance the kernels were tuned at (see `cpu_kernels.prefetch_distance`)
DEFAULT_LAYERS = (1, 3, 5, 7, 9, 11, 14, 18)  # and the whole model: SmolLM2 from 1.9x to 8x a 32 MiB L3


def layer_counts(spec: str | None, depth: int, quick: bool) -> list[int]:
    """The layer counts to measure, ascending: `spec` ("1,5,all"), else the defaults up to the model's depth."""
    if spec is None:
        return [1, 2] if quick else sorted({n for n in DEFAULT_LAYERS if n < depth} | {depth})
    counts = set()
    for part in spec.split(","):
        part = part.strip()
        n = depth if part == "all" else int(part) if part.isdigit() else 0
        if not 1 <= n <= depth:
            raise ValueError(f"--layers: each entry must be 'all' or a layer count from 1 to {depth}, got {part!r}")
        counts.add(n)
    return sorted(counts)


def verdict(chosen_one_row: int, interval: dict[str, Any] | None) -> str:
    """"agrees", "tie" or "disagrees": the engine's one-row choice against the measured ratio (one-row / none)."""
    if interval is None or interval["low"] <= 1 <= interval["high"]:
        return "tie"
    faster_with = interval["low"] > 1
    return "agrees" if faster_with == (chosen_one_row > 0) else "disagrees"


def truncated(name: str, layers: int) -> Any:
    """The checkpoint `name` keeping only its first `layers` decoder layers (and its embeddings, norm and head)."""
    from ..models.hub import load_causal_lm

    model = load_causal_lm(name)
    dec: Any = decoder_of(model)  # a Protocol types its layers as a Sequence; the model holds a ModuleList
    dec.layers = torch.nn.ModuleList(list(dec.layers)[:layers])
    model.config.num_hidden_layers = layers
    return model


def measure(name: str, layers: int, prompts: list[list[int]], params: SamplingParams, rounds: int,
            advance: Callable[[], None]) -> dict[str, Any]:
    engine = RolloutEngine(truncated(name, layers), max_batch_size=1, seed=0, dtype="auto")
    runner = engine.runner
    chosen = runner.prefetch
    if chosen is None:
        raise ValueError(f"the engine runs {name} in {runner.dtype} without the bfloat16 kernels on this CPU: "
                         "there is no prefetch to measure")
    engine.generate(prompts[:1], params)  # warm-up: first touches and kernel dispatch
    rates: dict[str, list[float]] = {"one_row": [], "none": []}
    for r in range(rounds):
        for side in ("one_row", "none") if r % 2 == 0 else ("none", "one_row"):
            runner.prefetch = (AHEAD if side == "one_row" else 0, chosen[1])
            start = time.process_time()
            outs = engine.generate(prompts, params)
            rates[side].append(sum(len(o.token_ids) for o in outs) / (time.process_time() - start))
        advance()
    runner.prefetch = chosen
    l3 = cpu_kernels.l3_bytes()
    interval = ratio_interval([a / b for a, b in zip(rates["one_row"], rates["none"])])
    return {"layers": layers, "weight_bytes": runner.kernel_bytes,
            "times_l3": round(runner.kernel_bytes / l3, 2) if l3 else None, "chosen": list(chosen),
            "tokens_per_cpu_s": {k: round(statistics.median(v), 1) for k, v in rates.items()},
            "per_round": {k: [round(x, 1) for x in v] for k, v in rates.items()},
            "one_row_vs_none": interval, "verdict": verdict(chosen[0], interval)}


def run(name: str, layers: str | None, quick: bool, rounds: int, progress: Callable[[str], None],
        advance: Callable[[], None], start_total: Callable[[int], None]) -> dict[str, Any]:
    from ..models.hub import load_causal_lm, load_tokenizer

    tok = load_tokenizer(name)
    depth = len(decoder_of(load_causal_lm(name)).layers)
    counts = layer_counts(layers, depth, quick)
    start_total(len(counts) * rounds)
    prompts = [tok.prompt_ids(text) for text in REAL_PROMPTS[:2]]
    params = SamplingParams(temperature=0.0, max_new_tokens=8 if quick else 48, stop_token_ids=tuple(tok.stop_ids))
    rows = []
    for n in counts:
        progress(f"{n} of {depth} layers")
        rows.append(measure(name, n, prompts, params, rounds, advance))
    return {"model": name, "depth": depth, "rounds": rounds, "ahead_bytes": AHEAD, "l3_bytes": cpu_kernels.l3_bytes(),
            "sizes": rows, "machine": machine_info(None, None)}


def _table(result: dict[str, Any]) -> Any:
    from rich.table import Table

    t = Table(title=f"one-row prefetch ({result['ahead_bytes']} B ahead) vs none, plain decoding at batch 1, "
                    f"{result['model']}, {result['rounds']} paired rounds")
    # tokens per CPU-second (medians); the ratio: geomean of the paired rounds, one-row over none
    for col in ("layers", "MiB", "x L3", "one-row", "none", "ratio [90%]", "engine", "choice"):
        t.add_column(col, justify="left" if col == "choice" else "right")
    for row in result["sizes"]:
        iv = row["one_row_vs_none"]
        ratio = f"{iv['geomean']:.3f} [{iv['low']:.3f}, {iv['high']:.3f}]" if iv else "-"
        t.add_row(str(row["layers"]), f"{row['weight_bytes'] / 2**20:.0f}", str(row["times_l3"] or "-"),
                  f"{row['tokens_per_cpu_s']['one_row']:.1f}", f"{row['tokens_per_cpu_s']['none']:.1f}", ratio,
                  "one-row" if row["chosen"][0] else "none", row["verdict"])
    return t


def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    quick = bool(getattr(args, "quick", False))
    rounds = getattr(args, "repeats", None) or (2 if quick else 20)
    torch.set_num_threads(bench_threads())
    quiet_transformers()
    with progress_bar(None, "loading") as (describe, advance, set_total):
        try:
            result = run(args.model, getattr(args, "layers", None), quick, rounds, describe, advance, set_total)
        except ValueError as exc:
            print(f"specrl bench prefetch: {exc}", file=sys.stderr)
            return 2
    out = Console()
    out.print(_table(result))
    if getattr(args, "json", None):
        Path(args.json).write_text(json.dumps(result, indent=2))
        out.print(f"wrote {args.json}")
    return 0
