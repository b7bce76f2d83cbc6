"""Weight-only int4 GEMM with grouped scales and zero points, and the int4 → float dequantizer.

Where it sits: ``fxquant.passes.lower`` (device="cuda") replaces
``fxquant::int4_weight_only_linear`` by ``fxquant::triton_int4_weight_only_linear`` below
(same arguments); Inductor sees the kernels through ``wrap_triton`` and AOTInductor embeds them.

Layout (``fxquant.core.reference.quantize_int4_grouped``): the weight is packed uint8 [N, Kp/2], two
nibbles per byte along K with the low nibble the even column; ``scale`` fp32 and ``zero`` uint8
are [N, Kp/g]; w = (u - z) * s. Kp is K rounded up to the group size g, and x has K ≤ Kp
columns (the padded columns dequantize to zero; the kernel masks them anyway).

Numerics: the K loop steps by at most one group, so each step has one (s, z) per output column.
(u - z) is an integer in [-15, 15], exact in x's dtype; the step's dot accumulates in fp32 and is
then multiplied by s, which is the reference's fp32 dequantization with the multiply factored
out of the group's sum, and keeps the weight's full fp32 precision (dequantizing first would
round w to x's dtype).

Three paths, picked by the launcher from M: decode and prefill exactly as in
``int8_weight_only`` (whose tiling and epilogue helpers this kernel uses), and, from
``INT4_DENSE_MIN_M`` rows on, dequantize once and call the dense GEMM, which wins when M is
large enough to pay for writing W out.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxquant.kernels import configs
from fxquant.kernels.int8_weight_only import (
    GROUP_M,
    as_operand,
    dot_f32,
    gemm_grid,
    output_buffer,
    store_tile,
    tile_coords,
)

# M at or above which the linear dequantizes W and calls torch.mm instead of the fused kernel.
# 10**9 means never: benchmarks/gpu measures the crossover on the GPU, and it is set from that.
INT4_DENSE_MIN_M = 10**9
GROUP_SIZES = (32, 64, 128, 256)
_DEQUANT_BLOCK_N = 32
_DEQUANT_BLOCK_K = 128


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _unpack(w_ptr, n, k, mask, K_BYTES):
    """Nibbles of W (int32 in [0, 15]) at rows n and columns k, broadcast against each other
    (shape the tile by passing n and k as a row and a column)."""
    packed = tl.load(w_ptr + n * K_BYTES + k // 2, mask=mask, other=0)
    return (packed.to(tl.int32) >> ((k % 2) * 4)) & 0xF


@triton.jit
def _int4_gemm_kernel(
    x_ptr,  # [M, K] bf16 / fp16 / fp32, row-major
    w_ptr,  # [N, Kp/2] uint8, two nibbles per byte along K (low nibble = even column)
    scale_ptr,  # [N, Kp/g] fp32
    zero_ptr,  # [N, Kp/g] uint8
    bias_ptr,  # [N] float; any valid pointer when HAS_BIAS is False (never read)
    y_ptr,  # [M, N] x's dtype, or fp32 zeros (decode)
    M,
    N,
    K,
    GROUPS,  # Kp / g: the row stride of scale and zero
    HAS_BIAS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    # A K step never crosses a group: both are powers of two, so the smaller divides the larger.
    STEP_K: tl.constexpr = BLOCK_K if BLOCK_K < GROUP_SIZE else GROUP_SIZE
    pid_m, pid_n = tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, STEP_K)
    mask_m = offs_m < M
    mask_n = offs_n < N

    # ---- K loop: this program takes K steps pid_k, pid_k + SPLIT_K, ...
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * STEP_K, K, STEP_K * SPLIT_K):
        k = k0 + offs_k
        mask_k = k < K
        a = tl.load(
            x_ptr + offs_m[:, None] * K + k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
        u = _unpack(
            w_ptr,
            offs_n[None, :],
            k[:, None],
            mask_k[:, None] & mask_n[None, :],
            GROUPS * GROUP_SIZE // 2,
        )
        group = offs_n * GROUPS + k0 // GROUP_SIZE
        s = tl.load(scale_ptr + group, mask=mask_n, other=0.0)
        z = tl.load(zero_ptr + group, mask=mask_n, other=0).to(tl.int32)
        # (u - z) in [-15, 15] is exact in x's dtype; s multiplies the step's fp32 sum.
        acc += dot_f32(a, as_operand(u - z[None, :], a.dtype)) * s[None, :]

    store_tile(y_ptr, acc, bias_ptr, offs_m, offs_n, M, N, pid_k, HAS_BIAS, SPLIT_K)


_decode_kernel = triton.autotune(
    configs=configs.decode_configs(), key=["N", "K", "GROUP_SIZE"], reset_to_zero=["y_ptr"]
)(_int4_gemm_kernel)
_prefill_kernel = triton.autotune(
    configs=configs.prefill_configs(), key=["M", "N", "K", "GROUP_SIZE"]
)(_int4_gemm_kernel)


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
    n = (tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N))[:, None]
    k = (tl.program_id(1) * BLOCK_K + tl.arange(0, BLOCK_K))[None, :]
    mask = (n < N) & (k < K)
    u = _unpack(w_ptr, n, k, mask, GROUPS * GROUP_SIZE // 2)
    group = n * GROUPS + k // GROUP_SIZE
    s = tl.load(scale_ptr + group, mask=mask, other=0.0)
    z = tl.load(zero_ptr + group, mask=mask, other=0).to(tl.int32)
    w = (u - z).to(tl.float32) * s
    tl.store(out_ptr + n * K + k, w.to(out_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _check(weight: Tensor, scale: Tensor, zero: Tensor, group_size: int, k: int) -> None:
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size={group_size} is not supported; allowed: {GROUP_SIZES}")
    if weight.dtype != torch.uint8 or scale.dtype != torch.float32 or zero.dtype != torch.uint8:
        raise ValueError(
            f"expected weight uint8, scale fp32, zero uint8; got {weight.dtype}, {scale.dtype}, "
            f"{zero.dtype}"
        )
    n, kp = weight.shape[0], 2 * weight.shape[1]
    if kp % group_size or tuple(scale.shape) != (n, kp // group_size) or zero.shape != scale.shape:
        raise ValueError(
            f"packed weight [N={n}, Kp/2={kp // 2}] needs Kp a multiple of group_size="
            f"{group_size} and scale, zero [N, Kp/g]; got scale {tuple(scale.shape)}, zero "
            f"{tuple(zero.shape)}"
        )
    if k > kp:
        raise ValueError(f"{k} input features, but the packed weight holds Kp={kp}")


def dequantize(
    weight: Tensor, scale: Tensor, zero: Tensor, *, group_size: int, k: int, dtype: torch.dtype
) -> Tensor:
    """Packed int4 [N, Kp/2] → W [N, k] in ``dtype`` (the first k of the Kp columns)."""
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
    *,
    group_size: int,
    decode: bool | None = None,
) -> Tensor:
    """x [..., K] · packed int4 W [N, Kp/2] → [..., N] in x's dtype (fused, or dequant + mm).

    ``decode`` forces the fused decode (True) or prefill (False) kernel; None picks from M."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x dtype is {x.dtype}; allowed: bfloat16, float16, float32")
    k = x.shape[-1]
    _check(weight, scale, zero, group_size, k)
    n = weight.shape[0]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]

    # As in configs.is_decode: only an M known without a shape guard leaves the fused kernel.
    if decode is None and statically_known_true(m >= INT4_DENSE_MIN_M):
        w = dequantize(weight, scale, zero, group_size=group_size, k=k, dtype=x.dtype)
        b = None if bias is None else bias.to(x.dtype)
        return torch.nn.functional.linear(x2, w, b).reshape(*x.shape[:-1], n)

    decode = configs.is_decode(m, decode)
    y = output_buffer(m, n, x=x, decode=decode)
    kernel, split = (_decode_kernel, {}) if decode else (_prefill_kernel, {"SPLIT_K": 1})
    torch.library.wrap_triton(kernel)[gemm_grid(m, n)](
        x2,
        weight.contiguous(),
        scale.contiguous(),
        zero.contiguous(),
        scale if bias is None else bias.contiguous(),
        y,
        m,
        n,
        k,
        scale.shape[1],
        HAS_BIAS=bias is not None,
        GROUP_SIZE=group_size,
        GROUP_M=GROUP_M,
        **split,
    )
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


# --------------------------------------------------------------------------------------------
# Ops
# --------------------------------------------------------------------------------------------


@torch.library.triton_op("fxquant::triton_int4_weight_only_linear", mutates_args=())
def triton_int4_weight_only_linear(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    zero: Tensor,
    bias: Tensor | None,
    group_size: int,
    decode: bool | None = None,
) -> Tensor:
    """CUDA lowering of ``fxquant::int4_weight_only_linear`` (same arguments, then ``decode``:
    force the decode (True) or prefill (False) kernel; None picks from M)."""
    return int4_linear(x, weight, scale, zero, bias, group_size=group_size, decode=decode)


@torch.library.triton_op("fxquant::triton_int4_dequantize", mutates_args=())
def triton_int4_dequantize(
    weight: Tensor, scale: Tensor, zero: Tensor, group_size: int, k: int, dtype: torch.dtype
) -> Tensor:
    """Packed int4 W [N, Kp/2] → [N, k] in ``dtype``: the dense path's first half."""
    return dequantize(weight, scale, zero, group_size=group_size, k=k, dtype=dtype)
