"""Decode kernels for CPUs with AVX512-BF16, compiled once per machine with the system C++ compiler.

Why: at batch 1 a decode step is a chain of matrix-vector products over ~270 MB of bfloat16 weights (SmolLM2) plus
~15 small elementwise ops per layer. Measured here (one thread, weights streamed from memory): oneDNN's packed bf16
matmul reads weights at 9-12 GB/s for one row where a plain `sum` streams 14-16 GB/s, and ATen's per-op dispatch
adds ~9 ms per step (30 layers x ~12 ops). `linear_bf16` multiplies a few rows by a weight packed once into
`vdpbf16ps`'s pair layout (`pack_bf16`; fp32 accumulation in vector lanes, round-to-nearest-even output like
oneDNN's), tiles of up to 6 rows x 64 columns in registers, so up to 6 rows read the weights once as one sequential
stream: 90% of a streaming `sum` at one row on SmolLM2 (Zen 4 EPYC), and from ~4 rows on the chip's bf16 dot-product
throughput bounds it (~36 GMAC/s a core on the Xeon measured here). `decode_layers` runs a whole stack of Llama
layers for a few tokens of each of a few sequences in one call (norms, fused qkv, rotary, K/V cache write, GQA
attention, SiLU MLP), rounding to bfloat16 at the same points as the ATen path; its elementwise work (roundings,
norms, rotary, SiLU, softmax) runs 16 lanes at a time with a vector exp (scalar `std::exp` and bf16 roundings cost
~20 µs per row and layer at 512 wide, 12-15% of a forward of the 27M benchmark model at every batch size). Every row
is computed exactly as it would be alone, so plain decoding, the verification of drafts and any batch composition
give bit-identical logits for a sequence.

Built lazily on first use with `torch.utils.cpp_extension.load_inline` (about 30 s, cached under `kernels/` in
specrl's cache, see `build_folder`); where there is no compiler, no AVX512-BF16, or the build fails, `available()`
is False and the engine keeps its ATen/oneDNN path. The kernels are exercised against that path in the engine tests.
On a CPU with AMX (and a kernel that grants it) the bf16 matmuls run on AMX tiles instead (`use_amx`), which keeps
forwards of up to 16 rows at the cost of one.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import shutil
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from ..paths import cache_dir

# Blocks of 16 output columns per packed group (`pack_bf16`); the kernels' source gets the same number.
GROUP = 4

_SOURCE = r"""
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <cmath>
#include <cstring>
#include <algorithm>
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

// Denormal floats cost a microcode assist per operation on these cores. At long contexts the weights of far
// positions underflow to denormals in the softmax and in p * V: a 3-token verification at 101 tokens of context
// took 4.4 ms instead of 2.5. The kernels flush them (FTZ and DAZ) for their duration, restoring the caller's mode.
struct FlushDenormals {
  unsigned int saved;
  FlushDenormals() : saved(_mm_getcsr()) { _mm_setcsr(saved | 0x8040); }
  ~FlushDenormals() { _mm_setcsr(saved); }
};

// 16 lanes at a time: the same rounding as `to_bf16` bit for bit (so a loop may split anywhere between vector
// and scalar code), and an exp accurate to ~1 ulp. Elementwise: a lane's result never depends on its neighbours.
static inline __m512i rne16(__m512 v) {  // bf16 bits in the low half of each 32-bit lane
  const __m512i u = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(u, _mm512_add_epi32(_mm512_set1_epi32(0x7FFF), lsb)), 16);
  const __mmask16 nan = _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q);
  return _mm512_mask_mov_epi32(r, nan, _mm512_or_si512(_mm512_srli_epi32(u, 16), _mm512_set1_epi32(0x40)));
}
static inline __m512 rb16(__m512 v) { return _mm512_castsi512_ps(_mm512_slli_epi32(rne16(v), 16)); }
static inline void store_bf16(bf16* p, __m512 v) { _mm256_storeu_si256((__m256i*)p, _mm512_cvtepi32_epi16(rne16(v))); }
static inline __m512 load16(const bf16* p) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256((const __m256i*)p)), 16));
}
static inline __m512 exp16(__m512 x) {
  // e^x = 2^n e^r, n = round(x / ln 2), |r| <= ln 2 / 2 (Cody-Waite split of ln 2), e^r by its degree-6 Taylor
  // polynomial (relative error < 2e-7 on that interval)
  x = _mm512_max_ps(_mm512_min_ps(x, _mm512_set1_ps(88.72f)), _mm512_set1_ps(-103.9f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504089f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187e-06f), r);
  __m512 p = _mm512_set1_ps(1.f / 720);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 120));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 24));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f / 6));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.f));
  return _mm512_scalef_ps(p, n);
}
static inline float exp1(float x) {  // exp16 on one value: scalar tails round exactly as the vector body
  return _mm512_cvtss_f32(exp16(_mm512_set1_ps(x)));
}
// y[i] = rb(y[i]) and friends over n values, vector body + scalar tail (bit-identical, see rne16)
static void round_f32(float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) _mm512_storeu_ps(y + i, rb16(_mm512_loadu_ps(y + i)));
  for (; i < n; ++i) y[i] = rb(y[i]);
}
static void to_bf16_n(const float* y, bf16* out, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store_bf16(out + i, _mm512_loadu_ps(y + i));
  for (; i < n; ++i) out[i] = to_bf16(y[i]);
}
// h = bf16(h + rb(y)): the residual add, rounded as the per-op path's bf16 add of a bf16 matmul output
static void residual_add(bf16* h, const float* y, int64_t n) {
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) store_bf16(h + i, _mm512_add_ps(load16(h + i), rb16(_mm512_loadu_ps(y + i))));
  for (; i < n; ++i) h[i] = to_bf16(from_bf16(h[i]) + rb(y[i]));
}

// bf16 weights for the kernels are packed once (`pack_bf16` in Python) in groups of GROUP blocks of 16 output
// columns: [ceil(blocks/GROUP)][K/2][GROUP][16][2] (the last group narrower). For one block and an input pair
// (k, k+1) the 16 columns' two weights are one 64-byte vector, which `vdpbf16ps` multiplies with the broadcast
// activation pair, so outputs accumulate in vector lanes (no horizontal sums); a group's GROUP vectors for one pair
// are adjacent, so a tile of GROUP blocks reads one sequential stream. Why one stream: one block per stream (eight
// streams a tile, software prefetch on each) read SmolLM2's weights at 71% of a streaming `sum` on the Zen 4 EPYC,
// one stream of four blocks without software prefetch at 90-92% at one and five rows (the hardware prefetcher
// follows one stream; the prefetch instructions only cost issue slots). A tile of MB rows x GROUP blocks keeps
// MB x GROUP accumulators in registers, and every output is the same sequence of pairwise products whatever MB or
// M: a row's result does not depend on the rows computed with it (a verification computes each token as a
// one-token step does; batched decoding is batch-invariant).
constexpr int GROUP = @GROUP@;

// Block j of a packed weight: its first vector and the distance between consecutive input pairs' vectors.
static inline const bf16* block_at(const bf16* Wp, int64_t j, int64_t blocks, int64_t K, int64_t* stride) {
  const int64_t g0 = j / GROUP * GROUP;
  *stride = std::min<int64_t>(GROUP, blocks - g0) * 32;
  return Wp + g0 * 16 * K + (j - g0) * 32;
}

// Software prefetch distance of the weight streams (`tile`, `q4_tile`), set per CPU by `prefetch_distance` in Python
// (0: none). Each tile reads its weights as one sequential run. On the Zen 5 EPYC the hardware prefetchers alone keep
// too few lines in flight (they stop at 4 KB pages): SmolLM2-shaped stacks of 120 matmuls streamed from memory (one
// thread, medians of 5 rounds), ms without -> with 8 KB ahead: bf16 at 5 / 12 rows 8.0-8.5 / 10.5-11.6 -> 6.1-6.4 /
// 8.8-9.3 (so a 5-token verification's matmuls cost what one token's do; one row 5.8-6.3 either way), 4-bit at 1 /
// 2 / 4 rows 2.3 / 3.4-3.5 / 4.6-4.8 -> 1.8-1.9 / 2.3-2.5 / 3.5-3.7; 4 KB ahead did less at 5 rows, 16 KB no better.
// On the Zen 4 EPYC the same prefetches slow the stream, except a one-row step's on weights not much larger than
// the L3 (see `prefetch_distance`): hence one distance for one-row tiles and one for the rest, set per model.
static int64_t prefetch_one_row = 8192, prefetch_rows = 8192;
static std::vector<int64_t> set_prefetch(int64_t one_row, int64_t rows) {
  prefetch_one_row = one_row;
  prefetch_rows = rows;
  return {prefetch_one_row, prefetch_rows};
}

template <int MB, int NB>
static void tile(const bf16* X, const bf16* Wp, float* Y, int64_t m0, int64_t j0, int64_t K, int64_t N) {
  const int64_t K2 = K / 2, blocks = (N + 15) / 16;
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m) for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  const bf16* xr[MB];
  for (int m = 0; m < MB; ++m) xr[m] = X + (m0 + m) * K;
  const bf16* wb[NB];
  int64_t stride[NB];
  for (int j = 0; j < NB; ++j) wb[j] = block_at(Wp, j0 + j, blocks, K, &stride[j]);
  // a narrower group's step is not one stream's lines
  const int64_t ahead = NB != GROUP ? 0 : MB == 1 ? prefetch_one_row : prefetch_rows;
  for (int64_t k2 = 0; k2 < K2; ++k2) {
    __m512bh w[NB];
    for (int j = 0; j < NB; ++j) w[j] = (__m512bh)_mm512_loadu_si512(wb[j] + k2 * stride[j]);
    if (ahead)  // a whole group's step is NB adjacent lines of one stream
      for (int line = 0; line < NB; ++line)
        _mm_prefetch(reinterpret_cast<const char*>(wb[0] + k2 * stride[0]) + ahead + line * 64, _MM_HINT_T0);
    for (int m = 0; m < MB; ++m) {
      int32_t pair;  // (x_2k2, x_2k2+1) as one 32-bit lane
      std::memcpy(&pair, xr[m] + 2 * k2, 4);
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(pair);
      for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_dpbf16_ps(acc[m][j], xb, w[j]);
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) {
      const int64_t n = (j0 + j) * 16;
      float* y = Y + (m0 + m) * N + n;
      if (n + 16 <= N) _mm512_storeu_ps(y, acc[m][j]);
      else _mm512_mask_storeu_ps(y, (__mmask16)((1u << (N - n)) - 1), acc[m][j]);
    }
}

// Rows m0..m0+MB against column blocks j_lo..j_hi (whole groups but the last): a whole group a tile (registers: MB x
// GROUP accumulators + GROUP weights, at most 6 x 4 + 4 + 1 of 32), the narrower last group a block at a time.
template <int MB>
static void row_chunk(const bf16* X, const bf16* Wp, float* Y, int64_t m0, int64_t j_lo, int64_t j_hi, int64_t K,
                      int64_t N) {
  int64_t j = j_lo;
  for (; j + GROUP <= j_hi; j += GROUP) tile<MB, GROUP>(X, Wp, Y, m0, j, K, N);
  for (; j < j_hi; ++j) tile<MB, 1>(X, Wp, Y, m0, j, K, N);
}

static inline void add_bias(float* Y, const bf16* bias, int64_t M, int64_t N) {
  if (bias)
    for (int64_t m = 0; m < M; ++m) for (int64_t n = 0; n < N; ++n) Y[m * N + n] += from_bf16(bias[n]);
}

// fp32 Y[M, N] = X[M, K] W[N, K]^T (+ bias) with W packed by `pack_bf16`, K even. Columns go in spans of 8 blocks
// (128 columns, two groups): all row chunks of 6 run over one span before the next, so with many rows a span's
// weights are re-read from L2, not memory, and up to 6 rows read them once.
// `tiled`: X is 64-byte aligned and readable up to a whole tile of 16 rows (`TileRows`), so AMX reads it in place.
// On AMX, rows go in pairs of 16-row tiles (`amx_tile2`), then one tile (`amx_tile`); full C tiles are stored in
// place. Against one tile at a time through a buffer, the bench model's forward over 16 sequences x 5 / 9 tokens
// took 17.7-18.1 / 26.6-28.2 ms instead of 20.5-21.9 / 33.5-35.5 (minimum of 30 each, processes of the two versions
// alternating, 4 and 3, one thread); one row and 16 x 1 token as before (5.6-6.3 ms both; 8.0-8.6 and 8.1-9.1).
static bool amx_matmul(const bf16* X, const bf16* Wp, float* Y, int64_t M, int64_t K, int64_t N, bool tiled);

static void matmul(const bf16* X, const bf16* Wp, const bf16* bias, float* Y, int64_t M, int64_t K, int64_t N,
                   bool tiled = false) {
  if (amx_matmul(X, Wp, Y, M, K, N, tiled)) { add_bias(Y, bias, M, N); return; }
  const int64_t blocks = (N + 15) / 16;
  at::parallel_for(0, (blocks + 7) / 8, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t j_lo = g * 8, j_hi = std::min<int64_t>(blocks, j_lo + 8);
      for (int64_t m0 = 0; m0 < M; m0 += 6) {
        switch (std::min<int64_t>(6, M - m0)) {
          case 6: row_chunk<6>(X, Wp, Y, m0, j_lo, j_hi, K, N); break;
          case 5: row_chunk<5>(X, Wp, Y, m0, j_lo, j_hi, K, N); break;
          case 4: row_chunk<4>(X, Wp, Y, m0, j_lo, j_hi, K, N); break;
          case 3: row_chunk<3>(X, Wp, Y, m0, j_lo, j_hi, K, N); break;
          case 2: row_chunk<2>(X, Wp, Y, m0, j_lo, j_hi, K, N); break;
          default: row_chunk<1>(X, Wp, Y, m0, j_lo, j_hi, K, N); break;
        }
      }
    }
  });
  add_bias(Y, bias, M, N);
}

// ---- AMX (Sapphire Rapids and later Xeons) --------------------------------------------------------------------
// `vdpbf16ps` tiles are bound by the core's dot-product throughput from ~4 rows: on a Xeon with AMX (one thread,
// medians of 15), the bench model's 8 layers of matmuls took 6.1 / 10.5 / 19.1 / 43.5 ms for 1 / 8 / 16 / 32 rows,
// and verifications of a few drafted tokens for a few sequences are exactly such forwards. An AMX tile multiply
// does 16 rows x 16 columns x 32 inputs in one instruction, and the packed weights are already its B operand (a
// block's 16 columns for 16 input pairs are 16 rows of 64 bytes at the group's stride), so up to 16 rows stream
// the weights once at memory speed: 5.8 / 7.1 / 7.8 / 12.2 ms (SmolLM2's 30 layers: 30.5 / 26.8 / 34.7 / 41.1 where
// `vdpbf16ps` took 29.7 / 40.1 / 74.3 / 129.4). Used for every row count where it runs, one row included (bound
// by memory there, as fast), so a row's result is the same sequence of tile products whatever the rows computed
// with it, and plain steps and verifications stay bit-identical. Rows are padded to whole tiles of 16 (the
// padding's products are never stored). The weights are prefetched AMX_AHEAD input steps ahead (each step a new
// 4 KB page of the group's stream, and the hardware prefetchers stop at page boundaries): without it a one-row step
// of the bench model took 13-14 ms instead of 6.5-7 in three processes of five (measured in turn, one thread), the
// same weights read at a third of the speed depending on where they landed; with it 6.4-8.4 in five of five
// (`vdpbf16ps`: 6.7-7.7).
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>

static bool amx_on = false;
constexpr int64_t AMX_AHEAD = 2;  // input steps of 32 (4 KB of a full group's weights each)

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Linux gives a process AMX's tile state only on request (ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); a kernel
// or hypervisor that refuses leaves the `vdpbf16ps` path.
static bool set_amx(bool on) {
  static const bool permitted = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  amx_on = on && permitted;
  return amx_on;
}

// Prefetch the weights AMX_AHEAD input steps ahead of step k (see above). Forced inline: GCC kept it a call, and
// one-row steps of the bench model then took 12-15 ms instead of 8-9 in two processes of three.
template <int NB>
__attribute__((always_inline)) static inline void amx_prefetch(const bf16* const* wb, const int64_t* stride,
                                                               int64_t k, int64_t K) {
  if (k + 32 * AMX_AHEAD >= K) return;
  for (int j = 0; j < NB; ++j) {
    const char* ahead = reinterpret_cast<const char*>(wb[j] + (k / 2 + 16 * AMX_AHEAD) * stride[j]);
    for (int r = 0; r < 16; ++r) _mm_prefetch(ahead + r * stride[j] * 2, _MM_HINT_T0);
  }
}

// C tile `T` (rows m0.., columns n0..n0+15) into Y: straight into place when all 16 rows and columns are real, else
// through `buf` (row stride `ld` floats), copying only the real ones.
#define AMX_STORE(T, m0, n0, M, N, Y, buf, ld)                                                                       \
  do {                                                                                                               \
    if ((m0) + 16 <= (M) && (n0) + 16 <= (N)) {                                                                      \
      _tile_stored(T, (Y) + (m0) * (N) + (n0), (N) * 4);                                                             \
    } else if ((m0) < (M) && (n0) < (N)) {                                                                           \
      _tile_stored(T, buf, (ld) * 4);                                                                                \
      for (int64_t r_ = 0; r_ < std::min<int64_t>(16, (M) - (m0)); ++r_)                                             \
        std::memcpy((Y) + ((m0) + r_) * (N) + (n0), (buf) + r_ * (ld),                                               \
                    std::min<int64_t>(16, (N) - (n0)) * sizeof(float));                                              \
    }                                                                                                                \
  } while (0)

// Rows m0..m0+15 of X (K inputs, whole 32s) x the NB blocks of one group from block j0: C tiles 0..NB-1, A tile 4, B
// tiles 5..7 (the fourth block reuses 5).
template <int NB>
static void amx_tile(const bf16* X, const bf16* Wp, float* Y, int64_t m0, int64_t M, int64_t j0, int64_t K,
                     int64_t N, float* buf) {
  const int64_t blocks = (N + 15) / 16;
  const bf16* wb[NB];
  int64_t stride[NB];
  for (int j = 0; j < NB; ++j) wb[j] = block_at(Wp, j0 + j, blocks, K, &stride[j]);
  _tile_zero(0);
  if constexpr (NB > 1) _tile_zero(1);
  if constexpr (NB > 2) _tile_zero(2);
  if constexpr (NB > 3) _tile_zero(3);
  const bf16* xa = X + m0 * K;
  for (int64_t k = 0; k < K; k += 32) {
    const int64_t k2 = k / 2;
    amx_prefetch<NB>(wb, stride, k, K);
    _tile_loadd(4, xa + k, K * 2);
    _tile_loadd(5, wb[0] + k2 * stride[0], stride[0] * 2);
    _tile_dpbf16ps(0, 4, 5);
    if constexpr (NB > 1) { _tile_loadd(6, wb[1] + k2 * stride[1], stride[1] * 2); _tile_dpbf16ps(1, 4, 6); }
    if constexpr (NB > 2) { _tile_loadd(7, wb[2] + k2 * stride[2], stride[2] * 2); _tile_dpbf16ps(2, 4, 7); }
    if constexpr (NB > 3) { _tile_loadd(5, wb[3] + k2 * stride[3], stride[3] * 2); _tile_dpbf16ps(3, 4, 5); }
  }
  const int64_t n0 = j0 * 16;
  AMX_STORE(0, m0, n0, M, N, Y, buf, 16);
  if constexpr (NB > 1) AMX_STORE(1, m0, n0 + 16, M, N, Y, buf, 16);
  if constexpr (NB > 2) AMX_STORE(2, m0, n0 + 32, M, N, Y, buf, 16);
  if constexpr (NB > 3) AMX_STORE(3, m0, n0 + 48, M, N, Y, buf, 16);
}

// Rows m0..m0+31 (A tiles 4 and 5) x NB <= 2 blocks from j0 (B tiles 6 and 7): C tiles 0 and 1 for the first 16
// rows, 2 and 3 for the next. Every tile loaded feeds two products, where `amx_tile` loads a weight tile for each
// one. Each row's product is the same sequence of tile products as in `amx_tile`, so its bits are too.
template <int NB>
static void amx_tile2(const bf16* X, const bf16* Wp, float* Y, int64_t m0, int64_t M, int64_t j0, int64_t K,
                      int64_t N, float* buf) {
  const int64_t blocks = (N + 15) / 16;
  const bf16* wb[NB];
  int64_t stride[NB];
  for (int j = 0; j < NB; ++j) wb[j] = block_at(Wp, j0 + j, blocks, K, &stride[j]);
  _tile_zero(0);
  _tile_zero(2);
  if constexpr (NB > 1) { _tile_zero(1); _tile_zero(3); }
  const bf16* xa = X + m0 * K;
  const bf16* xb = xa + 16 * K;
  for (int64_t k = 0; k < K; k += 32) {
    const int64_t k2 = k / 2;
    amx_prefetch<NB>(wb, stride, k, K);
    _tile_loadd(4, xa + k, K * 2);
    _tile_loadd(6, wb[0] + k2 * stride[0], stride[0] * 2);
    _tile_dpbf16ps(0, 4, 6);
    if constexpr (NB > 1) { _tile_loadd(7, wb[1] + k2 * stride[1], stride[1] * 2); _tile_dpbf16ps(1, 4, 7); }
    _tile_loadd(5, xb + k, K * 2);
    _tile_dpbf16ps(2, 5, 6);
    if constexpr (NB > 1) _tile_dpbf16ps(3, 5, 7);
  }
  const int64_t n0 = j0 * 16;
  AMX_STORE(0, m0, n0, M, N, Y, buf, 16);
  AMX_STORE(2, m0 + 16, n0, M, N, Y, buf, 16);
  if constexpr (NB > 1) {
    AMX_STORE(1, m0, n0 + 16, M, N, Y, buf, 16);
    AMX_STORE(3, m0 + 16, n0 + 16, M, N, Y, buf, 16);
  }
}

static bool amx_matmul(const bf16* X, const bf16* Wp, float* Y, int64_t M, int64_t K, int64_t N, bool tiled) {
  if (!amx_on || K % 32) return false;
  const int64_t Mp = (M + 15) / 16 * 16;
  // Whole tiles of rows (the padding's products are never stored), from a 64-byte boundary so no tile row straddles
  // two cache lines. The decode stack's activations are laid out so (`tiled`); anything else is copied into one
  // buffer per thread, reused.
  if (!tiled && (Mp != M || reinterpret_cast<uintptr_t>(X) % 64)) {
    static thread_local std::vector<bf16> padded;
    padded.resize(Mp * K + 32);
    bf16* aligned = reinterpret_cast<bf16*>((reinterpret_cast<uintptr_t>(padded.data()) + 63) & ~uintptr_t(63));
    std::memcpy(aligned, X, M * K * sizeof(bf16));
    std::memset(aligned + M * K, 0, (Mp - M) * K * sizeof(bf16));
    X = aligned;
  }
  const int64_t blocks = (N + 15) / 16;
  // Spans of 8 blocks as in `matmul`: all 16-row chunks over one span before the next, re-reading it from L2.
  at::parallel_for(0, (blocks + 7) / 8, 1, [&](int64_t g0, int64_t g1) {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) { cfg.rows[t] = 16; cfg.colsb[t] = 64; }
    _tile_loadconfig(&cfg);
    alignas(64) float buf[16 * 16];
    for (int64_t g = g0; g < g1; ++g) {
      const int64_t j_lo = g * 8, j_hi = std::min<int64_t>(blocks, j_lo + 8);
      int64_t m0 = 0;
      for (; m0 + 32 <= Mp; m0 += 32) {
        int64_t j = j_lo;
        for (; j + 2 <= j_hi; j += 2) amx_tile2<2>(X, Wp, Y, m0, M, j, K, N, buf);
        if (j < j_hi) amx_tile2<1>(X, Wp, Y, m0, M, j, K, N, buf);
      }
      if (m0 < Mp) {
        int64_t j = j_lo;
        for (; j + GROUP <= j_hi; j += GROUP) amx_tile<GROUP>(X, Wp, Y, m0, M, j, K, N, buf);
        for (; j < j_hi; ++j) amx_tile<1>(X, Wp, Y, m0, M, j, K, N, buf);
      }
    }
    _tile_release();
  });
  return true;
}
#else
static bool set_amx(bool) { return false; }
static bool amx_matmul(const bf16*, const bf16*, float*, int64_t, int64_t, int64_t, bool) { return false; }
#endif

// ---- 4-bit weights (the quantized_self drafter) ---------------------------------------------------------------
// w = scale * q + min per group of 32 input channels (q in 0..15). Activations are quantized to int16 per group of
// 32 (scale max|x|/32767; int8 activations cost the SmolLM2 drafter acceptance 0.93 -> 0.79) and split into a
// signed high byte and an unsigned low byte, x16 = 256 h + l, so `vpdpbusd` (u8 x s8, four products a 32-bit lane)
// does the products: sum_{k in g} q_k x16_k = 256 sum q_k h_k + sum q_k l_k, exact in int32, and
// sum_k w_k x_k = sum_g scale_g xscale_g (that integer) + sum_g min_g sum_{k in g} x_k.
// Layout (`pack_q4`, one uint8 tensor): like the bf16 weights, blocks of 16 output columns in groups of GROUP blocks,
// a 32-bit lane per column; for each group and each group of 32 inputs g, one contiguous record: the codes of inputs
// 32g .. 32g+31 as 4 chunks x gw blocks x 16 lanes x 4 bytes (byte b of a column's lane in chunk c holds
// q[32g + 8c + b] | q[32g + 8c + 4 + b] << 4, so one AND and one shift give the four-input byte vectors `vpdpbusd`
// takes, for 16 columns at once), then the gw x 16 scales and the gw x 16 mins in bf16: 320 bytes a block of 16
// columns x 32 inputs. Why: the previous layout (a row of nibbles per output column, widened to 16-bit lanes for
// `vpdpwssd`, a horizontal sum per column) spent ~12 vector ops per 64 products and was arithmetic-bound;
// this one spends ~5, and with the scales and mins in the same stream a tile reads one sequential run (SmolLM2's 30
// layers at one row: 1.20-1.25x the same kernel reading scales and mins from two arrays of their own, Zen 4 EPYC).
// A drafter need not be exact (the rejection sampler uses its actual distribution), but every output is the same
// sequence of operations whatever the rows computed with it (integer sums per group, then one fold per group in
// order), so drafting is batch-invariant too.
struct XQ {
  std::vector<uint8_t> lo;    // [M, K] low bytes of the int16 activations
  std::vector<int8_t> hi;     // [M, K] high bytes
  std::vector<float> scale;   // [M, G]
  std::vector<float> sum;     // [M, G]
};

static void quantize_x(const bf16* X, int64_t M, int64_t K, XQ& out) {
  // 16 lanes at a time; the division and the round-to-nearest-even conversion are what a scalar `lrint(x / sc)`
  // computes, lane by lane
  const int64_t G = K / 32;
  out.lo.resize(M * K); out.hi.resize(M * K); out.scale.resize(M * G); out.sum.resize(M * G);
  const __m512 absmask = _mm512_castsi512_ps(_mm512_set1_epi32(0x7fffffff));
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const bf16* x = X + m * K + g * 32;
      const __m512 a = load16(x), b = load16(x + 16);
      const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_and_ps(a, absmask), _mm512_and_ps(b, absmask)));
      const float sc = amax > 0.f ? amax / 32767.f : 1.f;
      const __m512 vs = _mm512_set1_ps(sc);
      const __m512i qa = _mm512_cvtps_epi32(_mm512_div_ps(a, vs)), qb = _mm512_cvtps_epi32(_mm512_div_ps(b, vs));
      const int64_t o = m * K + g * 32;
      _mm_storeu_si128((__m128i*)(out.lo.data() + o), _mm512_cvtepi32_epi8(qa));  // truncation: the low byte
      _mm_storeu_si128((__m128i*)(out.lo.data() + o + 16), _mm512_cvtepi32_epi8(qb));
      _mm_storeu_si128((__m128i*)(out.hi.data() + o), _mm512_cvtepi32_epi8(_mm512_srai_epi32(qa, 8)));
      _mm_storeu_si128((__m128i*)(out.hi.data() + o + 16), _mm512_cvtepi32_epi8(_mm512_srai_epi32(qb, 8)));
      out.scale[m * G + g] = sc;
      out.sum[m * G + g] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    }
}

// MB activation rows x NB blocks of 16 columns (blocks j0.. of the group of gw blocks at Wq): per group of 32
// inputs, two integer accumulators (high and low bytes) per row and block, folded into a float one.
template <int MB, int NB>
static void q4_tile(const XQ& xq, int64_t m0, const uint8_t* Wq, int64_t gw, int64_t j0, float* Y, int64_t K,
                    int64_t N, int64_t n0) {
  const int64_t G = K / 32;
  const __m512i nib = _mm512_set1_epi8(0x0F);
  // one-row 4-bit streams too: on the Zen 4 EPYC they ran 1.25-1.27x slower with 8 KB prefetch at 1.5-2.5x the L3
  const int64_t ahead = prefetch_rows;
  __m512 acc[MB][NB];
  for (int m = 0; m < MB; ++m) for (int j = 0; j < NB; ++j) acc[m][j] = _mm512_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    const uint8_t* rec = Wq + g * gw * 320;  // this group of inputs' record
    if (ahead)  // the records follow each other: the stream `ahead` bytes on
      for (int64_t o = 0; o < gw * 320; o += 64) _mm_prefetch(reinterpret_cast<const char*>(rec) + ahead + o, _MM_HINT_T0);
    __m512i il[MB][NB], ih[MB][NB];
    for (int m = 0; m < MB; ++m) for (int j = 0; j < NB; ++j) il[m][j] = ih[m][j] = _mm512_setzero_si512();
    for (int c = 0; c < 4; ++c) {
      const uint8_t* w = rec + (c * gw + j0) * 64;
      __m512i wl[NB], wh[NB];
      for (int j = 0; j < NB; ++j) {
        const __m512i v = _mm512_loadu_si512(w + j * 64);
        wl[j] = _mm512_and_si512(v, nib);                          // inputs 8c .. 8c+3
        wh[j] = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);    // inputs 8c+4 .. 8c+7
      }
      for (int m = 0; m < MB; ++m) {
        const int64_t o = (m0 + m) * K + g * 32 + c * 8;
        int32_t l0, l1, h0, h1;
        std::memcpy(&l0, xq.lo.data() + o, 4); std::memcpy(&l1, xq.lo.data() + o + 4, 4);
        std::memcpy(&h0, xq.hi.data() + o, 4); std::memcpy(&h1, xq.hi.data() + o + 4, 4);
        const __m512i L0 = _mm512_set1_epi32(l0), L1 = _mm512_set1_epi32(l1);
        const __m512i H0 = _mm512_set1_epi32(h0), H1 = _mm512_set1_epi32(h1);
        for (int j = 0; j < NB; ++j) {
          il[m][j] = _mm512_dpbusd_epi32(il[m][j], L0, wl[j]);  // unsigned low bytes x the codes (as signed)
          il[m][j] = _mm512_dpbusd_epi32(il[m][j], L1, wh[j]);
          ih[m][j] = _mm512_dpbusd_epi32(ih[m][j], wl[j], H0);  // the codes (unsigned) x signed high bytes
          ih[m][j] = _mm512_dpbusd_epi32(ih[m][j], wh[j], H1);
        }
      }
    }
    const bf16* S = reinterpret_cast<const bf16*>(rec + gw * 256);
    const bf16* Mn = S + gw * 16;
    for (int j = 0; j < NB; ++j) {
      const __m512 sc = load16(S + (j0 + j) * 16), mn = load16(Mn + (j0 + j) * 16);
      for (int m = 0; m < MB; ++m) {
        const __m512i sum = _mm512_add_epi32(_mm512_slli_epi32(ih[m][j], 8), il[m][j]);
        const __m512 sx = _mm512_mul_ps(sc, _mm512_set1_ps(xq.scale[(m0 + m) * G + g]));
        acc[m][j] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(sum), sx, acc[m][j]);
        acc[m][j] = _mm512_fmadd_ps(mn, _mm512_set1_ps(xq.sum[(m0 + m) * G + g]), acc[m][j]);
      }
    }
  }
  for (int m = 0; m < MB; ++m)
    for (int j = 0; j < NB; ++j) {
      const int64_t n = n0 + j * 16;
      float* y = Y + (m0 + m) * N + n;
      if (n + 16 <= N) _mm512_storeu_ps(y, acc[m][j]);
      else _mm512_mask_storeu_ps(y, (__mmask16)((1u << (N - n)) - 1), acc[m][j]);
    }
}

// One group of gw blocks (64 columns for a whole group) for all M rows: one row with the whole group a tile (its
// records one sequential run), more rows two at a time against two blocks (registers: 2 x 2 x 3 accumulators).
static void q4_group(const XQ& xq, int64_t M, const uint8_t* Wq, int64_t gw, float* Y, int64_t K, int64_t N,
                     int64_t n0) {
  for (int64_t m0 = 0; m0 < M;) {
    int64_t j = 0;
    if (M - m0 == 1) {
      for (; j + GROUP <= gw; j += GROUP) q4_tile<1, GROUP>(xq, m0, Wq, gw, j, Y, K, N, n0 + j * 16);
      for (; j < gw; ++j) q4_tile<1, 1>(xq, m0, Wq, gw, j, Y, K, N, n0 + j * 16);
      m0 += 1;
    } else {
      for (; j + 2 <= gw; j += 2) q4_tile<2, 2>(xq, m0, Wq, gw, j, Y, K, N, n0 + j * 16);
      for (; j < gw; ++j) q4_tile<2, 1>(xq, m0, Wq, gw, j, Y, K, N, n0 + j * 16);
      m0 += 2;
    }
  }
}

static inline int64_t q4_row_bytes(int64_t K) { return K / 2 + K / 8; }  // a column's codes, scales and mins

static void matmul_q4(const XQ& xq, int64_t M, const uint8_t* Wq, const bf16* bias, float* Y, int64_t K,
                      int64_t N) {
  const int64_t blocks = (N + 15) / 16;
  at::parallel_for(0, (blocks + GROUP - 1) / GROUP, 1, [&](int64_t q0, int64_t q1) {
    for (int64_t q = q0; q < q1; ++q) {
      const int64_t b0 = q * GROUP, gw = std::min<int64_t>(GROUP, blocks - b0);
      q4_group(xq, M, Wq + b0 * 16 * q4_row_bytes(K), gw, Y, K, N, b0 * 16);
    }
  });
  add_bias(Y, bias, M, N);
}

std::vector<torch::Tensor> pack_q4(torch::Tensor q, torch::Tensor scale, torch::Tensor mn) {
  // q int [N, K] in 0..15; scale, mn float [N, K/32] -> {uint8 [blocks * 16, K/2 + K/8]} in the layout above
  // (columns past N zero): the tensors `linear_q4` takes after x, as the float32 module's `pack_q4` returns them
  auto qi = q.to(torch::kUInt8).contiguous();
  auto sf = scale.to(torch::kFloat32).contiguous(), mf = mn.to(torch::kFloat32).contiguous();
  const int64_t N = qi.size(0), K = qi.size(1), G = K / 32, blocks = (N + 15) / 16;
  TORCH_CHECK(K % 32 == 0, "pack_q4: input features must be whole groups of 32");
  auto out = torch::zeros({blocks * 16, q4_row_bytes(K)}, torch::TensorOptions().dtype(torch::kUInt8));
  const uint8_t* src = qi.data_ptr<uint8_t>();
  const float* sp = sf.data_ptr<float>();
  const float* mp = mf.data_ptr<float>();
  uint8_t* dst = out.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t blk = n / 16, b0 = blk / GROUP * GROUP, gw = std::min<int64_t>(GROUP, blocks - b0);
    const int64_t col = (blk - b0) * 16 + n % 16;  // the column's place within its group of blocks
    for (int64_t g = 0; g < G; ++g) {
      uint8_t* rec = dst + b0 * 16 * q4_row_bytes(K) + g * gw * 320;
      for (int c = 0; c < 4; ++c)
        for (int b = 0; b < 4; ++b) {
          const uint8_t* qk = src + n * K + 32 * g + 8 * c + b;
          rec[(c * gw * 16 + col) * 4 + b] = qk[0] | (qk[4] << 4);
        }
      const bf16 sv = to_bf16(sp[n * G + g]), mv = to_bf16(mp[n * G + g]);
      std::memcpy(rec + gw * 256 + col * 2, &sv, 2);
      std::memcpy(rec + gw * 288 + col * 2, &mv, 2);
    }
  }
  return {out};
}

torch::Tensor linear_q4(torch::Tensor x, torch::Tensor packed, c10::optional<torch::Tensor> bias, int64_t N) {
  // packed: `pack_q4`'s of an [N, K] weight
  auto x2 = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t M = x2.size(0), K = x2.size(1);
  XQ xq; quantize_x(P(x2), M, K, xq);
  std::vector<float> y32(M * N);
  matmul_q4(xq, M, packed.data_ptr<uint8_t>(), bias ? P(*bias) : nullptr, y32.data(), K, N);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options());
  to_bf16_n(y32.data(), PM(y), M * N);
  return y;
}

// One weight of the fused stack: a bf16 matrix packed by `pack_bf16`, or a uint8 one packed by `pack_q4` (the
// quantized_self drafter's 4-bit weights, scales and mins inside). `sz` is in the signature `decode_layers` shares with
// the float32 module, whose 4-bit layout keeps scales and mins apart; here it must be empty.
struct Weight {
  const torch::Tensor& w;
  const c10::optional<torch::Tensor>& sz;
  const c10::optional<torch::Tensor>& bias;
};

// fp32 y [M, N] = x [M, K] W^T (+ bias), rounded through bf16 as the per-op path's matmul outputs are.
// Activations the decode stack multiplies: 64-byte aligned, rows readable up to a whole tile of 16 (zeros, never
// written), so the AMX path reads them in place instead of copying them into a padded buffer at every matmul.
struct TileRows {
  std::vector<bf16> mem;
  bf16* p;
  TileRows(int64_t rows, int64_t cols) : mem((rows + 15) / 16 * 16 * cols + 32) {
    p = reinterpret_cast<bf16*>((reinterpret_cast<uintptr_t>(mem.data()) + 63) & ~uintptr_t(63));
  }
  bf16* data() { return p; }
};

static void apply(const Weight& W, bf16* x, float* y, int64_t M, int64_t K, int64_t N) {  // x: `TileRows`
  TORCH_CHECK(!W.sz, "decode_layers: bf16 kernels take 4-bit weights as `pack_q4` packs them, without scales apart");
  if (W.w.scalar_type() != torch::kUInt8) {
    matmul(x, P(W.w), W.bias ? P(*W.bias) : nullptr, y, M, K, N, false);
  } else {
    XQ xq; quantize_x(x, M, K, xq);
    matmul_q4(xq, M, W.w.data_ptr<uint8_t>(), W.bias ? P(*W.bias) : nullptr, y, K, N);
  }
  round_f32(y, M * N);
}

torch::Tensor linear_bf16(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, int64_t N) {
  // w: packed by `pack_bf16` from an [N, K] weight
  auto x2 = x.reshape({-1, x.size(-1)}).contiguous();
  const int64_t M = x2.size(0), K = x2.size(1);
  std::vector<float> y32(M * N);
  matmul(P(x2), P(w), bias ? P(*bias) : nullptr, y32.data(), M, K, N);
  auto sizes = x.sizes().vec();
  sizes.back() = N;
  auto y = torch::empty(sizes, x.options());
  bf16* Y = PM(y);
  to_bf16_n(y32.data(), Y, M * N);
  return y;
}

// out = bf16(x * rsqrt(mean(x^2) + eps) * w) in fp32, one rounding: what F.rms_norm does on bfloat16.
static void rms_norm(const bf16* x, const bf16* w, bf16* out, int64_t H, double eps) {
  __m512 acc = _mm512_setzero_ps();
  int64_t i = 0;
  for (; i + 16 <= H; i += 16) { const __m512 v = load16(x + i); acc = _mm512_fmadd_ps(v, v, acc); }
  float ss = _mm512_reduce_add_ps(acc);
  for (int64_t j = i; j < H; ++j) { float v = from_bf16(x[j]); ss += v * v; }
  const float r = 1.0f / std::sqrt(ss / H + (float)eps);
  const __m512 rv = _mm512_set1_ps(r);
  for (i = 0; i + 16 <= H; i += 16)
    store_bf16(out + i, _mm512_mul_ps(_mm512_mul_ps(load16(x + i), rv), load16(w + i)));
  for (; i < H; ++i) out[i] = to_bf16(from_bf16(x[i]) * r * from_bf16(w[i]));
}

// The sums of 16 vectors, one per lane, each added in the order `_mm512_reduce_add_ps` adds one vector's lanes
// (halves of 256, then of 128 bits, then pairs of pairs), so a score does not depend on which path computed it:
// a transpose-and-add network of 45 shuffles and adds for 16 positions where 16 reductions cost ~8 ops each,
// and their latencies no longer sit between a position's dot product and the next.
static inline __m512 sum16(const __m512* v) {
  __m512 a[8], b[4], c[2];
  for (int i = 0; i < 8; ++i)  // positions 2i, 2i+1: lanes i + (i + 8), eight each
    a[i] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)),
                         _mm512_shuffle_f32x4(v[2 * i], v[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)));
  for (int i = 0; i < 4; ++i)  // positions 4i .. 4i+3 in 128-bit lanes: b_l = a_l + a_(l+4), four each
    b[i] = _mm512_add_ps(_mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(3, 1, 3, 1)),
                         _mm512_shuffle_f32x4(a[2 * i], a[2 * i + 1], _MM_SHUFFLE(2, 0, 2, 0)));
  for (int i = 0; i < 2; ++i)  // (b0 + b2, b1 + b3) per position
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  const __m512 d = _mm512_add_ps(_mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(c[0], c[1], _MM_SHUFFLE(3, 1, 3, 1)));
  // d holds position 4e + l at element e of 128-bit lane l
  const __m512i order = _mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0);
  return _mm512_permutexvar_ps(order, d);
}

// o = sum_j p_j V_j over NC vectors of 16 (D = 16 NC), in registers, each lane in the order of j as before.
template <int NC>
static void weighted_values(const float* p, const bf16* V, int64_t len, float* o) {
  __m512 acc[NC];
  for (int c = 0; c < NC; ++c) acc[c] = _mm512_setzero_ps();
  for (int64_t j = 0; j < len; ++j) {
    const __m512 pv = _mm512_set1_ps(p[j]);
    const bf16* vj = V + j * NC * 16;
    for (int c = 0; c < NC; ++c) acc[c] = _mm512_fmadd_ps(pv, load16(vj + 16 * c), acc[c]);
  }
  for (int c = 0; c < NC; ++c) _mm512_storeu_ps(o + 16 * c, acc[c]);
}

// A position's products q_d k_d in 16 lanes (one FMA chain over d in steps of 16): the blocks sum 16 such vectors
// with `sum16`, the tail one with `_mm512_reduce_add_ps`, which add the lanes in the same order.
__attribute__((always_inline)) static inline __m512 dot_lanes(const float* qf, const bf16* kj, int64_t D) {
  __m512 acc = _mm512_setzero_ps();
  for (int64_t d = 0; d < D; d += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qf + d), load16(kj + d), acc);
  return acc;
}

// softmax(q K[0..len)^T * scaling) V[0..len) for one query head, fp32 inside, bf16 out. The one attention
// routine of both the fused batch-1 step and `attend` (the per-op path's few-token forwards), so a plain step and
// the verification of a draft compute every attention output identically. Its time grows with the context: on
// SmolLM2 (D = 64, 9 heads, 30 layers) it was ~25 cycles a position and head, a quarter of a plain step at 1,000
// positions and most of a 5-token verification's extra cost; scores go 16 positions at a time (`sum16`), and the
// weighted sum of values accumulates in registers (through memory, each position waited on the last one's store).
// Every number is what the one-position-at-a-time loops computed, bit for bit.
static void attend_row(const bf16* q, const bf16* K, const bf16* V, int64_t len, int64_t D, float scaling,
                       float* scores, bf16* out) {
  float qf[512], o[512];
  for (int64_t d = 0; d < D; ++d) { qf[d] = from_bf16(q[d]) * scaling; o[d] = 0.f; }
  const bool vec = D % 16 == 0;
  float mx = -INFINITY;
  int64_t j0 = 0;
  if (vec) {
    __m512 mv = _mm512_set1_ps(-INFINITY);
    for (; j0 + 16 <= len; j0 += 16) {
      __m512 dots[16];
      for (int p = 0; p < 16; ++p) dots[p] = dot_lanes(qf, K + (j0 + p) * D, D);
      const __m512 s = sum16(dots);
      _mm512_storeu_ps(scores + j0, s);
      mv = _mm512_max_ps(mv, s);
    }
    mx = _mm512_reduce_max_ps(mv);
  }
  for (int64_t j = j0; j < len; ++j) {
    const bf16* kj = K + j * D;
    float s = 0.f;
    if (vec) {
      s = _mm512_reduce_add_ps(dot_lanes(qf, kj, D));
    } else {
      for (int64_t d = 0; d < D; ++d) s += qf[d] * from_bf16(kj[d]);
    }
    scores[j] = s;
    mx = std::max(mx, s);
  }
  float den = 0.f;
  {
    const __m512 mv = _mm512_set1_ps(mx);
    __m512 dv = _mm512_setzero_ps();
    int64_t j = 0;
    for (; j + 16 <= len; j += 16) {
      const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + j), mv));
      _mm512_storeu_ps(scores + j, e);
      dv = _mm512_add_ps(dv, e);
    }
    den = _mm512_reduce_add_ps(dv);
    for (; j < len; ++j) { scores[j] = exp1(scores[j] - mx); den += scores[j]; }
  }
  {  // the weights p_j = e_j / den (a division rounds alike in a vector lane and alone)
    const __m512 dv = _mm512_set1_ps(den);
    int64_t j = 0;
    for (; j + 16 <= len; j += 16) _mm512_storeu_ps(scores + j, _mm512_div_ps(_mm512_loadu_ps(scores + j), dv));
    for (; j < len; ++j) scores[j] = scores[j] / den;
  }
  switch (vec ? D / 16 : 0) {
    case 1: weighted_values<1>(scores, V, len, o); break;
    case 2: weighted_values<2>(scores, V, len, o); break;
    case 4: weighted_values<4>(scores, V, len, o); break;
    case 8: weighted_values<8>(scores, V, len, o); break;
    default:
      for (int64_t j = 0; j < len; ++j) {
        const float p = scores[j];
        const bf16* vj = V + j * D;
        if (vec) {
          const __m512 pv = _mm512_set1_ps(p);
          for (int64_t d = 0; d < D; d += 16)
            _mm512_storeu_ps(o + d, _mm512_fmadd_ps(pv, load16(vj + d), _mm512_loadu_ps(o + d)));
        } else {
          for (int64_t d = 0; d < D; ++d) o[d] += p * from_bf16(vj[d]);
        }
      }
  }
  to_bf16_n(o, out, D);
}

// q [B, nh, T, D] (any strides), caches [slots, nkv, max_len, D]: row b, token t attends to keys
// 0..min(positions[b, t], kv_len - 1) of slot slot0 + b. Returns o [B, nh, T, D] bf16.
torch::Tensor attend(torch::Tensor q, torch::Tensor kc, torch::Tensor vc, int64_t slot0, torch::Tensor positions,
                     int64_t kv_len, double scaling) {
  auto qc = q.contiguous();
  auto pos = positions.to(torch::kInt64).contiguous();
  const int64_t B = qc.size(0), nh = qc.size(1), T = qc.size(2), D = qc.size(3);
  const int64_t nkv = kc.size(1), max_len = kc.size(2), group = nh / nkv;
  auto out = torch::empty({B, nh, T, D}, qc.options());
  const bf16* Q = P(qc);
  const bf16* Kp = P(kc);
  const bf16* Vp = P(vc);
  bf16* O = PM(out);
  const int64_t* ps = pos.data_ptr<int64_t>();
  at::parallel_for(0, B * nh, 1, [&](int64_t i0, int64_t i1) {
    FlushDenormals ftz;  // per thread: the mode is a thread's own
    std::vector<float> scores(kv_len);
    for (int64_t i = i0; i < i1; ++i) {
      const int64_t b = i / nh, h = i % nh, g = h / group;
      const bf16* K = Kp + ((slot0 + b) * nkv + g) * max_len * D;
      const bf16* V = Vp + ((slot0 + b) * nkv + g) * max_len * D;
      for (int64_t t = 0; t < T; ++t) {
        const int64_t len = std::min(ps[b * T + t], kv_len - 1) + 1;
        attend_row(Q + (i * T + t) * D, K, V, len, D, (float)scaling, scores.data(), O + (i * T + t) * D);
      }
    }
  });
  return out;
}

// A few tokens of one sequence through layers [0, L): h [T, H] bf16 is updated in place; K/V written from `pos`.
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
  // starts[b] + S - 1 (a decode step, S = 1, or the verification of S - 1 drafts); cos/sin [B * S, D]. Each matmul
  // reads its weight once for all rows (up to 8 per pass), and every row is computed exactly as it would be alone:
  // the kernels' accumulation order depends on neither S nor B, so batched decoding is batch-invariant.
  FlushDenormals ftz;
  const int64_t B = (int64_t)starts.size(), T = h.size(0), S = T / B, H = h.size(1), L = (int64_t)qkv_w.size();
  const int64_t D = cos.size(1), half = D / 2;
  const int64_t qs = nh * D, kvs = nkv * D, I = inter, group = nh / nkv, W3 = qs + 2 * kvs;
  const int64_t max_len = k_cache[0].size(2);
  bf16* hp = PM(h);
  const bf16* cp = P(cos);
  const bf16* sp = P(sin);
  const int64_t longest = *std::max_element(starts.begin(), starts.end()) + S;
  TileRows a(T, std::max(H, I)), att(T, qs), act(T, I);
  std::vector<bf16> qkv(T * W3);
  std::vector<float> y(T * std::max({W3, 2 * I, H})), scores(longest);
  for (int64_t l = 0; l < L; ++l) {
    for (int64_t t = 0; t < T; ++t) rms_norm(hp + t * H, P(in_norm[l]), a.data() + t * H, H, eps);
    apply({qkv_w[l], qkv_sz[l], qkv_b[l]}, a.data(), y.data(), T, H, W3);
    to_bf16_n(y.data(), qkv.data(), T * W3);
    bf16* kc = PM(k_cache[l]);
    bf16* vc = PM(v_cache[l]);
    for (int64_t t = 0; t < T; ++t) {
      // rotary on q and k heads: bf16(bf16(x*cos) + bf16(rot(x)*sin)), rot(x) = (-x2, x1)
      for (int64_t hd = 0; hd < nh + nkv; ++hd) {
        bf16* x = qkv.data() + t * W3 + hd * D;
        if (half % 16 == 0) {  // both halves as vectors: out1 = x1 c1 - x2 s1, out2 = x2 c2 + x1 s2
          for (int64_t d = 0; d < half; d += 16) {
            const __m512 x1 = load16(x + d), x2 = load16(x + half + d);
            const __m512 c1 = load16(cp + t * D + d), c2 = load16(cp + t * D + half + d);
            const __m512 s1 = load16(sp + t * D + d), s2 = load16(sp + t * D + half + d);
            const __m512 neg = _mm512_castsi512_ps(_mm512_xor_si512(_mm512_castps_si512(x2), _mm512_set1_epi32(INT32_MIN)));
            store_bf16(x + d, _mm512_add_ps(rb16(_mm512_mul_ps(x1, c1)), rb16(_mm512_mul_ps(neg, s1))));
            store_bf16(x + half + d, _mm512_add_ps(rb16(_mm512_mul_ps(x2, c2)), rb16(_mm512_mul_ps(x1, s2))));
          }
          continue;
        }
        float tmp[512];
        for (int64_t d = 0; d < D; ++d) {
          const float rot = d < half ? -from_bf16(x[d + half]) : from_bf16(x[d - half]);
          tmp[d] = rb(rb(from_bf16(x[d]) * from_bf16(cp[t * D + d])) + rb(rot * from_bf16(sp[t * D + d])));
        }
        for (int64_t d = 0; d < D; ++d) x[d] = to_bf16(tmp[d]);
      }
      const int64_t slot = slot0 + t / S, pos = starts[t / S] + t % S;
      for (int64_t g = 0; g < nkv; ++g) {
        const int64_t off = ((slot * nkv + g) * max_len + pos) * D;
        std::memcpy(kc + off, qkv.data() + t * W3 + qs + g * D, D * sizeof(bf16));
        std::memcpy(vc + off, qkv.data() + t * W3 + qs + kvs + g * D, D * sizeof(bf16));
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
    apply({o_w[l], o_sz[l], o_b[l]}, att.data(), y.data(), T, qs, H);
    residual_add(hp, y.data(), T * H);
    for (int64_t t = 0; t < T; ++t) rms_norm(hp + t * H, P(post_norm[l]), a.data() + t * H, H, eps);
    apply({gu_w[l], gu_sz[l], gu_b[l]}, a.data(), y.data(), T, H, 2 * I);
    for (int64_t t = 0; t < T; ++t) {
      const float* gy = y.data() + t * 2 * I;
      const float* uy = gy + I;
      bf16* at = act.data() + t * I;
      int64_t i = 0;
      for (; i + 16 <= I; i += 16) {
        const __m512 g = rb16(_mm512_loadu_ps(gy + i)), u = rb16(_mm512_loadu_ps(uy + i));
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        store_bf16(at + i, _mm512_mul_ps(rb16(_mm512_div_ps(g, _mm512_add_ps(_mm512_set1_ps(1.f), e))), u));
      }
      for (; i < I; ++i) {
        const float g = rb(gy[i]), u = rb(uy[i]);
        at[i] = to_bf16(rb(g / (1.f + exp1(-g))) * u);
      }
    }
    apply({down_w[l], down_sz[l], down_b[l]}, act.data(), y.data(), T, I, H);
    residual_add(hp, y.data(), T * H);
  }
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("linear_bf16", &linear_bf16);
  m.def("linear", &linear_bf16);  // the name the runner calls for either dtype
  m.def("decode_layers", &decode_layers);
  m.def("pack_q4", &pack_q4);
  m.def("attend", &attend);
  m.def("linear_q4", &linear_q4);
  m.def("set_amx", &set_amx);
  m.def("set_prefetch", &set_prefetch);
}
""".replace("@GROUP@", str(GROUP))

_lock = threading.Lock()
_built: dict[str, Any] = {}  # extension name -> its module, or None where it did not build


def _cpuinfo(field: str) -> str:
    """The first /proc/cpuinfo line of `field` ("flags", "vendor_id", ...), whole; "" where there is none."""
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.split(":")[0].strip() == field), "")
    except OSError:
        return ""


def cpu_flags() -> str:
    return _cpuinfo("flags")


def _value(line: str) -> str:
    return line.partition(":")[2].strip()


def l3_bytes() -> int:
    """The size of the L3 cache the first core reads through (bytes); 0 where the OS does not say."""
    try:
        text = Path("/sys/devices/system/cpu/cpu0/cache/index3/size").read_text().strip()
    except OSError:
        return 0
    scale = {"K": 2**10, "M": 2**20, "G": 2**30}.get(text[-1:], 1)
    digits = text[:-1] if scale > 1 else text
    return int(digits) * scale if digits.isdigit() else 0


NEAR_L3 = 3.4  # weights up to this many times the L3 count as near its size (the measured crossover, see below)


def prefetch_distance(weight_bytes: int | None = None, vendor: str | None = None, family: str | None = None,
                      l3: int | None = None) -> tuple[int, int]:
    """How far ahead (bytes) the bfloat16 kernels prefetch a model's weight stream in software on this CPU:
    (one-row tiles, every other tile); 0: not at all. `weight_bytes`: the model's (None: unknown).

    On the Zen 5 EPYC (AMD family 26) 8 KB ahead made a 5-token verification's matmuls cost what one token's do
    (the C++ comment above `prefetch_one_row` has the numbers). On the Zen 4 EPYC (family 25, one thread, the same
    weights read both ways in alternating rounds) the prefetches mostly cost issue slots: stacks of SmolLM2's matmuls
    streamed from memory took 10.7 / 11.0 / 21.5 ms without at 1 / 5 / 16 rows against 11.2 / 12.5 / 22.5 with; in
    the engine SmolLM2's plain decoding ran 1.02-1.06x as fast without at batch 1 and 1.06-1.07x at batch 8,
    quantized_self γ=4 1.14-1.20x, the bench model's speculation at batch 1 and 8 and plain decoding at batch 16
    1.02-1.12x. The exception is one-row steps of a model not much larger than the L3: the bench model's plain
    batch-1 steps back to back (30-40 paired rounds) ran 0.86-0.91x without, 0.985x with one-row tiles prefetched
    only; its 55 MB of weights are 1.6x the 32 MiB L3. Where that stops, `specrl bench prefetch` measured on
    SmolLM2 cut to 1-30 layers (plain batch 1, one-row prefetch against none, geomeans of 60-120 paired rounds
    over three to five runs, three of them the command's): 1.07 / 1.03 / 1.03 / 1.03 at 1.9x / 2.3x / 2.7x / 3.2x
    the L3, a wash at 3.6x (0.99: three runs lost 0.97x, two gained 1.03x), then 0.98 / 0.98 / 0.98 / 0.96 at 4.0x
    / 4.6x / 5.5x / 8x. Hence one-row prefetch on Zen 4 up to NEAR_L3 times the L3, between the last size that
    gained and the wash. Stacks of one-row matmuls timed outside the engine ran slower with the prefetch at 1.6x
    the L3 too (1.04x), so the effect is not the matmuls' alone. CPUs not measured keep Zen 5's setting."""
    vendor = _value(_cpuinfo("vendor_id")) if vendor is None else vendor
    family = _value(_cpuinfo("cpu family")) if family is None else family
    if (vendor, family) != ("AuthenticAMD", "25"):
        return 8192, 8192
    l3 = l3_bytes() if l3 is None else l3
    near = weight_bytes is not None and 0 < weight_bytes <= NEAR_L3 * l3
    return (8192 if near else 0), 0


def _cpu_has_avx512_bf16() -> bool:
    return "avx512_bf16" in cpu_flags().split()


def toolchain() -> bool:
    """The compiler and build tool `torch.utils.cpp_extension` needs are on PATH."""
    return all(shutil.which(tool) for tool in ("c++", "ninja"))


def buildable() -> bool:
    """Where the kernels must build: the CPU has AVX512-BF16 and the toolchain torch needs is on PATH."""
    return _cpu_has_avx512_bf16() and toolchain()


def build_folder(name: str) -> Path:
    """Where extension `name` is built and cached: SPECRL_KERNEL_CACHE, else `kernels/` in specrl's cache
    (SPECRL_CACHE_DIR, default ~/.cache/specrl).

    In specrl's cache because that is what a job's pods share (the model-cache volume): each pod's HOME is new, and
    every pod compiled its kernels at every start (about 30 s an extension on a Zen 4, with its peers compiling beside
    it). -march=native code: one folder per instruction-set flags, so a cache shared between different CPUs (nodes
    of a cluster) never loads a binary compiled for another one; and one per extension: both write main.cpp, and in
    a shared folder each load of the other one recompiled it (30 s)."""
    root = os.environ.get("SPECRL_KERNEL_CACHE")
    base = Path(root) if root else cache_dir("kernels", create=False)
    return base / hashlib.sha256(cpu_flags().encode()).hexdigest()[:12] / name


@contextlib.contextmanager
def _build_lock(build: Path) -> Iterator[None]:
    """Hold the build folder against other processes while torch builds or loads in it.

    torch's own guard is a file it creates and deletes: a process killed mid-build (Ctrl-C during the first
    `specrl run`) leaves it behind, and every later process waits for it forever, silently. An advisory lock is
    released by the OS when its process dies; while it is held no other process is building here, so a torch lock
    file found then is such a leftover and goes."""
    with open(build / "specrl.lock", "a") as guard:
        fcntl.flock(guard, fcntl.LOCK_EX)
        try:
            (build / "lock").unlink(missing_ok=True)
            yield
        finally:
            fcntl.flock(guard, fcntl.LOCK_UN)


def build_once(name: str, source: str, supported: Callable[[], bool]) -> Any:
    """Extension `name` compiled from `source` (once per process; cached on disk per machine), or None where the CPU
    lacks what `supported` checks, SPECRL_CPU_KERNELS=0, or the build fails (then the engine runs ATen)."""
    with _lock:
        if name in _built:
            return _built[name]
        module = None
        if os.environ.get("SPECRL_CPU_KERNELS", "1") != "0" and supported():
            try:
                from torch.utils.cpp_extension import load_inline

                build = build_folder(name)
                build.mkdir(parents=True, exist_ok=True)
                with _build_lock(build):
                    module = load_inline(name, cpp_sources=source, functions=None,
                                         extra_cflags=["-O3", "-march=native"], build_directory=str(build),
                                         verbose=False)
            except Exception as exc:  # noqa: BLE001 - no compiler / headers / ninja: the ATen path is the fallback
                logging.getLogger(__name__).warning("CPU kernels %s not built (%s: %s); the engine uses ATen", name,
                                                    type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")
        _built[name] = module
        return module


def load() -> Any:
    """The compiled bfloat16 module, or None where it cannot be built here (then the ATen path runs)."""
    module = build_once("specrl_decode_kernels", _SOURCE, _cpu_has_avx512_bf16)
    if module is not None and _amx_active is None:
        _set_amx(module, os.environ.get("SPECRL_AMX", "1") != "0")
        module.set_prefetch(*prefetch_distance())
    return module


_amx_active: bool | None = None  # whether the loaded module multiplies with AMX tiles (None: not loaded yet)


def _set_amx(module: Any, on: bool) -> bool:
    global _amx_active
    _amx_active = bool(module.set_amx(on))
    return _amx_active


def use_amx(on: bool) -> bool:
    """Multiply with AMX tiles where the CPU, the compiler and the OS allow it (on by default; SPECRL_AMX=0: never);
    returns whether the kernels now do. Runners read it when they are built: switch before building them, never
    between a plain step and its verification (they must take one path to round alike)."""
    module = load()
    return module is not None and _set_amx(module, on)


def amx() -> bool:
    """Whether the bfloat16 kernels multiply with AMX tiles in this process."""
    load()  # sets `_amx_active` on first load, from SPECRL_AMX
    return bool(_amx_active)


def pack_bf16(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] bfloat16 -> the kernels' layout: blocks of 16 output columns (rows past N zero) in groups of
    `GROUP` blocks, [groups][K/2][GROUP][16][2], the last group narrower. For one input pair a group's weights are
    adjacent, so a tile of a group reads one sequential stream."""
    n, k = weight.shape
    w = weight if n % 16 == 0 else torch.cat([weight, weight.new_zeros((-n) % 16, k)])
    blocks = w.view(-1, 16, k // 2, 2).transpose(1, 2)  # [blocks, K/2, 16, 2]
    groups = [blocks[g : g + GROUP].transpose(0, 1).reshape(-1) for g in range(0, blocks.shape[0], GROUP)]
    return torch.cat(groups)


def available() -> bool:
    return load() is not None


def fits(weight: torch.Tensor) -> bool:
    """The kernels' layout: a contiguous CPU bfloat16 matrix with input features in whole 32-lanes."""
    return (weight.device.type == "cpu" and weight.dtype == torch.bfloat16 and weight.dim() == 2
            and weight.shape[1] % 32 == 0 and weight.is_contiguous())
