"""MXFP8 GEMM: y = x · dequant(W)ᵀ + bias, W e4m3 [N, K] with E8M0 scales per 1×32.

Where it sits: the CUDA lowering at the end of this file (collected by
``fxquant.passes.lower_cuda``) maps ``fxquant::mxfp8_linear`` onto ``fxquant::triton_mxfp8_linear``
below, after quantizing x to MXFP8 per token in aten ops (Inductor fuses the block amax,
exponent and cast); the kernel returns fp32. The oracle is
``fxquant.core.reference_mx.mxfp8_linear``.

One K step is one 32-wide scale block: the e4m3 tile is upcast, multiplied by each column's
power-of-two scale (exact) and accumulated by an IEEE fp32 ``tl.dot``; sm100's block-scaled
MMA is not used yet. Ragged M and N are masked; K is a multiple of 32 (the scheme skips other
layers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

from fxquant.core import reference_mx as ref_mx
from fxquant.core.registry import lowering
from fxquant.kernels import gemm
from fxquant.kernels.gemm import store_tile
from fxquant.kernels.mxfp4 import e8m0_to_f32, launch

_BLOCK_K = 32  # the MX block: one scale per weight row and K step


@triton.jit
def _mxfp8_linear_kernel(
    x_ptr,  # [M, K] float: the MXFP8-dequantized activation
    w_ptr,  # [N, K] float8_e4m3fn
    s_ptr,  # [N, K/32] uint8 E8M0 exponents
    bias_ptr,  # [N] float (read only when HAS_BIAS)
    out_ptr,  # [M, N] fp32
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # ---- tile of this program -------------------------------------------------------------
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * K  # [BLOCK_M, 1]
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * K  # [1, BLOCK_N]: W tile read as [K, N]
    s_cols = s_ptr + offs_n.to(tl.int64) * (K // BLOCK_K)  # [BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # ---- per 32-wide block: upcast, scale by 2**(s - 127), fp32 dot ----------------------------
    for kb in range(0, K // BLOCK_K):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        a = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None], other=0.0).to(tl.float32)
        w = tl.load(w_cols + offs_k[:, None], mask=mask_n[None, :], other=0.0).to(tl.float32)
        s = tl.load(s_cols + kb, mask=mask_n, other=127).to(tl.int32)
        acc += tl.dot(a, w * e8m0_to_f32(s)[None, :], input_precision="ieee")
    # ---- epilogue: bias ------------------------------------------------------------------------
    store_tile(out_ptr, acc, bias_ptr, offs_m, offs_n, M, N, 0, HAS_BIAS, 1)


def mxfp8_linear(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """x [M, K] float (MXFP8-dequantized) · e4m3 W [N, K] with E8M0 (uint8) scales [N, K/32]
    → fp32 [M, N]."""
    m, k = x.shape
    n = weight.shape[0]
    if weight.dtype != torch.float8_e4m3fn or weight.shape[1] != k or k % _BLOCK_K:
        raise ValueError(
            "MXFP8 linear needs x [M, K] with K a multiple of 32 and an e4m3 weight [N, K]; got "
            f"x {tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}"
        )
    if scale.dtype != torch.uint8 or scale.shape != (n, k // _BLOCK_K):
        raise ValueError(
            f"MXFP8 linear needs uint8 E8M0 scales {(n, k // _BLOCK_K)}; got {scale.dtype} "
            f"{tuple(scale.shape)}"
        )
    operands = (x.contiguous(), weight.contiguous(), scale.contiguous())
    return launch(_mxfp8_linear_kernel, operands, bias, m, n, k, BLOCK_K=_BLOCK_K)


# The launcher is the op's body: its signature is the op's schema.
triton_mxfp8_linear = triton_op("fxquant::triton_mxfp8_linear", mxfp8_linear, mutates_args=())


@lowering("cuda", "mxfp8_linear")
def lower_mxfp8_linear(x, weight, scale, bias, scale_rule):
    xd = ref_mx.mx_fake_quantize(gemm.rows(x), elem="e4m3", rule=scale_rule)
    y = torch.ops.fxquant.triton_mxfp8_linear(xd, weight, scale, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)
