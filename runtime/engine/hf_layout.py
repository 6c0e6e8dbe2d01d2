"""The parts of a Hugging Face Llama/Qwen2/Qwen3 causal LM the native engine reads, as Protocols.

Hugging Face builds these modules dynamically (`nn.Module.__getattr__`), so a type checker sees every attribute
as `Tensor | Module`. `decoder_of` (model_runner) checks the layout at runtime and returns it as a `Decoder`;
from there attribute access is typed. Only what the engine reads is declared.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Protocol

import torch
from torch import nn

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Norm(Protocol):
    weight: torch.Tensor


class Attention(Protocol):
    q_proj: nn.Linear
    k_proj: nn.Linear
    v_proj: nn.Linear
    o_proj: nn.Linear
    scaling: float


class MLP(Protocol):
    gate_proj: nn.Linear
    up_proj: nn.Linear
    down_proj: nn.Linear
    act_fn: Callable[[torch.Tensor], torch.Tensor]


class DecoderLayer(Protocol):
    self_attn: Attention
    mlp: MLP
    input_layernorm: Norm
    post_attention_layernorm: Norm


class Rotary(Protocol):
    inv_freq: torch.Tensor

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class Decoder(Protocol):
    """The base decoder (LlamaModel/Qwen2Model/Qwen3Model) of a *ForCausalLM."""

    layers: Sequence[DecoderLayer]
    embed_tokens: nn.Embedding
    norm: Norm
    rotary_emb: Rotary

    def __call__(self, *, input_ids: torch.Tensor) -> Any: ...  # a BaseModelOutputWithPast


def config_of(model: nn.Module) -> PretrainedConfig:
    """The model's Hugging Face config (its fields are read by name: they differ per architecture)."""
    from transformers import PretrainedConfig

    cfg = getattr(model, "config", None)
    if not isinstance(cfg, PretrainedConfig):
        raise ValueError(f"model: {type(model).__name__} has no Hugging Face config")  # noqa: TRY004 - bad input
    return cfg


def output_embeddings(model: nn.Module) -> nn.Linear:
    """The lm_head of a Hugging Face causal LM (tied or not)."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if not isinstance(head, nn.Linear):
        raise ValueError(f"model: {type(model).__name__} has no linear output embeddings (lm_head)")  # noqa: TRY004
    return head
