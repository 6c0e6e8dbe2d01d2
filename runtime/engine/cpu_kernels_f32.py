"""Float32 decode kernels for CPUs with AVX2 and FMA (no native bfloat16), compiled once per machine.

Why: on such a CPU (an AVX2-only AMD EPYC here) the engine runs float32, and at batch 1 a step of the 27M-parameter
benchmark policy must stream its 109 MB of weights: 6.6 ms at the 16.7 GB/s one thread reads, but the per-op path
took ~21 ms (31% of that roofline) — oneDNN's packed small-M GEMM reads the weights at well under the streaming rate,
a verification of 5 tokens cost ~1.7 plain steps instead of ~1, and ATen dispatches ~12 ops per layer. These are
the float32 counterparts of `cpu_kernels`' bfloat16 ones, with the same Python-facing functions (`linear`,
`attend`, `decode_layers`): weights packed once (`pack_f32`: 8 output columns' weights for one input side by side,
one 32-byte vector), products accumulated in vector lanes (no horizontal sums) over tiles of up to 6 rows x 16
columns, so up to 6 rows read the weights once from memory and more re-read a 16 KB panel from L1; the whole layer
stack of a few tokens of a few sequences in one call. Measured on an AVX2-only EPYC (Zen 3), one thread, the
benchmark policy's 8 layers of matmuls: 5.3-6.5 ms for 1-6 rows (the 16-20 GB/s streaming rate), 9 ms for 8 and
13.5 ms for 16, where oneDNN's packed GEMM takes 8-12 / 13-15 / 19-24 ms. Every output is
the same sequence of fused multiply-adds whatever the batch, so a row's result does not depend on the rows computed
with it: plain decoding, a verification and any batch composition give bit-identical logits for a sequence.

The quantized_self drafter's 4-bit weights (`pack_q4`, `linear_q4`, and 4-bit layers in `decode_layers`) read 5 bits
a weight with int8 activations per group of 32, each group's sum an exact integer (`vpmaddubsw`): SmolLM2's stack
with its lm_head at one row in 6.0-6.5 ms where float32 takes 23-27 (see the comment above `XQ` in the source).
"""

from __future__ import annotations

from typing import Any

import torch

from . import cpu_kernels

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <algorithm>
#include <vector>

static inline const float* P(const torch::Tensor& t) { return t.data_ptr<float>(); }
static inline float* PM(torch::Tensor& t) { return t.data_ptr<float>(); }

// Far positions' softmax weights underflow to denormals, which cost a microcode assist per operation: flush them
// (FTZ and DAZ) for the kernels' duration, restoring the caller's mode.
struct FlushDenormals {
  unsigned int saved;
  FlushDenormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
};

static inline float hsum8(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}
static inline __m256 exp8(__m256 x) {
  // e^x = 2^n e^r, n = round(x / ln 2) in [-126, 127] (so 2^n is a normal float built from its exponent bits),
  // |r| <= ln 2 / 2 (Cody-Waite split of ln 2), e^r by its degree-6 Taylor polynomial (relative error < 2e-7)
  x = _mm256_max_ps(_mm256_min_ps(x, _mm256_set1_ps(88.0f)), _mm256_set1_ps(-87.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504089f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693145751953125f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(1.428606765330187e-06f), r);
  __m256 p = _mm256_set1_ps(1.f / 720);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 120));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 24));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f / 6));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(0.5f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.f));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}
static inline float exp1(float x) { return _mm256_cvtss_f32(exp8(_mm256_set1_ps(x))); }  // tails as the body

// Weights packed once (`pack_f32`): [ceil(N/8)][K][8]. A tile of MB rows x 2 column blocks keeps 2 MB accumulators
// in registers (16 ymm: up to 12 accumulators, 2 weights, one broadcast) over inputs k0..k1, starting from zero or
// from the partial sums in Y. Every output is the same sequence of FMAs over k whatever MB or M (a partial sum
// stored and reloaded is exact), so a row's result does not depend on the rows computed with it.
template <int MB>
static void tile(const float* X, const float* Wp, float* Y, int64_t m0, int64_t j0, int64_t nb, int64_t k0, int64_t k1,
                 int64_t K, int64_t N) {
  // GCC keeps the accumulators in registers only with the m loops fully unrolled, and the weight pair only when
  // told (it would reload the weight from memory in each of the 2 MB FMAs)
  __m256 acc0[MB], acc1[MB];
  const float* w0 = Wp + j0 * K * 8;
  const float* w1 = nb > 1 ? w0 + K * 8 : w0;  // a lone last block computes it twice and stores it once
  const int64_t n0 = j0 * 8, n1 = n0 + 8;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  const __m256i mask0 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)std::min<int64_t>(8, N - n0)), lane);
  const __m256i mask1 = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)std::max<int64_t>(0, std::min<int64_t>(8, N - n1))), lane);
  _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) {
    float* y = Y + (m0 + m) * N;
    acc0[m] = k0 ? _mm256_maskload_ps(y + n0, mask0) : _mm256_setzero_ps();
    acc1[m] = k0 && nb > 1 ? _mm256_maskload_ps(y + n1, mask1) : _mm256_setzero_ps();
  }
  const float* xr[MB];
  _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) xr[m] = X + (m0 + m) * K;
  for (int64_t k = k0; k < k1; ++k) {
    if ((k & 1) == 0) {  // one prefetch per 64-byte line of each stream, 4 KB ahead
      // Past the end of its block a stream's prefetch runs on into the block that stream reads next (the next
      // pair's, one block further on): else each pair's second block starts cold, and SmolLM2's blocks are 18 KB.
      // Measured: 7-13% off SmolLM2's 30 layers of matmuls at one row alone, within the noise of a whole engine step.
      // (Also tried: the weights on 2 MiB pages, ~9% off the matmuls alone, none visible in the step: not kept.)
      const int64_t ahead = k * 8 + 4096, next = ahead < K * 8 ? ahead : ahead + K * 8;
      _mm_prefetch((const char*)(w0 + next), _MM_HINT_T0);
      _mm_prefetch((const char*)(w1 + next), _MM_HINT_T0);
    }
    __m256 a = _mm256_loadu_ps(w0 + k * 8), b = _mm256_loadu_ps(w1 + k * 8);
    asm("" : "+x"(a), "+x"(b));
    _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) {
      const __m256 xb = _mm256_broadcast_ss(xr[m] + k);
      acc0[m] = _mm256_fmadd_ps(xb, a, acc0[m]);
      acc1[m] = _mm256_fmadd_ps(xb, b, acc1[m]);
    }
  }
  _Pragma("GCC unroll 8") for (int m = 0; m < MB; ++m) {
    float* y = Y + (m0 + m) * N;
    _mm256_maskstore_ps(y + n0, mask0, acc0[m]);
    if (nb > 1) _mm256_maskstore_ps(y + n1, mask1, acc1[m]);
  }
}

// Y[M, N] = X[M, K] W[N, K]^T (+ bias), GEMM-style: for each pair of column blocks and each slice of KC inputs (a
// 16 KB weight panel, which stays in L1), every chunk of up to 6 rows in turn. With one chunk (up to 6 rows) the
// weights stream once from memory at the read rate; further chunks re-read the panel from L1, so the FMA units,
// not the L3, bound many rows. KC is fixed, so the k order of every output is the same whatever M.
static void matmul(const float* X, const float* Wp, const float* bias, float* Y, int64_t M, int64_t K, int64_t N) {
  constexpr int64_t KC = 256;
  const int64_t blocks = (N + 7) / 8;
  at::parallel_for(0, (blocks + 1) / 2, 1, [&](int64_t p0, int64_t p1) {
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t j = p * 2, nb = std::min<int64_t>(2, blocks - j);
      for (int64_t k0 = 0; k0 < K; k0 += KC) {
        const int64_t k1 = std::min(K, k0 + KC);
        for (int64_t m0 = 0; m0 < M; m0 += 6) {
          switch (std::min<int64_t>(6, M - m0)) {
            case 6: tile<6>(X, Wp, Y, m0, j, nb, k0, k1, K, N); break;
            case 5: tile<5>(X, Wp, Y, m0, j, nb, k0, k1, K, N); break;
            case 4: tile<4>(X, Wp, Y, m0, j, nb, k0, k1, K, N); break;
            case 3: tile<3>(X, Wp, Y, m0, j, nb, k0, k1, K, N); break;
            case 2: tile<2>(X, Wp, Y, m0, j, nb, k0, k1, K, N); break;
            default: tile<1>(X, Wp, Y, m0, j, nb, k0, k1, K, N); break;
          }
        }
      }
    }
  });
  if (bias)
    for (int64_t m = 0; m < M; ++m) for (int64_t n = 0; n < N; ++n) Y[m * N + n] += bias[n];
}

// x [..., K] as a contiguous [M, K] matrix, and the output [..., N] the linear functions fill
static std::pair<torch::Tensor, torch::Tensor> rows_and_output(const torch::Tensor& x, int64_t N) {
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  return {x.reshape({-1, x.size(-1)}).contiguous(), torch::empty(sizes, x.options())};
}

torch::Tensor linear(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t N) {
  // w: packed by `pack_f32` from an [N, K] weight
  auto [x2, y] = rows_and_output(x, N);
  FlushDenormals ftz;
  matmul(P(x2), P(w), bias ? P(*bias) : nullptr, PM(y), x2.size(0), x2.size(1), N);
  return y;
}

// ---- 4-bit weights (the quantized_self drafter) ---------------------------------------------------------------
// w = scale_g * q + min_g, q in 0..15, per group g of 32 inputs (GGUF Q4_1). Layout (`pack_q4`): blocks of 8 output
// columns; per block and group, each column's 32 codes in 16 bytes (byte j = q[32g + j] | q[32g + 16 + j] << 4),
// and the block's bfloat16 scales and mins [blocks, G, 8]: 5 bits a weight, under a sixth of float32's bytes.
// Activations are quantized to int8 per group of 32 (scale max|x| / 127, as llama.cpp's Q8_1 beside Q4_1):
//   y = sum_g S_g (scale_g xscale_g) + min_g xsum_g,   S_g = sum_{k in g} q_k x8_k,
// where S_g is an exact integer (`vpmaddubsw`: 32 unsigned codes times 32 signed activations into 16 pair sums, no
// saturation: two of them added stay below 4 x 15 x 127 < 2^15; then `vpmaddwd` by ones), folded into each column's
// lane in the order of g: a row's result is the same bits whatever rows it is computed with. Two columns' codes load
// as one vector and stay bytes: about 60% of the instructions of int16 activations (`vpmaddwd` over codes widened to
// 16 bits), which bounded this kernel. Measured on an AVX2-only EPYC, one thread, SmolLM2's 30 layers and lm_head:
// 6.0-6.5 / 6.9-7.2 / 46-49 ms at 1 / 2 / 16 rows with int8 and the prefetch below, 9.2-12.6 / 11.8-13.0 / 86 with
// int16 (84 MB of weights: 6 ms is 14 GB/s, near the 16-17 GB/s one thread streams). What int8 costs: SmolLM2's
// expected acceptance at T=1 on its own sampled text, 0.878 with int16 (the same as unrounded activations) against
// 0.861 with int8 per 32 (0.868 per 16, 0.874 per 8); per-tensor int8 (torch.ao's dynamic quantization) cost 0.93 ->
// 0.79. At batch 1 the drafter's token went from 0.28 to 0.18 plain steps and speculation from 1.7x to 2.0x plain
// decoding. (Also tried: float32 FMAs over codes unpacked once per block for many rows — 2-4x slower than integer
// sums even at 64 rows.) A drafter need not be exact: the rejection sampler uses the distribution it drafted from.
struct XQ {
  std::vector<int8_t> q;      // [M, K]
  std::vector<float> scale;   // [M, G]
  std::vector<float> sum;     // [M, G]
};

static void quantize_x(const float* X, int64_t M, int64_t K, XQ& out) {
  const int64_t G = K / 32;
  out.q.resize(M * K); out.scale.resize(M * G); out.sum.resize(M * G);
  const __m256 abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFFFFFF));
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);  // undoes the packs' lane interleaving
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const float* x = X + m * K + g * 32;
      __m256 v[4], mx = _mm256_setzero_ps(), sm = _mm256_setzero_ps();
      for (int i = 0; i < 4; ++i) {
        v[i] = _mm256_loadu_ps(x + 8 * i);
        mx = _mm256_max_ps(mx, _mm256_and_ps(v[i], abs_mask));
        sm = _mm256_add_ps(sm, v[i]);
      }
      __m128 h = _mm_max_ps(_mm256_castps256_ps128(mx), _mm256_extractf128_ps(mx, 1));
      h = _mm_max_ps(h, _mm_movehl_ps(h, h));
      const float amax = _mm_cvtss_f32(_mm_max_ss(h, _mm_movehdup_ps(h)));
      const __m256 inv = _mm256_set1_ps(amax > 0.f ? 127.f / amax : 0.f);
      __m256i c[4];
      for (int i = 0; i < 4; ++i) c[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], inv));
      const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(c[0], c[1]), _mm256_packs_epi32(c[2], c[3]));
      _mm256_storeu_si256((__m256i*)(out.q.data() + m * K + g * 32), _mm256_permutevar8x32_epi32(bytes, order));
      out.scale[m * G + g] = amax > 0.f ? amax / 127.f : 0.f;
      out.sum[m * G + g] = hsum8(sm);
    }
}

static inline __m256 load_bf16x8(const uint16_t* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i*)p)), 16));
}

// acc += S_g * (scale_g * xscale_g); acc += min_g * xsum_g
static inline __m256 fold_group(__m256 acc, __m256 sums, const uint16_t* S, const uint16_t* Mn, float xs, float xsum) {
  acc = _mm256_fmadd_ps(sums, _mm256_mul_ps(load_bf16x8(S), _mm256_set1_ps(xs)), acc);
  return _mm256_fmadd_ps(load_bf16x8(Mn), _mm256_set1_ps(xsum), acc);
}

// One block of 8 columns for MB rows. Per group: columns c, c+1 load as one vector (c's 16 bytes in the low lane),
// whose low nibbles are both columns' codes 0..15 and high nibbles their codes 16..31, against each row's
// activations 0..15 / 16..31 broadcast to both lanes; three horizontal adds leave the 8 columns' exact sums in the
// lane order 0 2 4 6 1 3 5 7, which one permute puts back before the fold.
template <int MB>
static void block_q4(const XQ& xq, int64_t m0, const uint8_t* W, const uint16_t* S, const uint16_t* Mn, int64_t G,
                     int64_t K, __m256 (&acc)[MB]) {
  const __m256i lo = _mm256_set1_epi8(0x0F), ones = _mm256_set1_epi16(1);
  const __m256i order = _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7);
  for (int r = 0; r < MB; ++r) acc[r] = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* w = W + g * 128;
    // a group's 128 bytes are two cache lines: ask for the lines 4 KB ahead (1.3x at one row, measured)
    _mm_prefetch((const char*)(w + 4096), _MM_HINT_T0);
    _mm_prefetch((const char*)(w + 4096 + 64), _MM_HINT_T0);
    __m256i xa[MB], xb[MB], d[MB][4];
    _Pragma("GCC unroll 2") for (int r = 0; r < MB; ++r) {
      const int8_t* x = xq.q.data() + (m0 + r) * K + g * 32;
      xa[r] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)x));
      xb[r] = _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i*)(x + 16)));
    }
    _Pragma("GCC unroll 4") for (int c = 0; c < 4; ++c) {
      const __m256i p = _mm256_loadu_si256((const __m256i*)(w + c * 32));
      const __m256i a = _mm256_and_si256(p, lo), b = _mm256_and_si256(_mm256_srli_epi16(p, 4), lo);
      _Pragma("GCC unroll 2") for (int r = 0; r < MB; ++r)
        d[r][c] = _mm256_madd_epi16(_mm256_add_epi16(_mm256_maddubs_epi16(a, xa[r]), _mm256_maddubs_epi16(b, xb[r])),
                                    ones);
    }
    _Pragma("GCC unroll 2") for (int r = 0; r < MB; ++r) {
      const __m256i s = _mm256_hadd_epi32(_mm256_hadd_epi32(d[r][0], d[r][1]), _mm256_hadd_epi32(d[r][2], d[r][3]));
      acc[r] = fold_group(acc[r], _mm256_cvtepi32_ps(_mm256_permutevar8x32_epi32(s, order)), S + g * 8, Mn + g * 8,
                          xq.scale[(m0 + r) * G + g], xq.sum[(m0 + r) * G + g]);
    }
  }
}

// Y[M, N] = X[M, K] W^T for 4-bit W, by blocks of 8 columns, pairs of rows sharing each group's unpacked codes.
static void matmul_q4(const XQ& xq, int64_t M, const uint8_t* Wq, const uint16_t* S, const uint16_t* Mn, float* Y,
                      int64_t K, int64_t N) {
  const int64_t G = K / 32, blocks = (N + 7) / 8;
  const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  at::parallel_for(0, blocks, 8, [&](int64_t j0, int64_t j1) {
    for (int64_t j = j0; j < j1; ++j) {
      const uint8_t* W = Wq + j * G * 128;
      const uint16_t* s = S + j * G * 8;
      const uint16_t* mn = Mn + j * G * 8;
      const __m256i mask = _mm256_cmpgt_epi32(_mm256_set1_epi32((int)std::min<int64_t>(8, N - j * 8)), lane);
      for (int64_t m0 = 0; m0 < M; m0 += 2) {
        if (M - m0 >= 2) {
          __m256 acc[2];
          block_q4<2>(xq, m0, W, s, mn, G, K, acc);
          for (int r = 0; r < 2; ++r) _mm256_maskstore_ps(Y + (m0 + r) * N + j * 8, mask, acc[r]);
        } else {
          __m256 acc[1];
          block_q4<1>(xq, m0, W, s, mn, G, K, acc);
          _mm256_maskstore_ps(Y + m0 * N + j * 8, mask, acc[0]);
        }
      }
    }
  });
}

std::vector<torch::Tensor> pack_q4(torch::Tensor q, torch::Tensor scale, torch::Tensor mn) {
  // q int [N, K] in 0..15 (K a multiple of 32); scale, mn float [N, K/32] -> packed uint8 [blocks, G, 8, 16] and
  // bf16 scale, min [blocks, G, 8] (columns past N: codes, scale and min 0)
  auto qi = q.to(torch::kUInt8).contiguous();
  const int64_t N = qi.size(0), K = qi.size(1), G = K / 32, blocks = (N + 7) / 8;
  TORCH_CHECK(K % 32 == 0, "pack_q4: the number of inputs must be a multiple of 32");
  auto out = torch::zeros({blocks, G, 8, 16}, torch::TensorOptions().dtype(torch::kUInt8));
  const uint8_t* src = qi.data_ptr<uint8_t>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n)
    for (int64_t g = 0; g < G; ++g)
      for (int j = 0; j < 16; ++j)
        dst[(((n / 8) * G + g) * 8 + n % 8) * 16 + j] = src[n * K + g * 32 + j] | (src[n * K + g * 32 + 16 + j] << 4);
  auto lay = [&](torch::Tensor t) {  // [N, G] -> [blocks, G, 8]
    auto f = torch::zeros({blocks * 8, G}, torch::TensorOptions().dtype(torch::kFloat32));
    f.narrow(0, 0, N).copy_(t.to(torch::kFloat32));
    return f.view({blocks, 8, G}).transpose(1, 2).contiguous().to(torch::kBFloat16);
  };
  return {out, lay(scale), lay(mn)};
}

static void linear_q4_into(const float* x, const torch::Tensor& packed, const torch::Tensor& scale,
                           const torch::Tensor& mn, const float* bias, float* y, int64_t M, int64_t K, int64_t N) {
  XQ xq;
  quantize_x(x, M, K, xq);
  matmul_q4(xq, M, packed.data_ptr<uint8_t>(), (const uint16_t*)scale.data_ptr(), (const uint16_t*)mn.data_ptr(),
            y, K, N);
  if (bias)
    for (int64_t m = 0; m < M; ++m) for (int64_t n = 0; n < N; ++n) y[m * N + n] += bias[n];
}

torch::Tensor linear_q4(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, torch::Tensor mn,
                        c10::optional<torch::Tensor> bias, int64_t N) {
  auto [x2, y] = rows_and_output(x, N);
  FlushDenormals ftz;
  linear_q4_into(P(x2), packed, scale, mn, bias ? P(*bias) : nullptr, PM(y), x2.size(0), x2.size(1), N);
  return y;
}

// out = x * rsqrt(mean(x^2) + eps) * w
static void rms_norm(const float* x, const float* w, float* out, int64_t H, double eps) {
  __m256 acc = _mm256_setzero_ps();
  int64_t i = 0;
  for (; i + 8 <= H; i += 8) { const __m256 v = _mm256_loadu_ps(x + i); acc = _mm256_fmadd_ps(v, v, acc); }
  float ss = hsum8(acc);
  for (int64_t j = i; j < H; ++j) ss += x[j] * x[j];
  const float r = 1.0f / std::sqrt(ss / H + (float)eps);
  const __m256 rv = _mm256_set1_ps(r);
  for (i = 0; i + 8 <= H; i += 8)
    _mm256_storeu_ps(out + i, _mm256_mul_ps(_mm256_mul_ps(_mm256_loadu_ps(x + i), rv), _mm256_loadu_ps(w + i)));
  for (; i < H; ++i) out[i] = x[i] * r * w[i];
}

// softmax(q K[0..len)^T * scaling) V[0..len) for one query head: the one attention routine of the fused stack and
// of `attend` (the per-op path's few-token forwards), so a plain step and a verification compute it identically.
static void attend_row(const float* q, const float* K, const float* V, int64_t len, int64_t D, float scaling,
                       float* scores, float* out) {
  float qf[512], o[512];
  for (int64_t d = 0; d < D; ++d) { qf[d] = q[d] * scaling; o[d] = 0.f; }
  const bool vec = D % 8 == 0;
  float mx = -INFINITY;
  for (int64_t j = 0; j < len; ++j) {
    const float* kj = K + j * D;
    float s = 0.f;
    if (vec) {
      __m256 acc = _mm256_setzero_ps();
      for (int64_t d = 0; d < D; d += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(qf + d), _mm256_loadu_ps(kj + d), acc);
      s = hsum8(acc);
    } else {
      for (int64_t d = 0; d < D; ++d) s += qf[d] * kj[d];
    }
    scores[j] = s;
    mx = std::max(mx, s);
  }
  float den = 0.f;
  {
    const __m256 mv = _mm256_set1_ps(mx);
    __m256 dv = _mm256_setzero_ps();
    int64_t j = 0;
    for (; j + 8 <= len; j += 8) {
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(scores + j), mv));
      _mm256_storeu_ps(scores + j, e);
      dv = _mm256_add_ps(dv, e);
    }
    den = hsum8(dv);
    for (; j < len; ++j) { scores[j] = exp1(scores[j] - mx); den += scores[j]; }
  }
  for (int64_t j = 0; j < len; ++j) {
    const float p = scores[j] / den;
    const float* vj = V + j * D;
    if (vec) {
      const __m256 pv = _mm256_set1_ps(p);
      for (int64_t d = 0; d < D; d += 8)
        _mm256_storeu_ps(o + d, _mm256_fmadd_ps(pv, _mm256_loadu_ps(vj + d), _mm256_loadu_ps(o + d)));
    } else {
      for (int64_t d = 0; d < D; ++d) o[d] += p * vj[d];
    }
  }
  std::memcpy(out, o, D * sizeof(float));
}

// q [B, nh, T, D] (any strides), caches [slots, nkv, max_len, D]: row b, token t attends to keys
// 0..min(positions[b, t], kv_len - 1) of slot slot0 + b. Returns o [B, nh, T, D].
torch::Tensor attend(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, int64_t slot0, torch::Tensor positions,
                     int64_t kv_len, double scaling) {
  auto qc = q.contiguous();
  auto pos = positions.to(torch::kInt64).contiguous();
  const int64_t B = qc.size(0), nh = qc.size(1), T = qc.size(2), D = qc.size(3);
  const int64_t nkv = kc.size(1), max_len = kc.size(2), group = nh / nkv;
  auto out = torch::empty({B, nh, T, D}, qc.options());
  const float* Q = P(qc);
  const float* Kp = P(kc);
  const float* Vp = P(vc);
  float* O = PM(out);
  const int64_t* ps = pos.data_ptr<int64_t>();
  at::parallel_for(0, B * nh, 1, [&](int64_t i0, int64_t i1) {
    FlushDenormals ftz;  // per thread: the mode is a thread's own
    std::vector<float> scores(kv_len);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / nh, h = i % nh, g = h / group;
      const float* K = Kp + ((slot0 + b) * nkv + g) * max_len * D;
      const float* V = Vp + ((slot0 + b) * nkv + g) * max_len * D;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t len = std::min(ps[b * T + t], kv_len - 1) + 1;
        attend_row(Q + (i * T + t) * D, K, V, len, D, (float)scaling, scores.data(), O + (i * T + t) * D);
      }
    }
  });
  return out;
}

// One weight of the fused stack: float32 packed by `pack_f32`, or 4-bit by `pack_q4` (`sz` = stack(scale, min)).
static void apply(const torch::Tensor& w, const c10::optional<torch::Tensor>& sz,
                  const c10::optional<torch::Tensor>& bias, const float* x, float* y, int64_t M, int64_t K, int64_t N) {
  if (sz) linear_q4_into(x, w, (*sz)[0], (*sz)[1], bias ? P(*bias) : nullptr, y, M, K, N);
  else matmul(x, P(w), bias ? P(*bias) : nullptr, y, M, K, N);
}

// The signature of the bfloat16 `decode_layers` (the runner calls either alike).
void decode_layers(torch::Tensor h, std::vector<torch::Tensor> in_norm, std::vector<torch::Tensor> post_norm,
                   std::vector<torch::Tensor> qkv_w, std::vector<c10::optional<torch::Tensor>> qkv_sz,
                   std::vector<c10::optional<torch::Tensor>> qkv_b,
                   std::vector<torch::Tensor> o_w, std::vector<c10::optional<torch::Tensor>> o_sz,
                   std::vector<c10::optional<torch::Tensor>> o_b,
                   std::vector<torch::Tensor> gu_w, std::vector<c10::optional<torch::Tensor>> gu_sz,
                   std::vector<c10::optional<torch::Tensor>> gu_b,
                   std::vector<torch::Tensor> down_w, std::vector<c10::optional<torch::Tensor>> down_sz,
                   std::vector<c10::optional<torch::Tensor>> down_b,
                   std::vector<torch::Tensor> k_cache, std::vector<torch::Tensor> v_cache, int64_t slot0,
                   std::vector<int64_t> starts, torch::Tensor cos, torch::Tensor sin, int64_t nh, int64_t nkv,
                   int64_t inter, double eps, double scaling) {
  // h [B * S, H]: for each of B sequences (cache slots slot0 + b), S consecutive tokens at positions starts[b] ..
  // starts[b] + S - 1 (a decode step, S = 1, or the verification of S - 1 drafts); cos/sin [B * S, D].
  FlushDenormals ftz;
  const int64_t B = (int64_t)starts.size(), T = h.size(0), S = T / B, H = h.size(1), L = (int64_t)qkv_w.size();
  const int64_t D = cos.size(1), half = D / 2;
  const int64_t qs = nh * D, kvs = nkv * D, I = inter, group = nh / nkv, W3 = qs + 2 * kvs;
  const int64_t max_len = k_cache[0].size(2);
  float* hp = PM(h);
  const float* cp = P(cos);
  const float* sp = P(sin);
  const int64_t longest = *std::max_element(starts.begin(), starts.end()) + S;
  std::vector<float> a(T * H), qkv(T * W3), att(T * qs), act(T * I), y(T * std::max(2 * I, H)), scores(longest);
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t t = 0; t < T; ++t) rms_norm(hp + t * H, P(in_norm[l]), a.data() + t * H, H, eps);
    apply(qkv_w[l], qkv_sz[l], qkv_b[l], a.data(), qkv.data(), T, H, W3);
    float* kc = PM(k_cache[l]);
    float* vc = PM(v_cache[l]);
    for (int64_t t = 0; t < T; ++t) {
      // rotary on q and k heads: x * cos + rot(x) * sin, rot(x) = (-x2, x1)
      for (int64_t hd = 0; hd < nh + nkv; ++hd) {
        float* x = qkv.data() + t * W3 + hd * D;
        const float* c = cp + t * D;
        const float* s = sp + t * D;
        int64_t d = 0;
        for (; half % 8 == 0 && d < half; d += 8) {
          const __m256 x1 = _mm256_loadu_ps(x + d), x2 = _mm256_loadu_ps(x + half + d);
          _mm256_storeu_ps(x + d, _mm256_fnmadd_ps(x2, _mm256_loadu_ps(s + d), _mm256_mul_ps(x1, _mm256_loadu_ps(c + d))));
          _mm256_storeu_ps(x + half + d, _mm256_fmadd_ps(x1, _mm256_loadu_ps(s + half + d),
                                                         _mm256_mul_ps(x2, _mm256_loadu_ps(c + half + d))));
        }
        for (; d < half; ++d) {
          const float x1 = x[d], x2 = x[half + d];
          x[d] = x1 * c[d] - x2 * s[d];
          x[half + d] = x2 * c[half + d] + x1 * s[half + d];
        }
      }
      const int64_t slot = slot0 + t / S, pos = starts[t / S] + t % S;
      for (int64_t g = 0; g < nkv; ++g) {
        const int64_t off = ((slot * nkv + g) * max_len + pos) * D;
        std::memcpy(kc + off, qkv.data() + t * W3 + qs + g * D, D * sizeof(float));
        std::memcpy(vc + off, qkv.data() + t * W3 + qs + kvs + g * D, D * sizeof(float));
      }
    }
    for (int64_t t = 0; t < T; ++t) {
      const int64_t slot = slot0 + t / S, len = starts[t / S] + t % S + 1;
      for (int64_t hd = 0; hd < nh; ++hd) {
        const int64_t g = hd / group;
        attend_row(qkv.data() + t * W3 + hd * D, kc + (slot * nkv + g) * max_len * D,
                   vc + (slot * nkv + g) * max_len * D, len, D, (float)scaling, scores.data(),
                   att.data() + t * qs + hd * D);
      }
    }
    apply(o_w[l], o_sz[l], o_b[l], att.data(), y.data(), T, qs, H);
    for (int64_t i = 0; i < T * H; ++i) hp[i] += y[i];
    for (int64_t t = 0; t < T; ++t) rms_norm(hp + t * H, P(post_norm[l]), a.data() + t * H, H, eps);
    apply(gu_w[l], gu_sz[l], gu_b[l], a.data(), y.data(), T, H, 2 * I);
    for (int64_t t = 0; t < T; ++t) {  // SiLU(gate) * up
      const float* gy = y.data() + t * 2 * I;
      const float* uy = gy + I;
      float* at = act.data() + t * I;
      int64_t i = 0;
      for (; i + 8 <= I; i += 8) {
        const __m256 g = _mm256_loadu_ps(gy + i);
        const __m256 e = exp8(_mm256_sub_ps(_mm256_setzero_ps(), g));
        _mm256_storeu_ps(at + i, _mm256_mul_ps(_mm256_div_ps(g, _mm256_add_ps(_mm256_set1_ps(1.f), e)),
                                               _mm256_loadu_ps(uy + i)));
      }
      for (; i < I; ++i) at[i] = gy[i] / (1.f + exp1(-gy[i])) * uy[i];
    }
    apply(down_w[l], down_sz[l], down_b[l], act.data(), y.data(), T, I, H);
    for (int64_t i = 0; i < T * H; ++i) hp[i] += y[i];
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear", &linear);
  m.def("decode_layers", &decode_layers);
  m.def("attend", &attend);
  m.def("pack_q4", &pack_q4);
  m.def("linear_q4", &linear_q4);
}
"""


def _cpu_has_avx2_fma() -> bool:
    flags = cpu_kernels.cpu_flags().split()
    return "avx2" in flags and "fma" in flags


def buildable() -> bool:
    """Where the kernels must build: the CPU has AVX2 and FMA and the toolchain torch needs is on PATH."""
    return _cpu_has_avx2_fma() and cpu_kernels.toolchain()


def load() -> Any:
    """The compiled module, or None where it cannot be built here (then the ATen path runs)."""
    return cpu_kernels.build_once("specrl_decode_kernels_f32", _SOURCE, _cpu_has_avx2_fma)


def available() -> bool:
    return load() is not None


def pack_f32(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] float32 -> the kernels' layout [ceil(N/8), K, 8] (8 output columns' weights for one input side by
    side; rows past N are zero)."""
    n, k = weight.shape
    w = weight if n % 8 == 0 else torch.cat([weight, weight.new_zeros((-n) % 8, k)])
    return w.view(-1, 8, k).transpose(1, 2).contiguous()


def fits(weight: torch.Tensor) -> bool:
    """The kernels' layout: a contiguous CPU float32 matrix (any number of inputs and outputs)."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32 and weight.dim() == 2 and weight.is_contiguous()
