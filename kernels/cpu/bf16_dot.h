// The bf16 dot-product GEMMs shared by the weight formats: a weight whose values are widened
// (int8, e4m3: exactly; int4: dequantized and rounded) to bf16 in registers, x rounded to bf16
// once a call, products and sums in fp32 with AVX-512 BF16's vdpbf16ps (16 fp32 lanes, each
// adding two bf16 products: twice the fp32 FMA's products an instruction).
//
// Where this sits: included by int8_fp8.cpp (int8 and e4m3 weights) and int4.cpp (int4 weights),
// which each define a weight source (below) and a shim; the lowering dispatches to those shims
// as the `bf16_dot` candidate (passes/cpu/dispatch.py).
//
// A weight source W is a small struct with
//   Row row(int64_t n) const                weight row n, a struct with
//     __m512bh operator()(int64_t k) const    its columns k .. k+31 as bf16 (zeros past K; k a
//                                             multiple of 32)
//     __m512bh full(int64_t k) const          the same where k + 32 <= K (no mask: the loops'
//                                             steady state)
//   const uint8_t* base; int64_t row_bytes;  where row n's bytes start (prefetching)
// and the GEMMs below take it by template, so each format's decode is inlined into the loops.
// The row is bound once per weight row: with the source's fields read through a reference and
// the row offset computed per step, GCC 12 reloaded and multiplied them in every step of the
// 16-row loop (seen in the assembly; ~10 % slower at M = 8-16 on the Zen 4).
//
// Two GEMMs: the row kernel (a weight row decoded once per 16 activation rows: 16 accumulators,
// all 32 registers but the decoded weight and a load; up to M = 16 the weight is read and
// decoded once, as in a GEMV, at twice its multiply rate) and, from kBf16PanelMinM rows, a
// packed-panel GEMM (the weight decoded once a call into 16-column panels, k-pair by k-pair, met
// by 6 x 4 register tiles of broadcast activation pairs, as the VNNI GEMM's panels).

#pragma once

#include <omp.h>

#include "amx.h"
#include "native.h"

#pragma GCC visibility push(hidden)

namespace fxq {

// From this many rows the bf16 ops round x and use the dot products; below, the fp32 GEMV (one
// row, decode: it reads the weight as fast, memory-bound, and keeps the scheme's numerics)
constexpr int64_t kBf16MinM = 2;
// From this many rows the packed-panel GEMM (each weight value decoded once a call); below, the
// row kernel (each decoded once per 16 rows, no pack: the pack alone cost what ~15 rows do).
// Zen 4, two threads, int8 weights of SmolLM2's 576 x 576, 192 x 576, 1536 x 576 and
// 576 x 1536, one build with the panels from 2 rows, one without them, compared per M (a one-off
// comparison, not a benchmarks/ script): the rows 2.7x faster at 4, they tie at 28, the panels
// 1.15x faster at 32, 1.5x at 64, 1.9x at 128, 2.3x at 512 (there 1.04x bf16 F.linear, the rows
// 0.43x).
#ifndef FXQ_BF16_PANEL_MIN_M
#define FXQ_BF16_PANEL_MIN_M 32
#endif
constexpr int64_t kBf16PanelMinM = FXQ_BF16_PANEL_MIN_M;

// x [M, K] rounded to bf16 (round to nearest even), as fp32: what the ops' builds without
// AVX-512 BF16 multiply, in fp32, to keep the same numerics
inline std::vector<float> bf16_rounded(const float* x, int64_t M, int64_t K) {
  std::vector<float> out(M * K);
  for (int64_t i = 0; i < M * K; ++i) out[i] = bf16_round(x[i]);
  return out;
}

#ifdef FXQ_BF16_512
// 32 lanes' mask of the first `cols` (all when cols >= 32)
inline __mmask32 first_columns(int64_t cols) {
  return cols >= 32 ? ~__mmask32(0) : (__mmask32(1) << cols) - 1;
}

// x [M, K] rounded to bf16, each row on its own 64-byte lines and zero-padded to whole 32-column
// steps; one line more between rows than they need, so that with K a power of two the 16 rows a
// weight row meets do not fall into one L1 set (K = 4096: 8 KiB apart, 16 rows in 8 ways;
// measured 2.4x slower at M = 16 on the Zen 4 before the extra line)
struct Bf16Rows {
  std::unique_ptr<uint16_t[]> buf;
  uint16_t* data;
  int64_t ldx;

  Bf16Rows(const float* x, int64_t M, int64_t K) : ldx((K + 31) / 32 * 32 + 32) {
    buf.reset(new uint16_t[M * ldx + 32]);
    data = line_aligned(buf.get());
#pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < M; ++m) {
      uint16_t* xr = data + m * ldx;
      int64_t k = 0;
      for (; k + 32 <= K; k += 32) {
        const __m512bh v = _mm512_cvtne2ps_pbh(_mm512_loadu_ps(x + m * K + k + 16),
                                               _mm512_loadu_ps(x + m * K + k));
        _mm512_store_si512(xr + k, (__m512i)v);
      }
      for (; k < ldx; ++k) xr[k] = k < K ? bf16_bits(x[m * K + k]) : 0;
    }
  }
  // columns k0.. of `rows` (k0 a multiple of 32: still 64-byte aligned), a view, not a copy;
  // what a GEMM reads past its own K there (whole 32-column steps) is the next columns' values
  // or the rows' zero padding, and meets zero weights
  Bf16Rows(const Bf16Rows& rows, int64_t k0) : data(rows.data + k0), ldx(rows.ldx) {}
};

// ---- The row kernel -------------------------------------------------------------------------

// R activation rows (bf16, ldx apart, zero past K) against weight row n: out[m] = x[m] . w[n]
template <int R, class W>
inline void dot_rows_bf16(const uint16_t* xb, int64_t ldx, const W& w, int64_t n, int64_t K,
                          float* out) {
  __m512 acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
  auto step = [&](int64_t k, __m512bh wv) {
    for (int m = 0; m < R; ++m) {
      const __m512bh xv = (__m512bh)_mm512_load_si512(xb + m * ldx + k);
      acc[m] = _mm512_dpbf16_ps(acc[m], xv, wv);
    }
  };
  const auto row = w.row(n);
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) step(k, row.full(k));
  if (k < K) step(k, row(k));
  for (int m = 0; m < R; ++m) out[m] = _mm512_reduce_add_ps(acc[m]);
}

// y[m, n] = (x[m] . w[n]) * scale[n] (scale null: 1), every row of x
template <class W>
void gemm_rows_bf16(const Bf16Rows& x, int64_t M, int64_t K, const W& w, int64_t N,
                    const float* scale, float* y) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    prefetch_row_ahead(w.base, n, N, w.row_bytes);
    const float s = scale ? scale[n] : 1.f;
    float out[16];
    auto put = [&](int64_t m0, int rows) {
      for (int i = 0; i < rows; ++i) y[(m0 + i) * N + n] = out[i] * s;
    };
    const uint16_t* xb = x.data;
    const int64_t ldx = x.ldx;
    int64_t m = 0;
    for (; m + 16 <= M; m += 16) dot_rows_bf16<16>(xb + m * ldx, ldx, w, n, K, out), put(m, 16);
    // the last M % 16 rows in blocks of 8, 4, 2, 1
    if (M - m >= 8) dot_rows_bf16<8>(xb + m * ldx, ldx, w, n, K, out), put(m, 8), m += 8;
    if (M - m >= 4) dot_rows_bf16<4>(xb + m * ldx, ldx, w, n, K, out), put(m, 4), m += 4;
    if (M - m >= 2) dot_rows_bf16<2>(xb + m * ldx, ldx, w, n, K, out), put(m, 2), m += 2;
    if (M - m >= 1) dot_rows_bf16<1>(xb + m * ldx, ldx, w, n, K, out), put(m, 1);
  }
}

// ---- The packed-panel GEMM ------------------------------------------------------------------
// Past a few dozen rows the row kernel is bound by its loads (16 activation vectors for 16 dot
// products of one weight vector) and decodes each weight row once per 16 rows. Here the weight
// is decoded once a call into panels of 16 output columns laid out k-pair by k-pair (64 bytes:
// the 16 columns' next two k, as bf16), so one broadcast pair of activations meets 16 columns in
// one vdpbf16ps, each fp32 lane is one output, and an R x P register tile does R * P dot products
// per P + R loads. Same products, fp32 sums in another order.

// r[i] = 16 int32 of row i -> r[j] = the j-th int32 of rows 0..15
inline void transpose16x16_epi32(__m512i* r) {
  __m512i t[16], u[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  // u[4q + j], 128-bit lane L: column 4L + j of rows 4q..4q+3
  for (int q = 0; q < 4; ++q)
    for (int h = 0; h < 2; ++h) {
      u[4 * q + 2 * h] = _mm512_unpacklo_epi64(t[4 * q + h], t[4 * q + h + 2]);
      u[4 * q + 2 * h + 1] = _mm512_unpackhi_epi64(t[4 * q + h], t[4 * q + h + 2]);
    }
  for (int j = 0; j < 4; ++j) {
    // lanes 0-1 (then 2-3) of rows 0..7's and 8..15's column groups, then one lane each
    const __m512i a = _mm512_shuffle_i32x4(u[j], u[4 + j], 0x44);
    const __m512i b = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0x44);
    const __m512i c = _mm512_shuffle_i32x4(u[j], u[4 + j], 0xEE);
    const __m512i d = _mm512_shuffle_i32x4(u[8 + j], u[12 + j], 0xEE);
    r[j] = _mm512_shuffle_i32x4(a, b, 0x88);
    r[4 + j] = _mm512_shuffle_i32x4(a, b, 0xDD);
    r[8 + j] = _mm512_shuffle_i32x4(c, d, 0x88);
    r[12 + j] = _mm512_shuffle_i32x4(c, d, 0xDD);
  }
}

// One 16-column panel from weight rows n0 .. n0 + rows - 1 (rows <= 16): K2 = ceil(K / 2) pairs
// of 64 bytes, pair g = the 16 columns' (w[c, 2g], w[c, 2g + 1]); missing rows and k past K are
// zeros (they add nothing)
template <class W>
inline void pack_panel_bf16(const W& w, int64_t n0, int64_t rows, int64_t K, __m512i* out) {
  const int64_t K2 = (K + 1) / 2;
  for (int64_t k = 0; k < K; k += 32) {
    __m512i r[16];
    for (int c = 0; c < 16; ++c)
      r[c] = c >= rows      ? _mm512_setzero_si512()
             : k + 32 <= K ? (__m512i)w.row(n0 + c).full(k)
                           : (__m512i)w.row(n0 + c)(k);
    transpose16x16_epi32(r);
    const int64_t g0 = k / 2, pairs = std::min<int64_t>(16, K2 - g0);
    for (int64_t g = 0; g < pairs; ++g) _mm512_storeu_si512(out + g0 + g, r[g]);
  }
}

// acc[i][j] = the dot products of k-pairs [g0, g1) for R activation rows (bf16, ldx apart) x P
// panels (K2 pairs each), from zero. Inlined into the tiles below, whose unroll pragmas and
// attribute keep the accumulators in registers, as in int8_fp8.cpp's panel16_tile (without
// them GCC 12 spilled them)
template <int R, int P>
__attribute__((always_inline)) inline void panel_bf16_sums(const uint16_t* xb, int64_t ldx,
                                                           const __m512i* wp, int64_t K2,
                                                           int64_t g0, int64_t g1,
                                                           __m512 (&acc)[R][P]) {
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < P; ++j) acc[i][j] = _mm512_setzero_ps();
  for (int64_t g = g0; g < g1; ++g) {
    __m512bh wv[P];
#pragma GCC unroll 8
    for (int j = 0; j < P; ++j) wv[j] = (__m512bh)_mm512_loadu_si512(wp + j * K2 + g);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      int32_t pair;
      std::memcpy(&pair, xb + i * ldx + 2 * g, 4);
      const __m512bh xv = (__m512bh)_mm512_set1_epi32(pair);
#pragma GCC unroll 8
      for (int j = 0; j < P; ++j) acc[i][j] = _mm512_dpbf16_ps(acc[i][j], xv, wv[j]);
    }
  }
}

// y[i, 16p + c] for R activation rows (bf16, ldx apart, zero-padded to whole pairs) x P panels,
// times scale[column] (null: 1)
template <int R, int P>
__attribute__((optimize("no-tree-pre"))) void panel_bf16_tile(const uint16_t* xb, int64_t ldx,
                                                               const __m512i* wp, int64_t K2,
                                                               const float* scale, float* y,
                                                               int64_t N, int64_t n0) {
  __m512 acc[R][P];
  panel_bf16_sums<R, P>(xb, ldx, wp, K2, 0, K2, acc);
#pragma GCC unroll 8
  for (int j = 0; j < P; ++j) {
    const int64_t n = n0 + 16 * j, cols = N - n;
    const __mmask16 mask = first_columns16(cols);
    const __m512 sv = scale ? _mm512_maskz_loadu_ps(mask, scale + n) : _mm512_set1_ps(1.f);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
      _mm512_mask_storeu_ps(y + i * N + n, mask, _mm512_mul_ps(acc[i][j], sv));
  }
}

// up to R rows x up to P panels, both counts runtime values (the last tiles)
template <int R, int P>
inline void panel_bf16_tile_n(int64_t rows, int64_t panels, const uint16_t* xb, int64_t ldx,
                              const __m512i* wp, int64_t K2, const float* scale, float* y,
                              int64_t N, int64_t n0) {
  if constexpr (R > 1)
    if (rows < R)
      return panel_bf16_tile_n<R - 1, P>(rows, panels, xb, ldx, wp, K2, scale, y, N, n0);
  if constexpr (P > 1)
    if (panels < P)
      return panel_bf16_tile_n<R, P - 1>(rows, panels, xb, ldx, wp, K2, scale, y, N, n0);
  panel_bf16_tile<R, P>(xb, ldx, wp, K2, scale, y, N, n0);
}

// The packed-panel GEMM's driver: each thread's panels packed once (PanelWork's blocks), then
// tile(m, rows, p, panels, wp) for every tile of up to R rows x P panels from row m and panel
// p, wp its packed panels (K2 = ceil(K / 2) pairs each)
template <int R, int P, class W, class Tile>
void for_panel_tiles(int64_t M, int64_t K, const W& w, int64_t N, Tile tile) {
  const int64_t K2 = (K + 1) / 2, panels = (N + 15) / 16;
  const PanelWork work(panels, K2 * 64, M, P, R, omp_get_max_threads());
#pragma omp parallel
  {
    std::vector<__m512i> buf(work.block_panels * K2);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < work.items(); ++item) {
      int64_t p0, p1, m0, m1;
      work.item(item, M, &p0, &p1, &m0, &m1);
      for (int64_t p = p0; p < p1; ++p)
        pack_panel_bf16(w, p * 16, std::min<int64_t>(16, N - p * 16), K, &buf[(p - p0) * K2]);
      for (int64_t m = m0; m < m1; m += R)
        for (int64_t p = p0; p < p1; p += P) tile(m, m1 - m, p, p1 - p, &buf[(p - p0) * K2]);
    }
  }
}

// y[m, n] = (x[m] . w[n]) * scale[n] (scale null: 1), every row of x
template <class W>
void gemm_panels_bf16(const Bf16Rows& x, int64_t M, int64_t K, const W& w, int64_t N,
                      const float* scale, float* y) {
  constexpr int R = 6, P = 4;  // 24 accumulators + 4 panel vectors + a broadcast, of 32
  const int64_t K2 = (K + 1) / 2;
  for_panel_tiles<R, P>(M, K, w, N, [&](int64_t m, int64_t rows, int64_t p, int64_t np,
                                        const __m512i* wp) {
    panel_bf16_tile_n<R, P>(rows, np, x.data + m * x.ldx, x.ldx, wp, K2, scale, y + m * N, N,
                            p * 16);
  });
}

#ifdef FXQ_AMX
// The same product on AMX tiles (amx.h): the panels as above, each padded with zero pairs to
// whole 32-k tile steps, and the activation rows as A tiles where they lie
template <class W>
void gemm_amx_bf16(const Bf16Rows& x, int64_t M, int64_t K, const W& w, int64_t N,
                   const float* scale, float* y) {
  const int64_t K2 = (K + 1) / 2, steps = (K2 + 15) / 16, panels = (N + 15) / 16;
  const int64_t panel_bytes = steps * 1024;
  auto prepare = [&](int64_t p0, int64_t p1, std::vector<uint8_t>& buf) {
    buf.resize((p1 - p0) * panel_bytes);
    for (int64_t p = p0; p < p1; ++p) {
      uint8_t* out = buf.data() + (p - p0) * panel_bytes;
      pack_panel_bf16(w, p * 16, std::min<int64_t>(16, N - p * 16), K, (__m512i*)out);
      std::memset(out + K2 * 64, 0, panel_bytes - K2 * 64);
    }
    return (const uint8_t*)buf.data();
  };
  auto store = [&](int64_t m0, int64_t rows, int64_t p, int np, int64_t, const uint8_t*,
                   const int32_t* c, float*) {
    const float* cf = reinterpret_cast<const float*>(c);
    for (int j = 0; j < np; ++j) {
      const int64_t n = (p + j) * 16, cols = N - n;
      const __mmask16 mask = first_columns16(cols);
      const __m512 sv = scale ? _mm512_maskz_loadu_ps(mask, scale + n) : _mm512_set1_ps(1.f);
      for (int64_t i = 0; i < rows; ++i)
        _mm512_mask_storeu_ps(y + (m0 + i) * N + n, mask,
                              _mm512_mul_ps(_mm512_loadu_ps(cf + (i * np + j) * 16), sv));
    }
  };
  amx_gemm<Amx::kBf16>((const uint8_t*)x.data, x.ldx * 2, M, steps, panels, panel_bytes,
                       prepare, store);
}
#endif

// The panel GEMM, on AMX tiles where the build has them and Linux granted them (amx.h), else on
// AVX-512 registers
template <class W>
void gemm_large_bf16(const Bf16Rows& xb, int64_t M, int64_t K, const W& w, int64_t N,
                     const float* scale, float* y) {
#ifdef FXQ_AMX
  if (amx_ready()) return gemm_amx_bf16(xb, M, K, w, N, scale, y);
#endif
  gemm_panels_bf16(xb, M, K, w, N, scale, y);
}

// Rows from which gemm_bf16 leaves its row kernel for gemm_large_bf16
inline int64_t bf16_large_min_m() {
#ifdef FXQ_AMX
  if (amx_ready()) return kAmxMinM;
#endif
  return kBf16PanelMinM;
}

// y [M, N] = (bf16(x) [M, K] . w[n]) * scale[n] (scale null: 1), M >= 1
template <class W>
void gemm_bf16(const float* x, int64_t M, int64_t K, const W& w, int64_t N, const float* scale,
               float* y) {
  const Bf16Rows xb(x, M, K);
  if (M >= bf16_large_min_m()) return gemm_large_bf16(xb, M, K, w, N, scale, y);
  gemm_rows_bf16(xb, M, K, w, N, scale, y);
}
#endif

}  // namespace fxq

#pragma GCC visibility pop
