// Native CPU kernels for int4 weights: fp32 activations (weight-only) and int8 activations
// (W4A8), on the prepacked nibble layout (fxquant.kernels.cpu.prepack_int4). The layouts,
// numerics and the reason these exist are in linear.cpp's header; the large-M path they fall
// back to is there too.

#include <omp.h>

#include "bf16_dot.h"
#include "native.h"

namespace fxq {
namespace {

// column k's code in a row of the kernel layout (scalar: the reference for the vector paths)
inline float int4_code(const uint8_t* row, int64_t k) {
  const uint8_t byte = row[(k / 32) * 16 + (k % 16)];
  return float((k % 32) < 16 ? (byte & 0x0F) : (byte >> 4));
}

// Per activation row and group, the sum of x (the offset term's factor), accumulated in Acc:
// fp32 for fp32 activations, exact int32 for int8 ones.
template <class Acc, class T>
std::vector<float> group_sums(const T* x, int64_t M, int64_t K, int64_t group) {
  const int64_t G = K / group;
  std::vector<float> out(M * G);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      Acc s = 0;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) s += x[m * K + k];
      out[m * G + g] = float(s);
    }
  return out;
}

// ---- GEMV, fp32 activations (the scheme of int8_fp8.cpp's GEMV, with int4 codes) ----------

// int4, one row: sum_g scale[g] * (sum_{k in g} x u) + offset[g] * xsum[g]
inline float dot_int4(const float* x, const uint8_t* row, const float* scale, const float* offset,
                      const float* xsum, int64_t K, int64_t group) {
  const int64_t G = K / group;
#if defined(FXQ_AVX512BW)
  // 16 bytes (a 32-column block) widen to 16 int32 lanes, and vpermps reads only the low 4 bits
  // of each index lane: so the lanes index a table of the group's 16 dequantized values,
  // u * scale + offset (one fma a group), directly for the low nibbles (columns k..k+15) and
  // after one shift for the high ones (k+16..k+31). One chain of fmas along the row and no
  // offset term: the AVX2 loop's per-group scale fma and per-row offset sum are dependency
  // chains that, over SmolLM2's 288-byte rows, left its decode GEMV at ~16 GB/s (perf: the
  // scale fma and the instruction after it the hottest, Zen 4). Each weight is rounded once
  // to fp32, as the reference's dequantized weight is.
  (void)xsum;
  const __m512 codes = _mm512_setr_ps(0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f, 8.f, 9.f, 10.f,
                                      11.f, 12.f, 13.f, 14.f, 15.f);
  __m512 a0 = _mm512_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t g = 0; g < G; ++g) {
    const __m512 table =
        _mm512_fmadd_ps(codes, _mm512_set1_ps(scale[g]), _mm512_set1_ps(offset[g]));
    int64_t k = g * group;
    const int64_t end = k + group;
    for (; k + 64 <= end; k += 64) {
      const uint8_t* p = row + k / 2;
      const __m512i b0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)p));
      const __m512i b1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(p + 16)));
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_permutexvar_ps(b0, table), a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16),
                           _mm512_permutexvar_ps(_mm512_srli_epi32(b0, 4), table), a1);
      a2 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 32), _mm512_permutexvar_ps(b1, table), a2);
      a3 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 48),
                           _mm512_permutexvar_ps(_mm512_srli_epi32(b1, 4), table), a3);
    }
    if (k < end) {  // groups of 32: one block
      const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i*)(row + k / 2)));
      a0 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k), _mm512_permutexvar_ps(b, table), a0);
      a1 = _mm512_fmadd_ps(_mm512_loadu_ps(x + k + 16),
                           _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table), a1);
    }
  }
  return _mm512_reduce_add_ps(_mm512_add_ps(_mm512_add_ps(a0, a1), _mm512_add_ps(a2, a3)));
#else
  float off = 0.f;
  for (int64_t g = 0; g < G; ++g) off += offset[g] * xsum[g];
#if defined(FXQ_AVX2)
  // 8 bytes widen to 8 int32 lanes (one load-and-widen); their low nibbles are columns k..k+7
  // of the 32-block and the high ones k+16..k+23 (the prepacked layout): one widen, one and,
  // one shift and two converts give 16 codes
  const __m256i low = _mm256_set1_epi32(0x0F);
  __m256 tot = _mm256_setzero_ps();
  for (int64_t g = 0; g < G; ++g) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0;
    for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
      const uint8_t* p = row + k / 2;
      const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
      const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)));
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k), _mm256_cvtepi32_ps(_mm256_and_si256(b0, low)), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 16), _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4)), a1);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 8), _mm256_cvtepi32_ps(_mm256_and_si256(b1, low)), a0);
      a1 = _mm256_fmadd_ps(_mm256_loadu_ps(x + k + 24), _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4)), a1);
    }
    tot = _mm256_fmadd_ps(_mm256_set1_ps(scale[g]), _mm256_add_ps(a0, a1), tot);
  }
  return hsum(tot) + off;
#else
  float tot = 0.f;
  for (int64_t g = 0; g < G; ++g) {
    float acc = 0.f;
    for (int64_t k = g * group; k < (g + 1) * group; ++k) acc += x[k] * int4_code(row, k);
    tot += scale[g] * acc;
  }
  return tot + off;
#endif
#endif
}

// int4, four activation rows against one weight row (codes decoded once per 16)
inline void dot_int4_x4(const float* x, int64_t K, const uint8_t* row, const float* scale,
                        const float* offset, const float* xsum, int64_t G, int64_t group,
                        float out[4]) {
#ifdef FXQ_AVX2
  const __m256i low = _mm256_set1_epi32(0x0F);
  __m256 tot[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  for (int64_t g = 0; g < G; ++g) {
    __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                     _mm256_setzero_ps()};
    for (int64_t k = g * group; k < (g + 1) * group; k += 32) {
      const uint8_t* p = row + k / 2;
      const __m256i b0 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
      const __m256i b1 = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(p + 8)));
      const __m256 u0 = _mm256_cvtepi32_ps(_mm256_and_si256(b0, low));   // columns k..k+7
      const __m256 u2 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b0, 4));    // k+16..k+23
      const __m256 u1 = _mm256_cvtepi32_ps(_mm256_and_si256(b1, low));   // k+8..k+15
      const __m256 u3 = _mm256_cvtepi32_ps(_mm256_srli_epi32(b1, 4));    // k+24..k+31
      for (int m = 0; m < 4; ++m) {
        const float* xm = x + m * K + k;
        __m256 t = _mm256_mul_ps(_mm256_loadu_ps(xm), u0);
        t = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 8), u1, t);
        t = _mm256_fmadd_ps(_mm256_loadu_ps(xm + 16), u2, t);
        acc[m] = _mm256_add_ps(acc[m], _mm256_fmadd_ps(_mm256_loadu_ps(xm + 24), u3, t));
      }
    }
    const __m256 sg = _mm256_set1_ps(scale[g]);
    for (int m = 0; m < 4; ++m) tot[m] = _mm256_fmadd_ps(sg, acc[m], tot[m]);
  }
  for (int m = 0; m < 4; ++m) {
    float off = 0.f;
    for (int64_t g = 0; g < G; ++g) off += offset[g] * xsum[m * G + g];
    out[m] = hsum(tot[m]) + off;
  }
#else
  for (int m = 0; m < 4; ++m) out[m] = dot_int4(x + m * K, row, scale, offset, xsum + m * G, K, group);
#endif
}

void gemv_int4(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
               const float* scale, const float* offset, int64_t group, float* y) {
  const int64_t G = K / group;
  const std::vector<float> xsum = group_sums<float>(x, M, K, group);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    prefetch_row_ahead(w, n, N, K / 2);
    const uint8_t* row = w + n * (K / 2);
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
      float out[4];
      dot_int4_x4(x + m * K, K, row, scale + n * G, offset + n * G, xsum.data() + m * G, G,
                  group, out);
      for (int i = 0; i < 4; ++i) y[(m + i) * N + n] = out[i];
    }
    for (; m < M; ++m)
      y[m * N + n] = dot_int4(x + m * K, row, scale + n * G, offset + n * G,
                              xsum.data() + m * G, K, group);
  }
}

// ---- int4 weights x int8 activations (W4A8) ------------------------------------------------
// Per group: sum_k u[k] * xq[k] in exact integers, then scale[g] * that + offset[g] * sum_k xq[k]
// (w = u * scale + offset). maddubs multiplies unsigned by signed bytes, which is exactly codes
// u in [0, 15] times xq in [-127, 127]: a pair sums to at most 2 * 15 * 127 = 3810, so the
// int16 lanes hold a whole group of up to 256 columns (8 blocks of 32, at most 30480 < 2^15)
// and widen once per group. Per 32 weights that is a load, three ops to split the nibbles and
// one maddubs + add, against two widens, four converts and four fmas for fp32 activations:
// the int4 GEMV is compute-bound on AVX2, and this halves the compute (llama.cpp's Q4 x Q8
// dot products do the same).

#ifdef FXQ_AVX2
// 16 bytes of the kernel layout -> the 32 codes of the block in column order
inline __m256i nibbles32(const uint8_t* p) {
  const __m128i b = _mm_loadu_si128((const __m128i*)p);
  const __m128i m = _mm_set1_epi8(0x0F);
  return _mm256_set_m128i(_mm_and_si128(_mm_srli_epi16(b, 4), m), _mm_and_si128(b, m));
}
#endif

// sum_g offset[g] * xsum[g], eight groups a vector (the scalar loop is one long add chain)
inline float offset_dot(const float* offset, const float* xsum, int64_t G) {
  int64_t g = 0;
  float out = 0.f;
#ifdef FXQ_AVX2
  __m256 v = _mm256_setzero_ps();
  for (; g + 8 <= G; g += 8)
    v = _mm256_fmadd_ps(_mm256_loadu_ps(offset + g), _mm256_loadu_ps(xsum + g), v);
  out = hsum(v);
#endif
  for (; g < G; ++g) out += offset[g] * xsum[g];
  return out;
}

// The activation in the order the nibbles come out. 32 bytes of weight (two blocks, j and j+1)
// load as one vector; its low nibbles are columns 0-15 of block j and then of block j+1, its high
// nibbles columns 16-31 of each. So in every 64 columns of xq the middle two quarters swap, once
// per call, and each 64 weights cost one load, three ops to split and two maddubs + adds: about
// half the work of splitting each block into its own vector. A last odd block keeps its order.
void permute_activation(const int8_t* xq, int64_t M, int64_t K, int8_t* out) {
  for (int64_t m = 0; m < M; ++m) {
    const int8_t* x = xq + m * K;
    int8_t* o = out + m * K;
    int64_t k = 0;
    for (; k + 64 <= K; k += 64) {
      std::memcpy(o + k, x + k, 16);
      std::memcpy(o + k + 16, x + k + 32, 16);
      std::memcpy(o + k + 32, x + k + 16, 16);
      std::memcpy(o + k + 48, x + k + 48, 16);
    }
    std::memcpy(o + k, x + k, K - k);
  }
}

#ifdef FXQ_AVX2
// 32 bytes of the kernel layout (blocks j, j+1) -> codes for activations xp[0:32] and xp[32:64]
inline void nibbles64(const uint8_t* p, __m256i* lo, __m256i* hi) {
  const __m256i v = _mm256_loadu_si256((const __m256i*)p);
  const __m256i m = _mm256_set1_epi8(0x0F);
  *lo = _mm256_and_si256(v, m);
  *hi = _mm256_and_si256(_mm256_srli_epi16(v, 4), m);
}

// R activation rows (permuted, K apart) against one weight row, groups of 32 * B columns, B a
// power of two up to 8; the result lacks the offset term. B is a template argument so the block
// loop unrolls (with a run-time trip count of two the GEMV ran 1.4x slower, measured). Groups
// of 32 (B = 1) go two at a time: each 128-bit half of the vector is one group, so the scales
// are a vector of two values.
template <int R, int B>
inline void dot_int4_int8(const int8_t* xp, int64_t K, const uint8_t* row, const float* scale,
                          int64_t G, float* out) {
  constexpr int64_t group = 32 * B;
  constexpr int64_t step = B == 1 ? 2 : 1;  // groups per iteration
  const __m256i ones = _mm256_set1_epi16(1);
  // two fp32 accumulators per activation row, alternate iterations: the fma is a dependency
  // chain, and a row has only a few groups' worth of independent work to hide it
  __m256 t0[R], t1[R];
  for (int r = 0; r < R; ++r) t0[r] = t1[r] = _mm256_setzero_ps();
  int64_t g = 0;
  for (int64_t it = 0; g + step <= G; g += step, ++it) {
    const uint8_t* p = row + g * (group / 2);
    const int8_t* xg = xp + g * group;
    __m256i acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm256_setzero_si256();
    for (int q = 0; q < (B == 1 ? 1 : B / 2); ++q) {
      __m256i lo, hi;
      nibbles64(p + 32 * q, &lo, &hi);
      for (int r = 0; r < R; ++r) {
        const int8_t* x = xg + r * K + 64 * q;
        acc[r] = _mm256_add_epi16(
            acc[r], _mm256_add_epi16(
                        _mm256_maddubs_epi16(lo, _mm256_loadu_si256((const __m256i*)x)),
                        _mm256_maddubs_epi16(hi, _mm256_loadu_si256((const __m256i*)(x + 32)))));
      }
    }
    const __m256 s = B == 1 ? _mm256_set_m128(_mm_set1_ps(scale[g + 1]), _mm_set1_ps(scale[g]))
                            : _mm256_set1_ps(scale[g]);
    for (int r = 0; r < R; ++r) {
      const __m256 v = _mm256_cvtepi32_ps(_mm256_madd_epi16(acc[r], ones));
      if (it & 1)
        t1[r] = _mm256_fmadd_ps(s, v, t1[r]);
      else
        t0[r] = _mm256_fmadd_ps(s, v, t0[r]);
    }
  }
  if (g < G) {  // groups of 32 only: an odd last group, one block in its own order
    const __m256 s = _mm256_set1_ps(scale[g]);
    const __m256i u = nibbles32(row + g * 16);
    for (int r = 0; r < R; ++r) {
      const __m256i xv = _mm256_loadu_si256((const __m256i*)(xp + r * K + g * 32));
      const __m256i p16 = _mm256_maddubs_epi16(u, xv);
      t0[r] = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, ones)), t0[r]);
    }
  }
  for (int r = 0; r < R; ++r) out[r] = hsum(_mm256_add_ps(t0[r], t1[r]));
}
#else
// column k of a row of permuted activations (the inverse of permute_activation)
inline int8_t permuted_at(const int8_t* xp, int64_t K, int64_t k) {
  const int64_t base = k / 64 * 64, i = k % 64;
  if (base + 64 > K) return xp[k];
  const int64_t q = i / 16;
  return xp[base + (q == 1 ? 2 : q == 2 ? 1 : q) * 16 + i % 16];
}

template <int R, int B>
inline void dot_int4_int8(const int8_t* xp, int64_t K, const uint8_t* row, const float* scale,
                          int64_t G, float* out) {
  constexpr int64_t group = 32 * B;
  for (int r = 0; r < R; ++r) {
    float tot = 0.f;
    for (int64_t g = 0; g < G; ++g) {
      int32_t acc = 0;
      for (int64_t k = g * group; k < (g + 1) * group; ++k)
        acc += int32_t(permuted_at(xp + r * K, K, k)) * int32_t(int4_code(row, k));
      tot += scale[g] * float(acc);
    }
    out[r] = tot;
  }
}
#endif

// y[m, n] = xs[m] * sum_k xq[m, k] * (u[n, k] * scale[n, g] + offset[n, g]), groups of 32 * B;
// xp is xq permuted, xsum [M, G] the per-group sums of xq (for the offset term)
template <int B>
void gemv_int4_int8_b(const int8_t* xp, const float* xs, int64_t M, int64_t K, const uint8_t* w,
                      int64_t N, const float* scale, const float* offset, const float* xsum,
                      float* y) {
  const int64_t G = K / (32 * B);
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    prefetch_row_ahead(w, n, N, K / 2);
    const uint8_t* row = w + n * (K / 2);
    const float* sn = scale + n * G;
    const float* on = offset + n * G;
    float out[4];
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
      dot_int4_int8<4, B>(xp + m * K, K, row, sn, G, out);
      for (int i = 0; i < 4; ++i)
        y[(m + i) * N + n] = (out[i] + offset_dot(on, xsum + (m + i) * G, G)) * xs[m + i];
    }
    for (; m < M; ++m) {
      dot_int4_int8<1, B>(xp + m * K, K, row, sn, G, out);
      y[m * N + n] = (out[0] + offset_dot(on, xsum + m * G, G)) * xs[m];
    }
  }
}

#ifdef FXQ_AVX2
// ---- W4A8 GEMM for larger M: packed panels, as int8_fp8.cpp's int8 x int8 GEMM -------------
// The codes of 8 weight rows are unpacked from nibbles and laid out k-quad by k-quad (32 bytes:
// the 8 columns' next 4 codes), per block, into a buffer that stays in L1 while every activation
// row passes over it; a broadcast activation quad meets 8 columns in one maddubs (codes
// unsigned, xq signed: no sign trick, two ops per 32 products against the int8 GEMM's four).
// Eight quads (32 columns: pairs of at most 2 * 15 * 127, sixteen products at most 30480) sum
// in the int16 lanes, then widen into int32 sums of the whole group, which go to fp32 times the
// group's scale once per group, with the offset term (offset[g] * sum of the group's xq): the
// same products and fp32 terms as the GEMV, summed in another order.

// one panel of `rows` (<= 8) weight rows of the kernel layout (K / 2 bytes each): quad q of its
// codes to codes[q * stride], group g's scales and offsets to ps / po[g * width + c] (stride 2
// and width 16: one half of the VNNI GEMM's 16-column panel)
inline void pack_int4_panel(const uint8_t* w, int64_t K, int64_t rows, const float* scale,
                            const float* offset, int64_t G, __m256i* codes, float* ps, float* po,
                            int64_t stride = 1, int64_t width = 8) {
  for (int64_t k = 0; k < K; k += 32) {
    __m256i r[8];
    for (int c = 0; c < 8; ++c)
      r[c] = c < rows ? nibbles32(w + c * (K / 2) + k / 2) : _mm256_setzero_si256();
    transpose8x8_epi32(r);
    for (int q = 0; q < 8; ++q) _mm256_store_si256(codes + (k / 4 + q) * stride, r[q]);
  }
  for (int64_t g = 0; g < G; ++g)
    for (int c = 0; c < 8; ++c) {
      ps[g * width + c] = c < rows ? scale[c * G + g] : 0.f;
      po[g * width + c] = c < rows ? offset[c * G + g] : 0.f;
    }
}

// y[i, 8p + c] for R activation rows x P panels; xsum [R][G] the rows' group sums of xq
template <int R, int P>
inline void int4_panel_tile(const int8_t* x, int64_t K, const __m256i* codes, const float* ps,
                            const float* po, int64_t K4, int64_t G, int64_t group,
                            const float* xsum, const float* xs, float* y, int64_t N, int64_t n0) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256 acc[R][P];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < P; ++j) acc[i][j] = _mm256_setzero_ps();
  // the group's sums stay exact integers, as in the GEMV: one fp32 term per group, not per
  // block (per-block terms lost 13 dB against the semantic program at 15 rows)
  __m256i s32[R][P];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < P; ++j) s32[i][j] = _mm256_setzero_si256();
  for (int64_t k = 0; k < K; k += 32) {
    __m256i s16[R][P];
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < P; ++j) s16[i][j] = _mm256_setzero_si256();
    for (int64_t q = k / 4; q < k / 4 + 8; ++q) {
      __m256i wv[P];
      for (int j = 0; j < P; ++j) wv[j] = _mm256_load_si256(codes + j * K4 + q);
      for (int i = 0; i < R; ++i) {
        const __m256i xv = broadcast_quad(x + i * K + q * 4);
        for (int j = 0; j < P; ++j)
          s16[i][j] = _mm256_add_epi16(s16[i][j], _mm256_maddubs_epi16(wv[j], xv));
      }
    }
    for (int i = 0; i < R; ++i)
      for (int j = 0; j < P; ++j)
        s32[i][j] = _mm256_add_epi32(s32[i][j], _mm256_madd_epi16(s16[i][j], ones));
    if ((k + 32) % group) continue;  // (a flat loop: nested per group it ran 10-20 % slower)
    const int64_t g = k / group;
    for (int j = 0; j < P; ++j) {
      const __m256 sv = _mm256_load_ps(ps + j * G * 8 + g * 8);
      const __m256 ov = _mm256_load_ps(po + j * G * 8 + g * 8);
      for (int i = 0; i < R; ++i) {
        acc[i][j] = _mm256_fmadd_ps(sv, _mm256_cvtepi32_ps(s32[i][j]), acc[i][j]);
        acc[i][j] = _mm256_fmadd_ps(ov, _mm256_set1_ps(xsum[i * G + g]), acc[i][j]);
        s32[i][j] = _mm256_setzero_si256();
      }
    }
  }
  for (int i = 0; i < R; ++i) {
    const __m256 xsv = _mm256_set1_ps(xs[i]);
    for (int j = 0; j < P; ++j) {
      const int64_t n = n0 + 8 * j;
      store_columns(y + i * N + n, _mm256_mul_ps(acc[i][j], xsv), N - n);
    }
  }
}

// R rows x up to 2 panels, the panel count a runtime value (the block's last tile)
template <int R>
inline void int4_panel_tile_n(int64_t panels, const int8_t* x, int64_t K, const __m256i* codes,
                              const float* ps, const float* po, int64_t K4, int64_t G,
                              int64_t group, const float* xsum, const float* xs, float* y,
                              int64_t N, int64_t n0) {
  if (panels == 2) int4_panel_tile<R, 2>(x, K, codes, ps, po, K4, G, group, xsum, xs, y, N, n0);
  if (panels == 1) int4_panel_tile<R, 1>(x, K, codes, ps, po, K4, G, group, xsum, xs, y, N, n0);
}

// y[m, n] = xs[m] * sum_k xq[m, k] * (u[n, k] * scale[n, g] + offset[n, g]) past the GEMV's rows
[[maybe_unused]] void gemm_int4_int8(const int8_t* xq, const float* xs, int64_t M, int64_t K,
                                     const uint8_t* w, int64_t N, const float* scale,
                                     const float* offset, int64_t group, float* y) {
  constexpr int R = 3, P = 2;  // 6 int16 + 6 int32 accumulators + 2 panel vectors of 16
  const int64_t K4 = K / 4, G = K / group, panels = (N + 7) / 8;
  const std::vector<float> xsum = group_sums<int32_t>(xq, M, K, group);  // exact in fp32
  const int64_t pb = std::max<int64_t>(P, 32 * 1024 / (K4 * 32) / P * P);
  const int64_t blocks = (panels + pb - 1) / pb;
#pragma omp parallel
  {
    std::vector<__m256i> codes(pb * K4);
    std::vector<__m256> sc(pb * G), of(pb * G);  // [panel][G] vectors of 8 columns
    float* ps = (float*)sc.data();
    float* po = (float*)of.data();
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t p0 = b * pb, p1 = std::min(panels, p0 + pb);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n = p * 8;
        pack_int4_panel(w + n * (K / 2), K, std::min<int64_t>(8, N - n), scale + n * G,
                        offset + n * G, G, &codes[(p - p0) * K4], ps + (p - p0) * G * 8,
                        po + (p - p0) * G * 8);
      }
      // R rows (in L1) over every panel of the block, then the next R rows
      for (int64_t m = 0; m < M; m += R)
        for (int64_t p = p0; p < p1; p += P) {
          const int64_t np = std::min<int64_t>(P, p1 - p), i0 = p - p0;
          const __m256i* c = &codes[i0 * K4];
          const float *s = ps + i0 * G * 8, *o = po + i0 * G * 8;
          if (m + R <= M)
            int4_panel_tile_n<R>(np, xq + m * K, K, c, s, o, K4, G, group, xsum.data() + m * G,
                                 xs + m, y + m * N, N, p * 8);
          else
            for (int64_t i = m; i < M; ++i)
              int4_panel_tile_n<1>(np, xq + i * K, K, c, s, o, K4, G, group,
                                   xsum.data() + i * G, xs + i, y + i * N, N, p * 8);
        }
    }
  }
}
#endif

#ifdef FXQ_VNNI512
// ---- The W4A8 GEMM with AVX-512 VNNI ---------------------------------------------------------
// Panels 16 columns wide (the two 8-column halves packed as above, side by side), and vpdpbusd,
// whose unsigned operand the codes are and whose signed one xq is: 4 products into each of the
// 16 columns' int32 lanes, 64 a instruction where AVX2 takes two for 32, summed exactly over the
// whole group (at most 256 * 15 * 127 < 2^31). Per group the sums meet the group's scale once,
// with the offset term, as in the AVX2 GEMM (the same fp32 operations in the same order).

// One 16-column panel from `rows` (<= 16) weight rows: codes [K4] and ps / po [G][16]
inline void pack_int4_panel16(const uint8_t* w, int64_t K, int64_t rows, const float* scale,
                              const float* offset, int64_t G, __m512i* codes, float* ps,
                              float* po) {
  pack_int4_panel(w, K, std::min<int64_t>(rows, 8), scale, offset, G, (__m256i*)codes, ps, po, 2,
                  16);
  const int64_t more = std::max<int64_t>(rows - 8, 0), n8 = rows > 8 ? 8 : 0;
  pack_int4_panel(w + n8 * (K / 2), K, more, scale + n8 * G, offset + n8 * G, G,
                  (__m256i*)codes + 1, ps + 8, po + 8, 2, 16);
}

// y[i, 16p + c] for R activation rows (xq, K apart) x P panels; xsum [R][G] the rows' group
// sums of xq. Unrolled, and without tree-PRE, for the register allocation (int8_fp8.cpp's VNNI
// tile says why).
template <int R, int P>
__attribute__((optimize("no-tree-pre"))) void int4_panel16_tile(
    const int8_t* x, int64_t K, const __m512i* codes, const float* ps, const float* po,
    int64_t K4, int64_t G, int64_t group, const float* xsum, const float* xs, float* y, int64_t N,
    int64_t n0) {
  __m512 acc[R][P];
#pragma GCC unroll 8
  for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
    for (int j = 0; j < P; ++j) acc[i][j] = _mm512_setzero_ps();
  const int64_t Q = group / 4;  // quads a group
  for (int64_t g = 0; g < G; ++g) {
    __m512i s[R][P];
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
#pragma GCC unroll 8
      for (int j = 0; j < P; ++j) s[i][j] = _mm512_setzero_si512();
    for (int64_t q = g * Q; q < (g + 1) * Q; ++q) {
      __m512i wv[P];
#pragma GCC unroll 8
      for (int j = 0; j < P; ++j) wv[j] = _mm512_load_si512(codes + j * K4 + q);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        int32_t quad;
        std::memcpy(&quad, x + i * K + q * 4, 4);
        const __m512i xv = _mm512_set1_epi32(quad);
#pragma GCC unroll 8
        for (int j = 0; j < P; ++j) s[i][j] = _mm512_dpbusd_epi32(s[i][j], wv[j], xv);
      }
    }
#pragma GCC unroll 8
    for (int j = 0; j < P; ++j) {
      const __m512 sv = _mm512_loadu_ps(ps + (j * G + g) * 16);
      const __m512 ov = _mm512_loadu_ps(po + (j * G + g) * 16);
#pragma GCC unroll 8
      for (int i = 0; i < R; ++i) {
        acc[i][j] = _mm512_fmadd_ps(sv, _mm512_cvtepi32_ps(s[i][j]), acc[i][j]);
        acc[i][j] = _mm512_fmadd_ps(ov, _mm512_set1_ps(xsum[i * G + g]), acc[i][j]);
      }
    }
  }
#pragma GCC unroll 8
  for (int j = 0; j < P; ++j) {
    const int64_t n = n0 + 16 * j, cols = N - n;
    const __mmask16 mask = first_columns16(cols);
#pragma GCC unroll 8
    for (int i = 0; i < R; ++i)
      _mm512_mask_storeu_ps(y + i * N + n, mask, _mm512_mul_ps(acc[i][j], _mm512_set1_ps(xs[i])));
  }
}

// up to R rows x up to P panels, both counts runtime values (the last tiles)
template <int R, int P>
inline void int4_panel16_tile_n(int64_t rows, int64_t panels, const int8_t* x, int64_t K,
                                const __m512i* codes, const float* ps, const float* po,
                                int64_t K4, int64_t G, int64_t group, const float* xsum,
                                const float* xs, float* y, int64_t N, int64_t n0) {
  if constexpr (R > 1)
    if (rows < R)
      return int4_panel16_tile_n<R - 1, P>(rows, panels, x, K, codes, ps, po, K4, G, group, xsum,
                                           xs, y, N, n0);
  if constexpr (P > 1)
    if (panels < P)
      return int4_panel16_tile_n<R, P - 1>(rows, panels, x, K, codes, ps, po, K4, G, group, xsum,
                                           xs, y, N, n0);
  int4_panel16_tile<R, P>(x, K, codes, ps, po, K4, G, group, xsum, xs, y, N, n0);
}

void gemm_int4_int8_vnni(const int8_t* xq, const float* xs, int64_t M, int64_t K,
                         const uint8_t* w, int64_t N, const float* scale, const float* offset,
                         int64_t group, float* y) {
  constexpr int R = 4, P = 3;  // 12 fp32 + 12 int32 accumulators + 3 panel vectors, of 32
  const int64_t K4 = K / 4, G = K / group, panels = (N + 15) / 16;
  const std::vector<float> xsum = group_sums<int32_t>(xq, M, K, group);  // exact in fp32
  const PanelWork work(panels, K4 * 64, M, P, R, omp_get_max_threads());
#pragma omp parallel
  {
    std::vector<__m512i> codes(work.block_panels * K4);
    std::vector<float> ps(work.block_panels * G * 16), po(work.block_panels * G * 16);
#pragma omp for schedule(static)
    for (int64_t item = 0; item < work.items(); ++item) {
      int64_t p0, p1, m0, m1;
      work.item(item, M, &p0, &p1, &m0, &m1);
      for (int64_t p = p0; p < p1; ++p) {
        const int64_t n = p * 16, i0 = p - p0;
        pack_int4_panel16(w + n * (K / 2), K, std::min<int64_t>(16, N - n), scale + n * G,
                          offset + n * G, G, &codes[i0 * K4], &ps[i0 * G * 16], &po[i0 * G * 16]);
      }
      for (int64_t m = m0; m < m1; m += R)
        for (int64_t p = p0; p < p1; p += P) {
          const int64_t i0 = p - p0;
          int4_panel16_tile_n<R, P>(m1 - m, p1 - p, xq + m * K, K, &codes[i0 * K4],
                                    &ps[i0 * G * 16], &po[i0 * G * 16], K4, G, group,
                                    xsum.data() + m * G, xs + m, y + m * N, N, p * 16);
        }
    }
  }
}
#endif

#ifdef FXQ_AMX
// W4A8 on AMX tiles (amx.h), from kAmxMinM rows, for groups of 64 columns or more (whole tile
// steps): the 16-column code panels pack_int4_panel16 writes per call are B tiles, xq's rows
// the A tiles, and TDPBSUD's s8 x u8 int32 sums those of vpdpbusd. Each group's sums leave the
// tiles (a group is group / 64 tile steps) and meet its scale and offset in the fp32 operations
// of int4_panel16_tile, in its order: the same outputs. A panel's record: its codes (K4 x 64
// bytes), then its scales and offsets ([G][16] floats each).
void gemm_int4_int8_amx(const int8_t* xq, const float* xs, int64_t M, int64_t K,
                        const uint8_t* w, int64_t N, const float* scale, const float* offset,
                        int64_t group, float* y) {
  const int64_t K4 = K / 4, G = K / group, panels = (N + 15) / 16;
  const int64_t codes_bytes = K4 * 64, panel_bytes = codes_bytes + 2 * G * 16 * 4;
  const std::vector<float> xsum = group_sums<int32_t>(xq, M, K, group);  // exact in fp32
  auto prepare = [&](int64_t p0, int64_t p1, std::vector<uint8_t>& buf) {
    buf.resize((p1 - p0) * panel_bytes + 64);
    uint8_t* base = line_aligned(buf.data());
    for (int64_t p = p0; p < p1; ++p) {
      uint8_t* rec = base + (p - p0) * panel_bytes;
      float* ps = (float*)(rec + codes_bytes);
      const int64_t n = p * 16;
      pack_int4_panel16(w + n * (K / 2), K, std::min<int64_t>(16, N - n), scale + n * G,
                        offset + n * G, G, (__m512i*)rec, ps, ps + G * 16);
    }
    return (const uint8_t*)base;
  };
  auto store = [&](int64_t m0, int64_t rows, int64_t p, int np, int64_t g, const uint8_t* panel,
                   const int32_t* c, float* acc) {
    for (int j = 0; j < np; ++j) {
      const float* ps = (const float*)(panel + j * panel_bytes + codes_bytes);
      const __m512 sv = _mm512_load_ps(ps + g * 16), ov = _mm512_load_ps(ps + (G + g) * 16);
      const int64_t n = (p + j) * 16, cols = N - n;
      const __mmask16 mask = first_columns16(cols);
      for (int64_t i = 0; i < rows; ++i) {
        float* a = acc + (i * np + j) * 16;
        __m512 v = g ? _mm512_load_ps(a) : _mm512_setzero_ps();
        v = _mm512_fmadd_ps(sv, _mm512_cvtepi32_ps(_mm512_load_si512(c + (i * np + j) * 16)), v);
        v = _mm512_fmadd_ps(ov, _mm512_set1_ps(xsum[(m0 + i) * G + g]), v);
        if (g + 1 < G)
          _mm512_store_ps(a, v);
        else
          _mm512_mask_storeu_ps(y + (m0 + i) * N + n, mask,
                                _mm512_mul_ps(v, _mm512_set1_ps(xs[m0 + i])));
      }
    }
  };
  amx_gemm<Amx::kInt8Codes>((const uint8_t*)xq, K, M, K / 64, panels, panel_bytes, prepare,
                            store, group / 64);
}
#endif

// groups of 32, 64, 128 or 256 columns (the shim checks)
void gemv_int4_int8(const int8_t* xq, const float* xs, int64_t M, int64_t K, const uint8_t* w,
                    int64_t N, const float* scale, const float* offset, int64_t group, float* y) {
  const std::vector<float> xsum = group_sums<int32_t>(xq, M, K, group);  // exact in fp32
  std::vector<int8_t> xp(M * K);
  permute_activation(xq, M, K, xp.data());
  const float* xsp = xsum.data();
  switch (group) {
    case 32: return gemv_int4_int8_b<1>(xp.data(), xs, M, K, w, N, scale, offset, xsp, y);
    case 64: return gemv_int4_int8_b<2>(xp.data(), xs, M, K, w, N, scale, offset, xsp, y);
    case 128: return gemv_int4_int8_b<4>(xp.data(), xs, M, K, w, N, scale, offset, xsp, y);
    default: return gemv_int4_int8_b<8>(xp.data(), xs, M, K, w, N, scale, offset, xsp, y);
  }
}

#ifdef FXQ_BF16_512
// ---- bf16 dot products: int4 weights x activations rounded to bf16 -------------------------
// The int4 layout as a bf16_dot.h weight source: a 32-column block (16 bytes: byte i holds
// column i in its low nibble, column i + 16 in its high one) dequantized in fp32, w = u * s + b
// (one fused multiply-add, as the decoders of decode.cpp and the chunked path), then rounded to
// bf16 (~2e-3 relative a value, far under int4's own rounding); x rounded to bf16, fp32 sums.
struct Int4Weight {
  const uint8_t* base;
  int64_t row_bytes;  // K / 2
  int64_t groups, group;
  const float *scale, *offset;  // [N, groups]
  struct Row {
    const uint8_t* p;
    const float *s, *o;  // the row's groups
    int64_t group;
    __m512bh operator()(int64_t k) const {
      const __m128i b = _mm_loadu_si128((const __m128i*)(p + k / 2));
      const __m128i low = _mm_set1_epi8(0x0F);
      const __m512 sv = _mm512_set1_ps(s[k / group]), ov = _mm512_set1_ps(o[k / group]);
      auto dequant = [&](__m128i u) {
        return _mm512_fmadd_ps(_mm512_cvtepi32_ps(_mm512_cvtepu8_epi32(u)), sv, ov);
      };
      return _mm512_cvtne2ps_pbh(dequant(_mm_and_si128(_mm_srli_epi16(b, 4), low)),
                                 dequant(_mm_and_si128(b, low)));
    }
    __m512bh full(int64_t k) const { return (*this)(k); }  // K: whole 32-column blocks
  };
  Row row(int64_t n) const {
    return {base + n * row_bytes, scale + n * groups, offset + n * groups, group};
  }
};
#endif

// ---- The shims' shared bodies (the linears' and the experts') --------------------------------

// y [M, N] (M >= 1) = x . dequant(w)^T on the int4 kernel layout. bf16_x: the bf16-dot path
// (from 2 rows x and the dequantized weight rounded to bf16, fp32 sums: bf16_dot.h with
// AVX-512 BF16; builds without it round both the same way and multiply in fp32, on the chunked
// path), else fp32 x as it is; one row (decode) is the fp32 GEMV either way
AOTITorchError int4_rows(const float* xp, int64_t M, int64_t K, const uint8_t* wp, int64_t N,
                         const float* sp, const float* op, int64_t group_size, bool bf16_x,
                         float* y) {
  if (bf16_x && M >= kBf16MinM) {
#ifdef FXQ_BF16_512
    gemm_bf16(xp, M, K, Int4Weight{wp, K / 2, K / group_size, group_size, sp, op}, N, nullptr, y);
    return AOTI_TORCH_SUCCESS;
#else
    const std::vector<float> xr = bf16_rounded(xp, M, K);
    return gemm_chunked(Fmt::kInt4, xr.data(), M, K, wp, N, sp, op, group_size, y, true);
#endif
  }
  if (M > kGemvMaxM[int(Fmt::kInt4)])
    return gemm_chunked(Fmt::kInt4, xp, M, K, wp, N, sp, op, group_size, y);
  gemv_int4(xp, M, K, wp, N, sp, op, group_size, y);
  return AOTI_TORCH_SUCCESS;
}

// y [M, N] (M >= 1) = (xq . w) * xs on the int4 kernel layout, groups of 32 to 256 (checked by
// the callers): the GEMV for small M, the machine's integer GEMM above
AOTITorchError int8_int4_rows(const int8_t* xp, const float* xsp, int64_t M, int64_t K,
                              const uint8_t* wp, int64_t N, const float* sp, const float* op,
                              int64_t group_size, float* y) {
  if (M <= kGemvMaxMInt4Int8) {
    gemv_int4_int8(xp, xsp, M, K, wp, N, sp, op, group_size, y);
    return AOTI_TORCH_SUCCESS;
  }
#if defined(FXQ_AMX)
  if (M >= kAmxMinM && group_size % 64 == 0 && amx_ready()) {
    gemm_int4_int8_amx(xp, xsp, M, K, wp, N, sp, op, group_size, y);
    return AOTI_TORCH_SUCCESS;
  }
#endif
#if defined(FXQ_VNNI512)
  gemm_int4_int8_vnni(xp, xsp, M, K, wp, N, sp, op, group_size, y);
  return AOTI_TORCH_SUCCESS;
#elif defined(FXQ_AVX2)
  gemm_int4_int8(xp, xsp, M, K, wp, N, sp, op, group_size, y);
  return AOTI_TORCH_SUCCESS;
#else
  const std::vector<float> xf = dequantize_activation(xp, xsp, M, K);
  return gemm_chunked(Fmt::kInt4, xf.data(), M, K, wp, N, sp, op, group_size, y);
#endif
}

// the W4A8 kernel's groups: the int16 lanes hold a group's sums, and the kernel is instantiated
// per size (see dot_int4_int8)
inline bool w4a8_group(int64_t g) { return g == 32 || g == 64 || g == 128 || g == 256; }

// The weight-only shims' body (bf16_x: int4_rows')
AOTITorchError int4_linear(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle scale,
                           AtenTensorHandle offset, int64_t group_size, AtenTensorHandle* ret0,
                           bool bf16_x = false) {
  Mat xm, wm, sm, om;
  if (!view(x, 2, aoti_torch_dtype_float32(), &xm) || !view(w, 2, aoti_torch_dtype_uint8(), &wm) ||
      !view(scale, 2, aoti_torch_dtype_float32(), &sm) ||
      !view(offset, 2, aoti_torch_dtype_float32(), &om))
    return AOTI_TORCH_FAILURE;
  const int64_t M = xm.rows, K = xm.cols, N = wm.rows;
  if (group_size <= 0 || group_size % 32 != 0 || K % group_size != 0 || wm.cols * 2 != K ||
      sm.rows != N || sm.cols != K / group_size || om.rows != N || om.cols != sm.cols)
    return AOTI_TORCH_FAILURE;
  float* y = nullptr;
  if (AOTITorchError e = new_output(M, N, ret0, &y)) return e;
  if (M == 0 || N == 0) return AOTI_TORCH_SUCCESS;
  return int4_rows(xm.as<float>(), M, K, wm.as<uint8_t>(), N, sm.as<float>(), om.as<float>(),
                   group_size, bf16_x, y);
}

// y = (xq . w) * xs on the int4 kernel layout: the W4A8 shims' body
AOTITorchError int8_int4_linear(const int8_t* xp, const float* xsp, int64_t M, int64_t K,
                                AtenTensorHandle w, AtenTensorHandle scale,
                                AtenTensorHandle offset, int64_t group_size,
                                AtenTensorHandle* ret0) {
  Mat wm, sm, om;
  if (!view(w, 2, aoti_torch_dtype_uint8(), &wm) ||
      !view(scale, 2, aoti_torch_dtype_float32(), &sm) ||
      !view(offset, 2, aoti_torch_dtype_float32(), &om))
    return AOTI_TORCH_FAILURE;
  const int64_t N = wm.rows;
  if (!w4a8_group(group_size) || K % group_size != 0 || wm.cols * 2 != K || sm.rows != N ||
      sm.cols != K / group_size || om.rows != N || om.cols != sm.cols)
    return AOTI_TORCH_FAILURE;
  float* y = nullptr;
  if (AOTITorchError e = new_output(M, N, ret0, &y)) return e;
  if (M == 0 || N == 0) return AOTI_TORCH_SUCCESS;
  return int8_int4_rows(xp, xsp, M, K, wm.as<uint8_t>(), N, sm.as<float>(), om.as<float>(),
                        group_size, y);
}

// ---- mixture-of-experts: int4 experts, weight-only and W4A8 ---------------------------------
// x [S, K] fp32 with its rows sorted by expert, offs [E] (int64) each expert's cumulative row
// end, w [E, N, K/2] in the kernel's int4 layout, scale and offset [E, N, K/g]: each expert's
// rows take the int4 linear's paths on that expert's weight (int8_fp8.cpp's int8 experts say
// why: decode reads only the chosen experts' bytes; rows of zeros are not run, and the row counts
// below are those that remain). An expert with at least int8_from rows (0:
// never) quantizes them per token to int8 (the reference's bytes) and takes the W4A8 kernels:
// W4A8 experts pass 1, int4 weight-only ones where the machine's dispatch table runs the int4
// linear so from that M. Else from bf16_from rows (0: never) the bf16-dot path, else fp32.
AOTITorchError int4_grouped_mm(AtenTensorHandle x, AtenTensorHandle w, AtenTensorHandle scale,
                               AtenTensorHandle offset, AtenTensorHandle offs, int64_t group_size,
                               int64_t bf16_from, int64_t int8_from, AtenTensorHandle* ret0) {
  Mat xm, wm, sm, om, fm;
  if (!view(x, 2, aoti_torch_dtype_float32(), &xm) || !view(w, 3, aoti_torch_dtype_uint8(), &wm) ||
      !view(scale, 3, aoti_torch_dtype_float32(), &sm) ||
      !view(offset, 3, aoti_torch_dtype_float32(), &om) ||
      !view(offs, 1, aoti_torch_dtype_int64(), &fm))
    return AOTI_TORCH_FAILURE;
  int64_t *ws = nullptr, *ss = nullptr, *os = nullptr;
  if (aoti_torch_get_sizes(w, &ws) || aoti_torch_get_sizes(scale, &ss) ||
      aoti_torch_get_sizes(offset, &os))
    return AOTI_TORCH_FAILURE;
  const int64_t S = xm.rows, K = xm.cols, E = ws[0], N = ws[1];
  if (group_size <= 0 || group_size % 32 != 0 || K % group_size != 0 || ws[2] * 2 != K ||
      fm.rows != E || (int8_from > 0 && !w4a8_group(group_size)))
    return AOTI_TORCH_FAILURE;
  const int64_t G = K / group_size;
  for (int i = 0; i < 3; ++i) {
    const int64_t want = i == 0 ? E : i == 1 ? N : G;
    if (ss[i] != want || os[i] != want) return AOTI_TORCH_FAILURE;
  }
  const float* xp = xm.as<float>();
  const uint8_t* wp = wm.as<uint8_t>();
  const float* sp = sm.as<float>();
  const float* op = om.as<float>();
  auto rows = [&](int64_t e, const float* xe, int64_t M, float* ye) -> AOTITorchError {
    const uint8_t* we = wp + e * N * (K / 2);
    const float* se = sp + e * N * G;
    const float* oe = op + e * N * G;
    if (int8_from > 0 && M >= int8_from) {
      std::vector<uint8_t> q(M * K);
      std::vector<float> qs(M);
      quantize_int8_rows(xe, M, K, q.data(), K, 0, qs.data());
      return int8_int4_rows((const int8_t*)q.data(), qs.data(), M, K, we, N, se, oe, group_size,
                            ye);
    }
    return int4_rows(xe, M, K, we, N, se, oe, group_size, bf16_from > 0 && M >= bf16_from, ye);
  };
  return run_grouped(xp, S, K, N, fm.as<int64_t>(), E, /*skip_zero_rows=*/true, ret0, rows);
}

}  // namespace
}  // namespace fxq

using namespace fxq;

// ---- C shims: the ABI AOTInductor calls (aoti_torch_cpu_<op name>) ---------------------------

extern "C" {

AOTITorchError aoti_torch_cpu_native_int4_weight_only_linear(AtenTensorHandle x,
                                                             AtenTensorHandle w,
                                                             AtenTensorHandle scale,
                                                             AtenTensorHandle offset,
                                                             int64_t group_size,
                                                             AtenTensorHandle* ret0) {
  return int4_linear(x, w, scale, offset, group_size, ret0);
}

AOTITorchError aoti_torch_cpu_native_int4_bf16dot_linear(AtenTensorHandle x, AtenTensorHandle w,
                                                         AtenTensorHandle scale,
                                                         AtenTensorHandle offset,
                                                         int64_t group_size,
                                                         AtenTensorHandle* ret0) {
  return int4_linear(x, w, scale, offset, group_size, ret0, true);
}

AOTITorchError aoti_torch_cpu_native_int8_int4_linear(AtenTensorHandle xq, AtenTensorHandle xs,
                                                      AtenTensorHandle w, AtenTensorHandle scale,
                                                      AtenTensorHandle offset, int64_t group_size,
                                                      AtenTensorHandle* ret0) {
  Mat xm, xsm;
  if (!view(xq, 2, aoti_torch_dtype_int8(), &xm) || !view(xs, 1, aoti_torch_dtype_float32(), &xsm) ||
      xsm.rows != xm.rows)
    return AOTI_TORCH_FAILURE;
  return int8_int4_linear(xm.as<int8_t>(), xsm.as<float>(), xm.rows, xm.cols, w, scale, offset,
                          group_size, ret0);
}

// W4A8 from fp32 activations: the per-token quantization here (quantize_int8_rows), then the
// W4A8 kernels as above
AOTITorchError aoti_torch_cpu_native_int8_dynamic_int4_linear(AtenTensorHandle x,
                                                              AtenTensorHandle w,
                                                              AtenTensorHandle scale,
                                                              AtenTensorHandle offset,
                                                              int64_t group_size,
                                                              AtenTensorHandle* ret0) {
  Int8Rows xq;
  if (!int8_rows(x, 1, 0, &xq)) return AOTI_TORCH_FAILURE;
  return int8_int4_linear(xq.as_int8(), xq.scale.data(), xq.rows, xq.cols, w, scale, offset,
                          group_size, ret0);
}

AOTITorchError aoti_torch_cpu_native_int4_grouped_mm(AtenTensorHandle x, AtenTensorHandle w,
                                                    AtenTensorHandle scale,
                                                    AtenTensorHandle offset, AtenTensorHandle offs,
                                                    int64_t group_size, int64_t bf16_from,
                                                    int64_t int8_from, AtenTensorHandle* ret0) {
  return int4_grouped_mm(x, w, scale, offset, offs, group_size, bf16_from, int8_from, ret0);
}

}  // extern "C"
