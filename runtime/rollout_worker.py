"""Rollout worker: turns assigned prompts into scored samples with the (speculative) rollout engine.

It owns a policy copy, the drafter, the engine and the reward. New weights arrive through the sync group on a
second actor thread while a chunk may be decoding; they are staged and swapped in atomically before the next
chunk starts, so no sequence ever mixes two policy versions.
"""

from __future__ import annotations

import logging
import threading
import time
import zlib
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from .rl.settings import RunSettings
from .rl.trainer import Sample

if TYPE_CHECKING:
    from .engine import SamplingParams
    from .rl.task import Problem
    from .sync import SyncGroup, WeightReceiver

log = logging.getLogger(__name__)


def _stat(stats: Any, name: str) -> float:
    if stats is None:
        return 0.0
    if isinstance(stats, dict):
        return float(stats.get(name, 0) or 0)
    return float(getattr(stats, name, 0) or 0)


def stats_snapshot(stats: Any) -> dict[str, float]:
    keys = ("drafts", "draft_tokens", "accepted_tokens", "target_forwards", "generated_tokens", "sd_steps",
            "ar_steps", "decode_seconds", "prefill_seconds")
    out = {k: _stat(stats, k) for k in keys}
    # Per-position acceptance (the native engine; backends without it export none).
    for i, n in enumerate(getattr(stats, "accepted_per_position", None) or ()):
        out[f"accepted_tokens_pos_{i}"] = float(n)
    return out


def stats_delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after.get(k, 0.0) - before.get(k, 0.0) for k in after}


def load_problem_split(settings: RunSettings, style: str = "toy") -> tuple[list, list]:
    """(training problems, held-out evaluation problems) for the job's dataset; `style` is the synthetic task's
    prompt form ("toy" for the character-level builtins, "chat" for real models)."""
    from .rl.task import BUILTIN_TASK, load_jsonl

    if settings.dataset in (BUILTIN_TASK, "builtin", "arithmetic"):
        # Short expressions recur across seeds, so a second seed alone does not hold problems out: a hash of the
        # prompt puts every expression on one side only. Held-out problems are drawn like training ones (the
        # job's difficulty mix, an expression may recur): with distinct prompts, easy ones ran out (there are a few
        # hundred one-operation expressions) and an 80/10/10 job was evaluated on a 65/20/15 mix, a different
        # distribution than the one it trains on.
        def held_out(p: Problem) -> bool:
            return zlib.crc32(p.prompt.encode()) % HELDOUT_BUCKETS == 0

        train = _synthetic(settings, settings.seed, settings.dataset_size, lambda p: not held_out(p), style=style)
        evals = _synthetic(settings, settings.seed + 10_000, settings.eval_size, held_out, style=style)
        return train, evals
    problems = load_jsonl(settings.dataset, prompt_field=settings.prompt_field,
                          answer_field=settings.answer_field).problems
    n_eval = min(settings.eval_size, max(1, len(problems) // 10))
    return problems[: len(problems) - n_eval] or problems, problems[len(problems) - n_eval:]


HELDOUT_BUCKETS = 8  # one expression in 8 is reserved for evaluation


def _synthetic(settings: RunSettings, seed: int, n: int, keep: Callable[[Problem], bool], style: str = "toy") -> list:
    """The first `n` problems of the seeded synthetic task that `keep` accepts."""
    from .rl.task import SyntheticTask

    size = n + n // 4 + 16
    while True:
        out = [p for p in SyntheticTask(size, settings.difficulty, seed, style) if keep(p)]
        if len(out) >= n or size > 256 * max(1, n):
            return out[:n]
        size *= 2


def max_model_len(problems: list, tokenizer: Any, max_new_tokens: int, model_positions: int | None = None) -> int:
    """The context the engines must hold: the longest prompt of the job + its completion budget, never more than
    the model's own `max_position_embeddings` (a prompt the model was never trained to attend over is refused
    by the engine — a task error, dropped with its reason — instead of decoding silently past the trained
    positions)."""
    from .rl.task import prompt_token_ids

    wanted = max((len(prompt_token_ids(p, tokenizer)) for p in problems), default=1) + max_new_tokens
    return min(wanted, model_positions) if model_positions else wanted


# The static KV caches of one native engine (the policy's; a drafter's is smaller) may take this much memory.
KV_CACHE_BUDGET_BYTES = 2 << 30


def engine_slots(wanted: int, max_len: int, config: Any, dtype_bytes: int,
                 budget: int = KV_CACHE_BUDGET_BYTES) -> int:
    """Concurrent sequences of a native engine (vLLM's max_num_seqs): a worker's whole assignment at once, so
    continuous batching starts at full batch and the step's long tail decodes at small batch, as on a GPU; fewer
    when the preallocated static KV cache would pass `budget` (never fewer than 16)."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    per_slot = 2 * config.num_hidden_layers * kv_heads * head_dim * max_len * dtype_bytes
    return max(1, min(wanted, max(16, budget // max(1, per_slot))))


def prompt_style(tokenizer: Any) -> str:
    """The synthetic task's prompt form for this tokenizer: the toy form only for the character tokenizer."""
    from .rl.tokenizer import CharTokenizer

    return "toy" if isinstance(tokenizer, CharTokenizer) else "chat"


class RolloutWorker:
    def __init__(self, settings: RunSettings, name: str, metrics: Any = None) -> None:
        from .engine import RolloutEngine, SpeculativeConfig
        from .models.hub import check_same_vocab, load_causal_lm, load_tokenizer
        from .rl.reward import SafeReward

        torch.set_num_threads(max(1, settings.torch_threads))
        self.settings, self.name, self.metrics = settings, name, metrics
        self.tokenizer = load_tokenizer(settings.model, revision=settings.revision, chat=settings.chat_template,
                                        system_prompt=settings.system_prompt, field="spec.model.name")
        self.problems, self.eval_problems = load_problem_split(settings, prompt_style(self.tokenizer))
        self.reward = SafeReward.from_spec(settings.reward, on_error=self._reward_error,
                                           timeout_s=settings.reward_timeout_s)
        self.last_number = settings.reward == "builtin:last_number"  # accuracy reads answers as the reward does
        self.calibration: dict | None = None
        self.model = self.draft = None
        self.vllm_updates: VLLMUpdates | None = None
        if settings.rollout_engine == "vllm":
            self.engine, self.vllm_updates = build_vllm_engine(settings)
            self.ar_engine = None  # no plain-decoding twin on the GPU: vLLM's per-batch-size K covers SD-off
        else:
            from .devices import decode_dtype, device_for, weights_dtype

            device = device_for(settings.gpus_per_pod)
            # The rollout copy holds the weights in spec.model.dtype (the trainer keeps float32 masters); "auto"
            # holds float32 and decodes in the device's native dtype (devices.decode_dtype).
            held = weights_dtype(settings.dtype)
            self.model = load_causal_lm(settings.model, held, device, revision=settings.revision,
                                        field="spec.model.name")
            if settings.method == "draft_model" and settings.draft_model:
                check_same_vocab(settings.model, settings.draft_model, revision=settings.revision)
                self.draft = load_causal_lm(settings.draft_model, held, device,
                                            field="spec.speculative.draftModel")
            spec = SpeculativeConfig(method=settings.method, num_speculative_tokens=settings.num_speculative_tokens)
            # The static KV cache is preallocated per slot: size it to this job's prompts, not the model's context
            # (SmolLM2's 8192 positions would cost ~190 MB per slot in float32).
            self.max_model_len = max_model_len(self.problems + self.eval_problems, self.tokenizer,
                                               settings.max_new_tokens,
                                               getattr(self.model.config, "max_position_embeddings", None))
            dtype = decode_dtype(settings.dtype, device)
            slots = engine_slots(settings.prompts_per_step * settings.group_size, self.max_model_len,
                                 self.model.config, getattr(torch, dtype).itemsize)
            self.engine = RolloutEngine(self.model, speculative=spec, draft_model=self.draft, max_batch_size=slots,
                                        max_model_len=self.max_model_len, dtype=dtype)
            if settings.adaptive and settings.method != "none":
                self._install_adaptive_controller()
            # Plain decoding on the same weights: the side-by-side baseline (and the SD-off path).
            self.ar_engine = RolloutEngine(self.model, speculative=SpeculativeConfig(method="none"),
                                           max_batch_size=slots, max_model_len=self.max_model_len, dtype=dtype)
        self.weight_version = 0
        self._pending: tuple[int, dict[str, torch.Tensor]] | None = None
        self._lock = threading.Lock()
        self._live: tuple[list, int] | None = None  # (the busy engine's step records, how many predate this call)
        self._sync_group: SyncGroup | None = None
        self._receiver: WeightReceiver | None = None
        self.active_sequences = 0

    def _install_adaptive_controller(self) -> None:
        """Calibrate the cost model on this machine with the job's own prompts, then let the controller decide
        per decode step whether to speculate and how far (DESIGN §5)."""
        from .engine.adaptive import AdaptiveController, settings_from_spec
        from .engine.calibration import calibrate
        from .rl.task import prompt_token_ids

        prompts = [prompt_token_ids(p, self.tokenizer) for p in self.problems[:8]]
        cal = calibrate(self.engine, prompts, batch_sizes=(1, 2, 4, 8), gammas=(2, 4), steps=6, rounds=1,
                        seed=self.settings.seed)
        self.engine.controller = AdaptiveController(
            list(self.engine.proposers), cost_model=cal.cost_model, alpha_priors=cal.alpha, metrics=self.metrics,
            settings=settings_from_spec(self.settings.extra.get("speculative")))
        self.engine.stats.reset()  # calibration steps are not rollouts
        self.calibration = cal.summary()

    def _reward_error(self, _exc: BaseException | None) -> None:
        if self.metrics is not None:
            self.metrics.reward_errors.inc()

    def ping(self) -> str:
        return self.name

    def decoding(self) -> dict[str, int]:
        """What this worker's running `generate` is doing, answered from another actor thread: `sequences` still
        decoding (the coordinator's long-tail signal: the batch of the engine's latest decode step, which only
        shrinks as sequences finish; the whole assignment before the first step and on engines without step
        records) and `steps` decoded so far (its progress, the hang detector's clock)."""
        live = self._live
        if live is not None:
            steps, first = live
            if len(steps) > first:
                return {"sequences": int(steps[-1].batch_size), "steps": len(steps) - first}
        return {"sequences": self.active_sequences, "steps": 0}

    # -- weights --------------------------------------------------------------------------------------

    def open_sync_group(self, host: str, port: int, rank: int, world_size: int, epoch: int) -> bool:
        from .sync import SyncGroup, WeightReceiver

        self.close_sync_group()
        if self.vllm_updates is not None:  # vLLM's own NCCL group; the trainer (rank 0) sends with vLLM's producer
            self.engine.init_weight_transfer(host, port, rank_offset=rank, world_size=world_size)
            return True
        group = SyncGroup.create(host, port, rank=rank, world_size=world_size, backend=self.settings.sync_backend,
                                 epoch=epoch, timeout_s=self.settings.sync_timeout_s)
        self._sync_group, self._receiver = group, WeightReceiver(group)
        return True

    def close_sync_group(self) -> None:
        if self.vllm_updates is not None:
            self.engine.close_weight_transfer()
        if self._sync_group is not None:
            self._sync_group.close()
        self._sync_group = self._receiver = None

    def receive_weights(self, expected_version: int | None = None) -> dict[str, float]:
        """Receive one packed transfer (blocking) and stage it; it is swapped in before the next chunk.

        `expected_version` is the version the trainer is sending: checked against the stream's header, and the
        version vLLM commits (its NCCL stream carries none).
        """
        if self.vllm_updates is not None:
            return self._receive_into_vllm(expected_version)
        from .sync import split_states

        assert self._receiver is not None, "open_sync_group first"
        version, flat, stats = self._receiver.receive()
        if expected_version is not None and version != expected_version:
            raise RuntimeError(f"receive_weights: got weight version {version}, the trainer sent {expected_version}")
        parts = split_states(flat)
        # Copy out of the receiver's reusable buffer: the staged state may wait while another sync lands.
        staged = {f"{part}/{k}": v.clone() for part, sd in parts.items() for k, v in sd.items()}
        with self._lock:
            self._pending = (version, staged)
        return {"seconds": float(stats.seconds), "bytes": int(stats.bytes), "version": version}

    def _receive_into_vllm(self, version: int | None) -> dict[str, float]:
        """Policy, then drafter, straight into vLLM's weights over NCCL (the trainer streams the same list)."""
        if version is None:
            raise ValueError("receive_weights: expected_version: the vLLM engine commits the version being sent")
        assert self.vllm_updates is not None
        t0 = time.perf_counter()
        policy, draft = self.vllm_updates
        self.engine.update_weights(policy, draft, version=version, drafter_frozen=draft is None)
        seconds = time.perf_counter() - t0
        self.weight_version = version
        nbytes = policy.nbytes + (draft.nbytes if draft is not None else 0)
        if self.metrics is not None:
            self.metrics.weight_version.set(version)
        return {"seconds": seconds, "bytes": nbytes, "version": version}

    def set_weights(self, state: dict[str, torch.Tensor], version: int) -> bool:
        """Stage weights handed over directly (used when no sync group is open, e.g. at start-up)."""
        if self.vllm_updates is not None:
            raise RuntimeError("set_weights: a vLLM rollout worker takes weights only over vLLM's NCCL transfer "
                               "(open_sync_group + receive_weights)")
        with self._lock:
            self._pending = (version, state)
        self._apply_pending()
        return True

    def drafter_weights(self) -> tuple[int, dict[str, torch.Tensor]] | None:
        """The drafter this worker serves, or has staged, with its weight version (float32 on the CPU): after
        trainer rank 0 dies, the newest copy of the drafter master weights. None without a native drafter."""
        if self.draft is None:
            return None
        with self._lock:
            pending = self._pending
        if pending is not None:
            version, state = pending
            staged = {k.removeprefix("drafter/"): v for k, v in state.items() if k.startswith("drafter/")}
            if staged:
                return version, {k: v.detach().to("cpu", torch.float32, copy=True) for k, v in staged.items()}
        return self.weight_version, {k: v.detach().to("cpu", torch.float32, copy=True)
                                     for k, v in self.draft.state_dict().items()}

    def _apply_pending(self) -> None:
        with self._lock:
            pending, self._pending = self._pending, None
        if pending is None:
            return
        version, state = pending
        policy = {k.removeprefix("policy/"): v for k, v in state.items() if k.startswith("policy/")}
        drafter = {k.removeprefix("drafter/"): v for k, v in state.items() if k.startswith("drafter/")}
        if not policy and not drafter:
            policy = state
        if policy:
            self.engine.load_policy_state(policy)
            if self.ar_engine is not None and self.ar_engine.model is not self.engine.model:
                self.ar_engine.load_policy_state(policy)
        if drafter and self.draft is not None:
            with torch.no_grad():
                self.draft.load_state_dict(drafter)
        self.engine.refresh_drafter()
        self.weight_version = version
        if self.metrics is not None:
            self.metrics.weight_version.set(version)

    # -- rollouts -------------------------------------------------------------------------------------

    def _engine(self, use_sd: bool) -> Any:
        if use_sd:
            return self.engine
        if self.ar_engine is None:
            raise RuntimeError("use_sd=False: the vLLM rollout engine has no plain-decoding twin (compare "
                               "speculation on/off with rolloutEngine: native)")
        return self.ar_engine

    def _params(self, seed: int, greedy: bool = False) -> SamplingParams:
        from .engine import SamplingParams

        s = self.settings
        return SamplingParams(temperature=0.0 if greedy else s.temperature, top_p=1.0 if greedy else s.top_p,
                              top_k=0 if greedy else s.top_k, max_new_tokens=s.max_new_tokens,
                              stop_token_ids=tuple(self.tokenizer.stop_ids), seed=seed)

    def generate(self, items: list[tuple[str, int]], step: int, use_sd: bool = True) -> dict[str, Any]:
        """Roll out `group_size` samples for each (prompt_id, dataset index); returns samples and stats."""
        from .rl.task import prompt_token_ids

        self._apply_pending()
        s = self.settings
        version = self.weight_version
        problems = [self.problems[idx] for _, idx in items]
        prompts = [prompt_token_ids(p, self.tokenizer) for p in problems for _ in range(s.group_size)]
        # One seed per sample, from (job seed, step, prompt id, sample index): the tokens do not depend on
        # which worker ran the prompt or what else was in its batch (up to float rounding of batched maths).
        params = [self._params(sample_seed(s.seed, step, pid, k)) for pid, _ in items for k in range(s.group_size)]
        engine = self._engine(use_sd)
        before = stats_snapshot(engine.stats)
        self.active_sequences = len(prompts)
        steps = getattr(engine.stats, "steps", None)
        self._live = (steps, len(steps)) if steps is not None else None
        t0 = time.perf_counter()
        try:
            outs = engine.generate(prompts, params)
        finally:
            self._live = None
            self.active_sequences = 0
        seconds = time.perf_counter() - t0
        delta = stats_delta(stats_snapshot(engine.stats), before)
        samples: list[dict] = []
        tokens = 0
        for k, out in enumerate(outs):
            pid = items[k // s.group_size][0]
            problem = problems[k // s.group_size]
            ids = [int(t) for t in out.token_ids]
            text = self.tokenizer.decode(ids)
            reward = self.reward(problem.prompt, text, problem.answer)
            from .rl.task import is_correct

            # vars, not dataclasses.asdict: asdict deep-copies every token list (~90 ms of a 384-sample step)
            samples.append(vars(Sample(prompt_id=pid, prompt_ids=prompts[k], response_ids=ids,
                                        logprobs=[float(x) for x in out.logprobs], reward=reward,
                                        weight_version=version, finish_reason=str(out.finish_reason),
                                        correct=is_correct(text, problem.answer, self.last_number))))
            tokens += len(ids)
            if self.metrics is not None:
                self.metrics.response_length.observe(len(ids))
        if self.metrics is not None:
            m = self.metrics
            m.generated_tokens.inc(tokens)
            m.sequences_completed.inc(len(outs))
            m.spec_num_drafts.inc(delta.get("drafts", 0))
            m.spec_num_draft_tokens.inc(delta.get("draft_tokens", 0))
            m.spec_num_accepted_tokens.inc(delta.get("accepted_tokens", 0))
            m.count_accepted_per_position(delta)
        return {"worker": self.name, "samples": samples, "seconds": seconds, "tokens": tokens,
                "stats": delta, "weight_version": version, "reward_errors": self.reward.errors,
                "reward_timeouts": self.reward.timeouts}

    def evaluate(self, indices: list[int] | None = None, use_sd: bool = True,
                 split: str = "heldout", samples: int = 0) -> dict[str, Any]:
        """Decode evaluation problems: accuracy, per-output correctness and tokens, time.

        `split` "heldout": problems the job never trains on; "trained": the first `eval_size` problems of the
        job's own dataset (what the RL updates see), to tell learning the task from learning the problems.
        `samples` 0: one greedy decode per problem. `samples` k > 0: k samples per problem at the job's
        temperature, each with a seed fixed by (job seed, problem, k) — never by the weights — so an evaluation
        before and one after training draw paired samples (see `specrl.runtime.rl.significance`).
        """
        from .rl.task import is_correct, prompt_token_ids

        self._apply_pending()
        if split not in ("heldout", "trained"):
            raise ValueError(f"split: must be 'heldout' or 'trained', got {split!r}")
        pool = self.eval_problems if split == "heldout" else self.problems[: len(self.eval_problems)]
        problems = pool if indices is None else [pool[i] for i in indices]
        repeat = max(1, samples)
        problems = [p for p in problems for _ in range(repeat)]
        prompts = [prompt_token_ids(p, self.tokenizer) for p in problems]
        params = (self._params(self.settings.seed, greedy=True) if samples <= 0 else
                  [self._params(sample_seed(self.settings.seed, -1, f"eval-{split}-{p.id}", i % repeat))
                   for i, p in enumerate(problems)])
        engine = self._engine(use_sd)
        before = stats_snapshot(engine.stats)
        t0 = time.perf_counter()
        outs = engine.generate(prompts, params)
        seconds = time.perf_counter() - t0
        delta = stats_delta(stats_snapshot(engine.stats), before)
        tokens = [[int(t) for t in o.token_ids] for o in outs]
        correct = [is_correct(self.tokenizer.decode(t), p.answer, self.last_number) for t, p in zip(tokens, problems)]
        return {"accuracy": sum(correct) / max(1, len(correct)), "correct": correct, "tokens": tokens,
                "seconds": seconds, "generated": sum(len(t) for t in tokens), "stats": delta,
                "weight_version": self.weight_version, "problems": len(problems) // repeat,
                "samples_per_problem": repeat, "temperature": 0.0 if samples <= 0 else self.settings.temperature,
                "difficulty": [p.difficulty for p in problems]}

    def compare_rollout(self, items: list[tuple[str, int]], step: int, min_pairs: int = 5, max_pairs: int = 41,
                        budget_s: float = 6.0) -> dict[str, Any]:
        """The same prompts with SD on and with plain decoding, same weights and per-sample seeds, alternating
        which goes first: at least `min_pairs` pairs, then more while the pairs so far took under `budget_s` (at
        most `max_pairs`), so the median ratio resists load spikes from other processes, and `speedup_interval`
        (`significance.median_interval`, 90%) says how far it can be trusted. Why a budget: tiny-local's rollouts
        take ~0.1 s, and five pairs of them put the same code at 0.86-1.05x from one run to the next.

        `policy_at_batch_1`: the adaptive policy's predicted speed (vs plain decoding) and γ per proposer at batch 1.
        `sd_trace`/`ar_trace`: the decode steps of the last pair, one `[active batch, SD on, tokens emitted,
        seconds]` each, in order: where in the step the batch shrinks (the long tail) and where speculation ran.
        """
        import statistics

        from .rl.significance import median_interval

        sd_t, ar_t, ratios = [], [], []
        sd = ar = None
        traces: dict[bool, list[list]] = {}
        # One untimed pass of each first: the first full-batch generate after a weight sync pays one-off costs
        # (the decode-dtype copy of the new weights, first-touch of cache pages) that belong to neither side.
        for use_sd in (True, False):
            self.generate(items, step, use_sd=use_sd)
        t0 = time.perf_counter()
        r = 0
        while r < max(1, min_pairs) or (r < max_pairs and time.perf_counter() - t0 < budget_s):
            order = (True, False) if r % 2 == 0 else (False, True)
            r += 1
            times = {}
            for use_sd in order:
                engine = self._engine(use_sd)
                steps = getattr(engine.stats, "steps", None) or []  # the native engine's per-decode-step records
                last = steps[-1].step if steps else -1
                out = self.generate(items, step, use_sd=use_sd)
                traces[use_sd] = [[rec.batch_size, rec.method is not None, rec.emitted_tokens, rec.seconds]
                                  for rec in getattr(engine.stats, "steps", None) or [] if rec.step > last]
                times[use_sd] = out["seconds"]
                if use_sd:
                    sd = out
                else:
                    ar = out
            sd_t.append(times[True])
            ar_t.append(times[False])
            ratios.append(times[False] / times[True] if times[True] > 0 else float("nan"))
        assert sd is not None and ar is not None
        # What the adaptive policy predicts at batch 1, the end of every long tail: where it never speculated, this
        # says by how far speculation falls short on this model and machine (per proposer, [speed vs plain, γ]).
        table = getattr(self.engine.controller, "table", None)
        at_one = {m: [round(speed, 3), d.gamma] for m, (speed, d) in table(1).items() if m is not None} \
            if callable(table) else None
        return {"sd_seconds": statistics.median(sd_t), "ar_seconds": statistics.median(ar_t),
                "policy_at_batch_1": at_one,
                "speedup_median": statistics.median(ratios), "speedups": ratios,
                "speedup_interval": median_interval(ratios), "sd_tokens": sd["tokens"],
                "ar_tokens": ar["tokens"], "sd_stats": sd["stats"], "repeats": len(ratios),
                "sd_trace": traces[True], "ar_trace": traces[False],
                "response_lengths": [len(x["response_ids"]) for x in sd["samples"]]}

    def train_drafter(self, state: dict[str, Any], sequences: list[list[int]], prompt_lens: list[int],
                      max_steps: int, deadline_s: float) -> dict[str, Any]:
        """TLT on idle rollout capacity: continue training the lent drafter master copy (distilling this
        worker's policy copy along recent rollouts) and hand it back. A separate copy is trained, so the
        drafter this worker's engine serves changes only with the next weight sync, like everyone else's."""
        import copy

        from .rl.drafter_trainer import DrafterTrainer

        if self.draft is None:
            return {"steps": 0, "loss": float("nan"), "state": state}
        trainer = DrafterTrainer(copy.deepcopy(self.draft), lr=self.settings.drafter_lr, seed=self.settings.seed)
        trainer.load_state_dict(state)
        out = trainer.train(sequences, prompt_lens, max_steps=max_steps, deadline_s=deadline_s, teacher=self.model)
        return {**out, "state": trainer.state_dict()}

    def engine_stats(self) -> dict[str, float]:
        return stats_snapshot(self.engine.stats)

    def reward_errors(self) -> int:
        return self.reward.errors


VLLMUpdates = tuple[Any, Any]  # (policy WeightUpdateInfo, drafter WeightUpdateInfo or None)


def build_vllm_engine(settings: RunSettings) -> tuple[Any, VLLMUpdates]:
    """The vLLM rollout engine of a `rolloutEngine: vllm` job, from the policy folder (or HF id) and the spec.

    Returns the engine and what each weight refresh streams: the policy, and the drafter when the trainers train
    it (`trains_drafter`); a drafter nobody trains stays as loaded. Names, shapes and dtypes come from the models'
    configs, the same list the trainer sends (`vllm_backend.named_weights`).
    """
    import torch

    from .devices import decode_dtype, device_for
    from .engine.vllm_backend import VLLMRolloutEngine, weight_update_info_for
    from .rl.trainer import trains_drafter

    policy = _model_ref(settings.model)
    draft = _model_ref(settings.draft_model) if settings.draft_model else None
    speculative = {"method": settings.method, "num_speculative_tokens": settings.num_speculative_tokens,
                   "draft_model": draft}
    name = decode_dtype(settings.dtype, device_for(settings.gpus_per_pod))  # the trainer sends in the same dtype
    dtype = getattr(torch, name)
    engine = VLLMRolloutEngine(policy, speculative, dtype=name, seed=settings.seed,
                               max_num_seqs=max(1, settings.prompts_per_step * settings.group_size))
    draft_info = weight_update_info_for(draft, dtype) if draft and trains_drafter(settings) else None
    return engine, (weight_update_info_for(policy, dtype), draft_info)


def _model_ref(name: str) -> str:
    """A builtin -> its built HF folder; a folder or an HF id is what vLLM loads as is."""
    if name.startswith("builtin:"):
        from .models.bootstrap import resolve_model_path

        return str(resolve_model_path(name))
    return name


def sample_seed(seed: int, step: int, prompt_id: str, k: int) -> int:
    """Sampling seed of sample `k` of a prompt in a step: a function of the job, never of timing or placement."""
    import zlib

    return zlib.crc32(f"{seed}:{step}:{prompt_id}:{k}".encode()) & 0x7FFFFFFF
