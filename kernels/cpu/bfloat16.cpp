// The 16-bit float linears a quantization config leaves in float in a bf16 or fp16 model (the
// tied lm_head under int8wo, a layer skipped for its shape, a model packaged as it is),
// y [M, N] fp32 = x [M, K] @ w [N, K]^T with w bf16 or fp16, for fxquant.passes.cpu.float32.
//
// Where this sits: beside the fp32 one (float32.cpp); the CPU lowering rewrites a bf16 (fp16)
// linear on a stored bf16 (fp16) weight to `fxquant::native_bfloat16_linear`
// (`native_float16_linear`), x given as fp32 rows, as every native linear takes it (the model's
// x is bf16 or fp16 already: exact in fp32).
//
// Why they exist: at M = 1 the linear is a read of its weight, and ATen's bf16 path read it at
// ~12 GB/s on the Zen 4 (two cores): SmolLM2 in bf16, nothing quantized, under Hugging Face's
// generate with the fxquant backend spent ~23 ms of a 26 ms decode step in aten::mm (270 MB of
// weights; torch profiler, a one-off run by hand). ATen's fp16 linear reads fast enough at M = 1
// but falls to ~1/10 of bf16's speed from M = 16 (SmolLM2's shapes, same machine, by hand).
//
// How: bf16 with AVX-512 BF16: bf16_dot.h's GEMMs on the weight as it lies (the row kernel up
// to kRowsMaxMBf16 rows, the packed panels above, on AMX tiles where the CPU has them). fp16,
// and bf16 without AVX-512 BF16: a GEMV of fp32 products of the widened values (F16C for fp16)
// up to kGemvMaxMHalf rows, and above, MKL's sgemm on chunks of the weight widened to fp32.
// fp16 on the Zen 4 against fp16 F.linear (one-off timings by hand, SmolLM2's shapes): 1.2-1.8x
// at M = 1, 2.1-3.7x at 4-32; the chunks 1.0-1.1x at 33 rows, 1.5-1.7x at 64, 2.1-4.0x at 128
// (8 MiB chunks: 1 MiB ones, each an MKL call that packs its part of the weight again, took
// 1.5 ms against 0.8 at 33 x 1536 x 576).
//
// Numerics: products of the 16-bit values (exact in fp32), sums in fp32 in another order than
// ATen's; bf16 rounds x to bf16 first (the dot products' operands; exact for a bf16 model's x),
// fp16 takes x as given. y not rounded (the caller rounds it to the model's dtype once, after
// the bias).

#include "bf16_dot.h"
#include "float_rows.h"

namespace fxq {
namespace {

#ifdef FXQ_BF16_512
// Up to this many rows bf16_dot.h's row kernel (each weight row read once for all of them);
// above, its packed-panel GEMM. Zen 4, two threads, SmolLM2's shapes and the stack's 4096 x 1024
// against bf16 F.linear (one-off timings by hand, noisy): the row kernel 2.4-4.1x at M = 1,
// 1.8-3.6x at 4, 1.4-1.8x at 8, 0.8-1.6x at 12; from 16 rows the panels 1.1-1.3x on four of the
// shapes, 0.9x on 576 x 1536 and 0.7-0.9x on the 49152 x 576 lm_head (a prompt's every-position
// logits only). ATen's bf16 mm itself, called on a bf16 copy of x, lost 0.74-0.98x to those
// copies.
constexpr int64_t kRowsMaxMBf16 = 15;

// bf16_dot.h's weight source for a stored bf16 [N, K] weight: its rows are already the values
struct Bf16Weight {
  const uint8_t* base;
  int64_t row_bytes;  // 2 K
  struct Row {
    const uint16_t* p;
    int64_t K;
    __m512bh operator()(int64_t k) const {
      return (__m512bh)_mm512_maskz_loadu_epi16(first_columns(K - k), p + k);
    }
    __m512bh full(int64_t k) const { return (__m512bh)_mm512_loadu_si512(p + k); }
  };
  Row row(int64_t n) const { return {(const uint16_t*)(base + n * row_bytes), row_bytes / 2}; }
};

#endif

// ---- The widening paths: fp16 weights everywhere, bf16 ones without AVX-512 BF16 -----------

// Up to this many rows the GEMV (float_rows.h: each weight row read once for all rows, as for
// fp32 weights); above, MKL's sgemm on widened chunks.
constexpr int64_t kGemvMaxMHalf = 32;

struct WidenTag {};

// y = x @ widen(w)^T by MKL's sgemm on chunks of up to 8 MiB of weight rows widened to fp32
// (native.h's mm_chunks, as linear.cpp's gemm_chunked dequantizes the byte formats)
template <class F>
AOTITorchError mm_half(const float* x, int64_t M, int64_t K, const uint16_t* w, int64_t N,
                       float* y) {
  return mm_chunks<WidenTag>(x, M, K, N, y, 8 << 20, [&](int64_t n0, int64_t nc, float* buf) {
#pragma omp parallel for schedule(static) if (nc * K > 65536)
    for (int64_t r = 0; r < nc; ++r) widen_row<F>(w + (n0 + r) * K, K, buf + r * K);
  });
}

// y [M, N] = x @ widen(w)^T with x [M, K] fp32 rows as given and w [N, K] of format F
template <class F>
AOTITorchError widened_linear(const float* x, int64_t M, int64_t K, const uint16_t* w,
                              int64_t N, AtenTensorHandle* ret0) {
  auto gemv = [&](float* y) { gemv_float_rows<F>(x, M, K, w, N, y); };
  auto mm = [&](float* y) { return mm_half<F>(x, M, K, w, N, y); };
  return run_linear(M, N, kGemvMaxMHalf, ret0, gemv, mm);
}

// x [M, K] and w [N, K] of the shims' contract: fp32 x, w of `w_dtype`, both contiguous
bool operands(AtenTensorHandle x, AtenTensorHandle w, int32_t w_dtype, Mat* xm, Mat* wm) {
  return view(x, 2, aoti_torch_dtype_float32(), xm) && view(w, 2, w_dtype, wm) &&
         wm->cols == xm->cols;
}

}  // namespace
}  // namespace fxq

using namespace fxq;

extern "C" {

AOTITorchError aoti_torch_cpu_native_bfloat16_linear(AtenTensorHandle x, AtenTensorHandle w,
                                                     AtenTensorHandle* ret0) {
  Mat xm, wm;
  if (!operands(x, w, aoti_torch_dtype_bfloat16(), &xm, &wm)) return AOTI_TORCH_FAILURE;
  const int64_t M = xm.rows, K = xm.cols, N = wm.rows;
  const float* xp = xm.as<float>();
  const uint16_t* wp = wm.as<uint16_t>();
#ifdef FXQ_BF16_512
  const Bf16Weight source{(const uint8_t*)wp, 2 * K};
  auto rows = [&](float* y) { gemm_rows_bf16(Bf16Rows(xp, M, K), M, K, source, N, nullptr, y); };
  auto panels = [&](float* y) {
    // AMX CPUs: the same panels on tiles (amx.h); without them the bf16 float package of
    // SmolLM2 prefilled at 0.36x bf16 Inductor there (results/llm_decode_xeon_amx.json)
    gemm_large_bf16(Bf16Rows(xp, M, K), M, K, source, N, nullptr, y);
    return AOTI_TORCH_SUCCESS;
  };
  return run_linear(M, N, kRowsMaxMBf16, ret0, rows, panels);
#else
  const std::vector<float> rounded = bf16_rounded(xp, M, K);  // the bf16 dot products' x
  return widened_linear<Bf16Format>(rounded.data(), M, K, wp, N, ret0);
#endif
}

AOTITorchError aoti_torch_cpu_native_float16_linear(AtenTensorHandle x, AtenTensorHandle w,
                                                    AtenTensorHandle* ret0) {
  Mat xm, wm;
  if (!operands(x, w, aoti_torch_dtype_float16(), &xm, &wm)) return AOTI_TORCH_FAILURE;
  return widened_linear<Fp16Format>(xm.as<float>(), xm.rows, xm.cols, wm.as<uint16_t>(),
                                    wm.rows, ret0);
}

}  // extern "C"
