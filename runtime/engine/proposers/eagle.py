"""EAGLE-style feature-level drafter: one decoder layer on the target's hidden states (TLT's trainable drafter).

Feature f_i is the target's final *normed* hidden state at position i (the input of lm_head, which predicts
token i+1). The head maps (embed(t_{i+1}), f_i) -> fc -> one Llama decoder layer -> g_i, a prediction of
f_{i+1}; the target's own lm_head turns g_i into draft logits for token i+2. Embedding and lm_head are SHARED
with the target (read, never trained here), so the head is small: fc (2H -> H) plus one layer.

The head is laid out exactly as vLLM's EAGLE model (``vllm/model_executor/models/llama_eagle.py``) expects, so
`save_for_vllm` writes its state dict unchanged: fc without bias over ``cat(embedding, feature)`` (that order), the
layer's input RMSNorm removed (vLLM replaces layer 0's with Identity, as the original EAGLE), no final norm, no
embedding/lm_head in the checkpoint (vLLM then shares the target's). `tests/contract/test_eagle_layout.py` checks
this against the loader code of the pinned vLLM wheel.

Inference: the proposer keeps the target features of every sequence position (the engine passes them after
each prefill/AR/verify forward) and a one-layer KV cache over true features; drafting continues on predicted
features, which are recomputed from true features at the next step. Drafts are sampled from the processed q.

Training (the RL runtime's drafter trainer): `eagle_loss(head, target, hidden, tokens)` / `train_step(...)` on
target hidden states collected from rollouts (`target_features(target, tokens)`).
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, cast, overload

import torch
import torch.nn.functional as F
from torch import nn

from ..hf_layout import DecoderLayer, config_of, output_embeddings
from ..model_runner import Dense, LayerWeights, TransformerRunner, decoder_of
from .base import DraftCollector, DraftContext, Proposal, Proposer

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from ..engine import RolloutEngine
    from ..kv_cache import StaticKVCache


class EagleHead(nn.Module):
    """fc(cat(feature, token embedding)) -> one decoder layer of the target's architecture."""

    def __init__(self, target_config: PretrainedConfig) -> None:
        super().__init__()
        cfg = copy.deepcopy(target_config)
        cfg.num_hidden_layers = 1
        if hasattr(cfg, "layer_types") and cfg.layer_types is not None:
            cfg.layer_types = ["full_attention"]
        self.config = cfg
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)  # input: cat(embedding, feature), vLLM's order
        # Reuse the target architecture's decoder layer and rotary embedding classes.
        from transformers import AutoModel

        base = AutoModel.from_config(cfg)
        self.layers = nn.ModuleList([base.layers[0]])
        self.layers[0].input_layernorm = nn.Identity()  # fc's output enters attention un-normed (EAGLE, vLLM)
        self.rotary_emb = base.rotary_emb
        del base
        with torch.no_grad():
            # Start close to "copy the feature through": helps a fresh head propose something sensible.
            self.fc.weight.zero_()
            self.fc.weight[:, h:].copy_(torch.eye(h))

    @property
    def layer(self) -> DecoderLayer:
        """The head's one decoder layer: the target architecture's own class (built in __init__)."""
        return cast("DecoderLayer", self.layers[0])

    @classmethod
    def from_target(cls, target: nn.Module) -> EagleHead:
        p = next(target.parameters())
        return cls(config_of(target)).to(device=p.device, dtype=p.dtype)

    def forward(self, features: torch.Tensor, next_tokens: torch.Tensor, embed_weight: torch.Tensor) -> torch.Tensor:
        """Teacher-forced training forward: features [B, T, H], next_tokens [B, T] -> predicted next features."""
        x = self.fc(torch.cat([F.embedding(next_tokens, embed_weight), features], dim=-1))
        b, t, _ = x.shape
        pos = torch.arange(t, device=x.device).unsqueeze(0).expand(b, t)
        cos, sin = self.rotary_emb(x, pos)
        mask = torch.full((t, t), float("-inf"), device=x.device, dtype=x.dtype).triu(1).view(1, 1, t, t)
        out = self.layers[0](x, attention_mask=mask, position_embeddings=(cos, sin), position_ids=pos)
        return out[0] if isinstance(out, tuple) else out


@torch.no_grad()
def target_features(target: nn.Module, tokens: torch.Tensor) -> torch.Tensor:
    """The target's final normed hidden states [B, T, H] for tokens [B, T] (what the head is trained on)."""
    return decoder_of(target)(input_ids=tokens).last_hidden_state


def eagle_loss(head: EagleHead, target: nn.Module, hidden: torch.Tensor, tokens: torch.Tensor,
               mask: torch.Tensor | None = None, ce_weight: float = 0.1) -> torch.Tensor:
    """Feature regression (smooth L1 to f_{i+1}) + soft cross-entropy to the target's next-token distribution.

    hidden [B, T, H] are target features of tokens [B, T]; mask [B, T] (1 = real token) excludes padding.
    """
    if tokens.shape[1] < 2:
        raise ValueError("tokens: need at least 2 positions to train the eagle head")
    embed = decoder_of(target).embed_tokens.weight.detach()
    lm_head = output_embeddings(target).weight.detach()
    pred = head(hidden[:, :-1], tokens[:, 1:], embed)
    goal = hidden[:, 1:].detach()
    reg = F.smooth_l1_loss(pred, goal, reduction="none").mean(-1)
    with torch.no_grad():
        p_target = torch.softmax(F.linear(goal, lm_head).float(), dim=-1)
    logq = torch.log_softmax(F.linear(pred, lm_head).float(), dim=-1)
    ce = -(p_target * logq).sum(-1)
    per_pos = reg + ce_weight * ce
    if mask is None:
        return per_pos.mean()
    m = (mask[:, 1:] * mask[:, :-1]).to(per_pos.dtype)
    return (per_pos * m).sum() / m.sum().clamp(min=1.0)


def train_step(head: EagleHead, optimizer: torch.optim.Optimizer, target: nn.Module, tokens: torch.Tensor,
               hidden: torch.Tensor | None = None, mask: torch.Tensor | None = None) -> float:
    """One optimizer step on a batch of token sequences (features computed from the target if not given)."""
    if hidden is None:
        hidden = target_features(target, tokens)
    was_training = head.training
    head.train()
    optimizer.zero_grad(set_to_none=True)
    loss = eagle_loss(head, target, hidden, tokens, mask)
    loss.backward()
    optimizer.step()
    head.train(was_training)
    return float(loss.detach())


class _EagleRunner(TransformerRunner):
    """Runs the head's single layer over its own static cache; embed/lm_head are the target runner's."""

    def __init__(self, head: EagleHead, target_runner: TransformerRunner) -> None:
        self.head_module = head
        self.target_runner = target_runner
        self.model = head
        self.quantize = 0
        cfg = head.config
        self.config = cfg
        self.num_heads = cfg.num_attention_heads
        self.num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden_size = cfg.hidden_size
        self.vocab_size = target_runner.vocab_size
        self.eps = float(cfg.rms_norm_eps)
        self.num_layers = 1
        self.scaling = float(head.layer.self_attn.scaling)
        self.device = target_runner.device
        self.dtype = target_runner.dtype
        self.max_positions = target_runner.max_positions
        self.refresh()

    @torch.no_grad()
    def refresh(self) -> None:
        layer = self.head_module.layer
        at, mlp = layer.self_attn, layer.mlp
        from ..model_runner import _cat_bias

        qkv = [at.q_proj, at.k_proj, at.v_proj]

        @overload
        def c(t: torch.Tensor) -> torch.Tensor: ...
        @overload
        def c(t: torch.Tensor | None) -> torch.Tensor | None: ...
        def c(t: torch.Tensor | None) -> torch.Tensor | None:  # the head runs in the target runner's dtype
            return None if t is None else t.detach().to(self.dtype)

        self.layers = [LayerWeights(
            in_norm=None,  # the head's layer has no input norm (see EagleHead)
            post_norm=c(layer.post_attention_layernorm.weight),
            qkv=Dense(c(torch.cat([m.weight for m in qkv])), c(_cat_bias(qkv))),
            o=Dense(c(at.o_proj.weight), c(at.o_proj.bias)),
            gate_up=Dense(c(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                          c(_cat_bias([mlp.gate_proj, mlp.up_proj]))),
            down=Dense(c(mlp.down_proj.weight), None),
            act=mlp.act_fn,
        )]
        self.fc = Dense(c(self.head_module.fc.weight), None)
        self.cos_table = self.target_runner.cos_table
        self.sin_table = self.target_runner.sin_table
        self._signature = self._current_signature()

    def step(self, cache: StaticKVCache, starts: list[int], features: torch.Tensor, tokens: torch.Tensor,
             last_index: torch.Tensor | None = None, lens: list[int] | None = None,
             ) -> tuple[torch.Tensor, torch.Tensor]:
        """features [B, T, H] + next tokens [B, T] (row b right-padded after lens[b]) -> (draft logits fp32,
        predicted features)."""
        plan = self.plan(0, starts, tokens.shape[1], lens, cache.max_len)
        x = self.fc(torch.cat([F.embedding(tokens, self.target_runner.embed), features], dim=-1))
        g = self.layers_forward(x, cache, plan)
        if last_index is not None:
            g = g[torch.arange(g.shape[0], device=g.device), last_index]
        return self.target_runner.lm_head(g).float(), g


class EagleProposer(Proposer):
    name = "eagle"
    needs_hidden = True

    def __init__(self, head: EagleHead | None = None) -> None:
        self.head = head

    def attach(self, engine: RolloutEngine) -> None:
        if self.head is None:
            self.head = EagleHead.from_target(engine.model)  # freshly initialised (trained later by the runtime)
        if self.head.config.hidden_size != engine.runner.hidden_size:
            raise ValueError("eagle_head: hidden size differs from the target's")
        self.runner = _EagleRunner(self.head, engine.runner)
        self.cache = self.runner.new_cache(engine.max_batch_size, engine.cache_len)
        self.features = torch.zeros((engine.max_batch_size, engine.cache_len, engine.runner.hidden_size),
                                    dtype=engine.runner.dtype, device=engine.device)
        self.head_lens = [0] * engine.max_batch_size
        self.feat_lens = [0] * engine.max_batch_size

    def refresh(self, policy: nn.Module | None = None) -> None:
        self.runner.refresh()

    def refresh_if_stale(self) -> None:
        self.runner.refresh_if_stale()  # the head is trained in place by the runtime's drafter trainer

    def reset_slot(self, slot: int) -> None:
        self.head_lens[slot] = 0
        self.feat_lens[slot] = 0

    def move_slot(self, src: int, dst: int) -> None:
        self.cache.move_slot(src, dst, self.head_lens[src])
        n = self.feat_lens[src]
        self.features[dst, :n].copy_(self.features[src, :n])
        self.head_lens[dst] = self.head_lens[src]
        self.feat_lens[dst] = n

    def copy_prefix(self, src: list[int], dst: list[int], lens: list[int]) -> None:
        # The prompt's target features; the head's cache (whose last prompt position depends on the first
        # generated token) stays empty after reset_slot and catches up per slot in `propose`, as without sharing.
        dev = self.features.device
        head = self.features.narrow(1, 0, max(lens, default=0))
        head.index_copy_(0, torch.tensor(dst, device=dev), head.index_select(0, torch.tensor(src, device=dev)))
        for d, n in zip(dst, lens):
            self.feat_lens[d] = n

    def truncate(self, target_lens: list[int]) -> None:
        for b, n in enumerate(target_lens):
            self.head_lens[b] = min(self.head_lens[b], n)
            self.feat_lens[b] = min(self.feat_lens[b], n)

    def observe_target(self, hidden: torch.Tensor, starts: list[int], counts: list[int], slot0: int = 0) -> None:
        for b, (s, c) in enumerate(zip(starts, counts)):
            self.features[slot0 + b, s : s + c].copy_(hidden[b, :c])
            self.feat_lens[slot0 + b] = s + c

    def propose(self, ctx: DraftContext, gamma: int) -> Proposal:
        runner = self.runner
        b = ctx.batch
        dev = runner.device
        n = [len(t) for t in ctx.tokens]
        m = [x - 1 for x in n]  # target cache length == positions with true features
        starts = [self.head_lens[i] for i in range(b)]
        counts = [m[i] - starts[i] for i in range(b)]
        if any(self.feat_lens[i] < m[i] for i in range(b)) or any(c < 1 for c in counts):
            raise RuntimeError("eagle: target features are missing for some positions (engine bookkeeping bug)")
        width = max(counts)
        idx = torch.tensor([[min(starts[i] + j, m[i] - 1) for j in range(width)] for i in range(b)], device=dev)
        feats = self.features[:b].gather(1, idx.unsqueeze(-1).expand(b, width, self.features.shape[-1]))
        nxt = torch.tensor([ctx.tokens[i][starts[i] + 1 : m[i] + 1] + [0] * (width - counts[i]) for i in range(b)],
                           dtype=torch.int64, device=dev)
        last = torch.tensor([c - 1 for c in counts], dtype=torch.int64, device=dev)
        logits, g = runner.step(self.cache, starts, feats, nxt, last_index=last, lens=counts)
        drafts = DraftCollector(ctx)
        for j in range(gamma):
            d = drafts.add(logits)
            if j + 1 < gamma:
                logits, g = runner.step(self.cache, [x + j for x in m], g.unsqueeze(1), d.unsqueeze(1))
                logits, g = logits[:, 0], g[:, 0]
        for i in range(b):
            self.head_lens[i] = m[i]
        return drafts.proposal()


# -- export in vLLM's EAGLE layout --------------------------------------------------------------------------------

VLLM_EAGLE_WEIGHTS = "model.safetensors"


def vllm_eagle_config(head: EagleHead) -> dict:
    """The drafter's ``config.json`` for vLLM's ``EagleLlamaForCausalLM`` (``speculative_config.method="eagle"``).

    vLLM builds the head from a Llama config (``EAGLEConfig`` prefixes the architecture with ``Eagle``); a Qwen2
    target's q/k/v biases become ``qkv_bias`` — without it vLLM would silently drop them (its loader ignores
    unexpected ``.bias`` tensors).
    """
    cfg = head.config
    attn = head.layer.self_attn
    out = {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "num_hidden_layers": 1,
        "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads,
        "head_dim": getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads,
        "hidden_act": cfg.hidden_act, "rms_norm_eps": cfg.rms_norm_eps, "vocab_size": cfg.vocab_size,
        "max_position_embeddings": cfg.max_position_embeddings, "tie_word_embeddings": False,
        "attention_bias": attn.o_proj.bias is not None, "qkv_bias": attn.q_proj.bias is not None,
        "mlp_bias": head.layer.mlp.gate_proj.bias is not None,
        "torch_dtype": str(head.fc.weight.dtype).removeprefix("torch."),
    }
    rope = getattr(cfg, "rope_parameters", None)
    if rope:
        out["rope_parameters"] = dict(rope)
        out["rope_theta"] = rope.get("rope_theta", 10000.0)  # older readers look for the flat key
    elif getattr(cfg, "rope_theta", None) is not None:
        out["rope_theta"] = cfg.rope_theta
    return out


def save_for_vllm(head: EagleHead, folder: str) -> None:
    """Write ``config.json`` + ``model.safetensors`` that vLLM loads as an EAGLE drafter (names unchanged)."""
    import json
    import os

    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    tensors = {k: v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    save_file(tensors, os.path.join(folder, VLLM_EAGLE_WEIGHTS), metadata={"format": "pt"})
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(vllm_eagle_config(head), f, indent=1)


def load_for_vllm_folder(folder: str, target: nn.Module) -> EagleHead:
    """The inverse of `save_for_vllm`: a head for `target` from a vLLM-layout EAGLE folder."""
    import os

    from safetensors.torch import load_file

    head = EagleHead.from_target(target)
    state = load_file(os.path.join(folder, VLLM_EAGLE_WEIGHTS), device=str(next(head.parameters()).device))
    missing, unexpected = head.load_state_dict(state, strict=False)
    if missing or unexpected:
        raise ValueError(f"{folder}: not an EAGLE head for this target (missing {sorted(missing)[:4]}, "
                         f"unexpected {sorted(unexpected)[:4]})")
    return head
