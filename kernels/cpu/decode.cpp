// Weight decoders to bf16: the first half of the large-M bf16 GEMM the CPU dispatch picks
// (passes/cpu/dispatch.py) on CPUs whose bf16 GEMM beats fp32 sgemm (AVX-512 bf16, AMX).
//
// Where this sits: called by the lowering's "bf16" candidates of fp8 and int4 weights
// (passes/cpu/float8.py, passes/cpu/int4.py), once per call, before a bf16 F.linear; as every
// native kernel, through a C shim in AOTInductor packages and register.cpp in process.
//
// Why native: Inductor's CPU code converts e4m3 to another float one element at a time, and the
// int4 nibble layout through a stack/reshape it does not vectorize well. SmolLM2-135M's 211
// weights, one decode each (AMD EPYC Zen 4, 2 cores): e4m3 -> bf16 ~420 ms compiled, int4 ->
// bf16 ~70 ms; these stream the weight once at memory speed.
//
// Numerics: e4m3 -> bf16 is exact (3 mantissa bits fit bf16's 7; subnormals too), so the
// result equals w.to(torch.bfloat16). int4: w = u * scale + offset in fp32, rounded to the
// nearest bf16 (ties to even), as dequantize_native_int4(..., torch.bfloat16) computes it
// (up to whether the compiler fuses the multiply-add: one fp32 rounding).

#include "native.h"

namespace fxq {
namespace {

#ifdef FXQ_AVX2
// eight 32-bit lanes, each < 2^16, stored as eight uint16 at out
inline void store_u16x8(uint16_t* out, __m256i r) {
  // packus works per 128-bit lane: [r0..r3 r0..r3 | r4..r7 r4..r7]; gather quads 0 and 2
  const __m256i packed = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
  _mm_storeu_si128((__m128i*)out, _mm256_castsi256_si128(packed));
}

// eight fp32 -> eight bf16 (ties to even), stored at out
inline void store_bf16x8(uint16_t* out, __m256 v) {
  const __m256i b = _mm256_castps_si256(v);
  const __m256i odd = _mm256_and_si256(_mm256_srli_epi32(b, 16), _mm256_set1_epi32(1));
  store_u16x8(out, _mm256_srli_epi32(
                       _mm256_add_epi32(_mm256_add_epi32(b, _mm256_set1_epi32(0x7FFF)), odd), 16));
}
#endif

}  // namespace
}  // namespace fxq

using namespace fxq;

extern "C" {

// w [N, K] float8_e4m3fn -> the same values, bf16 [N, K]
AOTITorchError aoti_torch_cpu_native_float8_to_bfloat16(AtenTensorHandle w,
                                                        AtenTensorHandle* ret0) {
  Mat wm;
  if (!view(w, 2, aoti_torch_dtype_float8_e4m3fn(), &wm)) return AOTI_TORCH_FAILURE;
  const int64_t N = wm.rows, K = wm.cols;
  uint16_t* out = nullptr;
  if (AOTITorchError e = new_matrix(N, K, aoti_torch_dtype_bfloat16(), ret0, (void**)&out))
    return e;
  const uint8_t* src = wm.as<uint8_t>();
  const int64_t total = N * K;
  constexpr int64_t kBlock = 4096;
#pragma omp parallel for schedule(static)
  for (int64_t b0 = 0; b0 < total; b0 += kBlock) {
    const int64_t end = std::min(total, b0 + kBlock);
    int64_t i = b0;
#ifdef FXQ_AVX2
    // an e4m3 value's fp32 bits end in 16 zeros (at most 3 mantissa bits): bf16 is the top half
    for (; i + 8 <= end; i += 8)
      store_u16x8(out + i, _mm256_srli_epi32(_mm256_castps_si256(load_fp8x8(src + i)), 16));
#endif
    for (; i < end; ++i) out[i] = bf16_bits(fp8_e4m3_to_float(src[i]));
  }
  return AOTI_TORCH_SUCCESS;
}

// the int4 kernel layout (w [N, K/2] uint8, scale and offset [N, K/g] fp32; see linear.cpp)
// -> W = u * scale + offset, bf16 [N, K]
AOTITorchError aoti_torch_cpu_native_int4_to_bfloat16(AtenTensorHandle w, AtenTensorHandle scale,
                                                      AtenTensorHandle offset, int64_t group,
                                                      AtenTensorHandle* ret0) {
  Mat wm, sm, om;
  if (!view(w, 2, aoti_torch_dtype_uint8(), &wm) ||
      !view(scale, 2, aoti_torch_dtype_float32(), &sm) ||
      !view(offset, 2, aoti_torch_dtype_float32(), &om) || group <= 0 || group % 32 ||
      (2 * wm.cols) % group || sm.rows != wm.rows || sm.cols != 2 * wm.cols / group ||
      om.rows != sm.rows || om.cols != sm.cols)
    return AOTI_TORCH_FAILURE;
  const int64_t N = wm.rows, K = 2 * wm.cols, G = K / group;
  uint16_t* out = nullptr;
  if (AOTITorchError e = new_matrix(N, K, aoti_torch_dtype_bfloat16(), ret0, (void**)&out))
    return e;
  const uint8_t* src = wm.as<uint8_t>();
  const float* sp = sm.as<float>();
  const float* op = om.as<float>();
#pragma omp parallel for schedule(static)
  for (int64_t n = 0; n < N; ++n) {
    const uint8_t* row = src + n * (K / 2);
    uint16_t* o = out + n * K;
    const float *s = sp + n * G, *b = op + n * G;
#ifdef FXQ_AVX2
    int4_row(row, K, group, s, b, [o](int64_t c, __m256 v) { store_bf16x8(o + c, v); });
#else
    int4_row(row, K, group, s, b, [o](int64_t c, float v) { o[c] = bf16_bits(v); });
#endif
  }
  return AOTI_TORCH_SUCCESS;
}

}  // extern "C"
