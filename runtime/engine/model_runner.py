"""Our own decode loop over a Hugging Face Llama/Qwen2/Qwen3 model's weights, on the static KV cache.

HF's generic forward (DynamicCache, 4-D padding masks, output dataclasses) costs more Python time per step than
the math itself for small models at small batch, which is exactly the long-tail regime speculative decoding is
for. This runner reads the HF model's weights (embedding, per-layer norms, q/k/v/o, gate/up/down, final norm,
lm_head, rotary inverse frequencies) and runs the same math with: fused qkv and gate|up matmuls, one
`F.rms_norm` per norm, rotary tables precomputed once, cache writes in place, and one SDPA call per layer
(GQA handled by `enable_gqa`). Same code on CPU and CUDA.

Weights are *copied* into fused tensors (q|k|v and gate|up). `refresh_if_stale()` compares every source
parameter's identity and in-place version counter, so in-place updates of the HF model (load_state_dict,
optimizer steps, weight sync) are picked up automatically at the next `generate` call.

`quantize=4|8` builds the quantized_self drafter: every matmul (lm_head included) reads 4-bit group-wise or int8
per-channel weights (re-quantized from the policy on refresh); `quantize_bits` picks 4 where the CPU kernel exists.

On a CPU with AVX512-BF16 (and a C++ compiler), bfloat16 and 4-bit runners take `cpu_kernels` for decode-sized
forwards (`FUSED_ROWS`: a few tokens of a few sequences — decode steps, their verification, drafting): the whole
layer stack in one C++ call, each token computed exactly as a one-token batch-1 step computes it; float32 runners,
4-bit ones included, take `cpu_kernels_f32` alike on a CPU with AVX2 and FMA. Larger forwards keep the per-op path,
whose few-token forwards share the same attention routine.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, overload

import torch
import torch.nn.functional as F
from torch import nn

from . import cpu_kernels, cpu_kernels_f32
from .hf_layout import Attention, Decoder, config_of, output_embeddings
from .kv_cache import StaticKVCache


@dataclass
class ForwardPlan:
    """Everything about one forward's shape that is shared by all layers (built once per forward)."""

    slot0: int
    batch: int
    tokens: int
    positions: torch.Tensor  # [B, T]
    rows: torch.Tensor | None  # [B, T] slot index per position (multi-row writes)
    single_row_start: int | None
    kv_len: int
    mask: torch.Tensor | None  # [B, 1, T, kv_len] additive (0 = attend, -inf = masked)
    cos: torch.Tensor  # [B, 1, T, D]
    sin: torch.Tensor
    flat_index: torch.Tensor | None = None  # cache-write index, computed by the cache on first use


def native_bf16() -> bool:
    """True where this CPU has bfloat16 matmul instructions (AVX512-BF16 or AMX) and torch's oneDNN uses them."""
    global _NATIVE_BF16
    if _NATIVE_BF16 is None:
        try:
            with open("/proc/cpuinfo") as f:
                flags = f.read()
            has = "avx512_bf16" in flags or "amx_bf16" in flags
        except OSError:
            has = False
        _NATIVE_BF16 = bool(has and torch.backends.mkldnn.is_available()
                            and torch.ops.mkldnn._is_mkldnn_bf16_supported())
    return _NATIVE_BF16


_NATIVE_BF16: bool | None = None


def compute_dtype(requested: str | torch.dtype | None, model_dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """The dtype the engine runs in: None = the model's own; "auto" = bfloat16 on a CPU with native bf16
    kernels (measured here: a 5-token verify then costs ~1.1 plain steps instead of ~2), else the model's."""
    if requested is None:
        return model_dtype
    if requested == "auto":
        if device.type == "cpu":
            return torch.bfloat16 if native_bf16() else torch.float32
        return model_dtype
    dt = getattr(torch, requested) if isinstance(requested, str) else requested
    if dt not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype: must be auto, float32, bfloat16 or float16, got {requested!r}")
    return dt


class Dense:
    """y = x W^T + b with plain tensors (no module dispatch).

    CPU bfloat16 with native kernels: up to SMALL_ROWS rows go to `cpu_kernels.linear_bf16` (weights packed once
    into its layout), more to oneDNN with the weight pre-packed once (`mkldnn._linear_pointwise`). Measured here
    (Xeon with AVX512-BF16, no AMX, one thread, stacks of SmolLM2 / bench / tiny-shaped layers): the kernel takes
    8.8 / 14.7 / 46.6 ms for 1 / 5 / 16 rows of SmolLM2's 30 layers where oneDNN takes 12.4 / 17.9 / 48.3, and is
    1.5-6x faster on the small builtin models, whose matmuls are too small for oneDNN's per-call overhead; at 40
    rows the two are even.

    CPU float32 with AVX2 and FMA: up to SMALL_ROWS_F32 rows go to `cpu_kernels_f32.linear`, more to oneDNN as
    follows. The bench-shaped 8-layer stack below, ms for 1-5 / 16 / 32 / 64 / 112 rows: kernel 6-9 (the streaming
    rate) / 13.6 / 25.7 / 45.8 / 77.6, packed oneDNN 8-18 / 19.8 / 30.9 / 51.2 / 83.8.

    CPU float32 without native bf16 (e.g. an AVX2-only EPYC): oneDNN with the weight pre-packed once (laid out for 4
    rows). Its rows come out bit-identical whatever the row count (F.linear's do not: MKL's one-row GEMV and its
    GEMM round differently), so a plain step and a verification compute every token alike; and MKL's small-M GEMM
    streams the weight about once per row. Measured on an AVX2-only AMD EPYC, one
    thread, bench-shaped 8-layer stacks, best of 7 while a test run used the other core, ms for 1 / 2 / 3 / 4 / 8 /
    16 rows: F.linear 12.4 / 20.4 / 31.2 / 34.0 / 37.6 / 47.4, packed 13.0 /
    15.3 / 22.4 / 21.9 / 27.5 / 35.0. Elsewhere, and for float32 on CPUs with native bf16 (only the reference
    dtype of the lossless checks there, where F.linear was measured and tested; the packed path was not): F.linear.
    """

    SMALL_ROWS = 16  # up to this many rows: the kernel
    SMALL_ROWS_F32 = 128
    PACK_ROWS = 4  # float32: the row count oneDNN lays the packed weight out for (one layout serves 1-16 rows)

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        self.out_features = weight.shape[0]
        self.bias = bias
        self.packed = None
        self.weight: torch.Tensor | None = weight
        self.kernels = None
        self.small_rows = self.SMALL_ROWS
        self.kweight: torch.Tensor | None = None  # cpu_kernels' layout, where the kernels run this weight
        if weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and native_bf16():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), 1)
            kernels = cpu_kernels.load() if cpu_kernels.fits(weight) else None
            if kernels is not None:
                self.kernels = kernels
                self.kweight = cpu_kernels.pack_bf16(weight)
                self.weight = None  # oneDNN and the kernels each hold their own packed copy
        elif weight.device.type == "cpu" and weight.dtype == torch.float32:
            kernels = cpu_kernels_f32.load() if cpu_kernels_f32.fits(weight) else None
            if kernels is not None:
                self.kernels = kernels
                self.kweight = cpu_kernels_f32.pack_f32(weight)
                self.small_rows = self.SMALL_ROWS_F32
            if not native_bf16() and torch.backends.mkldnn.is_available():
                try:
                    self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), self.PACK_ROWS)
                    self.weight = None
                except (RuntimeError, NotImplementedError):  # a torch without oneDNN's linear: F.linear
                    self.packed = None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None and x.numel() <= self.small_rows * x.shape[-1]:
            return self.kernels.linear(x, self.kweight, self.bias, self.out_features)
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        assert self.weight is not None
        return F.linear(x, self.weight, self.bias)


class Int8Dense:
    """int8 matmul for the quantized_self drafter, per-output-channel symmetric weight scales.

    CPU (fp32 activations): torch.ao's dynamic-quantized Linear (fbgemm int8 GEMM, activations quantized per
    call) — measured 4-5x faster than the fp32 matmul for 1-16 rows here. Elsewhere: weight-only int8 via
    `torch._weight_int8pack_mm` (bf16/fp16 activations), else a dequantizing fallback.
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        w = weight.detach().float()
        self.out_features = weight.shape[0]
        self.bias = bias
        self.ao = _ao_dynamic_linear(w, bias) if weight.device.type == "cpu" and weight.dtype == torch.float32 else None
        if self.ao is None:
            scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
            self.qweight = torch.round(w / scale.unsqueeze(1)).clamp(-127, 127).to(torch.int8).contiguous()
            self.scale = scale.to(weight.dtype)
        self._packed_ok = True

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.ao is not None:
            return self.ao(x)
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        y = None
        if self._packed_ok:
            try:
                y = torch._weight_int8pack_mm(x2, self.qweight, self.scale)
            except (RuntimeError, NotImplementedError):
                self._packed_ok = False  # kernel missing for this device/dtype: dequantizing fallback
        if y is None:
            y = F.linear(x2, self.qweight.to(x2.dtype)) * self.scale
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


class Int4Dense:
    """4-bit weights, asymmetric per group of 32 input channels (the GGUF Q4_1 / AWQ layout: w = scale·q + min,
    q in 0..15). A checkpoint that was itself 4-bit with this grouping (SmolLM2's GGUF Q4_1) comes back nearly
    exactly.

    CPU with AVX512-BF16: bfloat16 activations, every row through `cpu_kernels.linear_q4` (ATen's
    `_weight_int4pack_mm_for_cpu` where the kernels did not build). Measured on a Zen 4 EPYC, one thread: SmolLM2's
    30 layers of 4-bit matmuls in 3.7 ms at one row with the weights streamed from memory, where its bfloat16 ones
    take ~9; ATen's int4 kernel takes 2x ours at every row count from 1 to 256 (SmolLM2's lm_head and MLP shapes).

    CPU with AVX2 and FMA only (no native bf16): float32 activations (int8 per group of 32 inside the kernel), every
    row through `cpu_kernels_f32.linear_q4`, each row computed alike whatever rows come with it. Measured on an
    AVX2-only EPYC, one thread, SmolLM2's 30 layers of matmuls and lm_head: 6.0-6.5 ms at one row against 23-27 ms
    for the float32 kernel (the target's own), 6.9-7.2 ms at two; ATen's int4 kernel takes ~1 s for 1000 rows of one
    1536 x 576 weight in float32 there.
    """

    GROUP = 32

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        w = weight.detach().float()
        n, k = w.shape
        g = w.view(n, k // self.GROUP, self.GROUP)
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        scale = ((hi - lo) / 15).clamp(min=1e-8)
        q = torch.round((g - lo) / scale).clamp(0, 15).to(torch.int32).view(n, k)
        self.bias = bias
        self.out_features = n
        self.packed: torch.Tensor | None = None
        self.f32 = weight.dtype == torch.float32 and self.f32_kernels() is not None
        if self.f32:
            self.kernels = self.f32_kernels()
        else:
            self.kernels = cpu_kernels.load()
            if self.kernels is None:  # ATen's kernel computes (q - 8)·scale + zero
                zero = lo + 8 * scale
                self.scales_zeros = torch.stack([scale.squeeze(-1), zero.squeeze(-1)], dim=-1).transpose(0, 1) \
                    .contiguous().to(weight.dtype)
                self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q, 1)
        if self.kernels is not None:
            # what the kernels' `linear_q4` takes after x: the bf16 module's codes with their scales and mins in one
            # stream, the float32 module's codes, scales and mins apart (`q4_sz` in its `decode_layers`)
            self.q4_packed: list[torch.Tensor] = list(self.kernels.pack_q4(q, scale.view(n, -1), lo.view(n, -1)))
            self.q4_sz = torch.stack(self.q4_packed[1:]) if len(self.q4_packed) > 1 else None

    @staticmethod
    def f32_kernels() -> Any:
        return None if native_bf16() else cpu_kernels_f32.load()

    @classmethod
    def available(cls, device: torch.device) -> bool:
        if device.type != "cpu":
            return False
        if native_bf16():
            return cpu_kernels.available() or hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu")
        return cls.f32_kernels() is not None

    @classmethod
    def fits(cls, weight: torch.Tensor) -> bool:
        """The kernels' layout: input features in whole groups; for ATen's, output features a multiple of 16."""
        f32 = weight.dtype == torch.float32 and cls.f32_kernels() is not None
        return weight.shape[1] % cls.GROUP == 0 and (f32 or weight.shape[0] % 16 == 0)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.kernels is not None:
            return self.kernels.linear_q4(x.contiguous(), *self.q4_packed, self.bias, self.out_features)
        assert self.packed is not None
        shape = x.shape
        y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.reshape(-1, shape[-1]), self.packed, self.GROUP,
                                                       self.scales_zeros)
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*shape[:-1], self.out_features)


def _ao_dynamic_linear(weight: torch.Tensor, bias: torch.Tensor | None) -> nn.Module | None:
    """A per-channel dynamic int8 Linear (torch.ao), or None when this torch build lacks it."""
    try:
        import warnings

        from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
        from torch.ao.quantization import per_channel_dynamic_qconfig

        lin = nn.Linear(weight.shape[1], weight.shape[0], bias=bias is not None)
        with torch.no_grad():
            lin.weight.copy_(weight)
            if bias is not None:
                lin.bias.copy_(bias.detach().float())
        lin.qconfig = per_channel_dynamic_qconfig  # type: ignore[assignment]  # torch.ao's dynamic attribute
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # torch.ao eager quantization is deprecated in favour of torchao
            return DynamicLinear.from_float(lin)
    except Exception:  # noqa: BLE001 - any failure means "use the portable path"
        return None


@dataclass
class LayerWeights:
    in_norm: torch.Tensor | None  # None: no input norm (the EAGLE head's layer)
    post_norm: torch.Tensor
    qkv: Callable[[torch.Tensor], torch.Tensor]
    o: Callable[[torch.Tensor], torch.Tensor]
    gate_up: Callable[[torch.Tensor], torch.Tensor]
    down: Callable[[torch.Tensor], torch.Tensor]
    act: Callable[[torch.Tensor], torch.Tensor]
    qk_norm: torch.Tensor | None = None  # Qwen3: per-head RMSNorm weights of q and k, [1, heads_q + heads_kv, 1, D]


def _cat_bias(mods: list[nn.Linear]) -> torch.Tensor | None:
    if all(m.bias is None for m in mods):
        return None
    return torch.cat([m.bias if m.bias is not None else torch.zeros(m.out_features, dtype=m.weight.dtype,
                                                                     device=m.weight.device) for m in mods])


# model_type of the architectures this runner reproduces exactly (Llama, Qwen2, Qwen3 with q/k norm).
SUPPORTED_MODEL_TYPES = ("llama", "qwen2", "qwen3")


def decoder_of(model: nn.Module) -> Decoder:
    """The base decoder (LlamaModel/Qwen2Model/Qwen3Model) of a *ForCausalLM."""
    inner = getattr(model, "model", None)
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    if inner is None or not hasattr(inner, "layers") or not hasattr(inner, "embed_tokens") \
            or model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"model: the native engine runs {', '.join(SUPPORTED_MODEL_TYPES)} causal LMs, got "
                         f"{type(model).__name__} (model_type {model_type!r})")
    return inner


def quantize_bits(model: nn.Module, requested: int | None = None) -> int:
    """Bits of the quantized_self drafter: `requested`, else 4 where the CPU int4 kernel exists, else 8."""
    if requested is not None:
        return requested
    return 4 if Int4Dense.available(next(model.parameters()).device) else 8


def _int4_or_int8(weight: torch.Tensor, bias: torch.Tensor | None) -> Int4Dense | Int8Dense:
    """A 4-bit matmul, or int8 for a matrix whose shape the int4 kernel does not take."""
    return Int4Dense(weight, bias) if Int4Dense.fits(weight) else Int8Dense(weight, bias)


def _kernel_bytes(m: object) -> int:
    """The bytes of weights the kernels stream for layer `m` (0 where they do not run it)."""
    if isinstance(m, Int4Dense) and m.kernels is not None:
        return sum(t.nbytes for t in m.q4_packed)
    return m.kweight.nbytes if isinstance(m, Dense) and m.kweight is not None else 0


class TransformerRunner:
    """Runs (the first `num_layers` layers of) a Llama/Qwen2 causal LM over a StaticKVCache."""

    FEW_TOKENS = 16  # forwards of at most this many tokens per row attend with cpu_kernels where it runs
    # Forwards of at most this many rows (batch x tokens) run the fused stack: its matmul keeps pace with oneDNN's
    # up to ~40 rows (see `Dense`) and it saves ~12 op dispatches per layer; measured per forward on the tiny
    # policy, one thread: 0.08 / 0.15 / 0.34 / 0.67 ms at batch 1 / 2 / 8 / 16 where the per-op path takes 0.34 /
    # 0.46 / 0.94 / 1.49 ms.
    FUSED_ROWS = 64
    FUSED_ROWS_F32 = 128  # the float32 kernel's matmul is faster than oneDNN's up to 112 rows at least (see `Dense`)
    # With AMX tiles (`cpu_kernels.use_amx`) the fused stack's matmuls stay at memory speed to 16 rows and beat the
    # per-op path at every size measured: bench model, one thread, ms at batch x tokens 4x5 / 8x5 / 16x5 / 16x9:
    # 10.1 / 15.4 / 26.4 / 40.5 where the per-op path (oneDNN, which uses AMX too) took 15.0 / 24.8 / 34.0 / 61.8.
    FUSED_ROWS_AMX = 144
    _fused: tuple[list, ...] | None = None  # decode_layers' weights (set by refresh where the kernels run)
    _kernels: Any = None  # cpu_kernels (bfloat16) or cpu_kernels_f32 (float32): the module `_fused` is for
    # `cpu_kernels.prefetch_distance` of this model's weights, set before each fused forward: the bf16 module's
    # setting is the process's, and a drafter beside the policy may want another one
    _prefetch: tuple[int, int] | None = None
    kernel_bytes = 0  # bytes of weights a fused step streams through the kernels (0: it does not run them)
    _fused_rows = FUSED_ROWS

    def __init__(self, model: nn.Module, quantize: int = 0, max_positions: int | None = None,
                 dtype: str | torch.dtype | None = None) -> None:
        self.model = model
        if quantize not in (0, 4, 8):
            raise ValueError(f"quantized_bits: must be 4 or 8, got {quantize!r}")
        self.quantize = quantize
        decoder_of(model)  # an unsupported architecture fails here, before any config field is read
        cfg = config_of(model)
        layer_types = getattr(cfg, "layer_types", None) or []
        if getattr(cfg, "use_sliding_window", False) or any(t != "full_attention" for t in layer_types):
            raise ValueError("model: sliding-window attention is not supported by the native engine")
        self.config = cfg
        self.num_heads: int = cfg.num_attention_heads
        self.num_kv_heads: int = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim: int = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.hidden_size: int = cfg.hidden_size
        self.vocab_size: int = cfg.vocab_size
        self.eps = float(cfg.rms_norm_eps)
        dec = decoder_of(model)
        self.num_layers = len(dec.layers)
        self.scaling = float(dec.layers[0].self_attn.scaling)
        param = next(model.parameters())
        self.device = param.device
        # int8 drafting keeps float32 activations on CPU (torch.ao's int8 GEMM is the fast kernel there); the
        # int4 kernels take bfloat16 where the CPU has native bf16, float32 elsewhere.
        self.dtype = {0: compute_dtype(dtype, param.dtype, param.device),
                      4: torch.bfloat16 if native_bf16() else torch.float32, 8: param.dtype}[quantize]
        config_positions: int = getattr(cfg, "max_position_embeddings", 2048)
        self.max_positions = int(max_positions or config_positions)
        self._signature: tuple = ()
        self.refresh()

    # ---- weights -------------------------------------------------------------------------------------------
    def _source_params(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def _current_signature(self) -> tuple:
        return tuple((id(p), p._version) for p in self._source_params())

    def refresh_if_stale(self) -> bool:
        sig = self._current_signature()
        if sig != self._signature:
            self.refresh()
            return True
        return False

    @torch.no_grad()
    def refresh(self) -> None:
        """(Re)build the fused (and, for int8, re-quantized) weights from the HF model."""
        dense = {0: Dense, 4: _int4_or_int8, 8: Int8Dense}[self.quantize]
        dec = decoder_of(self.model)

        @overload
        def c(t: torch.Tensor) -> torch.Tensor: ...
        @overload
        def c(t: torch.Tensor | None) -> torch.Tensor | None: ...
        def c(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.detach().to(self.dtype)

        layers = []
        for layer in dec.layers:
            at, mlp = layer.self_attn, layer.mlp
            qkv = [at.q_proj, at.k_proj, at.v_proj]
            layers.append(
                LayerWeights(
                    in_norm=c(layer.input_layernorm.weight),
                    post_norm=c(layer.post_attention_layernorm.weight),
                    qkv=dense(c(torch.cat([m.weight for m in qkv])), c(_cat_bias(qkv))),
                    o=dense(c(at.o_proj.weight), c(at.o_proj.bias)),
                    gate_up=dense(c(torch.cat([mlp.gate_proj.weight, mlp.up_proj.weight])),
                                  c(_cat_bias([mlp.gate_proj, mlp.up_proj]))),
                    down=dense(c(mlp.down_proj.weight), c(mlp.down_proj.bias)),
                    act=mlp.act_fn,
                    qk_norm=self._qk_norm(at),
                )
            )
        self.layers = layers
        self.intermediate = int(dec.layers[0].mlp.down_proj.weight.shape[1])
        self.embed = c(dec.embed_tokens.weight)
        self.final_norm = c(dec.norm.weight)
        head = output_embeddings(self.model)
        self.lm_head = dense(c(head.weight), c(getattr(head, "bias", None)))
        rot = dec.rotary_emb
        inv_freq = rot.inv_freq.detach().to(self.device, torch.float32)
        pos = torch.arange(self.max_positions, device=self.device, dtype=torch.float32)
        freqs = pos[:, None] * inv_freq[None, :]
        emb = torch.cat((freqs, freqs), dim=-1)
        scale = float(getattr(rot, "attention_scaling", 1.0))
        self.cos_table = (emb.cos() * scale).to(self.dtype)
        self.sin_table = (emb.sin() * scale).to(self.dtype)
        self._fused = self._fused_decode_args()
        self._signature = self._current_signature()

    def _fused_decode_args(self) -> tuple[list, ...] | None:
        """The per-layer weights `cpu_kernels.decode_layers` takes, where it can run this model: bf16 Dense
        layers the kernel fits, no q/k norm, SiLU MLP, head_dim within the kernel's buffers."""
        kernels = {torch.bfloat16: cpu_kernels, torch.float32: cpu_kernels_f32}.get(self.dtype)
        if not self.layers or self.head_dim > 512 or self.head_dim % 2 or kernels is None or kernels.load() is None:
            return None
        self._kernels = kernels.load()
        self._fused_rows = (self.FUSED_ROWS_F32 if self.dtype == torch.float32
                            else self.FUSED_ROWS_AMX if cpu_kernels.amx() else self.FUSED_ROWS)

        def fused(m: Callable[[torch.Tensor], torch.Tensor]) -> bool:
            return isinstance(m, (Dense, Int4Dense)) and m.kernels is not None

        probe = torch.linspace(-8, 8, 64, dtype=self.dtype)
        for w in self.layers:
            parts = (w.qkv, w.o, w.gate_up, w.down)
            silu = torch.equal(w.act(probe), F.silu(probe))  # transformers has its own SiLU classes
            if w.in_norm is None or w.qk_norm is not None or not silu or not all(map(fused, parts)):
                return None
        cols: list[list] = [[w.in_norm for w in self.layers], [w.post_norm for w in self.layers]]
        streamed = 0  # bytes of weights a step reads through the kernels
        for name in ("qkv", "o", "gate_up", "down"):
            mods = [getattr(w, name) for w in self.layers]
            cols += [[m.q4_packed[0] if isinstance(m, Int4Dense) else m.kweight for m in mods],
                     [m.q4_sz if isinstance(m, Int4Dense) else None for m in mods],
                     [m.bias for m in mods]]
            streamed += sum(map(_kernel_bytes, mods))
        self.kernel_bytes = streamed + _kernel_bytes(self.lm_head)
        if kernels is cpu_kernels:
            self._prefetch = cpu_kernels.prefetch_distance(self.kernel_bytes)
        return tuple(cols)

    def _qk_norm(self, attn: Attention) -> torch.Tensor | None:
        q_norm, k_norm = getattr(attn, "q_norm", None), getattr(attn, "k_norm", None)
        if q_norm is None or k_norm is None:
            return None
        w = torch.cat([q_norm.weight.detach().expand(self.num_heads, -1),
                       k_norm.weight.detach().expand(self.num_kv_heads, -1)])
        # in the activations' dtype: a float32 norm weight would promote k (and the cache write) to float32
        return w.view(1, self.num_heads + self.num_kv_heads, 1, self.head_dim).to(self.dtype)

    # ---- cache ---------------------------------------------------------------------------------------------
    @property
    def prefetch(self) -> tuple[int, int] | None:
        """The kernels' weight-stream prefetch this model runs with (one-row tiles, the rest; bytes ahead), None
        where its forward does not run the bfloat16 fused stack."""
        return self._prefetch

    @prefetch.setter
    def prefetch(self, distances: tuple[int, int]) -> None:
        """Override the choice (`specrl bench prefetch` measures both sides of it); a weight refresh chooses again."""
        if self._prefetch is None:
            raise ValueError("prefetch: this model's forward does not run the bfloat16 kernels")
        one_row, rows = distances
        self._prefetch = (int(one_row), int(rows))

    def new_cache(self, slots: int, max_len: int, num_layers: int | None = None) -> StaticKVCache:
        return StaticKVCache(num_layers or self.num_layers, slots, self.num_kv_heads, max_len, self.head_dim,
                             self.dtype, self.device)

    # ---- forward -------------------------------------------------------------------------------------------
    def plan(self, slot0: int, starts: list[int], tokens: int, lens: list[int] | None = None,
             cache_len: int | None = None) -> ForwardPlan:
        """Row b feeds positions starts[b] .. starts[b]+lens[b]-1 (lens: default all `tokens`; a shorter row is
        right-padded). Attention reads keys up to the longest row's real end, and padding writes its K/V to the
        last position of the cache (`cache_len - 1`, scratch the caller never uses for a real token): a padded
        row beside a long one must not address positions past any real sequence, nor past the cache."""
        b = len(starts)
        dev = self.device
        real = lens if lens is not None else [tokens] * b
        kv_len = max(s + n for s, n in zip(starts, real))
        padded = tokens > min(real)
        scratch = min(cache_len or self.max_positions, self.max_positions) - 1
        if kv_len > scratch + (not padded):  # padding needs the scratch position free
            raise ValueError(f"max_model_len: position {kv_len} exceeds the context ({scratch + 1} positions)")
        ar = torch.arange(tokens, device=dev)
        if b == 1:
            positions = (ar + starts[0]).unsqueeze(0)
        else:
            positions = torch.tensor(starts, device=dev).unsqueeze(1) + ar.unsqueeze(0)
        if padded:
            pad = ar.unsqueeze(0) >= torch.tensor(real, device=dev).unsqueeze(1)
            positions = positions.masked_fill(pad, scratch)
        mask = None
        # One new token per row and equal lengths (batch 1, or a GRPO group of one prompt): every cached key is
        # visible, so no mask (SDPA is cheaper without one).
        if not (tokens == 1 and min(starts) == max(starts)):
            keys = torch.arange(kv_len, device=dev)
            hidden = keys.view(1, 1, 1, kv_len) > positions.view(b, 1, tokens, 1)
            # Additive, in the compute dtype, built once per forward: SDPA would convert a bool mask in every layer.
            mask = torch.zeros(hidden.shape, dtype=self.dtype, device=dev).masked_fill_(hidden, float("-inf"))
        rows = None
        if b > 1 or padded:
            rows = torch.arange(slot0, slot0 + b, device=dev).unsqueeze(1).expand(b, tokens)
        return ForwardPlan(
            slot0=slot0, batch=b, tokens=tokens, positions=positions, rows=rows,
            single_row_start=starts[0] if b == 1 and not padded else None, kv_len=kv_len, mask=mask,
            cos=self.cos_table[positions].unsqueeze(1), sin=self.sin_table[positions].unsqueeze(1),
        )

    def layers_forward(self, h: torch.Tensor, cache: StaticKVCache, plan: ForwardPlan,
                       num_layers: int | None = None) -> torch.Tensor:
        """Run layers 0..num_layers-1 on hidden states h [B, T, H], writing K/V into `cache`."""
        b, t = plan.batch, plan.tokens
        nh, nkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        qs, kvs = nh * d, nkv * d
        gqa = nh != nkv
        cos, sin = plan.cos, plan.sin
        half = d // 2
        # Decode and verification forwards (a few tokens per row) share the fused batch-1 step's attention
        # routine, so plain decoding and speculation compute identical attention; long prefills use SDPA.
        attend = self._kernels.attend if self._fused is not None and t <= self.FEW_TOKENS else None
        for i, w in enumerate(self.layers[: num_layers or self.num_layers]):
            a = h if w.in_norm is None else F.rms_norm(h, (self.hidden_size,), w.in_norm, self.eps)
            qkv = w.qkv(a)
            # Rotary on q and k in one pass (half the elementwise kernels of rotating them separately).
            qk = qkv[..., : qs + kvs].view(b, t, nh + nkv, d).transpose(1, 2)
            if w.qk_norm is not None:  # Qwen3: RMSNorm of every q and k head before rotary
                qk = F.rms_norm(qk, (d,), None, self.eps) * w.qk_norm
            qk = qk * cos + torch.cat((-qk[..., half:], qk[..., :half]), dim=-1) * sin
            q, k = qk[:, :nh], qk[:, nh:]
            v = qkv[..., qs + kvs :].view(b, t, nkv, d).transpose(1, 2)
            cache.write(i, plan, k, v)
            if attend is not None:
                o = attend(q, cache.k[i], cache.v[i], plan.slot0, plan.positions, plan.kv_len, self.scaling)
            else:
                kc, vc = cache.view(i, plan.slot0, b, plan.kv_len)
                o = F.scaled_dot_product_attention(q, kc, vc, attn_mask=plan.mask, scale=self.scaling,
                                                   enable_gqa=gqa)
            h = h + w.o(o.transpose(1, 2).reshape(b, t, qs))
            a = F.rms_norm(h, (self.hidden_size,), w.post_norm, self.eps)
            gu = w.gate_up(a)
            inter = gu.shape[-1] // 2
            h = h + w.down(w.act(gu[..., :inter]) * gu[..., inter:])
        return h

    def head(self, h: torch.Tensor, row_invariant: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
        """Final norm + lm_head: returns (logits fp32, normed hidden). `row_invariant`: every row's logits as a
        one-row call computes them (the fused path's verification must round as its plain step does)."""
        hn = F.rms_norm(h, (self.hidden_size,), self.final_norm, self.eps)
        head = self.lm_head
        if row_invariant and isinstance(head, Dense) and head.kernels is not None:
            return head.kernels.linear(hn, head.kweight, head.bias, head.out_features).float(), hn
        return head(hn).float(), hn

    def prefill(self, cache: StaticKVCache, slot0: int, tokens: torch.Tensor, lens: list[int],
                all_hidden: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Prompts tokens [B, T] (row b right-padded after lens[b] tokens) into slots slot0.. from position 0.

        Returns the pre-norm hidden state at each row's last real position [B, H] (`head` of it gives the logits;
        the engine keeps it to sample a later sibling's first token) and, with `all_hidden`, the normed hidden
        [B, T, H] at every position (a feature-level drafter's prefill)."""
        b, t = tokens.shape
        plan = self.plan(slot0, [0] * b, t, lens, cache.max_len)
        h = self.layers_forward(F.embedding(tokens, self.embed), cache, plan)
        last = h[torch.arange(b, device=h.device), torch.tensor([n - 1 for n in lens], device=h.device)]
        return last, F.rms_norm(h, (self.hidden_size,), self.final_norm, self.eps) if all_hidden else None

    def forward(self, cache: StaticKVCache, slot0: int, starts: list[int], tokens: torch.Tensor,
                num_layers: int | None = None, last_index: torch.Tensor | None = None, all_hidden: bool = False,
                lens: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """tokens [B, T] for slots slot0.., row b at positions starts[b]..starts[b]+T-1 (or right-padded after
        lens[b] real tokens, see `plan`).

        Returns (logits fp32, normed hidden): [B, T, *] for all positions, or [B, *] at `last_index` [B].
        With `last_index` and `all_hidden`, logits [B, V] at `last_index` but hidden [B, T, H] everywhere: what a
        feature-level drafter's prefill needs, without [B, T, V] logits (16 x 1024 tokens x 152k vocab is ~10 GB
        of float32).
        """
        h = F.embedding(tokens, self.embed)
        b, t = tokens.shape
        fused = False
        if self._fused is not None and lens is None and t <= self.FEW_TOKENS and b * t <= self._fused_rows \
                and max(starts) + t <= min(cache.max_len, self.max_positions):
            # Decode-sized forwards (plain steps, verifications, a drafter's steps): the whole layer stack in one
            # call, each token of each row computed exactly as a one-token batch-1 step would compute it.
            n = num_layers or self.num_layers
            h = h.reshape(b * t, -1)
            if b == 1:
                cos, sin = self.cos_table[starts[0]:starts[0] + t], self.sin_table[starts[0]:starts[0] + t]
            else:
                pos = (torch.tensor(starts)[:, None] + torch.arange(t)).view(-1)
                cos, sin = self.cos_table[pos], self.sin_table[pos]
            if self._prefetch is not None:
                self._kernels.set_prefetch(*self._prefetch)
            self._kernels.decode_layers(
                h, *(col[:n] for col in self._fused), cache.k[:n], cache.v[:n], slot0, starts, cos, sin,
                self.num_heads, self.num_kv_heads, self.intermediate, self.eps, self.scaling)
            h = h.view(b, t, -1)
            fused = True
        else:
            plan = self.plan(slot0, starts, tokens.shape[1], lens, cache.max_len)
            h = self.layers_forward(h, cache, plan, num_layers)
        if last_index is None:
            return self.head(h, row_invariant=fused)
        rows = torch.arange(h.shape[0], device=h.device)
        if all_hidden:
            hn = F.rms_norm(h, (self.hidden_size,), self.final_norm, self.eps)
            return self.lm_head(hn[rows, last_index]).float(), hn
        return self.head(h[rows, last_index], row_invariant=fused)
