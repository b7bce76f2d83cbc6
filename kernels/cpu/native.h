// What the native CPU kernels' sources share: the vector decoders, the GEMV / mm thresholds,
// and the large-M path and shim plumbing of linear.cpp (declared here, defined there).
//
// Where this sits: included by linear.cpp (the shared parts), int8_fp8.cpp (int8 and fp8
// weights) and int4.cpp (int4 weights); fxquant.kernels.cpu compiles the three into one library.
// Everything here has hidden visibility: it is internal to the library, or to the AOTInductor
// model .so the static archive is linked into, so two packages (or a package and the in-process
// library) loaded into one process never bind to each other's copies.

#pragma once

#include <torch/csrc/inductor/aoti_torch/c/shim.h>
#include <torch/csrc/inductor/aoti_torch/generated/c_shim_cpu.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <memory>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__)
#include <immintrin.h>
#define FXQ_AVX2 1
#endif
#if defined(FXQ_AVX2) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define FXQ_AVX512BW 1  // AVX-512 with byte / word lanes and 128- / 256-bit forms
#endif
#if defined(FXQ_AVX2) && defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define FXQ_VNNI512 1  // int8 x int8 dot products in one instruction (vpdpbusd)
#endif
#if defined(FXQ_AVX512BW) && defined(__AVX512VBMI__)
#define FXQ_VBMI 1  // byte permutes across a whole vector (vpermi2b): table lookups of 128 bytes
#endif
#if defined(FXQ_AVX2) && defined(__AVX512BF16__) && defined(__AVX512BW__) && \
    defined(__AVX512VL__)
#define FXQ_BF16_512 1  // bf16 pair dot products into fp32 lanes (vdpbf16ps)
#endif

#pragma GCC visibility push(hidden)

namespace fxq {

// Up to this many rows a GEMV (the weight read once, decoded once per four activation rows)
// beats the large-M path; above it that path wins. Measured on SmolLM2's linears (all 211 of
// them, each size) on the AVX2 EPYC. Past the limit the weight-only formats dequantize a chunk
// for MKL's sgemm; int8 x int8 and int4 x int8 have their own packed-panel GEMMs on AVX2
// (int8_fp8.cpp, int4.cpp); the int8 one overtakes its GEMV from 4 rows, the W4A8 one from 9
// (Zen 3, SmolLM2's 1536 x 576 and 576 x 1536 and the stack's 4096 x 1024, two threads, one
// build with the GEMVs and one without them, compared per M: a one-off comparison, not a
// benchmarks/ script). With AVX-512 VNNI the int8 x int8 and W4A8 GEMMs have 16-column panels
// and vpdpbusd (int8_fp8.cpp, int4.cpp) and overtake their GEMVs from 3 and 5 rows (Zen 4, the
// same shapes and comparison; int8 x int8 ties at 2 rows, and at 1 the GEMV's one pass over the
// weight is 1.5x faster; W4A8 ties at 4 and the GEMM is 1.2-1.8x faster at 8-16).
#ifndef FXQ_GEMV_MAX_M
#ifdef FXQ_VNNI512
#define FXQ_GEMV_MAX_M 32, 16, 32, 2, 4
#else
#define FXQ_GEMV_MAX_M 32, 16, 32, 3, 8
#endif
#endif
constexpr int64_t kGemvLimits[] = {FXQ_GEMV_MAX_M};  // int8, int4, fp8, int8 x int8, int4 x int8
constexpr const int64_t* kGemvMaxM = kGemvLimits;
constexpr int64_t kGemvMaxMInt8Int8 = kGemvLimits[3];
constexpr int64_t kGemvMaxMInt4Int8 = kGemvLimits[4];
// Rows of weight dequantized per mm call: about 2 MiB of fp32, which stays in cache.
constexpr int64_t kChunkBytes = 2 * 1024 * 1024;

// p rounded up to the next 64-byte line (a buffer 63 bytes larger than it needs holds that)
template <class T>
inline T* line_aligned(T* p) {
  return (T*)(((uintptr_t)p + 63) & ~uintptr_t(63));
}

#ifdef FXQ_AVX512BW
// 16 lanes' mask of the first `cols` (all when cols >= 16): a 16-column panel's last columns
inline __mmask16 first_columns16(int64_t cols) {
  return cols >= 16 ? __mmask16(0xFFFF) : __mmask16((1u << cols) - 1);
}
#endif

enum class Fmt { kInt8, kInt4, kFp8 };

// The GEMVs read each weight row once, in order. The hardware prefetcher follows that stream,
// but asking for the row four ahead as well keeps more cache misses in flight: on SmolLM2's 121
// int8 x int8 GEMVs of one decode step (134 MB, from memory) 6.3 -> 5.6 ms, 21 -> 24 GB/s on the
// AVX2 EPYC, two threads (a paired one-off C++ comparison, the variants alternated 100 times;
// 8 and 16 rows ahead were a little slower than 4, four rows interleaved far slower).
constexpr int64_t kPrefetchRows = 4;
inline void prefetch_row_ahead(const void* w, int64_t n, int64_t N, int64_t row_bytes) {
  if (n + kPrefetchRows >= N) return;
  const char* p = (const char*)w + (n + kPrefetchRows) * row_bytes;
  for (int64_t b = 0; b < row_bytes; b += 64) __builtin_prefetch(p + b, 0, 3);
}

// ---- ATen calls from the kernels (linear.cpp, float32.cpp: mm; attention.cpp: bmm) ----------

// An fp32 CPU tensor over `data` (not owned) with the given sizes and strides (elements)
inline AOTITorchError float_blob(const float* data, int64_t ndim, const int64_t* sizes,
                                 const int64_t* strides, AtenTensorHandle* out) {
  return aoti_torch_create_tensor_from_blob((void*)data, ndim, sizes, strides, 0,
                                            aoti_torch_dtype_float32(),
                                            aoti_torch_device_type_cpu(), 0, out);
}

// a [rows, cols] view of fp32 data (strides in elements)
inline AOTITorchError matrix_blob(const float* data, int64_t rows, int64_t cols,
                                  int64_t row_stride, int64_t col_stride, AtenTensorHandle* out) {
  const int64_t sizes[2] = {rows, cols}, strides[2] = {row_stride, col_stride};
  return float_blob(data, 2, sizes, strides, out);
}

struct Owned {  // an AtenTensorHandle deleted at scope exit
  AtenTensorHandle h = nullptr;
  Owned() = default;
  Owned(const Owned&) = delete;
  Owned& operator=(const Owned&) = delete;
  ~Owned() {
    if (h) aoti_torch_delete_tensor_object(h);
  }
};

// n floats, uninitialised, from one buffer per thread and per Tag (each caller its own), kept
// between calls and grown as needed: a fresh allocation per call is an mmap and a page fault
// per 4 KiB every time
template <class Tag>
float* thread_buffer(int64_t n) {
  thread_local std::unique_ptr<float[]> buf;
  thread_local int64_t size = 0;
  if (n > size) {
    buf.reset(new float[n]);
    size = n;
  }
  return buf.get();
}

// y [M, N] = x [M, K] (fp32) @ W^T for a weight stored in another format, at large M: W made
// fp32 a chunk of rows at a time, fill(n0, nc, buf) writing rows [n0, n0 + nc) to buf [nc, K]
// (a per-thread buffer of Tag's that stays in cache), and ATen's mm (MKL) writing y's columns
// in place. As few chunks as fit chunk_bytes, of equal width (a multiple of 16): a last sliver
// of a few columns would be a GEMM MKL runs at a fraction of its speed. The quantized formats'
// (linear.cpp's gemm_chunked) and the 16-bit floats' (bfloat16.cpp) large-M path.
template <class Tag, class Fill>
AOTITorchError mm_chunks(const float* x, int64_t M, int64_t K, int64_t N, float* y,
                         int64_t chunk_bytes, Fill fill) {
  if (M == 0 || N == 0) return AOTI_TORCH_SUCCESS;
  const int64_t cap = std::max<int64_t>(16, chunk_bytes / (4 * std::max<int64_t>(K, 1)));
  const int64_t chunks = (N + cap - 1) / cap;
  const int64_t nc_max = std::min(N, ((N + chunks - 1) / chunks + 15) / 16 * 16);
  float* buf = thread_buffer<Tag>(nc_max * K);  // fill writes all of each chunk
  Owned xt;
  if (AOTITorchError e = matrix_blob(x, M, K, K, 1, &xt.h)) return e;
  for (int64_t n0 = 0; n0 < N; n0 += nc_max) {
    const int64_t nc = std::min(nc_max, N - n0);
    fill(n0, nc, buf);
    Owned wt, yt;  // the chunk as a [K, nc] (transposed) view; y[:, n0 : n0 + nc], row stride N
    if (AOTITorchError e = matrix_blob(buf, K, nc, 1, K, &wt.h)) return e;
    if (AOTITorchError e = matrix_blob(y + n0, M, nc, N, 1, &yt.h)) return e;
    if (AOTITorchError e = aoti_torch_cpu_mm_out(yt.h, xt.h, wt.h)) return e;
  }
  return AOTI_TORCH_SUCCESS;
}

// ---- scalar decoders (reference for the vector paths, and the non-AVX2 build) -------------

// fp16 bits -> fp32 (the tails the vector conversion leaves, and builds without F16C): the
// exponent rebiased from 15 to 127, subnormals scaled, inf and NaN kept
inline float half_to_float(uint16_t h) {
  const uint32_t sign = uint32_t(h & 0x8000) << 16, rest = h & 0x7fff;
  uint32_t bits;
  if (rest >= 0x7c00) {
    bits = sign | 0x7f800000u | ((rest & 0x3ff) << 13);
  } else if (rest >= 0x400) {
    bits = sign | ((rest << 13) + (112u << 23));
  } else {
    const float f = float(rest) * 5.9604644775390625e-8f;  // rest x 2^-24, exact
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float out;
  std::memcpy(&out, &bits, 4);
  return out;
}

inline float fp8_e4m3_to_float(uint8_t b) {
  // The 7 magnitude bits moved to the top of an fp32's exponent/mantissa, then rebiased by
  // 2^(127-7): exact for normals and subnormals alike (0x7F, NaN in e4m3fn, never occurs in
  // a quantized weight: the rewrite refuses non-finite weights).
  uint32_t bits = (uint32_t(b & 0x7F) << 20) | (uint32_t(b & 0x80) << 24);
  float f;
  std::memcpy(&f, &bits, sizeof f);
  return f * 0x1p120f;
}

// fp32 -> bf16 bits, round to nearest, ties to even (inputs are finite)
inline uint16_t bf16_bits(float f) {
  uint32_t b;
  std::memcpy(&b, &f, sizeof b);
  return uint16_t((b + 0x7FFF + ((b >> 16) & 1)) >> 16);
}

// f rounded to the nearest bf16, as an fp32
inline float bf16_round(float f) {
  const uint32_t b = uint32_t(bf16_bits(f)) << 16;
  float out;
  std::memcpy(&out, &b, sizeof out);
  return out;
}

#ifdef FXQ_AVX2
inline float hsum(__m256 v) {
  __m128 lo = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  lo = _mm_add_ps(lo, _mm_movehl_ps(lo, lo));
  lo = _mm_add_ss(lo, _mm_shuffle_ps(lo, lo, 1));
  return _mm_cvtss_f32(lo);
}

inline __m256 load_fp8x8(const uint8_t* p) {
  const __m256i b = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)p));
  const __m256i mag = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x7F)), 20);
  const __m256i sign = _mm256_slli_epi32(_mm256_and_si256(b, _mm256_set1_epi32(0x80)), 24);
  return _mm256_mul_ps(_mm256_castsi256_ps(_mm256_or_si256(mag, sign)),
                       _mm256_set1_ps(0x1p120f));
}

#ifdef FXQ_VBMI
// ---- e4m3 by table lookup (AVX-512 VBMI) ---------------------------------------------------
// Every e4m3 value is exact in bf16, so a byte's value is its bf16 bits: two 128-entry byte
// tables (high and low byte of the magnitude's bf16 bits) looked up with vpermi2b, 64 bytes a
// lookup, the sign bit copied over, then the bytes placed into bf16 words or fp32 lanes by one
// permute each. 64 weights: 3 instructions for the bf16 bits, 4 more for fp32 lanes, where
// load_fp8x8 spends 7 for 8 (the fp8 GEMVs at M = 1 were bound by that decode, not by memory).

// bf16 bits of the e4m3 magnitude m (7 bits; 0x7F, NaN, never occurs in a weight)
constexpr uint16_t e4m3_bf16_bits(int m) {
  const int e = m >> 3, f = m & 7;
  if (e > 0) return uint16_t(((e + 120) << 7) | (f << 4));
  if (f == 0) return 0;
  const int t = f >= 4 ? 2 : f >= 2 ? 1 : 0;  // f * 2^-9 = 2^(t - 9) * (f / 2^t)
  return uint16_t(((118 + t) << 7) | ((f - (1 << t)) << (7 - t)));
}

struct Fp8Tables {
  alignas(64) uint8_t hi[128];
  alignas(64) uint8_t lo[128];
  constexpr Fp8Tables() : hi(), lo() {
    for (int m = 0; m < 128; ++m) {
      hi[m] = uint8_t(e4m3_bf16_bits(m) >> 8);
      lo[m] = uint8_t(e4m3_bf16_bits(m) & 0xFF);
    }
  }
};
inline constexpr Fp8Tables kFp8Tables{};

// 64 e4m3 bytes -> the high and low bytes of their bf16 bits (sign included in hi)
struct Fp8Bytes {
  __m512i hi, lo;
};
inline Fp8Bytes fp8_bf16_bytes(__m512i w) {
  const __m512i h = _mm512_permutex2var_epi8(_mm512_load_si512(kFp8Tables.hi), w,
                                             _mm512_load_si512(kFp8Tables.hi + 64));
  const __m512i l = _mm512_permutex2var_epi8(_mm512_load_si512(kFp8Tables.lo), w,
                                             _mm512_load_si512(kFp8Tables.lo + 64));
  // hi | (w & 0x80): ternary-logic truth table A | (B & C)
  return {_mm512_ternarylogic_epi32(h, w, _mm512_set1_epi8(char(0x80)), 0xF8), l};
}

// The 64 values' bf16 bits placed W bytes a value (W = 2: bf16 words; W = 4: the top half of
// fp32 lanes, zeros below), values 64 / W * Part onward
template <int W, int Part>
inline __m512i fp8_place(const Fp8Bytes& b) {
  constexpr int kValues = 64 / W;
  alignas(64) static constexpr struct Idx {
    uint8_t v[64];
    constexpr Idx() : v() {
      for (int i = 0; i < kValues; ++i) {
        v[W * i + W - 2] = uint8_t(kValues * Part + i);       // lo (first table)
        v[W * i + W - 1] = uint8_t(64 + kValues * Part + i);  // hi (second table)
      }
    }
  } idx{};
  constexpr __mmask64 kTop2 = W == 4 ? 0xCCCCCCCCCCCCCCCCull : ~0ull;  // bytes W-2, W-1
  return _mm512_maskz_permutex2var_epi8(kTop2, b.lo, _mm512_load_si512(idx.v), b.hi);
}

// values 16q .. 16q + 15 of the 64 as fp32
template <int Q>
inline __m512 fp8_quarter_f32(const Fp8Bytes& b) {
  return _mm512_castsi512_ps(fp8_place<4, Q>(b));
}

// values 32h .. 32h + 31 of the 64 as bf16
template <int H>
inline __m512i fp8_half_bf16(const Fp8Bytes& b) {
  return fp8_place<2, H>(b);
}
#endif

// The packed-panel GEMMs' weight packing (int8_fp8.cpp, int4.cpp), 8 weight rows' next 32
// bytes to the 8 k-quads of a panel: r[i] = 8 int32 of row i -> r[j] = the j-th int32 of rows
// 0..7
inline void transpose8x8_epi32(__m256i* r) {
  __m256i t[8], u[8];
  for (int i = 0; i < 8; i += 2) {
    t[i] = _mm256_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm256_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 8; i += 4) {
    u[i] = _mm256_unpacklo_epi64(t[i], t[i + 2]);
    u[i + 1] = _mm256_unpackhi_epi64(t[i], t[i + 2]);
    u[i + 2] = _mm256_unpacklo_epi64(t[i + 1], t[i + 3]);
    u[i + 3] = _mm256_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x20);
    r[i + 4] = _mm256_permute2x128_si256(u[i], u[i + 4], 0x31);
  }
}
#endif

#ifdef FXQ_AVX2
// The packed-panel GEMMs' shared steps. An activation quad (4 int8 at p) in every int32 lane,
// to meet a panel's 8 columns in one maddubs
inline __m256i broadcast_quad(const int8_t* p) {
  int32_t quad;
  std::memcpy(&quad, p, 4);  // activation rows carry no alignment
  return _mm256_set1_epi32(quad);
}

// 8 fp32 columns from p, only the first `cols` read (zeros after) when fewer remain
inline __m256 load_columns(const float* p, int64_t cols) {
  if (cols >= 8) return _mm256_loadu_ps(p);
  alignas(32) float t[8] = {};
  for (int64_t c = 0; c < cols; ++c) t[c] = p[c];
  return _mm256_load_ps(t);
}

// 8 fp32 columns to p, only the first `cols` written when fewer remain (a row's last panel)
inline void store_columns(float* p, __m256 v, int64_t cols) {
  if (cols >= 8) return _mm256_storeu_ps(p, v);
  alignas(32) float t[8];
  _mm256_store_ps(t, v);
  for (int64_t c = 0; c < cols; ++c) p[c] = t[c];
}
#endif

// One 32-column block of the int4 layout (16 bytes; byte i holds column i in its low nibble and
// column i + 16 in its high one), dequantized as w = u * s + b and handed to put(column, value):
// eight columns at a time as an __m256 with AVX2, else one float at a time.
template <class Put>
inline void int4_block(const uint8_t* bytes, float s, float b, Put put) {
#ifdef FXQ_AVX2
  const __m256i low = _mm256_set1_epi32(0x0F);
  const __m256 sv = _mm256_set1_ps(s), bv = _mm256_set1_ps(b);
  for (int h = 0; h < 2; ++h) {  // bytes 0-7 hold columns 0-7 and 16-23; 8-15: 8-15, 24-31
    const __m256i v = _mm256_cvtepu8_epi32(_mm_loadl_epi64((const __m128i*)(bytes + 8 * h)));
    put(8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_and_si256(v, low)), sv, bv));
    put(16 + 8 * h, _mm256_fmadd_ps(_mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)), sv, bv));
  }
#else
  for (int i = 0; i < 16; ++i) {
    put(i, float(bytes[i] & 0x0F) * s + b);
    put(16 + i, float(bytes[i] >> 4) * s + b);
  }
#endif
}

// One weight row of the int4 layout (K columns, a multiple of the group, hence of 32), its
// groups' scale and offset, block by block: put(column, value or __m256 of eight) as above.
template <class Put>
inline void int4_row(const uint8_t* row, int64_t K, int64_t group, const float* scale,
                     const float* offset, Put put) {
  for (int64_t k0 = 0; k0 < K; k0 += 32)
    int4_block(row + k0 / 2, scale[k0 / group], offset[k0 / group],
               [&](int c, auto v) { put(k0 + c, v); });
}

// ---- The VNNI panel GEMMs' work split (int8_fp8.cpp, int4.cpp) ------------------------------
// Blocks of 16-column panels (up to about 256 KiB, in L2), each packed once and met by every
// activation row of its item, in whole groups of `P` panels (one register tile's width). When
// the groups do not divide evenly over the threads: with many rows, the rows are split into
// one chunk per thread and each thread packs every block for its own rows (the pack then a
// small part of the work); with few, the blocks' count is rounded up to the threads' and the
// blocks are cut at single panels (sizes differ by one panel at most; a short last group
// costs less than an idle thread: k and v's 12 panels are 3 groups of 4).
struct PanelWork {
  int64_t panels, blocks, chunks, unit, units, block_panels, chunk_rows;

  PanelWork(int64_t panels_, int64_t panel_bytes, int64_t M, int P, int R, int64_t threads)
      : panels(panels_), chunks(1), unit(P) {
    const int64_t groups = (panels + P - 1) / P;
    const int64_t fit = std::max<int64_t>(1, 256 * 1024 / (panel_bytes * P));
    blocks = (groups + fit - 1) / fit;
    if (blocks % threads || groups % blocks) {
      if (M >= 8 * R * threads) {
        chunks = threads;
      } else {
        blocks = (blocks + threads - 1) / threads * threads;
        if (groups % blocks) unit = 1;
      }
    }
    units = (panels + unit - 1) / unit;
    block_panels = (units + blocks - 1) / blocks * unit;
    chunk_rows = ((M + chunks - 1) / chunks + R - 1) / R * R;
  }
  int64_t items() const { return chunks * blocks; }
  // item i (chunk-major: with static scheduling each thread takes one chunk's blocks): its
  // panels [p0, p1) and rows [m0, m1); the first units % blocks blocks one unit longer
  void item(int64_t i, int64_t M, int64_t* p0, int64_t* p1, int64_t* m0, int64_t* m1) const {
    const int64_t b = i % blocks;
    *m0 = i / blocks * chunk_rows;
    *m1 = std::min(M, *m0 + chunk_rows);
    const int64_t u0 = b * (units / blocks) + std::min(b, units % blocks);
    const int64_t u1 = u0 + units / blocks + (b < units % blocks);
    *p0 = u0 * unit;
    *p1 = std::min(panels, u1 * unit);
  }
};

// ---- Shared by the shims (linear.cpp) ------------------------------------------------------

struct Mat {
  void* data = nullptr;
  int64_t rows = 0, cols = 0;
  template <class T>
  const T* as() const {
    return (const T*)data;
  }
};

// A contiguous tensor of `dim` dims and dtype `dtype`, on CPU; 2-D ones as (rows, cols).
bool view(AtenTensorHandle t, int64_t dim, int32_t dtype, Mat* out);

// A new contiguous [rows, cols] tensor of `dtype` and its data.
AOTITorchError new_matrix(int64_t rows, int64_t cols, int32_t dtype, AtenTensorHandle* ret,
                          void** data);

// A new fp32 [M, N] tensor and its data.
AOTITorchError new_output(int64_t M, int64_t N, AtenTensorHandle* ret, float** data);

// Every shim's last step: a new fp32 y [M, N] in *ret, filled by gemv(y) for M up to
// gemv_max_m and by the large-M path mm(y) above (nothing to do when y is empty).
template <class Gemv, class Mm>
AOTITorchError run_linear(int64_t M, int64_t N, int64_t gemv_max_m, AtenTensorHandle* ret,
                          Gemv gemv, Mm mm) {
  float* y = nullptr;
  if (AOTITorchError e = new_output(M, N, ret, &y)) return e;
  if (M == 0 || N == 0) return AOTI_TORCH_SUCCESS;
  if (M > gemv_max_m) return mm(y);
  gemv(y);
  return AOTI_TORCH_SUCCESS;
}

// Whether every value of the row is zero (+0 or -0; a NaN is not): its product with any finite
// weight is a row of zeros.
inline bool zero_row(const float* x, int64_t K) {
  for (int64_t k = 0; k < K; ++k)
    if (x[k] != 0.f) return false;
  return true;
}

// The grouped (mixture-of-experts) shims' walk over x [S, K] (fp32): a new fp32 y [S, N] in
// *ret, zeros, then rows(e, xe, M, ye) for each expert e with rows, the M rows of x at xe into
// the M rows of y at ye, where expert e owns rows [offs[e-1], offs[e]) of x (offs[-1] taken as
// 0; an end past S clipped to S; a decreasing end gives no rows), what transformers' grouped_mm
// fallback reads from its offsets. Rows at or past offs[E-1] stay zeros. Stops at the first
// error rows returns.
//
// skip_zero_rows (the quantized experts, whose weights are finite by construction): an expert's
// rows that are all zeros keep their zero output and are not run, and the others are run
// together, gathered when zero rows lie between them, so the kernel's path follows the rows that
// remain. Llama 4 sends every token through every expert, scaled by 0 where the token did not
// choose it (passes/rewrite.py's bmm sites): its decode step then reads only the chosen experts'
// weights, and its prefill runs each expert's GEMM on the tokens that chose it.
//
// run_grouped_aux: aux (A floats a row, may be null) holds values that travel with x's rows (an
// activation's scales); rows(e, xe, ae, M, ye) also gets those rows' aux values at ae, gathered
// as x's rows are.
template <class Rows>
AOTITorchError run_grouped_aux(const float* x, int64_t S, int64_t K, int64_t N,
                               const int64_t* offs, int64_t E, bool skip_zero_rows,
                               AtenTensorHandle* ret, const float* aux, int64_t A, Rows rows) {
  float* y = nullptr;
  if (AOTITorchError e = new_output(S, N, ret, &y)) return e;
  std::fill(y, y + S * N, 0.f);
  if (N == 0) return AOTI_TORCH_SUCCESS;
  std::vector<int64_t> live;
  std::vector<float> xg, ag, yg;
  int64_t start = 0;
  for (int64_t e = 0; e < E; ++e) {
    const int64_t end = std::min(offs[e], S);
    const int64_t M = end - start;
    if (M > 0) {
      const float* xe = x + start * K;
      const float* ae = aux ? aux + start * A : nullptr;
      float* ye = y + start * N;
      live.clear();
      if (skip_zero_rows) {
        for (int64_t m = 0; m < M; ++m)
          if (!zero_row(xe + m * K, K)) live.push_back(m);
      }
      const int64_t L = static_cast<int64_t>(live.size());
      if (!skip_zero_rows || L == M) {
        if (AOTITorchError err = rows(e, xe, ae, M, ye)) return err;
      } else if (L > 0 && live.back() - live.front() + 1 == L) {  // one run: no copies
        const int64_t f = live.front();
        if (AOTITorchError err = rows(e, xe + f * K, ae ? ae + f * A : nullptr, L, ye + f * N))
          return err;
      } else if (L > 0) {
        xg.resize(L * K);
        ag.resize(aux ? L * A : 0);
        yg.assign(L * N, 0.f);
        for (int64_t i = 0; i < L; ++i) {
          std::copy(xe + live[i] * K, xe + (live[i] + 1) * K, xg.data() + i * K);
          if (aux) std::copy(ae + live[i] * A, ae + (live[i] + 1) * A, ag.data() + i * A);
        }
        if (AOTITorchError err = rows(e, xg.data(), aux ? ag.data() : nullptr, L, yg.data()))
          return err;
        for (int64_t i = 0; i < L; ++i)
          std::copy(yg.data() + i * N, yg.data() + (i + 1) * N, ye + live[i] * N);
      }
    }
    start = std::max(start, end);
  }
  return AOTI_TORCH_SUCCESS;
}

template <class Rows>
AOTITorchError run_grouped(const float* x, int64_t S, int64_t K, int64_t N, const int64_t* offs,
                           int64_t E, bool skip_zero_rows, AtenTensorHandle* ret, Rows rows) {
  auto plain = [&](int64_t e, const float* xe, const float*, int64_t M, float* ye) {
    return rows(e, xe, M, ye);
  };
  return run_grouped_aux(x, S, K, N, offs, E, skip_zero_rows, ret, nullptr, 0, plain);
}

// y [M, N] = x [M, K] (fp32) @ dequant(w)^T for large M (offset and group: int4 only);
// bf16_weight: the dequantized values rounded to bf16 first (the bf16-dot ops' numerics, in the
// builds without AVX-512 BF16)
AOTITorchError gemm_chunked(Fmt fmt, const float* x, int64_t M, int64_t K, const uint8_t* w,
                            int64_t N, const float* scale, const float* offset, int64_t group,
                            float* y, bool bf16_weight = false);

// The dequantized activation xq * xs [M, K] fp32, for the large-M path of int8 activations.
std::vector<float> dequantize_activation(const int8_t* xq, const float* xs, int64_t M, int64_t K);

// The reference's per-token int8 quantization (fxquant.core.reference.quantize_int8_per_token)
// in its own fp32 operations, so the bytes are the same: s = max(amax(|x|), 1e-12) / 127,
// q = clamp(round half to even(x / s), -127, 127), xs [M] = s. Row m's bytes go to
// out + m * ld as q ^ flip, columns K..ld padded with q = 0 (the VNNI GEMM reads q + 128 in
// whole quads: flip 0x80). The dynamic ops quantize here, in one pass over a row that stays in
// L1, where Inductor's fused quantization evaluated a producer's pointwise math (GELU's erf)
// twice: once for the amax, once for x / s.
void quantize_int8_rows(const float* x, int64_t M, int64_t K, uint8_t* out, int64_t ld,
                        uint8_t flip, float* xs);

// What the dynamic int8-activation shims run first: fp32 x [rows, cols] (a tensor handle)
// quantized by quantize_int8_rows into rows of ld = cols rounded up to `align` bytes (q ^ flip),
// and the rows' scales. The buffer is left uninitialised: the quantizer writes every byte.
struct Int8Rows {
  int64_t rows = 0, cols = 0, ld = 0;
  std::unique_ptr<uint8_t[]> q;
  std::vector<float> scale;
  const int8_t* as_int8() const { return (const int8_t*)q.get(); }
};
bool int8_rows(AtenTensorHandle x, int64_t align, uint8_t flip, Int8Rows* out);

// The reference's per-token fp8 quantization (quantize_fp8_per_token, fp8_scale) onto the e4m3
// grid, kept as fp32 values (the kernels read them so; exact): s = max(min(amax(|x|), ub),
// 1e-12) / 448, xq = e4m3(clamp(x / s, -448, 448)) rounded half to even, xs [M] = s.
void quantize_fp8_rows(const float* x, int64_t M, int64_t K, float ub, float* xq, float* xs);

// out[k] = value(w[k]) * s for k < len: e4m3 bytes dequantized with one scale (the large-M
// paths' weight chunks)
void fp8_times(const uint8_t* w, int64_t len, float s, float* out);

// The reference's 1 x group fp8 quantization (quantize_fp8_groups) in the same operations, per
// group of each row (a last group shorter than `group` scaled by its own elements): xq [M, K],
// xs [M, ceil(K / group)].
void quantize_fp8_groups(const float* x, int64_t M, int64_t K, int64_t group, float* xq,
                         float* xs);

}  // namespace fxq

#pragma GCC visibility pop
