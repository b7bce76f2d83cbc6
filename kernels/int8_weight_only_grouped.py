"""int8 weight-only grouped GEMM (mixture-of-experts): row s of x [S, K] times its expert's int8
W [E, N, K], scaled per output channel by scale [E, N] → [S, N].

Where it sits: the CUDA lowerings at the end of this file (collected by
``fxquant.passes.lower_cuda``) map ``fxquant::int8_weight_only_grouped_mm`` (the op the rewrite
puts where an exported MoE layer had its grouped_mm, under ``int8wo``) onto
``fxquant::triton_int8_weight_only_grouped_mm`` below, and ``float8_weight_only_grouped_mm``
(``fp8wo``: e4m3 [E, N, K], the same kernel) onto ``triton_float8_weight_only_grouped_mm``. The
oracles are ``fxquant.core.reference.int8_weight_only_grouped_mm`` / ``float8_...``.

Rows and programs as in ``kernels.grouped``: x sorted by expert, ``offs`` [E] each
expert's cumulative row end, grid (E, cdiv(S, BLOCK_M), cdiv(N, BLOCK_N)); program (e, mb, nb)
takes its expert's rows from ``offs[e-1] + mb * BLOCK_M`` and exits at once when it has none, so
the offsets stay on the device and S stays dynamic. Numerics as ``kernels.int8_weight_only``'s:
the weight tile converted to x's dtype (exact), products summed in fp32, the scale applied once
in the epilogue before one rounding to x's dtype. One fixed tile, not autotuned, as the MXFP4
experts' kernel; not yet measured on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

from fxquant.core.registry import lowering
from fxquant.kernels.gemm import as_operand, dot_f32, load_a, store_tile
from fxquant.kernels.grouped import check_offsets, expert_tile, launch_grouped

_BLOCK_M, _BLOCK_N, _BLOCK_K = 32, 64, 64
_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _int8_grouped_kernel(
    x_ptr,  # [S, K] float: rows sorted by expert
    w_ptr,  # [E, N, K] int8
    s_ptr,  # [E, N] fp32: per-channel dequant multipliers
    offs_ptr,  # [E] int32/int64: cumulative row end of each expert
    out_ptr,  # [S, N] x's dtype, zeroed: rows no program writes stay 0
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
    # ---- K loop: the weight tile exact in x's dtype, fp32 sums --------------------------------
    for k0 in range(0, K, BLOCK_K):
        k = k0 + offs_k
        a, mask_k = load_a(x_ptr, offs_m, mask_m, k, K)
        b = tl.load(w_cols + k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        acc += dot_f32(a, as_operand(b, a.dtype))
    # ---- epilogue: the expert's channel scales, one rounding to x's dtype ---------------------
    scale = tl.load(s_ptr + e.to(tl.int64) * N + offs_n, mask=mask_n, other=0.0)
    store_tile(out_ptr, acc * scale[None, :], out_ptr, offs_m, offs_n, end, N, 0, False, 1)


def _check(
    x: Tensor, weight: Tensor, scale: Tensor, offs: Tensor, dtype: torch.dtype = torch.int8
) -> None:
    """ValueError naming the value and what is allowed, for each layout the kernel cannot read
    (``dtype``: the weight's, int8 or float8_e4m3fn)."""
    name = str(dtype).removeprefix("torch.")
    what = f"{'int8' if dtype == torch.int8 else 'fp8'} weight-only grouped mm"
    if x.dim() != 2 or x.dtype not in _X_DTYPES:
        raise ValueError(
            f"{what}: x must be 2-D [S, K] float32/bfloat16/float16; got {x.dtype} {tuple(x.shape)}"
        )
    if weight.dtype != dtype or weight.dim() != 3:
        raise ValueError(
            f"{what}: weight must be {name} [E, N, K]; got {weight.dtype} {tuple(weight.shape)}"
        )
    e, n, k = weight.shape
    if x.shape[1] != k:
        raise ValueError(f"{what}: x has K={x.shape[1]} features, the weight [E, N, K] K={k}")
    if scale.dtype != torch.float32 or tuple(scale.shape) != (e, n):
        raise ValueError(
            f"{what}: scale must be fp32 [E, N] = {[e, n]}; got {scale.dtype} {tuple(scale.shape)}"
        )
    check_offsets(what, x, weight, scale, offs)


@triton_op("fxquant::triton_int8_weight_only_grouped_mm", mutates_args=())
def triton_int8_weight_only_grouped_mm(
    x: Tensor, weight: Tensor, scale: Tensor, offs: Tensor
) -> Tensor:
    """x [S, K] float (rows sorted by expert) · its expert's int8 W [E, N, K] with fp32 scales
    [E, N], experts from cumulative row ends ``offs`` [E] (int32 or int64, non-decreasing: not
    checked, that would need a host sync) → [S, N] in x's dtype, zeros for rows at or past
    ``offs[-1]``."""
    _check(x, weight, scale, offs)
    return _launch(x, weight, scale, offs)


def _launch(x: Tensor, weight: Tensor, scale: Tensor, offs: Tensor) -> Tensor:
    return launch_grouped(
        _int8_grouped_kernel, (x, weight, scale, offs), weight, x.dtype,
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )  # fmt: skip


@triton_op("fxquant::triton_float8_weight_only_grouped_mm", mutates_args=())
def triton_float8_weight_only_grouped_mm(
    x: Tensor, weight: Tensor, scale: Tensor, offs: Tensor
) -> Tensor:
    """``triton_int8_weight_only_grouped_mm`` on e4m3 weights [E, N, K] (``fp8wo``'s experts):
    the same kernel, the weight tile converted to x's dtype as exactly."""
    _check(x, weight, scale, offs, torch.float8_e4m3fn)
    return _launch(x, weight, scale, offs)


@lowering("cuda", "int8_weight_only_grouped_mm")
def lower_int8_weight_only_grouped_mm(x, weight, scale, offs):
    # the kernel takes the op as it is (x [S, K] sorted by expert) and returns x's dtype
    return torch.ops.fxquant.triton_int8_weight_only_grouped_mm(x, weight, scale, offs)


@lowering("cuda", "float8_weight_only_grouped_mm")
def lower_float8_weight_only_grouped_mm(x, weight, scale, offs):
    return torch.ops.fxquant.triton_float8_weight_only_grouped_mm(x, weight, scale, offs)
