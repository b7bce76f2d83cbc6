"""FP8 training math: the casts of each ``Float8Recipe`` and the linear whose forward and
backward GEMMs use them.

Where it sits: ``fxquant.passes.float8_regions`` replaces each linear of an FP8 autocast region
in a Dynamo graph by ``float8_training_linear``; AOTAutograd traces it (forward and, through the
autograd function, backward) into the graphs Inductor compiles, so training compiles whole.
``fxquant.training.state`` owns the delayed-scaling state the graph reads (scales) and the amaxes
it reports back.

Every GEMM operand is cast from its high-precision source along that GEMM's reduction dim and
never re-quantized: fprop x·Wᵀ casts x and W along K, dgrad g·W casts g and W along N, wgrad gᵀ·x
casts g and x along M (the row-wise, column-wise copies of TE/torchao). The GEMM itself is
emulated: the fp8 values, dequantized exactly to fp32, are multiplied with fp32 accumulation,
which is what an FP8 tensor core computes up to summation order. This is also the reference the
tests hold the compiled graphs to.

Scales here follow Transformer Engine where state is kept: a delayed-scaling ``scale`` multiplies
into fp8 (``q = sat(x * scale)``, dequantized by ``1 / scale``). Current, MX and block scales are
dequant multipliers (``amax / fp8_max``, as the rest of fxquant).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxquant.core.config import Float8Recipe
from fxquant.core.reference import EPS
from fxquant.core.reference_mx import e8m0_exponent

__all__ = [
    "E4M3",
    "E5M2",
    "cast_blocks",
    "cast_current",
    "cast_delayed",
    "cast_mx",
    "delayed_scaling_update",
    "float8_training_linear",
    "fp8_max",
]

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FWD_ROLES = ("input", "weight", "output")  # TE's forward meta: index 0, 1, 2
BWD_ROLES = ("grad_output", "grad_input")  # TE's backward meta: index 0, 1
MX_BLOCK = 32
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127


def fp8_max(dtype: torch.dtype) -> float:
    return torch.finfo(dtype).max


def grad_dtype(recipe: Float8Recipe) -> torch.dtype:
    """The format gradients are cast to: E5M2 under HYBRID, E4M3 otherwise."""
    return E5M2 if recipe.fp8_format == "HYBRID" else E4M3


# --------------------------------------------------------------------------------------------
# Casts: high precision → fp8 → back to fp32 (the exact values an fp8 GEMM would consume)
# --------------------------------------------------------------------------------------------


def _saturate(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    m = fp8_max(dtype)
    return t.clamp(-m, m).to(dtype).float()


def cast_delayed(t: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Delayed scaling: ``sat(t * scale)`` in fp8, dequantized by ``1 / scale`` (scale: a 0-d
    or 1-element fp32 tensor from the amax history). Values beyond the range saturate."""
    scale = scale.float()
    return _saturate(t.float() * scale, dtype) / scale


def cast_current(t: torch.Tensor, dtype: torch.dtype, *, dim: int | None) -> torch.Tensor:
    """Current scaling from ``t`` itself: one scale per tensor (``dim=None``) or one per slice
    along ``dim`` (amax over ``dim``: per row of the other dim). All-zero slices stay zero."""
    t = t.float()
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = amax.clamp(min=EPS) / fp8_max(dtype)
    return _saturate(t / scale, dtype) * scale


def _blocked(t: torch.Tensor, dim: int, block: int) -> tuple[torch.Tensor, int]:
    """2-D ``t`` with ``dim`` moved last and cut into [..., n_blocks, block] (zero-padded)."""
    t = t.float()
    if dim in (0, -2):
        t = t.t()
    k = t.shape[-1]
    kp = -(-k // block) * block
    return F.pad(t, (0, kp - k)).unflatten(-1, (kp // block, block)), k


def _unblocked(b: torch.Tensor, k: int, dim: int) -> torch.Tensor:
    t = b.flatten(-2)[..., :k]
    return t.t() if dim in (0, -2) else t


def cast_mx(t: torch.Tensor, dtype: torch.dtype, *, dim: int) -> torch.Tensor:
    """MXFP8: one power-of-two (E8M0) scale per 32 consecutive values along ``dim`` of a 2-D
    tensor, its exponent ``ceil(log2(amax / fp8_max))`` so nothing saturates. A short last block
    takes its scale from the values it has; an all-zero block gets scale 1."""
    b, k = _blocked(t, dim, MX_BLOCK)
    # the "ceil" rule of fxquant.core.reference_mx, shared with the MXFP8 inference op, so an
    # MXFP8-trained layer exports (``MXFP8(scale_rule="ceil")``) with the casts it trained with
    amax = b.abs().amax(dim=-1, keepdim=True)
    exp = e8m0_exponent(amax, elem_max=fp8_max(dtype), rule="ceil")
    scale = torch.ldexp(torch.ones_like(amax), exp)
    return _unblocked(_saturate(b / scale, dtype) * scale, k, dim)


def cast_blocks(t: torch.Tensor, dtype: torch.dtype, *, dim: int, block: int) -> torch.Tensor:
    """1×``block`` groups along ``dim`` of a 2-D tensor, fp32 scales ``amax / fp8_max``
    (DeepSeek-V3 activations and gradients)."""
    b, k = _blocked(t, dim, block)
    scale = b.abs().amax(dim=-1, keepdim=True).clamp(min=EPS) / fp8_max(dtype)
    return _unblocked(_saturate(b / scale, dtype) * scale, k, dim)


def cast_tiles(w: torch.Tensor, dtype: torch.dtype, *, block: int) -> torch.Tensor:
    """``block``×``block`` tiles of a 2-D weight (DeepSeek-V3 weights): one cast serves both
    orientations, so fprop and dgrad read the same values."""
    n, k = w.shape
    np_, kp = -(-n // block) * block, -(-k // block) * block
    tiles = F.pad(w.float(), (0, kp - k, 0, np_ - n)).reshape(
        np_ // block, block, kp // block, block
    )
    scale = tiles.abs().amax(dim=(1, 3), keepdim=True).clamp(min=EPS) / fp8_max(dtype)
    return (_saturate(tiles / scale, dtype) * scale).reshape(np_, kp)[:n, :k]


def cast_operand(
    t: torch.Tensor,
    recipe: Float8Recipe,
    dtype: torch.dtype,
    *,
    dim: int,
    scale: torch.Tensor | None = None,
    weight: bool = False,
) -> torch.Tensor:
    """One GEMM operand as the recipe casts it; ``dim`` is the GEMM's reduction dim of ``t``."""
    if recipe.scaling == "delayed":
        return cast_delayed(t, scale, dtype)
    if recipe.scaling == "current":
        return cast_current(t, dtype, dim=dim if recipe.granularity == "row" else None)
    if recipe.scaling == "mxfp8":
        return cast_mx(t, dtype, dim=dim)
    if weight:
        return cast_tiles(t, dtype, block=recipe.block_size)
    return cast_blocks(t, dtype, dim=dim, block=recipe.block_size)


# --------------------------------------------------------------------------------------------
# Delayed scaling: the once-per-step update of one role's history and scale (TE's rule)
# --------------------------------------------------------------------------------------------


def delayed_scaling_update(
    amax_history: torch.Tensor,
    scale: torch.Tensor,
    *,
    fp8_maxes: torch.Tensor | tuple[float, ...],
    margin: int,
    amax_compute_algo: str,
) -> None:
    """Update ``scale [n]`` from ``amax_history [L, n]`` in place and roll the history.

    amax = max over the history (``"max"``) or its row 0 (``"most_recent"``); scale =
    (fp8_max / amax) / 2**margin, except that an amax of 0, inf or NaN keeps the old scale; then
    the history rolls by one (row i takes row i+1, the last row takes row 0) and row 0 is zeroed
    for the next step's casts to write. So step t's scales come from the amaxes of steps < t.
    """
    amax = amax_history.amax(dim=0) if amax_compute_algo == "max" else amax_history[0].clone()
    maxes = torch.as_tensor(fp8_maxes, dtype=torch.float32, device=scale.device)
    new = (maxes / amax) / (2.0**margin)
    ok = (amax > 0) & torch.isfinite(amax)
    scale.copy_(torch.where(ok, new, scale))
    if amax_history.shape[0] > 1:
        amax_history.copy_(torch.roll(amax_history, -1, 0))
    amax_history[0].zero_()


# --------------------------------------------------------------------------------------------
# The linear
# --------------------------------------------------------------------------------------------


def _gemm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [M, K] · b [K, N] of fp8-exact fp32 values, fp32 accumulation."""
    return a.float() @ b.float()


class _Float8TrainingLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, fwd_scale, bwd_scale, amax_sink, recipe):
        ctx.recipe = recipe
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.save_for_backward(x2, weight, fwd_scale, bwd_scale)
        fprop_hp = recipe.override_linear_precision[0]
        if fprop_hp:
            y = x2 @ weight.to(x2.dtype).t()
        else:
            xs = None if fwd_scale is None else fwd_scale[0]
            ws = None if fwd_scale is None else fwd_scale[1]
            xq = cast_operand(x2, recipe, E4M3, dim=1, scale=xs)
            wq = cast_operand(weight, recipe, E4M3, dim=1, scale=ws, weight=True)
            y = _gemm(xq, wq.t()).to(x2.dtype)
        if bias is not None:
            y = y + bias.to(y.dtype)
        if fwd_scale is None:
            return y, None
        # What the delayed-scaling state records for this call: amax of input and weight (the
        # output role is kept for TE's layout and is never cast by a linear).
        amax = torch.stack(
            [
                x2.detach().abs().amax(),
                weight.detach().abs().amax(),
                x2.new_zeros((), dtype=torch.float32),
            ]
        ).float()
        ctx.mark_non_differentiable(amax)
        return y, amax

    @staticmethod
    def backward(ctx, grad_y, _grad_amax):
        x2, weight, fwd_scale, bwd_scale = ctx.saved_tensors
        recipe = ctx.recipe
        _, dgrad_hp, wgrad_hp = recipe.override_linear_precision
        gdt = grad_dtype(recipe)
        gs = None if bwd_scale is None else bwd_scale[0]
        xs = None if fwd_scale is None else fwd_scale[0]
        ws = None if fwd_scale is None else fwd_scale[1]
        grad_x = grad_w = grad_b = sink = None
        if ctx.needs_input_grad[0]:
            if dgrad_hp:
                grad_x = grad_y @ weight.to(grad_y.dtype)
            else:
                gq = cast_operand(grad_y, recipe, gdt, dim=1, scale=gs)
                wq = cast_operand(weight, recipe, E4M3, dim=0, scale=ws, weight=True)
                grad_x = _gemm(gq, wq)
            grad_x = grad_x.to(x2.dtype)
        if ctx.needs_input_grad[1]:
            if wgrad_hp:
                grad_w = grad_y.t().to(x2.dtype) @ x2
            else:
                gq = cast_operand(grad_y, recipe, gdt, dim=0, scale=gs)
                xq = cast_operand(x2, recipe, E4M3, dim=0, scale=xs)
                grad_w = _gemm(gq.t(), xq)
            grad_w = grad_w.to(weight.dtype)
        if ctx.bias_dtype is not None and ctx.needs_input_grad[2]:
            grad_b = grad_y.float().sum(0).to(ctx.bias_dtype)
        if bwd_scale is not None:
            # The amax of grad_output leaves the backward graph as the "gradient" of the sink,
            # a leaf the state hooks (fxquant.training.state): a compiled backward has no other
            # way to hand a value out.
            sink = torch.stack(
                [grad_y.detach().abs().amax().float(), grad_y.new_zeros((), dtype=torch.float32)]
            )
        return grad_x, grad_w, grad_b, None, None, sink, None


def float8_training_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    fwd_scale: torch.Tensor | None,
    bwd_scale: torch.Tensor | None,
    amax_sink: torch.Tensor | None,
    *,
    recipe: Float8Recipe,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``F.linear(x, weight, bias)`` with the recipe's FP8 GEMMs in forward and backward.

    Delayed scaling reads ``fwd_scale [3]`` (input, weight, output) and ``bwd_scale [2]``
    (grad_output, grad_input) and returns, beside y, the amaxes this call saw ([3]); the
    grad_output amax comes back as the gradient of ``amax_sink [2]``. Other recipes pass None
    for all three and get ``(y, None)``.
    """
    x2 = x.reshape(-1, x.shape[-1])
    y, amax = _Float8TrainingLinear.apply(x2, weight, bias, fwd_scale, bwd_scale, amax_sink, recipe)
    return y.reshape(*x.shape[:-1], weight.shape[0]), amax
