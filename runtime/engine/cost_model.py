"""The cost model of speculative decoding on this machine: expected tokens per round, and step costs per batch size.

A round with draft length γ and per-token acceptance α emits L = (1 − α^(γ+1)) / (1 − α) tokens and costs
d + v plain steps (d: drafting γ tokens, the proposer's fixed work per round included; v: verifying γ+1 tokens).
Where acceptance is known per draft position (p_j: the chance that draft j is accepted given drafts 1..j−1 were),
L = 1 + Σ_{i≤γ} Π_{j≤i} p_j instead (`Acceptance`): the geometric law overrates long drafts when later positions
are accepted less often.
`CostModel` holds the measured seconds behind d and v per batch size and length, interpolated in between (and the
calibration's per-token r and per-round a, a straight-line fit of d, for reports and the simulator).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .control import StepRecord


def expected_tokens_per_round(alpha: float, gamma: int) -> float:
    """L = (1 − α^(γ+1)) / (1 − α): expected tokens emitted by one round with γ drafts (bonus token included)."""
    if gamma < 0:
        raise ValueError(f"gamma must be >= 0, got {gamma}")
    if not 0.0 <= alpha <= 1.0:
        raise ValueError(f"alpha must lie in [0, 1], got {alpha}")
    if alpha >= 1.0 - 1e-12:
        return float(gamma + 1)
    return (1.0 - alpha ** (gamma + 1)) / (1.0 - alpha)


# Acceptance: one α for every draft position, or the conditional acceptance p_1, p_2, ... of each position (the last
# one holds for every position beyond).
Acceptance = float | Sequence[float]


def round_lengths(acceptance: Acceptance, gammas: Iterable[int]) -> dict[int, float]:
    """Expected tokens emitted by one round (bonus token included) for each γ in `gammas`."""
    gammas = list(gammas)
    if isinstance(acceptance, (int, float)):
        return {g: expected_tokens_per_round(float(acceptance), g) for g in gammas}
    if not acceptance:
        raise ValueError("acceptance: needs at least one position")
    if any(not 0.0 <= p <= 1.0 for p in acceptance):
        raise ValueError(f"acceptance: every position must lie in [0, 1], got {list(acceptance)}")
    out, total, survive = {}, 1.0, 1.0
    wanted = set(gammas)
    for i in range(1, max(gammas, default=0) + 1):
        survive *= acceptance[min(i, len(acceptance)) - 1]
        total += survive
        if i in wanted:
            out[i] = total
    if 0 in wanted:
        out[0] = 1.0
    return {g: out[g] for g in gammas}


def predicted_speedup(alpha: float, gamma: int, r: float, v: float) -> float:
    """Speedup of one speculative round over plain decoding: L / (γ·r + v)."""
    cost = gamma * r + v
    if cost <= 0:
        raise ValueError(f"round cost γ·r + v must be > 0, got {cost} (r={r}, v={v}, γ={gamma})")
    return expected_tokens_per_round(alpha, gamma) / cost


def alpha_from_mean_accepted(mean_accepted: float, gamma: int) -> float:
    """Invert E[accepted drafts] = α(1 − α^γ)/(1 − α) for α (bisection; the map is increasing in α)."""
    if gamma < 1:
        raise ValueError(f"gamma must be >= 1, got {gamma}")
    target = min(max(mean_accepted, 0.0), float(gamma))
    if target <= 0.0:
        return 0.0
    if target >= gamma:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(24):  # 6e-8 resolution: far below the noise of one round's estimate
        mid = (lo + hi) / 2
        if expected_tokens_per_round(mid, gamma) - 1.0 < target:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


def round_alpha_from_record(record: StepRecord) -> float | None:
    """α of one speculative step from the engine's totals (None when nothing was drafted)."""
    if record.gamma < 1 or record.draft_tokens <= 0:
        return None
    drafting = max(record.draft_tokens / record.gamma, 1e-9)  # sequences that drafted (ragged proposers: fewer)
    return alpha_from_mean_accepted(record.accepted_tokens / drafting, record.gamma)


def low_percentile(xs: Iterable[float], q: float = 0.2) -> float:
    """The q-quantile of timings: other processes only ever add time, so a low quantile estimates the intrinsic
    cost far more stably than the mean (the minimum would be too optimistic)."""
    ordered = sorted(xs)
    if not ordered:
        raise ValueError("no samples")
    return ordered[min(int(q * len(ordered)), len(ordered) - 1)]


def interp_log_batch(points: Mapping[int, float], x: float) -> float:
    """Piecewise-linear in log(batch size), clamped at the ends: step costs grow smoothly with b."""
    return _interp_with(sorted(points), points.__getitem__, x)


def _bracket(keys: Sequence[int], x: float) -> list[tuple[int, float]]:
    """The (key, weight) pairs that piecewise-linear interpolation in log(x) over sorted `keys` mixes at x."""
    if not keys:
        raise ValueError("no calibration points")
    if x <= keys[0]:
        return [(keys[0], 1.0)]
    if x >= keys[-1]:
        return [(keys[-1], 1.0)]
    i = bisect.bisect_right(keys, x)
    a, b = keys[i - 1], keys[i]
    w = (math.log(x) - math.log(a)) / (math.log(b) - math.log(a))
    return [(a, 1 - w), (b, w)]


def _interp_with(keys: Sequence[int], value: Callable[[int], float], x: float) -> float:
    """`interp_log_batch` over sorted `keys`, evaluating `value` only at the (at most two) keys that bracket x."""
    return sum(value(k) * w for k, w in _bracket(keys, x))


def linear_in_tokens(by_k: Mapping[int, float], tokens: int, ks: Sequence[int] | None = None) -> float:
    """by_k at `tokens`, linear between measured token counts (`ks`: sorted keys of by_k, if already known)."""
    exact = by_k.get(tokens)
    if exact is not None:
        return exact
    ks = sorted(by_k) if ks is None else ks
    if len(ks) == 1:
        return by_k[ks[0]] * tokens / ks[0]
    i = bisect.bisect_left(ks, tokens)
    if 0 < i < len(ks):
        lo, hi = ks[i - 1], ks[i]
        return by_k[lo] + (by_k[hi] - by_k[lo]) / (hi - lo) * (tokens - lo)
    # outside the measured range: extend the nearest segment, never downhill (a noisy pair of timings under load
    # once extrapolated the verify cost of 7 tokens to 0, and the toggle then speculated at α≈0.2 and ran at 0.76x
    # plain decoding)
    above = i > 0
    lo, hi = (ks[-2], ks[-1]) if above else (ks[0], ks[1])
    slope = max(by_k[hi] - by_k[lo], 0.0) / (hi - lo)
    return by_k[hi] + slope * (tokens - hi) if above else by_k[lo] - slope * (lo - tokens)


@dataclass
class CostModel:
    """Step costs on this machine (seconds) at measured batch sizes, interpolated in between.

    ``target_step[b]``: one plain decode step at batch b. ``verify_step[b][k]``: one target forward over k new
    tokens per sequence (k = γ+1 when verifying). ``draft_round[m][b][γ]``: proposer m's drafting in one round
    with draft length γ (its catch-up on the tokens it has not seen plus γ draft steps), measured per γ like the
    verification; where a batch size has none, ``draft_step[m][b]`` per draft token and ``overhead[m][b]`` per
    round (the calibration's straight-line fit) stand in.
    """

    target_step: dict[int, float]
    verify_step: dict[int, dict[int, float]]
    draft_step: dict[str, dict[int, float]] = field(default_factory=dict)
    overhead: dict[str, dict[int, float]] = field(default_factory=dict)
    draft_round: dict[str, dict[int, dict[int, float]]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not self.target_step:
            raise ValueError("CostModel.target_step: needs at least one calibrated batch size")
        for b, t in self.target_step.items():
            if b < 1 or not t > 0:
                raise ValueError(f"CostModel.target_step[{b}]: batch must be >= 1 and cost > 0, got {t}")

    @property
    def methods(self) -> list[str]:
        return sorted(set(self.draft_step) | set(self.draft_round))

    def knows(self, method: str) -> bool:
        """Whether proposer `method`'s drafting cost has been measured (calibrated or observed)."""
        return method in self.draft_step or method in self.draft_round

    def t_ar(self, batch: int) -> float:
        # a measured batch size is its own value (what the interpolation gives there, without sorting the keys:
        # every step folded into the estimates reads it twice)
        exact = self.target_step.get(batch)
        return exact if exact is not None else interp_log_batch(self.target_step, batch)

    def v(self, batch: int, gamma: int) -> float:
        """verify(γ+1 tokens) / `plain_step` at this batch size (linear in tokens between measured k)."""
        return self.verify_ratios(batch, (gamma,))[gamma]

    def verify_ratios(self, batch: int, gammas: Iterable[int]) -> dict[int, float]:
        """`v(batch, γ)` for every γ in `gammas`, reading each bracketing batch size's measurements once (the
        controller evaluates every γ at every table refresh)."""
        gammas = list(gammas)
        if not self.verify_step:
            return {g: float(g + 1) for g in gammas}
        out = dict.fromkeys(gammas, 0.0)
        for b, w in _bracket(sorted(self.verify_step), batch):
            t = self.plain_step(b)
            points = {**self.verify_step[b], 1: t}
            ks = sorted(points)
            for g in gammas:
                out[g] += linear_in_tokens(points, g + 1, ks) / t * w
        return out

    def verify_seconds(self, batch: int, lengths: Iterable[int]) -> dict[int, float]:
        """One target forward over k tokens per sequence at this batch size, in seconds, for every k in `lengths`
        (k = 1: the plain step): linear in tokens between measured k, interpolated in log(b) between batch sizes."""
        lengths = list(lengths)
        out = dict.fromkeys(lengths, 0.0)
        for b, w in _bracket(sorted(self.verify_step), batch):
            points = {**self.verify_step[b], 1: self.target_step.get(b) or self.t_ar(b)}
            ks = sorted(points)
            for k in lengths:
                out[k] += linear_in_tokens(points, k, ks) * w
        return out

    def plain_step(self, batch: int) -> float:
        """The unit of the ratios at this batch size: the plain step, capped at the cheapest verification estimate
        here (calibrated or measured by steps). At one moment verifying γ+1 tokens never costs less than the
        one-token step it replaces; estimates that say otherwise were taken at different moments (a plain step
        timed under load, or on the longer contexts of rows that are gone, is re-measured only now and then while
        speculation runs). Clamping each verification up to a stale plain step instead gave every short draft
        length the same cost: at batch 2, γ=2 and γ=3 both cost "one plain step" and the policy ran γ=3 at 1.68x
        plain where γ=2 ran at 1.98x. Capped, the choice between draft lengths reads their costs as measured."""
        t = self.target_step.get(batch) or self.t_ar(batch)
        return min([t, *(x for k, x in self.verify_step.get(batch, {}).items() if k > 1)])

    def r(self, method: str, batch: int) -> float:
        if method not in self.draft_step:
            raise KeyError(f"CostModel: proposer {method!r} was not calibrated (have {self.methods})")
        return self._relative(self.draft_step[method], batch)

    def round_overhead(self, method: str, batch: int) -> float:
        by_b = self.overhead.get(method)
        return self._relative(by_b, batch) if by_b else 0.0

    def _relative(self, seconds: Mapping[int, float], batch: int) -> float:
        """seconds[b] / t(b), interpolated at `batch` (evaluated only at the two bracketing batch sizes)."""
        return max(_interp_with(sorted(seconds), lambda b: seconds[b] / self.t_ar(b), batch), 0.0)

    def draft_ratios(self, method: str, batch: int, gammas: Iterable[int]) -> dict[int, float]:
        """A round's drafting with each γ in `gammas`, in plain steps at this batch size: linear in γ between the
        measured draft lengths (never downhill beyond them, never below proportional under the shortest), or γ·r + a
        where a batch size has no measured rounds."""
        gammas = list(gammas)
        rounds = self.draft_round.get(method, {})
        per_token, per_round = self.draft_step.get(method, {}), self.overhead.get(method, {})
        keys = sorted(set(rounds) | set(per_token))
        if not keys:
            raise KeyError(f"CostModel: proposer {method!r} was not calibrated (have {self.methods})")
        out = dict.fromkeys(gammas, 0.0)
        for b, w in _bracket(keys, batch):
            t = self.plain_step(b)
            points = rounds.get(b)
            if points:
                ks = sorted(points)
                for g in gammas:
                    x = points.get(g)
                    if x is None:
                        x = linear_in_tokens(points, g, ks)
                        if g < ks[0]:  # never below its share of the shortest measured draft (noise can make
                            x = max(x, points[ks[0]] * g / ks[0])  # the line's intercept negative)
                    out[g] += x / t * w
            else:
                c, a = per_token[b], per_round.get(b, 0.0)
                for g in gammas:
                    out[g] += (g * c + a) / t * w
        return {g: max(x, 0.0) for g, x in out.items()}

    def round_cost(self, method: str, gamma: int, batch: int) -> float:
        """Cost of one speculative round in plain steps: drafting γ tokens plus verifying γ+1."""
        return self.draft_ratios(method, batch, (gamma,))[gamma] + self.v(batch, gamma)

    def round_seconds(self, method: str, gamma: int, batch: int) -> float:
        """`round_cost` in seconds. Once a step has run this option at this batch size its costs are entries of the
        tables, and the ratio to `plain_step(b)` reduces to reading them (the policy asks twice a step)."""
        draft = self.draft_round.get(method, {}).get(batch, {}).get(gamma)
        verify = self.verify_step.get(batch, {}).get(gamma + 1)
        if draft is not None and verify is not None:
            return max(draft, 0.0) + verify
        return self.round_cost(method, gamma, batch) * self.plain_step(batch)

    def speedup(self, method: str, gamma: int, batch: int, acceptance: Acceptance) -> float:
        return round_lengths(acceptance, (gamma,))[gamma] / self.round_cost(method, gamma, batch)

    def best_gamma(self, method: str, batch: int, acceptance: Acceptance, gammas: Iterable[int],
                   verify: Mapping[int, float] | None = None, tie: float = 0.0) -> tuple[int, float]:
        """The shortest γ in `gammas` predicted within `tie` (relative) of the highest speedup, and its speedup.
        `verify`: `verify_ratios(batch, gammas)` if already computed (it is the same for every proposer).

        Why shorter within a tie: near a flat optimum the prediction's error is larger than the differences, and
        the error is not symmetric. A longer draft depends on more acceptance probabilities at once, so it loses
        more when acceptance is overestimated than it gains when it is underestimated (the draft model at batch 1
        on the bench's calibration: predicted at α = 0.88, γ=7 ties γ=4, but at a true 0.80 it runs 9% slower
        and at 0.92 only 5% faster); and at equal speed it spends fewer forwards."""
        gs = sorted(gammas)
        v = verify if verify is not None else self.verify_ratios(batch, gs)
        d = self.draft_ratios(method, batch, gs)
        lengths = round_lengths(acceptance, gs)
        speed = {g: lengths[g] / (d[g] + v[g]) for g in gs}
        top = max(speed.values())
        g = next(g for g in gs if speed[g] >= top * (1 - tie))
        return g, speed[g]

    def to_dict(self) -> dict[str, Any]:
        return {"target_step": self.target_step, "verify_step": self.verify_step,
                "draft_step": self.draft_step, "overhead": self.overhead, "draft_round": self.draft_round}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> CostModel:
        def ints(d: Mapping[Any, Any]) -> dict[int, float]:
            return {int(k): float(v) for k, v in d.items()}

        return cls(target_step=ints(data["target_step"]),
                   verify_step={int(b): ints(by_k) for b, by_k in data["verify_step"].items()},
                   draft_step={m: ints(v) for m, v in data.get("draft_step", {}).items()},
                   overhead={m: ints(v) for m, v in data.get("overhead", {}).items()},
                   draft_round={m: {int(b): ints(by_g) for b, by_g in v.items()}
                                for m, v in data.get("draft_round", {}).items()})
