// The fp32 linear a quantization config leaves in float (an LLM's tied lm_head under int8wo),
// y [M, N] = x [M, K] @ w [N, K]^T, for fxquant.passes.cpu.float32.
//
// Where this sits: beside the quantized formats' kernels (int8_fp8.cpp, int4.cpp); the CPU
// lowering rewrites an fp32 linear on a stored weight to `fxquant::native_float32_linear`.
//
// Why it exists: at M = 1 the linear is a read of its weight, and ATen's fp32 path (MKL's sgemv)
// does not read at the memory's rate on every machine. On the AMD EPYC Zen 4 (2 cores, 31 GB/s
// fp32 `sum`) SmolLM2's 49152 x 576 lm_head took 10.0 ms at M = 1 (11 GB/s) and 26 ms at M = 2,
// with one thread or two: a third of an int8wo decode step's 14.6 ms (one-off timings by hand).
// Here the weight is streamed once, row by row, up to kGemvMaxMFloat32 activation rows against
// each row; above that the product is ATen's mm (MKL), as before.
//
// Numerics: fp32 products and sums, in another order than MKL's (the sums differ by rounding).

#include "native.h"

namespace fxq {
namespace {

// Up to this many activation rows the weight is read once for all of them (x's rows stay in
// L1/L2: 8 rows of K = 1536 are 48 KiB); above, MKL's sgemm, whose GEMM blocking wins there.
constexpr int64_t kGemvMaxMFloat32 = 8;

// out[r] = x[r] . row for R activation rows of K (x rows K apart)
template <int R>
inline void dot_rows(const float* x, int64_t K, const float* row, float* out) {
  int64_t k = 0;
  float acc[R] = {};
  // 256-bit vectors on AVX-512 machines too: on the Zen 4 an AVX-512 build of this loop read
  // SmolLM2's lm_head and 60 of its 1536 x 576 weights from memory 5-10 % slower than the AVX2
  // one (one-off timings, two runs each), as the int8 GEMV's AVX-512 loop was (int8_fp8.cpp)
#if defined(FXQ_AVX2)
  __m256 a[R][2];
  for (int r = 0; r < R; ++r) a[r][0] = a[r][1] = _mm256_setzero_ps();
  for (; k + 16 <= K; k += 16) {
    const __m256 w0 = _mm256_loadu_ps(row + k), w1 = _mm256_loadu_ps(row + k + 8);
    for (int r = 0; r < R; ++r) {
      a[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k), w0, a[r][0]);
      a[r][1] = _mm256_fmadd_ps(_mm256_loadu_ps(x + r * K + k + 8), w1, a[r][1]);
    }
  }
  for (int r = 0; r < R; ++r) acc[r] = hsum(_mm256_add_ps(a[r][0], a[r][1]));
#endif
  for (; k < K; ++k)
    for (int r = 0; r < R; ++r) acc[r] += x[r * K + k] * row[k];
  for (int r = 0; r < R; ++r) out[r] = acc[r];
}

// y [M, N] for M <= kGemvMaxMFloat32: each weight row read once, against four rows at a time
void gemv_float32(const float* x, int64_t M, int64_t K, const float* w, int64_t N, float* y) {
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    prefetch_row_ahead(w, n, N, K * 4);
    const float* row = w + n * K;
    float dots[4];
    int64_t m = 0;
    for (; m + 4 <= M; m += 4) {
      dot_rows<4>(x + m * K, K, row, dots);
      for (int i = 0; i < 4; ++i) y[(m + i) * N + n] = dots[i];
    }
    for (; m + 2 <= M; m += 2) {
      dot_rows<2>(x + m * K, K, row, dots);
      y[m * N + n] = dots[0];
      y[(m + 1) * N + n] = dots[1];
    }
    if (m < M) {
      dot_rows<1>(x + m * K, K, row, dots);
      y[m * N + n] = dots[0];
    }
  }
}

// y = x @ w^T by ATen's mm into y's storage (w as a [K, N] transposed view)
AOTITorchError mm_float32(const float* x, int64_t M, int64_t K, const float* w, int64_t N,
                          float* y) {
  Owned xt, wt, yt;
  if (AOTITorchError e = matrix_blob(x, M, K, K, 1, &xt.h)) return e;
  if (AOTITorchError e = matrix_blob(w, K, N, 1, K, &wt.h)) return e;
  if (AOTITorchError e = matrix_blob(y, M, N, N, 1, &yt.h)) return e;
  return aoti_torch_cpu_mm_out(yt.h, xt.h, wt.h);
}

}  // namespace
}  // namespace fxq

using namespace fxq;

extern "C" {

AOTITorchError aoti_torch_cpu_native_float32_linear(AtenTensorHandle x, AtenTensorHandle w,
                                                    AtenTensorHandle* ret0) {
  Mat xm, wm;
  if (!view(x, 2, aoti_torch_dtype_float32(), &xm) ||
      !view(w, 2, aoti_torch_dtype_float32(), &wm) || wm.cols != xm.cols)
    return AOTI_TORCH_FAILURE;
  const int64_t M = xm.rows, K = xm.cols, N = wm.rows;
  const float *xp = xm.as<float>(), *wp = wm.as<float>();
  auto gemv = [&](float* y) { gemv_float32(xp, M, K, wp, N, y); };
  auto mm = [&](float* y) { return mm_float32(xp, M, K, wp, N, y); };
  return run_linear(M, N, kGemvMaxMFloat32, ret0, gemv, mm);
}

}  // extern "C"
