"""AQLM GEMM: y = x · Wᵀ + bias, W decoded in the kernel as the sum of one codeword per codebook
for each group of ``in_group_size`` values, times a scale per row.

Where it sits: the CUDA lowering at the end of this file (collected by
``fxquant.passes.lower_cuda``) maps ``fxquant::aqlm_linear`` onto ``fxquant::triton_aqlm_linear``.
The oracle is ``fxquant.core.aqlm.aqlm_linear``.

A K step covers BLOCK_G groups of ig values: the kernel loads the [BLOCK_G, BLOCK_N] codes of
each codebook, and for each of the ig positions in a group gathers the codeword entries (the
codebooks, 1 MiB for 1x16, stay in L2), sums them over the codebooks and runs one fp32 dot
against x's column at that position, so the decoded weight never reaches memory. Row scales are
applied in the epilogue. Ragged M, N and group counts are masked. AQLM's own CUDA kernels
(lookup tables in shared memory) are the faster design; this one is correct first and measured
by benchmarks/gpu when a GPU is lent.
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
def _aqlm_linear_kernel(
    x_ptr,  # [M, K] float
    c_ptr,  # [N, K/IG, C] int32 codes
    cb_ptr,  # [C, S, 1, IG] fp32 codebooks
    s_ptr,  # [N] fp32 row scales
    bias_ptr,
    out_ptr,  # [M, N] fp32
    M,
    N,
    K,
    S,  # codebook size
    HAS_BIAS: tl.constexpr,
    C: tl.constexpr,
    IG: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_G: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    gi = K // IG
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * K
    c_rows = c_ptr + offs_n.to(tl.int64)[None, :] * (gi * C)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for g0 in range(0, gi, BLOCK_G):
        g = g0 + tl.arange(0, BLOCK_G)
        mask_g = g < gi
        mask_w = mask_g[:, None] & mask_n[None, :]
        for d in tl.static_range(IG):
            w = tl.zeros((BLOCK_G, BLOCK_N), dtype=tl.float32)
            for c in tl.static_range(C):
                code = tl.load(c_rows + g[:, None] * C + c, mask=mask_w, other=0)
                w += tl.load(cb_ptr + (c * S + code).to(tl.int64) * IG + d, mask=mask_w, other=0.0)
            xv = tl.load(x_rows + (g * IG + d)[None, :], mask=mask_m[:, None] & mask_g[None, :],
                         other=0.0).to(tl.float32)  # fmt: skip
            acc += tl.dot(xv, w, input_precision="ieee")
    acc = acc * tl.load(s_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    store_tile(out_ptr, acc, bias_ptr, offs_m, offs_n, M, N, 0, HAS_BIAS, 1)


@triton_op("fxquant::triton_aqlm_linear", mutates_args=())
def triton_aqlm_linear(
    x: Tensor, weight: Tensor, codebooks: Tensor, scale: Tensor, bias: Tensor | None
) -> Tensor:
    """x [M, K] · AQLM W (codes [N, K/ig, C], codebooks [C, S, 1, ig], row scales [N]) → fp32."""
    m, k = x.shape
    n, gi, c = weight.shape
    cs, size, og, ig = codebooks.shape
    if (cs, og) != (c, 1) or gi * ig != k:
        raise ValueError(
            f"aqlm linear: codes {tuple(weight.shape)} and codebooks {tuple(codebooks.shape)} "
            f"do not make a [N, {k}] weight with one row a group"
        )
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)
    bm, bn = (16 if m <= 16 else 64), 64
    wrap_triton(_aqlm_linear_kernel)[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x.contiguous(),
        weight.to(torch.int32).contiguous(),
        codebooks.float().contiguous(),
        scale.float().contiguous(),
        x if bias is None else bias.contiguous(),  # HAS_BIAS=False never reads it
        y,
        m,
        n,
        k,
        size,
        HAS_BIAS=bias is not None,
        C=c,
        IG=ig,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_G=_BLOCK_G,
    )
    return y


@lowering("cuda", "aqlm_linear")
def lower_aqlm_linear(x, weight, codebooks, scale, bias):
    x2 = gemm.rows(x)
    y = torch.ops.fxquant.triton_aqlm_linear(x2, weight, codebooks, scale, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)
