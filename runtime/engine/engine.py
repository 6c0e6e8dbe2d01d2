"""The native rollout engine: batched decode over a static KV cache, continuous batching, lossless speculation.

    engine = RolloutEngine(model, speculative=SpeculativeConfig(method="draft_model", num_speculative_tokens=4),
                           draft_model=draft)
    outs = engine.generate(prompts, SamplingParams(temperature=1.0, max_new_tokens=64, seed=0))

Invariants (per active sequence, slots 0..B-1): the target cache holds len(tokens) - 1 positions and the
last token is "pending" (fed by the next step). An AR step feeds the pending token and samples one; a
speculative step feeds the pending token plus gamma drafts in ONE target forward, verifies them with
`rejection_sample` and rolls the cache back to the accepted length (a length update, nothing is copied).

Shared prefill (`share_prefill`, default on): GRPO samples each prompt `groupSize` times; a prompt already in
the cache (a sibling still decoding, or earlier in the same admission wave) is copied into the new slot instead of
prefilled again, drafters' caches included, and its first token is sampled from the kept last hidden state with the
request's own params and generator. Outputs are bit-identical to sharing off (tests/unit/engine/
test_shared_prefill.py).

Randomness: each request owns a CPU `torch.Generator` (seeded from `SamplingParams.seed`, else from the
engine's seed) and draws a fixed number of float64 uniforms per step (AR: 1; speculative with gamma: 2*gamma+1)
whatever is accepted, so an AR request's tokens do not depend on what else is in the batch. Greedy requests
read no uniforms (every token is an argmax), so a batch of greedy requests draws none.

Per-step overhead (the long tail runs at small batch, where a forward of a small model costs little more than
its Python): a speculative step moves data to the host once (tokens, logprobs, and draft lengths only where the
host lacks them), the rejection sampler touches one [B, V] row per sequence beyond the [B, gamma] acceptance
test, and greedy batches verify by argmax without building probabilities.

Logprobs: `RequestOutput.logprobs[i]` is the TARGET's log-probability of token i. With
`SamplingParams.logprobs_mode="processed"` (default) it is taken from the processed distribution the token was
sampled from (temperature/top-k/top-p applied; greedy -> 0.0); with "raw" from log_softmax of the raw logits.
AR and speculative steps compute it the same way from the target's logits at that position.

Control hook: see `specrl.runtime.engine.control` (`decide(active_batch_size) -> Decision`, `observe(decision,
record)`); default: `FixedController` from the SpeculativeConfig. Proposers for every name in
`SpeculativeConfig.candidates()` are built up front so a controller can switch between them per step.
"""

from __future__ import annotations

import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
from torch import nn

from .control import Controller, Decision, FixedController, StepRecord
from .model_runner import TransformerRunner
from .proposers.base import DraftContext, Proposer
from .rejection_sampler import greedy_verify, rejection_sample
from .sampling import (
    BatchSamplingTensors,
    SamplingParams,
    process_logits,
    sample_from_probs,
)

if TYPE_CHECKING:
    from .proposers.eagle import EagleHead

METHODS = ("none", "draft_model", "ngram", "layer_skip", "quantized_self", "eagle")
Method = Literal["none", "draft_model", "ngram", "layer_skip", "quantized_self", "eagle"]


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "none"
    num_speculative_tokens: int = 4
    # Extra proposers to build so a controller can pick among them per step (the main method is always built).
    extra_methods: tuple[str, ...] = ()
    # Largest gamma a controller may ask for (sizes the cache headroom); default max(8, num_speculative_tokens).
    max_speculative_tokens: int | None = None
    ngram_max: int = 4
    ngram_min: int = 1
    layer_skip_layers: int | None = None  # default: half of the target's layers
    quantized_bits: int | None = None  # quantized_self weights: 4 or 8; default 4 where the CPU int4 kernel exists

    def __post_init__(self) -> None:
        object.__setattr__(self, "extra_methods", tuple(self.extra_methods))
        for m in (self.method, *self.extra_methods):
            if m not in METHODS:
                raise ValueError(f"method: must be one of {', '.join(METHODS)}, got {m!r}")
        if not isinstance(self.num_speculative_tokens, int) or self.num_speculative_tokens < 1:
            raise ValueError(f"num_speculative_tokens: must be an integer >= 1, got {self.num_speculative_tokens!r}")
        if self.max_speculative_tokens is not None and self.max_speculative_tokens < self.num_speculative_tokens:
            raise ValueError("max_speculative_tokens: must be >= num_speculative_tokens")
        if not (1 <= self.ngram_min <= self.ngram_max):
            raise ValueError(f"ngram_min: must satisfy 1 <= ngram_min <= ngram_max, got {self.ngram_min}, "
                             f"{self.ngram_max}")
        if self.quantized_bits not in (None, 4, 8):
            raise ValueError(f"quantized_bits: must be 4 or 8, got {self.quantized_bits!r}")
        if self.layer_skip_layers is not None and self.layer_skip_layers < 1:
            raise ValueError(f"layer_skip_layers: must be >= 1, got {self.layer_skip_layers}")

    def candidates(self) -> tuple[str, ...]:
        out = [m for m in (self.method, *self.extra_methods) if m != "none"]
        return tuple(dict.fromkeys(out))

    @property
    def gamma_cap(self) -> int:
        return self.max_speculative_tokens or max(8, self.num_speculative_tokens)


@dataclass
class RequestOutput:
    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" | "length"


@dataclass
class EngineStats:
    drafts: int = 0  # (request, step) pairs that got at least one draft token (vLLM num_drafts)
    draft_tokens: int = 0
    accepted_tokens: int = 0
    target_forwards: int = 0  # prefill + AR + verify forwards of the target
    prefill_forwards: int = 0
    prefill_rows: int = 0  # prompts the target prefilled (fewer than requests when identical prompts share one)
    generated_tokens: int = 0
    sd_steps: int = 0
    ar_steps: int = 0
    requests_completed: int = 0
    # accepted_per_position[i]: drafts whose token at position i was accepted (vLLM num_accepted_tokens_per_pos)
    accepted_per_position: list[int] = field(default_factory=list)
    decode_seconds: float = 0.0
    prefill_seconds: float = 0.0
    steps: deque[StepRecord] = field(default_factory=lambda: deque(maxlen=100_000))
    # The controller's own view (its `stats()` dict, e.g. the adaptive toggle/bandit state), refreshed after
    # every generate() call when the controller has a `stats()` method.
    controller: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        """Counters and derived rates (no per-step records), JSON-serialisable."""
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k not in ("steps", "controller")}
        out["acceptance_length"] = self.acceptance_length
        out["acceptance_rate"] = self.acceptance_rate
        out["controller"] = dict(self.controller)
        return out

    @property
    def acceptance_length(self) -> float | None:
        """Mean tokens emitted per draft (1 + accepted/drafts), as vLLM reports it."""
        return None if self.drafts == 0 else 1.0 + self.accepted_tokens / self.drafts

    @property
    def acceptance_rate(self) -> float | None:
        return None if self.draft_tokens == 0 else self.accepted_tokens / self.draft_tokens

    def reset(self) -> None:
        fresh = EngineStats()
        for k in fresh.__dataclass_fields__:
            setattr(self, k, getattr(fresh, k))


@dataclass
class _Seq:
    request_id: int
    tokens: list[int]
    prompt_len: int
    params: SamplingParams
    generator: torch.Generator
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str | None = None

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


class RolloutEngine:
    def __init__(
        self,
        model: nn.Module,
        speculative: SpeculativeConfig | None = None,
        draft_model: nn.Module | None = None,
        eagle_head: EagleHead | None = None,
        max_batch_size: int = 16,
        max_model_len: int | None = None,
        controller: Controller | None = None,
        seed: int | None = None,
        dtype: str | torch.dtype | None = None,
        share_prefill: bool = True,
    ) -> None:
        if not isinstance(max_batch_size, int) or max_batch_size < 1:
            raise ValueError(f"max_batch_size: must be an integer >= 1, got {max_batch_size!r}")
        self.model = model  # not switched to eval(): the engine never runs its modules, a trainer may own it
        self.speculative = speculative or SpeculativeConfig()
        cfg = model.config
        # Default context: the model's, capped at 4096 — the static cache is preallocated for every slot.
        limit = int(getattr(cfg, "max_position_embeddings", 2048))
        self.max_model_len = int(max_model_len or min(limit, 4096))
        if self.max_model_len < 2:
            raise ValueError(f"max_model_len: must be >= 2, got {self.max_model_len}")
        self.max_batch_size = max_batch_size
        # Prefill identical prompts admitted together once (see `_prefill`); off only to compare against.
        self.share_prefill = share_prefill
        self.max_gamma = self.speculative.gamma_cap
        # Speculative steps write up to gamma positions past a sequence's end before rollback (real positions end
        # at max_model_len - 1 + gamma); the one after is scratch for right-padded ragged forwards (see `plan`).
        self.cache_len = self.max_model_len + self.max_gamma + 1
        # dtype: None runs in the model's own dtype (the losslessness reference); "auto" in bfloat16 where the
        # CPU has native bf16 kernels. Sampling and rejection math stay in fp32/fp64 either way.
        self.runner = TransformerRunner(model, max_positions=self.cache_len, dtype=dtype)
        self.device = self.runner.device
        self.vocab_size = self.runner.vocab_size
        self.cache = self.runner.new_cache(max_batch_size, self.cache_len)
        self.stats = EngineStats()
        self._rng = random.Random(seed)
        self.controller: Controller = controller or FixedController(self.speculative.method,
                                                                      self.speculative.num_speculative_tokens)
        self.proposers: dict[str, Proposer] = {}
        for name in self.speculative.candidates():
            self.proposers[name] = self._build_proposer(name, draft_model, eagle_head)
        for p in self.proposers.values():
            p.attach(self)
        self._step = 0

    # ---- proposers -----------------------------------------------------------------------------------------
    def _build_proposer(self, name: str, draft_model: nn.Module | None, eagle_head: EagleHead | None) -> Proposer:
        from . import proposers as P

        if name == "draft_model":
            if draft_model is None:
                raise ValueError("draft_model: method 'draft_model' needs a draft model (draft_model=...)")
            return P.DraftModelProposer(draft_model)
        if name == "ngram":
            return P.NgramProposer(self.speculative.ngram_min, self.speculative.ngram_max)
        if name == "layer_skip":
            return P.LayerSkipProposer(self.speculative.layer_skip_layers)
        if name == "quantized_self":
            return P.QuantizedSelfProposer(self.model, self.speculative.quantized_bits)
        if name == "eagle":
            return P.EagleProposer(eagle_head)
        raise ValueError(f"method: unknown proposer {name!r}")

    def add_proposer(self, name: str, proposer: Proposer) -> None:
        """Register a custom proposer a controller can select by name."""
        proposer.attach(self)
        self.proposers[name] = proposer

    def refresh_drafter(self) -> None:
        """Make every drafter follow the current policy weights (re-quantize, re-read shared weights)."""
        for p in self.proposers.values():
            p.refresh(self.model)

    @torch.no_grad()
    def load_drafter_state(self, state_dict: dict[str, torch.Tensor], method: str | None = None) -> None:
        """Load pushed drafter weights (the draft model's, or the eagle head's) and refresh that proposer."""
        name = method or next((m for m in ("draft_model", "eagle") if m in self.proposers), None)
        proposer = self.proposers.get(name) if name else None
        module = getattr(proposer, "draft_model", None) if name == "draft_model" else getattr(proposer, "head", None)
        if proposer is None or module is None:
            raise ValueError(f"method: no trainable drafter ({method or 'draft_model/eagle'}) in this engine; "
                             f"proposers: {sorted(self.proposers)}")
        try:
            module.load_state_dict(state_dict, strict=True)
        except RuntimeError as exc:
            raise ValueError(f"state_dict: does not match the {name} drafter: {exc}") from None
        proposer.refresh(self.model)

    @torch.no_grad()
    def load_policy_state(self, state_dict: dict[str, torch.Tensor]) -> None:
        """Load new policy weights (strict) and refresh the engine's fused weights and every drafter."""
        try:
            self.model.load_state_dict(state_dict, strict=True)
        except RuntimeError as exc:
            raise ValueError(f"state_dict: does not match the policy model: {exc}") from None
        self.runner.refresh()
        self.refresh_drafter()

    # ---- validation ----------------------------------------------------------------------------------------
    def _validate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams]) -> list[SamplingParams]:
        if not isinstance(prompts, (list, tuple)):
            raise ValueError("prompts: must be a list of token-id lists")  # noqa: TRY004 - bad input is ValueError
        if isinstance(params, SamplingParams):
            plist = [params] * len(prompts)
        else:
            plist = list(params)
            if len(plist) != len(prompts):
                raise ValueError(f"params: got {len(plist)} SamplingParams for {len(prompts)} prompts")
            if not all(isinstance(p, SamplingParams) for p in plist):
                raise ValueError("params: must be SamplingParams or a list of them")
        for i, prompt in enumerate(prompts):
            if not isinstance(prompt, (list, tuple)) or len(prompt) == 0:
                raise ValueError(f"prompts[{i}]: must be a non-empty list of token ids")
            if len(prompt) >= self.max_model_len:
                raise ValueError(f"prompts[{i}]: length {len(prompt)} leaves no room to generate within "
                                 f"max_model_len={self.max_model_len}")
            for t in prompt:
                if not isinstance(t, int) or isinstance(t, bool) or not (0 <= t < self.vocab_size):
                    raise ValueError(f"prompts[{i}]: token id {t!r} outside the vocabulary [0, {self.vocab_size})")
        return plist

    # ---- generation ----------------------------------------------------------------------------------------
    @torch.inference_mode()
    def generate(self, prompts: list[list[int]], params: SamplingParams | list[SamplingParams],
                 max_batch: int | None = None) -> list[RequestOutput]:
        """Decode every prompt, at most `max_batch` sequences at a time (default and ceiling: max_batch_size);
        the rest wait in a queue and join as sequences finish (continuous batching)."""
        plist = self._validate(prompts, params)
        if max_batch is not None and (not isinstance(max_batch, int) or max_batch < 1):
            raise ValueError(f"max_batch: must be an integer >= 1, got {max_batch!r}")
        cap = self.max_batch_size if max_batch is None else min(max_batch, self.max_batch_size)
        if self.runner.refresh_if_stale():
            self.refresh_drafter()
        else:
            for p in self.proposers.values():
                p.refresh_if_stale()
        queue = deque(range(len(prompts)))
        active: list[_Seq] = []
        results: list[RequestOutput | None] = [None] * len(prompts)
        self._sampling: BatchSamplingTensors | None = None
        self._any_raw: bool | None = None
        # Last-position hidden state of every prompt prefilled in this call (shared prefill, see `_prefill`).
        self._prompt_hidden: dict[tuple[int, ...], torch.Tensor] = {}
        while queue or active:
            if queue and len(active) < cap:
                joiners: list[_Seq] = []
                while queue and len(active) + len(joiners) < cap:
                    i = queue.popleft()
                    sp = plist[i]
                    gen = torch.Generator().manual_seed(sp.seed if sp.seed is not None else self._rng.getrandbits(63))
                    joiners.append(_Seq(i, [int(t) for t in prompts[i]], len(prompts[i]), sp, gen))
                self._prefill(active, joiners)
            else:
                decision = self.controller.decide(len(active))
                if decision.method is None:
                    record = self._ar_step(active, decision)
                else:
                    record = self._sd_step(active, decision)
                self.stats.steps.append(record)
                self.controller.observe(decision, record)
            self._retire(active, results)
        self._prompt_hidden = {}
        controller_stats = getattr(self.controller, "stats", None)
        if callable(controller_stats):
            self.stats.controller = dict(controller_stats())
        return [r for r in results if r is not None]

    def _uniforms(self, active: list[_Seq], n: int) -> torch.Tensor:
        u = torch.empty((len(active), n), dtype=torch.float64)
        for row, s in zip(u, active):
            row.uniform_(generator=s.generator)  # the same stream as torch.rand(n, generator=...)
        return u.to(self.device, non_blocking=True) if self.device.type != "cpu" else u

    def _batch_sampling(self, active: list[_Seq]) -> BatchSamplingTensors:
        if self._sampling is None:
            self._any_raw = None
            self._sampling = BatchSamplingTensors.build([s.params for s in active], self.device)
        return self._sampling

    def _logprobs(self, probs: torch.Tensor | None, logits: torch.Tensor, tokens: torch.Tensor,
                  active: list[_Seq]) -> torch.Tensor | None:
        """probs/logits [N, V], tokens [N] -> target logprob per row (processed or raw per request).

        probs None: every row is greedy, whose processed logprob is log 1 = 0; returns None when no row asks for
        raw logprobs either (the caller fills in zeros on the host)."""
        if self._any_raw is None:
            self._any_raw = any(s.params.logprobs_mode == "raw" for s in active)
        if probs is None and not self._any_raw:
            return None
        idx = tokens.clamp(min=0).unsqueeze(1)
        if self._any_raw:
            raw = torch.log_softmax(logits.float(), dim=-1).gather(1, idx).squeeze(1)
            if probs is None and all(s.params.logprobs_mode == "raw" for s in active):
                return raw
        if probs is not None:
            lp = probs.gather(1, idx).squeeze(1).log()
        else:
            lp = torch.zeros(len(tokens), dtype=torch.float32, device=logits.device)
        if self._any_raw:
            per = len(tokens) // len(active)
            is_raw = torch.tensor([s.params.logprobs_mode == "raw" for s in active], device=lp.device)
            lp = torch.where(is_raw.repeat_interleave(per), raw, lp)
        return lp

    def _prefill(self, active: list[_Seq], joiners: list[_Seq]) -> None:
        """Admit `joiners` into slots len(active)..: prefill their prompts, then each samples its first token with
        its own params and generator.

        Shared prefill (GRPO samples each prompt `groupSize` times): a joiner whose prompt is already in the cache
        (a sibling still decoding: its prompt positions never change) or earlier in this wave is not prefilled
        again. Its slot receives the prompt's K/V (and each proposer its per-slot state) by one copy per layer,
        and its first token is sampled from the prompt's kept last hidden state. Every rounding is kept: the rows
        still prefilled are padded as the whole wave would be, and one head call covers every joiner."""
        t0 = time.perf_counter()
        slot0 = len(active)
        width = max(len(s.tokens) for s in joiners)
        src: list[int] = []  # slot to copy the prompt from, per joiner (its own slot when prefilled there)
        fresh: list[_Seq] = []  # joiners to prefill, into slots slot0, slot0+1, ...
        own: dict[int, int] = {}  # joiner -> its row in `fresh`
        # A one-token, one-row forward runs GEMV kernels, which round unlike the GEMM of a larger one: such a wave
        # neither shares nor is shared (and a shared wave never shrinks to one, see `rows` below).
        share = self.share_prefill and len(joiners) * width > 1
        rows_of: dict[tuple[int, ...], int] = {}  # prompt -> its slot, prefilled in this wave or still decoding
        if share and any(tuple(s.tokens) in self._prompt_hidden for s in joiners):
            held = (tuple(a.tokens[: a.prompt_len]) for a in active)
            rows_of = {k: i for i, k in enumerate(held) if k in self._prompt_hidden}
        for j, s in enumerate(joiners):
            key = tuple(s.tokens)
            if share and key in rows_of:
                src.append(rows_of[key])
                continue
            own[j] = len(fresh)
            src.append(slot0 + len(fresh))
            if share:
                rows_of[key] = slot0 + len(fresh)
            fresh.append(s)
        for j in range(len(joiners)):
            for p in self.proposers.values():
                p.reset_slot(slot0 + j)
        if fresh:
            rows = fresh
            if len(rows) * width == 1 < len(joiners):
                rows = rows * 2  # a second (overwritten) row keeps the wave's GEMM rounding
            lens = [len(s.tokens) for s in rows]
            inp = torch.tensor([s.tokens + [0] * (width - len(s.tokens)) for s in rows], dtype=torch.int64,
                               device=self.device)
            want_hidden = [p for p in self.proposers.values() if p.needs_hidden]
            last, hidden = self.runner.prefill(self.cache, slot0, inp, lens, all_hidden=bool(want_hidden))
            for p in want_hidden:
                assert hidden is not None
                p.observe_target(hidden, [0] * len(rows), lens, slot0=slot0)
            for p in self._warm_proposers(slot0 + len(joiners)):
                p.prefill(slot0, inp, lens)
            if share:
                for s, h in zip(fresh, last):
                    self._prompt_hidden[tuple(s.tokens)] = h
            self.stats.target_forwards += 1
            self.stats.prefill_forwards += 1
            self.stats.prefill_rows += len(fresh)
        moves = [(a, slot0 + j, s.prompt_len) for j, (a, s) in enumerate(zip(src, joiners)) if a != slot0 + j]
        if moves:
            self.cache.copy_slots([m[0] for m in moves], [m[1] for m in moves], max(m[2] for m in moves))
            for p in self.proposers.values():
                p.copy_prefix([m[0] for m in moves], [m[1] for m in moves], [m[2] for m in moves])
        kept = [last[own[j]] if j in own else self._prompt_hidden[tuple(s.tokens)] for j, s in enumerate(joiners)]
        logits, _ = self.runner.head(torch.stack(kept))  # one call for the wave: rounds as without sharing
        st = BatchSamplingTensors.build([s.params for s in joiners], self.device)
        self._any_raw = None  # computed for the joiners here, then again for the whole batch
        toks, lps = self._sample_one(logits, st, joiners)
        self._any_raw = None
        active.extend(joiners)
        self._sampling = None
        for s, t, l in zip(joiners, toks, lps):
            self._append(s, [t], [l])
        self.stats.prefill_seconds += time.perf_counter() - t0

    def _append(self, s: _Seq, toks: list[int], lps: list[float]) -> int:
        """Append emitted tokens, truncating at a stop token, max_new_tokens or max_model_len."""
        budget = min(s.params.max_new_tokens - s.generated, self.max_model_len - len(s.tokens))
        n = 0
        stops = s.params.stop_token_ids
        for t, l in zip(toks, lps):
            if n >= budget:
                break
            s.tokens.append(t)
            s.logprobs.append(l)
            n += 1
            if t in stops:
                s.finish_reason = "stop"
                break
        if s.finish_reason is None and (s.generated >= s.params.max_new_tokens or len(s.tokens) >= self.max_model_len):
            s.finish_reason = "length"
        self.stats.generated_tokens += n
        return n

    def _sample_one(self, logits: torch.Tensor, st: BatchSamplingTensors, rows: list[_Seq]
                    ) -> tuple[list[int], list[float]]:
        """One token per row from logits [B, V], with its target logprob, in one device->host transfer."""
        if st.all_greedy:  # the argmax is what inverse-CDF sampling of the one-hot returns, for any uniform
            tok = logits.argmax(dim=-1)
            lp = self._logprobs(None, logits, tok, rows)
        else:
            probs = process_logits(logits, st)
            tok = sample_from_probs(probs, self._uniforms(rows, 1)[:, 0])
            lp = self._logprobs(probs, logits, tok, rows)
        if lp is None:
            return [int(t) for t in tok.tolist()], [0.0] * len(rows)
        host = torch.stack([tok.double(), lp.double()]).tolist()
        return [int(t) for t in host[0]], host[1]

    def _ar_step(self, active: list[_Seq], decision: Decision) -> StepRecord:
        t0 = time.perf_counter()
        b = len(active)
        starts = [len(s.tokens) - 1 for s in active]
        inp = torch.tensor([[s.tokens[-1]] for s in active], dtype=torch.int64, device=self.device)
        logits, hidden = self.runner.forward(self.cache, 0, starts, inp)
        toks, lps = self._sample_one(logits[:, 0], self._batch_sampling(active), active)
        for p in self.proposers.values():
            if p.needs_hidden:
                p.observe_target(hidden, starts, [1] * b)
        emitted = stopped = 0
        for s, t, l in zip(active, toks, lps):
            emitted += self._append(s, [t], [l])
            stopped += s.finish_reason == "stop"
        # No proposer truncation: a plain step only appends a token, so what each proposer holds is still a prefix
        # of every row (truncation is a no-op here, and a Python loop over rows x proposers at every step).
        self.stats.target_forwards += 1
        self.stats.ar_steps += 1
        dt = time.perf_counter() - t0
        self.stats.decode_seconds += dt
        self._step += 1
        return StepRecord(self._step, None, 0, b, 0, 0, emitted, dt, 0.0, dt, stopped=stopped)

    def _sd_step(self, active: list[_Seq], decision: Decision) -> StepRecord:
        t0 = time.perf_counter()
        proposer = self.proposers.get(decision.method) if decision.method is not None else None
        if proposer is None:
            raise ValueError(f"controller: method {decision.method!r} is not one of the engine's proposers "
                             f"{sorted(self.proposers)}")
        # No row drafts past its budget (max_new_tokens, max_model_len): a step emits at most budget tokens, so
        # gamma = budget - 1 is enough, and a batch whose rows all end within one token decodes plainly.
        caps = [min(s.params.max_new_tokens - s.generated, self.max_model_len - len(s.tokens)) - 1 for s in active]
        gamma = min(int(decision.gamma), self.max_gamma, max(caps))
        if gamma < 1:
            return self._ar_step(active, Decision(None, 0))
        b = len(active)
        g1 = gamma + 1
        st = self._batch_sampling(active)
        # Greedy rows never read their uniforms (every token is an argmax): an all-greedy batch draws none.
        u = (torch.zeros((b, 2 * gamma + 1), dtype=torch.float64, device=self.device) if st.all_greedy
             else self._uniforms(active, 2 * gamma + 1))
        ctx = DraftContext(tokens=[s.tokens for s in active], sampling=st, uniforms=u[:, :gamma])
        prop = proposer.propose(ctx, gamma)
        # Draft lengths per row, on the host where they are known without a transfer; rows near their end verify
        # only what they can still emit (ragged, still exact).
        row_lens: list[int] | None = None
        if prop.lens is None:
            row_lens = [min(c, gamma) for c in caps]
        elif prop.host_lens is not None:
            row_lens = [min(n, c) for n, c in zip(prop.host_lens, caps)]
        if row_lens is not None:
            lens = (torch.tensor(row_lens, dtype=torch.int64, device=self.device) if min(row_lens) < gamma
                    else None)
        else:
            limit = torch.tensor(caps, dtype=torch.int64, device=self.device).clamp(0, gamma)
            lens = torch.minimum(prop.lens, limit) if prop.lens is not None else limit
        # No device sync for timing: the step's one host transfer below bounds its total time; on an accelerator
        # the draft/target split is then approximate (kernels still queued count as target time).
        t1 = time.perf_counter()
        starts = [len(s.tokens) - 1 for s in active]
        pending = torch.tensor([[s.tokens[-1]] for s in active], dtype=torch.int64, device=self.device)
        inp = torch.cat([pending, prop.tokens.clamp(min=0)], dim=1)
        logits, hidden = self.runner.forward(self.cache, 0, starts, inp)
        v = logits.shape[-1]
        flat_logits = logits.reshape(b * g1, v)
        if st.all_greedy:
            tokens, _ = greedy_verify(logits, prop.tokens, lens)
            lp = self._logprobs(None, flat_logits, tokens.view(-1), active)
        else:
            probs = process_logits(flat_logits, st.expand(g1))
            res = rejection_sample(probs.view(b, g1, v), prop.tokens, prop.probs, u[:, gamma : 2 * gamma],
                                   u[:, 2 * gamma], lens)
            tokens = res.tokens
            lp = self._logprobs(probs, flat_logits, tokens.view(-1), active)
        # One device->host transfer per step: tokens (exact in float64; -1 after a row's last emitted token),
        # logprobs, and the draft lengths where the host does not know them.
        parts = [tokens.double()]
        if lp is not None:
            parts.append(lp.view(b, g1).double())
        if row_lens is None:
            assert lens is not None  # built above whenever the host lacks the lengths
            parts.append(lens.double().unsqueeze(1))
        host = torch.cat(parts, dim=1).tolist() if len(parts) > 1 else parts[0].tolist()
        if row_lens is None:
            row_lens = [int(row[-1]) for row in host]
        emitted = stopped = 0
        nacc: list[int] = []
        in_text: list[int] = []  # tokens of the round that are text: up to a stop token
        for s, row in zip(active, host):
            k = row.index(-1.0) if row[gamma] == -1.0 else g1  # tokens the verification accepted for this row
            nacc.append(k - 1)
            n = self._append(s, [int(t) for t in row[:k]], row[g1 : g1 + k] if lp is not None else [0.0] * k)
            emitted += n
            stopped += s.finish_reason == "stop"
            in_text.append(n if s.finish_reason == "stop" else g1)
        for p in self.proposers.values():
            if p.needs_hidden:
                p.observe_target(hidden, starts, [a + 1 for a in nacc])
        self._truncate_proposers(active)
        drafted = sum(row_lens)
        # Acceptance counts the drafts of the text only: past a stop token the sequence has ended, and a drafter
        # that is a copy of the policy goes on agreeing with it there (quantized_self at γ=8 and batch 2: accepted
        # drafts and bonus tokens 815, emitted 688). Where the text ends is the stop hazard's part (`StepRecord.stopped`).
        nacc_text = [min(a, e) for a, e in zip(nacc, in_text)]
        accepted = sum(nacc_text)
        # per draft position: rows that tested it (accepted every draft before it) and rows that accepted it
        tested_at, accepted_at = [0] * gamma, [0] * gamma
        for a, n, e in zip(nacc_text, row_lens, in_text):
            for j in range(min(a + 1, n, e)):
                tested_at[j] += 1
            for j in range(a):
                accepted_at[j] += 1
        tried = sum(tested_at)
        self.stats.drafts += sum(1 for n in row_lens if n > 0)
        self.stats.draft_tokens += drafted
        self.stats.accepted_tokens += accepted
        per_pos = self.stats.accepted_per_position
        if len(per_pos) < gamma:
            per_pos.extend([0] * (gamma - len(per_pos)))
        for j, n in enumerate(accepted_at):
            per_pos[j] += n
        self.stats.target_forwards += 1
        self.stats.sd_steps += 1
        t2 = time.perf_counter()
        self.stats.decode_seconds += t2 - t0
        self._step += 1
        return StepRecord(self._step, decision.method, gamma, b, drafted, accepted, emitted, t2 - t0, t1 - t0, t2 - t1,
                          tried, tuple(tested_at), tuple(accepted_at), stopped)

    def _warm_proposers(self, batch: int) -> list[Proposer]:
        """The proposers to prefill on admission into a batch of `batch` sequences: those the controller names
        (`Controller.warm_proposers`), else every one. A cold one catches up on the prompt when it first drafts
        for the row."""
        warm = getattr(self.controller, "warm_proposers", None)
        if not callable(warm):
            return list(self.proposers.values())
        names = set(warm(batch))
        return [p for name, p in self.proposers.items() if name in names]

    def _truncate_proposers(self, active: list[_Seq]) -> None:
        if self.proposers:
            lens = [len(s.tokens) - 1 for s in active]
            for p in self.proposers.values():
                p.truncate(lens)

    def _retire(self, active: list[_Seq], results: list[RequestOutput | None]) -> None:
        done = [i for i, s in enumerate(active) if s.finish_reason is not None]
        if not done:
            return
        for slot in reversed(done):
            s = active[slot]
            results[s.request_id] = RequestOutput(s.request_id, s.tokens[: s.prompt_len], s.tokens[s.prompt_len :],
                                                  s.logprobs, s.finish_reason or "length")
            self.stats.requests_completed += 1
            last = len(active) - 1
            if slot != last:
                moved = active[last]
                self.cache.move_slot(last, slot, len(moved.tokens) - 1)
                for p in self.proposers.values():
                    p.move_slot(last, slot)
                active[slot] = moved
            active.pop()
        self._sampling = None
