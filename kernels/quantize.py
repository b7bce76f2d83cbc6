"""Activation quantization: x [..., K] float → int8 or fp8 e4m3 values and fp32 dequant scales.

Where it sits: the CUDA lowering (``fxquant.passes.lower``) maps the dynamic-activation linears
(``fxquant::int8_dynamic_linear``, ``float8_dynamic_linear``, ``float8_block_linear``) onto the
``*_linear`` ops of ``int8_dynamic``, ``float8_dynamic`` and ``float8_block``, which quantize x
with the launchers here and then run the GEMM on the quantized activation. The
``fxquant::triton_quantize_*`` ops are the same launchers for a graph that quantizes on its own
(per tensor also returns the amax that delayed scaling records). The math is that of
``fxquant.core.reference.quantize_int8_per_token``, ``quantize_fp8_per_token``,
``quantize_fp8_per_tensor`` and ``quantize_fp8_groups``, bit for bit:

- amax is clamped by ``scale_ub`` (when given), then to ``EPS`` (all-zero rows give zeros);
- scale = amax / 127 (int8) or amax / 448 (e4m3), and x / scale is an IEEE division
  (``div_rn``: Triton's ``/`` compiles to the approximate ``div.full.f32`` on NVIDIA);
- values are clamped, then rounded with ``rounding`` before the cast.

One program per row; a row is read in BLOCK chunks, twice (amax, then quantize), so any K
fits. Per tensor takes two kernels: row amaxes combined with ``atomic_max``, then the same
quantize pass with that amax. Groups (1×g along K) need no second read: each group is loaded
once, as one row of a [groups, g] tile.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from fxquant.kernels import configs, rounding
from fxquant.kernels.rounding import round_half_even, round_to_e4m3

# Module constants reach the kernels as constexpr: Inductor hands Python floats to Triton as
# fp64 runtime arguments, and an fp64 bound would turn the fp8 cast into an fp64 one.
_EPS = tl.constexpr(rounding.EPS)
_INT8_MAX = tl.constexpr(rounding.INT8_MAX)
_FP8_MAX = tl.constexpr(rounding.FP8_E4M3_MAX)
_ROW_BLOCK = 1024  # elements of a row per iteration; the loop covers any K
_GROUP_TILE = 1024  # elements per [groups, g] tile of the group kernel


@triton.jit
def _row_absmax(x_row, K, BLOCK: tl.constexpr):
    """max |x| over one row of K elements (x_row points at its first), in fp32."""
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        x = tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32)
        acc = tl.maximum(acc, tl.abs(x))
    return tl.max(acc, axis=0)


@triton.jit
def _scale_from_amax(amax, FP8: tl.constexpr, HAS_UB: tl.constexpr, SCALE_UB: tl.constexpr):
    """reference.fp8_scale (fp8) or amax.clamp(min=EPS) / 127 (int8)."""
    if HAS_UB:
        amax = tl.minimum(amax, SCALE_UB)
    amax = tl.maximum(amax, _EPS)
    if FP8:
        return tl.math.div_rn(amax, _FP8_MAX)
    else:
        return tl.math.div_rn(amax, _INT8_MAX)


@triton.jit
def _quantize(x, scale, FP8: tl.constexpr):
    """fp32 x, broadcastable fp32 scale → values on the int8 or e4m3 grid (as fp32)."""
    v = tl.math.div_rn(x, scale)
    if FP8:
        return round_to_e4m3(tl.clamp(v, -_FP8_MAX, _FP8_MAX))
    else:
        return round_half_even(tl.clamp(v, -_INT8_MAX, _INT8_MAX))


# --------------------------------------------------------------------------------------------
# Kernels
# --------------------------------------------------------------------------------------------


@triton.autotune(configs=configs.rowwise_configs(), key=["K"])
@triton.jit
def _quantize_rows_kernel(
    x_ptr,  # [M, K] fp32/bf16/fp16, contiguous
    q_ptr,  # [M, K] int8 or float8_e4m3fn
    s_ptr,  # [M] fp32 (per row) or [1] (TENSOR_AMAX)
    amax_ptr,  # [1] fp32, the whole tensor's amax (read only when TENSOR_AMAX)
    K,
    FP8: tl.constexpr,
    HAS_UB: tl.constexpr,
    SCALE_UB: tl.constexpr,  # a constexpr like the fp8 bound: one compile per configured bound
    TENSOR_AMAX: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * K
    q_row = q_ptr + row * K
    # ---- amax and scale -------------------------------------------------------------------
    if TENSOR_AMAX:
        scale = _scale_from_amax(tl.load(amax_ptr), FP8, HAS_UB, SCALE_UB)
        if row == 0:
            tl.store(s_ptr, scale)
    else:
        scale = _scale_from_amax(_row_absmax(x_row, K, BLOCK), FP8, HAS_UB, SCALE_UB)
        tl.store(s_ptr + row, scale)
    # ---- quantize -------------------------------------------------------------------------
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        q = _quantize(x, scale, FP8)
        tl.store(q_row + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=configs.rowwise_configs(), key=["K"])
@triton.jit
def _tensor_absmax_kernel(
    x_ptr,  # [M, K] float, contiguous
    amax_ptr,  # [1] fp32, zero on entry; ends as max |x|
    K,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    # |x| >= 0, so fp32 atomic_max against a zero start is exact and order-independent.
    tl.atomic_max(amax_ptr, _row_absmax(x_ptr + row * K, K, BLOCK))


@triton.autotune(configs=configs.rowwise_configs(), key=["K", "GROUP"])
@triton.jit
def _quantize_groups_kernel(
    x_ptr,  # [M, K] float, contiguous
    q_ptr,  # [M, K] float8_e4m3fn
    s_ptr,  # [M, NUM_GROUPS] fp32
    K,
    NUM_GROUPS,  # ceil(K / GROUP)
    GROUP: tl.constexpr,
    BLOCK_G: tl.constexpr,  # next power of two >= GROUP
    GROUPS_PER_TILE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_G)
    for g0 in range(0, NUM_GROUPS, GROUPS_PER_TILE):
        groups = g0 + tl.arange(0, GROUPS_PER_TILE)
        offs = groups[:, None] * GROUP + cols[None, :]  # [GROUPS_PER_TILE, BLOCK_G]
        # A short last group is masked by offs < K: its amax is over the elements it has.
        mask = (cols[None, :] < GROUP) & (offs < K)
        x = tl.load(x_ptr + row * K + offs, mask=mask, other=0.0).to(tl.float32)
        scale = _scale_from_amax(tl.max(tl.abs(x), axis=1), True, False, 0.0)
        tl.store(s_ptr + row * NUM_GROUPS + groups, scale, mask=groups < NUM_GROUPS)
        q = _quantize(x, scale[:, None], True)
        tl.store(q_ptr + row * K + offs, q.to(q_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Launchers and ops
# --------------------------------------------------------------------------------------------


def _rows(x: Tensor) -> tuple[Tensor, int, int]:
    """x → (contiguous x, rows, K): any tensor, read as [rows, K] (a 0-d tensor as [1, 1])."""
    x = x.contiguous()
    k = x.shape[-1] if x.dim() else 1
    return x, x.numel() // k, k


def _quantize_per_row(x: Tensor, qdtype: torch.dtype, scale_ub: float | None):
    x, rows, k = _rows(x)
    q = torch.empty(x.shape, dtype=qdtype, device=x.device)
    scale = torch.empty((*x.shape[:-1], 1), dtype=torch.float32, device=x.device)
    wrap_triton(_quantize_rows_kernel)[(rows,)](
        x,
        q,
        scale,
        x,  # amax_ptr, not read per row: x stands in (an output passed twice would alias)
        k,
        FP8=qdtype == torch.float8_e4m3fn,
        HAS_UB=scale_ub is not None,
        SCALE_UB=0.0 if scale_ub is None else float(scale_ub),
        TENSOR_AMAX=False,
        BLOCK=_ROW_BLOCK,
    )
    return q, scale


def int8_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    """x [..., K] float → (q int8 [..., K], scale fp32 [..., 1]), symmetric, one scale per token."""
    return _quantize_per_row(x, torch.int8, None)


def fp8_per_token(x: Tensor, scale_ub: float | None) -> tuple[Tensor, Tensor]:
    """x [..., K] float → (q e4m3 [..., K], scale fp32 [..., 1]); amax clamped to ``scale_ub``."""
    return _quantize_per_row(x, torch.float8_e4m3fn, scale_ub)


def fp8_per_tensor(x: Tensor, scale_ub: float | None) -> tuple[Tensor, Tensor, Tensor]:
    """Any float x → (q e4m3, scale fp32 [1], amax fp32 [1]).

    amax is max |x| before the ``scale_ub`` and EPS clamps: what delayed scaling records.
    """
    x, rows, k = _rows(x)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(1, dtype=torch.float32, device=x.device)
    amax = torch.zeros(1, dtype=torch.float32, device=x.device)
    wrap_triton(_tensor_absmax_kernel)[(rows,)](x, amax, k, BLOCK=_ROW_BLOCK)
    wrap_triton(_quantize_rows_kernel)[(rows,)](
        x,
        q,
        scale,
        amax,
        k,
        FP8=True,
        HAS_UB=scale_ub is not None,
        SCALE_UB=0.0 if scale_ub is None else float(scale_ub),
        TENSOR_AMAX=True,
        BLOCK=_ROW_BLOCK,
    )
    return q, scale, amax


def fp8_groups(x: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    """x [..., K] float → (q e4m3 [..., K], scale fp32 [..., ceil(K/g)]): 1×g groups along K."""
    if group_size < 1:
        raise ValueError(f"group_size={group_size} is not supported; allowed: >= 1")
    x, rows, k = _rows(x)
    num_groups = -(-k // group_size)
    q = torch.empty(x.shape, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty((*x.shape[:-1], num_groups), dtype=torch.float32, device=x.device)
    block_g = triton.next_power_of_2(group_size)
    groups_per_tile = min(max(1, _GROUP_TILE // block_g), triton.next_power_of_2(num_groups))
    wrap_triton(_quantize_groups_kernel)[(rows,)](
        x,
        q,
        scale,
        k,
        num_groups,
        GROUP=group_size,
        BLOCK_G=block_g,
        GROUPS_PER_TILE=groups_per_tile,
    )
    return q, scale


# The ops: the launchers above, registered so that Inductor traces into their kernels. The
# *_linear ops of the GEMM files call the launchers directly (no second op dispatch).


@triton_op("fxquant::triton_quantize_int8_per_token", mutates_args=())
def triton_quantize_int8_per_token(x: Tensor) -> tuple[Tensor, Tensor]:
    return int8_per_token(x)


@triton_op("fxquant::triton_quantize_fp8_per_token", mutates_args=())
def triton_quantize_fp8_per_token(x: Tensor, scale_ub: float | None) -> tuple[Tensor, Tensor]:
    return fp8_per_token(x, scale_ub)


@triton_op("fxquant::triton_quantize_fp8_per_tensor", mutates_args=())
def triton_quantize_fp8_per_tensor(
    x: Tensor, scale_ub: float | None
) -> tuple[Tensor, Tensor, Tensor]:
    return fp8_per_tensor(x, scale_ub)


@triton_op("fxquant::triton_quantize_fp8_groups", mutates_args=())
def triton_quantize_fp8_groups(x: Tensor, group_size: int) -> tuple[Tensor, Tensor]:
    return fp8_groups(x, group_size)
