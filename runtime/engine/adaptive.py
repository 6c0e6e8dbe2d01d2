"""Adaptive speculation: one cost-model argmax per decode step (DESIGN §5).

At active batch size b, plain decoding emits b tokens per plain step t(b). A speculative round with proposer m and
draft length γ emits b·L_m(γ) tokens, L = 1 + Σ_{i≤γ} Π_{j≤i} p_j (p_j: the chance that draft j is accepted once
drafts 1..j−1 were; a single α gives the geometric (1 − α^(γ+1)) / (1 − α)), and costs ``d_m(b, γ) + t_v(b, γ+1)``:
the proposer's drafting (its catch-up on unseen tokens plus γ draft steps) and one target forward over γ+1 tokens.
Its speed relative to plain decoding is ``L / (d + v)`` in units of t(b). Every step the controller takes the
argmax over {plain} ∪ {(m, γ)} of that ratio — that is all of the policy. What feeds it and what guards it:

* **estimates** (`estimates.py`): t(b), t_v(b, k) and d_m(b, γ) from the calibration and then from what the steps
  measure; α_m and its shape over the draft positions; the stop hazard h(b) (a round also ends where its sequence
  does). A record that moves its estimate by 10% recomputes its batch size's table.
* **margin**: a proposer runs only where it is predicted `margin` faster than plain decoding: its speed is an
  estimate, plain decoding's a measurement, and in a near-tie the estimate's error is larger than the gain.
* **length ties**: a proposer drafts the shortest γ predicted within `length_tie` of its best: a longer draft rests
  on more acceptance probabilities at once, so an overestimated α costs it more than an underestimated one gains.
* **hysteresis**: switching proposer, or from plain decoding to one, must win by `hysteresis` (a drafter with a
  cache of its own pays a catch-up each time it is switched back in). Falling back to plain decoding is never held
  back: it has nothing to catch up on, and a refilled full batch is where a held drafter would cost most.
* **plain rechecks**: every forward grows dearer with the rows' contexts, and speculation is worth only what it
  saves against a plain step *now*; while a proposer runs, a plain step every so often (at most `recheck_cost` of
  the time) keeps that cost current. Plain decoding's estimate reads only the last `horizon` steps.
* **speculation rechecks**: the mirror image. Where plain decoding is chosen and nothing speculated at that batch
  size for `horizon` steps, the leading proposer runs one step at its γ (at most one such step in `recheck`, none
  where the table is settled; counted among the probe steps). An estimate that errs towards speculation is corrected
  by the steps it chooses (they time the verification); one that errs towards plain decoding is not: plain steps
  time only themselves, and the verifications there stay priced by the calibration, which is off by 10-30% per batch
  size against the tail's own steps (`estimates.py`). Measured on a Zen 5 (32 MiB L3), `specrl bench policy
  --by-batch`: in a run whose calibration priced 3 tokens at batch 16 at 2.41 plain steps (the tail's steps: 2.04),
  the policy decoded plainly at batch 13-16 in 96 of 126 steps where draft_model γ=2 ran 1.08-1.12x plain decoding
  (at 13, 14 and 16). In one ring with the calibration's plain steps made 15% faster (every verification overpriced
  alike), the policy without rechecks decoded plainly in 114 of 116 steps at batch 16 (0.84x draft_model γ=2 there,
  0.93x on the whole workload's common mix); with them it ran γ=2 there in 45 of 60 steps (0.97x and 0.97x). In
  three rings on unaltered calibrations, with against without: 1.00x, 1.02x and 0.98x on the common mix (6 repeats
  each). Rechecks alone, with plain steps' ratios still in the verifier's level, read 0.97x, 1.00x and 0.96x: a
  recheck's one verification then hardly moved it (a low quantile of ratios that plain steps dominate).
* **probes**: a share `probe` of the steps (bursts of `probe_run`, at batch sizes up to `probe_max_batch`, where
  speculation can pay) runs the option longest unmeasured, so a drafter that improves (it is trained while the
  job runs) or a machine that slows down is noticed. Only options that could change the choice are probed: with
  `probe_optimism` more acceptance than estimated, a proposer would have to beat the best prediction.
* **neighbours**: every `neighbour` steps the running proposer drafts one token more or one less than the
  argmax's γ, so the lengths around it are timed in the same minutes (a shared machine's speed drifts by tens of
  percent within a minute, and a length timed only in a slow one would never run again).

**What a step costs the policy.** Inside the decode loop the interpreter's code and data are cold, and estimating
at every step cost 130–165 µs (3% of a speculative step at batch 2). So the argmax is *held* while nothing can
change it (the same batch size, its table not due for a refresh, no probe due, no step `SURPRISE` times off its
prediction), a held step only keeps its record, and the records are *folded* into the estimates, in order, when
something reads them (a table's computation, a probe's choice, the step after a surprise). A table is never
computed from records not folded yet. A recomputation that names the same leader as the table it replaces doubles
the steps until the next one (from `refresh` up to `stable_refresh`): at batch 2 on the bench model the policy's
time, with tables every 8 steps and their folds, was 2.4–2.5% of the decode's, and 1.8–2.0% with this.

**Table lifetimes.** A table's refresh counts the steps run at its batch size (its key), not all steps, and
`max_table_age` steps in all bound it. A rollout step's long tail visits each batch size for a step or two, a few
dozen steps apart: counted in all steps every table had expired by the next visit, and 58% of the long-tail
workload's steps computed one (bench model, AMX Xeon: the policy's own time 218-243 µs a step, 1.4% of the run's
CPU). Counted per batch size, 17% did (161 µs, 0.9%). What the stale tables miss is covered elsewhere: a record that
moves an estimate by 10% drops its table (`_fold`), and a step `SURPRISE` times off its prediction is re-examined.

**Settled tables.** Where plain decoding wins by more than a probe could overturn, the table is settled: it stands
`settled_refresh` steps instead of `refresh` (doubled by each recomputation that settles it again, up to
`settled_stable_refresh`), through cost moves its margin covers, until a speculative step moves acceptance, and
plain decoding held at one batch size carries on into any batch size whose table is settled without computing
anything. A GRPO rollout's batch shrinks every step or two, and without this every new size computed a table on
steps of well under a millisecond (tiny-local). Plain decoding there keeps one record per visit to a batch size
(its first step, or any step `SURPRISE` times off its prediction): a settled table only has to notice a cost move
beyond its margin. In a rollout of tiny-local's trained policy (148 decode steps, 100–114 ms), folding every
record and recomputing the settled tables every 512 steps put the policy's own time (`decide` and `observe`) at
2.5–2.9 ms; one record per visit and the doubling, at 1.4–2.2 ms.

The engine prefills on admission only the drafters this policy names warm (`warm_proposers`); the others catch up
from the prompt when a probe or a switch first runs them. Nothing here touches the sampling RNG, so the choice
never changes the distribution of the sampled tokens (every option is lossless).

The measurements behind each mechanism, and the alternatives tried and reverted, are in
docs/performance-history.md (search for the mechanism's name).
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from .control import Decision, StepClock, StepRecord, retimed
from .cost_model import (
    Acceptance,
    CostModel,
    alpha_from_mean_accepted,
    expected_tokens_per_round,
    predicted_speedup,
    round_alpha_from_record,
)
from .estimates import MIN_TRIED, Estimates, batch_key

# the math lives in cost_model; these names are re-exported for the callers that import them from here
__all__ = ["AR", "AdaptiveController", "AdaptiveSettings", "CostModel", "alpha_from_mean_accepted",
           "controller_from_spec", "expected_tokens_per_round", "is_speculative", "label", "predicted_speedup",
           "round_alpha_from_record", "settings_from_spec"]

AR = Decision(None, 0)
# A held choice whose step cost this factor more or less than predicted is re-examined at the next step. Single
# steps are noisy (the estimates' own check compares low quantiles at 10%); this only has to catch a choice that
# was mispriced by a lot, such as a drafter calibrated on short sequences.
SURPRISE = 1.5


def is_speculative(decision: Decision) -> bool:
    return decision.method is not None and decision.gamma > 0


def label(decision: Decision) -> str:
    return f"{decision.method}:{decision.gamma}" if is_speculative(decision) else "ar"


# ---------------------------------------------------------------------------------------------------------------
# the policy


Options = dict[str | None, tuple[float, Decision]]  # per option (None: plain), its speed and best γ


@dataclass(frozen=True, slots=True)
class _Table:
    """One batch size's options as computed at its step `step`, current until its step `until` (steps counted at
    its batch key, see "table lifetimes" in the module docstring) and at most `max_table_age` steps in all after
    `born`. `settled`: plain decoding wins there by more than a probe could overturn (see "settled tables")."""

    step: int
    until: int
    options: Options
    plain_seconds: float  # a plain step's estimate at this batch size when the table was computed
    born: int  # the controller's step (all batch sizes) it was computed at
    # the fastest proposer's predicted speed with `probe_optimism` more acceptance (inf: not computed, not settled)
    optimistic: float = math.inf

    @property
    def period(self) -> int:
        """The steps it stands: `refresh` (`settled_refresh` if settled), doubled while recomputations confirm it."""
        return self.until - self.step

    @property
    def settled(self) -> bool:
        return self.optimistic < 1


@dataclass(slots=True)
class _Held:
    """An argmax that stands until step `until` at batch size `batch` while its table is `table` (mutable: plain
    decoding carried into the next batch size updates it in place, see `_carry`)."""

    batch: int
    until: int
    decision: Decision
    key: int
    table: _Table
    counts: Counter[str]
    label: str
    speculative: bool
    seconds: float  # what a step of `decision` was predicted to cost
    # `sparse`: plain decoding on a settled table, which keeps only a visit's first record (module docstring);
    # `kept`: this visit's is kept
    sparse: bool = False
    kept: bool = False


@dataclass
class AdaptiveSettings:
    """`settings_from_spec` maps the RLJob's ``spec.speculative.adaptive`` onto these.

    toggle: plain decoding is an option; draft_length: γ ranges over [min_gamma, max_gamma] (else fixed at
    `gamma`); strategy: every proposer the engine built is an option (else only the first).
    """

    toggle: bool = True
    draft_length: bool = True
    strategy: bool = True
    gamma: int = 4  # fixed draft length when draft_length is off (spec.speculative.numSpeculativeTokens)
    min_gamma: int = 1
    max_gamma: int = 8
    hysteresis: float = 0.05
    # Speculation runs only where it is predicted at least this much faster than plain decoding, whatever ran
    # before: its speed is an estimate (acceptance, stop hazard, verify costs interpolated between lengths), plain
    # decoding's a measurement, and in a near-tie the estimate's error is larger than the gain (batch 16 on an AVX512
    # machine: draft_model γ=1 predicted 1.009x plain, ran at 0.95x).
    margin: float = 0.02
    # The shortest draft length predicted within this share of the best one runs (`CostModel.best_gamma`: near a
    # flat optimum a longer draft has more to lose from an overestimated acceptance than to gain)
    length_tie: float = 0.02
    probe: float = 0.01  # share of steps that refresh the stalest option (spec.speculative.adaptive.epsilon)
    probe_run: int = 4  # steps in a row per probe (one round says little about acceptance at batch 1)
    probe_max_batch: int = 16  # no probes above this active batch size (see the module docstring)
    probe_optimism: float = 0.25  # a proposer is probed only if this much more acceptance would make it the best
    neighbour: int = 16  # steps between runs of the draft length next to the argmax's (`_neighbour`; 0: never)
    window: int = 32  # timing samples kept per (quantity, batch size)
    # plain rechecks (module docstring): the steps a plain sample stays current, the fewest steps between two
    # rechecks at one batch size, and the share of time they may cost (a recheck where speculation is predicted
    # at r times plain decoding comes every (r - 1) / recheck_cost steps: 60 at 1.3x)
    horizon: int = 64
    recheck: int = 16
    recheck_cost: float = 0.005
    # draft tokens of acceptance evidence the estimate remembers (an exponential window): counted in tokens, not
    # rounds, so it follows a change of regime as fast at batch 1 (a few tokens a round) as at batch 16
    alpha_memory: float = 256.0
    shape_memory: float = 4096.0  # the same for the shape of acceptance over the draft positions
    stop_memory: float = 512.0  # emitted tokens the stop hazard of a batch size remembers
    prior_alpha: float = 0.6
    refresh: int = 8  # steps between recomputations of one batch size's table of options
    # A recomputation that names the argmax the table before it named doubles the steps until the next one, up to
    # this (module docstring, "what a step costs the policy")
    stable_refresh: int = 32
    # The same for a settled table (module docstring): from `settled_refresh`, doubled by every recomputation that
    # settles it again, up to `settled_stable_refresh`
    settled_refresh: int = 512
    settled_stable_refresh: int = 4096
    # The steps (all batch sizes) a table stands at most, however few of them ran at its batch size ("table
    # lifetimes" in the module docstring): acceptance moves with the drafter's training in every batch size's steps
    max_table_age: int = 512
    # The tail's choice is prefilled on every admission only if a draft token costs at most this many plain steps
    # at batch 1: its prompt prefill then adds about that share to the target's. A costlier drafter with a cache of
    # its own (a draft model near the policy's size) catches up only on the rows that reach the tail. Drafters over
    # the target's cache (layer_skip, quantized_self) have nothing to prefill either way.
    warm_max_draft_cost: float = 0.15
    clock: str = "wall"  # "cpu" on shared CPU machines, see control.StepClock

    def __post_init__(self) -> None:
        if self.clock not in ("wall", "cpu"):
            raise ValueError(f"clock: must be 'wall' or 'cpu', got {self.clock!r}")
        if self.min_gamma < 1 or self.max_gamma < self.min_gamma:
            raise ValueError(f"minDraftTokens/maxDraftTokens: need 1 <= min <= max, got {self.min_gamma}, "
                             f"{self.max_gamma}")
        if not self.min_gamma <= self.gamma <= self.max_gamma:
            raise ValueError(f"numSpeculativeTokens: {self.gamma} outside [minDraftTokens, maxDraftTokens] = "
                             f"[{self.min_gamma}, {self.max_gamma}]")
        if self.hysteresis < 0 or self.margin < 0 or not 0 <= self.probe <= 1 or not 0 <= self.probe_optimism <= 1:
            raise ValueError(f"hysteresis and margin must be >= 0, probe and probe_optimism in [0, 1], got "
                             f"{self.hysteresis}, {self.margin}, {self.probe}, {self.probe_optimism}")
        if not 0 <= self.length_tie < 1:
            raise ValueError(f"length_tie must be in [0, 1), got {self.length_tie}")
        if self.warm_max_draft_cost < 0:
            raise ValueError(f"warm_max_draft_cost must be >= 0, got {self.warm_max_draft_cost}")
        if not self.alpha_memory > 0 or not self.shape_memory > 0 or not self.stop_memory > 0:
            raise ValueError(f"alpha_memory, shape_memory and stop_memory must be > 0, got {self.alpha_memory}, "
                             f"{self.shape_memory}, {self.stop_memory}")
        if self.horizon < 1 or self.recheck < 1 or not self.recheck_cost > 0:
            raise ValueError(f"horizon and recheck must be >= 1 and recheck_cost > 0, got {self.horizon}, "
                             f"{self.recheck}, {self.recheck_cost}")
        if self.neighbour < 0:
            raise ValueError(f"neighbour must be >= 0, got {self.neighbour}")
        if min(self.window, self.refresh, self.settled_refresh, self.probe_run, self.probe_max_batch,
               self.max_table_age) < 1:
            raise ValueError(f"window, refresh, settled_refresh, probe_run, probe_max_batch and max_table_age must be "
                             f">= 1, got {self.window}, {self.refresh}, {self.settled_refresh}, {self.probe_run}, "
                             f"{self.probe_max_batch}, {self.max_table_age}")
        if self.stable_refresh < self.refresh or self.settled_stable_refresh < self.settled_refresh:
            raise ValueError(f"stable_refresh must be >= refresh and settled_stable_refresh >= settled_refresh, got "
                             f"{self.stable_refresh} < {self.refresh} or {self.settled_stable_refresh} < "
                             f"{self.settled_refresh}")

    @property
    def adaptive(self) -> bool:
        return self.toggle or self.draft_length or self.strategy

    @property
    def probe_period(self) -> int:
        """Steps between the starts of two probes (0: no probes)."""
        return max(round(self.probe_run / self.probe), 1) if self.probe > 0 else 0

    def gammas(self) -> list[int]:
        return list(range(self.min_gamma, self.max_gamma + 1)) if self.draft_length else [self.gamma]


class AdaptiveController:
    """The engine's per-step hook (`control.Controller`); see the module docstring.

    `methods`: the proposers the engine built; `cost_model`: from `calibrate(...)` (optional: without one the
    controller measures plain decoding first and probes every proposer once before choosing).
    """

    def __init__(self, methods: Sequence[str], cost_model: CostModel | None = None,
                 settings: AdaptiveSettings | None = None, metrics: Any | None = None,
                 alpha_priors: Mapping[str, float] | None = None) -> None:
        self.settings = s = settings or AdaptiveSettings()
        names = list(dict.fromkeys(m for m in methods if m and m != "none"))
        self.methods = names if s.strategy else names[:1]
        self.metrics = metrics
        self._reported: Decision | None = None  # what the gauges show (they are set when it changes, not every step)
        self.estimates = Estimates(self.methods, cost_model, s, alpha_priors)
        self._probing: tuple[Decision, int] | None = None  # a probe burst in progress: (option, steps left)
        self._tables: dict[int, _Table] = {}  # per batch key
        self._key_steps: Counter[int] = Counter()  # per batch key, the steps that ran there (tables' clocks)
        self._held: _Held | None = None  # the last argmax, while it stands (`decide`'s fast path)
        self._surprised = False  # the last step cost far from its prediction (`observe`)
        self._measured = False  # every option has been measured (`_unmeasured`)
        # records not folded yet, with their CPU seconds and the step that ran them
        self._pending: list[tuple[StepRecord, float | None, int]] = []
        self._clock = StepClock(s.clock)
        self.current = AR
        self.steps = self.sd_steps = self.probes = self.neighbours = 0
        self._counts: dict[int, Counter[str]] = {}
        self._speculated_at: dict[int, int] = {}  # per batch size, the last step that speculated there
        self._last_speculation_recheck = -(10 ** 9)

    @property
    def alpha(self) -> dict[str, float]:
        """Per proposer, its acceptance rate per draft token (the estimate's level)."""
        self._fold()
        return self.estimates.alpha

    @property
    def costs(self) -> CostModel | None:
        """The step costs as measured so far (the calibration's where nothing was measured yet)."""
        self._fold()
        return self.estimates.costs

    # -- the argmax ------------------------------------------------------------------------------------------

    def table(self, batch: int) -> Options:
        """Per option (None: plain decoding), its predicted speed relative to plain decoding and its best γ."""
        return self._table(batch).options

    def _table(self, batch: int) -> _Table:
        key = batch_key(batch)
        cached = self._tables.get(key)
        at = self._key_steps[key]
        if cached is not None and self._current(cached, at):
            return cached
        if self._pending:
            self._fold()
            if self._tables.get(key) is not cached:  # a record moved its estimates by 10%: the period starts over
                cached = None
        s = self.settings
        out: Options = {}
        if s.toggle or not self.methods:
            out[None] = (1.0, AR)
        costs = self.estimates.costs
        plain = 0.0
        if costs is not None:
            gammas = s.gammas()
            verify = costs.verify_ratios(batch, gammas)
            for m in self.methods:
                if costs.knows(m):
                    g, speed = costs.best_gamma(m, batch, self.continuing(m, batch), gammas, verify, s.length_tie)
                    out[m] = (speed, Decision(m, g))
            plain = costs.t_ar(batch)
        optimistic = math.inf
        if None in out and costs is not None and all(costs.knows(m) for m in self.methods) \
                and max(v[0] for v in out.values()) <= 1:
            optimistic = max((self._optimistic_speed(costs, m, batch, verify) for m in self.methods), default=0.0)
        if optimistic < 1:
            period = min(max(cached.period, s.settled_refresh) * 2, s.settled_stable_refresh) \
                if cached is not None and cached.settled else s.settled_refresh
        elif cached is not None and out and cached.options and _leader(out) == _leader(cached.options):
            period = min(max(cached.period, s.refresh) * 2, s.stable_refresh)
        else:
            period = s.refresh
        table = self._tables[key] = _Table(at, at + period, out, plain, self.steps, optimistic)
        return table

    def _current(self, table: _Table, at: int) -> bool:
        """Whether `table` still stands at its batch key's step `at`."""
        return at < table.until and self.steps - table.born < self.settings.max_table_age

    def choose(self, batch: int) -> Decision:
        """The argmax with hysteresis (no probes): what the policy exploits at this batch size."""
        return self._pick(self.table(batch))

    def _pick(self, options: Options) -> Decision:
        if not options:  # plain decoding excluded and nothing measured yet: try the first proposer
            return Decision(self.methods[0], self.settings.gamma)
        best = _leader(options).method
        incumbent = self.current.method if is_speculative(self.current) else None
        if best is not None and incumbent in options \
                and options[best][0] < options[incumbent][0] * (1 + self.settings.hysteresis):
            best = incumbent
        return options[self._or_plain(options, best)][1]

    def _or_plain(self, options: Mapping[str | None, tuple[float, Decision]], option: str | None) -> str | None:
        """`option`, or plain decoding where that is an option and `option` does not beat it by `margin`."""
        if option is not None and None in options and options[option][0] < options[None][0] * (1 + self.settings.margin):
            return None
        return option

    def _probe(self, batch: int) -> Decision | None:
        """An option to measure this step instead of the argmax, or None."""
        s = self.settings
        if self._pending and self._unmeasured():
            self._fold()  # the records kept since may have measured it
        costs = self.estimates.costs
        if costs is None:  # nothing measured yet: plain decoding first, it is the baseline of everything
            return AR if s.toggle else Decision(self.methods[0], s.gamma)
        if batch > s.probe_max_batch:
            self._probing = None
            return None
        if not self._measured:  # proposers without a draft cost or enough acceptance evidence come first
            for m in self.methods:
                if not costs.knows(m) or self.estimates.evidence(m) < MIN_TRIED:
                    return Decision(m, s.gamma)
        if self._probing is not None:
            option, left = self._probing
            self._probing = (option, left - 1) if left > 1 else None
            return option
        if not s.probe_period or self.steps % s.probe_period:
            return None
        if self._pending:
            self._fold()  # which option is stalest
        options = self.table(batch)
        current = self.current.method if is_speculative(self.current) else None
        candidates = [k for k in options if k != current and self._could_win(k, batch, options)]
        stale = min(candidates, key=lambda k: self.estimates.last_run.get(k, -1), default=current)
        if stale == current:
            return None
        option = options[stale][1]
        if is_speculative(option):  # draft at least `gamma` tokens: a probe is for evidence, 1 token says little
            option = Decision(option.method, max(option.gamma, s.gamma))
        self._probing = (option, s.probe_run - 1) if s.probe_run > 1 else None
        return option

    def _unmeasured(self) -> bool:
        """Whether an option has yet to be measured: plain decoding, or a proposer's cost or acceptance. Once all
        are, they stay so (a cost is never forgotten, and decayed evidence never falls back under `MIN_TRIED`: a
        record of t tried tokens keeps exp(-t / alpha_memory) of it and adds t, which shrinks it only above
        ~`alpha_memory` tokens), and it is read on every step that is not held."""
        if self._measured:
            return False
        costs = self.estimates.costs
        self._measured = costs is not None and all(costs.knows(m) and self.estimates.evidence(m) >= MIN_TRIED
                                                   for m in self.methods)
        return not self._measured

    def _neighbour(self) -> Decision | None:
        """Every `neighbour` steps, the running proposer at the draft length next to the argmax's, longer and
        shorter in turn (see "neighbours" in the module docstring), or None."""
        s, current = self.settings, self.current
        if not s.neighbour or not s.draft_length or not is_speculative(current) or self.steps % s.neighbour:
            return None
        first, second = (current.gamma + 1, current.gamma - 1) if self.steps // s.neighbour % 2 \
            else (current.gamma - 1, current.gamma + 1)
        gamma = first if s.min_gamma <= first <= s.max_gamma else second
        return Decision(current.method, gamma) if s.min_gamma <= gamma <= s.max_gamma else None

    def _could_win(self, option: str | None, batch: int, options: Mapping[str | None, tuple[float, Decision]]
                   ) -> bool:
        """Whether a probe of `option` could change the choice: a proposer must beat the best option's predicted
        speed with an acceptance `probe_optimism` above its estimate (a probe of a hopeless option costs several
        slow steps: an n-gram probe at batch 16 ran at 0.4x plain); plain decoding, the baseline of every ratio,
        always could."""
        costs = self.estimates.costs
        if option is None or costs is None:
            return True
        return self._optimistic_speed(costs, option, batch) > max(v[0] for v in options.values())

    def _optimistic_speed(self, costs: CostModel, method: str, batch: int,
                          verify: Mapping[int, float] | None = None) -> float:
        """`method`'s predicted speed at its best γ with an acceptance `probe_optimism` above its estimate."""
        acceptance = self.continuing(method, batch, self.settings.probe_optimism)
        return costs.best_gamma(method, batch, acceptance, self.settings.gammas(), verify)[1]

    def decide(self, active_batch_size: int) -> Decision:
        s = self.settings
        self.steps += 1
        held = self._held
        self._key_steps[held.key if held is not None and held.batch == active_batch_size
                        else batch_key(active_batch_size)] += 1
        if held is not None and self.steps < held.until and self.current is held.decision \
                and self._probing is None and self._tables.get(held.key) is held.table \
                and (held.batch == active_batch_size or (held := self._carry(held, active_batch_size)) is not None):
            # The last argmax still stands: same batch size (or plain decoding into a settled table), same table,
            # no probe due. Most steps of a rollout end here (see "What a step costs the policy" in the module
            # docstring).
            held.counts[held.label] += 1
            if held.speculative:
                self.sd_steps += 1
                self._speculated_at[held.batch] = self.steps
            self._report(held.decision)
            self._clock.start()
            return held.decision
        if self._surprised:  # fold now: the estimates' own check decides whether the table is recomputed
            self._surprised = False
            self._fold()
        probe = neighbour = None
        if not self.methods or active_batch_size < 1:
            decision = AR
        elif not s.adaptive:
            decision = Decision(self.methods[0], s.gamma)
        else:
            probe = self._probe(active_batch_size)
            if probe is None and active_batch_size <= s.probe_max_batch:
                neighbour = self._neighbour()
            decision = probe or neighbour or self.choose(active_batch_size)
            if probe is None and neighbour is None and self._plain_is_stale(active_batch_size, decision):
                self.current, probe, decision = decision, AR, AR
            elif probe is None and neighbour is None and not is_speculative(decision) \
                    and (option := self._speculation_recheck(active_batch_size)) is not None:
                self.current, probe, decision = decision, option, option
        if is_speculative(decision):
            self._speculated_at[active_batch_size] = self.steps
        exploring = probe is not None or neighbour is not None
        if not exploring:
            self.current = decision
        self.probes += probe is not None
        self.neighbours += neighbour is not None
        self.sd_steps += is_speculative(decision)
        counts = self._counts.get(active_batch_size)
        if counts is None:  # not setdefault: it would build a Counter at every step
            counts = self._counts[active_batch_size] = Counter()
        counts[label(decision)] += 1
        self._held = self._hold(active_batch_size, decision, counts) if not exploring and s.adaptive else None
        self._report(decision)
        self._clock.start()
        return decision

    def _plain_is_stale(self, batch: int, decision: Decision) -> bool:
        """Whether plain decoding's cost at this batch size is due a recheck while `decision` runs (see "plain
        rechecks" in the module docstring)."""
        s = self.settings
        if not s.toggle or not is_speculative(decision) or batch > s.probe_max_batch:
            return False
        return self.steps > self._recheck_due(batch, decision, None)

    def _recheck_due(self, batch: int, decision: Decision, options: Options | None) -> float:
        """The last step before plain decoding's cost at this batch size is due a recheck while `decision` runs
        (`options`: this batch size's table, if at hand; inf: never measured here, so nothing to recheck: the
        calibration's or a neighbour's cost stands).

        Counted in all steps, not in steps at this batch size (tried and reverted, thirty-fourth session): a batch
        size the long-tail workload visits for two or three steps per rollout step then went unrechecked for whole
        rollouts, and in one of two runs the policy decoded plainly in 430 steps at batch 16 (the serving shape at
        1.02x plain decoding; two runs of this code on the same seeds: 41 and 162 such steps, 1.12x and 1.09x). A
        recheck at each such visit times plain decoding in the same moments as the speculation it is compared with."""
        s = self.settings
        measured = self.estimates.plain_measured_at(batch)
        if measured is None:
            return math.inf
        if self.steps - measured > s.recheck:
            # a plain step since may be among the records not folded yet (read there: folding here, at nearly
            # every step that is not held, cost as much as the tables)
            measured = max((step for record, _, step in self._pending
                            if record.batch_size == batch and not (record.method and record.gamma > 0)),
                           default=measured)
            if self.steps - measured <= s.recheck:
                return measured + s.recheck
        gain = (options if options is not None else self.table(batch))[decision.method][0] - 1
        return measured + max(s.recheck, gain / s.recheck_cost)

    def _speculation_recheck(self, batch: int) -> Decision | None:
        """The leading proposer at its γ, to run this one step in place of the plain decoding chosen here, where
        nothing speculated at this batch size for `horizon` steps (at most one such step in `recheck`, none where
        the table is settled); else None. See "speculation rechecks" in the module docstring."""
        s = self.settings
        if batch > s.probe_max_batch or self.steps - self._speculated_at.get(batch, 0) <= s.horizon \
                or self.steps - self._last_speculation_recheck < s.recheck:
            return None
        table = self._tables.get(batch_key(batch))
        if table is None or table.settled:
            return None
        options = table.options
        leader = max((k for k in options if k is not None), key=lambda k: options[k][0], default=None)
        if leader is None:
            return None
        self._last_speculation_recheck = self.steps
        return options[leader][1]

    def _hold(self, batch: int, decision: Decision, counts: Counter[str]) -> _Held | None:
        """`decision` held at this batch size until its table's next refresh or the next step a probe may start."""
        s, key, costs = self.settings, batch_key(batch), self.estimates.costs
        table = self._tables.get(key)
        if table is None or costs is None or self.steps <= 0:
            return None
        speculative = is_speculative(decision)
        method = decision.method
        predicted = costs.round_seconds(method, decision.gamma, batch) \
            if method is not None and speculative and costs.knows(method) else costs.t_ar(batch)
        until = self._until(table, batch, speculative)
        if speculative and s.toggle and batch <= s.probe_max_batch and method in table.options \
                and (due := self._recheck_due(batch, decision, table.options)) < until:
            until = math.floor(due) + 1
        return _Held(batch, until, decision, key, table, counts, label(decision), speculative, predicted,
                     sparse=not speculative and table.settled)

    def _carry(self, held: _Held, batch: int) -> _Held | None:
        """Plain decoding held into another batch size whose table is settled (it would choose plain decoding
        there too), without computing anything; None where the step must think."""
        if held.speculative:
            return None
        key = batch_key(batch)
        table = self._tables.get(key)
        if table is None or not table.settled or not self._current(table, self._key_steps[key]):
            return None
        until = self._until(table, batch, False)
        if self.steps >= until:
            return None
        counts = self._counts.get(batch)
        if counts is None:
            counts = self._counts[batch] = Counter()
        # in place: the tail visits a new batch size every step or two, and this runs inside the decode loop
        held.batch, held.until, held.key, held.table, held.counts = batch, until, key, table, counts
        held.seconds, held.sparse, held.kept = table.plain_seconds, True, False
        return held

    def _until(self, table: _Table, batch: int, speculative: bool) -> int:
        """The step a hold at this batch size ends: its table's refresh, or the next step a probe (or, while a
        proposer runs, a neighbour step) may start."""
        until = self.steps + min(table.until - self._key_steps[batch_key(batch)],
                                 table.born + self.settings.max_table_age - self.steps)
        if batch <= self.settings.probe_max_batch:
            for period in (self.settings.probe_period, self.settings.neighbour if speculative else 0):
                if period:
                    until = min(until, (self.steps // period + 1) * period)
        return until

    def _report(self, decision: Decision) -> None:
        if self.metrics is not None and decision is not self._reported and decision != self._reported:
            self._reported = decision
            self.metrics.spec_decode_enabled.set(1 if is_speculative(decision) else 0)
            self.metrics.spec_decode_draft_length.set(decision.gamma if is_speculative(decision) else 0)

    def warm_proposers(self, active_batch_size: int) -> list[str]:
        """The proposers the engine prefills on admission into a batch of `active_batch_size` sequences: the one
        this policy will run there and the argmax at batch 1 (the tail, which every sequence reaches) if its
        drafting is cheap (`warm_max_draft_cost`); before any estimate, all of them (each is probed first). The
        rest catch up on a sequence's prompt when a probe or a switch first runs them. Not the one running now:
        after a tail that ran a costly drafter a refilled full batch decodes plainly, and prefilling that drafter
        for all of it cost SmolLM2's batch of 8 a third of its rate (adaptive 77.7 tok/s against plain's 93.2, when
        quantized_self still kept a cache of its own)."""
        if not self.settings.adaptive:
            return self.methods[:1]
        costs = self.estimates.costs
        if costs is None:
            return list(self.methods)
        # Tables as last computed, however old, and no records folded: which proposer leads changes rarely, and a
        # server-style batch admits at every finish. Read fresh, at batch 4 in the benchmark's sweep, the admissions
        # cost 0.2 ms each (batch 1's table had always expired, and each folded the few records since the last
        # fold, which the weight streams leave cold), 1.8% of the decode time.
        running = self._pick(self._last_options(active_batch_size)).method
        tail = self._last_options(1)
        best = _leader(tail).method if tail else None
        if best is not None and best != running:
            one, two = costs.draft_ratios(best, 1, (1, 2)).values()
            if two - one > self.settings.warm_max_draft_cost:
                best = None
        return list(dict.fromkeys(m for m in (running, best) if m))

    def _last_options(self, batch: int) -> Options:
        """This batch size's table as last computed, whatever its age (computed now where there is none)."""
        cached = self._tables.get(batch_key(batch))
        return cached.options if cached is not None else self.table(batch)

    # -- estimates -------------------------------------------------------------------------------------------

    def acceptance(self, method: str, optimism: float = 0.0) -> Acceptance:
        """`Estimates.acceptance`, with every record so far folded in."""
        if self._pending:
            self._fold()
        return self.estimates.acceptance(method, optimism)

    def stop_hazard(self, batch: int) -> float:
        if self._pending:
            self._fold()
        return self.estimates.stop_hazard(batch)

    def continuing(self, method: str, batch: int, optimism: float = 0.0) -> Acceptance:
        if self._pending:
            self._fold()
        return self.estimates.continuing(method, batch, optimism)

    def observe(self, decision: Decision, record: StepRecord) -> None:
        # Only kept here: the records reach the estimates on the next step that computes anything (`_fold`), so
        # the steps that keep the last argmax run no estimation in the decode loop. A table is never computed from
        # records not folded yet.
        seconds = self._clock.elapsed()
        held = self._held
        if held is not None:
            if held.seconds > 0:
                # a step far from what its choice was predicted to cost ends the hold (and is kept): the next step
                # folds, and the estimates' own check (`learn`) decides whether the table is recomputed
                off = (record.seconds if seconds is None else seconds) / held.seconds
                if not 1 / SURPRISE < off < SURPRISE:
                    self._held = held = None
                    self._surprised = True
            if held is not None and held.sparse:
                if held.kept:  # plain decoding on a settled table: the visit's first record stands for it
                    return
                held.kept = True
        self._pending.append((record, seconds, self.steps))

    def _fold(self) -> None:
        """Bring the kept records into the estimates, in the order the steps ran."""
        pending, self._pending = self._pending, []
        speculated = False
        for record, seconds, step in pending:
            speculated = speculated or (record.method is not None and record.gamma > 0)
            moved = self.estimates.learn(retimed(record, seconds), step)
            if abs(moved - 1) > 0.1:
                key = batch_key(record.batch_size)
                table = self._tables.get(key)
                # a settled table stands a cost move its margin covers (an estimate of a batch size the tail visits
                # for a step or two rests on a few samples, and moves by 10% at a jitter)
                if table is not None and not table.optimistic * max(moved, 1 / moved) < 1:
                    del self._tables[key]
        if speculated:  # acceptance moved: a settled table read it, and it is what a settled table's margin rests on
            self._tables = {k: t for k, t in self._tables.items() if not t.settled}

    # -- visibility ------------------------------------------------------------------------------------------

    def stats(self) -> dict[str, Any]:
        if self._pending:
            self._fold()
        return {
            "adaptive": True,
            "current_method": self.current.method,
            "current_gamma": self.current.gamma,
            "sd_enabled": is_speculative(self.current),
            "sd_share": self.sd_steps / self.steps if self.steps else 0.0,
            "steps": self.steps,
            "probe_steps": self.probes,
            "neighbour_steps": self.neighbours,
            "decisions_by_batch_size": self.decisions_by_batch_size(),
            "alpha": {m: round(a, 4) for m, a in self.estimates.alpha.items()},
            "stop_hazard_by_batch_size": {b: round(h, 4) for b, h in self.estimates.stop_hazards().items()},
            "acceptance_by_position": {m: [round(p, 3) for p in a] for m in self.methods
                                       if not isinstance(a := self.acceptance(m), float)},
        }

    def decisions_by_batch_size(self) -> dict[int, dict[str, int]]:
        """Per batch size, the steps each option ran (probes and neighbours included). Unlike `stats`, folds
        nothing: a benchmark reads it between runs without moving the estimates."""
        return {b: dict(c) for b, c in sorted(self._counts.items())}

    def per_batch_size_gamma(self, max_batch: int = 256) -> list[list[int]]:
        """vLLM's ``num_speculative_tokens_per_batch_size`` ([[start_bs, end_bs, K], ...], inclusive, K=0 off):
        the argmax's γ at every batch size with the current estimates (no hysteresis, no probes)."""
        ranges: list[list[int]] = []
        for b in range(1, max_batch + 1):
            options: dict[str | None, tuple[float, Decision]] = \
                self.table(b) if self.methods else {None: (1.0, AR)}
            k = options[self._or_plain(options, _leader(options).method)][1].gamma \
                if options else self.settings.gamma
            if ranges and ranges[-1][2] == k:
                ranges[-1][1] = b
            else:
                ranges.append([b, b, k])
        return ranges


def _leader(options: Options) -> Decision:
    """The fastest option's decision (no margin, no hysteresis); its `method` is the option's key (None: plain)."""
    return options[max(options, key=lambda k: options[k][0])][1]


# ---------------------------------------------------------------------------------------------------------------
# building a controller from the RLJob


def settings_from_spec(speculative: Any, **overrides: Any) -> AdaptiveSettings:
    """Map the RLJob's ``spec.speculative`` (`specrl.runtime.api.SpeculativeSpec`, or its YAML mapping) onto
    `AdaptiveSettings`; `overrides` set fields the API does not carry (hysteresis, clock, ...)."""
    from ..api import SpeculativeSpec  # pydantic only; keeps this module importable alone

    try:
        spec = speculative if isinstance(speculative, SpeculativeSpec) else SpeculativeSpec.model_validate(
            speculative or {})
    except ValueError as exc:
        raise ValueError(f"spec.speculative: {exc}") from None
    a = spec.adaptive
    fields = {"toggle": a.toggle, "draft_length": a.draft_length, "strategy": a.strategy,
              "gamma": spec.num_speculative_tokens, "min_gamma": a.min_draft_tokens, "max_gamma": a.max_draft_tokens,
              "probe": a.epsilon, "window": a.window}
    return AdaptiveSettings(**{**fields, **overrides})


def controller_from_spec(speculative: Any, methods: Sequence[str] | None = None, cost_model: CostModel | None = None,
                         metrics: Any | None = None, **overrides: Any) -> AdaptiveController:
    """An `AdaptiveController` for the RLJob's ``spec.speculative`` (`methods`: the proposers the engine built;
    default: the spec's method only)."""
    from ..api import SpeculativeSpec

    spec = speculative if isinstance(speculative, SpeculativeSpec) else SpeculativeSpec.model_validate(
        speculative or {})
    if methods is None:
        methods = [] if spec.method == "none" else [spec.method]
    return AdaptiveController(methods, cost_model=cost_model, settings=settings_from_spec(spec, **overrides),
                              metrics=metrics)
