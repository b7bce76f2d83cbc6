"""int4 grouped GEMM (mixture-of-experts): row s of x [S, K] times its expert's packed int4 W
[E, N, Kp/2] with scales and integer zero points [E, N, Kp/g] → [S, N]; weight-only and W4A8.

Where it sits: the CUDA lowerings at the end of this file (collected by
``fxquant.passes.lower_cuda``) map ``fxquant::int4_weight_only_grouped_mm`` (what the rewrite
puts where an exported MoE layer had its grouped_mm, under ``int4wo-<g>``) onto
``fxquant::triton_int4_weight_only_grouped_mm`` below, and ``int8_dynamic_int4_grouped_mm``
(``w4a8-<g>``) onto the per-token int8 quantizer of ``kernels.quantize`` and the same kernel, as
the W4A8 linear does. The oracles are ``fxquant.core.reference.int4_weight_only_grouped_mm`` and
``int8_dynamic_int4_grouped_mm``.

Rows and programs as in ``kernels.grouped`` (``expert_tile``: the offsets stay on the
device, S stays dynamic). Weight layout and numerics as ``kernels.int4_weight_only``'s: each K
step of 32 columns lies in one group, its codes minus the zero point (in [-15, 15], exact in
x's dtype) go into one fp32-accumulated dot, which is then multiplied by the group's scale; one
rounding to x's dtype at the end. One fixed tile, not autotuned; not yet measured on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

import fxquant.kernels.quantize  # noqa: F401  (registers W4A8's activation quantizer)
from fxquant.core.registry import lowering
from fxquant.kernels.gemm import as_operand, dot_f32, load_a, store_tile
from fxquant.kernels.grouped import check_offsets, expert_tile, launch_grouped
from fxquant.kernels.int4_weight_only import GROUP_SIZES
from fxquant.kernels.intx_weight_only import unpack_nibbles

_BLOCK_M, _BLOCK_N, _BLOCK_K = 32, 64, 32  # BLOCK_K divides every group size: one scale a step
_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _int4_grouped_kernel(
    x_ptr,  # [S, K] float: rows sorted by expert
    w_ptr,  # [E, N, Kp/2] uint8: two codes a byte along K, the even column in the low nibble
    s_ptr,  # [E, N, Kp/g] fp32
    z_ptr,  # [E, N, Kp/g] uint8: integer zero points
    offs_ptr,  # [E] int32/int64: cumulative row end of each expert
    out_ptr,  # [S, N] x's dtype, zeroed: rows no program writes stay 0
    S,
    N,
    K,
    GROUPS,  # Kp / g
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # ---- rows of this program: its expert's slice of x, from offs ----------------------------
    e, row0, end, offs_m, offs_n, mask_m, mask_n = expert_tile(offs_ptr, S, N, BLOCK_M, BLOCK_N)
    if row0 >= end:
        return
    offs_k = tl.arange(0, BLOCK_K)
    row_bytes = GROUPS * GROUP_SIZE // 2
    rows_n = e.to(tl.int64) * N + offs_n  # the expert's weight rows, as [E·N] rows
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # ---- K loop: (u - z) exact in x's dtype, fp32 dot, then the group's scale ----------------
    for k0 in range(0, K, BLOCK_K):
        a, _ = load_a(x_ptr, offs_m, mask_m, k0 + offs_k, K)  # columns past K read 0
        u = unpack_nibbles(w_ptr, rows_n, mask_n, k0, row_bytes, BLOCK_K, BLOCK_N)
        group = rows_n * GROUPS + k0 // GROUP_SIZE
        s = tl.load(s_ptr + group, mask=mask_n, other=0.0)
        z = tl.load(z_ptr + group, mask=mask_n, other=0).to(tl.int32)
        b = tl.trans(u - z[:, None])  # [BLOCK_K, BLOCK_N]
        acc += dot_f32(a, as_operand(b, a.dtype)) * s[None, :]
    # ---- epilogue: one rounding to x's dtype (rows up to the expert's end) -------------------
    store_tile(out_ptr, acc, out_ptr, offs_m, offs_n, end, N, 0, False, 1)


def _check(x: Tensor, weight: Tensor, scale: Tensor, zero: Tensor, offs: Tensor, g: int) -> None:
    """ValueError naming the value and what is allowed, for each layout the kernel cannot read."""
    what = "int4 grouped mm"
    if x.dim() != 2 or x.dtype not in _X_DTYPES:
        raise ValueError(
            f"{what}: x must be 2-D [S, K] float32/bfloat16/float16; got {x.dtype} {tuple(x.shape)}"
        )
    if g not in GROUP_SIZES:
        raise ValueError(f"{what}: group_size={g} is not supported; allowed: {GROUP_SIZES}")
    if weight.dtype != torch.uint8 or weight.dim() != 3:
        raise ValueError(
            f"{what}: weight must be packed uint8 [E, N, Kp/2]; "
            f"got {weight.dtype} {tuple(weight.shape)}"
        )
    e, n, half = weight.shape
    k = x.shape[1]
    if 2 * half % g or not 2 * half - g < k <= 2 * half:
        raise ValueError(
            f"{what}: weight shape {tuple(weight.shape)} does not pack K={k} in groups of {g}; "
            f"allowed: [E, N, {-(-k // g) * g // 2}]"
        )
    want = (e, n, 2 * half // g)
    for name, t, dtype in (("scale", scale, torch.float32), ("zero", zero, torch.uint8)):
        if t.dtype != dtype or tuple(t.shape) != want:
            raise ValueError(
                f"{what}: {name} must be {dtype} {list(want)} ([E, N, Kp/g]); "
                f"got {t.dtype} {tuple(t.shape)}"
            )
    check_offsets(what, x, weight, scale, offs)


@triton_op("fxquant::triton_int4_weight_only_grouped_mm", mutates_args=())
def triton_int4_weight_only_grouped_mm(
    x: Tensor, weight: Tensor, scale: Tensor, zero: Tensor, offs: Tensor, group_size: int
) -> Tensor:
    """x [S, K] float (rows sorted by expert) · its expert's packed int4 W [E, N, Kp/2] with
    fp32 scales and uint8 zero points [E, N, Kp/g], experts from cumulative row ends ``offs``
    [E] (int32 or int64, non-decreasing: not checked, that would need a host sync) → [S, N] in
    x's dtype, zeros for rows at or past ``offs[-1]``."""
    _check(x, weight, scale, zero, offs, group_size)
    return launch_grouped(
        _int4_grouped_kernel, (x, weight, scale, zero, offs), weight, x.dtype, scale.shape[2],
        GROUP_SIZE=group_size, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )  # fmt: skip


@lowering("cuda", "int4_weight_only_grouped_mm")
def lower_int4_weight_only_grouped_mm(x, weight, scale, zero, offs, group_size):
    # the kernel takes the op as it is (x [S, K] sorted by expert) and returns x's dtype
    fn = torch.ops.fxquant.triton_int4_weight_only_grouped_mm
    return fn(x, weight, scale, zero, offs, group_size)


@lowering("cuda", "int8_dynamic_int4_grouped_mm")
def lower_int8_dynamic_int4_grouped_mm(x, weight, scale, zero, offs, group_size):
    # W4A8: the per-token int8 grid (a row's does not depend on its expert), then the weight-only
    # kernel on the dequantized activation (exact in fp32: the reference's numerics)
    xq, xs = torch.ops.fxquant.triton_quantize_int8_per_token(x)
    xd = xq.float() * xs.reshape(-1, 1)
    y = lower_int4_weight_only_grouped_mm(xd, weight, scale, zero, offs, group_size)
    return y.to(x.dtype)
