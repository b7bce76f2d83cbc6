"""VPTQ GEMM: y = (x ⊙ scale)[:, perm] · W'ᵀ + x·bias_w + bias, W' decoded in the kernel from the
packed indices (main + residual codebook entry per vector of ``vector_len`` output rows).

Where it sits: the CUDA lowering at the end of this file (collected by
``fxquant.passes.lower_cuda``) maps ``fxquant::vptq_linear`` onto the column scale and permutation
of x (aten ops Inductor fuses), ``fxquant::triton_vptq_linear`` below, and the column bias as one
GEMV (W = W'[:, perm⁻¹]·diag(scale) + bias_w gives x·Wᵀ = (x ⊙ scale)[:, perm]·W'ᵀ + x·bias_w);
a checkpoint's outlier columns (the first S of W', decoded at load) are one more small GEMM.
The oracle is ``fxquant.core.vptq.vptq_linear``.

The kernel reads each (codebook group, output vector block)'s bit stream where its field for
input column g starts (bit g·T: one or two 32-bit words, joined in an int64), splits the main and
residual indices, gathers both codebook entries at the row's position in its vector, and runs one
fp32 dot per K step; the decoded weight never reaches memory. Rows come through ``rows`` (the
layer's rows of the padded decode). VPTQ's own CUDA kernels (shared-memory codebooks) are the
faster design; this one is correct first and measured by benchmarks/gpu when a GPU is lent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from fxquant.core.registry import lowering
from fxquant.kernels import gemm
from fxquant.kernels.gemm import store_tile

_BLOCK_G = 16


@triton.jit
def _vptq_linear_kernel(
    x_ptr,  # [M, C·G] fp32: x scaled and permuted
    i_ptr,  # [C, NV, P] int32 packed indices
    cb_ptr,  # [C, K, VL] fp32
    rcb_ptr,  # [C, R, VL] fp32 (read only when R > 0)
    rows_ptr,  # [N] int64: each output's row of the decode
    out_ptr,  # [M, N] fp32
    M,
    N,
    NV,
    P,
    G,
    K,
    R,
    C: tl.constexpr,
    VL: tl.constexpr,
    IB: tl.constexpr,
    RB: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    row = tl.load(rows_ptr + offs_n, mask=mask_n, other=0)
    blk, pos = row // VL, row % VL  # [BLOCK_N]
    kin = C * G
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for c in tl.static_range(C):
        words = i_ptr + (c * NV + blk.to(tl.int64))[None, :] * P  # [1, BLOCK_N]
        for g0 in range(0, G, BLOCK_G):
            g = g0 + tl.arange(0, BLOCK_G)
            mask_g = g < G
            mask_w = mask_g[:, None] & mask_n[None, :]
            start = g.to(tl.int64) * (IB + RB)
            word = (start // 32)[:, None]
            shift = (start % 32)[:, None]
            lo = tl.load(words + word, mask=mask_w, other=0).to(tl.int64) & 0xFFFFFFFF
            hi = tl.load(words + word + 1, mask=mask_w & (word + 1 < P), other=0).to(tl.int64)
            merged = ((lo | ((hi & 0xFFFFFFFF) << 32)) >> shift) & ((1 << (IB + RB)) - 1)
            main = merged & ((1 << IB) - 1)
            w = tl.load(cb_ptr + ((c * K + main) * VL + pos[None, :]), mask=mask_w, other=0.0)
            if RB > 0:
                res = (merged >> IB) & ((1 << RB) - 1)
                w += tl.load(rcb_ptr + ((c * R + res) * VL + pos[None, :]), mask=mask_w, other=0.0)
            xv = tl.load(x_ptr + offs_m.to(tl.int64)[:, None] * kin + (c * G + g)[None, :],
                         mask=mask_m[:, None] & mask_g[None, :], other=0.0)  # fmt: skip
            acc += tl.dot(xv, w, input_precision="ieee")
    store_tile(out_ptr, acc, out_ptr, offs_m, offs_n, M, N, 0, False, 1)


@triton_op("fxquant::triton_vptq_linear", mutates_args=())
def triton_vptq_linear(
    x: Tensor, weight: Tensor, centroids: Tensor, res_centroids: Tensor, rows: Tensor
) -> Tensor:
    """x [M, in] fp32, already scaled and permuted · W' decoded from the packed indices
    [C, NV, P] and codebooks [C, K, vl] / [C, R, vl], the ``rows`` [N] of it → fp32 [M, N]."""
    m, kin = x.shape
    c, nv, p = weight.shape
    _, k, vl = centroids.shape
    r = res_centroids.shape[1]
    ib, rb = k.bit_length() - 1, (r.bit_length() - 1 if r > 0 else 0)
    n = rows.shape[0]
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)
    bm, bn = (16 if m <= 16 else 64), 64
    rcb = res_centroids if r > 0 else centroids  # a stand-in when never read
    wrap_triton(_vptq_linear_kernel)[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x.contiguous(), weight.contiguous(), centroids.float().contiguous(),
        rcb.float().contiguous(), rows.contiguous(), y, m, n, nv, p, kin // c, k, max(r, 1),
        C=c, VL=vl, IB=ib, RB=rb, BLOCK_M=bm, BLOCK_N=bn, BLOCK_G=_BLOCK_G,
    )  # fmt: skip
    return y


@lowering("cuda", "vptq_linear")
def lower_vptq_linear(
    x, weight, centroids, res_centroids, perm, weight_scale, weight_bias, rows, outliers, bias
):
    x2 = gemm.rows(x).float()
    xs = (x2 * weight_scale.float())[:, perm]
    s = 0 if outliers is None else outliers.shape[1]
    y = torch.ops.fxquant.triton_vptq_linear(xs[:, s:], weight, centroids, res_centroids, rows)
    if outliers is not None:
        y = y + xs[:, :s] @ outliers.float().t()
    y = y + (x2 @ weight_bias.float())[:, None]
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*x.shape[:-1], rows.shape[0]).to(x.dtype)
