"""FP8 training math: the casts of each ``Float8Recipe`` and the linear whose forward and
backward GEMMs use them.

Where it sits: ``fxquant.passes.float8_regions`` replaces each linear of an FP8 autocast region
in a Dynamo graph by ``float8_training_linear``; AOTAutograd traces it (forward and, through the
autograd function, backward) into the graphs Inductor compiles, so training compiles whole.
``fxquant.training.state`` owns the delayed-scaling state the graph reads (scales) and the amaxes
it reports back.

Every GEMM operand is cast from its high-precision source along that GEMM's reduction dim and
never re-quantized: fprop x·Wᵀ casts x and W along K, dgrad g·W casts g and W along N, wgrad gᵀ·x
casts g and x along M (the row-wise, column-wise copies of TE/torchao).

The GEMMs of per-tensor and per-row scales (``delayed``, ``current``) are real FP8 GEMMs:
``torch._scaled_mm`` on the fp8 operands and their dequant scales (fp32 accumulation; the second
operand column-major; on CUDA K and N zero-padded to multiples of 16), the tensor-core path on a
GPU and the same code on CPU, where torch runs it too (as an fp32 GEMM of the scaled fp8 values;
where torch would hand it to oneDNN's reference fp8 matmul instead, on AMX CPUs, fxquant
computes that fallback itself: :func:`onednn_fp8_is_reference`). What the backward needs of x is
saved as fp8 (1 byte a value: the copy cast along M, or for per-tensor scales the forward's own
copy), never in high precision. MXFP8 and block scales have no ``_scaled_mm`` layout on every
device and torch this supports, so those GEMMs are emulated: the fp8 values, dequantized exactly
to fp32, multiplied with fp32 accumulation, what an FP8 tensor core computes up to summation
order. The emulated casts (``cast_*``) are also the reference the tests hold the ``_scaled_mm``
path to (the same fp8 values; sums in another order).

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
from fxquant.training.gathered import Float8GatheredWeight

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
    "gemm_kind",
    "onednn_fp8_is_reference",
    "quantize_rows",
    "scaled_gemm",
    "scaled_gemm_note",
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


def _saturate_fp8(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``t`` clamped to the format's range, in fp8 (what ``_scaled_mm`` reads)."""
    m = fp8_max(dtype)
    return t.clamp(-m, m).to(dtype)


def _saturate(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return _saturate_fp8(t, dtype).float()


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
    """a [M, K] · b [K, N] of fp8-exact fp32 values, fp32 accumulation (the emulated GEMM)."""
    return a.float() @ b.float()


def gemm_kind(recipe: Float8Recipe) -> str:
    """Which GEMM the recipe's FP8 linears run: ``"_scaled_mm"`` (per-tensor and per-row
    scales) or ``"emulated"`` (MXFP8 and block scales: dequantized fp8 values, fp32 GEMM)."""
    return "_scaled_mm" if recipe.scaling in ("delayed", "current") else "emulated"


def missing_gemm(recipe: Float8Recipe) -> str | None:
    """Why the recipe's FP8 GEMMs cannot run on this device and torch, or None: MX and block
    scales have no ``_scaled_mm`` layout fxquant calls and no training kernel, so they run only
    emulated, which the recipe must ask for (``emulate=True``)."""
    if gemm_kind(recipe) == "_scaled_mm" or recipe.emulate or all(recipe.override_linear_precision):
        return None
    what = "MX (E8M0 per 32)" if recipe.scaling == "mxfp8" else "1x128 / 128x128 block"
    return (
        f"Float8Recipe(scaling={recipe.scaling!r}) has no FP8 GEMM here: fxquant calls no "
        f"torch._scaled_mm with {what} scales (torch {torch.__version__}) and has no training "
        "kernel for them; pass emulate=True to run it emulated (FP8 numerics, an fp32 GEMM: "
        "slower than high precision), or use scaling='delayed' / 'current'"
    )


def quantize_rows(
    t: torch.Tensor, recipe: Float8Recipe, dtype: torch.dtype, *, scale: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """2-D ``t`` cast along its last dim (the GEMM's reduction dim) as ``cast_operand`` casts it,
    kept in fp8: (values in ``dtype``, dequant scale, 0-d or [rows, 1] fp32). Delayed and current
    scaling only (:func:`gemm_kind`)."""
    t = t.float().contiguous()  # a transposed operand becomes row-major: K last in memory
    if recipe.scaling == "delayed":
        mult = scale.float().reshape(())
        return _saturate_fp8(t * mult, dtype), (1.0 / mult)
    per_row = recipe.granularity == "row"
    amax = t.abs().amax(dim=1, keepdim=True) if per_row else t.abs().amax()
    s = amax.clamp(min=EPS) / fp8_max(dtype)
    return _saturate_fp8(t / s, dtype), s


def reads_gathered(weight: torch.Tensor, recipe: Float8Recipe) -> bool:
    """Whether the recipe's GEMMs read ``weight`` as FSDP gathered it (:func:`weight_rows`):
    an FP8-gathered weight under per-tensor current scaling."""
    per_tensor_current = recipe.scaling == "current" and recipe.granularity == "tensor"
    return isinstance(weight, Float8GatheredWeight) and per_tensor_current


def weight_rows(
    weight: torch.Tensor, recipe: Float8Recipe, *, scale: torch.Tensor | None, transpose: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """W (fprop, K last) or Wᵀ (dgrad, N last) in fp8 with its dequant scale, as
    :func:`quantize_rows` casts it. FSDP's FP8-gathered weight (``Float8GatheredWeight``) under
    per-tensor current scaling goes in as gathered: casting its dequantized values again would
    find the same scale (its amax is 448 · scale) and the same e4m3 values, a pass over the
    weight for nothing. Other recipes cast its dequantized values (what they would do without
    the FP8 all-gather, rounding the weight twice)."""
    if reads_gathered(weight, recipe):
        data = weight.fp8_data
        return (data.t().contiguous() if transpose else data), weight.fp8_scale.reshape(())
    return quantize_rows(weight.t() if transpose else weight, recipe, E4M3, scale=scale)


def _pad16(t: torch.Tensor, dim: int, value: float = 0.0) -> torch.Tensor:
    extra = -t.shape[dim] % 16
    if not extra:
        return t
    pad = [0, 0] * (t.dim() - 1 - dim % t.dim()) + [0, extra]
    if t.dtype in (E4M3, E5M2):  # F.pad has no fp8 kernels: pad the bytes
        return F.pad(t.view(torch.uint8), pad).view(t.dtype)
    return F.pad(t, pad, value=value)


def onednn_fp8_is_reference(a_dtype: torch.dtype, b_dtype: torch.dtype) -> bool:
    """Whether ``torch._scaled_mm`` on this CPU would run oneDNN's reference fp8 matmul.

    torch sends a CPU fp8 GEMM to oneDNN where the CPU has AMX-int8 (e4m3 x e4m3) or AMX-fp16
    (e5m2 x e4m3) and oneDNN is enabled, else to its own fallback (the scaled fp8 values in
    fp32, an sgemm). The oneDNN of torch 2.13 has no optimized fp8 matmul for those CPUs: it
    runs ``ref:any``, ~1000x the fallback's time (6 s against 5 ms for a 256 x 576 x 1536 GEMM on
    a Xeon Emerald Rapids, ``ONEDNN_VERBOSE=1``, by hand). There fxquant computes the fallback
    itself. (A CPU with AMX-FP8 may get a real oneDNN kernel: measure before trusting this.)
    """
    if not (torch.backends.mkldnn.is_available() and torch.backends.mkldnn.enabled):
        return False
    if a_dtype == b_dtype:
        return torch.cpu._is_amx_tile_supported()
    return torch.cpu._is_amx_fp16_supported()


def cpu_scaled_mm_takes_row_scales() -> bool:
    """Whether this torch's CPU ``torch._scaled_mm`` takes per-row scales: 2.13's does, 2.11's
    refuses them ("only supports per-tensor scaling"; its CUDA one takes them)."""
    return torch.__version__ >= "2.13"


def scaled_gemm_note(recipe: Float8Recipe, device: torch.device) -> str | None:
    """What a report row says of the recipe's ``_scaled_mm`` GEMMs on ``device`` where
    :func:`scaled_gemm` computes torch's CPU fallback itself, else None."""
    if device.type != "cpu" or gemm_kind(recipe) != "_scaled_mm":
        return None
    if recipe.granularity == "row" and not cpu_scaled_mm_takes_row_scales():
        why = f"torch {torch.__version__}'s CPU _scaled_mm takes no row-wise scales"
    elif any(onednn_fp8_is_reference(g, E4M3) for g in (E4M3, grad_dtype(recipe))):
        why = "torch would send this CPU's fp8 GEMMs to oneDNN's reference matmul, ~1000x slower"
    else:
        return None
    fallback = "torch's CPU _scaled_mm fallback (fp32 GEMM of the scaled fp8 values)"
    return f"{fallback}, run by fxquant: {why}"


def scaled_gemm(
    a: torch.Tensor,
    sa: torch.Tensor,
    b: torch.Tensor,
    sb: torch.Tensor,
    *,
    out_dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """[M, N] in ``out_dtype`` = (a · sa) [M, K] · ((b · sb) [N, K])ᵀ on fp8 ``a`` and ``b`` (both
    with K last), with ``torch._scaled_mm``: per-tensor (0-d) or per-row ([M, 1] / [N, 1]) scales.
    On CUDA a per-tensor GEMM writes ``out_dtype`` itself (a bf16 model's product never makes an
    fp32 pass through memory); elsewhere the fp32 product is converted.

    ``b`` goes in as the column-major [K, N] ``_scaled_mm`` wants (a transposed view, no copy).
    On CUDA, K and N are zero-padded to multiples of 16 (zeros add nothing; padded rows of b
    get scale 1 and are sliced off), and row-wise scales give a bf16 product there (the only
    output rowwise ``_scaled_mm`` supports), so that path rounds the product to bf16.
    """
    if a.device.type == "cpu" and (
        onednn_fp8_is_reference(a.dtype, b.dtype)
        or ((sa.dim() or sb.dim()) and not cpu_scaled_mm_takes_row_scales())
    ):
        # torch's own CPU _scaled_mm without oneDNN: the scaled fp8 values in fp32, an sgemm
        return ((a.float() * sa) @ (b.float() * sb).t()).to(out_dtype)
    m, n = a.shape[0], b.shape[0]
    gemm_dtype = torch.float32
    if a.is_cuda:
        a, b = _pad16(a, 1), _pad16(_pad16(b, 1), 0)
        if sb.dim():
            sb = _pad16(sb, 0, value=1.0)
        gemm_dtype = torch.bfloat16 if sa.dim() or sb.dim() else out_dtype
    scale_b = sb.t() if sb.dim() else sb  # [1, N]: one scale per column of bᵀ
    y = torch._scaled_mm(a, b.t(), scale_a=sa, scale_b=scale_b, out_dtype=gemm_dtype)
    return y[:m, :n].to(out_dtype)


class _Float8TrainingLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x2, weight, bias, fwd_scale, bwd_scale, amax_sink, recipe):
        ctx.recipe = recipe
        ctx.bias_dtype = None if bias is None else bias.dtype
        ctx.x_dtype = x2.dtype
        fprop_hp, _, wgrad_hp = recipe.override_linear_precision
        xs = None if fwd_scale is None else fwd_scale[0]
        ws = None if fwd_scale is None else fwd_scale[1]
        scaled = gemm_kind(recipe) == "_scaled_mm"
        xq = xq_scale = None
        if fprop_hp:
            y = x2 @ weight.to(x2.dtype).t()
        elif scaled:
            xq, xq_scale = quantize_rows(x2, recipe, E4M3, scale=xs)
            wq, wq_scale = weight_rows(weight, recipe, scale=ws, transpose=False)
            y = scaled_gemm(xq, xq_scale, wq, wq_scale, out_dtype=x2.dtype)
        else:
            xc = cast_operand(x2, recipe, E4M3, dim=1, scale=xs)
            wc = cast_operand(weight, recipe, E4M3, dim=1, scale=ws, weight=True)
            y = _gemm(xc, wc.t()).to(x2.dtype)
        # What wgrad reads of x: for the _scaled_mm path its fp8 copy cast along M ([K, M], one
        # byte a value; per-tensor scales make it the forward's own copy, transposed), else x.
        if scaled and not wgrad_hp and ctx.needs_input_grad[1]:
            if recipe.scaling == "delayed" or recipe.granularity == "tensor":
                if xq is None:
                    xq, xq_scale = quantize_rows(x2, recipe, E4M3, scale=xs)
                x_saved, x_scale = xq.t().contiguous(), xq_scale
            else:
                x_saved, x_scale = quantize_rows(x2.t(), recipe, E4M3, scale=xs)
        else:
            x_saved, x_scale = x2, None
        ctx.save_for_backward(x_saved, x_scale, weight, fwd_scale, bwd_scale)
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
        x_saved, x_scale, weight, fwd_scale, bwd_scale = ctx.saved_tensors
        recipe = ctx.recipe
        _, dgrad_hp, wgrad_hp = recipe.override_linear_precision
        scaled = gemm_kind(recipe) == "_scaled_mm"
        gdt = grad_dtype(recipe)
        gs = None if bwd_scale is None else bwd_scale[0]
        xs = None if fwd_scale is None else fwd_scale[0]
        ws = None if fwd_scale is None else fwd_scale[1]
        grad_x = grad_w = grad_b = sink = None
        if ctx.needs_input_grad[0]:
            if dgrad_hp:
                grad_x = grad_y @ weight.to(grad_y.dtype)
            elif scaled:  # g [M, N] · W [N, K]: both cast along N
                gq, g_scale = quantize_rows(grad_y, recipe, gdt, scale=gs)
                wq, w_scale = weight_rows(weight, recipe, scale=ws, transpose=True)
                grad_x = scaled_gemm(gq, g_scale, wq, w_scale, out_dtype=ctx.x_dtype)
            else:
                gq = cast_operand(grad_y, recipe, gdt, dim=1, scale=gs)
                wq = cast_operand(weight, recipe, E4M3, dim=0, scale=ws, weight=True)
                grad_x = _gemm(gq, wq)
            grad_x = grad_x.to(ctx.x_dtype)
        if ctx.needs_input_grad[1]:
            if wgrad_hp:
                grad_w = grad_y.t().to(x_saved.dtype) @ x_saved
            elif scaled:  # gᵀ [N, M] · x [M, K]: both cast along M (x's copy saved as [K, M])
                gq, g_scale = quantize_rows(grad_y.t(), recipe, gdt, scale=gs)
                grad_w = scaled_gemm(gq, g_scale, x_saved, x_scale, out_dtype=weight.dtype)
            else:
                gq = cast_operand(grad_y, recipe, gdt, dim=0, scale=gs)
                xq = cast_operand(x_saved, recipe, E4M3, dim=0, scale=xs)
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
