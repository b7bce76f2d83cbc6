"""Weight-only GEMM on int2 / int3 / int6 / float-zero int4 grouped weights (``IntxWeightOnly``).

Where it sits: ``fxquant.passes.lower`` (device="cuda") replaces
``fxquant::intx_weight_only_linear`` by ``fxquant::triton_intx_weight_only_linear`` below (same
arguments, then ``decode``); Inductor sees the kernel through ``wrap_triton`` and AOTInductor
embeds it.

Layout (``fxquant.core.reference_lowbit``): codes u packed along K into uint8 [N, Kp*b/8] (b = 2:
four a byte, low bits first; b = 3: eight in a 3-byte little-endian word; b = 4: two a byte, low
nibble first; b = 6: four in a 3-byte little-endian word); ``scale`` fp32 and ``zero`` (uint8 or
fp32) [N, Kp/g]; w = (u - z) * s.

Numerics: each K step lies inside one group (the step is min(BLOCK_K, g), both powers of two),
so a step has one (s, z) per output column and
    Σ_k x_k (u_k - z) s = s · (Σ_k x_k u_k - z · Σ_k x_k).
Groups of 16 (6-bit, GGUF Q6_K) make 16-wide steps: still a valid ``tl.dot`` K (its minimum),
at more loop trips per tile. The codes u (< 64) are exact in x's dtype (bf16 holds integers to
256), the dot accumulates in fp32 and the row sums of x are taken in fp32, so a float zero point
never has to be rounded to x's dtype (which (u - z) as a dot operand would need). Decode
(M ≤ 16, split-K) and prefill share the kernel, as in ``int4_weight_only``, whose tiling and
epilogue helpers (from ``int8_weight_only``) it uses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

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

BITS = (2, 3, 4, 6)
# 16 works for every width here; IntxWeightOnly allows it only with bits=6, because the
# CPU int4 kernel that int2/3/4 lower to takes groups of 32 to 256
GROUP_SIZES = (16, 32, 64, 128, 256)


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _codes(w_ptr, n, k, mask, ROW_BYTES, BITS: tl.constexpr):
    """Codes (int32) of W at rows n and columns k, broadcast against each other."""
    row = w_ptr + n * ROW_BYTES
    if BITS == 3 or BITS == 6:
        # column PER·i + j (PER = 24 / BITS codes a word): bits BITS·j.. of the 24-bit word in
        # bytes 3i..3i+2; they start in byte (BITS·j) // 8 and may run into the next one (3 bits:
        # j = 2, 5; 6 bits: j = 1, 2), never past the word's last byte (hence the mask)
        PER_WORD: tl.constexpr = 24 // BITS
        bit = (k % PER_WORD) * BITS
        byte = (k // PER_WORD) * 3 + bit // 8
        lo = tl.load(row + byte, mask=mask, other=0).to(tl.int32)
        hi = tl.load(row + byte + 1, mask=mask & (bit // 8 < 2), other=0).to(tl.int32)
        return ((lo | (hi << 8)) >> (bit % 8)) & ((1 << BITS) - 1)
    else:
        PER_BYTE: tl.constexpr = 8 // BITS
        packed = tl.load(row + k // PER_BYTE, mask=mask, other=0).to(tl.int32)
        return (packed >> ((k % PER_BYTE) * BITS)) & ((1 << BITS) - 1)


@triton.jit
def _intx_gemm_kernel(
    x_ptr,  # [M, K] bf16 / fp16 / fp32, row-major
    w_ptr,  # [N, Kp*BITS/8] uint8 codes packed along K
    scale_ptr,  # [N, Kp/g] fp32
    zero_ptr,  # [N, Kp/g] uint8 or fp32
    bias_ptr,  # [N] float; any valid pointer when HAS_BIAS is False (never read)
    y_ptr,  # [M, N] x's dtype, or fp32 zeros (decode)
    M,
    N,
    K,
    GROUPS,  # Kp / g: the row stride of scale and zero
    BITS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP_SIZE: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    STEP_K: tl.constexpr = BLOCK_K if BLOCK_K < GROUP_SIZE else GROUP_SIZE
    pid_m, pid_n = tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, STEP_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    row_bytes = GROUPS * GROUP_SIZE * BITS // 8

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
        u = _codes(
            w_ptr, offs_n[None, :], k[:, None], mask_k[:, None] & mask_n[None, :], row_bytes, BITS
        )
        group = offs_n * GROUPS + k0 // GROUP_SIZE
        s = tl.load(scale_ptr + group, mask=mask_n, other=0.0)
        z = tl.load(zero_ptr + group, mask=mask_n, other=0).to(tl.float32)
        # s · (x·u - z · Σx): u is exact in x's dtype, z and Σx stay fp32 (module docstring)
        xu = dot_f32(a, as_operand(u, a.dtype))
        x_sum = tl.sum(a.to(tl.float32), axis=1)
        acc += (xu - x_sum[:, None] * z[None, :]) * s[None, :]

    store_tile(y_ptr, acc, bias_ptr, offs_m, offs_n, M, N, pid_k, HAS_BIAS, SPLIT_K)


_decode_kernel = triton.autotune(
    configs=configs.decode_configs(),
    key=["N", "K", "BITS", "GROUP_SIZE"],
    reset_to_zero=["y_ptr"],
)(_intx_gemm_kernel)
_prefill_kernel = triton.autotune(
    configs=configs.prefill_configs(), key=["M", "N", "K", "BITS", "GROUP_SIZE"]
)(_intx_gemm_kernel)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def _check(weight: Tensor, scale: Tensor, zero: Tensor, bits: int, group_size: int, k: int):
    if bits not in BITS:
        raise ValueError(f"bits={bits} is not supported; allowed: {BITS}")
    if group_size not in GROUP_SIZES:
        raise ValueError(f"group_size={group_size} is not supported; allowed: {GROUP_SIZES}")
    if (
        weight.dtype != torch.uint8
        or scale.dtype != torch.float32
        or zero.dtype not in (torch.uint8, torch.float32)
    ):
        raise ValueError(
            f"expected weight uint8, scale fp32, zero uint8 or fp32; got {weight.dtype}, "
            f"{scale.dtype}, {zero.dtype}"
        )
    n, kp = weight.shape[0], weight.shape[1] * 8 // bits
    if (
        weight.shape[1] * 8 % bits
        or kp % group_size
        or tuple(scale.shape) != (n, kp // group_size)
        or zero.shape != scale.shape
    ):
        raise ValueError(
            f"packed {bits}-bit weight {tuple(weight.shape)} needs [N, Kp*{bits}/8] with Kp a "
            f"multiple of group_size={group_size} and scale, zero [N, Kp/g]; got scale "
            f"{tuple(scale.shape)}, zero {tuple(zero.shape)}"
        )
    if k > kp:
        raise ValueError(f"{k} input features, but the packed weight holds Kp={kp}")


def intx_linear(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    zero: Tensor,
    bias: Tensor | None,
    *,
    bits: int,
    group_size: int,
    decode: bool | None = None,
) -> Tensor:
    """x [..., K] · packed W → [..., N] in x's dtype. ``decode`` forces the decode (True) or
    prefill (False) kernel; None picks from M."""
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x dtype is {x.dtype}; allowed: bfloat16, float16, float32")
    k = x.shape[-1]
    _check(weight, scale, zero, bits, group_size, k)
    n = weight.shape[0]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
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
        BITS=bits,
        HAS_BIAS=bias is not None,
        GROUP_SIZE=group_size,
        GROUP_M=GROUP_M,
        **split,
    )
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


# --------------------------------------------------------------------------------------------
# Op
# --------------------------------------------------------------------------------------------


@torch.library.triton_op("fxquant::triton_intx_weight_only_linear", mutates_args=())
def triton_intx_weight_only_linear(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    zero: Tensor,
    bias: Tensor | None,
    bits: int,
    group_size: int,
    decode: bool | None = None,
) -> Tensor:
    """CUDA lowering of ``fxquant::intx_weight_only_linear`` (same arguments, then ``decode``)."""
    return intx_linear(
        x, weight, scale, zero, bias, bits=bits, group_size=group_size, decode=decode
    )
