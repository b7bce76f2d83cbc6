// AMX tile GEMMs (Intel Xeon Sapphire Rapids and later): the large-M path of the panel GEMMs,
// on the panels they already lay out.
//
// Where this sits: included by bf16_dot.h, so by int8_fp8.cpp (w8a8 on the prepacked VNNI
// panels; the bf16 dot-product GEMM of int8 and e4m3 weights) and int4.cpp (W4A8; the bf16
// GEMM of int4 weights), which call amx_gemm from kAmxMinM rows when the CPU and the kernel
// build have AMX (FXQ_AMX, amx_ready()).
//
// The panel layouts are an AMX B tile's already: the VNNI panel (prepack_int8_vnni) and W4A8's
// code panel (pack_int4_panel16) are 16 columns x 4 k per 64 bytes, K4 rows of them, and the
// bf16 panel (pack_panel_bf16) 16 columns x 2 k per 64 bytes, K2 rows; 16 consecutive 64-byte
// rows are one B tile (64 k of int8, 32 k of bf16). The activations are the A tiles where they
// lie: 16 rows x 64 bytes. One TDPBUSD is 256 times the products of one vpdpbusd, issued once
// every 16 cycles (Sapphire Rapids) where two vpdpbusd issue a cycle: 8x the peak rate of the
// AVX-512 panel tiles, of which the tile loads leave w8a8 1.2-1.35x here (README, "How the
// CPU lowering runs"). Sums as the AVX-512 kernels': int32 exact for int8 (the same bytes; u8 x s8
// less 128 x the column sums for w8a8, s8 x u8 codes for W4A8); fp32 for bf16 (pairs of bf16
// products added to fp32, another order of the same sums; the tile unit flushes fp32
// denormals, which an fp32 output of these scales does not reach).

#pragma once

#include <omp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "native.h"

#if defined(FXQ_VNNI512) && defined(FXQ_BF16_512) && defined(__AMX_TILE__) && \
    defined(__AMX_INT8__) && defined(__AMX_BF16__)
#define FXQ_AMX 1
#endif

#ifdef FXQ_AMX

#pragma GCC visibility push(hidden)

namespace fxq {

// From this many rows the AMX tiles; below, the AVX-512 kernels (a 16-row A tile is mostly
// empty there, and the bf16 path's per-call pack costs what a few rows do). The Xeon (Emerald
// Rapids, two threads, SmolLM2's 576 x 1536, 1536 x 576 and 576 x 576, int8 weights, one build
// with the tiles from 2 rows and one from 16, compared per M: a one-off comparison, not a
// benchmarks/ script): the AVX-512 kernels 1.4-2x faster at 2-4 rows, the tiles 1.05-1.3x at 8
// (bf16: 1.1-1.3x) and 1.3-1.9x at 12.
#ifndef FXQ_AMX_MIN_M
#define FXQ_AMX_MIN_M 8
#endif
constexpr int64_t kAmxMinM = FXQ_AMX_MIN_M;

// Linux gives a process the tiles' 8 KiB of register state only when it asks (arch_prctl
// ARCH_REQ_XCOMP_PERM for XFEATURE_XTILEDATA); without it the first tile instruction faults.
// Asked once a process; a kernel that refuses (an old Linux, a sandbox) keeps the AVX-512 path.
inline bool amx_ready() {
  static const bool ok = [] {
    constexpr long kReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;  // asm/prctl.h
    return syscall(SYS_arch_prctl, kReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

// A thread's tile configuration for one parallel region: eight tiles of 16 rows x 64 bytes
// (0-3 the accumulators, 4-5 A, 6-7 B), released at the end (the tile state is per thread)
struct Tiles {
  struct alignas(64) Config {
    uint8_t palette = 1, start_row = 0, reserved[14] = {};
    uint16_t colsb[16] = {};
    uint8_t rows[16] = {};
  };
  Tiles() {
    Config c;
    for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
    _tile_loadconfig(&c);
  }
  ~Tiles() { _tile_release(); }
  Tiles(const Tiles&) = delete;
  Tiles& operator=(const Tiles&) = delete;
};

// A x B: u8 x s8 into int32 (w8a8: x + 128 against the weight), s8 x u8 into int32 (W4A8: x
// against the int4 codes), bf16 x bf16 into fp32
enum class Amx { kInt8, kInt8Codes, kBf16 };

// C += A . B on tiles named by literals (the intrinsics paste them into the instruction)
#define FXQ_TILE_DOT(T, C, A, B)              \
  do {                                        \
    if constexpr (T == Amx::kInt8)            \
      _tile_dpbusd(C, A, B);                  \
    else if constexpr (T == Amx::kInt8Codes) \
      _tile_dpbsud(C, A, B);                  \
    else                                      \
      _tile_dpbf16ps(C, A, B);                \
  } while (0)

// c [16 MR rows x 16 NP columns] (int32 / fp32, 64 NP bytes a row) = A . B over `steps` steps:
// A's 16 MR rows lda bytes apart, 64 bytes a step; the B panels' steps 1 KiB apart from b0, b1
template <Amx T, int MR, int NP>
inline void amx_block(const uint8_t* a, int64_t lda, const uint8_t* b0, const uint8_t* b1,
                      int64_t steps, void* c) {
  _tile_zero(0);
  if constexpr (NP == 2) _tile_zero(1);
  if constexpr (MR == 2) _tile_zero(2);
  if constexpr (MR == 2 && NP == 2) _tile_zero(3);
  for (int64_t s = 0; s < steps; ++s) {
    _tile_loadd(4, a + s * 64, lda);
    _tile_loadd(6, b0 + s * 1024, 64);
    if constexpr (NP == 2) _tile_loadd(7, b1 + s * 1024, 64);
    FXQ_TILE_DOT(T, 0, 4, 6);
    if constexpr (NP == 2) FXQ_TILE_DOT(T, 1, 4, 7);
    if constexpr (MR == 2) {
      _tile_loadd(5, a + 16 * lda + s * 64, lda);
      FXQ_TILE_DOT(T, 2, 5, 6);
      if constexpr (NP == 2) FXQ_TILE_DOT(T, 3, 5, 7);
    }
  }
  char* out = static_cast<char*>(c);
  constexpr int64_t ldc = 64 * NP;
  _tile_stored(0, out, ldc);
  if constexpr (NP == 2) _tile_stored(1, out + 64, ldc);
  if constexpr (MR == 2) _tile_stored(2, out + 16 * ldc, ldc);
  if constexpr (MR == 2 && NP == 2) _tile_stored(3, out + 16 * ldc + 64, ldc);
}

// Tried against this on 2026-12-06 (Xeon Emerald Rapids, two threads, SmolLM2's four linear
// shapes, one-off timings by hand), neither kept: the item's A rows copied into a tile-ordered
// buffer (each A tile load 1 KiB in a row instead of 16 rows lda apart): no faster (1.5x the
// time of ATen's bf16 F.linear at 512 x 1536 x 576, against 1.4x before, separate runs); and,
// from some M on, ATen's bf16 mm (oneDNN) through aoti_torch_cpu_mm_out on the weight decoded to
// bf16 in a kept buffer, its bf16 product widened and scaled: 0.72-0.92x these tiles' speed at
// M = 32-512 on int8 weights, 0.66-1.02x on bf16 ones, where F.linear on a stored bf16 weight
// had looked ~1.3x faster at M = 512.
// Every output of an [M, 16 panels] product, 32 rows x 2 panels a block, the blocks split
// between the threads as the panel GEMMs split them (PanelWork: blocks of panels that fit in
// L2, rows too when there are many).
//   a, lda:       the M activation rows, lda bytes apart, each steps x 64 bytes (zeros past K)
//   panel_bytes:  one panel's bytes (steps x 1 KiB, or more)
//   prepare(p0, p1, buf) -> base: panel p's tiles at base + (p - p0) * panel_bytes (the stored
//                 panels, or panels packed into the thread's buffer buf)
//   chunk:        steps a sum runs before it leaves the tiles (all of them: one sum a block;
//                 a quantization group's: one sum a group, which store scales)
//   store(m0, rows, p, np, ci, panel, c, acc): chunk ci's sums c (16 np columns a row) of the
//                 block into y, or into acc (the thread's fp32 block, laid out as c) until the
//                 last; panel: panel p's bytes (for what a format keeps after its tiles)
template <Amx T, class Prepare, class Store>
void amx_gemm(const uint8_t* a, int64_t lda, int64_t M, int64_t steps, int64_t panels,
              int64_t panel_bytes, const Prepare& prepare, const Store& store,
              int64_t chunk = 0) {
  constexpr int R = 32, P = 2;
  if (chunk <= 0) chunk = steps;
  const PanelWork work(panels, panel_bytes, M, P, R, omp_get_max_threads());
#pragma omp parallel
  {
    const Tiles tiles;
    alignas(64) int32_t c[R * 16 * P];
    alignas(64) float acc[R * 16 * P];
    std::vector<uint8_t> buf, tail;  // packed panels; the last rows, zero-padded to a block
#pragma omp for schedule(static)
    for (int64_t item = 0; item < work.items(); ++item) {
      int64_t p0, p1, m0, m1;
      work.item(item, M, &p0, &p1, &m0, &m1);
      const uint8_t* base = prepare(p0, p1, buf);
      // rows past M are not there to load: the last block's rows copied, padded with zeros
      const int64_t full = m0 + (m1 - m0) / R * R;
      if (full < m1) {
        tail.assign(R * steps * 64, 0);
        for (int64_t i = full; i < m1; ++i)
          std::memcpy(&tail[(i - full) * steps * 64], a + i * lda, steps * 64);
      }
      // a panel pair (its B tiles, 2 x steps KiB, in L1) meets every block of rows, which
      // stream from L2: the other order read both from L2 (measured ~1.6x slower, M = 128)
      for (int64_t p = p0; p < p1; p += P) {
        const uint8_t* b0 = base + (p - p0) * panel_bytes;
        const uint8_t* b1 = b0 + panel_bytes;
        const int np = p + 1 < p1 ? 2 : 1;
        for (int64_t m = m0; m < m1; m += R) {
          const int64_t rows = std::min<int64_t>(R, m1 - m);
          const bool in_tail = m >= full;
          const uint8_t* am = in_tail ? tail.data() : a + m * lda;
          const int64_t ld = in_tail ? steps * 64 : lda;
          for (int64_t s = 0, ci = 0; s < steps; s += chunk, ++ci) {
            const int64_t n = std::min(chunk, steps - s);
            const uint8_t *as = am + s * 64, *bs0 = b0 + s * 1024, *bs1 = b1 + s * 1024;
            if (rows > 16)
              np == 2 ? amx_block<T, 2, 2>(as, ld, bs0, bs1, n, c)
                      : amx_block<T, 2, 1>(as, ld, bs0, bs1, n, c);
            else
              np == 2 ? amx_block<T, 1, 2>(as, ld, bs0, bs1, n, c)
                      : amx_block<T, 1, 1>(as, ld, bs0, bs1, n, c);
            store(m, rows, p, np, ci, b0, (const int32_t*)c, acc);
          }
        }
      }
    }
  }
}

#undef FXQ_TILE_DOT

}  // namespace fxq

#pragma GCC visibility pop

#endif  // FXQ_AMX
