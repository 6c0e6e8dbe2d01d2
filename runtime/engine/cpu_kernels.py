"""Batch-1 decode kernels for CPUs with AVX512-BF16, compiled once per machine with the system C++ compiler.

Why: at batch 1 a decode step is a chain of matrix-vector products over ~270 MB of bfloat16 weights (SmolLM2)
plus ~15 small elementwise ops per layer. Measured here (one thread, weights streamed from memory): oneDNN's
packed bf16 matmul reads weights at 9-12 GB/s for one row where a plain `sum` streams 14-16 GB/s, and ATen's
per-op dispatch adds ~9 ms per step (30 layers x ~12 ops). `linear_bf16` is a register-blocked dot-product
kernel (`vdpbf16ps`, fp32 accumulation, round-to-nearest-even output like oneDNN's), 13-14 GB/s at one row;
`decode_layers` runs a whole stack of Llama layers for one token of one sequence in one call (norms, fused qkv,
rotary, K/V cache write, GQA attention, SiLU MLP), rounding to bfloat16 at the same points as the ATen path.

Built lazily on first use with `torch.utils.cpp_extension.load_inline` (about 30 s, cached under
~/.cache/specrl/kernels); where there is no compiler, no AVX512-BF16, or the build fails, `available()` is False
and the engine keeps its ATen/oneDNN path. The kernels are exercised against that path in the engine tests.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import Any

import torch

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <vector>

typedef uint16_t bf16;

static inline bf16 to_bf16(float s) {
  uint32_t u; std::memcpy(&u, &s, 4);
  if ((u & 0x7fffffff) > 0x7f800000) return (bf16)((u >> 16) | 0x40);  // NaN stays NaN
  u += 0x7FFF + ((u >> 16) & 1);
  return (bf16)(u >> 16);
}
static inline float from_bf16(bf16 v) { uint32_t u = ((uint32_t)v) << 16; float f; std::memcpy(&f, &u, 4); return f; }
static inline float rb(float s) { return from_bf16(to_bf16(s)); }  // round through bfloat16
static inline const bf16* P(const torch::Tensor& t) { return reinterpret_cast<const bf16*>(t.data_ptr<at::BFloat16>()); }
static inline bf16* PM(torch::Tensor& t) { return reinterpret_cast<bf16*>(t.data_ptr<at::BFloat16>()); }

// Y[m, n0..n0+rows) for rows MB.. of X: W rows are read once for MB activation rows.
template <int MB>
static void block(const bf16* W, const bf16* X, float* Y, int64_t n0, int64_t rows, int64_t K, int64_t N, int64_t m0) {
  __m512 acc[4][MB];
  for (int r = 0; r < 4; ++r) for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 32) {
    __m512bh xv[MB];
    for (int m = 0; m < MB; ++m) xv[m] = (__m512bh)_mm512_loadu_si512(X + (m0 + m) * K + k);
    for (int r = 0; r < 4; ++r) {
      if (r >= rows) break;
      const bf16* wp = W + (n0 + r) * K + k;
      _mm_prefetch((const char*)(wp + 8 * K), _MM_HINT_T0);
      __m512bh wv = (__m512bh)_mm512_loadu_si512(wp);
      for (int m = 0; m < MB; ++m) acc[r][m] = _mm512_dpbf16_ps(acc[r][m], wv, xv[m]);
    }
  }
  for (int r = 0; r < rows; ++r)
    for (int m = 0; m < MB; ++m) Y[(m0 + m) * N + n0 + r] = _mm512_reduce_add_ps(acc[r][m]);
}

// fp32 Y[M, N] = X[M, K] W[N, K]^T (+ bias), K % 32 == 0.
static void matmul(const bf16* X, const bf16* W, const bf16* bias, float* Y, int64_t M, int64_t K, int64_t N) {
  at::parallel_for(0, (N + 3) / 4, 32, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      const int64_t n0 = b * 4, rows = std::min<int64_t>(4, N - n0);
      int64_t m0 = 0;
      for (; m0 + 4 <= M; m0 += 4) block<4>(W, X, Y, n0, rows, K, N, m0);
      switch (M - m0) {
        case 3: block<3>(W, X, Y, n0, rows, K, N, m0); break;
        case 2: block<2>(W, X, Y, n0, rows, K, N, m0); break;
        case 1: block<1>(W, X, Y, n0, rows, K, N, m0); break;
        default: break;
      }
    }
  });
  if (bias)
    for (int64_t m = 0; m < M; ++m) for (int64_t n = 0; n < N; ++n) Y[m * N + n] += from_bf16(bias[n]);
}

torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias) {
  auto x2 = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t M = x2.size(0), K = x2.size(1), N = w.size(0);
  std::vector<float> y32(M * N);
  matmul(P(x2), P(w), bias ? P(*bias) : nullptr, y32.data(), M, K, N);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options());
  bf16* Y = PM(y);
  for (int64_t i = 0; i < M * N; ++i) Y[i] = to_bf16(y32[i]);
  return y;
}

// out = bf16(x * rsqrt(mean(x^2) + eps) * w) in fp32, one rounding: what F.rms_norm does on bfloat16.
static void rms_norm(const bf16* x, const bf16* w, bf16* out, int64_t H, double eps) {
  float ss = 0.f;
  for (int64_t i = 0; i < H; ++i) { float v = from_bf16(x[i]); ss += v * v; }
  const float r = 1.0f / std::sqrt(ss / H + (float)eps);
  for (int64_t i = 0; i < H; ++i) out[i] = to_bf16(from_bf16(x[i]) * r * from_bf16(w[i]));
}

// One token of one sequence through layers [0, L): h [H] bf16 is updated in place; K/V written at `pos` of `slot`.
void decode_layers(torch::Tensor h, std::vector<torch::Tensor> in_norm, std::vector<torch::Tensor> post_norm,
                   std::vector<torch::Tensor> qkv_w, std::vector<c10::optional<torch::Tensor>> qkv_b,
                   std::vector<torch::Tensor> o_w, std::vector<c10::optional<torch::Tensor>> o_b,
                   std::vector<torch::Tensor> gu_w, std::vector<c10::optional<torch::Tensor>> gu_b,
                   std::vector<torch::Tensor> down_w, std::vector<c10::optional<torch::Tensor>> down_b,
                   std::vector<torch::Tensor> k_cache, std::vector<torch::Tensor> v_cache, int64_t slot, int64_t pos,
                   torch::Tensor cos, torch::Tensor sin, int64_t nh, int64_t nkv, double eps, double scaling) {
  const int64_t H = h.numel(), L = (int64_t)qkv_w.size(), D = cos.numel(), half = D / 2;
  const int64_t qs = nh * D, kvs = nkv * D, I = gu_w[0].size(0) / 2, group = nh / nkv;
  const int64_t max_len = k_cache[0].size(2), len = pos + 1;
  bf16* hp = PM(h);
  const bf16* cp = P(cos);
  const bf16* sp = P(sin);
  std::vector<bf16> a(std::max(H, I)), qkv(qs + 2 * kvs), att(qs), act(I);
  std::vector<float> y(std::max({qs + 2 * kvs, 2 * I, H})), scores(len);
  for (int64_t l = 0; l < L; ++l) {
    rms_norm(hp, P(in_norm[l]), a.data(), H, eps);
    matmul(a.data(), P(qkv_w[l]), qkv_b[l] ? P(*qkv_b[l]) : nullptr, y.data(), 1, H, qs + 2 * kvs);
    for (int64_t i = 0; i < qs + 2 * kvs; ++i) qkv[i] = to_bf16(y[i]);
    // rotary on q and k heads: bf16(bf16(x*cos) + bf16(rot(x)*sin)), rot(x) = (-x2, x1)
    for (int64_t hd = 0; hd < nh + nkv; ++hd) {
      bf16* x = qkv.data() + hd * D;
      float tmp[512];
      for (int64_t d = 0; d < D; ++d) {
        const float rot = d < half ? -from_bf16(x[d + half]) : from_bf16(x[d - half]);
        tmp[d] = rb(rb(from_bf16(x[d]) * from_bf16(cp[d])) + rb(rot * from_bf16(sp[d])));
      }
      for (int64_t d = 0; d < D; ++d) x[d] = to_bf16(tmp[d]);
    }
    bf16* kc = PM(k_cache[l]);
    bf16* vc = PM(v_cache[l]);
    for (int64_t g = 0; g < nkv; ++g) {
      const int64_t off = ((slot * nkv + g) * max_len + pos) * D;
      std::memcpy(kc + off, qkv.data() + qs + g * D, D * sizeof(bf16));
      std::memcpy(vc + off, qkv.data() + qs + kvs + g * D, D * sizeof(bf16));
    }
    for (int64_t hd = 0; hd < nh; ++hd) {
      const int64_t g = hd / group;
      const bf16* q = qkv.data() + hd * D;
      const bf16* K = kc + (slot * nkv + g) * max_len * D;
      const bf16* V = vc + (slot * nkv + g) * max_len * D;
      float qf[512], o[512];
      for (int64_t d = 0; d < D; ++d) { qf[d] = from_bf16(q[d]) * (float)scaling; o[d] = 0.f; }
      float mx = -INFINITY;
      for (int64_t j = 0; j < len; ++j) {
        float s = 0.f;
        const bf16* kj = K + j * D;
        for (int64_t d = 0; d < D; ++d) s += qf[d] * from_bf16(kj[d]);
        scores[j] = s;
        mx = std::max(mx, s);
      }
      float den = 0.f;
      for (int64_t j = 0; j < len; ++j) { scores[j] = std::exp(scores[j] - mx); den += scores[j]; }
      for (int64_t j = 0; j < len; ++j) {
        const float p = scores[j] / den;
        const bf16* vj = V + j * D;
        for (int64_t d = 0; d < D; ++d) o[d] += p * from_bf16(vj[d]);
      }
      for (int64_t d = 0; d < D; ++d) att[hd * D + d] = to_bf16(o[d]);
    }
    matmul(att.data(), P(o_w[l]), o_b[l] ? P(*o_b[l]) : nullptr, y.data(), 1, qs, H);
    for (int64_t i = 0; i < H; ++i) hp[i] = to_bf16(from_bf16(hp[i]) + rb(y[i]));
    rms_norm(hp, P(post_norm[l]), a.data(), H, eps);
    matmul(a.data(), P(gu_w[l]), gu_b[l] ? P(*gu_b[l]) : nullptr, y.data(), 1, H, 2 * I);
    for (int64_t i = 0; i < I; ++i) {
      const float g = rb(y[i]), u = rb(y[I + i]);
      act[i] = to_bf16(rb(g / (1.f + std::exp(-g))) * u);
    }
    matmul(act.data(), P(down_w[l]), down_b[l] ? P(*down_b[l]) : nullptr, y.data(), 1, I, H);
    for (int64_t i = 0; i < H; ++i) hp[i] = to_bf16(from_bf16(hp[i]) + rb(y[i]));
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_bf16", &linear_bf16);
  m.def("decode_layers", &decode_layers);
}
"""

_lock = threading.Lock()
_module: Any = None
_tried = False


def _cpu_has_avx512_bf16() -> bool:
    try:
        with open("/proc/cpuinfo") as f:
            return "avx512_bf16" in f.read()
    except OSError:
        return False


def load() -> Any:
    """The compiled module, or None where it cannot be built here (then the ATen path runs)."""
    global _module, _tried
    with _lock:
        if _tried:
            return _module
        _tried = True
        if os.environ.get("SPECRL_CPU_KERNELS", "1") == "0" or not _cpu_has_avx512_bf16():
            return None
        try:
            from torch.utils.cpp_extension import load_inline

            build = Path(os.environ.get("SPECRL_KERNEL_CACHE", Path.home() / ".cache" / "specrl" / "kernels"))
            build.mkdir(parents=True, exist_ok=True)
            _module = load_inline("specrl_decode_kernels", cpp_sources=_SOURCE, functions=None,
                                  extra_cflags=["-O3", "-march=native"], build_directory=str(build), verbose=False)
        except Exception:  # noqa: BLE001 - no compiler / headers / ninja: the ATen path is the fallback
            _module = None
        return _module


def available() -> bool:
    return load() is not None


def fits(weight: torch.Tensor) -> bool:
    """The kernels' layout: a contiguous CPU bfloat16 matrix with input features in whole 32-lanes."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[1] % 32 == 0 and weight.is_contiguous())
