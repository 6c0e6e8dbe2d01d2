"""What the adaptive policy knows (`adaptive.py`): running estimates of step costs, acceptance and stops, kept
from the engine's step records.

* **step costs**: t(b), t_v(b, k) and d_m(b, γ) start from the start-up calibration (`calibrate`) and are replaced
  by what the steps themselves measure once two steps have: a low quantile of the last `window` samples per batch
  size and length (on a shared machine other processes only ever add time); plain decoding's of the last
  `horizon` steps only (the policy's plain rechecks keep it current: every forward's cost grows with the rows'
  contexts), and where it never ran at a batch size, the calibration's scaled by the level of the verifications
  there (`_pool_verify`). The verify and draft costs of one batch size are pooled over its lengths
  (`pooled_lengths`): each length's estimate (the verifier's: every length the policy may verify, on the line
  through the calibration's, `verify_line`) is its calibrated cost times the batch size's level (what every length
  there costs now against the calibration) and, as it gathers samples of its own, its own ratio (`LENGTH_PRIOR`).
  Why: in a rollout's tail most batch sizes are visited for a few steps, and per length a single sample decided the
  estimate; one slow step of γ=4 at batch 16 rescaled every longer length with it and priced γ=6 at 4.65 plain
  steps where its rounds cost about 2.6 (fixed γ=6 ran 1.46x plain decoding there; the policy chose γ=2).
  The verifier's level is the verifications' own wherever any ran at that batch size, and the plain steps' (their
  ratio to the calibration's plain step) only where none did. Plain steps' ratios used to join it: but the
  calibration does not time a plain step as the workload does (its plain steps run back to back on short contexts,
  its verifications after a drafter's steps), and against the long tail's own steps it was off by 10-30% per batch
  size, in either direction from one run to the next (`specrl bench policy --by-batch`, `calibration_vs_run`; Zen
  5: at batch 16, 3 tokens at 2.41 plain steps where the tail's steps measured 2.04, and in another run 2.03 where
  they measured 2.17). Where only plain steps ran, their level carried the calibration's ratio over unchanged; a
  verification that ran there since, a speculation recheck's (`adaptive.py`), now sets it.
  Without a calibration a length no step has measured keeps its first estimate relative to the nearest measured
  one (`rescale_unmeasured`).
* **acceptance**: α_m is accepted / tried draft tokens over an exponential window of `alpha_memory` tokens. Per
  draft position j, p_j is α_m times the shape of acceptance over the positions: the same ratio at position j over
  all of them, each counted over a longer window (`shape_memory`; position j's shrunk towards position j−1's by
  `POSITION_PRIOR` tokens). Where later positions are accepted less often (heads that draft from their own guesses,
  such as EAGLE's and MTP's, lose acceptance with depth) the geometric law drafts too long; the benchmark's draft
  model is flat (0.85–0.91 at positions 1–8), and there the two laws agree. The level moves fast and the shape
  slowly: per-position ratios over the level's short window were noisy enough to flap between two proposers within
  2% of each other.
* **stop hazard**: a round also ends where its sequence does. The chance h(b) that an emitted token is a stop
  token (stops per emitted token at this batch size, over `stop_memory` tokens, `STOP_PRIOR` tokens of no-stop
  prior) scales every p_j by 1 − h(b) (`continuing`), and α_m counts only drafts inside the text. Why: a drafter
  that is a copy of the policy agrees with it past the end of a response too; on the benchmark's short responses
  (median 13 tokens) quantized_self at γ=8 and batch 2 emitted 16% fewer tokens than it had accepted, and the
  argmax, blind to it, chose it at 0.8x the draft model's rate.

Switch steps (the first step of a proposer after another option ran) measure the catch-up, not the proposer, so
their draft time is not recorded; their verify time and acceptance are.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Collection, Mapping, Sequence
from typing import TYPE_CHECKING

from .control import Decision, StepRecord
from .cost_model import (
    Acceptance,
    CostModel,
    interp_log_batch,
    linear_in_tokens,
    low_percentile,
    round_alpha_from_record,
)

if TYPE_CHECKING:
    from .adaptive import AdaptiveSettings

MIN_TRIED = 32  # draft tokens of acceptance evidence before a proposer's α is trusted (probed until then)
POSITION_PRIOR = 64.0  # tokens of evidence the previous position's acceptance counts for at the next
STOP_PRIOR = 64.0  # emitted tokens without a stop the stop hazard starts from
RECENT_MIN = 3  # plain samples its estimate reads at least, however old (see `AdaptiveSettings.horizon`)
# Samples of its own a length needs before they count as much as its batch size's level (`pooled_lengths`): a single
# step is noisy (tens of percent on a shared machine), the calibration's shape over lengths much less so.
LENGTH_PRIOR = 8.0
# Samples of its own a batch size's plain step needs before they count as much as what its neighbours' plain steps
# say (`shrunk_plain`).
PLAIN_PRIOR = 4.0


def batch_key(batch: int) -> int:
    """The batch sizes that share a table of options and a stop hazard. Above 16 sequences one key serves an eighth
    of an octave (~9%): costs are interpolated in log(b), and a full-step batch shrinks by a few sequences per step,
    which would recompute the table at every step."""
    return batch if batch <= 16 else 16 + round(8 * math.log2(batch / 16))


class Estimates:
    """Step costs (`costs`: a `CostModel`, None until something is measured or calibrated), acceptance per proposer
    and draft position, and stop hazards per batch size; `learn` folds in one step's record."""

    def __init__(self, methods: Sequence[str], cost_model: CostModel | None, settings: AdaptiveSettings,
                 alpha_priors: Mapping[str, float] | None = None) -> None:
        self.settings = s = settings
        priors = alpha_priors or {}
        self.alpha = {m: float(priors.get(m, s.prior_alpha)) for m in methods}
        # decayed (accepted, tried) draft tokens; a calibrated α counts as `MIN_TRIED` tokens of evidence
        self._acceptance = {m: (MIN_TRIED * self.alpha[m], float(MIN_TRIED)) if m in priors else (0.0, 0.0)
                            for m in methods}
        # per draft position, [accepted, tested] over `shape_memory` (empty until a record carries positions)
        self._positions: dict[str, list[list[float]]] = {m: [] for m in methods}
        self._stops: dict[int, tuple[float, float]] = {}  # per batch key: decayed (stops, emitted tokens)
        self._costs = CostModel.from_dict(cost_model.to_dict()) if cost_model is not None else None
        # per b: the calibrated verify seconds its plain steps' level waits to be pooled over (`costs`)
        self._unpooled: dict[int, Mapping[int, float]] = {}
        # the calibration as it came: the shape over draft lengths that unmeasured lengths keep (`_follow`)
        self._calibrated = CostModel.from_dict(cost_model.to_dict()) if cost_model is not None else None
        self._draft_base: dict[tuple[str, int], dict[int, float]] = {}  # per (proposer, b): `_draft_base_at`
        self._samples: dict[tuple, deque[tuple[int, float]]] = {}  # per quantity: (step, seconds), oldest first
        # per ("verify", b), ("plain", b) or ("draft", m, b): the costs of every length there (of the plain step,
        # for ("plain", b)) against its base, newest last
        self._levels: dict[tuple, deque[float]] = {}
        self._own: dict[tuple, dict[int, tuple[int, float]]] = {}  # the same keys: per length, (samples, own ratio)
        self._verify_base: dict[int, dict[int, float]] = {}  # per b: the calibration's verify seconds per length
        self.last_run: dict[str | None, int] = {}  # option (None: plain) -> step it last ran
        self._last_method: str | None = None

    # -- reading --------------------------------------------------------------------------------------------

    @property
    def costs(self) -> CostModel | None:
        """The step costs as estimated now. A plain step's record moves its batch size's verify costs with its
        level where no verification ran there (`_pool_verify`); that pooling waits until something reads the costs:
        in a run of plain steps it was a third of folding each record, and only its last result is ever read."""
        if self._unpooled:
            pending, self._unpooled = self._unpooled, {}
            for b, base in pending.items():
                self._pool_verify(b, base)
        return self._costs

    def evidence(self, method: str) -> float:
        """Draft tokens of acceptance evidence `method`'s α rests on (decayed)."""
        return self._acceptance[method][1]

    def plain_measured_at(self, batch: int) -> int | None:
        """The step that last timed plain decoding at this batch size (None: never)."""
        window = self._samples.get(("ar", batch))
        return window[-1][0] if window else None

    def acceptance(self, method: str, optimism: float = 0.0) -> Acceptance:
        """Proposer `method`'s acceptance per draft position (its α alone before any record carried positions),
        each raised by `optimism`: what the cost model's expected tokens per round read."""
        positions = self._positions[method]
        alpha = self.alpha[method]
        tested = sum(t for _, t in positions)
        if tested <= 0 or alpha <= 0:
            return min(alpha + optimism, 1.0)
        # The shape's level is shrunk towards α by `POSITION_PRIOR` tokens, as each position is towards the one
        # before: a proposer's first round at batch 1 rejected its first draft (1 tested, 0 accepted), the raw
        # level was 0, every position's acceptance with it, and no probe ever ran the draft model again.
        level = (sum(a for a, _ in positions) + POSITION_PRIOR * alpha) / (tested + POSITION_PRIOR)
        out, p = [], level
        for accepted_j, tested_j in positions:
            p = (accepted_j + POSITION_PRIOR * p) / (tested_j + POSITION_PRIOR)
            out.append(min(alpha * p / level + optimism, 1.0))
        return out

    def stop_hazard(self, batch: int) -> float:
        """The chance that a token emitted at this batch size ends its sequence."""
        stops, tokens = self._stops.get(batch_key(batch), (0.0, 0.0))
        return stops / (tokens + STOP_PRIOR)

    def stop_hazards(self) -> dict[int, float]:
        return {b: self.stop_hazard(b) for b in sorted(self._stops)}

    def continuing(self, method: str, batch: int, optimism: float = 0.0) -> Acceptance:
        """Per draft position, the chance the round goes on past it: accepted, and not the end of the text."""
        keep = 1.0 - self.stop_hazard(batch)
        acceptance = self.acceptance(method, optimism)
        return acceptance * keep if isinstance(acceptance, float) else [p * keep for p in acceptance]

    def predicted_seconds(self, record: StepRecord) -> float | None:
        """The current estimate of the step that `record` ran: t(b), or d_m(b, γ) + t_v(b, γ+1)."""
        b = record.batch_size
        if not record.method or record.gamma < 1:
            plain = self._costs  # a plain step's estimate is its own: no pooling to wait for
            return plain.t_ar(b) if plain is not None else None
        c = self.costs
        if c is None or not c.knows(record.method):
            return None
        return c.round_seconds(record.method, record.gamma, b)

    # -- learning -------------------------------------------------------------------------------------------

    def learn(self, record: StepRecord, step: int) -> float:
        """Fold in one step's record (run at `step`); how far it moved the estimate of what ran, as the factor
        new / old (1.0 where there is none). Past 10% either way the policy recomputes that batch size's table, else
        a wrong choice would run until its refresh."""
        b = record.batch_size
        if b < 1 or record.seconds <= 0:
            return 1.0
        if record.emitted_tokens > 0:
            key = batch_key(b)
            keep = math.exp(-record.emitted_tokens / self.settings.stop_memory)
            stops, tokens = self._stops.get(key, (0.0, 0.0))
            self._stops[key] = (keep * stops + record.stopped, keep * tokens + record.emitted_tokens)
        before = self.predicted_seconds(record)
        self._learn(record, b, step)
        after = self.predicted_seconds(record)
        return after / before if before and after else 1.0

    def _sample(self, key: tuple, x: float, seed: float | None, step: int) -> float:
        """Add one timing sample and return the new estimate: from two samples on, a low quantile of the last
        `window` (plain decoding's: of those of the last `horizon` steps, at least `RECENT_MIN`); after one, its
        mean with the seed (the calibration's value). The seed does not stay in the window: a calibration timed on
        short sequences (attention grows with the context) held a wrong cost for a dozen steps of the workload when
        it counted as three samples."""
        window = self._samples.get(key)
        if window is None:
            window = self._samples[key] = deque(maxlen=self.settings.window)
        window.append((step, x))
        if len(window) == 1 and seed is not None:
            return (seed + x) / 2
        if key[0] != "ar":
            return low_percentile([v for _, v in window], 0.25)
        since = step - self.settings.horizon
        recent = [v for at, v in window if at > since]
        if len(recent) < RECENT_MIN:
            recent = [v for _, v in list(window)[-RECENT_MIN:]]
        return low_percentile(recent, 0.25)

    def _learn(self, record: StepRecord, b: int, step: int) -> None:
        # what ran (the engine decodes plainly when every row ends within one token, and caps γ at the budget)
        decision = Decision(record.method, record.gamma) if record.method and record.gamma > 0 else Decision()
        method = decision.method
        switched, self._last_method = method != self._last_method, method
        self.last_run[method] = step
        if method is None:
            old = self._costs.target_step.get(b) if self._costs is not None else None
            t = self._sample(("ar", b), record.seconds, old, step)
            if self._costs is not None and (self._calibrated is None or b not in self._calibrated.target_step):
                t = shrunk_plain(t, len(self._samples[("ar", b)]), self._costs.target_step, b)
            if self._costs is None:
                self._costs = CostModel(target_step={b: t}, verify_step={})
            self._costs.target_step[b] = t
            if (base := self._verify_base_at(b)) is not None:
                self._level(("plain", b), record.seconds / base[1])
                self._unpooled[b] = base
            else:
                self._follow(b)
            return
        if record.tried_tokens > 0:  # α = accepted / tried over a decaying window of tokens (the MLE)
            keep = math.exp(-record.tried_tokens / self.settings.alpha_memory)
            acc, tried = self._acceptance[method]
            acc, tried = keep * acc + record.accepted_tokens, keep * tried + record.tried_tokens
            self._acceptance[method] = (acc, tried)
            self.alpha[method] = min(max(acc / tried, 0.0), 1.0)
            positions = self._positions[method]
            positions.extend([0.0, 0.0] for _ in range(len(record.tested_at) - len(positions)))
            keep = math.exp(-record.tried_tokens / self.settings.shape_memory)
            for j, cell in enumerate(positions):
                cell[0] *= keep
                cell[1] *= keep
                if j < len(record.tested_at):
                    cell[0] += record.accepted_at[j]
                    cell[1] += record.tested_at[j]
        elif (alpha := round_alpha_from_record(record)) is not None:
            weight = 1 - math.exp(-record.draft_tokens / self.settings.alpha_memory)
            self.alpha[method] += weight * (alpha - self.alpha[method])
        c = self.costs
        if c is None:
            return
        k = decision.gamma + 1
        by_k = c.verify_step.setdefault(b, {})
        base = self._verify_base_at(b)
        if base is not None and k in base:
            self._own_ratio(("verify", b), k, self._sample(("verify", b, k), record.target_seconds, None, step),
                            base[k])
            self._level(("verify", b), record.target_seconds / base[k])
            self._pool_verify(b, base)
        else:
            by_k[k] = self._sample(("verify", b, k), record.target_seconds, by_k.get(k), step)
            self._follow(b)
        g = decision.gamma
        if not c.knows(method):  # first ever measurement: an upper bound until a steady step comes
            c.draft_round[method] = {b: {g: record.draft_seconds}}
        elif not switched:
            base = self._draft_base_at(method, b)
            by_g = c.draft_round.setdefault(method, {}).setdefault(b, dict(base))
            if g in base and all(x > 0 for x in base.values()):
                self._own_ratio(("draft", method, b), g,
                                self._sample(("draft", method, b, g), record.draft_seconds, None, step), base[g])
                self._level(("draft", method, b), record.draft_seconds / base[g])
                by_g.update(self._pooled(("draft", method, b), base))
            else:  # a free drafter (n-gram: predicted at 0): its measured lengths, the others scaled alike
                by_g[g] = self._sample(("draft", method, b, g), record.draft_seconds, by_g.get(g), step)
                measured = {k for k in by_g if ("draft", method, b, k) in self._samples}
                by_g.update(rescale_unmeasured(by_g, base, measured, base.__getitem__))

    def _draft_base_at(self, method: str, b: int) -> dict[int, float]:
        """Proposer `method`'s drafting at batch b for every γ, in seconds: the calibration's where it timed the
        proposer (interpolated between its batch sizes and lengths), else the estimates' first prediction at b;
        what the pooled estimates scale. (Before, a calibrated batch size kept its two calibrated lengths and each
        other length its own samples, so every batch size the calibration timed, the sweep's five among them, was
        priced per length: at batch 2 drafting γ=3 stood at 0.56 plain steps and γ=4 at 0.43, the calibration's
        0.24 and 0.28; the benchmark's sweep at batch 2 saw the policy flip between γ=4, 5 and 6 at 0.93x fixed
        γ=6.)"""
        base = self._draft_base.get((method, b))
        if base is None:
            cal = self._calibrated
            source = cal if cal is not None and cal.knows(method) else self.costs
            assert source is not None
            t = source.plain_step(b)
            base = self._draft_base[(method, b)] = {
                k: x * t for k, x in source.draft_ratios(method, b, self.settings.gammas()).items()}
        return base

    def _verify_base_at(self, b: int) -> dict[int, float] | None:
        """The calibration's verify seconds at batch b for every length it timed and every longer length the policy
        may verify (γ+1 for each of its γ), on the least-squares line through the timed ones (`verify_line`; the
        plain step as length 1), interpolated between calibrated batch sizes; None without a calibrated
        verification.

        Every length the policy may verify, not only the calibrated ones: a length outside the base was priced by
        its own samples alone, and the lengths the policy does not run are timed only now and then (its neighbour
        steps), so one slow moment set their price until the next: at batch 1 (bench model, AMX Xeon) 8 tokens stood
        at 1.89 plain steps and 6 at 1.24, the policy ran γ=4-5 at 0.90x fixed γ=6, and γ=7 and γ=8 ran 1.03x and
        1.05x γ=6 beside it. In the base, every length moves with its batch size's level (`pooled_lengths`)."""
        base = self._verify_base.get(b)
        if base is None:
            cal = self._calibrated
            if cal is None or not cal.verify_step:
                return None
            timed = sorted({k for by_k in cal.verify_step.values() for k in by_k} | {1})
            # below the shortest timed verification a length stays between it and the plain step, as measured now
            # (`CostModel.verify_ratios`): at a batch size past the calibrated ones the level's first sample is
            # halved towards the calibration's (`pooled_lengths`), and 2 tokens from the base then cost less
            # against the plain step just measured than the calibration says
            shortest = min((k for k in timed if k > 1), default=1)
            wanted = sorted(set(timed) | {g + 1 for g in self.settings.gammas() if g + 1 > shortest})
            base = self._verify_base[b] = verify_line(cal.verify_seconds(b, timed), wanted)
        return base

    def _level(self, key: tuple, ratio: float) -> None:
        window = self._levels.get(key)
        if window is None:
            window = self._levels[key] = deque(maxlen=self.settings.window)
        window.append(ratio)

    def _own_ratio(self, key: tuple, k: int, estimate: float, base: float) -> None:
        """Keep length k's own (samples, ratio to its base) for `pooled_lengths` (`estimate`: `_sample`'s)."""
        self._own.setdefault(key, {})[k] = (len(self._samples[key + (k,)]), estimate / base)

    def _pooled(self, key: tuple, base: Mapping[int, float]) -> dict[int, float]:
        """`pooled_lengths` for the quantity `key` (("verify", b) or ("draft", m, b)) over `base`."""
        return pooled_lengths(base, list(self._levels.get(key, ())), self._own.get(key, {}))

    def _pool_verify(self, b: int, base: Mapping[int, float]) -> None:
        # The verifications' own level where any ran at this batch size; plain steps' only where none did. A plain
        # step's ratio to the calibration's plain step says what a verification costs only if the calibration
        # timed the two alike, and it did not (see the module docstring's step costs).
        level = self._levels.get(("verify", b)) or self._levels.get(("plain", b))
        pooled = pooled_lengths(base, list(level or ()), self._own.get(("verify", b), {}))
        plain = pooled.pop(1)
        assert self._costs is not None
        self._costs.verify_step.setdefault(b, {}).update(pooled)
        if ("ar", b) not in self._samples:
            # Never timed at this batch size, plain decoding moves with the level of its verifications, as an
            # unmeasured length does; its own samples (probes, rechecks) rule once it has any. Why: the bench's
            # sweep at batch 4 speculated in every step, and a plain step stood at the calibration's 2.14 ms (short
            # contexts, another minute) where the fixed plain configuration beside it measured 2.40 ms. Every
            # verification was measured at its cost, so every proposer was priced 12% slower than plain decoding
            # than it ran.
            self._costs.target_step[b] = plain

    def _follow(self, b: int) -> None:
        """Re-derive the verify costs at batch b that no step has measured: each calibrated length at what the
        nearest measured length (the plain step included) costs now against its own calibration. The machine's
        load moves every forward alike, so a calibrated γ that never runs keeps its place beside the ones that do.
        (Multiplying in every change of a measured estimate instead made a random walk of the unmeasured ones:
        replaying noisy steps at two lengths and plain steps, the unmeasured 3-token verify drifted to 2.1x the
        plain step, where the calibration had it at 1.1x.)"""
        if self._calibrated is None or self.costs is None:
            return
        cal = self._calibrated.verify_step.get(b)
        if not cal:
            return
        verify = self.costs.verify_step.setdefault(b, {})
        now = dict(verify)
        measured = {k for k in now if ("verify", b, k) in self._samples}
        if ("ar", b) in self._samples and b in self.costs.target_step:
            now[1] = self.costs.target_step[b]
            measured.add(1)
        points = {**cal, 1: self._calibrated.target_step.get(b) or self._calibrated.t_ar(b)}
        verify.update(rescale_unmeasured(now, cal, measured, lambda k: linear_in_tokens(points, k)))


def pooled_lengths(base: Mapping[int, float], level: Sequence[float], own: Mapping[int, tuple[int, float]]
                   ) -> dict[int, float]:
    """Every length k of `base` (its calibrated seconds) at base[k] × its ratio now: the batch size's level (a low
    quantile of `level`, the recent ratios of every length there; after one sample, its mean with the
    calibration's 1, as `Estimates._sample` does) and, where k has `n` samples of its own with ratio `r`
    (`own[k] = (n, r)`), r weighted by n against `LENGTH_PRIOR` samples of the level.

    Tried and reverted for drafting: an offset in seconds instead of a ratio. In the benchmark's sweep (Zen 5,
    batch 4 and 8) drafting cost 0.04-0.14 plain steps a round over the calibration at every length, so a ratio
    measured at γ=1-3 priced γ=8 at 1.2-1.5x its cost; but with the offset the whole long-tail workload ran at
    0.93x the best fixed configuration on the sampling seeds where the ratio ran at 0.98x (the same code
    otherwise; the sweep at batch 2-16 alike: 0.95-0.99 with the offset, 0.95-1.01 with the ratio)."""
    at = (1.0 + level[0]) / 2 if len(level) == 1 else low_percentile(level, 0.25) if level else 1.0
    out = {}
    for k, x in base.items():
        count, ratio = own.get(k, (0, at))
        out[k] = x * (count * ratio + LENGTH_PRIOR * at) / (count + LENGTH_PRIOR)
    return out


def shrunk_plain(own: float, samples: int, target_step: Mapping[int, float], batch: int) -> float:
    """The plain step at `batch`: its own estimate `own` (from `samples` steps) weighted against `PLAIN_PRIOR`
    samples of the other batch sizes' plain steps interpolated at `batch` (`own` alone where no batch sizes on
    both sides have one).

    Applied where the calibration timed no plain step (a calibrated size starts from its own measurement). Why:
    the tail of a rollout visits batch sizes 9-15 for a step or two each, and one plain step there (a probe, a
    recheck) set that size's cost alone. Measured on the Xeon (AMX, 480 MiB L3) at batch 12, the benchmark's sweep
    workload: a lone 5.95 ms plain step (plain steps there took 4.9 ms, median) priced the draft model at 1.75x plain
    decoding where it ran at 1.34x; in another run a low estimate (3.55 ms against a 4.32 ms median) priced it at
    1.07x, where it ran at 1.32x, within reach of plain decoding's margin."""
    others = {k: v for k, v in target_step.items() if k != batch}
    if not others or not min(others) < batch < max(others):  # beyond the others' range a prior would extrapolate
        return own
    return (samples * own + PLAIN_PRIOR * interp_log_batch(others, batch)) / (samples + PLAIN_PRIOR)


def verify_line(timed: Mapping[int, float], lengths: Sequence[int]) -> dict[int, float]:
    """Verify seconds at every k in `lengths` from the calibration's at the lengths it timed (`timed`, the plain
    step as k = 1): the plain step itself at k = 1, and from k = 2 on the least-squares line through the timed
    lengths from 2 on, never falling with k (with fewer than two of them, linear between the timed points).

    Why a line: the calibration times a few steps per length, and read point to point its noise set the shape over
    lengths (at batch 1 on the bench model: 3 / 5 / 7 tokens at 1.25 / 1.33 / 1.32 plain steps in one run, 1.11 /
    1.13 / 1.23 in another), and extended past the longest timed length its last segment's slope, noise included,
    priced 9 tokens at 2.2 plain steps where fixed γ=8 ran 1.07x γ=6. A verification's cost is close to affine in
    its tokens over these few lengths (the weights are read once whatever k; each token adds its rows)."""
    points = sorted((k, x) for k, x in timed.items() if k >= 2)
    if len(points) < 2:
        ks = sorted(timed)
        return {k: linear_in_tokens(timed, k, ks) for k in lengths}
    n = len(points)
    mk = sum(k for k, _ in points) / n
    mx = sum(x for _, x in points) / n
    slope = max(sum((k - mk) * (x - mx) for k, x in points) / sum((k - mk) ** 2 for k, _ in points), 0.0)
    out = {k: mx + slope * (k - mk) for k in lengths}
    if 1 in timed and 1 in out:
        out[1] = timed[1]
    return out


def rescale_unmeasured(current: Mapping[int, float], base: Mapping[int, float], measured: Collection[int],
                       base_at: Callable[[int], float]) -> dict[int, float]:
    """For every length k of `base` no step has measured: base[k] times what the nearest measured length m costs
    now against its own base, current[m] / base_at(m) (the shorter m on ties). Nothing when nothing is measured."""
    out = {}
    for k, v in base.items():
        if k in measured or not measured:
            continue
        m = min(measured, key=lambda a: (abs(a - k), a))
        if (at := base_at(m)) > 0:  # a free proposer's (n-gram) predicted drafting: nothing to scale
            out[k] = v * current[m] / at
    return out
