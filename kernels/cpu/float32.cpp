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

#include "float_rows.h"

namespace fxq {
namespace {

// Up to this many activation rows the weight is read once for all of them (x's rows stay in
// L1/L2: 8 rows of K = 1536 are 48 KiB); above, MKL's sgemm, whose GEMM blocking wins there.
constexpr int64_t kGemvMaxMFloat32 = 8;

// y = x @ w^T by ATen's mm into y's storage (w [N, K] as a [K, N] transposed view; kn: w
// stored [K, N] already)
AOTITorchError mm_float32(const float* x, int64_t M, int64_t K, const float* w, int64_t N,
                          float* y, bool kn = false) {
  Owned xt, wt, yt;
  if (AOTITorchError e = matrix_blob(x, M, K, K, 1, &xt.h)) return e;
  if (AOTITorchError e = kn ? matrix_blob(w, K, N, N, 1, &wt.h) : matrix_blob(w, K, N, 1, K, &wt.h))
    return e;
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
  auto gemv = [&](float* y) { gemv_float_rows<Fp32Format>(xp, M, K, wp, N, y); };
  auto mm = [&](float* y) { return mm_float32(xp, M, K, wp, N, y); };
  return run_linear(M, N, kGemvMaxMFloat32, ret0, gemv, mm);
}

// Mixture-of-experts weights a config leaves in fp32: x [S, K] with its rows sorted by expert,
// offs [E] (int64) each expert's cumulative row end, w [E, N, K] ([E, K, N] with kn, gpt-oss'
// layout): each expert's rows on the linear's paths above (the GEMV up to kGemvMaxMFloat32 rows
// for [N, K] weights, ATen's mm otherwise), rows at or past offs[E-1] zeros. What transformers'
// grouped_mm fallback computes, without its Python op in the package. skip_zero_rows: rows of
// zeros give zeros without running (run_grouped), which the caller asks for only when the weight
// is finite (a zero row times an inf or NaN weight is NaN): Llama 4's experts kept in float.
AOTITorchError aoti_torch_cpu_native_float32_grouped_mm(AtenTensorHandle x, AtenTensorHandle w,
                                                        AtenTensorHandle offs, int64_t kn,
                                                        int64_t skip_zero_rows,
                                                        AtenTensorHandle* ret0) {
  Mat xm, wm, om;
  int64_t* wsizes = nullptr;
  if (!view(x, 2, aoti_torch_dtype_float32(), &xm) ||
      !view(w, 3, aoti_torch_dtype_float32(), &wm) ||
      !view(offs, 1, aoti_torch_dtype_int64(), &om) || aoti_torch_get_sizes(w, &wsizes))
    return AOTI_TORCH_FAILURE;
  const int64_t S = xm.rows, K = xm.cols, E = wsizes[0];
  const int64_t N = kn ? wsizes[2] : wsizes[1];
  if ((kn ? wsizes[1] : wsizes[2]) != K || om.rows != E) return AOTI_TORCH_FAILURE;
  const float *xp = xm.as<float>(), *wp = wm.as<float>();
  auto rows = [&](int64_t e, const float* xe, int64_t M, float* ye) -> AOTITorchError {
    const float* we = wp + e * N * K;
    if (kn || M > kGemvMaxMFloat32) return mm_float32(xe, M, K, we, N, ye, kn);
    gemv_float_rows<Fp32Format>(xe, M, K, we, N, ye);
    return AOTI_TORCH_SUCCESS;
  };
  return run_grouped(xp, S, K, N, om.as<int64_t>(), E, skip_zero_rows != 0, ret0, rows);
}

}  // extern "C"
