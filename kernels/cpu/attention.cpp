// Grouped-query attention over a KV cache: softmax(q kᵀ · scale, masked) v for the packed query
// rows of each key/value head, the `fxquant::native_gqa_attention` op.
//
// Where this sits: inside the program fxquant.export_llm traces on CPU (fxquant/llm.py's packed
// grouped-query attention: the G query heads of a group are G x T rows of its key/value head).
// AOTInductor calls the C shim below, linked into the package like the linears' kernels.
//
// Why it exists: at decode each head multiplies G query rows (SmolLM2: 3) by a few hundred
// cached keys and values. MKL's bmm spent ~12 µs a call on that (60 calls a token on SmolLM2,
// ~11 % of a w8a8 decode step, 2 cores). Up to 16 rows a head (decode) the loops here read
// each key and value row once, in order, for all of a head's rows, and split the positions
// between the threads (as flash-decoding splits them), so each core reads an equal share of
// the cache, which comes from memory (the weights evict it between steps). Past 16 rows (a
// prompt) ATen's flash attention for CPU runs on views of the cache (fp32: 16-bit keys and
// values widened first; a bf16 prompt on a CPU with AMX tiles in bf16: prompt_in_bf16). One op
// for both, not a torch.cond on T in the program choosing this or ATen's attention: that
// measured a smaller decode gain (1.14x) and cost a 128-token prefill ~10 %.
// On SmolLM2's w8a8 + lm_head package, one process, old and new package alternated (Zen 4, two
// cores; one-off A/Bs, the benchmark is benchmarks/llm_decode.py): decode steps (positions
// 128-228) 1.20x faster than with bmm and Inductor's softmax; a 128-token prefill ~5 % slower
// (0.90-0.96 over three runs).
//
// Layouts: q [B, Hkv, R, D] packed; key and value [B, Hkv, L, D] with the last dim contiguous and
// any other strides (a slice of the static cache, read in place); q, key and value all fp32, all
// bf16 or all fp16; mask [Bm, 1, Rm, L] bool (Bm = 1 or B; True = attend; Rm divides R, query
// row r reading mask row r % Rm), last dim contiguous. Rm = T: the G x T packed rows of a
// group repeat the prompt's T mask rows, so every layer reads the model's one causal mask as
// it is (with the op's flexible layout and fxquant.passes.cpu.attention.share_attention_masks,
// one buffer computed once a call). The mask expanded to G x T rows in the graph, and copied
// for each call by Inductor, was computed again in every layer: ~17 % of a 512-token SmolLM2
// prefill of a bf16 int8wo package (profiled on the AMX Xeon). Rm = R: a mask per row. Any
// other layout of the inputs is copied into one the loops read (`readable`).
// Out [B, Hkv, R, D] fp32 whatever the inputs' dtype (the caller rounds it to the model's).
// bf16 / fp16 inputs (a model loaded in its checkpoint's dtype, from_pretrained's default) are
// widened to fp32 as they are read: each work unit's visible key and value rows into a buffer
// of its own (L1/L2-sized at decode), a prompt's per batch row, and the rest runs the fp32 code.
// The cache is read once, at half the bytes; transformers' eager attention multiplies in bf16
// and rounds the probabilities to bf16, this op keeps fp32 from the products on (but for a bf16
// prompt on AMX: bf16 flash attention's numerics, prompt_in_bf16).
// Numerics: fp32 scores, max-subtracted exponentials (exp_nonpositive: Cephes' expf
// polynomial), each split's value sum combined with the others' by the usual rescaling, then
// times 1 / (the exponentials' sum): transformers' eager attention up to fp32 rounding (a
// prompt's: flash attention's fp32 blocks, the same sums in another order). A row
// whose every position is masked gives zeros (eager gives NaN; the causal decode never has
// one: position 0 is always visible).

#include "amx.h"
#include "float_rows.h"

#include <omp.h>

namespace fxq {
namespace {

// exp(x) for x <= 0 (-inf included: 0), Cephes' expf polynomial after x = n ln2 + r; plain
// arithmetic the compiler vectorises (no libm call in the loop)
inline float exp_nonpositive(float x) {
  if (!(x > -87.0f)) return 0.0f;  // exp(-87) ~ 1.6e-38: below it the scale 2^n leaves fp32
  const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest
  const float r = (x - n * 0.693359375f) + n * 2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const float e = p * r * r + r + 1.0f;
  const int32_t bits = (int32_t(n) + 127) << 23;
  float two_n;
  std::memcpy(&two_n, &bits, 4);
  return e * two_n;
}

// out[j] = q . k[j] over D for four key rows at once: four independent chains of multiply-adds
// and horizontal sums (one key at a time, each product waited ~30 cycles on its own chain)
inline void dot4(const float* q, const float* const k[4], int64_t D, float out[4]) {
  int64_t d = 0;
  float sum[4] = {0.0f, 0.0f, 0.0f, 0.0f};
#if defined(FXQ_AVX512BW)
  __m512 acc[4] = {_mm512_setzero_ps(), _mm512_setzero_ps(), _mm512_setzero_ps(),
                   _mm512_setzero_ps()};
  for (; d + 16 <= D; d += 16) {
    const __m512 qv = _mm512_loadu_ps(q + d);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[j] = _mm512_fmadd_ps(qv, _mm512_loadu_ps(k[j] + d), acc[j]);
  }
  // the four horizontal sums together: per 128-bit lane [k0, k1, k2, k3] after two steps,
  // then the lanes added (one reduction each took ~7 shuffles and adds)
  const __m512 s01 = _mm512_add_ps(_mm512_unpacklo_ps(acc[0], acc[1]),
                                   _mm512_unpackhi_ps(acc[0], acc[1]));
  const __m512 s23 = _mm512_add_ps(_mm512_unpacklo_ps(acc[2], acc[3]),
                                   _mm512_unpackhi_ps(acc[2], acc[3]));
  const __m512 s4 = _mm512_add_ps(_mm512_shuffle_ps(s01, s23, 0x44),
                                  _mm512_shuffle_ps(s01, s23, 0xEE));
  const __m256 hi = _mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(s4), 1));
  const __m256 h = _mm256_add_ps(_mm512_castps512_ps256(s4), hi);
  _mm_storeu_ps(sum, _mm_add_ps(_mm256_castps256_ps128(h), _mm256_extractf128_ps(h, 1)));
#elif defined(FXQ_AVX2)
  __m256 acc[4] = {_mm256_setzero_ps(), _mm256_setzero_ps(), _mm256_setzero_ps(),
                   _mm256_setzero_ps()};
  for (; d + 8 <= D; d += 8) {
    const __m256 qv = _mm256_loadu_ps(q + d);
#pragma GCC unroll 4
    for (int j = 0; j < 4; ++j) acc[j] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(k[j] + d), acc[j]);
  }
  const __m256 s01 = _mm256_add_ps(_mm256_unpacklo_ps(acc[0], acc[1]),
                                   _mm256_unpackhi_ps(acc[0], acc[1]));
  const __m256 s23 = _mm256_add_ps(_mm256_unpacklo_ps(acc[2], acc[3]),
                                   _mm256_unpackhi_ps(acc[2], acc[3]));
  const __m256 s4 = _mm256_add_ps(_mm256_shuffle_ps(s01, s23, 0x44),
                                  _mm256_shuffle_ps(s01, s23, 0xEE));
  _mm_storeu_ps(sum, _mm_add_ps(_mm256_castps256_ps128(s4), _mm256_extractf128_ps(s4, 1)));
#endif
  for (; d < D; ++d)
    for (int j = 0; j < 4; ++j) sum[j] += q[d] * k[j][d];
  for (int j = 0; j < 4; ++j) out[j] = sum[j];
}

// max and sum of x [n] in 16 independent lanes, loops the compiler vectorises (one chain of
// scalar maxima or sums costs ~3 cycles a position)
inline float lane_max(const float* x, int64_t n) {
  float lanes[16];
  std::fill(lanes, lanes + 16, -INFINITY);
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lanes[j] = lanes[j] > x[i + j] ? lanes[j] : x[i + j];
  for (; i < n; ++i) lanes[0] = lanes[0] > x[i] ? lanes[0] : x[i];
  return *std::max_element(lanes, lanes + 16);
}

inline float lane_sum(const float* x, int64_t n) {
  float lanes[16] = {};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) lanes[j] += x[i + j];
  for (; i < n; ++i) lanes[0] += x[i];
  float total = 0.0f;
  for (float t : lanes) total += t;
  return total;
}

// s[l] = exp(s[l] · scale - max) where m[l], else 0, in place over a scores row of L positions;
// returns the max (-inf, and s all zeros, where every position is masked). Both softmaxes'
// first step: the loops' per split, the prompt path's per row.
float masked_exp(float* s, const bool* m, int64_t L, float scale) {
  for (int64_t l = 0; l < L; ++l) s[l] = m[l] ? s[l] * scale : -INFINITY;
  const float mx = lane_max(s, L);
  if (mx == -INFINITY)
    std::fill(s, s + L, 0.0f);
  else
    for (int64_t l = 0; l < L; ++l) s[l] = exp_nonpositive(s[l] - mx);
  return mx;
}

// `rows` rows of D 16-bit values, `stride` elements apart, into dst [rows, D] fp32
void widen_rows(const uint16_t* src, int64_t rows, int64_t stride, int64_t D, bool bf16,
                float* dst) {
  for (int64_t l = 0; l < rows; ++l) {
    if (bf16)
      widen_row<Bf16Format>(src + l * stride, D, dst + l * D);
    else
      widen_row<Fp16Format>(src + l * stride, D, dst + l * D);
  }
}

struct Strided4 {  // a 4-D tensor's data, sizes and strides (elements)
  const void* data = nullptr;
  int64_t size[4] = {0, 0, 0, 0}, stride[4] = {0, 0, 0, 0};
};

bool strided4(AtenTensorHandle t, int32_t dtype, Strided4* out) {
  int64_t dim = 0;
  int32_t dt = 0, dev = 0;
  int64_t *sizes = nullptr, *strides = nullptr;
  void* data = nullptr;
  if (aoti_torch_get_dim(t, &dim) || dim != 4) return false;
  if (aoti_torch_get_dtype(t, &dt) || dt != dtype) return false;
  if (aoti_torch_get_device_type(t, &dev) || dev != aoti_torch_device_type_cpu()) return false;
  if (aoti_torch_get_sizes(t, &sizes) || aoti_torch_get_strides(t, &strides)) return false;
  if (aoti_torch_get_data_ptr(t, &data)) return false;
  if (sizes[3] > 1 && strides[3] != 1) return false;  // rows must be contiguous
  out->data = data;
  for (int i = 0; i < 4; ++i) out->size[i] = sizes[i], out->stride[i] = strides[i];
  return true;
}

// t, or a contiguous copy of it (held by `hold`) where its layout is not one the kernel reads:
// rows (the last dim) contiguous and, with `packed`, the whole tensor. The op's schema lets
// Inductor hand it inputs in any layout (flexible_layout, fxquant/core/ops.py): a layout it
// required was met by a copy of the input for each call, the model's one mask computed again
// for every layer. The program's own inputs are in these layouts already: nothing is copied.
AOTITorchError readable(AtenTensorHandle t, bool packed, Owned* hold, AtenTensorHandle* out) {
  int64_t dim = 0;
  int64_t *sizes = nullptr, *strides = nullptr;
  int32_t dtype = 0;
  if (aoti_torch_get_dim(t, &dim) || aoti_torch_get_sizes(t, &sizes) ||
      aoti_torch_get_strides(t, &strides) || aoti_torch_get_dtype(t, &dtype))
    return AOTI_TORCH_FAILURE;
  std::vector<int64_t> dense(dim);
  bool ok = true;
  for (int64_t i = dim - 1, n = 1; i >= 0; n *= sizes[i], --i) {
    dense[i] = n;
    if (sizes[i] > 1 && strides[i] != n && (packed || i == dim - 1)) ok = false;
  }
  *out = t;
  if (ok) return AOTI_TORCH_SUCCESS;
  if (AOTITorchError e = aoti_torch_empty_strided(dim, sizes, dense.data(), dtype,
                                                  aoti_torch_device_type_cpu(), 0, &hold->h))
    return e;
  *out = hold->h;
  return aoti_torch_copy_(hold->h, t, 0);
}

// o[r] [D] = sum_l p[r][l] v[l] for RB query rows at once (p's rows ldp apart, v's
// vs apart): each value row is loaded once for all RB rows, and the RB x 4 sums stay in
// registers (one row at a time, four chains of multiply-adds: each waited on the last)
template <int RB>
void weighted_rows(const float* p, int64_t ldp, const float* v, int64_t vs, int64_t L, int64_t D,
                   float* o) {
  int64_t d0 = 0;
#if defined(FXQ_AVX512BW)
  for (; d0 < D; d0 += 64) {
    __mmask16 m[4];
    for (int i = 0; i < 4; ++i) {
      const int64_t left = std::min<int64_t>(std::max<int64_t>(D - d0 - 16 * i, 0), 16);
      m[i] = __mmask16((1u << left) - 1);
    }
    __m512 acc[RB][4];
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_setzero_ps();
    for (int64_t l = 0; l < L; ++l) {
      const float* row = v + l * vs + d0;
      __m512 vr[4];
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) vr[i] = _mm512_maskz_loadu_ps(m[i], row + 16 * i);
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) {
        const __m512 pl = _mm512_set1_ps(p[r * ldp + l]);
#pragma GCC unroll 4
        for (int i = 0; i < 4; ++i) acc[r][i] = _mm512_fmadd_ps(pl, vr[i], acc[r][i]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r)
#pragma GCC unroll 4
      for (int i = 0; i < 4; ++i) _mm512_mask_storeu_ps(o + r * D + d0 + 16 * i, m[i], acc[r][i]);
  }
#elif defined(FXQ_AVX2)
  for (; d0 + 16 <= D; d0 += 16) {  // 16 columns: RB x 2 sums, of 16 registers
    __m256 acc[RB][2];
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
    for (int64_t l = 0; l < L; ++l) {
      const float* row = v + l * vs + d0;
      const __m256 v0 = _mm256_loadu_ps(row), v1 = _mm256_loadu_ps(row + 8);
#pragma GCC unroll 4
      for (int r = 0; r < RB; ++r) {
        const __m256 pl = _mm256_set1_ps(p[r * ldp + l]);
        acc[r][0] = _mm256_fmadd_ps(pl, v0, acc[r][0]);
        acc[r][1] = _mm256_fmadd_ps(pl, v1, acc[r][1]);
      }
    }
#pragma GCC unroll 4
    for (int r = 0; r < RB; ++r) {
      _mm256_storeu_ps(o + r * D + d0, acc[r][0]);
      _mm256_storeu_ps(o + r * D + d0 + 8, acc[r][1]);
    }
  }
#endif
  for (; d0 < D; ++d0)  // columns the vector paths left (none with AVX-512)
    for (int r = 0; r < RB; ++r) {
      float acc = 0.0f;
      for (int64_t l = 0; l < L; ++l) acc += p[r * ldp + l] * v[l * vs + d0];
      o[r * D + d0] = acc;
    }
}

constexpr int kRowBlock = 4;  // query rows per weighted_rows call

// One (batch, head)'s R query rows against the cached positions [0, L) of k, v and mask (the
// caller offsets them to a split's first position; row r reads mask row r % mrows, ms apart):
// o [R, D] = sum_l e[r][l] v[l] unnormalised, with e = exp(score - mx[r]) and total[r] =
// sum_l e[r][l] (mx = -inf, o and total zeros where every position is masked). `scores` holds
// R x L floats.
void partial_attention(const float* q, const float* k, int64_t ks, const float* v, int64_t vs,
                       const bool* mask, int64_t ms, int64_t mrows, int64_t R, int64_t L,
                       int64_t D, float scale, float* o, float* mx, float* total,
                       float* scores) {
  // every dot product first, four keys at a time for each query row in turn: the keys are
  // read once (from memory: the cache is evicted by the weights between steps), the four
  // products overlap, and no masked choice sits between them
  for (int64_t l = 0; l < L; l += 4) {
    const float* rows[4];
    for (int j = 0; j < 4; ++j) rows[j] = k + std::min(l + j, L - 1) * ks;  // the last again
    for (int64_t r = 0; r < R; ++r) {
      float dots[4];
      dot4(q + r * D, rows, D, dots);
      for (int j = 0; j < 4 && l + j < L; ++j) scores[r * L + l + j] = dots[j];
    }
  }
  for (int64_t r = 0; r < R; ++r) {
    mx[r] = masked_exp(scores + r * L, mask + r % mrows * ms, L, scale);
    total[r] = lane_sum(scores + r * L, L);
  }
  for (int64_t r0 = 0; r0 < R; r0 += kRowBlock) {
    const int64_t rb = std::min<int64_t>(kRowBlock, R - r0);
    const float* p = scores + r0 * L;
    float* out = o + r0 * D;
    if (rb == 4) weighted_rows<4>(p, L, v, vs, L, D, out);
    if (rb == 3) weighted_rows<3>(p, L, v, vs, L, D, out);
    if (rb == 2) weighted_rows<2>(p, L, v, vs, L, D, out);
    if (rb == 1) weighted_rows<1>(p, L, v, vs, L, D, out);
  }
}

// Above this many query rows a head (a prompt's prefill: G x T rows) ATen's flash attention
// for CPU runs the rows (its per-call cost is then small against the work); at or below it
// (decode: G rows a head) the loops above.
constexpr int64_t kLoopMaxRows = 16;

// a [1, n1, n2, n3] view of fp32 data, or of `dtype`'s
AOTITorchError blob4(const void* data, int64_t n1, int64_t n2, int64_t n3, int64_t s1,
                     int64_t s2, int64_t s3, AtenTensorHandle* out,
                     int32_t dtype = aoti_torch_dtype_float32()) {
  const int64_t sizes[4] = {1, n1, n2, n3}, strides[4] = {n1 * s1, s1, s2, s3};
  return aoti_torch_create_tensor_from_blob((void*)data, 4, sizes, strides, 0, dtype,
                                            aoti_torch_device_type_cpu(), 0, out);
}

// A prompt's additive mask (0 where a row attends, -inf where not): R x L floats from one buffer
// per thread kept between calls (a fresh one per call is a page fault per 4 KiB), larger ones
// (a long prompt's) in `once`, freed after the call
constexpr int64_t kKeptMask = 8 << 20;
struct MaskTag {};
float* mask_buffer(int64_t n, std::unique_ptr<float[]>* once) {
  if (n > kKeptMask) {
    once->reset(new float[n]);  // uninitialised: every value is written
    return once->get();
  }
  return thread_buffer<MaskTag>(n);
}

// A bool mask's Rm rows (ms apart) of L positions as flash attention takes it for R query rows
// (row r: mask row r % Rm): 0 where a row attends, -inf where not, R x L floats
void additive_mask(const bool* m, int64_t ms, int64_t Rm, int64_t R, int64_t L, float* mask) {
#pragma omp parallel for schedule(static) if (R * L > 16384)
  for (int64_t r = 0; r < R; ++r) {
    const bool* from = m + r % Rm * ms;
    for (int64_t l = 0; l < L; ++l) mask[r * L + l] = from[l] ? 0.0f : -INFINITY;
  }
}

// One batch row's H heads of R query rows each through ATen's flash attention for CPU
// (`_scaled_dot_product_flash_attention_for_cpu`: blocks of keys with a running max and sum,
// the scores never written out whole), on views of the cache as it lies (k [H, L, D] with
// strides ks0, ks, 1). Against the bmm + softmax here it replaced, the op on a SmolLM2 layer's
// prompt (3 heads x 3 x T packed rows, fp32 or bf16; AMX Xeon, two cores, old and new library
// by hand, one-off): 3.6 ms against 7.8 at T = 512, 0.49 against 0.68 at T = 128. Its mask is
// additive fp32 (bool is refused), built in `mask`; a row with no visible position gives
// zeros, as the loops do (tested). `mask`: additive_mask's R x L. q, k and v are fp32, or all
// of `dtype` (bf16 on AMX: prompt_in_bf16); the output fp32.
AOTITorchError flash_attention(const void* q, const void* k, int64_t ks0, int64_t ks,
                               const void* v, int64_t vs0, int64_t vs, const float* mask,
                               int64_t H, int64_t R, int64_t L, int64_t D, double scale,
                               float* out, int32_t dtype = aoti_torch_dtype_float32()) {
  Owned qt, kt, vt, mt, ot, lse, dst;
  if (AOTITorchError e = blob4(q, H, R, D, R * D, D, 1, &qt.h, dtype)) return e;
  if (AOTITorchError e = blob4(k, H, L, D, ks0, ks, 1, &kt.h, dtype)) return e;
  if (AOTITorchError e = blob4(v, H, L, D, vs0, vs, 1, &vt.h, dtype)) return e;
  if (AOTITorchError e = blob4(mask, 1, R, L, R * L, L, 1, &mt.h)) return e;
  AtenTensorHandle mask_arg = mt.h;
  if (AOTITorchError e = aoti_torch_cpu__scaled_dot_product_flash_attention_for_cpu(
          qt.h, kt.h, vt.h, 0.0, 0, &mask_arg, &scale, &ot.h, &lse.h))
    return e;
  if (AOTITorchError e = blob4(out, H, R, D, R * D, D, 1, &dst.h)) return e;
  return aoti_torch_copy_(dst.h, ot.h, 0);  // into the packed fp32 output, whatever its strides
}

// Whether a bf16 prompt runs ATen's flash attention in bf16 (its AMX tiles: oneDNN's bf16
// brgemm) rather than on the values widened to fp32: on CPUs with AMX tiles. SmolLM2's prompt
// attention (3 heads x 3 x T packed rows, T positions; Xeon Emerald Rapids, two cores, one-off
// timings of the ATen op by hand): 1.9 ms against 4.2 in fp32 at T = 512 (30 layers: ~70 ms of
// a ~430 ms prefill of a bf16 int8wo package), 0.13 against 0.24 at T = 128. Its numerics are
// bf16 attention's, what transformers' sdpa runs for the bf16 model (fp32 scores and sums,
// the probabilities rounded to bf16 for the product with v: ~0.2 % relative against the fp32
// math here). Not measured on CPUs without the tiles, where the fp32 path stays.
bool prompt_in_bf16() {
#ifdef FXQ_AMX
  return amx_ready();
#else
  return false;
#endif
}

// 1 + the last position any query row attends to (L where none does): the positions past it
// add nothing to any row. Hugging Face's static cache under torch.compile hands attention the
// whole cache (max_cache_len positions, 2048 say), masked past the current one; reading only
// what is visible keeps a decode step's cost to the positions written so far.
int64_t visible_length(const bool* m, const Strided4& mt, int64_t L) {
  int64_t last = -1;
  for (int64_t b = 0; b < mt.size[0]; ++b)
    for (int64_t r = 0; r < mt.size[2]; ++r) {
      const bool* row = m + b * mt.stride[0] + r * mt.stride[2];
      for (int64_t l = L - 1; l > last; --l)
        if (row[l]) {
          last = l;
          break;
        }
    }
  return last < 0 ? L : last + 1;
}

}  // namespace
}  // namespace fxq

using namespace fxq;

// ---- C shim: the ABI AOTInductor calls ------------------------------------------------------

extern "C" {

AOTITorchError aoti_torch_cpu_native_gqa_attention(AtenTensorHandle q, AtenTensorHandle key,
                                                   AtenTensorHandle value, AtenTensorHandle mask,
                                                   double scale, AtenTensorHandle* ret0) {
  const int32_t f32 = aoti_torch_dtype_float32(), bf16 = aoti_torch_dtype_bfloat16();
  int32_t dt = 0;
  if (aoti_torch_get_dtype(q, &dt)) return AOTI_TORCH_FAILURE;
  if (dt != f32 && dt != bf16 && dt != aoti_torch_dtype_float16()) return AOTI_TORCH_FAILURE;
  // from here q is packed and every input's rows are contiguous
  Owned q_hold, k_hold, v_hold, m_hold;
  if (readable(q, true, &q_hold, &q) || readable(key, false, &k_hold, &key) ||
      readable(value, false, &v_hold, &value) || readable(mask, false, &m_hold, &mask))
    return AOTI_TORCH_FAILURE;
  Strided4 qt, kt, vt, mt;
  if (!strided4(q, dt, &qt) || !strided4(key, dt, &kt) || !strided4(value, dt, &vt) ||
      !strided4(mask, aoti_torch_dtype_bool(), &mt))
    return AOTI_TORCH_FAILURE;
  const int64_t B = qt.size[0], H = qt.size[1], R = qt.size[2], D = qt.size[3];
  const int64_t L_all = kt.size[2];
  for (int i = 0; i < 4; ++i)
    if (vt.size[i] != kt.size[i]) return AOTI_TORCH_FAILURE;
  if (kt.size[0] != B || kt.size[1] != H || kt.size[3] != D) return AOTI_TORCH_FAILURE;
  const int64_t Rm = mt.size[2];  // mask rows: R, or T repeated along the G x T packed rows
  if ((mt.size[0] != 1 && mt.size[0] != B) || mt.size[1] != 1 || Rm < 1 || R % Rm != 0 ||
      mt.size[3] != L_all)
    return AOTI_TORCH_FAILURE;
  const int64_t sizes[4] = {B, H, R, D}, strides[4] = {H * R * D, R * D, D, 1};
  if (AOTITorchError e =
          aoti_torch_empty_strided(4, sizes, strides, f32, aoti_torch_device_type_cpu(), 0, ret0))
    return e;
  void* data = nullptr;
  if (AOTITorchError e = aoti_torch_get_data_ptr(*ret0, &data)) return e;
  float* out = (float*)data;
  // 16-bit inputs: q widened whole (G x T rows a head: small), the cache's rows as they are read;
  // a bf16 prompt on AMX read as it is (prompt_in_bf16)
  const bool wide = dt != f32, is_bf16 = dt == bf16;
  const bool bf16_prompt = is_bf16 && R > kLoopMaxRows && prompt_in_bf16();
  const int64_t bytes = wide ? 2 : 4;
  std::vector<float> q32(wide && !bf16_prompt ? B * H * R * D : 0);
  if (wide && !bf16_prompt)
    widen_rows((const uint16_t*)qt.data, 1, 0, B * H * R * D, is_bf16, q32.data());
  const float* qd = wide ? q32.data() : (const float*)qt.data;
  // where batch row b, head h, position l of key or value starts
  auto kv_at = [&](const Strided4& t, int64_t b, int64_t h, int64_t l) {
    return (const char*)t.data + (b * t.stride[0] + h * t.stride[1] + l * t.stride[2]) * bytes;
  };
  auto u16 = [](const char* p) { return (const uint16_t*)p; };
  const bool* md = (const bool*)mt.data;
  const int64_t L = visible_length(md, mt, L_all);  // the rows' strides stay the cache's
  if (R > kLoopMaxRows) {  // a prompt: ATen's flash attention, one batch row at a time
    std::unique_ptr<float[]> once;
    float* mask = mask_buffer(R * L, &once);
    std::vector<float> k32(wide && !bf16_prompt ? H * L * D : 0);
    std::vector<float> v32(wide && !bf16_prompt ? H * L * D : 0);
    for (int64_t b = 0; b < B; ++b) {
      // one mask for every batch row where they share one
      if (b == 0 || mt.size[0] != 1)
        additive_mask(md + b * mt.stride[0], mt.stride[2], Rm, R, L, mask);
      const void *kb = kv_at(kt, b, 0, 0), *vb = kv_at(vt, b, 0, 0);
      int64_t ks0 = kt.stride[1], ks = kt.stride[2], vs0 = vt.stride[1], vs = vt.stride[2];
      if (bf16_prompt) {  // q and the cache as they lie (the copy into out widens)
        const uint16_t* qb = (const uint16_t*)qt.data + b * H * R * D;
        if (AOTITorchError e = flash_attention(qb, kb, ks0, ks, vb, vs0, vs, mask, H, R, L, D,
                                               scale, out + b * H * R * D, bf16))
          return e;
        continue;
      }
      if (wide) {  // this batch row's visible keys and values, [H, L, D] fp32
        for (int64_t h = 0; h < H; ++h) {
          widen_rows(u16(kv_at(kt, b, h, 0)), L, ks, D, is_bf16, &k32[h * L * D]);
          widen_rows(u16(kv_at(vt, b, h, 0)), L, vs, D, is_bf16, &v32[h * L * D]);
        }
        kb = k32.data(), vb = v32.data(), ks0 = vs0 = L * D, ks = vs = D;
      }
      if (AOTITorchError e = flash_attention(qd + b * H * R * D, kb, ks0, ks, vb, vs0, vs, mask,
                                             H, R, L, D, scale, out + b * H * R * D))
        return e;
    }
    return AOTI_TORCH_SUCCESS;
  }
  // Work units: (head, split of the positions), as flash-decoding splits its keys: reading
  // the cache from memory is most of the time, and every thread gets an equal share of each
  // head's positions. One head per thread (SmolLM2's 3 heads 2 : 1 on two cores) measured the
  // same at 128-228 positions; the split keeps longer caches balanced. Each unit's partial
  // sums are combined below. One thread where the work would not pay the fork.
  const int64_t heads = B * H, threads = omp_get_max_threads();
  const bool parallel = threads > 1 && heads * R * L * D > (1 << 14);
  const int64_t splits = parallel ? std::max<int64_t>(1, std::min(threads, L / 32)) : 1;
  const int64_t units = heads * splits, per_split = (L + splits - 1) / splits;
  std::vector<float> part(units * R * D), mx(units * R), total(units * R);
#pragma omp parallel if (parallel)
  {
    std::vector<float> scores(R * per_split);
    std::vector<float> k32(wide ? per_split * D : 0), v32(wide ? per_split * D : 0);
#pragma omp for schedule(static)
    for (int64_t u = 0; u < units; ++u) {
      const int64_t bh = u / splits, i = u % splits;
      const int64_t l0 = L * i / splits, l1 = L * (i + 1) / splits;
      const int64_t b = bh / H, h = bh % H, bm = mt.size[0] == 1 ? 0 : b;
      const char *kc = kv_at(kt, b, h, l0), *vc = kv_at(vt, b, h, l0);
      const float *kh = (const float*)kc, *vh = (const float*)vc;
      int64_t ks = kt.stride[2], vs = vt.stride[2];
      if (wide) {  // this unit's rows, [l1 - l0, D] fp32
        widen_rows(u16(kc), l1 - l0, ks, D, is_bf16, k32.data());
        widen_rows(u16(vc), l1 - l0, vs, D, is_bf16, v32.data());
        kh = k32.data(), vh = v32.data(), ks = vs = D;
      }
      partial_attention(qd + bh * R * D, kh, ks, vh, vs, md + bm * mt.stride[0] + l0,
                        mt.stride[2], Rm, R, l1 - l0, D, float(scale), &part[u * R * D],
                        &mx[u * R], &total[u * R], scores.data());
    }
  }
  for (int64_t bh = 0; bh < heads; ++bh)  // softmax across the splits
    for (int64_t r = 0; r < R; ++r) {
      float m = -INFINITY;
      for (int64_t i = 0; i < splits; ++i) m = std::max(m, mx[(bh * splits + i) * R + r]);
      float* o = out + (bh * R + r) * D;
      std::fill(o, o + D, 0.0f);
      if (m == -INFINITY) continue;  // every position masked: zeros
      float sum = 0.0f;
      for (int64_t i = 0; i < splits; ++i) {
        const int64_t at = (bh * splits + i) * R + r;
        const float w = exp_nonpositive(mx[at] - m);
        sum += w * total[at];
        for (int64_t d = 0; d < D; ++d) o[d] += w * part[at * D + d];
      }
      const float inv = 1.0f / sum;
      for (int64_t d = 0; d < D; ++d) o[d] *= inv;
    }
  return AOTI_TORCH_SUCCESS;
}

}  // extern "C"
