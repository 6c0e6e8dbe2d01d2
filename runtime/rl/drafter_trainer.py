"""Drafter training on idle capacity (TLT): keep the draft model close to the moving policy.

As RL moves the policy, a frozen drafter's acceptance decays and speculation stops paying. While a trainer
waits for samples (the rollout phase, and above all its long tail, when most rollout capacity idles) it
fits the drafter to the *current* policy along its own recent rollouts: forward KL(policy || drafter) on the
response positions, with the policy's full next-token distributions computed on the spot (the trainer holds
the policy), from a small replay buffer of recent steps. Matching distributions, not just the sampled
tokens, is what speculative acceptance (sum of min(p, q)) rewards. Without a teacher it falls back to
cross-entropy on the sampled tokens. The trained drafter ships with the next
weight sync (`drafter.*` tensors next to `policy.*`), so every rollout worker's proposer is refreshed in the
same transfer.
"""

from __future__ import annotations

import random
import time
from collections import deque
from typing import TYPE_CHECKING, Any

import torch

from .settings import RunSettings

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class DrafterTrainer:
    def __init__(self, model: PreTrainedModel, lr: float = 1e-3, buffer_sequences: int = 512, seed: int = 0,
                 batch_size: int = 16) -> None:
        self.model = model
        self.model.train()
        self.optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
        self.buffer: deque[tuple[list[int], int]] = deque(maxlen=buffer_sequences)
        self.rng = random.Random(seed)
        self.batch_size = batch_size
        self.steps_total = 0
        self.last_loss = float("nan")

    @classmethod
    def from_settings(cls, settings: RunSettings, device: torch.device | str = "cpu") -> DrafterTrainer:
        from ..models.hub import load_causal_lm

        assert settings.draft_model
        # float32 master weights like the policy's (the rollout copies hold spec.model.dtype), on the trainer's
        # device before the optimizer sees them
        model = load_causal_lm(settings.draft_model, "float32", device, field="spec.speculative.draftModel")
        return cls(model, lr=settings.drafter_lr, seed=settings.seed)

    def add(self, sequences: list[list[int]], prompt_lens: list[int]) -> None:
        for seq, n in zip(sequences, prompt_lens):
            if len(seq) > n:
                self.buffer.append((list(seq), int(n)))

    def loss_on(self, batch: list[tuple[list[int], int]], teacher: torch.nn.Module | None = None) -> torch.Tensor:
        T = max(len(s) for s, _ in batch)
        ids = torch.zeros((len(batch), T), dtype=torch.long)
        attn = torch.zeros_like(ids)
        labels = torch.full_like(ids, -100)
        for i, (seq, n) in enumerate(batch):
            ids[i, : len(seq)] = torch.tensor(seq)
            attn[i, : len(seq)] = 1
            labels[i, n: len(seq)] = torch.tensor(seq[n:])  # only response tokens are drafted
        dev = next(self.model.parameters()).device  # the trainer's device (cuda:<local rank> on a GPU pod)
        ids, attn, labels = ids.to(dev), attn.to(dev), labels.to(dev)
        logits = self.model(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
        if teacher is None:
            return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     labels[:, 1:].reshape(-1), ignore_index=-100)
        with torch.no_grad():
            target = torch.log_softmax(teacher(input_ids=ids, attention_mask=attn).logits[:, :-1].float(), -1)
        mask = (labels[:, 1:] != -100).float()
        logq = torch.log_softmax(logits, -1)
        kl = (target.exp() * (target - logq)).sum(-1)
        return (kl * mask).sum() / mask.sum().clamp(min=1)

    def train(self, sequences: list[list[int]], prompt_lens: list[int], *, max_steps: int,
              deadline_s: float, teacher: torch.nn.Module | None = None) -> dict[str, float]:
        """Add the sequences to the buffer, then take up to `max_steps` optimizer steps before the deadline."""
        self.add(sequences, prompt_lens)
        steps, losses = 0, []
        end = time.monotonic() + max(0.0, deadline_s)
        self.model.train()
        while steps < max_steps and self.buffer and time.monotonic() < end:
            batch = self.rng.sample(list(self.buffer), min(self.batch_size, len(self.buffer)))
            loss = self.loss_on(batch, teacher)
            self.optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
            self.optimizer.step()
            losses.append(float(loss.detach()))
            steps += 1
        self.steps_total += steps
        if losses:
            self.last_loss = sum(losses) / len(losses)
        return {"steps": steps, "loss": self.last_loss}

    def state_dict(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "optimizer": self.optimizer.state_dict(),
                "steps_total": self.steps_total, "rng": self.rng.getstate(),
                "buffer": list(self.buffer)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        self.steps_total = int(state["steps_total"])
        self.rng.setstate(state["rng"])
        self.buffer.clear()
        self.buffer.extend((list(s), int(n)) for s, n in state["buffer"])
