"""Trainer worker: GRPO updates with torch.distributed data parallelism, checkpoints with exact resume.

Data parallelism: the coordinator splits each step's groups over the trainer ranks and sends every rank
the global response-token count, so each rank's loss is already divided by the global count and one
all-reduce (SUM) of the flattened gradients gives exactly the single-process gradient. gloo on CPU, NCCL on
GPU, one collective per step (not one per parameter).

Checkpoint = model weights, optimizer state, step, weight version, torch/python/numpy RNG states and
whatever the coordinator hands in as its data cursor; loading it and replaying the same steps gives
bit-identical weights (tested).
"""

from __future__ import annotations

import hashlib
import logging
import os
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .grpo import GRPOLossConfig, grpo_loss, token_logprobs
from .settings import RunSettings

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from ..engine.vllm_backend import VLLMWeightSender
    from ..sync import SyncGroup, WeightSender

log = logging.getLogger(__name__)


@dataclass
class Sample:
    """One rollout sequence as the trainer consumes it."""

    prompt_id: str
    prompt_ids: list[int]
    response_ids: list[int]
    logprobs: list[float]  # behaviour-policy logprob of each response token (from the rollout engine)
    reward: float
    advantage: float = 0.0
    weight_version: int = 0
    finish_reason: str = "stop"
    correct: bool = False


def pad_batch(samples: list[Sample], pad_id: int = 0) -> dict[str, torch.Tensor]:
    """Right-padded input ids, attention mask, and per-response-token targets/positions."""
    seqs = [s.prompt_ids + s.response_ids for s in samples]
    T = max(len(x) for x in seqs)
    R = max(max(len(s.response_ids) for s in samples), 1)
    B = len(samples)
    input_ids = torch.full((B, T), pad_id, dtype=torch.long)
    attn = torch.zeros((B, T), dtype=torch.long)
    resp = torch.full((B, R), pad_id, dtype=torch.long)
    pos = torch.zeros((B, R), dtype=torch.long)  # index of the logits that predict each response token
    mask = torch.zeros((B, R), dtype=torch.float32)
    behaviour = torch.zeros((B, R), dtype=torch.float32)
    for i, (s, seq) in enumerate(zip(samples, seqs)):
        input_ids[i, : len(seq)] = torch.tensor(seq)
        attn[i, : len(seq)] = 1
        n = len(s.response_ids)
        if n:
            resp[i, :n] = torch.tensor(s.response_ids)
            pos[i, :n] = torch.arange(len(s.prompt_ids) - 1, len(s.prompt_ids) - 1 + n)
            mask[i, :n] = 1.0
            behaviour[i, :n] = torch.tensor(s.logprobs[:n], dtype=torch.float32)
    adv = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    return {"input_ids": input_ids, "attention_mask": attn, "response": resp, "positions": pos, "mask": mask,
            "behaviour": behaviour, "advantages": adv}


def response_logprobs(model: torch.nn.Module, batch: dict[str, torch.Tensor], temperature: float, top_k: int = 0,
                      top_p: float = 1.0, compute_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Log-probs of the response tokens under the processed sampling distribution (as the rollout engine's).

    `compute_dtype` (bfloat16/float16): forward under autocast in that dtype; the weights stay as they are.
    """
    device = next(model.parameters()).device
    batch = {k: v.to(device) for k, v in batch.items()}
    with torch.autocast(device.type, dtype=compute_dtype or torch.float32,
                        enabled=compute_dtype not in (None, torch.float32)):
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
    idx = batch["positions"].unsqueeze(-1).expand(-1, -1, logits.shape[-1])
    picked = logits.gather(1, idx)  # [B, R, V]
    return token_logprobs(picked, batch["response"], temperature, top_k, top_p)


POLICY_DIR, DRAFTER_DIR = "policy", "drafter"
CHECKPOINT_FORMAT = 2  # 1: one torch.save pickle; 2: HF folders + trainer.pt


def save_hf_folder(model: PreTrainedModel, tokenizer: Any, out: Path) -> None:
    """`model` (+ its tokenizer) as a Hugging Face folder, written to a temporary sibling and renamed into place.

    The state is copied out first: the trainer's parameters are views of one flat buffer (weight sync), which
    safetensors refuses to write as shared storage.
    """
    import shutil

    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    state = {k: v.detach().to("cpu", copy=True).contiguous() for k, v in model.state_dict().items()}
    model.save_pretrained(tmp, state_dict=state)
    if tokenizer is not None:
        tokenizer.save_pretrained(tmp)
    shutil.rmtree(out, ignore_errors=True)
    os.replace(tmp, out)


def load_hf_weights(folder: Path, like: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The state dict saved in `folder` by `save_hf_folder`, with tied weights filled in from `like`."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"{folder}: no safetensors weights in this checkpoint")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    own = like.state_dict()
    for k in own:  # tied weights (lm_head = embed_tokens) are stored once
        if k not in state:
            tied = _tied_source(like, k)
            if tied is None or tied not in state:
                raise KeyError(f"{folder}: checkpoint lacks {k}")
            state[k] = state[tied]
    return state


def _tied_source(model: torch.nn.Module, key: str) -> str | None:
    params = model.state_dict(keep_vars=True)
    target = params[key]
    for k, v in params.items():
        if k != key and v is target:
            return k
    # `like` may be any module; Hugging Face models also name their tied embeddings
    get_out, get_inp = getattr(model, "get_output_embeddings", None), getattr(model, "get_input_embeddings", None)
    out = get_out() if callable(get_out) else None
    inp = get_inp() if callable(get_inp) else None
    if out is not None and inp is not None and key.endswith("lm_head.weight"):
        for k, v in params.items():
            if v is inp.weight:
                return k
    return None


def weights_digest(model: torch.nn.Module) -> str:
    """SHA-256 over every parameter's bytes in name order: equal digests mean bit-identical weights."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _rng_state() -> dict[str, Any]:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def _set_rng_state(state: dict[str, Any]) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def trains_drafter(settings: RunSettings) -> bool:
    """Whether trainer rank 0 keeps a drafter master copy, trains it, and streams it with every weight sync."""
    return bool(settings.draft_model) and settings.method == "draft_model" and settings.drafter_training


def all_reduce_grads(params: list[torch.nn.Parameter], group: Any = None) -> None:
    """Sum the gradients of every data-parallel rank in place, in one collective on the gradients' own device.

    The flat buffer is allocated where the gradients live (GPU memory on a GPU trainer: no host round trip) and
    the group's backend must be the one for that device (`specrl.runtime.devices.collective_backend`).
    """
    import torch.distributed as dist

    if not params:
        return
    grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
    flat = torch.cat([g.reshape(-1) for g in grads])
    dist.all_reduce(flat, op=dist.ReduceOp.SUM, group=group)
    offset = 0
    for p, g in zip(params, grads):
        n = g.numel()
        p.grad = flat[offset:offset + n].view_as(p).clone()
        offset += n


def contributes(sample: Sample) -> bool:
    """Whether a sample can move the policy without a KL term: its per-token loss is ratio x advantage (clipped),
    importance weights included, so an advantage of exactly 0 gives a zero loss and a zero gradient. Skipping those
    samples leaves the gradient the same (up to the order of float sums: the loss is divided by the step's full
    token count either way) and saves their forward and backward: every group whose samples all scored the same."""
    return sample.advantage != 0.0


class TrainerWorker:
    """One data-parallel trainer rank. Rank 0 also owns the drafter master copy and sends weights."""

    def __init__(self, settings: RunSettings, rank: int = 0, world_size: int = 1, name: str | None = None,
                 metrics: Any = None) -> None:
        from ..devices import device_for, weights_dtype
        from ..models.hub import load_causal_lm, load_tokenizer, parse_dtype

        torch.set_num_threads(max(1, settings.trainer_threads or settings.torch_threads))
        self.settings, self.rank, self.world_size = settings, rank, world_size
        # Ray gives this actor its pod's GPUs and sets CUDA_VISIBLE_DEVICES: local rank 0 is cuda:0 there.
        self.device = device_for(settings.gpus_per_pod)
        self.name = name or f"{settings.job}-trainer-{rank}"
        torch.manual_seed(settings.seed)
        random.seed(settings.seed)
        np.random.seed(settings.seed)
        # Mixed precision: float32 master weights and optimizer state (bf16/fp16 weights would swallow small
        # updates), forward and backward in spec.model.dtype under autocast ("auto": float32).
        self.compute_dtype = parse_dtype(weights_dtype(settings.dtype), field="spec.model.dtype")
        self.model = load_causal_lm(settings.model, torch.float32, self.device, revision=settings.revision,
                                    field="spec.model.name")
        self.model.train()
        self.tokenizer = load_tokenizer(settings.model, revision=settings.revision, chat=settings.chat_template,
                                        system_prompt=settings.system_prompt, field="spec.model.name")
        self.ref_model = None
        if settings.kl_coef > 0:
            self.ref_model = load_causal_lm(settings.model, self.compute_dtype, self.device,
                                            revision=settings.revision, field="spec.model.name")
            self.ref_model.eval().requires_grad_(False)
        self.optimizer = torch.optim.AdamW(self.model.parameters(), lr=settings.lr, betas=(0.9, 0.99),
                                           weight_decay=0.0, eps=1e-8)
        self.loss_config = GRPOLossConfig(clip_eps=settings.clip_eps, kl_coef=settings.kl_coef)
        self.step = 0
        self.weight_version = 0
        self.drafter = None
        if rank == 0 and trains_drafter(settings):
            from .drafter_trainer import DrafterTrainer

            self.drafter = DrafterTrainer.from_settings(settings, self.device)
        self._dp_ready = False
        self.torn = False  # an RL step's update stopped after some but not all of its optimizer steps
        self.metrics = metrics
        self._sync_group: SyncGroup | None = None
        self._sender: WeightSender | None = None
        self._vllm_sender: VLLMWeightSender | None = None  # instead of _sender when the rollouts are vLLM

    # -- distributed ------------------------------------------------------------------------------------

    def init_data_parallel(self, master_addr: str, master_port: int, backend: str | None = None) -> bool:
        """Join the trainers' process group (the default group of this process).

        The backend follows the gradients' device (`collective_backend`): NCCL all-reducing CPU tensors fails, so
        a `backend` that does not match this trainer's device is refused rather than used.
        """
        import torch.distributed as dist

        from ..devices import collective_backend

        own = collective_backend(self.device)
        if backend is not None and backend != own:
            raise ValueError(f"backend: {backend!r} cannot all-reduce this trainer's {self.device} gradients "
                             f"(use {own!r})")
        backend = own
        if self.world_size > 1 and not dist.is_initialized():
            import datetime

            # Bounded (spec.faultTolerance.collectiveTimeoutSeconds), not torch's 30 min: an all-reduce waiting on
            # a peer that hangs without dying fails, and the coordinator's trainer recovery takes over.
            dist.init_process_group(backend=backend, init_method=f"tcp://{master_addr}:{master_port}",
                                    rank=self.rank, world_size=self.world_size,
                                    timeout=datetime.timedelta(seconds=self.settings.collective_timeout_s))
        self._dp_ready = True
        return True

    def regroup(self, rank: int, world_size: int, master_addr: str, master_port: int,
                backend: str | None = None) -> bool:
        """Leave the old data-parallel group and join a new one (trainers joined or were drained)."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        self.rank, self.world_size = rank, world_size
        if rank == 0 and self.drafter is None and trains_drafter(self.settings):
            from .drafter_trainer import DrafterTrainer

            self.drafter = DrafterTrainer.from_settings(self.settings, self.device)
        return self.init_data_parallel(master_addr, master_port, backend)

    def export_state(self) -> dict[str, Any]:
        """Everything a new data-parallel peer must copy to stay bit-identical with this rank."""
        state = {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(), "step": self.step,
                 "weight_version": self.weight_version}
        if self.drafter is not None:
            state["drafter"] = self.drafter.state_dict()
        return state

    def import_state(self, state: dict[str, Any]) -> bool:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.step, self.weight_version = int(state["step"]), int(state["weight_version"])
        self.torn = False
        if "drafter" in state and self.drafter is not None:
            self.drafter.load_state_dict(state["drafter"])
        return True

    def _all_reduce_grads(self) -> None:
        if self.world_size > 1:
            all_reduce_grads(list(self.model.parameters()))

    # -- training -------------------------------------------------------------------------------------

    def _logprobs(self, model: torch.nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
        s = self.settings
        return response_logprobs(model, batch, s.temperature, s.top_k, s.top_p, self.compute_dtype)

    def train_step(self, samples: list[Sample], step: int, total_tokens: int,
                   retrained: bool = False) -> dict[str, Any]:
        """One RL step on this rank's shard: `epochs` passes of `mini_batches` optimizer steps each (PPO-style;
        1 x 1 = one update). Returns this rank's own statistics, measured here (loss summed over its shard).
        `retrained`: the job trained this step before it rolled back to a checkpoint (counted apart)."""
        t0 = time.perf_counter()
        s = self.settings
        self.model.train()
        stats = {"loss": 0.0, "clip_fraction": 0.0, "kl": 0.0, "behaviour_weight": 0.0, "tokens": 0}
        async_mode = s.mode == "async"
        # The same number of updates on every rank (each one all-reduces), even when a shard is small.
        n_mb, epochs = max(1, s.mini_batches), max(1, s.epochs)
        updates = epochs * n_mb
        # interleaved: every mini-batch sees all groups; sorted by length so micro-batches pad little (the loss is
        # a sum over tokens, so the order does not change the gradient). Samples whose loss is identically zero
        # (advantage 0 and no KL term: a group where every sample scored the same) are not run at all.
        keep = contributes if self.ref_model is None else (lambda _x: True)
        mini_batches = [sorted((x for x in samples[i::n_mb] if keep(x)),
                               key=lambda x: len(x.prompt_ids) + len(x.response_ids)) for i in range(n_mb)]
        # Every rank divides by the same global count, so the summed gradient is the single-process one; with
        # mini-batches each update sees about 1/n_mb of the step's tokens.
        denom = max(1, round(total_tokens / n_mb))
        micro = max(1, s.micro_batch)
        proximal: dict[int, torch.Tensor] = {}
        if async_mode and updates > 1:
            # The proximal policy is the weights at the start of this step, for every update of the step.
            with torch.no_grad():
                for m, mb in enumerate(mini_batches):
                    for j, start in enumerate(range(0, len(mb), micro)):
                        proximal[m * 1_000_000 + j] = self._logprobs(self.model, pad_batch(mb[start:start + micro]))
        grad_norms = []
        for _epoch in range(epochs):
            for m, mb in enumerate(mini_batches):
                self.optimizer.zero_grad(set_to_none=True)
                for j, start in enumerate(range(0, len(mb), micro)):
                    batch = {k: v.to(self.device) for k, v in pad_batch(mb[start:start + micro]).items()}
                    logp = self._logprobs(self.model, batch)
                    ref = None
                    if self.ref_model is not None:
                        with torch.no_grad():
                            ref = self._logprobs(self.ref_model, batch)
                    # Sync mode: proximal == behaviour (the rollout weights are this step's start weights).
                    prox = (proximal[m * 1_000_000 + j] if proximal else logp.detach()) if async_mode else None
                    out = grpo_loss(logp, batch["behaviour"], batch["advantages"], batch["mask"], self.loss_config,
                                    proximal_logprobs=prox, ref_logprobs=ref, total_tokens=denom)
                    out.loss.backward()
                    w = out.tokens
                    stats["loss"] += float(out.loss.detach()) / epochs
                    stats["clip_fraction"] += out.clip_fraction * w
                    stats["kl"] += out.kl * w
                    stats["behaviour_weight"] += out.mean_behaviour_weight * w
                    stats["tokens"] += w
                if not mb:  # nothing contributes: the update still runs on zero gradients, as it would have
                    for p in self.model.parameters():
                        p.grad = torch.zeros_like(p)
                self._all_reduce_grads()
                grad_norms.append(float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)))
                # Set before the step: if a later all-reduce of this RL step fails (a peer died), these weights
                # are neither version `step` nor `step + 1` (coordinator/recovery.py).
                self.torn = True
                self.optimizer.step()
        self.torn = False
        self.step = step + 1
        self.weight_version = step + 1
        n = max(1, stats["tokens"])
        seconds = time.perf_counter() - t0
        result = {"loss": stats["loss"], "clip_fraction": stats["clip_fraction"] / n, "kl": stats["kl"] / n,
                  "behaviour_weight": stats["behaviour_weight"] / n, "tokens": stats["tokens"] // epochs,
                  "grad_norm": grad_norms[-1], "grad_norms": grad_norms, "updates": updates, "seconds": seconds,
                  "tokens_per_s": stats["tokens"] / seconds if seconds > 0 else 0.0, "samples": len(samples),
                  "samples_run": sum(len(mb) for mb in mini_batches),
                  "weight_version": self.weight_version, "worker": self.name, "rank": self.rank}
        if self.metrics is not None:
            self.metrics.trainer_step.set(self.step)
            self.metrics.trainer_step_duration.observe(result["seconds"])
            self.metrics.trainer_loss.set(result["loss"])
            self.metrics.trainer_grad_norm.set(result["grad_norm"])
            self.metrics.trainer_samples.inc(len(samples))
            if retrained:
                self.metrics.trainer_samples_retrained.inc(len(samples))
            self.metrics.weight_version.set(self.weight_version)
        return result

    # -- drafter (TLT) --------------------------------------------------------------------------------

    def train_drafter(self, sequences: list[list[int]], prompt_lens: list[int], max_steps: int,
                      deadline_s: float) -> dict[str, float]:
        """Train the drafter while this trainer waits for samples; returns {steps, loss}."""
        if self.drafter is None:
            return {"steps": 0, "loss": float("nan")}
        was_training = self.model.training
        self.model.eval()
        try:
            out = self.drafter.train(sequences, prompt_lens, max_steps=max_steps, deadline_s=deadline_s,
                                     teacher=self.model)
        finally:
            self.model.train(was_training)
        if self.metrics is not None and out["steps"]:
            self.metrics.drafter_train_steps.inc(out["steps"])
            self.metrics.drafter_loss.set(out["loss"])
        return out

    def drafter_state(self) -> dict[str, Any] | None:
        """The drafter master copy (weights, optimizer, replay buffer), to lend to an idle rollout worker."""
        return None if self.drafter is None else self.drafter.state_dict()

    def load_drafter_state(self, state: dict[str, Any]) -> bool:
        if self.drafter is None:
            return False
        self.drafter.load_state_dict(state)
        return True

    # -- weights --------------------------------------------------------------------------------------

    def sync_state(self) -> dict[str, torch.Tensor]:
        """What the rollout workers receive: the policy, and the drafter when it trains, in one stream."""
        from ..sync import merge_states

        parts = {"policy": {k: v.detach() for k, v in self.model.state_dict().items()}}
        if self.drafter is not None:
            parts["drafter"] = {k: v.detach() for k, v in self.drafter.model.state_dict().items()}
        return merge_states(**parts)

    def digest(self) -> str:
        return weights_digest(self.model)

    def node_address(self) -> tuple[str, int]:
        """An address and a free port on this trainer's host: rendezvous for groups it hosts."""
        import ray

        from ..ports import free_port

        ip = ray.util.get_node_ip_address() if ray.is_initialized() else "127.0.0.1"
        return ip, free_port("0.0.0.0" if ip != "127.0.0.1" else ip)

    def sync_address(self) -> tuple[str, int]:
        """Where this trainer hosts the weight-sync store: its own address, on the port the operator opened for
        it (`SPECRL_SYNC_MASTER_PORT`, declared on the pod and the headless Service), else a free port.

        The host is always this trainer's own address, not `SPECRL_SYNC_MASTER_ADDR`: that names trainer-0's
        pod, and after an elastic change the sender (rank 0) may be another trainer pod.
        """
        raw = os.environ.get("SPECRL_SYNC_MASTER_PORT", "").strip()
        host, port = self.node_address()
        if raw:
            try:
                port = int(raw)
            except ValueError:
                raise ValueError(f"SPECRL_SYNC_MASTER_PORT must be an integer, got {raw!r}") from None
        return host, port

    def open_sync_group(self, host: str, port: int, world_size: int, epoch: int) -> bool:
        from ..sync import SyncGroup, WeightSender, flatten_modules_

        self.close_sync_group()
        if self.settings.rollout_engine == "vllm":  # rollout workers are vLLM engines: speak vLLM's wire format
            from ..engine.vllm_backend import VLLMWeightSender

            self._vllm_sender = VLLMWeightSender(host, port, world_size)
            return True
        # Parameters become views of one buffer in sync_state() order, so every bucket goes out straight from
        # parameter memory (no packing copy). Redone per group because a drafter may have appeared since.
        modules = {"policy": self.model}
        if self.drafter is not None:
            modules["drafter"] = self.drafter.model
        flatten_modules_(**modules)
        group = SyncGroup.create(host, port, rank=0, world_size=world_size, backend=self.settings.sync_backend,
                                 epoch=epoch, timeout_s=self.settings.sync_timeout_s)
        self._sync_group = group
        self._sender = WeightSender(group, bucket_mib=self.settings.bucket_mb)
        return True

    def close_sync_group(self) -> None:
        if self._sync_group is not None:
            self._sync_group.close()
        if self._vllm_sender is not None:  # its NCCL communicator
            self._vllm_sender.close()
        self._sync_group = self._sender = self._vllm_sender = None

    def send_weights(self, version: int) -> dict[str, float]:
        if self._vllm_sender is not None:
            return self._send_to_vllm(self._vllm_sender)
        if self._sender is None:
            raise RuntimeError("send_weights: open_sync_group first")
        stats = self._sender.send(self.sync_state(), version)
        if self.metrics is not None:
            self.metrics.sync_duration.observe(stats.seconds)
            self.metrics.sync_bytes.inc(stats.bytes)
        return {"seconds": float(stats.seconds), "bytes": int(stats.bytes)}

    def _send_to_vllm(self, sender: VLLMWeightSender) -> dict[str, float]:
        """The policy, then the trained drafter, from device memory with vLLM's packed producer (the rollout
        workers run the matching update_weights; `vllm_backend.named_weights` fixes the order and dtype)."""
        from ..devices import decode_dtype
        from ..engine.vllm_backend import named_weights

        t0 = time.perf_counter()
        dtype = getattr(torch, decode_dtype(self.settings.dtype, self.device))  # what the vLLM engines decode in
        sent = sender.send(named_weights(self.model, dtype)).nbytes
        if self.drafter is not None:
            sent += sender.send(named_weights(self.drafter.model, dtype)).nbytes
        seconds = time.perf_counter() - t0
        if self.metrics is not None:
            self.metrics.sync_duration.observe(seconds)
            self.metrics.sync_bytes.inc(sent)
        return {"seconds": seconds, "bytes": sent}

    # -- checkpoints ----------------------------------------------------------------------------------

    def save_checkpoint(self, directory: str, cursor: dict[str, Any]) -> str:
        """Rank 0 writes `policy/` (and `drafter/`) as Hugging Face folders (safetensors + config + tokenizer,
        loadable by `AutoModelForCausalLM.from_pretrained` unchanged) and `trainer.pt` beside them (optimizer,
        step, weight version, data cursor, drafter optimizer/buffer); every rank writes its own RNG state.
        `trainer.pt` is written last, by rename: its presence marks the checkpoint complete."""
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        torch.save(_rng_state(), d / f"rng-rank{self.rank}.pt")
        if self.rank == 0:
            save_hf_folder(self.model, self.tokenizer, d / POLICY_DIR)
            payload: dict[str, Any] = {"optimizer": self.optimizer.state_dict(), "step": self.step,
                                       "weight_version": self.weight_version, "cursor": cursor,
                                       "format": CHECKPOINT_FORMAT}
            if self.drafter is not None:
                save_hf_folder(self.drafter.model, self.tokenizer, d / DRAFTER_DIR)
                payload["drafter"] = {k: v for k, v in self.drafter.state_dict().items() if k != "model"}
            tmp = d / "trainer.pt.tmp"
            torch.save(payload, tmp)
            os.replace(tmp, d / "trainer.pt")  # atomic: a crash mid-save never leaves a torn checkpoint
        return str(d)

    def load_checkpoint(self, directory: str) -> dict[str, Any]:
        d = Path(directory)
        payload = torch.load(d / "trainer.pt", weights_only=False)
        self.model.load_state_dict(load_hf_weights(d / POLICY_DIR, self.model))
        self.optimizer.load_state_dict(payload["optimizer"])
        self.step = int(payload["step"])
        self.weight_version = int(payload["weight_version"])
        self.torn = False
        self._load_drafter(d, payload)
        rng = d / f"rng-rank{self.rank}.pt"
        if rng.exists():
            _set_rng_state(torch.load(rng, weights_only=False))
        return payload["cursor"]

    def _load_drafter(self, d: Path, payload: dict[str, Any]) -> bool:
        if self.drafter is None or "drafter" not in payload or not (d / DRAFTER_DIR).is_dir():
            return False
        self.drafter.load_state_dict({**payload["drafter"],
                                      "model": load_hf_weights(d / DRAFTER_DIR, self.drafter.model)})
        return True

    def load_drafter_checkpoint(self, directory: str) -> bool:
        """Only the drafter part of a checkpoint (weights, optimizer, replay buffer): a new rank 0 takes over the
        drafter master copy after the old one died. False when this rank holds no drafter or the checkpoint none."""
        d = Path(directory)
        return self._load_drafter(d, torch.load(d / "trainer.pt", weights_only=False))

    def ping(self) -> str:
        return self.name

    def health(self) -> dict[str, Any]:
        """What the coordinator's trainer recovery needs: the version held and whether an update was cut off."""
        return {"name": self.name, "weight_version": self.weight_version, "torn": self.torn}
