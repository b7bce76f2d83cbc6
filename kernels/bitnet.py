"""BitNet b1.58 linear: int8 activations (per token, 127 / amax) × ternary weights, as
transformers' ``BitLinear`` computes it (``BitNetTernary``).

Where it sits: ``fxquant.passes.lower`` (device="cuda") replaces ``fxquant::bitnet_linear`` by
``fxquant::triton_bitnet_linear`` below (same arguments, then ``decode``). The oracle is
``fxquant.core.reference_lowbit.bitnet_linear``.

Two kernels, launched one after the other by the op:

1. ``_act_quant_kernel``, one program per row: s_x = 127 / max(amax, 1e-5), evaluated as torch
   evaluates it (reciprocal, correctly rounded with ``div_rn``, times 127), and
   x_q = clamp(round_half_even(x · s_x), -128, 127) — transformers' rule, bit for bit.
2. ``_ternary_gemm_kernel``: the weight is read in transformers' packed layout, uint8 [N/4, K]
   with row n in bit pair n // (N/4) of packed row n % (N/4), stored as w + 1. int8 × int8 tiles
   accumulate in int32 (exact), and the epilogue divides by s_x[m] · weight_scale in fp32 and
   adds the bias. Decode (M ≤ 16, split-K with fp32 atomics) and prefill share it, as in the
   other GEMMs.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fxquant.core.registry import lowering
from fxquant.kernels import gemm
from fxquant.kernels.gemm import program_tile, store_tile
from fxquant.kernels.rounding import round_half_even

_EPS = tl.constexpr(1e-5)  # fxquant.core.reference_lowbit.BITNET_EPS (transformers' clamp)
_ACT_MAX = tl.constexpr(127.0)


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.jit
def _act_quant_kernel(
    x_ptr,  # [M, K] float, row-major
    q_ptr,  # [M, K] int8
    inv_ptr,  # [M] fp32: s_x = 127 / amax (the multiplier, as transformers keeps it)
    K,
    BLOCK_K: tl.constexpr,  # next power of two ≥ K: the whole row in one block
):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, BLOCK_K)
    mask = offs < K
    x = tl.load(x_ptr + row * K + offs, mask=mask, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x)), _EPS)
    # torch evaluates transformers' `127 / amax` (a Python scalar over a tensor) as
    # reciprocal(amax) * 127, which is not always the correctly rounded quotient: do the same
    inv = tl.math.div_rn(1.0, amax) * _ACT_MAX
    q = tl.clamp(round_half_even(x * inv), -128.0, 127.0)
    tl.store(q_ptr + row * K + offs, q.to(tl.int8), mask=mask)
    tl.store(inv_ptr + row, inv)


@triton.jit
def _ternary_gemm_kernel(
    xq_ptr,  # [M, K] int8
    inv_ptr,  # [M] fp32 activation multipliers
    w_ptr,  # [N/4, K] uint8, transformers' packing (module docstring)
    ws_ptr,  # [1] fp32 weight multiplier 1 / mean|W|
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
    mask_m = offs_m < M
    mask_n = offs_n < N
    rows = N // 4
    # output row n lives in packed row n % (N/4), bit pair n // (N/4)
    w_row = (offs_n % rows).to(tl.int64)[None, :] * K  # [1, BLOCK_N]
    shift = ((offs_n // rows) * 2)[None, :]

    # ---- int8 · ternary → int32 (exact) over this program's K share
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(
            xq_ptr + offs_m.to(tl.int64)[:, None] * K + offs_k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0,
        )
        mask_b = mask_k[:, None] & mask_n[None, :]
        packed = tl.load(w_ptr + w_row + offs_k[:, None], mask=mask_b, other=0).to(tl.int32)
        # masked-out entries read 0 → -1: zero them so they add nothing
        b = tl.where(mask_b, ((packed >> shift) & 0x3) - 1, 0).to(tl.int8)
        acc = tl.dot(a, b, acc, out_dtype=tl.int32)

    # ---- epilogue: divide by both multipliers in fp32, bias, store
    inv = tl.load(inv_ptr + offs_m, mask=mask_m, other=1.0)
    ws = tl.load(ws_ptr)
    y = tl.math.div_rn(acc.to(tl.float32), inv[:, None] * ws)
    store_tile(y_ptr, y, bias_ptr, offs_m, offs_n, M, N, pid_k, HAS_BIAS, SPLIT_K)


_decode_kernel, _prefill_kernel = gemm.decode_and_prefill(_ternary_gemm_kernel, key=["N", "K"])


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def quantize_activation(x2: Tensor) -> tuple[Tensor, Tensor]:
    """x [M, K] → (int8 [M, K], fp32 multipliers [M, 1]): transformers' per-token rule."""
    m, k = x2.shape
    q = torch.empty((m, k), device=x2.device, dtype=torch.int8)
    inv = torch.empty((m, 1), device=x2.device, dtype=torch.float32)
    torch.library.wrap_triton(_act_quant_kernel)[(m,)](
        x2, q, inv, k, BLOCK_K=triton.next_power_of_2(k)
    )
    return q, inv


def bitnet_linear(
    x: Tensor,
    weight: Tensor,
    weight_scale: Tensor,
    bias: Tensor | None,
    decode: bool | None = None,
) -> Tensor:
    """x [..., K] · packed ternary W [N/4, K] → [..., N] in x's dtype: the CUDA lowering of
    ``fxquant::bitnet_linear`` (same arguments, then ``decode``: force the decode (True) or
    prefill (False) GEMM; None picks from M)."""
    gemm.check_activation(x)
    k = x.shape[-1]
    if weight.dtype != torch.uint8 or weight.dim() != 2 or weight.shape[1] != k:
        raise ValueError(
            f"weight must be uint8 [N/4, K={k}] (transformers' BitNet packing); got "
            f"{weight.dtype} {tuple(weight.shape)}"
        )
    if weight_scale.dtype != torch.float32 or weight_scale.numel() != 1:
        raise ValueError(
            f"weight_scale must be fp32 [1]; got {weight_scale.dtype} {tuple(weight_scale.shape)}"
        )
    n = 4 * weight.shape[0]
    x2 = x.reshape(-1, k).contiguous()
    xq, inv = quantize_activation(x2)
    y = gemm.launch(
        (_decode_kernel, _prefill_kernel),
        (xq, inv, weight.contiguous(), weight_scale.contiguous()),
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


# The launcher is the op's body: its signature is the op's schema.
triton_bitnet_linear = torch.library.triton_op(
    "fxquant::triton_bitnet_linear", bitnet_linear, mutates_args=()
)


@lowering("cuda", "bitnet_linear")
def lower_bitnet_linear(x, weight, weight_scale, bias):
    op = torch.ops.fxquant.triton_bitnet_linear.default
    return gemm.linear(op, x, weight, weight_scale, bias)
