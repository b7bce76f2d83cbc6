"""Fused RMSNorm / LayerNorm → activation quantization: one program per row of x [..., K].

Where it sits: the norm-fusion pass in ``fxquant.passes`` replaces a norm that feeds linears
quantizing their activation the same way with ``fxquant::norm_quant``, so the quantized
activation (and its scale) is produced once for all of them; ``fxquant.passes.lower``
(device="cuda") maps that op onto ``fxquant::triton_norm_quant`` below, whose body Inductor traces
and whose kernel AOTInductor embeds through ``wrap_triton``.

Numerics (``fxquant.core.reference.norm_quant``): statistics, weight and bias in fp32; the
normalized row is rounded once to x's dtype (``normed``) and quantized from that rounded value, per
token (int8, or fp8 e4m3 with an optional scale bound) or in 1×g groups along K (fp8). Scales are
amax / 127 or amax / 448 with amax clamped to ``EPS`` (all-zero rows give zeros, not NaN), and q =
round(normed / scale). Given the same ``normed``, q and the scales are bit-exact with the reference:
divisions and the square root are the correctly rounded ``div_rn`` / ``sqrt_rn`` (Triton's plain
fp32 ``/`` is the approximate ``div.full.f32`` on NVIDIA GPUs) and rounding goes through
``fxquant.kernels.rounding``. ``normed`` itself can differ from the reference in the last bit of x's
dtype, since the row sums are reduced in a different order.

Row layout: the row is seen as tiles of [BLOCK_R, BLOCK_C], tile row r holding GROUP
consecutive elements (a quantization group; per token, GROUP = BLOCK_C and BLOCK_R = 1), so the
group amax is a reduction along the tile's columns and any group size works (BLOCK_C is GROUP
rounded up to a power of two, the extra columns masked). A row of up to ``MAX_ROW_BLOCK``
elements is one tile: x is read once and stays in registers (the common case: K ≤ 16384 covers
the hidden sizes of current LLMs). A longer row is walked in tiles, re-reading x from L2:
statistics, then (per token) the row amax, then normalize + quantize + store. Groups need no
amax pass, since every tile holds whole groups.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fxquant.core.registry import lowering
from fxquant.kernels import configs, rounding
from fxquant.kernels.rounding import round_half_even, round_to_e4m3

# Elements of one row held in registers by one program: the single-tile path up to this K.
MAX_ROW_BLOCK = 16384

# Quantization bounds as constexpr: a plain Python float global is not allowed in a compiled
# kernel, and a float passed as an argument can arrive as fp64 from Inductor.
_EPS = tl.constexpr(rounding.EPS)
_INT8_MAX = tl.constexpr(rounding.INT8_MAX)
_FP8_MAX = tl.constexpr(rounding.FP8_E4M3_MAX)

_X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


# --------------------------------------------------------------------------------------------
# Helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def _rstd(var, eps):
    """1 / sqrt(var + eps), correctly rounded like torch.rsqrt on the CPU reference."""
    return tl.div_rn(1.0, tl.sqrt_rn(var + eps))


@triton.jit
def _round_to_bf16(v):
    """fp32 → the nearest bf16 value (as fp32), ties to even, on the bit pattern. The Triton
    interpreter's fp32 → bf16 cast truncates; on the GPU this is what the cast does anyway."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def _normalize(
    x,  # [BLOCK_R, BLOCK_C] fp32, zeros where masked
    cols,  # [BLOCK_R, BLOCK_C] column index in the row
    mask,
    mean,
    rstd,
    w_ptr,  # [K] float
    b_ptr,  # [K] float
    x_dtype: tl.constexpr,
    RMS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
):
    """The norm in fp32, rounded once to x's dtype (returned as fp32, zeros where masked)."""
    y = x * rstd if RMS else (x - mean) * rstd
    if HAS_WEIGHT:
        y = y * tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_BIAS:
        y = y + tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    # The reference quantizes the norm's output in x's dtype, not the fp32 value.
    y = _round_to_bf16(y) if x_dtype == tl.bfloat16 else y.to(x_dtype).to(tl.float32)
    return tl.where(mask, y, 0.0)


@triton.jit
def _scale(amax, scale_ub, HAS_UB: tl.constexpr, FP8: tl.constexpr):
    """amax → dequant scale: bound (fp8 only), clamp to EPS, divide by the format's max."""
    if HAS_UB:
        amax = tl.minimum(amax, scale_ub)
    amax = tl.maximum(amax, _EPS)
    return tl.div_rn(amax, _FP8_MAX if FP8 else _INT8_MAX)


@triton.jit
def _group_scales(
    y,  # [BLOCK_R, BLOCK_C] normalized tile, zeros where masked
    start,  # first column of the tile
    row,
    K,
    scale_ptr,  # [M, cdiv(K, GROUP)] fp32
    GROUP: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """Scale of each group (tile row) of the tile, stored; returned as [BLOCK_R, 1]."""
    scale = _scale(tl.max(tl.abs(y), axis=1), 0.0, False, True)
    n_groups = tl.cdiv(K, GROUP)
    group = start // GROUP + tl.arange(0, BLOCK_R)
    tl.store(scale_ptr + row * n_groups + group, scale, mask=group < n_groups)
    return scale[:, None]


@triton.jit
def _store_quantized(
    y,  # [BLOCK_R, BLOCK_C] normalized tile (values in x's dtype, as fp32)
    scale,  # scalar (per token) or [BLOCK_R, 1] (groups)
    offs,  # [BLOCK_R, BLOCK_C] offsets of the tile in [M, K]
    mask,
    q_ptr,  # [M, K] int8 / float8_e4m3fn
    normed_ptr,  # [M, K] x's dtype
    FP8: tl.constexpr,
    WRITE_NORMED: tl.constexpr,
):
    # Correctly rounded y / scale, as the reference divides (not y * (1 / scale)).
    v = tl.div_rn(y, scale)
    if FP8:
        v = round_to_e4m3(tl.minimum(tl.maximum(v, -_FP8_MAX), _FP8_MAX))
    else:
        v = round_half_even(tl.minimum(tl.maximum(v, -_INT8_MAX), _INT8_MAX))
    tl.store(q_ptr + offs, v.to(q_ptr.dtype.element_ty), mask=mask)
    if WRITE_NORMED:
        tl.store(normed_ptr + offs, y.to(normed_ptr.dtype.element_ty), mask=mask)


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _norm_quant_kernel(
    x_ptr,  # [M, K] bf16 / fp16 / fp32, row-major
    w_ptr,  # [K] float; any valid pointer when HAS_WEIGHT is False (never read)
    b_ptr,  # [K] float; any valid pointer when HAS_BIAS is False (never read)
    q_ptr,  # [M, K] int8 or float8_e4m3fn
    scale_ptr,  # [M] per token, [M, cdiv(K, GROUP)] groups; fp32
    normed_ptr,  # [M, K] x's dtype; any valid pointer when WRITE_NORMED is False (never written)
    K,
    eps,
    scale_ub,  # read only when HAS_UB
    RMS: tl.constexpr,
    HAS_WEIGHT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    FP8: tl.constexpr,
    PER_TOKEN: tl.constexpr,
    HAS_UB: tl.constexpr,
    WRITE_NORMED: tl.constexpr,
    GROUP: tl.constexpr,  # elements per tile row: the quantization group (per token: BLOCK_C)
    BLOCK_R: tl.constexpr,  # tile rows: groups per tile (per token: 1)
    BLOCK_C: tl.constexpr,  # tile columns: GROUP rounded up to a power of two
    ONE_TILE: tl.constexpr,  # the row fits one tile: read x once and keep it in registers
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * K
    TILE: tl.constexpr = BLOCK_R * GROUP
    col_in_group = tl.arange(0, BLOCK_C)[None, :]
    tile_cols = tl.arange(0, BLOCK_R)[:, None] * GROUP + col_in_group
    # Runtime floats stay fp32 whatever type the caller passed them as.
    eps = tl.cast(eps, tl.float32)
    scale_ub = tl.cast(scale_ub, tl.float32)
    k_f32 = tl.cast(K, tl.float32)
    x_dtype = x_ptr.dtype.element_ty

    if ONE_TILE:
        # ---- single tile: one read of x, everything in registers
        mask = (col_in_group < GROUP) & (tile_cols < K)
        x = tl.load(x_row + tile_cols, mask=mask, other=0.0).to(tl.float32)
        # RMSNorm is the same normalization with mean 0 and the mean square as the variance.
        if RMS:
            mean = 0.0
            var = tl.div_rn(tl.sum(x * x), k_f32)
        else:
            mean = tl.div_rn(tl.sum(x), k_f32)
            d = tl.where(mask, x - mean, 0.0)
            var = tl.div_rn(tl.sum(d * d), k_f32)
        rstd = _rstd(var, eps)
        y = _normalize(
            x, tile_cols, mask, mean, rstd, w_ptr, b_ptr, x_dtype, RMS, HAS_WEIGHT, HAS_BIAS
        )
        if PER_TOKEN:
            scale = _scale(tl.max(tl.abs(y)), scale_ub, HAS_UB, FP8)
            tl.store(scale_ptr + row, scale)
        else:
            scale = _group_scales(y, 0, row, K, scale_ptr, GROUP, BLOCK_R)
        _store_quantized(y, scale, row * K + tile_cols, mask, q_ptr, normed_ptr, FP8, WRITE_NORMED)
    else:
        # ---- pass 1: statistics, tile by tile
        if RMS:
            mean = 0.0
            sq = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
            for start in range(0, K, TILE):
                mask = (col_in_group < GROUP) & (start + tile_cols < K)
                x = tl.load(x_row + start + tile_cols, mask=mask, other=0.0).to(tl.float32)
                sq += x * x
            var = tl.div_rn(tl.sum(sq), k_f32)
        else:
            # Per-tile mean and squared deviations merged with Chan et al.'s update: stable
            # where the one-pass E[x^2] - mean^2 would cancel.
            n = 0.0
            mean = 0.0
            m2 = 0.0
            for start in range(0, K, TILE):
                mask = (col_in_group < GROUP) & (start + tile_cols < K)
                x = tl.load(x_row + start + tile_cols, mask=mask, other=0.0).to(tl.float32)
                n_t = tl.sum(mask.to(tl.float32))
                mean_t = tl.div_rn(tl.sum(x), n_t)
                d = tl.where(mask, x - mean_t, 0.0)
                delta = mean_t - mean
                n_new = n + n_t
                mean = mean + delta * tl.div_rn(n_t, n_new)
                m2 = m2 + tl.sum(d * d) + delta * delta * tl.div_rn(n * n_t, n_new)
                n = n_new
            var = tl.div_rn(m2, k_f32)
        rstd = _rstd(var, eps)

        # ---- pass 2 (per token): the row's amax
        if PER_TOKEN:
            amax = tl.zeros((BLOCK_R, BLOCK_C), dtype=tl.float32)
            for start in range(0, K, TILE):
                cols = start + tile_cols
                mask = (col_in_group < GROUP) & (cols < K)
                x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
                y = _normalize(
                    x, cols, mask, mean, rstd, w_ptr, b_ptr, x_dtype, RMS, HAS_WEIGHT, HAS_BIAS
                )
                amax = tl.maximum(amax, tl.abs(y))
            row_scale = _scale(tl.max(amax), scale_ub, HAS_UB, FP8)
            tl.store(scale_ptr + row, row_scale)

        # ---- last pass: normalize again (same code, same x: same values), quantize, store
        for start in range(0, K, TILE):
            cols = start + tile_cols
            mask = (col_in_group < GROUP) & (cols < K)
            x = tl.load(x_row + cols, mask=mask, other=0.0).to(tl.float32)
            y = _normalize(
                x, cols, mask, mean, rstd, w_ptr, b_ptr, x_dtype, RMS, HAS_WEIGHT, HAS_BIAS
            )
            if PER_TOKEN:
                scale = row_scale
            else:
                scale = _group_scales(y, start, row, K, scale_ptr, GROUP, BLOCK_R)
            _store_quantized(y, scale, row * K + cols, mask, q_ptr, normed_ptr, FP8, WRITE_NORMED)


def _prune_warps(configs_: list[triton.Config], named_args: dict, **kwargs) -> list[triton.Config]:
    """Drop warp counts that leave more than 64 tile elements per thread: they spill, and ptxas
    takes minutes on them (num_warps=1 on a 16384-element tile: 6 minutes on the dev CPU)."""
    args = {**named_args, **kwargs}
    tile = args["BLOCK_R"] * args["BLOCK_C"]
    kept = [c for c in configs_ if tile <= 64 * 32 * c.num_warps]
    return kept or [max(configs_, key=lambda c: c.num_warps)]


# Only the warp count is tuned; the best one depends on the tile and on the row length.
_kernel = triton.autotune(
    configs=configs.rowwise_configs(),
    key=["K", "BLOCK_R", "BLOCK_C"],
    prune_configs_by={"early_config_prune": _prune_warps},
)(_norm_quant_kernel)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def _check_args(x, weight, bias, rms, quant_dtype, group_size, scale_ub) -> None:
    """``reference.norm_quant``'s rules (and quantize_activation's), plus the kernel's own."""
    if x.dtype not in _X_DTYPES:
        raise ValueError(f"x dtype is {x.dtype}; allowed: bfloat16, float16, float32")
    if x.dim() == 0 or x.shape[-1] == 0:
        raise ValueError(f"x must be [..., K] with K > 0; got shape {tuple(x.shape)}")
    k = x.shape[-1]
    for name, t in (("weight", weight), ("bias", bias)):
        if t is not None and (tuple(t.shape) != (k,) or not t.is_floating_point()):
            raise ValueError(
                f"{name} must be a float tensor of shape [K={k}]; got {t.dtype} {tuple(t.shape)}"
            )
    if rms and bias is not None:
        raise ValueError("RMSNorm has no bias; pass bias=None with rms=True")
    if quant_dtype == torch.int8:
        if group_size != -1 or scale_ub is not None:
            raise ValueError(
                f"int8 activations are per token without a scale bound; got group_size="
                f"{group_size}, scale_ub={scale_ub}"
            )
    elif quant_dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"quant_dtype={quant_dtype} is not supported; allowed: torch.int8, torch.float8_e4m3fn"
        )
    elif not (group_size == -1 or (group_size > 0 and scale_ub is None)):
        raise ValueError(
            f"fp8 activations: group_size={group_size}, scale_ub={scale_ub} is not supported; "
            "allowed: group_size=-1 (per token, optional scale_ub) or > 0 (groups, no scale_ub)"
        )


def _tile(k: int, group_size: int) -> tuple[int, int, int, bool]:
    """(GROUP, BLOCK_R, BLOCK_C, PER_TOKEN) for a row of k elements.

    A group that spans the whole row is per-token scaling (same amax, same [..., 1] scale).
    """
    if group_size == -1 or group_size >= k:
        block_c = min(triton.next_power_of_2(k), MAX_ROW_BLOCK)
        return block_c, 1, block_c, True
    block_c = triton.next_power_of_2(group_size)
    groups = triton.cdiv(k, group_size)
    block_r = min(triton.next_power_of_2(groups), max(1, MAX_ROW_BLOCK // block_c))
    return group_size, block_r, block_c, False


def norm_quant(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    quant_dtype: torch.dtype,
    group_size: int,
    scale_ub: float | None,
    return_normed: bool,
) -> tuple[Tensor, Tensor, Tensor]:
    """x [..., K] → (q [..., K] ``quant_dtype``, scale fp32 [..., 1] or [..., ceil(K/g)],
    normed [..., K] in x's dtype): the CUDA lowering of ``fxquant::norm_quant``. Custom ops have
    a fixed output structure, so ``normed`` is an empty [0] tensor of x's dtype unless
    ``return_normed``."""
    _check_args(x, weight, bias, rms, quant_dtype, group_size, scale_ub)
    k = x.shape[-1]
    x2 = x.reshape(-1, k).contiguous()
    m = x2.shape[0]
    group, block_r, block_c, per_token = _tile(k, group_size)
    n_scales = 1 if per_token else triton.cdiv(k, group_size)

    q = torch.empty(x.shape, dtype=quant_dtype, device=x.device)
    scale = torch.empty((*x.shape[:-1], n_scales), dtype=torch.float32, device=x.device)
    if return_normed:
        normed = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    else:
        normed = torch.empty((0,), dtype=x.dtype, device=x.device)
    torch.library.wrap_triton(_kernel)[(m,)](
        x2,
        x2 if weight is None else weight.contiguous(),
        x2 if bias is None else bias.contiguous(),
        q,
        scale,
        normed if return_normed else x2,
        k,
        eps,
        0.0 if scale_ub is None else scale_ub,
        RMS=rms,
        HAS_WEIGHT=weight is not None,
        HAS_BIAS=bias is not None,
        FP8=quant_dtype == torch.float8_e4m3fn,
        PER_TOKEN=per_token,
        HAS_UB=scale_ub is not None,
        WRITE_NORMED=return_normed,
        GROUP=group,
        BLOCK_R=block_r,
        BLOCK_C=block_c,
        ONE_TILE=block_r * group >= k,
    )
    return q, scale, normed


# --------------------------------------------------------------------------------------------
# Op and lowering
# --------------------------------------------------------------------------------------------


# The launcher is the op's body: its signature is the op's schema.
triton_norm_quant = torch.library.triton_op(
    "fxquant::triton_norm_quant", norm_quant, mutates_args=()
)


@lowering("cuda", "norm_quant")
def lower_norm_quant(x, weight, bias, eps, rms, quant_dtype, group_size, scale_ub):
    q, scale, _ = torch.ops.fxquant.triton_norm_quant(
        x, weight, bias, eps, rms, quant_dtype, group_size, scale_ub, False
    )
    return q, scale
