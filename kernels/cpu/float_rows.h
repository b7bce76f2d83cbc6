// The float weight formats the native kernels read as they lie (fp32, bf16, fp16), each widened
// to fp32 in registers, and the two loops built on them: a row widened into a buffer, and the
// GEMV of the float linears (each weight row read once for up to a few activation rows).
//
// Where this sits: included by float32.cpp (fp32 weights), bfloat16.cpp (bf16 and fp16 weights)
// and attention.cpp (a bf16 / fp16 KV cache widened as it is read).

#pragma once

#include "native.h"

#pragma GCC visibility push(hidden)

namespace fxq {

// A format F: its element type T, one value widened (one), and eight (eight, where kVector: the
// build has the instructions)
struct Fp32Format {
  using T = float;
  static constexpr bool kVector = true;
  static float one(float v) { return v; }
#if defined(FXQ_AVX2)
  static __m256 eight(const float* p) { return _mm256_loadu_ps(p); }
#endif
};

struct Bf16Format {
  using T = uint16_t;
  static constexpr bool kVector = true;
  static float one(uint16_t b) {
    const uint32_t bits = uint32_t(b) << 16;  // a bf16 is the top half of its fp32
    float f;
    std::memcpy(&f, &bits, 4);
    return f;
  }
#if defined(FXQ_AVX2)
  static __m256 eight(const uint16_t* p) {
    const __m128i h = _mm_loadu_si128((const __m128i*)p);
    return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(h), 16));
  }
#endif
};

struct Fp16Format {
  using T = uint16_t;
#if defined(FXQ_AVX2) && defined(__F16C__)
  static constexpr bool kVector = true;
  static __m256 eight(const uint16_t* p) {
    return _mm256_cvtph_ps(_mm_loadu_si128((const __m128i*)p));
  }
#else
  static constexpr bool kVector = false;
#endif
  static float one(uint16_t h) { return half_to_float(h); }
};

// dst [K] = the K values of row, widened
template <class F>
inline void widen_row(const typename F::T* row, int64_t K, float* dst) {
  int64_t k = 0;
#if defined(FXQ_AVX2)
  if constexpr (F::kVector)
    for (; k + 8 <= K; k += 8) _mm256_storeu_ps(dst + k, F::eight(row + k));
#endif
  for (; k < K; ++k) dst[k] = F::one(row[k]);
}

// out[r] = x[r] . widen(row) for R activation rows of K (x rows K apart)
template <class F, int R>
inline void dot_rows(const float* x, int64_t K, const typename F::T* row, float* out) {
  int64_t k = 0;
  float acc[R] = {};
  // 256-bit vectors on AVX-512 machines too: on the Zen 4 an AVX-512 build of this loop read
  // SmolLM2's fp32 lm_head and 60 of its 1536 x 576 weights from memory 5-10 % slower than the
  // AVX2 one (one-off timings, two runs each), as the int8 GEMV's AVX-512 loop was (int8_fp8.cpp)
#if defined(FXQ_AVX2)
  if constexpr (F::kVector) {
    __m256 a[R][2];
    for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
    for (; k + 16 <= K; k += 16) {
      const __m256 w0 = F::eight(row + k), w1 = F::eight(row + k + 8);
      for (int r = 0; r < R; ++r) {
        a[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), w0, a[r][0]);
        a[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k + 8), w1, a[r][1]);
      }
    }
    for (int r = 0; r < R; ++r) acc[r] = hsum(_mm256_add_ps(a[r][0], a[r][1]));
  }
#endif
  for (; k < K; ++k)
    for (int r = 0; r < R; ++r) acc[r] += x[r * K + k] * F::one(row[k]);
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// y [M, N] = x [M, K] (fp32) @ widen(w [N, K])^T for few rows: each weight row read once,
// against four activation rows at a time (then two, then one)
template <class F>
void gemv_float_rows(const float* x, int64_t M, int64_t K, const typename F::T* w, int64_t N,
                     float* y) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    prefetch_row_ahead(w, n, N, K * int64_t(sizeof(typename F::T)));
    const typename F::T* row = w + n * K;
    float dots[4];
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
      dot_rows<F, 4>(x + m * K, K, row, dots);
      for (int i = 0; i < 4; ++i) y[(m + i) * N + n] = dots[i];
    }
    for (; m + 2 <= M; m += 2) {
      dot_rows<F, 2>(x + m * K, K, row, dots);
      y[m * N + n] = dots[0];
      y[(m + 1) * N + n] = dots[1];
    }
    if (m < M) {
      dot_rows<F, 1>(x + m * K, K, row, dots);
      y[m * N + n] = dots[0];
    }
  }
}

}  // namespace fxq

#pragma GCC visibility pop
