"""Weight-only GEMM with a per-output-channel scale: y = (x · Wᵀ) * scale + bias, W int8 [N, K].

Where it sits: ``fxquant.passes.lower`` (device="cuda") replaces
``fxquant::int8_weight_only_linear`` by ``fxquant::triton_int8_weight_only_linear`` below; Inductor
traces the op's body and sees the kernel through ``wrap_triton``, and AOTInductor embeds it in the
package. The same kernel serves float8 e4m3 weights (``float8_weight_only``: the weight dtype is
all that differs), and its tiling, dot and epilogue helpers are shared with the grouped int4
kernel (``int4_weight_only``).

Numerics (``fxquant.core.reference.int8_weight_only_linear``): the weight tile is converted to x's
dtype (int8 and e4m3 values are exact in bf16, fp16 and fp32), products accumulate in fp32, and
the per-channel scale and the bias are applied in fp32 in the epilogue before one rounding to
x's dtype.

Two launch shapes, picked by the launcher from M (``configs.is_decode``):

- decode (M ≤ ``configs.DECODE_MAX_M``): a GEMV in disguise, all weight bandwidth. One 16-row
  tile covers M; split-K spreads K over ``SPLIT_K`` programs per column tile so that a small N
  still fills the GPU. Partial sums are ``atomic_add``-ed into fp32 zeros (scale and bias are
  linear, so each partial applies its own scale; only the first K slice adds the bias), and the
  op casts that buffer to x's dtype.
- prefill: plain tiled GEMM writing x's dtype directly, tiles visited in GROUP_M-row bands so
  neighbouring programs reuse the same W tiles from L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fxquant.kernels import configs

GROUP_M = 8  # row tiles per band in the prefill tile order (Triton's matmul tutorial value)
# The interpreter (triton 3.9) multiplies bf16 dot operands as their raw uint16 bits; there the
# operands go up to fp32 first, which gives the GPU's bf16 MMA result (exact products, fp32 sums).
_BF16_DOT_IN_FP32 = tl.constexpr(configs.interpreting())


# --------------------------------------------------------------------------------------------
# Helpers shared with the int4 kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def tile_coords(pid, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """Program id → (row tile, column tile), GROUP_M row tiles per band so W tiles hit L2."""
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    band = pid // (GROUP_M * tiles_n)
    first_m = band * GROUP_M
    band_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % band_rows
    pid_n = (pid % (GROUP_M * tiles_n)) // band_rows
    return pid_m, pid_n


@triton.jit
def dot_f32(a, b):
    """a · b accumulated in fp32. fp32 operands use IEEE products, not TF32, so the GPU, the
    interpreter and the fp32 reference agree to fp32 rounding."""
    if _BF16_DOT_IN_FP32 and a.dtype == tl.bfloat16:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee") if a.dtype == tl.float32 else tl.dot(a, b)


@triton.jit
def as_operand(w, dtype: tl.constexpr):
    """Weight values (exact in ``dtype``) → the dot operand. Integers go through fp32: the
    interpreter (triton 3.9) casts int → bf16 by reinterpreting the bits; on the GPU both
    converts are exact."""
    if w.dtype.is_int():
        w = w.to(tl.float32)
    return w.to(dtype)


@triton.jit
def store_tile(
    y_ptr,  # [M, N] row-major
    acc,  # [BLOCK_M, BLOCK_N] fp32, already scaled
    bias_ptr,  # [N] float; ignored unless HAS_BIAS
    offs_m,
    offs_n,
    M,
    N,
    pid_k,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Add the bias (first K slice only) and write the tile: a store, or an fp32 atomic add
    into zeros when SPLIT_K programs share the tile."""
    mask_n = offs_n < N
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if SPLIT_K > 1:
            bias = tl.where(pid_k == 0, bias, 0.0)
        acc += bias[None, :]
    y_ptrs = y_ptr + offs_m[:, None] * N + offs_n[None, :]
    mask = (offs_m[:, None] < M) & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask)


def output_buffer(m, n, *, x: Tensor, decode: bool) -> Tensor:
    """Decode accumulates split-K partials into fp32 zeros; prefill writes x's dtype."""
    if decode:
        return torch.zeros((m, n), device=x.device, dtype=torch.float32)
    return torch.empty((m, n), device=x.device, dtype=x.dtype)


def gemm_grid(m, n):
    return lambda meta: (
        triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),
        meta["SPLIT_K"],
    )


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
    pid_m, pid_n = tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N

    # ---- K loop: this program takes K slices pid_k, pid_k + SPLIT_K, ...
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        k = k0 + offs_k
        mask_k = k < K
        a = tl.load(
            x_ptr + offs_m[:, None] * K + k[None, :],
            mask=mask_m[:, None] & mask_k[None, :],
            other=0.0,
        )
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


# Prefill keys on M too (a 32-row and a 4096-row problem want different tiles); decode's M is
# one tile whatever it is. reset_to_zero: autotuning runs the split-K kernel repeatedly on the
# same buffer, which must start at zero each time.
_decode_kernel = triton.autotune(
    configs=configs.decode_configs(), key=["N", "K"], reset_to_zero=["y_ptr"]
)(_channel_scaled_gemm_kernel)
_prefill_kernel = triton.autotune(configs=configs.prefill_configs(), key=["M", "N", "K"])(
    _channel_scaled_gemm_kernel
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
    if x.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x dtype is {x.dtype}; allowed: bfloat16, float16, float32")
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features but the weight [N, K] has K={k}")
    if tuple(scale.shape) != (n,) or scale.dtype != torch.float32:
        raise ValueError(f"scale must be fp32 [N={n}]; got {scale.dtype} {tuple(scale.shape)}")

    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    decode = configs.is_decode(m, decode)
    y = output_buffer(m, n, x=x, decode=decode)
    kernel, split = (_decode_kernel, {}) if decode else (_prefill_kernel, {"SPLIT_K": 1})
    torch.library.wrap_triton(kernel)[gemm_grid(m, n)](
        x2,
        weight.contiguous(),
        scale.contiguous(),
        scale if bias is None else bias.contiguous(),
        y,
        m,
        n,
        k,
        HAS_BIAS=bias is not None,
        GROUP_M=GROUP_M,
        **split,
    )
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


# --------------------------------------------------------------------------------------------
# Op
# --------------------------------------------------------------------------------------------


@torch.library.triton_op("fxquant::triton_int8_weight_only_linear", mutates_args=())
def triton_int8_weight_only_linear(
    x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None, decode: bool | None = None
) -> Tensor:
    """CUDA lowering of ``fxquant::int8_weight_only_linear``: x [..., K] · int8 W [N, K].

    ``decode`` forces the decode (True) or prefill (False) path; None picks from M."""
    return channel_scaled_linear(x, weight, scale, bias, weight_dtype=torch.int8, decode=decode)
