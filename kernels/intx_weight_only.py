"""Weight-only GEMM on grouped low-bit weights: int2 / int3 / int6 / float-zero int4
(``IntxWeightOnly``), and int4 with integer zero points (``int4_weight_only``, the same kernel
at BITS = 4 with ``INT_ZERO``).

Where it sits: ``fxquant.passes.lower`` (device="cuda") replaces
``fxquant::intx_weight_only_linear`` by ``fxquant::triton_intx_weight_only_linear`` below (same
arguments, then ``decode``); Inductor sees the kernel through ``wrap_triton`` and AOTInductor
embeds it.

Layout (``fxquant.core.reference_lowbit``): codes u packed along K into uint8 [N, Kp*b/8] (b = 2:
four a byte, low bits first; b = 3: eight in a 3-byte little-endian word; b = 4: two a byte, low
nibble first; b = 6: four in a 3-byte little-endian word); ``scale`` fp32 and ``zero`` (uint8 or
fp32) [N, Kp/g]; w = (u - z) * s. Kp is K rounded up to the group size g, and x has K ≤ Kp
columns (the kernel masks the padding).

Numerics: each K step lies inside one group (the step is min(BLOCK_K, g), both powers of two),
so a step has one (s, z) per output column and
    Σ_k x_k (u_k - z) s = s · (Σ_k x_k u_k - z · Σ_k x_k).
Groups of 16 (6-bit, GGUF Q6_K) make 16-wide steps: still a valid ``tl.dot`` K (its minimum),
at more loop trips per tile. The codes u (< 64) are exact in x's dtype (bf16 holds integers to
256), the dot accumulates in fp32 and the row sums of x are taken in fp32, so a float zero point
never has to be rounded to x's dtype (which (u - z) as a dot operand would need). With
``INT_ZERO`` (int4's integer zero points) the step's dot takes (u - z) itself, an integer
exact in x's dtype, and s multiplies the step's fp32 sum: the reference's fp32 dequantization
with the multiply factored out of the group's sum. Decode (M ≤ 16, split-K) and prefill paths
as in ``gemm``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fxquant.core.registry import lowering
from fxquant.kernels import gemm
from fxquant.kernels.gemm import as_operand, dot_f32, load_a, program_tile, store_tile

BITS = (2, 3, 4, 6)
# 16 works for every width here; IntxWeightOnly allows it only with bits=6, because the
# CPU int4 kernel that int2/3/4 lower to takes groups of 32 to 256
GROUP_SIZES = (16, 32, 64, 128, 256)


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def unpack_codes(w_ptr, n, k, mask, ROW_BYTES, BITS: tl.constexpr):
    """Codes (int32) of W at rows n and columns k, broadcast against each other (shape the
    tile by passing n and k as a row and a column)."""
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
def unpack_nibbles(
    w_ptr, offs_n, mask_n, k0, ROW_BYTES, WIDTH: tl.constexpr, BLOCK_N: tl.constexpr
):
    """4-bit codes of W at rows ``offs_n`` and columns k0 .. k0 + WIDTH (k0 even) as a
    [BLOCK_N, WIDTH] int32 tile, bytes past the packed row reading 0. Each row's WIDTH / 2 bytes
    load as one contiguous run, split into nibbles in registers (low nibble first), where
    ``unpack_codes`` gathers a byte per code, every byte twice: on the H200 the int4 decode GEMM
    took 27 µs on a 4096² weight whose 8 MB stream in ~2 µs (benchmarks/README.md, second
    run)."""
    HALF: tl.constexpr = WIDTH // 2
    cols = k0 // 2 + tl.arange(0, HALF)
    mask = mask_n[:, None] & (cols < ROW_BYTES)[None, :]
    packed = tl.load(w_ptr + offs_n[:, None] * ROW_BYTES + cols[None, :], mask=mask, other=0)
    packed = packed.to(tl.int32)
    u = tl.join(packed & 0xF, packed >> 4)  # [BLOCK_N, HALF, 2]: codes 2j, 2j + 1
    return tl.reshape(u, (BLOCK_N, WIDTH))


@triton.jit
def _intx_gemm_kernel(
    x_ptr,  # [M, K] bf16 / fp16 / fp32, row-major
    w_ptr,  # [N, Kp*BITS/8] uint8 codes packed along K
    scale_ptr,  # [N, Kp/g] fp32
    zero_ptr,  # [N, Kp/g] uint8 or fp32 (uint8 when INT_ZERO)
    bias_ptr,  # [N] float; any valid pointer when HAS_BIAS is False (never read)
    y_ptr,  # [M, N] x's dtype, or fp32 zeros (decode)
    M,
    N,
    K,
    GROUPS,  # Kp / g: the row stride of scale and zero
    BITS: tl.constexpr,
    INT_ZERO: tl.constexpr,  # (u - z) goes into the dot (int4); else z · Σx comes off in fp32
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
    offs_m, offs_n, pid_k = program_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, STEP_K)
    mask_m = offs_m < M
    mask_n = offs_n < N
    row_bytes = GROUPS * GROUP_SIZE * BITS // 8

    # ---- K loop: this program takes K steps pid_k, pid_k + SPLIT_K, ...
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * STEP_K, K, STEP_K * SPLIT_K):
        k = k0 + offs_k
        a, mask_k = load_a(x_ptr, offs_m, mask_m, k, K)
        if BITS == 4:
            u = tl.trans(unpack_nibbles(w_ptr, offs_n, mask_n, k0, row_bytes, STEP_K, BLOCK_N))
        else:
            u = unpack_codes(
                w_ptr,
                offs_n[None, :],
                k[:, None],
                mask_k[:, None] & mask_n[None, :],
                row_bytes,
                BITS,
            )
        group = offs_n * GROUPS + k0 // GROUP_SIZE
        s = tl.load(scale_ptr + group, mask=mask_n, other=0.0)
        if INT_ZERO:
            # (u - z) is an integer in (-2**BITS, 2**BITS), exact in x's dtype; s multiplies
            # the step's fp32 sum
            z = tl.load(zero_ptr + group, mask=mask_n, other=0).to(tl.int32)
            acc += dot_f32(a, as_operand(u - z[None, :], a.dtype)) * s[None, :]
        else:
            # s · (x·u - z · Σx): u is exact in x's dtype, z and Σx stay fp32 (module docstring)
            z = tl.load(zero_ptr + group, mask=mask_n, other=0).to(tl.float32)
            xu = dot_f32(a, as_operand(u, a.dtype))
            x_sum = tl.sum(a.to(tl.float32), axis=1)
            acc += (xu - x_sum[:, None] * z[None, :]) * s[None, :]

    store_tile(y_ptr, acc, bias_ptr, offs_m, offs_n, M, N, pid_k, HAS_BIAS, SPLIT_K)


_decode_kernel, _prefill_kernel = gemm.decode_and_prefill(
    _intx_gemm_kernel, key=["N", "K", "BITS", "GROUP_SIZE"]
)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def check(weight: Tensor, scale: Tensor, zero: Tensor, bits: int, group_size: int, k: int):
    """The packed layout's rules (module docstring), for x with ``k`` features."""
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


def launch(x: Tensor, weight, scale, zero, bias, *, bits, group_size, int_zero, decode) -> Tensor:
    """x [..., K] · packed W → [..., N] in x's dtype. ``int_zero`` puts (u - z) into the dot
    (uint8 zero points: int4's numerics); ``decode`` forces a path (``configs.is_decode``)."""
    gemm.check_activation(x)
    k = x.shape[-1]
    check(weight, scale, zero, bits, group_size, k)
    x2 = x.reshape(-1, k).contiguous()
    y = gemm.launch(
        (_decode_kernel, _prefill_kernel),
        (x2, weight.contiguous(), scale.contiguous(), zero.contiguous()),
        bias,
        x2.shape[0],
        weight.shape[0],
        k,
        scale.shape[1],
        out_dtype=x.dtype,
        decode=decode,
        BITS=bits,
        INT_ZERO=int_zero,
        GROUP_SIZE=group_size,
    )
    return y.reshape(*x.shape[:-1], weight.shape[0])


def intx_linear(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    zero: Tensor,
    bias: Tensor | None,
    bits: int,
    group_size: int,
    decode: bool | None = None,
) -> Tensor:
    """x [..., K] · packed W → [..., N] in x's dtype: the CUDA lowering of
    ``fxquant::intx_weight_only_linear`` (same arguments, then ``decode``: force the decode
    (True) or prefill (False) kernel; None picks from M)."""
    return launch(
        x,
        weight,
        scale,
        zero,
        bias,
        bits=bits,
        group_size=group_size,
        int_zero=False,
        decode=decode,
    )


# --------------------------------------------------------------------------------------------
# Op and lowering
# --------------------------------------------------------------------------------------------

# The launcher is the op's body: its signature is the op's schema.
triton_intx_weight_only_linear = torch.library.triton_op(
    "fxquant::triton_intx_weight_only_linear", intx_linear, mutates_args=()
)


@lowering("cuda", "intx_weight_only_linear")
def lower_intx_weight_only_linear(x, weight, scale, zero, bias, bits, group_size):
    op = torch.ops.fxquant.triton_intx_weight_only_linear.default
    return gemm.linear(op, x, weight, scale, zero, bias, bits, group_size)
