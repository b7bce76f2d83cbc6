// Native CPU kernels for the quantized linears: what fxquant.passes.lower emits on CPU.
//
// Where this sits: the last step of the CPU data flow. The lowering rewrites each quantized
// linear to one `fxquant::native_*` op; Inductor calls it as an extern kernel, and AOTInductor
// calls the C shims (`aoti_torch_cpu_<op name>`, in int8_fp8.cpp and int4.cpp), which
// `fxquant.kernels.cpu` links statically into the package's model .so, so a package runs where
// fxquant is not installed.
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
// differs. The `*_bf16dot_*` ops are the exception they are named for: x (and an int4 weight's
// dequantized value) rounded to bf16, for AVX-512 BF16's dot products (bf16_dot.h). Layouts
// (made once by the lowering's prepack, fxquant.kernels.cpu.prepack_*):
//   int8      w [N, K] int8, scale [N] fp32                       y = (x . w) * scale
//   int8xint8 xq [M, K] int8, xs [M] fp32, w and scale as above     y = (xq . w) * xs * scale
//   int4      w [N, K/2] uint8: per 32 columns 16 bytes, byte i = u[i] | u[i + 16] << 4;
//             scale, offset [N, K/g] fp32 with w = u * scale + offset (offset = -z * scale)
//   int4xint8 xq, xs as int8xint8's; w, scale, offset as int4's        y = (xq . w) * xs
//   fp8 e4m3  w [N, K] float8_e4m3fn, scale [N] fp32                y = (x . w) * scale
//   fp8 block w [N, K] float8_e4m3fn, ws [ceil(N/b), ceil(K/b)] fp32, xq e4m3 values [M, K] and
//             xs [M, ceil(K/b)] (b-wide groups)    y = sum over spans kb of (xq . w)_kb * xs * ws
// The `*_dynamic_*` ops take fp32 x for int8xint8 (on the VNNI panels), int4xint8 and fp8 and
// quantize it per token first (quantize_int8_rows, quantize_fp8_rows: the reference's bytes and
// e4m3 values; fp8's y rows then times their scales); the fp8 block op quantizes it in groups
// (quantize_fp8_groups), its scaled twin takes xq and xs from a fused norm.
// Every input is contiguous; the output is a new fp32 [M, N] tensor. K of int4 is a multiple
// of 32 (the lowering pads); nothing else is assumed about the sizes.
//
// This file holds what every format shares: the large-M path (dequantize a chunk of weight rows,
// ATen's mm) and the shims' checks; the GEMVs and the shims are in int8_fp8.cpp and int4.cpp,
// the shared declarations and decoders in native.h.

#include "native.h"

namespace fxq {

void fp8_times(const uint8_t* w, int64_t len, float s, float* out) {
  int64_t k = 0;
#ifdef FXQ_AVX2
  for (; k + 8 <= len; k += 8)
    _mm256_storeu_ps(out + k, _mm256_mul_ps(load_fp8x8(w + k), _mm256_set1_ps(s)));
#endif
  for (; k < len; ++k) out[k] = fp8_e4m3_to_float(w[k]) * s;
}

namespace {

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
      fp8_times(w + n * K, K, scale[n], o);
    } else {
      const int64_t G = K / group;
      const uint8_t* row = w + n * (K / 2);
      const float *s = scale + n * G, *b = offset + n * G;
#ifdef FXQ_AVX2
      int4_row(row, K, group, s, b, [o](int64_t c, __m256 v) { _mm256_storeu_ps(o + c, v); });
#else
      int4_row(row, K, group, s, b, [o](int64_t c, float v) { o[c] = v; });
#endif
    }
  }
}

// The dequantized chunk comes from thread_buffer<ChunkTag> (native.h): a fresh std::vector of
// 2 MiB per call is an mmap, a page fault per 4 KiB and a memset every time. With that and the
// equal chunks below, SmolLM2's q/k/v and down_proj shapes at M = 128 went from a median 0.80
// to 0.88 of fp32 sgemm's speed (five paired runs, AVX2 EPYC; a one-off hand measurement).
struct ChunkTag {};

}  // namespace

// y [M, N] = x [M, K] (fp32) @ dequant(w)^T, a chunk of weight rows at a time (mm_chunks)
AOTITorchError gemm_chunked(Fmt fmt, const float* x, int64_t M, int64_t K, const uint8_t* w,
                            int64_t N, const float* scale, const float* offset, int64_t group,
                            float* y, bool bf16_weight) {
  return mm_chunks<ChunkTag>(x, M, K, N, y, kChunkBytes, [&](int64_t n0, int64_t nc, float* buf) {
    dequant_rows(fmt, w, K, scale, offset, group, n0, nc, buf);
    if (bf16_weight)
      for (int64_t i = 0; i < nc * K; ++i) buf[i] = bf16_round(buf[i]);
  });
}

// ---- Shim plumbing: checks, output allocation ----------------------------------------------

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
  // an empty tensor is contiguous whatever its strides (a slice of a padded one keeps them)
  const bool empty = std::find(sizes, sizes + dim, int64_t(0)) != sizes + dim;
  int64_t expect = 1;
  for (int64_t i = dim - 1; i >= 0 && !empty; --i) {
    if (sizes[i] != 1 && strides[i] != expect) return false;
    expect *= sizes[i];
  }
  if (aoti_torch_get_data_ptr(t, &out->data)) return false;
  out->rows = dim >= 1 ? sizes[0] : 1;
  out->cols = dim >= 2 ? sizes[1] : 1;
  return true;
}

AOTITorchError new_matrix(int64_t rows, int64_t cols, int32_t dtype, AtenTensorHandle* ret,
                          void** data) {
  const int64_t sizes[2] = {rows, cols}, strides[2] = {cols, 1};
  if (AOTITorchError e = aoti_torch_empty_strided(2, sizes, strides, dtype,
                                                  aoti_torch_device_type_cpu(), 0, ret))
    return e;
  return aoti_torch_get_data_ptr(*ret, data);
}

AOTITorchError new_output(int64_t M, int64_t N, AtenTensorHandle* ret, float** data) {
  return new_matrix(M, N, aoti_torch_dtype_float32(), ret, (void**)data);
}

std::vector<float> dequantize_activation(const int8_t* xq, const float* xs, int64_t M, int64_t K) {
  std::vector<float> xf(M * K);
  for (int64_t m = 0; m < M; ++m)
    for (int64_t k = 0; k < K; ++k) xf[m * K + k] = float(xq[m * K + k]) * xs[m];
  return xf;
}

namespace {
constexpr float kQuantEps = 1e-12f;  // fxquant.core.reference.EPS
constexpr float kInt8Max = 127.0f;
constexpr float kFp8Max = 448.0f;  // e4m3's largest finite value

// |x|'s maximum over a row (the quantizers' amax)
float row_amax(const float* x, int64_t K) {
  float amax = 0.0f;
  int64_t k = 0;
#if defined(FXQ_AVX512BW)
  __m512 vmax = _mm512_setzero_ps();
  for (; k + 16 <= K; k += 16) vmax = _mm512_max_ps(vmax, _mm512_abs_ps(_mm512_loadu_ps(x + k)));
  amax = _mm512_reduce_max_ps(vmax);
#elif defined(FXQ_AVX2)
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 vmax = _mm256_setzero_ps();
  for (; k + 8 <= K; k += 8)
    vmax = _mm256_max_ps(vmax, _mm256_andnot_ps(sign, _mm256_loadu_ps(x + k)));
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, vmax);
  for (float v : lanes) amax = std::max(amax, v);
#endif
  for (; k < K; ++k) amax = std::max(amax, std::fabs(x[k]));
  return amax;
}

void quantize_int8_row(const float* x, int64_t K, uint8_t* q, int64_t ld, uint8_t flip,
                       float* xs) {
  const float s = std::max(row_amax(x, K), kQuantEps) / kInt8Max;
  *xs = s;
  int64_t k = 0;
#if defined(FXQ_AVX512BW)
  const __m512 vs = _mm512_set1_ps(s), hi = _mm512_set1_ps(kInt8Max);
  const __m512 lo = _mm512_set1_ps(-kInt8Max);
  const __m128i vflip = _mm_set1_epi8(char(flip));
  for (; k + 16 <= K; k += 16) {
    // division, not a reciprocal's product: the reference divides (the same fp32 result)
    __m512 v = _mm512_div_ps(_mm512_loadu_ps(x + k), vs);
    v = _mm512_roundscale_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    v = _mm512_min_ps(_mm512_max_ps(v, lo), hi);
    const __m128i b = _mm512_cvtepi32_epi8(_mm512_cvtps_epi32(v));
    _mm_storeu_si128((__m128i*)(q + k), _mm_xor_si128(b, vflip));
  }
#elif defined(FXQ_AVX2)
  const __m256 vs = _mm256_set1_ps(s), hi = _mm256_set1_ps(kInt8Max);
  const __m256 lo = _mm256_set1_ps(-kInt8Max);
  const __m128i vflip = _mm_set1_epi8(char(flip));
  for (; k + 8 <= K; k += 8) {
    __m256 v = _mm256_div_ps(_mm256_loadu_ps(x + k), vs);
    v = _mm256_round_ps(v, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    const __m256i i32 = _mm256_cvtps_epi32(_mm256_min_ps(_mm256_max_ps(v, lo), hi));
    const __m128i i16 =
        _mm_packs_epi32(_mm256_castsi256_si128(i32), _mm256_extracti128_si256(i32, 1));
    _mm_storel_epi64((__m128i*)(q + k), _mm_xor_si128(_mm_packs_epi16(i16, i16), vflip));
  }
#endif
  for (; k < K; ++k) {  // nearbyint rounds half to even in the default rounding mode
    const float v = std::nearbyint(x[k] / s);
    q[k] = uint8_t(int8_t(std::min(std::max(v, -kInt8Max), kInt8Max))) ^ flip;
  }
  std::memset(q + K, flip, ld - K);
}

// v (|v| <= 448) -> the nearest e4m3 value, ties to even, as fp32: passes/cpu/float8.py's
// e4m3_values (fp32 keeps 3 of its 23 mantissa bits, rounding at bit 20; below 2^-6 a fixed
// step of 2^-9), which is exactly torch's conversion to float8_e4m3fn and back
inline float e4m3_round(float v) {
  if (std::fabs(v) < 0.015625f) return std::nearbyint(v * 512.0f) * (1.0f / 512.0f);
  uint32_t bits;
  std::memcpy(&bits, &v, 4);
  bits = (bits + 0x7FFFFu + ((bits >> 20) & 1u)) & 0xFFF00000u;
  std::memcpy(&v, &bits, 4);
  return v;
}

void quantize_fp8_row(const float* x, int64_t K, float ub, float* q, float* xs) {
  const float s = std::max(std::min(row_amax(x, K), ub), kQuantEps) / kFp8Max;
  *xs = s;
  int64_t k = 0;
#if defined(FXQ_AVX512BW)
  const __m512 vs = _mm512_set1_ps(s), hi = _mm512_set1_ps(kFp8Max);
  const __m512 lo = _mm512_set1_ps(-kFp8Max), tiny = _mm512_set1_ps(0.015625f);
  const __m512i half = _mm512_set1_epi32(0x7FFFF), one = _mm512_set1_epi32(1);
  const __m512i keep = _mm512_set1_epi32(int32_t(0xFFF00000u));
  for (; k + 16 <= K; k += 16) {
    const __m512 d = _mm512_div_ps(_mm512_loadu_ps(x + k), vs);
    const __m512 v = _mm512_min_ps(_mm512_max_ps(d, lo), hi);
    const __m512i bits = _mm512_castps_si512(v);
    const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 20), one);
    const __m512i r = _mm512_and_si512(_mm512_add_epi32(_mm512_add_epi32(bits, half), odd), keep);
    const __m512 sub = _mm512_mul_ps(
        _mm512_roundscale_ps(_mm512_mul_ps(v, _mm512_set1_ps(512.0f)),
                             _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC),
        _mm512_set1_ps(1.0f / 512.0f));
    const __mmask16 small = _mm512_cmp_ps_mask(_mm512_abs_ps(v), tiny, _CMP_LT_OQ);
    _mm512_storeu_ps(q + k, _mm512_mask_blend_ps(small, _mm512_castsi512_ps(r), sub));
  }
#endif
  for (; k < K; ++k) q[k] = e4m3_round(std::min(std::max(x[k] / s, -kFp8Max), kFp8Max));
}
}  // namespace

void quantize_int8_rows(const float* x, int64_t M, int64_t K, uint8_t* out, int64_t ld,
                        uint8_t flip, float* xs) {
#pragma omp parallel for schedule(static) if (M * K > 65536)
  for (int64_t m = 0; m < M; ++m) quantize_int8_row(x + m * K, K, out + m * ld, ld, flip, xs + m);
}

bool int8_rows(AtenTensorHandle x, int64_t align, uint8_t flip, Int8Rows* out) {
  Mat xm;
  if (!view(x, 2, aoti_torch_dtype_float32(), &xm)) return false;
  out->rows = xm.rows;
  out->cols = xm.cols;
  out->ld = (xm.cols + align - 1) / align * align;
  out->q.reset(new uint8_t[out->rows * out->ld]);
  out->scale.resize(out->rows);
  quantize_int8_rows(xm.as<float>(), out->rows, out->cols, out->q.get(), out->ld, flip,
                     out->scale.data());
  return true;
}

void quantize_fp8_rows(const float* x, int64_t M, int64_t K, float ub, float* xq, float* xs) {
#pragma omp parallel for schedule(static) if (M * K > 65536)
  for (int64_t m = 0; m < M; ++m) quantize_fp8_row(x + m * K, K, ub, xq + m * K, xs + m);
}

void quantize_fp8_groups(const float* x, int64_t M, int64_t K, int64_t group, float* xq,
                         float* xs) {
  const int64_t G = (K + group - 1) / group;
#pragma omp parallel for schedule(static) if (M * K > 65536)
  for (int64_t m = 0; m < M; ++m)
    for (int64_t g = 0; g < G; ++g) {
      const int64_t k0 = g * group, at = m * K + k0;
      quantize_fp8_row(x + at, std::min(group, K - k0), INFINITY, xq + at, xs + m * G + g);
    }
}

}  // namespace fxq
