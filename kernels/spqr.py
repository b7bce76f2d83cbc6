"""SpQR GEMM: y = x · Wᵀ + bias with W = (dense 3-bit tiles + sparse fp16 outliers)[:, perm⁻¹],
the tiles decoded in the kernel's K loop and the outliers added in its epilogue.

Where it sits: the CUDA lowering at the end of this file (collected by
``fxquant.passes.lower_cuda``) maps ``fxquant::spqr_linear`` onto
``fxquant::triton_spqr_linear`` (same arguments, then ``decode``), through ``gemm.linear``'s
decode / prefill choice. The oracle is ``fxquant.core.spqr.spqr_linear``; the layout is in its
module docstring (W [m, n] there is [N, K] here).

Data flow inside the op: aten gathers x's columns once (x_p = x[:, perm], so that
x · Wᵀ = x_p · W_pᵀ with W_p the stored, permuted-column weight), turns the outliers into one
fp32 correction per entry (below) and lists them per output row; then one Triton GEMM on x_p.

A K step covers BLOCK_K / 16 tile columns: the kernel loads each (tile column, output row)'s
64-bit row word and the tile's eight words that carry the second-level statistics (byte p in
row 2p), decodes the row's scale and zero, then the 16 codes of every word, into a
[BLOCK_K, BLOCK_N] tile of W_p that never reaches memory. Numerics are the reference's: every
step of s = (s_code - zero_of_scales)·scale_of_scales, z likewise and w = (q - z)·s is rounded
to fp16 (fp32 arithmetic on fp16 values, rounded once, is the correctly rounded fp16 result), so
the tile holds the reference's fp16 dense weights exactly. The dot then multiplies them exactly:
fp32 activations in IEEE fp32, fp16 ones on the fp16 tensor cores, and bf16 ones as two bf16
dots, w = hi + lo (hi = bf16(w); the 11-bit fp16 significand leaves at most 4 bits for lo),
accumulated in fp32.

Outliers: the reference adds each to its dense weight in fp32 and rounds the sum to fp16 once.
The op computes, per outlier, delta = fp16(d + v) - d in fp32 (d the dense weight there,
decoded by aten at the nnz positions only), so that the epilogue's Σ x_p[:, col]·delta over
the row's outliers gives the reference's weight to fp32 rounding. Outliers are under 1 % of
the weights: the epilogue walks each output row's list (CSR offsets, at most the tile's longest
row of trips; only K slice 0 under split-K) instead of a sparse GEMM or a second launch.
PTCSR offsets (16 rows interleaved per block) are sorted into per-row lists first; its padding
entries (+0 at column 0) give delta = 0. Two entries at one (row, column), which SpQR does not
write, would each be rounded on their own.

Decode (M ≤ 16, split-K) and prefill paths and tiles as in ``gemm``; K and N are whole tiles
(multiples of 16, the layout's rule), ragged against BLOCK_K and BLOCK_N by masks. SpQR's own
CUDA kernels (tiles staged in shared memory, outliers per warp) are the faster design; this one
is correct first and measured by benchmarks/gpu when a GPU is lent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fxquant.core import spqr
from fxquant.core.registry import lowering
from fxquant.kernels import gemm
from fxquant.kernels.gemm import dot_f32, load_a, program_tile, store_tile

TILE = spqr.TILE  # 16: a tile's rows and columns; a tile row is one int64 word


@triton.jit
def _r16(v):
    """fp32 → the nearest fp16 value, kept in fp32."""
    return v.to(tl.float16).to(tl.float32)


@triton.jit
def _stat(w_ptr, tile, mask, P: tl.constexpr):
    """The tile's P-th fp16 second-level statistic (bytes 2P, 2P + 1, from rows 4P and
    4P + 2), in fp32, at the int64 word offsets ``tile`` of the tiles' first rows."""
    lo = (tl.load(w_ptr + tile + 4 * P, mask=mask, other=0) >> 54) & 0xFF
    hi = (tl.load(w_ptr + tile + 4 * P + 2, mask=mask, other=0) >> 54) & 0xFF
    return (lo | (hi << 8)).to(tl.uint16).to(tl.float16, bitcast=True).to(tl.float32)


@triton.jit
def _spqr_gemm_kernel(
    x_ptr,  # [M, K] bf16 / fp16 / fp32: x's columns already permuted (x_p)
    w_ptr,  # [N/16 · K/16 · 16] int64 tile row words
    ro_ptr,  # [N + 1] int32: output row n's outliers are entries ro[n] .. ro[n + 1] - 1
    oc_ptr,  # [nnz] int32: each outlier's (permuted) input column
    od_ptr,  # [nnz] fp32: each outlier's correction to the dense weight
    bias_ptr,  # [N] float; any valid pointer when HAS_BIAS is False (never read)
    y_ptr,  # [M, N] x's dtype, or fp32 zeros (decode)
    M,
    N,
    K,
    HAS_OUTLIERS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    KT: tl.constexpr = BLOCK_K // 16  # tile columns a K step covers
    offs_m, offs_n, pid_k = program_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    mask_m = offs_m < M
    mask_n = offs_n < N
    tiles_k = K // 16
    tile_row = (offs_n // 16).to(tl.int64) * tiles_k  # [BLOCK_N]
    row_in_tile = (offs_n % 16)[None, :]
    shifts = (6 + 3 * tl.arange(0, 16))[None, :, None]  # column j's code: bits 6 + 3j

    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        # ---- decode W_p's tile [BLOCK_K, BLOCK_N]
        tj = k0 // 16 + tl.arange(0, KT)
        mask_w = (tj < tiles_k)[:, None] & mask_n[None, :]
        tile = (tile_row[None, :] + tj[:, None]) * 16  # [KT, BLOCK_N]: the tile's first word
        word = tl.load(w_ptr + tile + row_in_tile, mask=mask_w, other=0)
        s_s, z_s = _stat(w_ptr, tile, mask_w, 0), _stat(w_ptr, tile, mask_w, 1)
        s_z, z_z = _stat(w_ptr, tile, mask_w, 2), _stat(w_ptr, tile, mask_w, 3)
        s = _r16(_r16((word & 7).to(tl.float32) - s_z) * s_s)
        z = _r16(_r16(((word >> 3) & 7).to(tl.float32) - z_z) * z_s)
        q = ((word[:, None, :] >> shifts) & 7).to(tl.float32)  # [KT, 16, BLOCK_N]
        w = _r16(_r16(q - z[:, None, :]) * s[:, None, :])
        w = tl.reshape(w, (BLOCK_K, BLOCK_N))  # row kt·16 + j: input column k0 + kt·16 + j

        # ---- the dot, exact products (module docstring)
        a, mask_k = load_a(x_ptr, offs_m, mask_m, k0 + tl.arange(0, BLOCK_K), K)
        if a.dtype == tl.float32:
            acc += dot_f32(a, w)
        elif a.dtype == tl.float16:
            acc += dot_f32(a, w.to(tl.float16))
        else:
            hi = w.to(tl.bfloat16)
            acc += dot_f32(a, hi)
            acc += dot_f32(a, (w - hi.to(tl.float32)).to(tl.bfloat16))

    # ---- outliers: K slice 0 walks each output row's list
    if HAS_OUTLIERS:
        start = tl.load(ro_ptr + offs_n, mask=mask_n, other=0)
        end = tl.load(ro_ptr + offs_n + 1, mask=mask_n, other=0)
        trips = tl.where(pid_k == 0, tl.max(end - start, axis=0), 0)
        x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * K
        for i in range(0, trips):
            e = start + i
            live = mask_n & (e < end)
            col = tl.load(oc_ptr + e, mask=live, other=0)
            delta = tl.load(od_ptr + e, mask=live, other=0.0)
            xv = tl.load(x_rows + col[None, :], mask=mask_m[:, None] & live[None, :], other=0.0)
            acc += xv.to(tl.float32) * delta[None, :]

    store_tile(y_ptr, acc, bias_ptr, offs_m, offs_n, M, N, pid_k, HAS_BIAS, SPLIT_K)


_decode_kernel, _prefill_kernel = gemm.decode_and_prefill(
    _spqr_gemm_kernel, key=["N", "K", "HAS_OUTLIERS"]
)


# --------------------------------------------------------------------------------------------
# Outliers: one fp32 correction per entry, listed per output row (aten)
# --------------------------------------------------------------------------------------------


def _dense_at(weight: Tensor, rows: Tensor, cols: Tensor, k: int) -> Tensor:
    """The dense (fp16) weight of W_p at (rows, cols), decoded as ``spqr.dense`` does."""
    tile = ((rows // TILE) * (k // TILE) + cols // TILE) * TILE  # the tile's first word
    d = weight.to(torch.int64)
    word = d[tile + rows % TILE]
    s, z = spqr.row_scale_zero(word, d[tile[:, None] + torch.arange(0, TILE, 2, device=d.device)])
    q = ((word >> (6 + 3 * (cols % TILE))) & 7).half()
    return (q - z) * s


def outliers(
    weight: Tensor, row_offsets: Tensor, col_vals: Tensor, n: int, k: int
) -> tuple[Tensor, Tensor, Tensor]:
    """(per-row offsets int32 [N + 1], columns int32 [nnz], corrections fp32 [nnz]): the
    epilogue's outlier lists (module docstring)."""
    cv = col_vals.to(torch.int64)
    cols = cv & 0xFFFF
    vals = spqr._half((cv >> 16) & 0xFFFF).float()
    rows = spqr.outlier_rows(row_offsets, cv.numel(), n)
    d = _dense_at(weight, rows, cols, k).float()
    delta = (d + vals).half().float() - d
    if row_offsets.numel() == n + 1:  # CSR: already listed per row
        offsets = row_offsets
    else:
        rows, order = torch.sort(rows, stable=True)
        cols, delta = cols[order], delta[order]
        ends = torch.arange(n + 1, device=rows.device)
        offsets = torch.searchsorted(rows, ends, out_int32=True)
    return offsets.to(torch.int32).contiguous(), cols.to(torch.int32), delta.contiguous()


# --------------------------------------------------------------------------------------------
# The op and the CUDA lowering
# --------------------------------------------------------------------------------------------


def check(weight: Tensor, row_offsets: Tensor, perm: Tensor, k: int) -> int:
    """The layout's rules for x with ``k`` features; returns N."""
    kp = perm.shape[0]
    if k != kp or k % TILE or (weight.numel() * TILE) % max(k, 1):
        raise ValueError(
            f"spqr linear: x has {k} features, perm {kp}; both must be equal and a multiple of "
            f"{TILE}, and the {weight.numel()} tile words must make whole [16, {k}] row bands"
        )
    n = weight.numel() * TILE // k
    if n % TILE or row_offsets.numel() not in (n + 1, n // TILE + 1):
        raise ValueError(
            f"spqr linear: {n} output rows (a multiple of {TILE} needed) with "
            f"{row_offsets.numel()} row offsets (CSR: {n + 1}, PTCSR: {n // TILE + 1})"
        )
    if weight.dtype != torch.int64:
        raise ValueError(f"spqr linear: tile words are {weight.dtype}, expected int64")
    return n


def spqr_linear(
    x: Tensor,
    weight: Tensor,
    row_offsets: Tensor,
    col_vals: Tensor,
    perm: Tensor,
    bias: Tensor | None = None,
    decode: bool | None = None,
) -> Tensor:
    """x [M, K] · the SpQR W [N, K] (+ bias) → [M, N] in x's dtype: the CUDA lowering of
    ``fxquant::spqr_linear`` (same arguments, then ``decode``: force the decode (True) or
    prefill (False) kernel; None picks from M)."""
    gemm.check_activation(x)
    m, k = x.shape
    n = check(weight, row_offsets, perm, k)
    xp = x[:, perm].contiguous()
    nnz = col_vals.numel()
    if nnz:
        offsets, cols, delta = outliers(weight, row_offsets, col_vals, n, k)
    else:  # stand-ins, never read (HAS_OUTLIERS=False)
        offsets, cols, delta = row_offsets.to(torch.int32), col_vals, xp
    return gemm.launch(
        (_decode_kernel, _prefill_kernel),
        (xp, weight.contiguous(), offsets, cols, delta),
        bias,
        m,
        n,
        k,
        out_dtype=x.dtype,
        decode=decode,
        HAS_OUTLIERS=nnz > 0,
    )


triton_spqr_linear = torch.library.triton_op(
    "fxquant::triton_spqr_linear", spqr_linear, mutates_args=()
)


@lowering("cuda", "spqr_linear")
def lower_spqr_linear(x, weight, row_offsets, col_vals, perm, bias):
    op = torch.ops.fxquant.triton_spqr_linear.default
    return gemm.linear(op, x, weight, row_offsets, col_vals, perm, bias)
