"""int8 grouped GEMM (mixture-of-experts, W8A8 experts): row s of the per-token int8 activation
xq [S, K] (scale xs [S, 1]) times its expert's int8 W [E, N, K] with per-channel scales [E, N]
→ [S, N].

Where it sits: the CUDA lowering at the end of this file (collected by
``fxquant.passes.lower_cuda``) maps ``fxquant::int8_dynamic_grouped_mm`` (the op the rewrite
puts where an exported MoE layer had its grouped_mm, under W8A8) onto the per-token quantizer of
``kernels.quantize`` (``fxquant::triton_quantize_int8_per_token``: a row's scale does not depend
on its expert, so one launch quantizes every row) and ``fxquant::triton_int8_scaled_grouped_mm``
below. The oracle is ``fxquant.core.reference.int8_dynamic_grouped_mm``.

Rows and programs as in ``kernels.mxfp4_grouped``: x sorted by expert, ``offs`` [E] each
expert's cumulative row end, grid (E, cdiv(S, BLOCK_M), cdiv(N, BLOCK_N)); program (e, mb, nb)
takes its expert's rows from ``offs[e-1] + mb * BLOCK_M`` and exits at once when it has none, so
the offsets stay on the device and S stays dynamic. Numerics as ``kernels.int8_dynamic``'s:
int8 tiles multiplied by ``tl.dot`` into an int32 accumulator (exact: no rounding until the
epilogue; |sum| ≤ K · 127², so K up to 133,000 cannot overflow), then xs[s] · scale[e, n]
applied in fp32 in the reference's order, before one rounding to the output dtype. The
reference sums the same integers in fp32, exactly while |sum| < 2**24, so the two differ by
nothing but the epilogue's fp32 roundings. The op takes the output dtype as ``out_dtype``: its
input is already int8, so x's dtype is not there to read (the lowering passes x's). One fixed
tile, not autotuned, as the other experts' kernels; not yet measured on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from fxquant.core.registry import lowering
from fxquant.kernels import quantize  # noqa: F401  (registers triton_quantize_int8_per_token)
from fxquant.kernels.gemm import store_tile
from fxquant.kernels.mxfp4_grouped import check_row_scaled, expert_tile

fxq = torch.ops.fxquant
# BLOCK_K = 128 int8 values: 128 bytes a weight row per K step, as the fp8 experts' kernel (and
# int8 mma's K of 32, four times).
_BLOCK_M, _BLOCK_N, _BLOCK_K = 32, 64, 128


@triton.jit
def _int8_scaled_grouped_kernel(
    x_ptr,  # [S, K] int8: rows sorted by expert
    xs_ptr,  # [S, 1] fp32: each row's dequant scale
    w_ptr,  # [E, N, K] int8
    s_ptr,  # [E, N] fp32: per-channel dequant scales
    offs_ptr,  # [E] int32/int64: cumulative row end of each expert
    out_ptr,  # [S, N] out_dtype, zeroed: rows no program writes stay 0
    S,
    N,
    K,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # ---- rows of this program: its expert's slice of x, from offs ----------------------------
    e, row0, end, offs_m, offs_n, mask_m, mask_n = expert_tile(offs_ptr, S, N, BLOCK_M, BLOCK_N)
    if row0 >= end:
        return
    offs_k = tl.arange(0, BLOCK_K)
    x_rows = x_ptr + offs_m[:, None] * K  # [BLOCK_M, 1] (offs_m is int64)
    w_cols = w_ptr + (e.to(tl.int64) * N + offs_n[None, :]) * K  # [1, BLOCK_N]: as [K, N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    # ---- K loop: int8 · int8, int32 sums (exact) ----------------------------------------------
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        mask_k = k < K
        # integer `other`s: the loads stay int8 (what the int8 tl.dot takes)
        a = tl.load(x_rows + k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0)
        b = tl.load(w_cols + k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)
    # ---- epilogue: (xq · Wᵀ) · xs · scale as the reference, one rounding to out_dtype --------
    xs = tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)
    scale = tl.load(s_ptr + e.to(tl.int64) * N + offs_n, mask=mask_n, other=0.0)
    y = acc.to(tl.float32) * xs[:, None] * scale[None, :]
    store_tile(out_ptr, y, out_ptr, offs_m, offs_n, end, N, 0, False, 1)


def _check(
    xq: Tensor, xs: Tensor, weight: Tensor, scale: Tensor, offs: Tensor, out_dtype: torch.dtype
) -> None:
    check_row_scaled("int8 scaled grouped mm", torch.int8, xq, xs, weight, scale, offs, out_dtype)


@triton_op("fxquant::triton_int8_scaled_grouped_mm", mutates_args=())
def triton_int8_scaled_grouped_mm(
    xq: Tensor, xs: Tensor, weight: Tensor, scale: Tensor, offs: Tensor, out_dtype: torch.dtype
) -> Tensor:
    """xq int8 [S, K] (rows sorted by expert) with per-row scales xs fp32 [S, 1] · its expert's
    int8 W [E, N, K] with per-channel scales fp32 [E, N], experts from cumulative row ends
    ``offs`` [E] (int32 or int64, non-decreasing: not checked, that would need a host sync) →
    (xq · Wᵀ) · xs · scale, [S, N] in ``out_dtype``, zeros for rows at or past ``offs[-1]``."""
    _check(xq, xs, weight, scale, offs, out_dtype)
    xq, xs, weight = xq.contiguous(), xs.contiguous(), weight.contiguous()
    scale, offs = scale.contiguous(), offs.contiguous()
    s, k = xq.shape
    e, n = weight.shape[0], weight.shape[1]
    out = torch.zeros((s, n), dtype=out_dtype, device=xq.device)
    grid = (e, triton.cdiv(s, _BLOCK_M), triton.cdiv(n, _BLOCK_N))
    wrap_triton(_int8_scaled_grouped_kernel)[grid](
        xq, xs, weight, scale, offs, out, s, n, k,
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )  # fmt: skip
    return out


@lowering("cuda", "int8_dynamic_grouped_mm")
def lower_int8_dynamic_grouped_mm(x, weight, scale, offs):
    # x [S, K] as the op has it: every row quantized per token in one launch, then the grouped
    # GEMM back in x's dtype
    xq, xs = fxq.triton_quantize_int8_per_token(x)
    return fxq.triton_int8_scaled_grouped_mm(xq, xs, weight, scale, offs, x.dtype)
