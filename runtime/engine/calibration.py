"""Start-up calibration of the cost model: run the engine itself, pinned to one decision at a time."""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .control import Decision, FixedController, StepRecord
from .cost_model import CostModel, low_percentile, round_alpha_from_record

DEFAULT_CALIBRATION_BATCH_SIZES: tuple[int, ...] = (1, 2, 4, 8, 16)
AR = Decision(None, 0)


@dataclass
class Calibration:
    """What `calibrate` measured: the cost model plus per-proposer acceptance seen while measuring."""

    cost_model: CostModel
    alpha: dict[str, float]
    seconds: float

    def summary(self) -> dict[str, Any]:
        cm = self.cost_model
        return {
            "seconds": round(self.seconds, 2),
            "target_step_ms": {b: round(t * 1e3, 3) for b, t in sorted(cm.target_step.items())},
            "v": {b: {g: round(cm.v(b, g), 3) for g in (2, 4, 6)} for b in sorted(cm.target_step)},
            "r": {m: {b: round(cm.r(m, b), 3) for b in sorted(cm.target_step)} for m in cm.methods},
            "overhead": {m: {b: round(cm.round_overhead(m, b), 3) for b in sorted(cm.target_step)}
                         for m in cm.methods},
            "alpha": {m: round(a, 3) for m, a in self.alpha.items()},
        }


def calibrate(engine: Any, prompts: Sequence[Sequence[int]], methods: Sequence[str] | None = None,
              batch_sizes: Sequence[int] = DEFAULT_CALIBRATION_BATCH_SIZES, gammas: Sequence[int] = (2, 6),
              steps: int = 10, rounds: int = 2, seed: int = 0, clock: str = "wall",
              progress: Callable[[str], None] | None = None,
              verify_gammas: Sequence[int] | None = None) -> Calibration:
    """Measure the cost model on this machine by running the engine itself, pinned to one decision at a time.

    For every batch size b (prompts are cycled to fill it) the engine decodes with plain steps (-> t(b)) and with
    every proposer at every γ in `gammas` (-> the verify cost of γ+1 tokens from the target part of the step, and
    the draft cost split into a per-token and a per-round part from two γ). The verification is also timed at every
    other γ in `verify_gammas` (default: 1 to the engine's longest draft), drafted by the cheapest proposer that
    drafts full rounds (γ tokens on every row) at least half the time: its cost is not linear in the tokens between
    two measured lengths (the CPU kernels take the rows of a forward in chunks of 6: at batch 4, 2 tokens a row cost
    1.75 plain steps and 3 cost 1.83, where a line through 1 and 3 put 2 at 1.28, and the policy ranked γ=1 above
    γ=2, which ran 1.06x faster). Every length is timed from that proposer's rounds that drafted γ on every row
    (`_verify_lengths`). Only steps at exactly batch b that ran the decision unchanged count; rounds are interleaved
    so a burst of load spreads over every measurement. The engine's controller is restored afterwards; its stats keep the calibration steps (they
    are real decode steps).
    """
    from .sampling import SamplingParams

    if len(gammas) < 1 or any(g < 1 for g in gammas):
        raise ValueError(f"calibrate: gammas must be >= 1, got {list(gammas)}")
    if not prompts:
        raise ValueError("calibrate: needs at least one prompt")
    methods = list(methods if methods is not None else getattr(engine, "proposers", {}))
    sizes = sorted({min(b, engine.max_batch_size) for b in batch_sizes})
    gammas = sorted(set(gammas))
    if verify_gammas is None:
        verify_gammas = range(1, int(getattr(engine, "max_gamma", gammas[-1])) + 1)
    verify_only = sorted(set(verify_gammas) - set(gammas))
    saved = engine.controller
    start = time.perf_counter()
    ar: dict[int, list[float]] = {b: [] for b in sizes}
    # per (proposer, b): the verification's seconds per length k, from the rounds that drafted γ = k-1 on every row
    verify: dict[tuple[str, int], dict[int, list[float]]] = {}
    draft: dict[tuple[str, int, int], list[float]] = {}
    alphas: dict[str, list[float]] = {m: [] for m in methods}
    # (proposer, b): [rounds that drafted γ tokens on every row, rounds]; a proposer that drafts full rounds at
    # least half the time can time the verification at every length
    full: dict[tuple[str, int], list[int]] = {}
    reference: dict[int, str] = {}  # per b: the proposer whose rounds time the verification at every length

    def run(b: int, decision: Decision, new_tokens: int) -> list[StepRecord]:
        fixed = FixedController(decision.method, decision.gamma, clock=clock)
        engine.controller = fixed
        engine.generate([list(prompts[i % len(prompts)]) for i in range(b)],
                        [SamplingParams(temperature=1.0, max_new_tokens=new_tokens, seed=seed + i) for i in range(b)])
        assert fixed.records is not None  # a controller with a clock records every step
        # Only steps that ran the decision as asked: at exactly batch b, and not a step whose γ was capped at the
        # rows' remaining budget or that decoded plainly because every row ended within one token (a drafter
        # that is always accepted ends every run so; its zero draft time would make drafting look free).
        return [r for r in fixed.records if r.batch_size == b and r.method == decision.method
                and r.gamma == decision.gamma]

    try:
        for _ in range(max(rounds, 1)):
            for b in sizes:
                if progress:
                    progress(f"calibrate: batch {b} AR")
                ar[b] += [r.seconds for r in run(b, AR, steps + 2)[1:]]  # step 1 warms caches
                for m in methods:
                    for g in gammas:
                        if progress:
                            progress(f"calibrate: batch {b} {m} γ={g}")
                        recs = run(b, Decision(m, g), (g + 1) * max(2, steps // 3) + 2)
                        # A round where some row drafted less (a row near its token budget, a draft that ended at
                        # EOS, an n-gram matcher that found nothing) is a shorter forward and a cheaper draft: only
                        # rounds that drafted γ tokens on every row time the proposer, where it has any. Rows that
                        # accept differently reach their budgets apart, so nearly every run at batch 4 and up ended
                        # with such a round, and as the cheapest sample it set the draft cost.
                        whole = [r for r in recs if r.draft_tokens == b * g]
                        verify.setdefault((m, b), {}).setdefault(g + 1, []).extend(r.target_seconds for r in whole)
                        draft.setdefault((m, b, g), []).extend(r.draft_seconds for r in whole or recs)
                        alphas[m] += [a for r in recs if (a := round_alpha_from_record(r)) is not None]
                        counts = full.setdefault((m, b), [0, 0])
                        counts[0] += len(whole)
                        counts[1] += len(recs)
                drafters = [m for m in methods
                            if draft.get((m, b, gammas[-1])) and 2 * full[(m, b)][0] >= full[(m, b)][1]]
                if drafters:
                    cheapest = reference.setdefault(
                        b, min(drafters, key=lambda m: low_percentile(draft[(m, b, gammas[-1])])))
                    for g in verify_only:
                        if progress:
                            progress(f"calibrate: batch {b} verify {g + 1} tokens")
                        recs = run(b, Decision(cheapest, g), (g + 1) * max(2, steps // 3) + 2)
                        verify.setdefault((cheapest, b), {}).setdefault(g + 1, []).extend(
                            r.target_seconds for r in recs if r.draft_tokens == b * g)
    finally:
        engine.controller = saved
    draft_step: dict[str, dict[int, float]] = {}
    overhead: dict[str, dict[int, float]] = {}
    draft_round: dict[str, dict[int, dict[int, float]]] = {}
    for m in methods:
        for b in sizes:
            by_g = {g: low_percentile(draft[(m, b, g)]) for g in gammas if draft.get((m, b, g))}
            if not by_g:
                continue
            gs = sorted(by_g)
            if len(gs) >= 2:  # draft(γ) = a + γ·c: c per draft token, a per round
                c = max((by_g[gs[-1]] - by_g[gs[0]]) / (gs[-1] - gs[0]), 0.0)
                a = max(by_g[gs[0]] - c * gs[0], 0.0)
            else:
                c, a = by_g[gs[0]] / gs[0], 0.0
            draft_step.setdefault(m, {})[b] = c
            overhead.setdefault(m, {})[b] = a
            draft_round.setdefault(m, {})[b] = dict(by_g)
    target = {b: low_percentile(xs) for b, xs in ar.items() if xs}
    model = CostModel(target_step=target,
                      verify_step={b: {1: target[b], **_verify_lengths(verify, methods, b, reference.get(b))}
                                   for b in sizes if b in target},
                      draft_step=draft_step, overhead=overhead, draft_round=draft_round)
    alpha = {m: sum(xs) / len(xs) for m, xs in alphas.items() if xs}
    return Calibration(model, alpha, time.perf_counter() - start)


def _verify_lengths(verify: Mapping[tuple[str, int], Mapping[int, list[float]]], methods: Sequence[str], b: int,
                    reference: str | None) -> dict[int, float]:
    """The verification's seconds per length at batch b, every length from the rounds of one proposer (`reference`;
    the others' only where it timed none). Why one: a forward costs more after a drafter that streams more memory
    of its own (the bench model's weights are larger than the L3), and pooled over every proposer's rounds the
    lengths every proposer ran (γ = 2 and 6) were timed after the n-gram matcher's free drafting, the rest after the
    cheapest full drafter's. At batch 2 on a Zen 5 (32 MiB L3), 3 tokens then stood at 1.87 ms and 4 at 2.96, the
    draft model's rounds measured 2.09 and 2.57; the policy's estimates scale every length by what the running
    lengths cost against their calibration, so that dip priced γ=4's verification 30% over its cost, and it drafted
    γ=2 (fixed γ=2 ran at 0.93x fixed γ=4, the policy at 0.87x)."""
    pooled: dict[int, list[float]] = {}
    for m in methods:
        for k, xs in verify.get((m, b), {}).items():
            pooled.setdefault(k, []).extend(xs)
    own = verify.get((reference, b), {}) if reference is not None else {}
    return {k: low_percentile(own[k] if own.get(k) else xs) for k, xs in sorted(pooled.items()) if xs}
