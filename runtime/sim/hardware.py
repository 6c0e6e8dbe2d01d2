"""Accelerator and model descriptions, loaded from `data/hardware.yaml` (the one file that holds the numbers)."""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

import yaml
from pydantic import BaseModel, ConfigDict, Field

DATA = Path(__file__).with_name("data") / "hardware.yaml"


class GPU(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = ""
    bf16_tflops: float = Field(gt=0)
    hbm_tbps: float = Field(gt=0)
    hbm_gib: float = Field(gt=0)
    nvlink_gbps: float = Field(gt=0)
    network_gbps: float = Field(gt=0)

    @property
    def flops(self) -> float:
        return self.bf16_tflops * 1e12

    @property
    def hbm_bytes_per_s(self) -> float:
        return self.hbm_tbps * 1e12


class ModelSpec(BaseModel):
    model_config = ConfigDict(extra="forbid")
    name: str = ""
    params_b: float = Field(gt=0)
    active_params_b: float = Field(gt=0)
    layers: int = Field(ge=1)
    hidden: int = Field(ge=1)
    kv_heads: int = Field(ge=1)
    head_dim: int = Field(ge=1)
    vocab: int = Field(ge=1)
    experts: int = 0
    experts_per_token: int = 0
    expert_params_b: float = 0.0
    bytes_per_param: float = 2.0

    @property
    def is_moe(self) -> bool:
        return self.experts > 0

    @property
    def params(self) -> float:
        return self.params_b * 1e9

    @property
    def active_params(self) -> float:
        return self.active_params_b * 1e9

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.layers * self.kv_heads * self.head_dim * 2.0

    @property
    def layer_params(self) -> float:
        """Parameters of one dense transformer layer of this width (what an EAGLE/MTP head costs)."""
        return 12.0 * self.hidden * self.hidden

    def weight_bytes_read(self, tokens: float) -> float:
        """Bytes of weights one forward pass reads for `tokens` tokens in the batch.

        Dense models read every weight. MoE models read the shared part plus the experts the batch
        routes to; with uniform routing, a layer's expert is touched with probability 1 - (1 - k/E)^tokens.
        This is why verifying gamma+1 tokens costs an MoE model more memory traffic than one token.
        """
        if not self.is_moe:
            return self.params * self.bytes_per_param
        shared = (self.params_b - self.expert_params_b) * 1e9
        touched = 1.0 - (1.0 - self.experts_per_token / self.experts) ** max(tokens, 1.0)
        return (shared + self.expert_params_b * 1e9 * touched) * self.bytes_per_param


@lru_cache(maxsize=1)
def _data() -> dict:
    return yaml.safe_load(DATA.read_text())


def gpu(name: str) -> GPU:
    table = _data()["gpus"]
    if name not in table:
        raise ValueError(f"unknown GPU {name!r}; known: {', '.join(sorted(table))}")
    return GPU(name=name, **table[name])


def model(name: str) -> ModelSpec:
    table = _data()["models"]
    if name not in table:
        raise ValueError(f"unknown model {name!r}; known: {', '.join(sorted(table))}")
    return ModelSpec(name=name, **table[name])


def known_gpus() -> list[str]:
    return sorted(_data()["gpus"])


def known_models() -> list[str]:
    return sorted(_data()["models"])
