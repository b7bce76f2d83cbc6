"""Weight-only GEMM with a per-output-channel scale: y = (x · Wᵀ) * scale + bias, W int8 [N, K].

Where it sits: ``fxquant.passes.lower`` (device="cuda") replaces
``fxquant::int8_weight_only_linear`` by ``fxquant::triton_int8_weight_only_linear`` below (the
lowering at the end of this file); Inductor traces the op's body and sees the kernel through
``wrap_triton``, and AOTInductor embeds it in the package. The same kernel serves float8 e4m3
weights (``float8_weight_only``: the weight dtype is all that differs).

Numerics (``fxquant.core.reference.int8_weight_only_linear``): the weight tile is converted to x's
dtype (int8 and e4m3 values are exact in bf16, fp16 and fp32), products accumulate in fp32, and
the per-channel scale and the bias are applied in fp32 in the epilogue before one rounding to
x's dtype. Decode (M ≤ 16, split-K) and prefill paths as in ``gemm``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fxquant.core.registry import lowering
from fxquant.kernels import gemm
from fxquant.kernels.gemm import as_operand, dot_f32, load_a, program_tile, store_tile

# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _channel_scaled_gemm_kernel(
    x_ptr,  # [M, K] bf16 / fp16 / fp32, row-major
    w_ptr,  # [N, K] int8 or float8_e4m3fn, row-major
    scale_ptr,  # [N] fp32 dequant multiplier per output channel
    bias_ptr,  # [N] float; any valid pointer when HAS_BIAS is False (never read)
    y_ptr,  # [M, N] x's dtype, or fp32 zeros (decode)
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    offs_m, offs_n, pid_k = program_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N

    # ---- K loop: this program takes K slices pid_k, pid_k + SPLIT_K, ...
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        k = k0 + offs_k
        a, mask_k = load_a(x_ptr, offs_m, mask_m, k, K)
        # W tile as [BLOCK_K, BLOCK_N] straight from the [N, K] layout; exact in x's dtype.
        b = tl.load(
            w_ptr + offs_n[None, :] * K + k[:, None],
            mask=mask_k[:, None] & mask_n[None, :],
            other=0.0,
        )
        acc += dot_f32(a, as_operand(b, a.dtype))

    # ---- epilogue: per-channel scale, bias, store
    scale = tl.load(scale_ptr + offs_n, mask=mask_n, other=0.0)
    acc = acc * scale[None, :]
    store_tile(y_ptr, acc, bias_ptr, offs_m, offs_n, M, N, pid_k, HAS_BIAS, SPLIT_K)


_decode_kernel, _prefill_kernel = gemm.decode_and_prefill(
    _channel_scaled_gemm_kernel, key=["N", "K"]
)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def channel_scaled_linear(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    *,
    weight_dtype: torch.dtype,
    decode: bool | None = None,
) -> Tensor:
    """x [..., K] · W [N, K] (``weight_dtype``) with fp32 ``scale`` [N] → [..., N] in x's dtype.

    Called from the ``triton_op`` bodies (int8 here, fp8 in ``float8_weight_only``). ``decode``
    forces a path (see ``configs.is_decode``); None picks from M.
    """
    n, k = weight.shape
    if weight.dtype != weight_dtype:
        raise ValueError(f"weight dtype is {weight.dtype}; this op takes {weight_dtype}")
    gemm.check_activation(x)
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features but the weight [N, K] has K={k}")
    if tuple(scale.shape) != (n,) or scale.dtype != torch.float32:
        raise ValueError(f"scale must be fp32 [N={n}]; got {scale.dtype} {tuple(scale.shape)}")

    x2 = x.reshape(-1, k).contiguous()
    if gemm.library_prefill(x2, x2.shape[0], decode):
        w = weight.to(torch.float32) * scale.reshape(n, 1)
        return gemm.dense_linear(x2, w, bias).reshape(*x.shape[:-1], n)
    operands = (x2, weight.contiguous(), scale.contiguous())
    y = gemm.launch(
        (_decode_kernel, _prefill_kernel),
        operands,
        bias,
        x2.shape[0],
        n,
        k,
        out_dtype=x.dtype,
        decode=decode,
    )
    return y.reshape(*x.shape[:-1], n)


# --------------------------------------------------------------------------------------------
# Op and lowering
# --------------------------------------------------------------------------------------------


@torch.library.triton_op("fxquant::triton_int8_weight_only_linear", mutates_args=())
def triton_int8_weight_only_linear(
    x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None, decode: bool | None = None
) -> Tensor:
    """CUDA lowering of ``fxquant::int8_weight_only_linear``: x [..., K] · int8 W [N, K].

    ``decode`` forces the decode (True) or prefill (False) path; None picks from M."""
    return channel_scaled_linear(x, weight, scale, bias, weight_dtype=torch.int8, decode=decode)


@lowering("cuda", "int8_weight_only_linear")
def lower_int8_weight_only_linear(x, weight, scale, bias):
    return gemm.linear(
        torch.ops.fxquant.triton_int8_weight_only_linear.default, x, weight, scale, bias
    )
