"""fp8 e4m3 grouped GEMM (mixture-of-experts, ``fp8-row``: FbgemmFp8Config's Llama 4 experts):
row s of the per-token e4m3 activation xq [S, K] (scale xs [S, 1]) times its expert's e4m3
W [E, N, K] with per-channel scales [E, N] → [S, N].

Where it sits: the CUDA lowering at the end of this file (collected by
``fxquant.passes.lower_cuda``) maps ``fxquant::float8_dynamic_grouped_mm`` (the op the rewrite
puts where an exported MoE layer had its grouped_mm, under ``fp8-row``) onto the per-token
quantizer of ``kernels.quantize`` (``fxquant::triton_quantize_fp8_per_token``: a row's scale
does not depend on its expert, so one launch quantizes every row) and
``fxquant::triton_float8_scaled_grouped_mm`` below. The oracle is
``fxquant.core.reference.float8_dynamic_grouped_mm``.

Rows and programs as in ``kernels.mxfp4_grouped``: x sorted by expert, ``offs`` [E] each
expert's cumulative row end, grid (E, cdiv(S, BLOCK_M), cdiv(N, BLOCK_N)); program (e, mb, nb)
takes its expert's rows from ``offs[e-1] + mb * BLOCK_M`` and exits at once when it has none, so
the offsets stay on the device and S stays dynamic. Numerics as ``kernels.float8_dynamic``'s:
e4m3 tiles multiplied by ``tl.dot`` with fp32 accumulation (every product is exact in fp32; on
sm90 Triton's default lets the tensor cores accumulate fp8 products at their own reduced
precision), then xs[s] · scale[e, n] applied once in fp32 in the epilogue, in the reference's
order, before one rounding to the output dtype. The op takes that dtype as ``out_dtype``: its
input is already e4m3, so x's dtype is not there to read (the lowering passes x's). One fixed
tile, not autotuned, as the other experts' kernels; not yet measured on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from fxquant.core.registry import lowering
from fxquant.kernels import quantize  # noqa: F401  (registers triton_quantize_fp8_per_token)
from fxquant.kernels.gemm import load_a, store_tile
from fxquant.kernels.mxfp4_grouped import check_row_scaled, expert_tile

fxq = torch.ops.fxquant
# BLOCK_K = 128 e4m3 values: 128 bytes a weight row per K step, what 64 bf16 values are to the
# weight-only experts' kernels (and fp8 wgmma's K of 32, four times).
_BLOCK_M, _BLOCK_N, _BLOCK_K = 32, 64, 128


@triton.jit
def _float8_grouped_kernel(
    x_ptr,  # [S, K] float8_e4m3fn: rows sorted by expert
    xs_ptr,  # [S, 1] fp32: each row's dequant scale
    w_ptr,  # [E, N, K] float8_e4m3fn
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
    w_cols = w_ptr + (e.to(tl.int64) * N + offs_n[None, :]) * K  # [1, BLOCK_N]: as [K, N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # ---- K loop: e4m3 · e4m3, fp32 sums -------------------------------------------------------
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a, mask_k = load_a(x_ptr, offs_m, mask_m, k, K)
        b = tl.load(w_cols + k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc = tl.dot(a, b, acc)
    # ---- epilogue: (x · Wᵀ) · xs · scale as the reference, one rounding to out_dtype ---------
    xs = tl.load(xs_ptr + offs_m, mask=mask_m, other=0.0)
    scale = tl.load(s_ptr + e.to(tl.int64) * N + offs_n, mask=mask_n, other=0.0)
    y = acc * xs[:, None] * scale[None, :]
    store_tile(out_ptr, y, out_ptr, offs_m, offs_n, end, N, 0, False, 1)


def _check(
    xq: Tensor, xs: Tensor, weight: Tensor, scale: Tensor, offs: Tensor, out_dtype: torch.dtype
) -> None:
    check_row_scaled("fp8 scaled grouped mm", torch.float8_e4m3fn, xq, xs, weight, scale, offs,
                     out_dtype)  # fmt: skip


@triton_op("fxquant::triton_float8_scaled_grouped_mm", mutates_args=())
def triton_float8_scaled_grouped_mm(
    xq: Tensor, xs: Tensor, weight: Tensor, scale: Tensor, offs: Tensor, out_dtype: torch.dtype
) -> Tensor:
    """xq e4m3 [S, K] (rows sorted by expert) with per-row scales xs fp32 [S, 1] · its expert's
    e4m3 W [E, N, K] with per-channel scales fp32 [E, N], experts from cumulative row ends
    ``offs`` [E] (int32 or int64, non-decreasing: not checked, that would need a host sync) →
    (xq · Wᵀ) · xs · scale, [S, N] in ``out_dtype``, zeros for rows at or past ``offs[-1]``."""
    _check(xq, xs, weight, scale, offs, out_dtype)
    xq, xs, weight = xq.contiguous(), xs.contiguous(), weight.contiguous()
    scale, offs = scale.contiguous(), offs.contiguous()
    s, k = xq.shape
    e, n = weight.shape[0], weight.shape[1]
    out = torch.zeros((s, n), dtype=out_dtype, device=xq.device)
    grid = (e, triton.cdiv(s, _BLOCK_M), triton.cdiv(n, _BLOCK_N))
    wrap_triton(_float8_grouped_kernel)[grid](
        xq, xs, weight, scale, offs, out, s, n, k,
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )  # fmt: skip
    return out


@lowering("cuda", "float8_dynamic_grouped_mm")
def lower_float8_dynamic_grouped_mm(x, weight, scale, offs, activation_scale_ub):
    # x [S, K] as the op has it: every row quantized per token in one launch, then the grouped
    # GEMM back in x's dtype
    xq, xs = fxq.triton_quantize_fp8_per_token(x, activation_scale_ub)
    return fxq.triton_float8_scaled_grouped_mm(xq, xs, weight, scale, offs, x.dtype)
