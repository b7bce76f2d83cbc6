// Native CPU kernels for the quantized linears: what fxquant.passes.lower emits on CPU.
//
// Where this sits: the last step of the CPU data flow. The lowering rewrites each quantized
// linear to one `fxquant::native_*` op; Inductor calls it as an extern kernel, and AOTInductor
// calls the C shims below (`aoti_torch_cpu_<op name>`), which `fxquant.kernels.cpu` links
// statically into the package's model .so, so a package runs where fxquant is not installed.
// The same functions back the ops in process (register.cpp, through torch's stable ABI).
//
// Why they exist: at M = 1 (LLM decode) a linear is a read of its weight, and the ATen
// kernels PyTorch ships read int8 / int4 weights slower than fp32 MKL reads four times the
// bytes. benchmarks/native_kernels.py, one M = 1 pass over SmolLM2-135M's 211 linears (AVX2
// EPYC, 2 cores, eager calls): fp32 F.linear 50.7 ms, aten `_weight_int8pack_mm` 19.9,
// `_weight_int4pack_mm_for_cpu` 15.2; here int8 12.8, int8 x int8 11.2, int4 12.0, int4 x int8
// 8.4 (about 3 ms of each is the 211 eager dispatches). The GEMVs stream each weight row once,
// decode it in registers (int8, int4 nibbles, fp8 e4m3) and accumulate in fp32, or, where the
// activation is int8 too, in exact integers with maddubs. For larger M the weight is
// dequantized a chunk of rows at a time into a buffer that stays in cache and multiplied by
// ATen's mm (MKL): as fast as fp32 at prefill, with a quarter of the bytes at rest.
//
// Numerics match fxquant.core.reference: the same integer/fp8 values, scales applied in the same
// places, fp32 accumulation (int8 x int8 in exact int32); only the order of the fp32 sums
// differs. Layouts (made once by the lowering's prepack, fxquant.kernels.cpu.prepack_*):
//   int8      w [N, K] int8, scale [N] fp32                       y = (x . w) * scale
//   int8xint8 xq [M, K] int8, xs [M] fp32, w and scale as above     y = (xq . w) * xs * scale
//   int4      w [N, K/2] uint8: per 32 columns 16 bytes, byte i = u[i] | u[i + 16] << 4;
//             scale, offset [N, K/g] fp32 with w = u * scale + offset (offset = -z * scale)
//   int4xint8 xq, xs as int8xint8's; w, scale, offset as int4's        y = (xq . w) * xs
//   fp8 e4m3  w [N, K] float8_e4m3fn, scale [N] fp32                y = (x . w) * scale
// Every input is contiguous; the output is a new fp32 [M, N] tensor. K of int4 is a multiple
// of 32 (the lowering pads); nothing else is assumed about the sizes.

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/generated/c_shim_cpu.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FXQ_AVX2 1
#endif

namespace {

// Up to this many rows a GEMV (the weight read once, decoded once per four activation rows)
// beats dequantize + mm; above it the mm wins. Measured on SmolLM2's linears (all 211 of them,
// each size) on the AVX2 EPYC: int8 x int8 keeps winning longest (one maddubs per 32 products).
#ifndef FXQ_GEMV_MAX_M
#define FXQ_GEMV_MAX_M 32, 16, 32, 64, 32
#endif
constexpr int64_t kGemvLimits[] = {FXQ_GEMV_MAX_M};  // int8, int4, fp8, int8 x int8, int4 x int8
constexpr const int64_t* kGemvMaxM = kGemvLimits;
constexpr int64_t kGemvMaxMInt8Int8 = kGemvLimits[3];
constexpr int64_t kGemvMaxMInt4Int8 = kGemvLimits[4];
// Rows of weight dequantized per mm call: about 2 MiB of fp32, which stays in cache.
constexpr int64_t kChunkBytes = 2 * 1024 * 1024;

enum class Fmt { kInt8, kInt4, kFp8 };

// ---- scalar decoders (reference for the vector paths, and the non-AVX2 build) -------------

inline float fp8_e4m3_to_float(uint8_t b) {
  // The 7 magnitude bits moved to the top of an fp32's exponent/mantissa, then rebiased by
  // 2^(127-7): exact for normals and subnormals alike (0x7F, NaN in e4m3fn, never occurs in
  // a quantized weight: the rewrite refuses non-finite weights).
  uint32_t bits = (uint32_t(b & 0x7F) << 20) | (uint32_t(b & 0x80) << 24);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f * 0x1p120f;
}

inline float int4_code(const uint8_t* row, int64_t k) {
  const uint8_t byte = row[(k / 32) * 16 + (k % 16)];
  return float((k % 32) < 16 ? (byte & 0x0F) : (byte >> 4));
}

#ifdef FXQ_AVX2
inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

inline int32_t hsum_i32(__m256i v) {
  __m128i lo = _mm_add_epi32(_mm256_castsi256_si128(v), _mm256_extracti128_si256(v, 1));
  lo = _mm_add_epi32(lo, _mm_unpackhi_epi64(lo, lo));
  lo = _mm_add_epi32(lo, _mm_shuffle_epi32(lo, 1));
  return _mm_cvtsi128_si32(lo);
}

inline __m256 load_int8x8(const int8_t* p) {
  return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64((const __m128i*)p)));
}

inline __m256 load_fp8x8(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7F)), 20);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(mag, sign)),
                       _mm256_set1_ps(0x1p120f));
}
#endif

// ---- GEMV: y[m, n] for small M, one weight row at a time -----------------------------------
// Each thread walks its rows in order, and each row is one sequential read with four
// independent accumulators along K: the pattern the hardware prefetcher streams best (measured:
// 40% more bandwidth than four rows interleaved). The row (a few hundred bytes to a few KiB)
// stays in L1 while the M activation rows pass over it, so the weight is read from memory once.

// sum_k x[k] * w[k] for one row of int8 or e4m3 bytes
template <Fmt F>
inline float dot_bytes(const float* x, const uint8_t* row, int64_t K) {
  int64_t k = 0;
  float out = 0.f;
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
  out = hsum(_mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3)));
#endif
  for (; k < K; ++k)
    out += x[k] * (F == Fmt::kInt8 ? float(int8_t(row[k])) : fp8_e4m3_to_float(row[k]));
  return out;
}

// Four activation rows against one weight row: each 8 weights are decoded once and meet the four
// rows from L1 (x[m] is K floats apart), so the decode is paid once per weight, not per row.
template <Fmt F>
inline void dot_bytes_x4(const float* x, int64_t K, const uint8_t* row, float out[4]) {
  int64_t k = 0;
  for (int m = 0; m < 4; ++m) out[m] = 0.f;
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
      a[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k), w0, a[m]);
      b[m] = _mm256_fmadd_ps(_mm256_loadu_ps(x + m * K + k + 8), w1, b[m]);
    }
  }
  for (int m = 0; m < 4; ++m) out[m] = hsum(_mm256_add_ps(a[m], b[m]));
#endif
  for (; k < K; ++k) {
    const float wv = F == Fmt::kInt8 ? float(int8_t(row[k])) : fp8_e4m3_to_float(row[k]);
    for (int m = 0; m < 4; ++m) out[m] += x[m * K + k] * wv;
  }
}

// y[m, n] = (sum_k x[m, k] * w[n, k]) * scale[n]   (w int8 or fp8 bits)
template <Fmt F>
void gemv_bytes(const float* x, int64_t M, int64_t K, const uint8_t* w, int64_t N,
                const float* scale, float* y) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* row = w + n * K;
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
      float out[4];
      dot_bytes_x4<F>(x + m * K, K, row, out);
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
  // maddubs multiplies unsigned by signed bytes: |x| times w with x's sign moved onto w.
  // |x| <= 127 and |w| <= 127, so a pair sums to at most 2 * 127 * 127 < 2^15: no saturation,
  // and the int32 sums are exact.
  const __m256i ones = _mm256_set1_epi16(1);
  auto dot32 = [&](int64_t at) {
    const __m256i xv = _mm256_loadu_si256((const __m256i*)(x + at));
    const __m256i wv = _mm256_loadu_si256((const __m256i*)(row + at));
    const __m256i p16 = _mm256_maddubs_epi16(_mm256_sign_epi8(xv, xv), _mm256_sign_epi8(wv, xv));
    return _mm256_madd_epi16(p16, ones);
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

// y[m, n] = (sum_k xq[m, k] * w[n, k]) * xs[m] * scale[n]
void gemv_int8_int8(const int8_t* xq, const float* xs, int64_t M, int64_t K, const int8_t* w,
                    int64_t N, const float* scale, float* y) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m = 0; m < M; ++m)
      y[m * N + n] = float(dot_int8_int8(xq + m * K, w + n * K, K)) * xs[m] * scale[n];
}

// int4, one row: sum_g scale[g] * (sum_{k in g} x u) + offset[g] * xsum[g]
inline float dot_int4(const float* x, const uint8_t* row, const float* scale, const float* offset,
                      const float* xsum, int64_t K, int64_t group) {
  const int64_t G = K / group;
  float off = 0.f;
  for (int64_t g = 0; g < G; ++g) off += offset[g] * xsum[g];
#ifdef FXQ_AVX2
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
  std::vector<float> xsum(M * G);  // per activation row and group: sum of x (the offset term)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      float s = 0.f;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) s += x[m * K + k];
      xsum[m * G + g] = s;
    }
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
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

// groups of 32, 64, 128 or 256 columns (the shim checks)
void gemv_int4_int8(const int8_t* xq, const float* xs, int64_t M, int64_t K, const uint8_t* w,
                    int64_t N, const float* scale, const float* offset, int64_t group, float* y) {
  const int64_t G = K / group;
  std::vector<float> xsum(M * G);  // per activation row and group: sum of xq (exact in fp32)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      int32_t s = 0;
      for (int64_t k = g * group; k < (g + 1) * group; ++k) s += xq[m * K + k];
      xsum[m * G + g] = float(s);
    }
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

// ---- Large M: dequantize a chunk of rows, mm straight into the output ---------------------

// rows [n0, n0 + nc) of the weight, dequantized to fp32 with their scales folded in
void dequant_rows(Fmt fmt, const uint8_t* w, int64_t K, const float* scale, const float* offset,
                  int64_t group, int64_t n0, int64_t nc, float* out) {
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < nc; ++r) {
    const int64_t n = n0 + r;
    float* o = out + r * K;
    if (fmt == Fmt::kInt8) {
      const int8_t* row = (const int8_t*)w + n * K;
      const float s = scale[n];
      for (int64_t k = 0; k < K; ++k) o[k] = float(row[k]) * s;
    } else if (fmt == Fmt::kFp8) {
      const uint8_t* row = w + n * K;
      const float s = scale[n];
      int64_t k = 0;
#ifdef FXQ_AVX2
      for (; k + 8 <= K; k += 8)
        _mm256_storeu_ps(o + k, _mm256_mul_ps(load_fp8x8(row + k), _mm256_set1_ps(s)));
#endif
      for (; k < K; ++k) o[k] = fp8_e4m3_to_float(row[k]) * s;
    } else {
      const uint8_t* row = w + n * (K / 2);
      const int64_t G = K / group;
      for (int64_t k0 = 0; k0 < K; k0 += 32) {  // K is a multiple of the group, hence of 32
        const float s = scale[n * G + k0 / group], b = offset[n * G + k0 / group];
        const uint8_t* bytes = row + k0 / 2;
#ifdef FXQ_AVX2
        const __m256i low = _mm256_set1_epi32(0x0F);
        const __m256 sv = _mm256_set1_ps(s), bv = _mm256_set1_ps(b);
        for (int h = 0; h < 2; ++h) {  // bytes 0-7 hold columns 0-7 and 16-23; 8-15: 8-15, 24-31
          const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(bytes + 8 * h)));
          const __m256 lo = _mm256_cvtepi32_ps(_mm256_and_si256(v, low));
          const __m256 hi = _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
          _mm256_storeu_ps(o + k0 + 8 * h, _mm256_fmadd_ps(lo, sv, bv));
          _mm256_storeu_ps(o + k0 + 16 + 8 * h, _mm256_fmadd_ps(hi, sv, bv));
        }
#else
        for (int i = 0; i < 16; ++i) {
          o[k0 + i] = float(bytes[i] & 0x0F) * s + b;
          o[k0 + 16 + i] = float(bytes[i] >> 4) * s + b;
        }
#endif
      }
    }
  }
}

AOTITorchError blob(void* data, int64_t rows, int64_t cols, int64_t row_stride,
                    int64_t col_stride, AtenTensorHandle* out) {
  const int64_t sizes[2] = {rows, cols}, strides[2] = {row_stride, col_stride};
  return aoti_torch_create_tensor_from_blob(data, 2, sizes, strides, 0,
                                            aoti_torch_dtype_float32(),
                                            aoti_torch_device_type_cpu(), 0, out);
}

struct Handles {  // owns up to four AtenTensorHandle references
  AtenTensorHandle hs[4] = {nullptr, nullptr, nullptr, nullptr};
  int n = 0;
  AtenTensorHandle* add() { return &hs[n++]; }
  ~Handles() {
    for (AtenTensorHandle h : hs)
      if (h) aoti_torch_delete_tensor_object(h);
  }
};

// y [M, N] = x [M, K] (fp32) @ dequant(w)^T, a chunk of weight rows at a time: the chunk is
// written to a buffer that stays in cache, and ATen's mm (MKL) writes y's columns in place.
AOTITorchError gemm_chunked(Fmt fmt, const float* x, int64_t M, int64_t K, const uint8_t* w,
                            int64_t N, const float* scale, const float* offset, int64_t group,
                            float* y) {
  const int64_t nc_max = std::max<int64_t>(16, kChunkBytes / (4 * std::max<int64_t>(K, 1)));
  std::vector<float> wbuf(std::min(nc_max, N) * K);
  Handles h;
  AtenTensorHandle* xt = h.add();
  if (AOTITorchError e = blob((void*)x, M, K, K, 1, xt)) return e;
  for (int64_t n0 = 0; n0 < N; n0 += nc_max) {
    const int64_t nc = std::min(nc_max, N - n0);
    dequant_rows(fmt, w, K, scale, offset, group, n0, nc, wbuf.data());
    Handles chunk;
    AtenTensorHandle* wt = chunk.add();  // the chunk as a [K, nc] (transposed) view
    AtenTensorHandle* yt = chunk.add();  // y[:, n0 : n0 + nc], row stride N
    if (AOTITorchError e = blob(wbuf.data(), K, nc, 1, K, wt)) return e;
    if (AOTITorchError e = blob(y + n0, M, nc, N, 1, yt)) return e;
    if (AOTITorchError e = aoti_torch_cpu_mm_out(*yt, *xt, *wt)) return e;
  }
  return AOTI_TORCH_SUCCESS;
}

// ---- Shim plumbing: checks, output allocation ----------------------------------------------

struct Mat {
  void* data = nullptr;
  int64_t rows = 0, cols = 0;
};

// A contiguous tensor of `dim` dims and dtype `dtype`, on CPU; 2-D ones as (rows, cols).
bool view(AtenTensorHandle t, int64_t dim, int32_t dtype, Mat* out) {
  int64_t d = 0;
  int32_t dt = 0, dev = 0;
  int64_t* sizes = nullptr;
  int64_t* strides = nullptr;
  if (aoti_torch_get_dim(t, &d) || d != dim) return false;
  if (aoti_torch_get_dtype(t, &dt) || dt != dtype) return false;
  if (aoti_torch_get_device_type(t, &dev) || dev != aoti_torch_device_type_cpu()) return false;
  if (aoti_torch_get_sizes(t, &sizes) || aoti_torch_get_strides(t, &strides)) return false;
  int64_t expect = 1;
  for (int64_t i = dim - 1; i >= 0; --i) {
    if (sizes[i] != 1 && strides[i] != expect) return false;
    expect *= sizes[i];
  }
  if (aoti_torch_get_data_ptr(t, &out->data)) return false;
  out->rows = dim >= 1 ? sizes[0] : 1;
  out->cols = dim >= 2 ? sizes[1] : 1;
  return true;
}

AOTITorchError new_output(int64_t M, int64_t N, AtenTensorHandle* ret, float** data) {
  const int64_t sizes[2] = {M, N}, strides[2] = {N, 1};
  if (AOTITorchError e = aoti_torch_empty_strided(2, sizes, strides, aoti_torch_dtype_float32(),
                                                  aoti_torch_device_type_cpu(), 0, ret))
    return e;
  void* p = nullptr;
  if (AOTITorchError e = aoti_torch_get_data_ptr(*ret, &p)) return e;
  *data = (float*)p;
  return AOTI_TORCH_SUCCESS;
}

AOTITorchError bytes_linear(Fmt fmt, int32_t w_dtype, AtenTensorHandle x, AtenTensorHandle w,
                            AtenTensorHandle scale, AtenTensorHandle* ret0) {
  Mat xm, wm, sm;
  if (!view(x, 2, aoti_torch_dtype_float32(), &xm) || !view(w, 2, w_dtype, &wm) ||
      !view(scale, 1, aoti_torch_dtype_float32(), &sm) || wm.cols != xm.cols ||
      sm.rows != wm.rows)
    return AOTI_TORCH_FAILURE;
  const int64_t M = xm.rows, K = xm.cols, N = wm.rows;
  float* y = nullptr;
  if (AOTITorchError e = new_output(M, N, ret0, &y)) return e;
  if (M == 0 || N == 0) return AOTI_TORCH_SUCCESS;
  const auto* xp = (const float*)xm.data;
  const auto* wp = (const uint8_t*)wm.data;
  const auto* sp = (const float*)sm.data;
  if (M <= kGemvMaxM[int(fmt)]) {
    if (fmt == Fmt::kInt8)
      gemv_bytes<Fmt::kInt8>(xp, M, K, wp, N, sp, y);
    else
      gemv_bytes<Fmt::kFp8>(xp, M, K, wp, N, sp, y);
    return AOTI_TORCH_SUCCESS;
  }
  return gemm_chunked(fmt, xp, M, K, wp, N, sp, nullptr, 0, y);
}

}  // namespace

// ---- C shims: the ABI AOTInductor calls (aoti_torch_cpu_<op name>) ---------------------------

extern "C" {

AOTITorchError aoti_torch_cpu_native_int8_weight_only_linear(AtenTensorHandle x,
                                                             AtenTensorHandle w,
                                                             AtenTensorHandle scale,
                                                             AtenTensorHandle* ret0) {
  return bytes_linear(Fmt::kInt8, aoti_torch_dtype_int8(), x, w, scale, ret0);
}

AOTITorchError aoti_torch_cpu_native_float8_weight_only_linear(AtenTensorHandle x,
                                                               AtenTensorHandle w,
                                                               AtenTensorHandle scale,
                                                               AtenTensorHandle* ret0) {
  return bytes_linear(Fmt::kFp8, aoti_torch_dtype_float8_e4m3fn(), x, w, scale, ret0);
}

AOTITorchError aoti_torch_cpu_native_int8_scaled_linear(AtenTensorHandle xq, AtenTensorHandle xs,
                                                        AtenTensorHandle w,
                                                        AtenTensorHandle scale,
                                                        AtenTensorHandle* ret0) {
  Mat xm, xsm, wm, sm;
  if (!view(xq, 2, aoti_torch_dtype_int8(), &xm) || !view(xs, 1, aoti_torch_dtype_float32(), &xsm) ||
      !view(w, 2, aoti_torch_dtype_int8(), &wm) || !view(scale, 1, aoti_torch_dtype_float32(), &sm) ||
      wm.cols != xm.cols || sm.rows != wm.rows || xsm.rows != xm.rows)
    return AOTI_TORCH_FAILURE;
  const int64_t M = xm.rows, K = xm.cols, N = wm.rows;
  float* y = nullptr;
  if (AOTITorchError e = new_output(M, N, ret0, &y)) return e;
  if (M == 0 || N == 0) return AOTI_TORCH_SUCCESS;
  const auto* xp = (const int8_t*)xm.data;
  const auto* xsp = (const float*)xsm.data;
  const auto* wp = (const int8_t*)wm.data;
  const auto* sp = (const float*)sm.data;
  if (M <= kGemvMaxMInt8Int8) {
    gemv_int8_int8(xp, xsp, M, K, wp, N, sp, y);
    return AOTI_TORCH_SUCCESS;
  }
  std::vector<float> xf(M * K);  // the dequantized activation, xq * xs
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xf[m * K + k] = float(xp[m * K + k]) * xsp[m];
  return gemm_chunked(Fmt::kInt8, xf.data(), M, K, (const uint8_t*)wp, N, sp, nullptr, 0, y);
}

AOTITorchError aoti_torch_cpu_native_int4_weight_only_linear(AtenTensorHandle x,
                                                             AtenTensorHandle w,
                                                             AtenTensorHandle scale,
                                                             AtenTensorHandle offset,
                                                             int64_t group_size,
                                                             AtenTensorHandle* ret0) {
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
  const auto* xp = (const float*)xm.data;
  const auto* wp = (const uint8_t*)wm.data;
  const auto* sp = (const float*)sm.data;
  const auto* op = (const float*)om.data;
  if (M <= kGemvMaxM[int(Fmt::kInt4)]) {
    gemv_int4(xp, M, K, wp, N, sp, op, group_size, y);
    return AOTI_TORCH_SUCCESS;
  }
  return gemm_chunked(Fmt::kInt4, xp, M, K, wp, N, sp, op, group_size, y);
}

AOTITorchError aoti_torch_cpu_native_int8_int4_linear(AtenTensorHandle xq, AtenTensorHandle xs,
                                                      AtenTensorHandle w, AtenTensorHandle scale,
                                                      AtenTensorHandle offset, int64_t group_size,
                                                      AtenTensorHandle* ret0) {
  Mat xm, xsm, wm, sm, om;
  if (!view(xq, 2, aoti_torch_dtype_int8(), &xm) || !view(xs, 1, aoti_torch_dtype_float32(), &xsm) ||
      !view(w, 2, aoti_torch_dtype_uint8(), &wm) ||
      !view(scale, 2, aoti_torch_dtype_float32(), &sm) ||
      !view(offset, 2, aoti_torch_dtype_float32(), &om))
    return AOTI_TORCH_FAILURE;
  const int64_t M = xm.rows, K = xm.cols, N = wm.rows;
  // groups of 32 to 256 columns, powers of two: the int16 lanes hold a group's sums, and the
  // kernel is instantiated per size (see dot_int4_int8)
  if ((group_size != 32 && group_size != 64 && group_size != 128 && group_size != 256) ||
      K % group_size != 0 ||
      wm.cols * 2 != K || xsm.rows != M || sm.rows != N || sm.cols != K / group_size ||
      om.rows != N || om.cols != sm.cols)
    return AOTI_TORCH_FAILURE;
  float* y = nullptr;
  if (AOTITorchError e = new_output(M, N, ret0, &y)) return e;
  if (M == 0 || N == 0) return AOTI_TORCH_SUCCESS;
  const auto* xp = (const int8_t*)xm.data;
  const auto* xsp = (const float*)xsm.data;
  const auto* wp = (const uint8_t*)wm.data;
  const auto* sp = (const float*)sm.data;
  const auto* op = (const float*)om.data;
  if (M <= kGemvMaxMInt4Int8) {
    gemv_int4_int8(xp, xsp, M, K, wp, N, sp, op, group_size, y);
    return AOTI_TORCH_SUCCESS;
  }
  std::vector<float> xf(M * K);  // the dequantized activation, xq * xs
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xf[m * K + k] = float(xp[m * K + k]) * xsp[m];
  return gemm_chunked(Fmt::kInt4, xf.data(), M, K, wp, N, sp, op, group_size, y);
}

}  // extern "C"
