// Native CPU kernels for byte weights: int8 and fp8 e4m3 weight-only linears (fp32
// activations), and int8 weights x int8 activations (w8a8). The layouts, numerics and the reason
// these exist are in linear.cpp's header; the large-M path they fall back to is there too.

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
  for (int64_t n = 0; n < N; ++n)
    for (int64_t m = 0; m < M; ++m)
      y[m * N + n] = float(dot_int8_int8(xq + m * K, w + n * K, K)) * xs[m] * scale[n];
#endif
}

#ifdef FXQ_AVX2
// ---- GEMM for larger M: int8 x int8 in exact int32, register tiles ---------------------------
// Above a few rows the GEMV's one-weight-row-at-a-time dot products leave the multipliers idle
// on loads; here R activation rows x C weight rows share every load (the R x C dot products of a
// 32-byte step reuse C weight and R activation vectors), with dequantize-and-sgemm's cache
// blocking. Products as in dot_int8_int8 (dot32_int8), so the sums, and y, are bit for bit
// the GEMV's. benchmarks/cpu_kernels.py on the AVX2 EPYC (Zen 3, 2 cores; SmolLM2-135M's 211
// linears): w8a8 1.37x / 1.44x fp32 at M = 128 / 512, where dequantizing to fp32 for MKL
// measured 1.01-1.25x / 1.02x.
template <int R, int C>
inline void tile_int8_int8(const int8_t* x, const int8_t* w, int64_t K, const float* xs,
                           const float* scale, float* y, int64_t ldy) {
  const __m256i ones = _mm256_set1_epi16(1);
  __m256i acc[R][C];
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) acc[i][j] = _mm256_setzero_si256();
  int64_t k = 0;
  for (; k + 32 <= K; k += 32) {
    __m256i wv[C];
    for (int j = 0; j < C; ++j) wv[j] = _mm256_loadu_si256((const __m256i*)(w + j * K + k));
    for (int i = 0; i < R; ++i) {
      const __m256i xv = _mm256_loadu_si256((const __m256i*)(x + i * K + k));
      const __m256i ax = _mm256_sign_epi8(xv, xv);  // |x|, once for the C weight rows
      for (int j = 0; j < C; ++j)
        acc[i][j] = _mm256_add_epi32(acc[i][j], dot32_int8(ax, xv, wv[j], ones));
    }
  }
  for (int i = 0; i < R; ++i)
    for (int j = 0; j < C; ++j) {
      int32_t d = hsum_i32(acc[i][j]);
      for (int64_t t = k; t < K; ++t) d += int32_t(x[i * K + t]) * w[j * K + t];
      y[i * ldy + j] = float(d) * xs[i] * scale[j];
    }
}

// y[m, n] = (sum_k xq[m, k] * w[n, k]) * xs[m] * scale[n], for M past the GEMV's limit
void gemm_int8_int8(const int8_t* xq, const float* xs, int64_t M, int64_t K, const int8_t* w,
                    int64_t N, const float* scale, float* y) {
  constexpr int R = 4, C = 2;  // 8 accumulators + 2 weight + 4 working registers of 16
  const int64_t k1 = std::max<int64_t>(K, 1);
  // a block of weight rows (16 KiB) stays in L1 while a block of activation rows (256 KiB)
  // passes over it; the activation block stays in L2 while every weight block passes
  const int64_t nb = std::max<int64_t>(C, 16 * 1024 / k1 / C * C);
  const int64_t mb = std::max<int64_t>(R, 256 * 1024 / k1 / R * R);
  const int64_t blocks = (N + nb - 1) / nb;
  for (int64_t m0 = 0; m0 < M; m0 += mb) {
    const int64_t m1 = std::min(M, m0 + mb);
#pragma omp parallel for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      const int64_t n0 = b * nb, n1 = std::min(N, n0 + nb);
      int64_t m = m0;
      for (; m + R <= m1; m += R) {
        int64_t n = n0;
        for (; n + C <= n1; n += C)
          tile_int8_int8<R, C>(xq + m * K, w + n * K, K, xs + m, scale + n, y + m * N + n, N);
        for (; n < n1; ++n)
          tile_int8_int8<R, 1>(xq + m * K, w + n * K, K, xs + m, scale + n, y + m * N + n, N);
      }
      for (; m < m1; ++m)
        for (int64_t n = n0; n < n1; ++n)
          tile_int8_int8<1, 1>(xq + m * K, w + n * K, K, xs + m, scale + n, y + m * N + n, N);
    }
  }
}
#endif

// ---- Shims' shared body: int8 and fp8 weights, fp32 activations ---------------------------

AOTITorchError bytes_linear(Fmt fmt, int32_t w_dtype, AtenTensorHandle x, AtenTensorHandle w,
                            AtenTensorHandle scale, AtenTensorHandle* ret0) {
  Mat xm, wm, sm;
  if (!view(x, 2, aoti_torch_dtype_float32(), &xm) || !view(w, 2, w_dtype, &wm) ||
      !view(scale, 1, aoti_torch_dtype_float32(), &sm) || wm.cols != xm.cols ||
      sm.rows != wm.rows)
    return AOTI_TORCH_FAILURE;
  const int64_t M = xm.rows, K = xm.cols, N = wm.rows;
  const float* xp = xm.as<float>();
  const uint8_t* wp = wm.as<uint8_t>();
  const float* sp = sm.as<float>();
  auto gemv = [&](float* y) {
    if (fmt == Fmt::kInt8)
      gemv_bytes<Fmt::kInt8>(xp, M, K, wp, N, sp, y);
    else
      gemv_bytes<Fmt::kFp8>(xp, M, K, wp, N, sp, y);
  };
  auto mm = [&](float* y) { return gemm_chunked(fmt, xp, M, K, wp, N, sp, nullptr, 0, y); };
  return run_linear(M, N, kGemvMaxM[int(fmt)], ret0, gemv, mm);
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
  const int8_t* xp = xm.as<int8_t>();
  const float* xsp = xsm.as<float>();
  const float* sp = sm.as<float>();
  auto gemv = [&](float* y) { gemv_int8_int8(xp, xsp, M, K, wm.as<int8_t>(), N, sp, y); };
  auto mm = [&](float* y) {
#ifdef FXQ_AVX2
    gemm_int8_int8(xp, xsp, M, K, wm.as<int8_t>(), N, sp, y);
    return AOTI_TORCH_SUCCESS;
#else
    const std::vector<float> xf = dequantize_activation(xp, xsp, M, K);
    return gemm_chunked(Fmt::kInt8, xf.data(), M, K, wm.as<uint8_t>(), N, sp, nullptr, 0, y);
#endif
  };
  return run_linear(M, N, kGemvMaxMInt8Int8, ret0, gemv, mm);
}

}  // extern "C"
