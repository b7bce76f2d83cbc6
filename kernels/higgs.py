"""HIGGS GEMM: y = (x·Ĥ) · ŵᵀ + bias, ŵ decoded in the kernel from vector codes into a Gaussian
grid times one scale per rotation block.

Where it sits: the CUDA lowering at the end of this file (collected by
``fxquant.passes.lower_cuda``) maps ``fxquant::higgs_linear`` onto the block rotation of x (one
batched matmul, cuBLAS) and ``fxquant::triton_higgs_linear`` below. The oracle is
``fxquant.core.higgs.higgs_linear``.

The weight is read as its codes (one byte per p values) and never written out decoded: a K step
of the kernel loads the codes of BLOCK_K / p positions of BLOCK_N rows, gathers each code's p
grid coordinates from the table (4 KB at most, cached), multiplies by the row's block scale and
runs one fp32 dot per coordinate (p = 2: the even columns of x against the first coordinates,
the odd ones against the second, as ``kernels.mxfp4`` splits its nibbles). A K step stays inside
one rotation block (BLOCK_K divides h), so a step reads one scale per row. Ragged M and N are
masked; K is the padded Kp, a multiple of h. FLUTE's lookup-table kernel is the faster design on
a GPU; this one is correct first and measured by benchmarks/gpu when a GPU is lent.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from fxquant.core import higgs
from fxquant.core.registry import lowering
from fxquant.kernels import gemm
from fxquant.kernels.gemm import store_tile

_BLOCK_K = 32


@triton.jit
def _higgs_linear_kernel(
    x_ptr,  # [M, Kp] fp32: the rotated activation
    c_ptr,  # [N, Kp/P] uint8 codes
    s_ptr,  # [N, Kp/H] fp32 block scales
    g_ptr,  # [2^(P·bits), P] fp32 grid
    bias_ptr,
    out_ptr,  # [M, N] fp32
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    P: tl.constexpr,
    H: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    kc = K // P
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * K
    c_cols = c_ptr + offs_n.to(tl.int64)[None, :] * kc
    s_cols = s_ptr + offs_n.to(tl.int64)[None, :] * (K // H)
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        j = k0 // P + tl.arange(0, BLOCK_K // P)  # code positions of this step
        code = tl.load(c_cols + j[:, None], mask=mask_n[None, :], other=0).to(tl.int32)
        scale = tl.load(s_cols + k0 // H, mask=mask_n[None, :], other=0.0)  # [1, BLOCK_N]
        for d in tl.static_range(P):
            w = tl.load(g_ptr + code * P + d) * scale  # [BLOCK_K/P, BLOCK_N]
            xv = tl.load(x_rows + (P * j + d)[None, :], mask=mask_m[:, None], other=0.0)
            acc += tl.dot(xv, w, input_precision="ieee")
    store_tile(out_ptr, acc, bias_ptr, offs_m, offs_n, M, N, 0, HAS_BIAS, 1)


@triton_op("fxquant::triton_higgs_linear", mutates_args=())
def triton_higgs_linear(
    x: Tensor, weight: Tensor, scale: Tensor, grid: Tensor, bias: Tensor | None, hadamard_size: int
) -> Tensor:
    """x [M, Kp] fp32, already rotated · codes [N, Kp/p] into ``grid`` with block scales
    [N, Kp/h] → fp32 [M, N]."""
    m, k = x.shape
    n, p = weight.shape[0], grid.shape[1]
    if weight.shape[1] * p != k or k % hadamard_size or hadamard_size % _BLOCK_K:
        raise ValueError(
            f"higgs linear: x [M, Kp] with Kp a multiple of {hadamard_size} and codes [N, Kp/p]; "
            f"got x {tuple(x.shape)}, codes {tuple(weight.shape)}, p={p}"
        )
    y = torch.empty((m, n), dtype=torch.float32, device=x.device)
    bm, bn = (16 if m <= 16 else 64), 64
    wrap_triton(_higgs_linear_kernel)[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        x.contiguous(),
        weight.contiguous(),
        scale.float().contiguous(),
        grid.float().contiguous(),
        x if bias is None else bias.contiguous(),  # HAS_BIAS=False never reads it
        y,
        m,
        n,
        k,
        HAS_BIAS=bias is not None,
        P=p,
        H=hadamard_size,
        BLOCK_M=bm,
        BLOCK_N=bn,
        BLOCK_K=_BLOCK_K,
    )
    return y


@lowering("cuda", "higgs_linear")
def lower_higgs_linear(x, weight, scale, grid, bias, hadamard_size):
    xr = gemm.rows(higgs.rotate(x, hadamard_size))
    y = torch.ops.fxquant.triton_higgs_linear(xr, weight, scale, grid, bias, hadamard_size)
    return y.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)
