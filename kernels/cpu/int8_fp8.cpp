// Native CPU kernels for byte weights: int8 and fp8 e4m3 weight-only linears (fp32
// activations), and int8 weights x int8 activations (w8a8). The layouts, numerics and the reason
// these exist are in linear.cpp's header; the large-M path they fall back to is there too.

#include <omp.h>

#include <type_traits>
#include <vector>

#include "bf16_dot.h"
#include "native.h"

namespace fxq {
namespace {

#ifdef FXQ_AVX2
inline int32_t hsum_i32(__m256i v) {
  __m128i lo = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  lo = _mm_add_epi32(lo, _mm_unpackhi_epi64(lo, lo));
  lo = _mm_add_epi32(lo, _mm_shuffle_epi32(lo, 1));
  return _mm_cvtsi128_si32(lo);
}

// 32 products xq * w of int8 bytes, summed in pairs and then fours into eight int32 lanes.
// maddubs multiplies unsigned by signed bytes: |x| (ax, from _mm256_sign_epi8(xv, xv)) times w
// with x's sign moved onto w. |x| <= 127 and |w| <= 127, so a pair sums to at most
// 2 * 127 * 127 < 2^15: no saturation, and the int32 sums are exact.
inline __m256i dot32_int8(__m256i ax, __m256i xv, __m256i wv, __m256i ones16) {
  return _mm256_madd_epi16(_mm256_maddubs_epi16(ax, _mm256_sign_epi8(wv, xv)), ones16);
}

inline __m256 load_int8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}
#endif

// ---- GEMV: y[m, n] for small M, one weight row at a time -----------------------------------
// Each thread walks its rows in order, and each row is one sequential read with four
// independent accumulators along K: the pattern the hardware prefetcher streams best (measured:
// 40% more bandwidth than four rows interleaved). The row (a few hundred bytes to a few KiB)
// stays in L1 while the M activation rows pass over it, so the weight is read from memory once.

#ifdef FXQ_VBMI
inline __m512 add4(const __m512 a[4]) {
  return _mm512_add_ps(_mm512_add_ps(a[0], a[1]), _mm512_add_ps(a[2], a[3]));
}

// a[q] += x[16q .. 16q + 15] * w[16q .. 16q + 15] for 64 e4m3 weights, decoded by table lookup
inline void fma_fp8x64(const float* x, const uint8_t* w, __m512 a[4]) {
  const Fp8Bytes b = fp8_bf16_bytes(_mm512_loadu_si512(w));
  a[0] = _mm512_fmadd_ps(_mm512_loadu_ps(x), fp8_quarter_f32<0>(b), a[0]);
  a[1] = _mm512_fmadd_ps(_mm512_loadu_ps(x + 16), fp8_quarter_f32<1>(b), a[1]);
  a[2] = _mm512_fmadd_ps(_mm512_loadu_ps(x + 32), fp8_quarter_f32<2>(b), a[2]);
  a[3] = _mm512_fmadd_ps(_mm512_loadu_ps(x + 48), fp8_quarter_f32<3>(b), a[3]);
}
#endif

// sum_k x[k] * w[k] for one row of int8 or e4m3 bytes
template <Fmt F>
inline float dot_bytes(const float* x, const uint8_t* row, int64_t K) {
  int64_t k = 0;
  float out = 0.f;
  // (An AVX-512 loop, 16 int8 weights widened a vector, ran 1.07-1.24x this one on weights in
  // cache but made a SmolLM2 int8wo+lm_head decode step, weights from memory, 1.39x slower on
  // the Zen 4: 8.16 vs 5.87 ms, packages interleaved in one process; not kept.)
#ifdef FXQ_VBMI
  if constexpr (F == Fmt::kFp8) {  // 64 weights a step, decoded by table lookup (native.h)
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
    for (; k + 64 <= K; k += 64) fma_fp8x64(x + k, row + k, a);
    out = _mm512_reduce_add_ps(add4(a));
  }
#endif
#ifdef FXQ_AVX2
  auto load = [](const uint8_t* p) {
    return F == Fmt::kInt8 ? load_int8x8((const int8_t*)p) : load_fp8x8(p);
  };
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (; k + 32 <= K; k += 32) {
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), load(row + k), a0);
    a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), load(row + k + 8), a1);
    a2 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), load(row + k + 16), a2);
    a3 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), load(row + k + 24), a3);
  }
  for (; k + 8 <= K; k += 8) a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), load(row + k), a0);
  out += hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
  for (; k < K; ++k)
    out += x[k] * (F == Fmt::kInt8 ? float(int8_t(row[k])) : fp8_e4m3_to_float(row[k]));
  return out;
}

// Four activation rows against one weight row: each 8 weights are decoded once and meet the four
// rows from L1 (x[m] is ld floats apart), so the decode is paid once per weight, not per row.
template <Fmt F>
inline void dot_bytes_x4(const float* x, int64_t ld, int64_t K, const uint8_t* row,
                         float out[4]) {
  int64_t k = 0;
  for (int m = 0; m < 4; ++m) out[m] = 0.f;
#ifdef FXQ_VBMI
  if constexpr (F == Fmt::kFp8) {  // 64 weights a step, decoded by table lookup (native.h)
    __m512 a[4], b[4];
    for (int m = 0; m < 4; ++m) a[m] = b[m] = _mm512_setzero_ps();
    for (; k + 64 <= K; k += 64) {
      const Fp8Bytes wb = fp8_bf16_bytes(_mm512_loadu_si512(row + k));
      const __m512 w0 = fp8_quarter_f32<0>(wb), w1 = fp8_quarter_f32<1>(wb);
      const __m512 w2 = fp8_quarter_f32<2>(wb), w3 = fp8_quarter_f32<3>(wb);
      for (int m = 0; m < 4; ++m) {
        const float* xm = x + m * ld + k;
        a[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xm), w0, a[m]);
        b[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xm + 16), w1, b[m]);
        a[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xm + 32), w2, a[m]);
        b[m] = _mm512_fmadd_ps(_mm512_loadu_ps(xm + 48), w3, b[m]);
      }
    }
    for (int m = 0; m < 4; ++m) out[m] = _mm512_reduce_add_ps(_mm512_add_ps(a[m], b[m]));
  }
#endif
#ifdef FXQ_AVX2
  __m256 a[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                 _mm256_setzero_ps()};
  __m256 b[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                 _mm256_setzero_ps()};
  for (; k + 16 <= K; k += 16) {
    const __m256 w0 = F == Fmt::kInt8 ? load_int8x8((const int8_t*)row + k) : load_fp8x8(row + k);
    const __m256 w1 =
        F == Fmt::kInt8 ? load_int8x8((const int8_t*)row + k + 8) : load_fp8x8(row + k + 8);
    for (int m = 0; m < 4; ++m) {
      a[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ld + k), w0, a[m]);
      b[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * ld + k + 8), w1, b[m]);
    }
  }
  for (int m = 0; m < 4; ++m) out[m] += hsum(_mm256_add_ps(a[m], b[m]));
#endif
  for (; k < K; ++k) {
    const float wv = F == Fmt::kInt8 ? float(int8_t(row[k])) : fp8_e4m3_to_float(row[k]);
    for (int m = 0; m < 4; ++m) out[m] += x[m * ld + k] * wv;
  }
}

// y[m, n] = (sum_k x[m, k] * w[n, k]) * scale[n]   (w int8 or fp8 bits)
template <Fmt F>
void gemv_bytes(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                const float* scale, float* y) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    prefetch_row_ahead(w, n, N, K);
    const uint8_t* row = w + n * K;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
      float out[4];
      dot_bytes_x4<F>(x + m * K, K, K, row, out);
      for (int i = 0; i < 4; ++i) y[(m + i) * N + n] = out[i] * scale[n];
    }
    for (; m < M; ++m) y[m * N + n] = dot_bytes<F>(x + m * K, row, K) * scale[n];
  }
}

// sum_k xq[k] * w[k] in exact int32
inline int32_t dot_int8_int8(const int8_t* x, const int8_t* row, int64_t K) {
  int64_t k = 0;
  int32_t out = 0;
#ifdef FXQ_AVX2
  const __m256i ones = _mm256_set1_epi16(1);
  auto dot32 = [&](int64_t at) {
    const __m256i xv = _mm256_loadu_si256((const __m256i*)(x + at));
    const __m256i wv = _mm256_loadu_si256((const __m256i*)(row + at));
    return dot32_int8(_mm256_sign_epi8(xv, xv), xv, wv, ones);
  };
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (; k + 128 <= K; k += 128) {
    a0 = _mm256_add_epi32(a0, dot32(k));
    a1 = _mm256_add_epi32(a1, dot32(k + 32));
    a2 = _mm256_add_epi32(a2, dot32(k + 64));
    a3 = _mm256_add_epi32(a3, dot32(k + 96));
  }
  for (; k + 32 <= K; k += 32) a0 = _mm256_add_epi32(a0, dot32(k));
  out = hsum_i32(_mm256_add_epi32(_mm256_add_epi32(a0, a1), _mm256_add_epi32(a2, a3)));
#endif
  for (; k < K; ++k) out += int32_t(x[k]) * row[k];
  return out;
}

#ifdef FXQ_VNNI512
// Up to four activation rows, as unsigned bytes xu = xq + 128 (xu[m * K + k]), against one int8
// weight row: vpdpbusd adds four u8 x s8 products into each int32 lane without saturation
// (|sum| <= K * 255 * 127 < 2^31 for K < 66000), so the sums are exact; with `wsum` it also sums
// the row itself (against bytes of 1), which takes the +128 back out: xq . w = xu . w - 128 sum w.
template <int R>
inline void dot_u8s8(const uint8_t* xu, int64_t K, const int8_t* row, int32_t out[R],
                     int32_t* wsum) {
  __m512i acc[R];
  for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_si512();
  __m512i ws = _mm512_setzero_si512();
  const __m512i ones = _mm512_set1_epi8(1);
  for (int64_t k = 0; k < K; k += 64) {
    // the tail's masked loads read nothing past the row and add zeros
    const __mmask64 mask = K - k >= 64 ? ~__mmask64(0) : (__mmask64(1) << (K - k)) - 1;
    const __m512i wv = _mm512_maskz_loadu_epi8(mask, row + k);
    for (int m = 0; m < R; ++m)
      acc[m] = _mm512_dpbusd_epi32(acc[m], _mm512_maskz_loadu_epi8(mask, xu + m * K + k), wv);
    if (wsum) ws = _mm512_dpbusd_epi32(ws, ones, wv);
  }
  for (int m = 0; m < R; ++m) out[m] = _mm512_reduce_add_epi32(acc[m]);
  if (wsum) *wsum = _mm512_reduce_add_epi32(ws);
}
#endif

// y[m, n] = (sum_k xq[m, k] * w[n, k]) * xs[m] * scale[n]
void gemv_int8_int8(const int8_t* xq, const float* xs, int64_t M, int64_t K, const int8_t* w,
                    int64_t N, const float* scale, float* y) {
#ifdef FXQ_VNNI512
  // AVX-512 VNNI: one vpdpbusd per 64 products (AVX2's maddubs path takes three instructions
  // per 32), four activation rows per pass over a weight row that stays in L1
  std::vector<uint8_t> xu(M * K);
  for (int64_t i = 0; i < M * K; ++i) xu[i] = uint8_t(xq[i]) ^ 0x80;  // xq + 128
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    prefetch_row_ahead(w, n, N, K);
    const int8_t* row = w + n * K;
    int32_t wsum = 0, dots[4];
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
      dot_u8s8<4>(xu.data() + m * K, K, row, dots, m == 0 ? &wsum : nullptr);
      for (int i = 0; i < 4; ++i)
        y[(m + i) * N + n] = float(dots[i] - 128 * wsum) * xs[m + i] * scale[n];
    }
    for (; m < M; ++m) {
      dot_u8s8<1>(xu.data() + m * K, K, row, dots, m == 0 ? &wsum : nullptr);
      y[m * N + n] = float(dots[0] - 128 * wsum) * xs[m] * scale[n];
    }
  }
#else
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    prefetch_row_ahead(w, n, N, K);
    for (int64_t m = 0; m < M; ++m)
      y[m * N + n] = float(dot_int8_int8(xq + m * K, w + n * K, K)) * xs[m] * scale[n];
  }
#endif
}

// The activations as unsigned bytes (xq + 128), rows padded with 128 to whole quads (the
// padding meets zero weights)
std::unique_ptr<uint8_t[]> unsigned_rows(const int8_t* xq, int64_t M, int64_t K, int64_t ldx) {
  std::unique_ptr<uint8_t[]> xu(new uint8_t[M * ldx]);  // every byte written below
#pragma omp parallel for schedule(static) if (M * K > 65536)
  for (int64_t m = 0; m < M; ++m) {
    uint8_t* row = xu.get() + m * ldx;
    for (int64_t k = 0; k < K; ++k) row[k] = uint8_t(xq[m * K + k]) ^ 0x80;
    std::memset(row + K, 0x80, ldx - K);
  }
  return xu;
}

#ifdef FXQ_AVX2
// ---- GEMM for larger M: int8 x int8 in exact int32, packed weight panels ---------------------
// Above a few rows the GEMV's one-weight-row-at-a-time dot products leave the multipliers idle
// on loads and horizontal sums. Here, as in fbgemm and oneDNN, the weight is read in panels of
// 8 output columns laid out k-quad by k-quad (32 bytes: the 8 columns' next 4 k), so one
// broadcast activation quad meets 8 columns in one maddubs and each int32 lane is one output:
// no horizontal sums, and every load is a whole vector. The panels are packed from the int8
// [N, K] weight per call, per block, into a buffer that stays in L1 while every activation row
// passes over it (an 8 x 8 transpose of 32-bit quads: a few percent of the GEMM's time at 16
// rows), so the stored weight keeps the one layout the GEMV and the other candidates read.
// Products as in dot_int8_int8 (dot32_int8's sign trick), summed exactly in int32, then
// float(sum) * xs[m] * scale[n]: bit for bit the GEMV's y.
// Measured on the AVX2 EPYC (Zen 3), one thread, against the sign trick's register-only bound
// of ~65 GMAC/s: 65-69 GMAC/s at M = 128 on SmolLM2's and the benchmark stack's shapes, where
// the row-layout register tiles this replaces ran 43-53 (benchmarks/cpu_kernels.py has the
// per-model figures).

// One panel from `rows` (<= 8) weight rows: K4 = ceil(K / 4) quads of 32 bytes, byte
// [g * 32 + c * 4 + t] = w[c, 4g + t]; missing rows and k past K are zeros (they add nothing).
// Quad g goes to out[g * stride] (stride 2: one half of the VNNI GEMM's 16-column panel).
inline void pack_panel(const int8_t* w, int64_t K, int64_t rows, __m256i* out,
                       int64_t stride = 1) {
  const int64_t K4 = (K + 3) / 4;
  int64_t k = 0;
  if (rows == 8)
    for (; k + 32 <= K; k += 32) {
      __m256i r[8];
      for (int c = 0; c < 8; ++c) r[c] = _mm256_loadu_si256((const __m256i*)(w + c * K + k));
      transpose8x8_epi32(r);
      for (int g = 0; g < 8; ++g) _mm256_store_si256(out + (k / 4 + g) * stride, r[g]);
    }
  for (int64_t g = k / 4; g < K4; ++g) {
    alignas(32) int8_t q[32];
    for (int c = 0; c < 8; ++c)
      for (int t = 0; t < 4; ++t) {
        const int64_t kk = g * 4 + t;
        q[c * 4 + t] = c < rows && kk < K ? w[c * K + kk] : 0;
      }
    out[g * stride] = _mm256_load_si256((const __m256i*)q);
  }
}

// y[i, 8p + c] for R activation rows x P panels: K4 broadcast quads of each row against the
// panels' vectors; `x` rows are ldx bytes apart and hold K4 * 4 readable bytes
template <int R, int P>
inline void panel_tile(const int8_t* x, int64_t ldx, const __m256i* wp, int64_t K4, const float* xs,
                       const float* scale, float* y, int64_t N, int64_t n0) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[R][P];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < P; ++j) acc[i][j] = _mm256_setzero_si256();
  for (int64_t g = 0; g < K4; ++g) {
    __m256i wv[P];
    for (int j = 0; j < P; ++j) wv[j] = _mm256_load_si256(wp + j * K4 + g);
    for (int i = 0; i < R; ++i) {
      const __m256i xv = broadcast_quad(x + i * ldx + g * 4);
      const __m256i ax = _mm256_sign_epi8(xv, xv);  // |x|, once for the P panels
      for (int j = 0; j < P; ++j)
        acc[i][j] = _mm256_add_epi32(acc[i][j], dot32_int8(ax, xv, wv[j], ones));
    }
  }
  for (int i = 0; i < R; ++i) {
    const __m256 xsv = _mm256_set1_ps(xs[i]);
    for (int j = 0; j < P; ++j) {
      const int64_t n = n0 + 8 * j;
      const __m256 v = _mm256_mul_ps(_mm256_cvtepi32_ps(acc[i][j]), xsv);
      store_columns(y + i * N + n, _mm256_mul_ps(v, load_columns(scale + n, N - n)), N - n);
    }
  }
}

// R rows x up to 3 panels, the panel count a runtime value (the block's last tile)
template <int R>
inline void panel_tile_n(int64_t panels, const int8_t* x, int64_t ldx, const __m256i* wp,
                         int64_t K4, const float* xs, const float* scale, float* y, int64_t N,
                         int64_t n0) {
  if (panels == 3) panel_tile<R, 3>(x, ldx, wp, K4, xs, scale, y, N, n0);
  if (panels == 2) panel_tile<R, 2>(x, ldx, wp, K4, xs, scale, y, N, n0);
  if (panels == 1) panel_tile<R, 1>(x, ldx, wp, K4, xs, scale, y, N, n0);
}

#ifdef FXQ_VNNI512
// ---- The same GEMM with AVX-512 VNNI ---------------------------------------------------------
// Panels 16 columns wide (64 bytes per k-quad: the two halves packed as above), and one
// vpdpbusd adds a broadcast activation quad's 4 products into each of the 16 columns' int32
// lanes: 64 multiply-adds per instruction where the sign trick takes three for 32. vpdpbusd
// multiplies unsigned by signed bytes, so the activations enter as xu = xq + 128 and each
// column's own sum takes the +128 back out, xq . w = xu . w - 128 sum w, exact in int32 as in
// the VNNI GEMV (whose y this matches bit for bit). Measured on the AMD EPYC Zen 4, two threads,
// against torch._int_mm and quantize_dynamic's fbgemm on the same inputs (a one-off comparison,
// not a benchmarks/ script): at M = 128-512 0.9-1.3x their speed on the benchmark stack's
// 1024 x 4096 and 4096 x 1024, 0.7-1.1x on SmolLM2's 576 x 1536 and 1536 x 576 (per call the
// pack costs what ~4 rows do); benchmarks/cpu_kernels.py decides where it runs.

// One 16-column panel from `rows` (<= 16) weight rows, and 128 x each column's sum in `comp`
inline void pack_panel16(const int8_t* w, int64_t K, int64_t rows, __m512i* out, __m512i* comp) {
  const int64_t K4 = (K + 3) / 4;
  pack_panel(w, K, std::min<int64_t>(rows, 8), (__m256i*)out, 2);
  pack_panel(rows > 8 ? w + 8 * K : w, K, std::max<int64_t>(rows - 8, 0), (__m256i*)out + 1, 2);
  const __m512i ones = _mm512_set1_epi8(1);
  __m512i sum = _mm512_setzero_si512();
  for (int64_t g = 0; g < K4; ++g) sum = _mm512_dpbusd_epi32(sum, ones, out[g]);
  *comp = _mm512_slli_epi32(sum, 7);
}

// y[i, 16p + c] for R activation rows (xu, ldx bytes apart) x P panels (weights and column sums
// read unaligned: a prepacked weight is a tensor, which promises no 64-byte alignment; on
// aligned data the unaligned loads cost the same). The unroll pragmas and
// the attribute keep the R x P accumulators in registers: without them GCC 12 copied every
// accumulator out and back once per k-quad, or spilled it (its partial redundancy elimination
// hoists the loop's loads and leaves no registers; seen in the assembly), and the GEMM ran at
// half of _int_mm's speed.
template <int R, int P>
__attribute__((optimize("no-tree-pre"))) void panel16_tile(
    const uint8_t* xu, int64_t ldx, const __m512i* wp, const __m512i* comp, int64_t K4,
    const float* xs, const float* scale, float* y, int64_t N, int64_t n0) {
  __m512i acc[R][P];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < P; ++j) acc[i][j] = _mm512_setzero_si512();
  for (int64_t g = 0; g < K4; ++g) {
    __m512i wv[P];
#pragma GCC unroll 8
    for (int j = 0; j < P; ++j) wv[j] = _mm512_loadu_si512(wp + j * K4 + g);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      int32_t quad;
      std::memcpy(&quad, xu + i * ldx + g * 4, 4);
      const __m512i xv = _mm512_set1_epi32(quad);
#pragma GCC unroll 8
      for (int j = 0; j < P; ++j) acc[i][j] = _mm512_dpbusd_epi32(acc[i][j], xv, wv[j]);
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < P; ++j) {
    const int64_t n = n0 + 16 * j, cols = N - n;
    const __mmask16 mask = first_columns16(cols);
    const __m512 sv = _mm512_maskz_loadu_ps(mask, scale + n);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i) {
      const __m512i c = _mm512_loadu_si512(comp + j);
      const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc[i][j], c)),
                                     _mm512_set1_ps(xs[i]));
      _mm512_mask_storeu_ps(y + i * N + n, mask, _mm512_mul_ps(v, sv));
    }
  }
}

// up to R rows x up to P panels, both counts runtime values (the last tiles)
template <int R, int P>
inline void panel16_tile_n(int64_t rows, int64_t panels, const uint8_t* xu, int64_t ldx,
                           const __m512i* wp, const __m512i* comp, int64_t K4, const float* xs,
                           const float* scale, float* y, int64_t N, int64_t n0) {
  if constexpr (R > 1)
    if (rows < R)
      return panel16_tile_n<R - 1, P>(rows, panels, xu, ldx, wp, comp, K4, xs, scale, y, N, n0);
  if constexpr (P > 1)
    if (panels < P)
      return panel16_tile_n<R, P - 1>(rows, panels, xu, ldx, wp, comp, K4, xs, scale, y, N, n0);
  panel16_tile<R, P>(xu, ldx, wp, comp, K4, xs, scale, y, N, n0);
}

void gemm_int8_int8_vnni(const int8_t* xq, const float* xs, int64_t M, int64_t K,
                         const int8_t* w, int64_t N, const float* scale, float* y) {
  constexpr int R = 6, P = 4;  // 24 accumulators + 4 panel vectors + a broadcast, of 32
  const int64_t K4 = (K + 3) / 4, panels = (N + 15) / 16;
  const PanelWork work(panels, K4 * 64, M, P, R, omp_get_max_threads());
  const int64_t ldx = K4 * 4;
  const std::unique_ptr<uint8_t[]> xu = unsigned_rows(xq, M, K, ldx);
#pragma omp parallel
  {
    std::vector<__m512i> buf(work.block_panels * K4), comp(work.block_panels);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < work.items(); ++item) {
      int64_t p0, p1, m0, m1;
      work.item(item, M, &p0, &p1, &m0, &m1);
      for (int64_t p = p0; p < p1; ++p)
        pack_panel16(w + p * 16 * K, K, std::min<int64_t>(16, N - p * 16), &buf[(p - p0) * K4],
                     &comp[p - p0]);
      for (int64_t m = m0; m < m1; m += R)
        for (int64_t p = p0; p < p1; p += P)
          panel16_tile_n<R, P>(m1 - m, p1 - p, xu.get() + m * ldx, ldx, &buf[(p - p0) * K4],
                               &comp[p - p0], K4, xs + m, scale, y + m * N, N, p * 16);
    }
  }
}

// The same product on a weight the lowering packed once (fxquant.kernels.cpu.prepack_int8_vnni:
// the panels pack_panel16 writes, one after another, and their 128 x column sums): no pack per
// call, so the tiles read the weight where it lies, and at every M, one row included (R = 1 is
// a GEMV over the panels: one 64-byte load and one vpdpbusd per 64 weights).
// The activations come as xu = xq + 128 (unsigned_rows' layout: rows of K4 * 4 bytes).
void gemm_int8_int8_vnni_packed(const uint8_t* xu, const float* xs, int64_t M, int64_t K,
                                const __m512i* wp, const __m512i* comp, int64_t N,
                                const float* scale, float* y) {
  constexpr int R = 6, P = 4;
  const int64_t K4 = (K + 3) / 4, panels = (N + 15) / 16;
  const PanelWork work(panels, K4 * 64, M, P, R, omp_get_max_threads());
  const int64_t ldx = K4 * 4;
#pragma omp parallel for schedule(static)
  for (int64_t item = 0; item < work.items(); ++item) {
    int64_t p0, p1, m0, m1;
    work.item(item, M, &p0, &p1, &m0, &m1);
    for (int64_t m = m0; m < m1; m += R)
      for (int64_t p = p0; p < p1; p += P)
        panel16_tile_n<R, P>(m1 - m, p1 - p, xu + m * ldx, ldx, wp + p * K4, comp + p,
                             K4, xs + m, scale, y + m * N, N, p * 16);
  }
}

#ifdef FXQ_AMX
// The same product on AMX tiles (amx.h), from kAmxMinM rows, where K is whole 64-k tile steps
// (K4 % 16 == 0; the others keep the AVX-512 tiles): the panels are B tiles as stored, xu's
// rows the A tiles, and TDPBUSD's u8 x s8 int32 sums the same as vpdpbusd's, less the same
// column sums; the same output expression, so the same fp32 values.
void gemm_int8_int8_amx(const uint8_t* xu, const float* xs, int64_t M, int64_t K,
                        const int8_t* wp, const __m512i* comp, int64_t N, const float* scale,
                        float* y) {
  const int64_t K4 = (K + 3) / 4, panels = (N + 15) / 16;
  auto prepare = [&](int64_t p0, int64_t, std::vector<uint8_t>&) {
    return (const uint8_t*)(wp + p0 * K4 * 64);
  };
  auto store = [&](int64_t m0, int64_t rows, int64_t p, int np, int64_t, const uint8_t*,
                   const int32_t* c, float*) {
    for (int j = 0; j < np; ++j) {
      const int64_t n = (p + j) * 16, cols = N - n;
      const __mmask16 mask = first_columns16(cols);
      const __m512 sv = _mm512_maskz_loadu_ps(mask, scale + n);
      const __m512i cv = _mm512_loadu_si512(comp + p + j);
      for (int64_t i = 0; i < rows; ++i) {
        const __m512i acc = _mm512_loadu_si512(c + (i * np + j) * 16);
        const __m512 v = _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_sub_epi32(acc, cv)),
                                       _mm512_set1_ps(xs[m0 + i]));
        _mm512_mask_storeu_ps(y + (m0 + i) * N + n, mask, _mm512_mul_ps(v, sv));
      }
    }
  };
  amx_gemm<Amx::kInt8>(xu, K4 * 4, M, K4 / 16, panels, K4 * 64, prepare, store);
}
#endif
#endif

// y[m, n] = (sum_k xq[m, k] * w[n, k]) * xs[m] * scale[n], for M past the GEMV's limit
[[maybe_unused]] void gemm_int8_int8(const int8_t* xq, const float* xs, int64_t M, int64_t K,
                                     const int8_t* w, int64_t N, const float* scale, float* y) {
  constexpr int R = 3, P = 3;  // 9 accumulators + 3 panel vectors + 4 working registers of 16
  const int64_t K4 = (K + 3) / 4, panels = (N + 7) / 8;
  // a block of panels (about 32 KiB, L1) is packed once and met by every activation row
  const int64_t pb = std::max<int64_t>(P, 32 * 1024 / (K4 * 32) / P * P);
  const int64_t blocks = (panels + pb - 1) / pb;
  // the quads read whole 4 bytes: rows are copied with zero padding when K is not a multiple
  std::vector<int8_t> padded;
  const int8_t* x = xq;
  int64_t ldx = K;
  if (K % 4) {
    padded.assign(M * K4 * 4, 0);
    for (int64_t m = 0; m < M; ++m) std::memcpy(&padded[m * K4 * 4], xq + m * K, K);
    x = padded.data();
    ldx = K4 * 4;
  }
#pragma omp parallel
  {
    std::vector<__m256i> buf(pb * K4);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t p0 = b * pb, p1 = std::min(panels, p0 + pb);
      for (int64_t p = p0; p < p1; ++p)
        pack_panel(w + p * 8 * K, K, std::min<int64_t>(8, N - p * 8), &buf[(p - p0) * K4]);
      // R rows (in L1) over every panel of the block, then the next R rows
      for (int64_t m = 0; m < M; m += R)
        for (int64_t p = p0; p < p1; p += P) {
          const int64_t np = std::min<int64_t>(P, p1 - p);
          const __m256i* wp = &buf[(p - p0) * K4];
          const int8_t* xm = x + m * ldx;
          if (m + R <= M)
            panel_tile_n<R>(np, xm, ldx, wp, K4, xs + m, scale, y + m * N, N, p * 8);
          else
            for (int64_t i = m; i < M; ++i)
              panel_tile_n<1>(np, x + i * ldx, ldx, wp, K4, xs + i, scale, y + i * N, N, p * 8);
        }
    }
  }
}
#endif

// Without VNNI the packed layout is read one byte at a time (a package built on a VNNI machine
// never runs here: fxquant.runtime refuses it; this serves tests that force the class)
[[maybe_unused]] void gemm_int8_int8_packed_scalar(const uint8_t* xu, const float* xs, int64_t M,
                                                   int64_t K, const int8_t* wp, int64_t N,
                                                   const float* scale, float* y) {
  const int64_t K4 = (K + 3) / 4;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const int8_t* panel = wp + (n / 16) * K4 * 64 + (n % 16) * 4;
    for (int64_t m = 0; m < M; ++m) {
      const uint8_t* x = xu + m * K4 * 4;
      int32_t acc = 0;
      for (int64_t k = 0; k < K; ++k) acc += (int32_t(x[k]) - 128) * panel[(k / 4) * 64 + k % 4];
      y[m * N + n] = float(acc) * xs[m] * scale[n];
    }
  }
}

// ---- bf16 dot products: int8 / fp8 weights x activations rounded to bf16 -----------------
// On CPUs with AVX-512 BF16 (bf16_dot.h: the row kernel and the packed-panel GEMM). Every int8
// and e4m3 value is exact in bf16 (8 significant bits; e4m3's exponent range inside bf16's), so
// the weight loses nothing when it is widened in registers; x is rounded to bf16 once per call
// (round to nearest even, ~2e-3 relative a value), and the products and their sums stay fp32.
// One activation row (decode) is not rounded: it takes the fp32 GEMV, which streams the weight
// as fast. The ops' other builds (no AVX-512 BF16) round x the same way and run the fp32
// kernels on it: the same numerics but for the order of fp32 sums, which the tests hold them to.

#ifdef FXQ_BF16_512
// 32 weight bytes from p (the first `mask` bits' worth; zeros after) widened to bf16, exact
template <Fmt F>
inline __m512bh load_bytes_bf16(const uint8_t* p, __mmask32 mask) {
  const __m256i b = _mm256_maskz_loadu_epi8(mask, p);
  const __m128i b0 = _mm256_castsi256_si128(b), b1 = _mm256_extracti128_si256(b, 1);
  if constexpr (F == Fmt::kInt8) {
    return _mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b1)),
                               _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(b0)));
  } else {
#ifdef FXQ_VBMI
    // the table lookup (native.h) on the 32 bytes, the upper half of the vector zeros
    return (__m512bh)fp8_half_bf16<0>(fp8_bf16_bytes(_mm512_zextsi256_si512(b)));
#endif
    // as load_fp8x8, 16 lanes: magnitude bits to the top of an fp32, rebiased by 2^120
    auto dec = [](__m128i q) {
      const __m512i v = _mm512_cvtepu8_epi32(q);
      const __m512i mag = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x7F)), 20);
      const __m512i sign = _mm512_slli_epi32(_mm512_and_si512(v, _mm512_set1_epi32(0x80)), 24);
      return _mm512_mul_ps(_mm512_castsi512_ps(_mm512_or_si512(mag, sign)),
                           _mm512_set1_ps(0x1p120f));
    };
    return _mm512_cvtne2ps_pbh(dec(b1), dec(b0));
  }
}

// int8 or e4m3 weight rows [N, K] as a bf16_dot.h weight source
template <Fmt F>
struct ByteWeight {
  const uint8_t* base;
  int64_t row_bytes;  // K
  struct Row {
    const uint8_t* p;
    int64_t K;
    __m512bh operator()(int64_t k) const { return load_bytes_bf16<F>(p + k, first_columns(K - k)); }
    __m512bh full(int64_t k) const { return load_bytes_bf16<F>(p + k, ~__mmask32(0)); }
  };
  Row row(int64_t n) const { return {base + n * row_bytes, row_bytes}; }
};

// ---- fp8 blocks on bf16 dot products (from 2 rows) ------------------------------------------
// xq's e4m3 values and the e4m3 weight are both exact in bf16, so the products are the
// reference's; each b-wide span's fp32 sums meet their two scales, as in the GEMV.

// R activation rows (bf16, ldx apart, zero past K) against weight row `row`: out[m] =
// sum_kb (x[m] . w over span kb) * xss[m * KB + kb], xss the product xs[m, kb] * s[kb] of the
// row's block (fp32, as the GEMV rounds it). Each span's vector sums are scaled into a second set
// of accumulators, reduced once at the end (2R + 2 registers: 8 rows at most; 16 rows, their
// totals in L1 and x interleaved so one pointer reads it, ran slower on the Zen 4).
template <int R>
inline void dot_rows_fp8_block(const uint16_t* xb, int64_t ldx, const uint8_t* row, int64_t K,
                               int64_t b, const float* xss, int64_t KB, float* out) {
  __m512 tot[R];
  for (int m = 0; m < R; ++m) tot[m] = _mm512_setzero_ps();
  for (int64_t kb = 0; kb < KB; ++kb) {
    const int64_t k1 = std::min(K, (kb + 1) * b);
    __m512 acc[R];
    for (int m = 0; m < R; ++m) acc[m] = _mm512_setzero_ps();
    for (int64_t k = kb * b; k < k1; k += 32) {
      const __m512bh wv = load_bytes_bf16<Fmt::kFp8>(row + k, first_columns(k1 - k));
      for (int m = 0; m < R; ++m)
        acc[m] = _mm512_dpbf16_ps(acc[m], (__m512bh)_mm512_load_si512(xb + m * ldx + k), wv);
    }
    for (int m = 0; m < R; ++m)
      tot[m] = _mm512_fmadd_ps(acc[m], _mm512_set1_ps(xss[m * KB + kb]), tot[m]);
  }
  for (int m = 0; m < R; ++m) out[m] = _mm512_reduce_add_ps(tot[m]);
}

void gemm_rows_fp8_block(const Bf16Rows& x, const float* xs, int64_t M, int64_t K,
                         const uint8_t* w, int64_t N, const float* ws, int64_t b, float* y) {
  const int64_t KB = (K + b - 1) / b, NB = (N + b - 1) / b;
  // xss[nb][m][kb] = xs[m, kb] * ws[nb, kb]: the scale each span's sums take, multiplied once
  // per block row of the weight, not once per weight row (the fma reads it as a broadcast)
  std::vector<float> xss(NB * M * KB);
  for (int64_t nb = 0; nb < NB; ++nb)
    for (int64_t m = 0; m < M; ++m)
      for (int64_t kb = 0; kb < KB; ++kb)
        xss[(nb * M + m) * KB + kb] = xs[m * KB + kb] * ws[nb * KB + kb];
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    prefetch_row_ahead(w, n, N, K);
    const uint8_t* row = w + n * K;
    const float* sc = xss.data() + (n / b) * M * KB;
    float out[8];
    auto rows = [&](auto r, int64_t m) {
      constexpr int R = decltype(r)::value;
      dot_rows_fp8_block<R>(x.data + m * x.ldx, x.ldx, row, K, b, sc + m * KB, KB, out);
      for (int i = 0; i < R; ++i) y[(m + i) * N + n] = out[i];
      return m + R;
    };
    int64_t m = 0;
    while (M - m >= 8) m = rows(std::integral_constant<int, 8>(), m);
    if (M - m >= 4) m = rows(std::integral_constant<int, 4>(), m);
    if (M - m >= 2) m = rows(std::integral_constant<int, 2>(), m);
    if (M - m >= 1) rows(std::integral_constant<int, 1>(), m);
  }
}

#ifdef FXQ_AMX
// columns [k0, k0 + len) of e4m3 weight rows [N, K] (base = w + k0) as a weight source: one
// span column of a block-scaled weight, for the AMX tile GEMM (which does not prefetch rows)
struct Fp8Span {
  const uint8_t* base;
  int64_t row_bytes;  // K
  int64_t len;
  ByteWeight<Fmt::kFp8>::Row row(int64_t n) const { return {base + n * row_bytes, len}; }
};
#endif

// The packed-panel GEMM (bf16_dot.h's panels and tiles) with the spans' scales: an R x P tile
// sums one span (b / 2 k-pairs) at a time, then adds its sums times xs[i, kb] * ws[nb, kb] into y
// (R x 16P floats, which stay in L1 across the spans; a 16-column panel lies in one weight tile,
// b being a multiple of 16). The first span stores, the others add.
template <int R, int P>
__attribute__((optimize("no-tree-pre"))) void panel_fp8_block_tile(
    const uint16_t* xb, int64_t ldx, const __m512i* wp, int64_t K2, int64_t b, const float* xs,
    int64_t KB, const float* ws, float* y, int64_t N, int64_t n0) {
  for (int64_t kb = 0, g0 = 0; g0 < K2; ++kb, g0 += b / 2) {
    __m512 acc[R][P];
    panel_bf16_sums<R, P>(xb, ldx, wp, K2, g0, std::min(K2, g0 + b / 2), acc);
#pragma GCC unroll 8
    for (int j = 0; j < P; ++j) {
      const int64_t n = n0 + 16 * j;
      const __mmask16 mask = first_columns16(N - n);
      const float wsj = ws[(n / b) * KB + kb];
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        const __m512 v = _mm512_mul_ps(acc[i][j], _mm512_set1_ps(xs[i * KB + kb] * wsj));
        float* out = y + i * N + n;
        _mm512_mask_storeu_ps(
            out, mask, kb == 0 ? v : _mm512_add_ps(_mm512_maskz_loadu_ps(mask, out), v));
      }
    }
  }
}

// up to R rows x up to P panels, both counts runtime values (the last tiles)
template <int R, int P>
inline void panel_fp8_block_tile_n(int64_t rows, int64_t panels, const uint16_t* xb, int64_t ldx,
                                   const __m512i* wp, int64_t K2, int64_t b, const float* xs,
                                   int64_t KB, const float* ws, float* y, int64_t N, int64_t n0) {
  if constexpr (R > 1)
    if (rows < R)
      return panel_fp8_block_tile_n<R - 1, P>(rows, panels, xb, ldx, wp, K2, b, xs, KB, ws, y, N,
                                              n0);
  if constexpr (P > 1)
    if (panels < P)
      return panel_fp8_block_tile_n<R, P - 1>(rows, panels, xb, ldx, wp, K2, b, xs, KB, ws, y, N,
                                              n0);
  panel_fp8_block_tile<R, P>(xb, ldx, wp, K2, b, xs, KB, ws, y, N, n0);
}

void gemm_panels_fp8_block(const Bf16Rows& x, const float* xs, int64_t M, int64_t K,
                           const uint8_t* w, int64_t N, const float* ws, int64_t b, float* y) {
  constexpr int R = 6, P = 4;  // as gemm_panels_bf16
  const int64_t K2 = (K + 1) / 2, KB = (K + b - 1) / b;
  for_panel_tiles<R, P>(M, K, ByteWeight<Fmt::kFp8>{w, K}, N,
                        [&](int64_t m, int64_t rows, int64_t p, int64_t np, const __m512i* wp) {
                          panel_fp8_block_tile_n<R, P>(rows, np, x.data + m * x.ldx, x.ldx, wp,
                                                       K2, b, xs + m * KB, KB, ws, y + m * N, N,
                                                       p * 16);
                        });
}

#ifdef FXQ_AMX
struct BlockPartTag {};

// On AMX tiles (where Linux granted them): one tile GEMM (bf16_dot.h) per span column, its
// columns times that column's tile scales, added into y times each row's group scale (the
// tiles keep their sums inside amx_gemm; not measured against the AVX-512 panels above)
void gemm_amx_fp8_block(const Bf16Rows& x, const float* xs, int64_t M, int64_t K,
                        const uint8_t* w, int64_t N, const float* ws, int64_t b, float* y) {
  const int64_t KB = (K + b - 1) / b;
  float* part = thread_buffer<BlockPartTag>(M * N);  // each span's product, written whole
  std::vector<float> col(N);
  for (int64_t kb = 0; kb < KB; ++kb) {
    const int64_t k0 = kb * b, len = std::min(b, K - k0);
    for (int64_t n = 0; n < N; ++n) col[n] = ws[(n / b) * KB + kb];
    gemm_amx_bf16(Bf16Rows(x, k0), M, len, Fp8Span{w + k0, K, len}, N, col.data(), part);
#pragma omp parallel for schedule(static)
    for (int64_t m = 0; m < M; ++m) {
      const float f = xs[m * KB + kb];
      float* ym = y + m * N;
      const float* pm = part + m * N;
      if (kb == 0)
        for (int64_t n = 0; n < N; ++n) ym[n] = pm[n] * f;
      else
        for (int64_t n = 0; n < N; ++n) ym[n] += pm[n] * f;
    }
  }
}
#endif

// From the panel GEMM's M
void gemm_large_fp8_block(const Bf16Rows& x, const float* xs, int64_t M, int64_t K,
                          const uint8_t* w, int64_t N, const float* ws, int64_t b, float* y) {
#ifdef FXQ_AMX
  if (amx_ready()) return gemm_amx_fp8_block(x, xs, M, K, w, N, ws, b, y);
#endif
  gemm_panels_fp8_block(x, xs, M, K, w, N, ws, b, y);
}
#endif

// ---- Shims' shared body: int8 and fp8 weights, fp32 activations ---------------------------

// y[m, :] *= row_scale[m] (nothing without row scales)
void scale_rows(float* y, int64_t M, int64_t N, const float* row_scale) {
  if (row_scale == nullptr) return;
#pragma omp parallel for schedule(static) if (M * N > 65536)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t n = 0; n < N; ++n) y[m * N + n] *= row_scale[m];
}

// y = (x . w) * scale [* row_scale] for fp32 rows x [M, K]: the byte formats' shims' body.
// bf16_x: the bf16-dot ops (x rounded to bf16, fp32 sums), else fp32 x as it is
AOTITorchError bytes_rows(Fmt fmt, const float* xp, int64_t M, int64_t K, const Mat& wm,
                          const Mat& sm, AtenTensorHandle* ret0, bool bf16_x,
                          const float* row_scale = nullptr) {
  if (wm.cols != K || sm.rows != wm.rows) return AOTI_TORCH_FAILURE;
  const int64_t N = wm.rows;
  const uint8_t* wp = wm.as<uint8_t>();
  const float* sp = sm.as<float>();
  std::vector<float> rounded;
  // one row (decode) keeps fp32 x: there the fp32 GEMV reads the weight as fast (one pass,
  // memory-bound), so the bf16 ops compute the scheme's own numerics at decode
  if (bf16_x && M >= kBf16MinM) {
#ifdef FXQ_BF16_512
    float* y = nullptr;
    if (AOTITorchError e = new_output(M, N, ret0, &y)) return e;
    if (N == 0) return AOTI_TORCH_SUCCESS;
    if (fmt == Fmt::kInt8)
      gemm_bf16(xp, M, K, ByteWeight<Fmt::kInt8>{wp, K}, N, sp, y);
    else
      gemm_bf16(xp, M, K, ByteWeight<Fmt::kFp8>{wp, K}, N, sp, y);
    scale_rows(y, M, N, row_scale);
    return AOTI_TORCH_SUCCESS;
#else
    rounded = bf16_rounded(xp, M, K);
    xp = rounded.data();
#endif
  }
  auto gemv = [&](float* y) {
    if (fmt == Fmt::kInt8)
      gemv_bytes<Fmt::kInt8>(xp, M, K, wp, N, sp, y);
    else
      gemv_bytes<Fmt::kFp8>(xp, M, K, wp, N, sp, y);
    scale_rows(y, M, N, row_scale);
  };
  auto mm = [&](float* y) {
    const AOTITorchError e = gemm_chunked(fmt, xp, M, K, wp, N, sp, nullptr, 0, y);
    scale_rows(y, M, N, row_scale);
    return e;
  };
  return run_linear(M, N, kGemvMaxM[int(fmt)], ret0, gemv, mm);
}

AOTITorchError bytes_linear(Fmt fmt, int32_t w_dtype, AtenTensorHandle x, AtenTensorHandle w,
                            AtenTensorHandle scale, AtenTensorHandle* ret0, bool bf16_x = false) {
  Mat xm, wm, sm;
  if (!view(x, 2, aoti_torch_dtype_float32(), &xm) || !view(w, 2, w_dtype, &wm) ||
      !view(scale, 1, aoti_torch_dtype_float32(), &sm))
    return AOTI_TORCH_FAILURE;
  return bytes_rows(fmt, xm.as<float>(), xm.rows, xm.cols, wm, sm, ret0, bf16_x);
}

// fp8 with dynamic per-row activations: x quantized per token onto the e4m3 grid here
// (quantize_fp8_rows), the e4m3 GEMM on those values, each row times its scale
AOTITorchError float8_dynamic_linear(AtenTensorHandle x, AtenTensorHandle w,
                                     AtenTensorHandle scale, double scale_ub,
                                     AtenTensorHandle* ret0, bool bf16_x) {
  Mat xm, wm, sm;
  if (!view(x, 2, aoti_torch_dtype_float32(), &xm) ||
      !view(w, 2, aoti_torch_dtype_float8_e4m3fn(), &wm) ||
      !view(scale, 1, aoti_torch_dtype_float32(), &sm))
    return AOTI_TORCH_FAILURE;
  const int64_t M = xm.rows, K = xm.cols;
  std::unique_ptr<float[]> xq(new float[M * K]);  // every value written by the quantizer
  std::vector<float> xs(M);
  quantize_fp8_rows(xm.as<float>(), M, K, float(scale_ub), xq.get(), xs.data());
  return bytes_rows(Fmt::kFp8, xq.get(), M, K, wm, sm, ret0, bf16_x, xs.data());
}

// ---- fp8 with block scales (DeepSeek-V3's): b x b weight tiles, 1 x b activation groups ------
// The reference (float8_block_scaled_linear) multiplies the dequantized x (xq * xs, each group's
// scale) by the dequantized weight (w * ws, each tile's scale) in fp32. Here, up to the GEMV
// limit, each b-wide span of a weight row is decoded once and meets up to four activation rows,
// its fp32 sums times xs[m, kb] * ws[n / b, kb]: the same products (e4m3 x e4m3 is exact in
// fp32) with the scales applied once a span rather than once a value, a difference of fp32
// rounding. Above it both operands are dequantized as the reference does and go to ATen's mm
// a chunk of weight rows at a time. On CPUs with AVX-512 BF16 every M from 2 takes the bf16
// kernels above instead (the same products and span scales). xq holds e4m3 values as fp32;
// xs [M, KB], ws [NB, KB].

#ifdef FXQ_VBMI
// One activation row against one weight row in b-wide spans (b a multiple of 64): each span's
// vector sums times its two scales into a vector total, summed across lanes once a row (a
// horizontal sum a span cost a third of the GEMV's time at M = 1)
inline float dot_fp8_spans(const float* x, const uint8_t* row, int64_t K, int64_t b,
                           const float* xs, const float* s) {
  __m512 tot = _mm512_setzero_ps();
  float tail = 0.f;
  for (int64_t kb = 0, k0 = 0; k0 < K; ++kb, k0 += b) {
    const int64_t k1 = std::min(K, k0 + b);
    const float f = xs[kb] * s[kb];
    __m512 a[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
    int64_t k = k0;
    for (; k + 64 <= k1; k += 64) fma_fp8x64(x + k, row + k, a);
    tot = _mm512_fmadd_ps(add4(a), _mm512_set1_ps(f), tot);
    if (k < k1) tail += dot_bytes<Fmt::kFp8>(x + k, row + k, k1 - k) * f;  // a ragged last span
  }
  return _mm512_reduce_add_ps(tot) + tail;
}
#endif

void gemv_fp8_block(const float* xq, const float* xs, int64_t M, int64_t K, const uint8_t* w,
                    int64_t N, const float* ws, int64_t b, float* y) {
  const int64_t KB = (K + b - 1) / b;
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    prefetch_row_ahead(w, n, N, K);
    const uint8_t* row = w + n * K;
    const float* s = ws + (n / b) * KB;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
      for (int64_t kb = 0; kb < KB; ++kb) {
        const int64_t k0 = kb * b;
        float out[4];
        dot_bytes_x4<Fmt::kFp8>(xq + m * K + k0, K, std::min(b, K - k0), row + k0, out);
        for (int i = 0; i < 4; ++i) acc[i] += out[i] * (xs[(m + i) * KB + kb] * s[kb]);
      }
      for (int i = 0; i < 4; ++i) y[(m + i) * N + n] = acc[i];
    }
    for (; m < M; ++m) {
#ifdef FXQ_VBMI
      if (b % 64 == 0) {
        y[m * N + n] = dot_fp8_spans(xq + m * K, row, K, b, xs + m * KB, s);
        continue;
      }
#endif
      float acc = 0.f;
      for (int64_t kb = 0; kb < KB; ++kb) {
        const int64_t k0 = kb * b;
        const float d = dot_bytes<Fmt::kFp8>(xq + m * K + k0, row + k0, std::min(b, K - k0));
        acc += d * (xs[m * KB + kb] * s[kb]);
      }
      y[m * N + n] = acc;
    }
  }
}

struct BlockChunkTag {};

// Large M: x dequantized once (xq * xs), the weight a chunk of rows at a time (w * ws), ATen's mm
AOTITorchError gemm_fp8_block(const float* xq, const float* xs, int64_t M, int64_t K,
                              const uint8_t* w, int64_t N, const float* ws, int64_t b, float* y) {
  const int64_t KB = (K + b - 1) / b;
  std::unique_ptr<float[]> xd(new float[M * K]);  // every value written below
#pragma omp parallel for schedule(static) if (M * K > 65536)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k0 = 0, kb = 0; k0 < K; k0 += b, ++kb) {
      const float s = xs[m * KB + kb];
      for (int64_t k = k0; k < std::min(K, k0 + b); ++k) xd[m * K + k] = xq[m * K + k] * s;
    }
  auto fill = [&](int64_t n0, int64_t nc, float* buf) {
#pragma omp parallel for schedule(static)
    for (int64_t r = 0; r < nc; ++r) {
      const int64_t n = n0 + r;
      for (int64_t k0 = 0, kb = 0; k0 < K; k0 += b, ++kb)
        fp8_times(w + n * K + k0, std::min(b, K - k0), ws[(n / b) * KB + kb], buf + r * K + k0);
    }
  };
  return mm_chunks<BlockChunkTag>(xd.get(), M, K, N, y, kChunkBytes, fill);
}

// y [M, N] (M, N > 0) = the block product of xq (e4m3 values as fp32) [M, K] with its group
// scales xs [M, KB] and the e4m3 weight w [N, K] with its tile scales ws [ceil(N/b), KB], on the
// path this M takes: the block linears' and the block experts' body
AOTITorchError block_product(const float* xq, const float* xs, int64_t M, int64_t K,
                             const uint8_t* wp, int64_t N, const float* sp, int64_t b, float* y) {
#ifdef FXQ_BF16_512
  // from 2 rows, bf16 dot products (exact here: e4m3 x e4m3); one row keeps the fp32 GEMV,
  // which reads the weight as fast
  if (M >= kBf16MinM && b % 32 == 0) {
    const Bf16Rows xb(xq, M, K);
    if (M >= bf16_large_min_m())
      gemm_large_fp8_block(xb, xs, M, K, wp, N, sp, b, y);
    else
      gemm_rows_fp8_block(xb, xs, M, K, wp, N, sp, b, y);
    return AOTI_TORCH_SUCCESS;
  }
#endif
  if (M > kGemvMaxM[int(Fmt::kFp8)]) return gemm_fp8_block(xq, xs, M, K, wp, N, sp, b, y);
  gemv_fp8_block(xq, xs, M, K, wp, N, sp, b, y);
  return AOTI_TORCH_SUCCESS;
}

// the block shims' body: xq (e4m3 values as fp32) [M, K], xs [M, KB]
AOTITorchError float8_block_rows(const float* xq, const float* xs, int64_t M, int64_t K,
                                 AtenTensorHandle w, AtenTensorHandle scale, int64_t b,
                                 AtenTensorHandle* ret0) {
  Mat wm, sm;
  if (b <= 0 || !view(w, 2, aoti_torch_dtype_float8_e4m3fn(), &wm) ||
      !view(scale, 2, aoti_torch_dtype_float32(), &sm) || wm.cols != K ||
      sm.rows != (wm.rows + b - 1) / b || sm.cols != (K + b - 1) / b)
    return AOTI_TORCH_FAILURE;
  const int64_t N = wm.rows;
  float* y = nullptr;
  if (AOTITorchError e = new_output(M, N, ret0, &y)) return e;
  if (M == 0 || N == 0) return AOTI_TORCH_SUCCESS;
  return block_product(xq, xs, M, K, wm.as<uint8_t>(), N, sm.as<float>(), b, y);
}

// fp8 block with dynamic activations: x quantized in 1 x b groups here (quantize_fp8_groups: the
// reference's quantize_fp8_groups values and scales)
AOTITorchError float8_block_linear(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle scale,
                                   int64_t b, AtenTensorHandle* ret0) {
  Mat xm;
  if (b <= 0 || !view(x, 2, aoti_torch_dtype_float32(), &xm)) return AOTI_TORCH_FAILURE;
  const int64_t M = xm.rows, K = xm.cols, KB = (K + b - 1) / b;
  std::unique_ptr<float[]> xq(new float[M * K]);  // every value written by the quantizer
  std::vector<float> xs(M * KB);
  quantize_fp8_groups(xm.as<float>(), M, K, b, xq.get(), xs.data());
  return float8_block_rows(xq.get(), xs.data(), M, K, w, scale, b, ret0);
}

// ... and on an activation a fused norm quantized: xq e4m3 values as fp32, xs [M, KB]
AOTITorchError float8_block_scaled_linear(AtenTensorHandle xq, AtenTensorHandle xs,
                                          AtenTensorHandle w, AtenTensorHandle scale, int64_t b,
                                          AtenTensorHandle* ret0) {
  Mat xm, sm;
  if (b <= 0 || !view(xq, 2, aoti_torch_dtype_float32(), &xm) ||
      !view(xs, 2, aoti_torch_dtype_float32(), &sm) || sm.rows != xm.rows ||
      sm.cols != (xm.cols + b - 1) / b)
    return AOTI_TORCH_FAILURE;
  return float8_block_rows(xm.as<float>(), sm.as<float>(), xm.rows, xm.cols, w, scale, b, ret0);
}

// y [M, N] (M, N > 0) = (xq . w) * xs * scale, int32 dot products, on the stored [N, K] int8
// weight: the GEMV up to kGemvMaxMInt8Int8 rows, the integer panel GEMM above
AOTITorchError int8_int8_product(const int8_t* xp, const float* xsp, int64_t M, int64_t K,
                                 const int8_t* wp, int64_t N, const float* sp, float* y) {
  if (M <= kGemvMaxMInt8Int8) {
    gemv_int8_int8(xp, xsp, M, K, wp, N, sp, y);
    return AOTI_TORCH_SUCCESS;
  }
#if defined(FXQ_VNNI512)
  gemm_int8_int8_vnni(xp, xsp, M, K, wp, N, sp, y);
#elif defined(FXQ_AVX2)
  gemm_int8_int8(xp, xsp, M, K, wp, N, sp, y);
#else
  // without AVX2 (other ISAs, builds that force the class) every M takes the GEMV's exact
  // int32 dot products: slower than a panel GEMM, but the sums stay the reference's
  gemv_int8_int8(xp, xsp, M, K, wp, N, sp, y);
#endif
  return AOTI_TORCH_SUCCESS;
}

// y = (xq . w) * xs * scale on the stored [N, K] int8 weight: the w8a8 shims' body
AOTITorchError int8_scaled_rows(const int8_t* xp, const float* xsp, int64_t M, int64_t K,
                                AtenTensorHandle w, AtenTensorHandle scale,
                                AtenTensorHandle* ret0) {
  Mat wm, sm;
  if (!view(w, 2, aoti_torch_dtype_int8(), &wm) ||
      !view(scale, 1, aoti_torch_dtype_float32(), &sm) || wm.cols != K || sm.rows != wm.rows)
    return AOTI_TORCH_FAILURE;
  const int64_t N = wm.rows;
  float* y = nullptr;
  if (AOTITorchError e = new_output(M, N, ret0, &y)) return e;
  if (M == 0 || N == 0) return AOTI_TORCH_SUCCESS;
  return int8_int8_product(xp, xsp, M, K, wm.as<int8_t>(), N, sm.as<float>(), y);
}

// y = (xq . w) * xs * scale on the prepacked VNNI panels (prepack_int8_vnni), the activations
// as xu = xq + 128 in rows of K4 * 4 bytes (unsigned_rows): the shims' body
AOTITorchError vnni_linear(const uint8_t* xu, const float* xs, int64_t M, int64_t K,
                           AtenTensorHandle w, AtenTensorHandle comp, AtenTensorHandle scale,
                           AtenTensorHandle* ret0) {
  Mat wm, cm, sm;
  if (!view(w, 2, aoti_torch_dtype_int8(), &wm) || !view(comp, 1, aoti_torch_dtype_int32(), &cm) ||
      !view(scale, 1, aoti_torch_dtype_float32(), &sm))
    return AOTI_TORCH_FAILURE;
  const int64_t N = sm.rows, panels = (N + 15) / 16;
  if (wm.rows != panels || wm.cols != (K + 3) / 4 * 64 || cm.rows != panels * 16)
    return AOTI_TORCH_FAILURE;
  float* y = nullptr;
  if (AOTITorchError e = new_output(M, N, ret0, &y)) return e;
  if (M == 0 || N == 0) return AOTI_TORCH_SUCCESS;
#if defined(FXQ_AMX)
  if (M >= kAmxMinM && (K + 3) / 4 % 16 == 0 && amx_ready()) {
    gemm_int8_int8_amx(xu, xs, M, K, wm.as<int8_t>(), cm.as<__m512i>(), N, sm.as<float>(), y);
    return AOTI_TORCH_SUCCESS;
  }
#endif
#if defined(FXQ_VNNI512)
  gemm_int8_int8_vnni_packed(xu, xs, M, K, wm.as<__m512i>(), cm.as<__m512i>(), N, sm.as<float>(),
                             y);
#else
  gemm_int8_int8_packed_scalar(xu, xs, M, K, wm.as<int8_t>(), N, sm.as<float>(), y);
#endif
  return AOTI_TORCH_SUCCESS;
}

// The grouped shims' views: x [S, K] fp32, w [E, N, K] of w_dtype, scale fp32 of sdim
// dimensions, offs [E] int64; false unless every one is readable and their E and K agree.
bool grouped_views(AtenTensorHandle x, AtenTensorHandle w, int32_t w_dtype,
                   AtenTensorHandle scale, int64_t sdim, AtenTensorHandle offs, Mat* xm, Mat* wm,
                   Mat* sm, Mat* om, int64_t* E, int64_t* N) {
  int64_t* wsizes = nullptr;
  if (!view(x, 2, aoti_torch_dtype_float32(), xm) || !view(w, 3, w_dtype, wm) ||
      !view(scale, sdim, aoti_torch_dtype_float32(), sm) ||
      !view(offs, 1, aoti_torch_dtype_int64(), om) || aoti_torch_get_sizes(w, &wsizes))
    return false;
  *E = wsizes[0];
  *N = wsizes[1];
  return wsizes[2] == xm->cols && om->rows == *E;
}

// ---- mixture-of-experts: int8 and fp8 weight-only experts ------------------------------------
// x [S, K] fp32 with its rows sorted by expert, offs [E] (int64) each expert's cumulative row
// end, w [E, N, K] int8 or e4m3 (F), scale [E, N]: each expert's rows take the linear's own
// paths on that expert's weight (the GEMV up to kGemvMaxM rows, the chunked GEMM above), so
// decode reads only the experts its token chose and prefill runs one GEMM per expert. Rows at or
// past offs[E-1] are zeros (transformers' grouped_mm fallback, the reference). The offsets are
// read here, on the host: the data-dependent row split an aten composition cannot express. Rows
// of zeros are not run (run_grouped: Llama 4's unchosen experts), and the path follows the rows
// that remain.
// bf16_x: an expert's rows from kBf16MinM on take the bf16-dot GEMM, x rounded to bf16 (the
// linear's bf16_dot candidate, where the machine's dispatch table picks it); one row keeps fp32
// x.
template <Fmt F>
AOTITorchError bytes_grouped_mm(int32_t w_dtype, AtenTensorHandle x, AtenTensorHandle w,
                                AtenTensorHandle scale, AtenTensorHandle offs, bool bf16_x,
                                AtenTensorHandle* ret0) {
  Mat xm, wm, sm, om;
  int64_t E = 0, N = 0;
  if (!grouped_views(x, w, w_dtype, scale, 2, offs, &xm, &wm, &sm, &om, &E, &N) ||
      sm.rows != E || sm.cols != N)
    return AOTI_TORCH_FAILURE;
  const int64_t S = xm.rows, K = xm.cols;
  const float* xp = xm.as<float>();
  const uint8_t* wp = wm.as<uint8_t>();
  const float* sp = sm.as<float>();
  auto rows = [&](int64_t e, const float* xe, int64_t M, float* ye) -> AOTITorchError {
    const uint8_t* we = wp + e * N * K;
    const float* se = sp + e * N;
    std::vector<float> rounded;
    if (bf16_x && M >= kBf16MinM) {
#ifdef FXQ_BF16_512
      gemm_bf16(xe, M, K, ByteWeight<F>{we, K}, N, se, ye);
      return AOTI_TORCH_SUCCESS;
#else
      rounded = bf16_rounded(xe, M, K);  // the same numerics on the fp32 paths below
      xe = rounded.data();
#endif
    }
    if (M > kGemvMaxM[int(F)]) return gemm_chunked(F, xe, M, K, we, N, se, nullptr, 0, ye);
    gemv_bytes<F>(xe, M, K, we, N, se, ye);
    return AOTI_TORCH_SUCCESS;
  };
  return run_grouped(xp, S, K, N, om.as<int64_t>(), E, /*skip_zero_rows=*/true, ret0, rows);
}

// ---- mixture-of-experts: fp8 experts with dynamic activations --------------------------------
// FbgemmFp8Config's experts (Llama 4: per-channel scales [E, N], x per token) and
// FineGrainedFP8Config's (b x b tile scales [E, ceil(N/b), ceil(K/b)], x in 1 x b groups): x
// [S, K] fp32 sorted by expert, offs [E] as bytes_grouped_mm's, w [E, N, K] e4m3. x is quantized
// as the linear quantizes it, every row at once (a row's grid does not depend on its expert: the
// reference's values and scales), then each expert's rows take that linear's paths on its
// weight, their scales gathered with them (run_grouped_aux). Rows of zeros quantize to zeros and
// are not run. bf16_x (per row): from kBf16MinM rows an expert's rows take the bf16-dot GEMM,
// exact for e4m3 values as the fp32 paths are (only the order of the fp32 sums differs).
AOTITorchError float8_dynamic_grouped_mm(AtenTensorHandle x, AtenTensorHandle w,
                                         AtenTensorHandle scale, AtenTensorHandle offs,
                                         double scale_ub, bool bf16_x, AtenTensorHandle* ret0) {
  Mat xm, wm, sm, om;
  int64_t E = 0, N = 0;
  if (!grouped_views(x, w, aoti_torch_dtype_float8_e4m3fn(), scale, 2, offs, &xm, &wm, &sm, &om,
                     &E, &N) ||
      sm.rows != E || sm.cols != N)
    return AOTI_TORCH_FAILURE;
  const int64_t S = xm.rows, K = xm.cols;
  std::unique_ptr<float[]> xq(new float[S * K]);  // every value written by the quantizer
  std::vector<float> xs(S);
  quantize_fp8_rows(xm.as<float>(), S, K, float(scale_ub), xq.get(), xs.data());
  const uint8_t* wp = wm.as<uint8_t>();
  const float* sp = sm.as<float>();
  auto rows = [&](int64_t e, const float* xe, const float* xse, int64_t M,
                  float* ye) -> AOTITorchError {
    const uint8_t* we = wp + e * N * K;
    const float* se = sp + e * N;
#ifdef FXQ_BF16_512
    if (bf16_x && M >= kBf16MinM) {
      gemm_bf16(xe, M, K, ByteWeight<Fmt::kFp8>{we, K}, N, se, ye);
      scale_rows(ye, M, N, xse);
      return AOTI_TORCH_SUCCESS;
    }
#endif
    if (M > kGemvMaxM[int(Fmt::kFp8)]) {
      if (AOTITorchError err = gemm_chunked(Fmt::kFp8, xe, M, K, we, N, se, nullptr, 0, ye))
        return err;
    } else {
      gemv_bytes<Fmt::kFp8>(xe, M, K, we, N, se, ye);
    }
    scale_rows(ye, M, N, xse);
    return AOTI_TORCH_SUCCESS;
  };
  (void)bf16_x;  // builds without AVX-512 BF16: the fp32 paths, the same products
  return run_grouped_aux(xq.get(), S, K, N, om.as<int64_t>(), E, /*skip_zero_rows=*/true, ret0,
                         xs.data(), 1, rows);
}

AOTITorchError float8_block_grouped_mm(AtenTensorHandle x, AtenTensorHandle w,
                                       AtenTensorHandle scale, AtenTensorHandle offs, int64_t b,
                                       AtenTensorHandle* ret0) {
  Mat xm, wm, sm, om;
  int64_t E = 0, N = 0;
  if (b <= 0 || !grouped_views(x, w, aoti_torch_dtype_float8_e4m3fn(), scale, 3, offs, &xm, &wm,
                               &sm, &om, &E, &N))
    return AOTI_TORCH_FAILURE;
  const int64_t S = xm.rows, K = xm.cols, KB = (K + b - 1) / b, NB = (N + b - 1) / b;
  int64_t* ssizes = nullptr;
  if (aoti_torch_get_sizes(scale, &ssizes) || ssizes[0] != E || ssizes[1] != NB ||
      ssizes[2] != KB)
    return AOTI_TORCH_FAILURE;
  std::unique_ptr<float[]> xq(new float[S * K]);  // every value written by the quantizer
  std::vector<float> xs(S * KB);
  quantize_fp8_groups(xm.as<float>(), S, K, b, xq.get(), xs.data());
  const uint8_t* wp = wm.as<uint8_t>();
  const float* sp = sm.as<float>();
  auto rows = [&](int64_t e, const float* xe, const float* xse, int64_t M, float* ye) {
    return block_product(xe, xse, M, K, wp + e * N * K, N, sp + e * NB * KB, b, ye);
  };
  return run_grouped_aux(xq.get(), S, K, N, om.as<int64_t>(), E, /*skip_zero_rows=*/true, ret0,
                         xs.data(), KB, rows);
}

// ---- mixture-of-experts: W8A8 experts ----------------------------------------------------------
// x [S, K] fp32 sorted by expert, offs [E] as bytes_grouped_mm's, w [E, N, K] int8, scale [E, N]:
// each expert's rows quantized per token to int8 (quantize_int8_rows: the reference's bytes; a
// row's grid does not depend on its expert, so quantizing an expert's rows alone is the same),
// then the w8a8 linear's integer kernels on that expert's stored weight (int8_int8_product:
// int32 sums, the reference's products). Rows of zeros are not run.
AOTITorchError int8_dynamic_grouped_mm(AtenTensorHandle x, AtenTensorHandle w,
                                       AtenTensorHandle scale, AtenTensorHandle offs,
                                       AtenTensorHandle* ret0) {
  Mat xm, wm, sm, om;
  int64_t E = 0, N = 0;
  if (!grouped_views(x, w, aoti_torch_dtype_int8(), scale, 2, offs, &xm, &wm, &sm, &om, &E, &N) ||
      sm.rows != E || sm.cols != N)
    return AOTI_TORCH_FAILURE;
  const int64_t S = xm.rows, K = xm.cols;
  const int8_t* wp = wm.as<int8_t>();
  const float* sp = sm.as<float>();
  std::vector<uint8_t> q;
  std::vector<float> xs;
  auto rows = [&](int64_t e, const float* xe, int64_t M, float* ye) {
    q.resize(M * K);
    xs.resize(M);
    quantize_int8_rows(xe, M, K, q.data(), K, /*flip=*/0, xs.data());
    return int8_int8_product((const int8_t*)q.data(), xs.data(), M, K, wp + e * N * K, N,
                             sp + e * N, ye);
  };
  return run_grouped(xm.as<float>(), S, K, N, om.as<int64_t>(), E, /*skip_zero_rows=*/true,
                     ret0, rows);
}

}  // namespace
}  // namespace fxq

using namespace fxq;

// ---- C shims: the ABI AOTInductor calls (aoti_torch_cpu_<op name>) ---------------------------

extern "C" {

AOTITorchError aoti_torch_cpu_native_int8_weight_only_linear(AtenTensorHandle x,
                                                             AtenTensorHandle w,
                                                             AtenTensorHandle scale,
                                                             AtenTensorHandle* ret0) {
  return bytes_linear(Fmt::kInt8, aoti_torch_dtype_int8(), x, w, scale, ret0);
}

AOTITorchError aoti_torch_cpu_native_int8_weight_only_grouped_mm(AtenTensorHandle x,
                                                                 AtenTensorHandle w,
                                                                 AtenTensorHandle scale,
                                                                 AtenTensorHandle offs,
                                                                 int64_t bf16_x,
                                                                 AtenTensorHandle* ret0) {
  return bytes_grouped_mm<Fmt::kInt8>(aoti_torch_dtype_int8(), x, w, scale, offs, bf16_x != 0,
                                      ret0);
}

AOTITorchError aoti_torch_cpu_native_float8_weight_only_grouped_mm(AtenTensorHandle x,
                                                                   AtenTensorHandle w,
                                                                   AtenTensorHandle scale,
                                                                   AtenTensorHandle offs,
                                                                   int64_t bf16_x,
                                                                   AtenTensorHandle* ret0) {
  return bytes_grouped_mm<Fmt::kFp8>(aoti_torch_dtype_float8_e4m3fn(), x, w, scale, offs,
                                     bf16_x != 0, ret0);
}

AOTITorchError aoti_torch_cpu_native_int8_dynamic_grouped_mm(AtenTensorHandle x,
                                                            AtenTensorHandle w,
                                                            AtenTensorHandle scale,
                                                            AtenTensorHandle offs,
                                                            AtenTensorHandle* ret0) {
  return int8_dynamic_grouped_mm(x, w, scale, offs, ret0);
}

AOTITorchError aoti_torch_cpu_native_float8_dynamic_grouped_mm(AtenTensorHandle x,
                                                              AtenTensorHandle w,
                                                              AtenTensorHandle scale,
                                                              AtenTensorHandle offs,
                                                              double scale_ub, int64_t bf16_x,
                                                              AtenTensorHandle* ret0) {
  return float8_dynamic_grouped_mm(x, w, scale, offs, scale_ub, bf16_x != 0, ret0);
}

AOTITorchError aoti_torch_cpu_native_float8_block_grouped_mm(AtenTensorHandle x,
                                                            AtenTensorHandle w,
                                                            AtenTensorHandle scale,
                                                            AtenTensorHandle offs,
                                                            int64_t block_size,
                                                            AtenTensorHandle* ret0) {
  return float8_block_grouped_mm(x, w, scale, offs, block_size, ret0);
}

AOTITorchError aoti_torch_cpu_native_float8_weight_only_linear(AtenTensorHandle x,
                                                               AtenTensorHandle w,
                                                               AtenTensorHandle scale,
                                                               AtenTensorHandle* ret0) {
  return bytes_linear(Fmt::kFp8, aoti_torch_dtype_float8_e4m3fn(), x, w, scale, ret0);
}

AOTITorchError aoti_torch_cpu_native_int8_bf16dot_linear(AtenTensorHandle x, AtenTensorHandle w,
                                                         AtenTensorHandle scale,
                                                         AtenTensorHandle* ret0) {
  return bytes_linear(Fmt::kInt8, aoti_torch_dtype_int8(), x, w, scale, ret0, true);
}

AOTITorchError aoti_torch_cpu_native_float8_bf16dot_linear(AtenTensorHandle x,
                                                           AtenTensorHandle w,
                                                           AtenTensorHandle scale,
                                                           AtenTensorHandle* ret0) {
  return bytes_linear(Fmt::kFp8, aoti_torch_dtype_float8_e4m3fn(), x, w, scale, ret0, true);
}

AOTITorchError aoti_torch_cpu_native_float8_block_linear(AtenTensorHandle x, AtenTensorHandle w,
                                                       AtenTensorHandle scale, int64_t block_size,
                                                       AtenTensorHandle* ret0) {
  return float8_block_linear(x, w, scale, block_size, ret0);
}

AOTITorchError aoti_torch_cpu_native_float8_block_scaled_linear(AtenTensorHandle xq,
                                                              AtenTensorHandle xs,
                                                              AtenTensorHandle w,
                                                              AtenTensorHandle scale,
                                                              int64_t block_size,
                                                              AtenTensorHandle* ret0) {
  return float8_block_scaled_linear(xq, xs, w, scale, block_size, ret0);
}

AOTITorchError aoti_torch_cpu_native_float8_dynamic_linear(AtenTensorHandle x, AtenTensorHandle w,
                                                          AtenTensorHandle scale, double scale_ub,
                                                          AtenTensorHandle* ret0) {
  return float8_dynamic_linear(x, w, scale, scale_ub, ret0, false);
}

AOTITorchError aoti_torch_cpu_native_float8_dynamic_bf16dot_linear(AtenTensorHandle x,
                                                                  AtenTensorHandle w,
                                                                  AtenTensorHandle scale,
                                                                  double scale_ub,
                                                                  AtenTensorHandle* ret0) {
  return float8_dynamic_linear(x, w, scale, scale_ub, ret0, true);
}

AOTITorchError aoti_torch_cpu_native_int8_scaled_linear(AtenTensorHandle xq, AtenTensorHandle xs,
                                                        AtenTensorHandle w,
                                                        AtenTensorHandle scale,
                                                        AtenTensorHandle* ret0) {
  Mat xm, xsm;
  if (!view(xq, 2, aoti_torch_dtype_int8(), &xm) || !view(xs, 1, aoti_torch_dtype_float32(), &xsm) ||
      xsm.rows != xm.rows)
    return AOTI_TORCH_FAILURE;
  return int8_scaled_rows(xm.as<int8_t>(), xsm.as<float>(), xm.rows, xm.cols, w, scale, ret0);
}

// w8a8 from fp32 activations: the per-token quantization here (quantize_int8_rows), then the
// int8 x int8 kernels as above
AOTITorchError aoti_torch_cpu_native_int8_dynamic_linear(AtenTensorHandle x, AtenTensorHandle w,
                                                         AtenTensorHandle scale,
                                                         AtenTensorHandle* ret0) {
  Int8Rows xq;
  if (!int8_rows(x, 1, 0, &xq)) return AOTI_TORCH_FAILURE;
  return int8_scaled_rows(xq.as_int8(), xq.scale.data(), xq.rows, xq.cols, w, scale, ret0);
}

AOTITorchError aoti_torch_cpu_native_int8_scaled_vnni_linear(AtenTensorHandle xq,
                                                             AtenTensorHandle xs,
                                                             AtenTensorHandle w,
                                                             AtenTensorHandle comp,
                                                             AtenTensorHandle scale,
                                                             AtenTensorHandle* ret0) {
  Mat xm, xsm;
  if (!view(xq, 2, aoti_torch_dtype_int8(), &xm) || !view(xs, 1, aoti_torch_dtype_float32(), &xsm) ||
      xsm.rows != xm.rows)
    return AOTI_TORCH_FAILURE;
  const int64_t M = xm.rows, K = xm.cols;
  const std::unique_ptr<uint8_t[]> xu = unsigned_rows(xm.as<int8_t>(), M, K, (K + 3) / 4 * 4);
  return vnni_linear(xu.get(), xsm.as<float>(), M, K, w, comp, scale, ret0);
}

// w8a8 from fp32 activations: the per-token quantization here (quantize_int8_rows), then the
// packed GEMM as above
AOTITorchError aoti_torch_cpu_native_int8_dynamic_vnni_linear(AtenTensorHandle x,
                                                              AtenTensorHandle w,
                                                              AtenTensorHandle comp,
                                                              AtenTensorHandle scale,
                                                              AtenTensorHandle* ret0) {
  Int8Rows xu;  // straight into the GEMM's unsigned rows: whole quads, q + 128
  if (!int8_rows(x, 4, 0x80, &xu)) return AOTI_TORCH_FAILURE;
  return vnni_linear(xu.q.get(), xu.scale.data(), xu.rows, xu.cols, w, comp, scale, ret0);
}

}  // extern "C"
