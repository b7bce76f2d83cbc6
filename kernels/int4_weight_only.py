"""Weight-only int4 GEMM with grouped scales and integer zero points, and the int4 → float
dequantizer.

Where it sits: ``fxquant.passes.lower`` (device="cuda") replaces
``fxquant::int4_weight_only_linear`` by ``fxquant::triton_int4_weight_only_linear`` below
(same arguments), and ``fxquant::int8_dynamic_int4_linear`` (W4A8) by the per-token int8
quantizer of ``kernels.quantize`` and the same op; Inductor sees the kernels through
``wrap_triton`` and AOTInductor embeds them.

Layout (``fxquant.core.reference.quantize_int4_grouped``): the weight is packed uint8 [N, Kp/2],
two nibbles per byte along K with the low nibble the even column; ``scale`` fp32 and ``zero``
uint8 are [N, Kp/g]; w = (u - z) * s. That is ``intx_weight_only``'s 4-bit layout, and the GEMM
is its kernel at BITS = 4 with ``INT_ZERO`` (its numerics: (u - z) in [-15, 15] is exact in x's
dtype, each K step's dot accumulates in fp32 and is then multiplied by s, so the weight keeps
its full fp32 precision; dequantizing first would round w to x's dtype).

Paths, picked by the launcher from M: decode and prefill as in ``gemm``; on a GPU the prefill
dequantizes W once with the kernel below and calls the dense GEMM (``gemm.library_prefill``:
on an H200 at M = 2048 the fused prefill kernel ran 6.5x slower than bf16 F.linear).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

import fxquant.kernels.quantize  # noqa: F401  (registers W4A8's activation quantizer)
from fxquant.core.registry import lowering
from fxquant.kernels import gemm, intx_weight_only
from fxquant.kernels.intx_weight_only import unpack_nibbles

fxq = torch.ops.fxquant

GROUP_SIZES = (32, 64, 128, 256)
_DEQUANT_BLOCK_N = 32
_DEQUANT_BLOCK_K = 128


# --------------------------------------------------------------------------------------------
# Kernel (the GEMM's is intx_weight_only's)
# --------------------------------------------------------------------------------------------


@triton.jit
def _dequantize_kernel(
    w_ptr,  # [N, Kp/2] uint8
    scale_ptr,  # [N, Kp/g] fp32
    zero_ptr,  # [N, Kp/g] uint8
    out_ptr,  # [N, K] output dtype, row-major
    N,
    K,
    GROUPS,
    GROUP_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    k0 = tl.program_id(1) * BLOCK_K
    u = unpack_nibbles(w_ptr, offs_n, offs_n < N, k0, GROUPS * GROUP_SIZE // 2, BLOCK_K, BLOCK_N)
    n = offs_n[:, None]
    k = (k0 + tl.arange(0, BLOCK_K))[None, :]
    mask = (n < N) & (k < K)
    group = n * GROUPS + k // GROUP_SIZE
    s = tl.load(scale_ptr + group, mask=mask, other=0.0)
    z = tl.load(zero_ptr + group, mask=mask, other=0).to(tl.int32)
    w = (u - z).to(tl.float32) * s
    tl.store(out_ptr + n * K + k, w.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _check(weight: Tensor, scale: Tensor, zero: Tensor, group_size: int, k: int) -> None:
    """int4's own limits (groups of 32 to 256, uint8 zero points), then the 4-bit layout's."""
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size={group_size} is not supported; allowed: {GROUP_SIZES}")
    if zero.dtype != torch.uint8:
        raise ValueError(f"expected zero uint8 (integer zero points); got {zero.dtype}")
    intx_weight_only.check(weight, scale, zero, 4, group_size, k)


def dequantize(
    weight: Tensor, scale: Tensor, zero: Tensor, group_size: int, k: int, dtype: torch.dtype
) -> Tensor:
    """Packed int4 W [N, Kp/2] → [N, k] in ``dtype`` (the first k of the Kp columns): the dense
    path's first half."""
    _check(weight, scale, zero, group_size, k)
    n = weight.shape[0]
    out = torch.empty((n, k), device=weight.device, dtype=dtype)
    grid = (triton.cdiv(n, _DEQUANT_BLOCK_N), triton.cdiv(k, _DEQUANT_BLOCK_K))
    torch.library.wrap_triton(_dequantize_kernel)[grid](
        weight.contiguous(),
        scale.contiguous(),
        zero.contiguous(),
        out,
        n,
        k,
        scale.shape[1],
        GROUP_SIZE=group_size,
        BLOCK_N=_DEQUANT_BLOCK_N,
        BLOCK_K=_DEQUANT_BLOCK_K,
    )
    return out


def int4_linear(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    zero: Tensor,
    bias: Tensor | None,
    group_size: int,
    decode: bool | None = None,
) -> Tensor:
    """x [..., K] · packed int4 W [N, Kp/2] → [..., N] in x's dtype (fused, or dequant + mm):
    the CUDA lowering of ``fxquant::int4_weight_only_linear`` (same arguments, then ``decode``:
    force the fused decode (True) or prefill (False) kernel; None picks from M)."""
    gemm.check_activation(x)
    k = x.shape[-1]
    _check(weight, scale, zero, group_size, k)
    x2 = x.reshape(-1, k)
    if gemm.library_prefill(x2, x2.shape[0], decode):
        w = dequantize(weight, scale, zero, group_size, k, x.dtype)
        return gemm.dense_linear(x2, w, bias).reshape(*x.shape[:-1], weight.shape[0])
    return intx_weight_only.launch(
        x, weight, scale, zero, bias, bits=4, group_size=group_size, int_zero=True, decode=decode
    )


# --------------------------------------------------------------------------------------------
# Ops and lowerings
# --------------------------------------------------------------------------------------------

# The launcher is the op's body: its signature is the op's schema.
triton_int4_weight_only_linear = torch.library.triton_op(
    "fxquant::triton_int4_weight_only_linear", int4_linear, mutates_args=()
)
triton_int4_dequantize = torch.library.triton_op(
    "fxquant::triton_int4_dequantize", dequantize, mutates_args=()
)


@lowering("cuda", "int4_weight_only_linear")
def lower_int4_weight_only_linear(x, weight, scale, zero, bias, group_size):
    return gemm.linear(
        fxq.triton_int4_weight_only_linear.default, x, weight, scale, zero, bias, group_size
    )


@lowering("cuda", "int8_dynamic_int4_linear")
def lower_int8_dynamic_int4_linear(x, weight, scale, zero, bias, group_size):
    # W4A8: the per-token int8 grid from the quantize kernel, then int4 weight-only's GEMM on
    # the dequantized activation (exact in fp32: the reference's numerics)
    xq, xs = fxq.triton_quantize_int8_per_token(gemm.rows(x))
    xd = xq.float() * xs.reshape(-1, 1)
    y = lower_int4_weight_only_linear(xd, weight, scale, zero, bias, group_size)
    return y.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)
