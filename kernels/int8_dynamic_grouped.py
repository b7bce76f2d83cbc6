"""int8 / fp8 grouped GEMM with per-row scales (mixture-of-experts, ``w8a8`` and ``fp8-row``
experts): row s of the per-token quantized activation xq [S, K] (scale xs [S, 1]) times its
expert's W [E, N, K] of the same dtype (int8, or e4m3) with per-channel scales [E, N] → [S, N].

Where it sits: the CUDA lowering at the end of this file (collected by
``fxquant.passes.lower_cuda``) maps ``fxquant::int8_dynamic_grouped_mm`` (the op the rewrite
puts where an exported MoE layer had its grouped_mm, under W8A8) onto the per-token quantizer of
``kernels.quantize`` (``fxquant::triton_quantize_int8_per_token``: a row's scale does not depend
on its expert, so one launch quantizes every row) and ``fxquant::triton_int8_scaled_grouped_mm``
below; ``kernels.float8_dynamic_grouped`` does the same for e4m3 with ``scaled_grouped_mm``'s
``INT8=False``, as ``kernels.float8_dynamic`` shares ``kernels.int8_dynamic``'s dense GEMM. The
oracles are ``fxquant.core.reference.int8_dynamic_grouped_mm`` / ``float8_dynamic_grouped_mm``.

Rows, programs and launch as every grouped kernel's (``kernels.grouped``). Numerics as the dense
kernel's, whose K step it runs (``int8_dynamic.scaled_dot_step``): int8 tiles multiplied by
``tl.dot`` into an int32 accumulator (exact: no rounding until the epilogue; |sum| ≤ K · 127²,
so K up to 133,000 cannot overflow), e4m3 tiles into an fp32 one (every product is exact in
fp32; on sm90 Triton's default lets the tensor cores accumulate fp8 products at their own
reduced precision); then xs[s] · scale[e, n] applied in fp32 in the reference's order, before
one rounding to the output dtype. The reference sums the same int8 integers in fp32, exactly
while |sum| < 2**24, so for int8 the two differ by nothing but the epilogue's fp32 roundings.
The ops take the output dtype as ``out_dtype``: their input is already quantized, so x's dtype
is not there to read (the lowerings pass x's). One fixed tile, not autotuned, as the other
experts' kernels; not yet measured on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

from fxquant.core.registry import lowering
from fxquant.kernels import quantize  # noqa: F401  (registers triton_quantize_int8_per_token)
from fxquant.kernels.gemm import store_tile
from fxquant.kernels.grouped import check_row_scaled, expert_tile, launch_grouped
from fxquant.kernels.int8_dynamic import scaled_dot_step

fxq = torch.ops.fxquant
# BLOCK_K = 128 one-byte values: 128 bytes a weight row per K step, what 64 bf16 values are to
# the weight-only experts' kernels (and int8 mma's or fp8 wgmma's K of 32, four times).
_BLOCK_M, _BLOCK_N, _BLOCK_K = 32, 64, 128


@triton.jit
def _scaled_grouped_kernel(
    x_ptr,  # [S, K] int8 or float8_e4m3fn: rows sorted by expert
    xs_ptr,  # [S, 1] fp32: each row's dequant scale
    w_ptr,  # [E, N, K] x's dtype
    s_ptr,  # [E, N] fp32: per-channel dequant scales
    offs_ptr,  # [E] int32/int64: cumulative row end of each expert
    out_ptr,  # [S, N] out_dtype, zeroed: rows no program writes stay 0
    S,
    N,
    K,
    INT8: tl.constexpr,  # int8 operands (int32 sums), else e4m3 (fp32 sums)
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
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32 if INT8 else tl.float32)
    # ---- K loop: int8 · int8 → int32 (exact), or e4m3 · e4m3 → fp32 --------------------------
    for k0 in range(0, K, BLOCK_K):
        acc = scaled_dot_step(acc, x_rows, w_cols, k0 + offs_k, K, mask_m, mask_n, INT8)
    # ---- epilogue: (xq · Wᵀ) · xs · scale as the reference, one rounding to out_dtype --------
    xs = tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)
    scale = tl.load(s_ptr + e.to(tl.int64) * N + offs_n, mask=mask_n, other=0.0)
    y = acc.to(tl.float32) * xs[:, None] * scale[None, :]
    store_tile(out_ptr, y, out_ptr, offs_m, offs_n, end, N, 0, False, 1)


def scaled_grouped_mm(
    xq: Tensor,
    xs: Tensor,
    weight: Tensor,
    scale: Tensor,
    offs: Tensor,
    out_dtype: torch.dtype,
    *,
    operand_dtype: torch.dtype,
) -> Tensor:
    """xq [S, K] (rows sorted by expert) with per-row scales xs fp32 [S, 1] · its expert's W
    [E, N, K] with per-channel scales fp32 [E, N], both ``operand_dtype`` (int8 or e4m3),
    experts from cumulative row ends ``offs`` [E] (int32 or int64, non-decreasing: not checked,
    that would need a host sync) → (xq · Wᵀ) · xs · scale, [S, N] in ``out_dtype``, zeros for
    rows at or past ``offs[-1]``."""
    name = "int8" if operand_dtype == torch.int8 else "fp8"
    what = f"{name} scaled grouped mm"
    check_row_scaled(what, operand_dtype, xq, xs, weight, scale, offs, out_dtype)
    return launch_grouped(
        _scaled_grouped_kernel, (xq, xs, weight, scale, offs), weight, out_dtype,
        INT8=operand_dtype == torch.int8, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )  # fmt: skip


@triton_op("fxquant::triton_int8_scaled_grouped_mm", mutates_args=())
def triton_int8_scaled_grouped_mm(
    xq: Tensor, xs: Tensor, weight: Tensor, scale: Tensor, offs: Tensor, out_dtype: torch.dtype
) -> Tensor:
    """``scaled_grouped_mm`` on int8 xq [S, K] and W [E, N, K]."""
    return scaled_grouped_mm(xq, xs, weight, scale, offs, out_dtype, operand_dtype=torch.int8)


@lowering("cuda", "int8_dynamic_grouped_mm")
def lower_int8_dynamic_grouped_mm(x, weight, scale, offs):
    # x [S, K] as the op has it: every row quantized per token in one launch, then the grouped
    # GEMM back in x's dtype
    xq, xs = fxq.triton_quantize_int8_per_token(x)
    return fxq.triton_int8_scaled_grouped_mm(xq, xs, weight, scale, offs, x.dtype)
