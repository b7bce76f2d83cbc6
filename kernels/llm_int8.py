"""LLM.int8 activation quantization with the outlier decomposition, and the LLM.int8 linear.

Where it sits: ``fxquant.passes.lower`` (device="cuda") replaces ``fxquant::llm_int8_linear`` by
``fxquant::triton_llm_int8_linear`` below (the lowering at the end of this file). The linear is
three steps:

1. the outlier columns: a [K] mask of the features where any token has |x| >= threshold (on
   the fp16 grid); an aten reduction that Inductor compiles (a mask, not an index list, so
   every shape stays static and the program exports);
2. ``_llm_int8_quantize_kernel`` (here), one program per token: x on the fp16 grid, outliers
   left out of the row's absmax, q = round(x · (127 / absmax)) with the outlier columns zeroed,
   the dequant multiplier absmax / 127, and the float part of the activation (x in the outlier
   columns, zero elsewhere; x as given, not fp16-rounded, as bnb);
3. the int8 GEMM of ``int8_dynamic`` (exact int32 sums, per-token × per-channel scales) on q,
   plus the weight-only GEMM of ``int8_weight_only`` on the float part with the same int8 weight
   and its dequant multiplier SCB / 127: bnb's outlier matmul against the dequantized int8
   columns, with the per-channel scale factored out of the sum. Both write fp32 and are added
   before the one rounding to x's dtype.

The math is ``fxquant.core.reference_bnb.llm_int8_linear``; the kernel rounds half to even like
``torch.round`` and takes 127 / absmax as torch does (a reciprocal, then times 127).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from fxquant.core.reference_bnb import to_fp16_grid
from fxquant.core.registry import lowering
from fxquant.kernels import configs, gemm
from fxquant.kernels.int8_dynamic import int8_scaled_mm
from fxquant.kernels.int8_weight_only import channel_scaled_linear
from fxquant.kernels.rounding import round_half_even

_FP16_MAX = tl.constexpr(65504.0)
_ROW_BLOCK = 1024  # elements of a row per iteration; the loop covers any K


@triton.jit
def _fp16_grid(x):
    """fp32 → the nearest fp16 value (saturating at ±65504), as fp32."""
    return tl.clamp(x, -_FP16_MAX, _FP16_MAX).to(tl.float16).to(tl.float32)


@triton.autotune(configs=configs.rowwise_configs(), key=["K"])
@triton.jit
def _llm_int8_quantize_kernel(
    x_ptr,  # [M, K] fp32/bf16/fp16, contiguous
    cols_ptr,  # [K] int8: 1 where the column holds an outlier (read only when OUTLIERS)
    q_ptr,  # [M, K] int8
    s_ptr,  # [M] fp32: absmax / 127
    xo_ptr,  # [M, K] fp32: x in the outlier columns, 0 elsewhere (written only when OUTLIERS)
    K,
    THRESHOLD: tl.constexpr,  # a constexpr: one compile per threshold, never an fp64 argument
    OUTLIERS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    x_row = x_ptr + row * K
    # ---- absmax of the row without its outliers --------------------------------------------
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        xh = _fp16_grid(tl.load(x_row + offs, mask=offs < K, other=0.0).to(tl.float32))
        if OUTLIERS:
            xh = tl.where(tl.abs(xh) >= THRESHOLD, 0.0, xh)
        acc = tl.maximum(acc, tl.abs(xh))
    amax = tl.max(acc, axis=0)
    # torch's 127.0 / absmax: a reciprocal, then times 127; a zero row stays zero
    recip = tl.where(amax > 0, tl.math.div_rn(1.0, tl.maximum(amax, 1e-30)) * 127.0, 0.0)
    tl.store(s_ptr + row, tl.math.div_rn(amax, 127.0))
    # ---- quantize, and split off the outlier columns ---------------------------------------
    for k0 in range(0, K, BLOCK):
        offs = k0 + tl.arange(0, BLOCK)
        mask = offs < K
        x = tl.load(x_row + offs, mask=mask, other=0.0).to(tl.float32)
        xh = _fp16_grid(x)
        if OUTLIERS:
            xh = tl.where(tl.abs(xh) >= THRESHOLD, 0.0, xh)
        q = round_half_even(xh * recip)
        if OUTLIERS:
            col = tl.load(cols_ptr + offs, mask=mask, other=0) != 0
            q = tl.where(col, 0.0, q)
            tl.store(xo_ptr + row * K + offs, tl.where(col, x, 0.0), mask=mask)
        tl.store(q_ptr + row * K + offs, q.to(tl.int8), mask=mask)


def outlier_columns(x2: Tensor, threshold: float) -> Tensor:
    """[K] bool: the features where any token has |x| >= threshold on the fp16 grid."""
    # the bit-exact fp16 rounding of the reference: a plain cast would be dropped by Inductor
    return (to_fp16_grid(x2).abs() >= threshold).any(dim=0)


def quantize(x2: Tensor, cols: Tensor | None, *, threshold: float):
    """x [M, K], outlier column mask [K] (None: no decomposition) → (q int8 [M, K], dequant
    multiplier fp32 [M, 1], float part fp32 [M, K] or None)."""
    if x2.dim() != 2 or x2.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise ValueError(f"x must be a float [M, K] tensor; got {x2.dtype} {tuple(x2.shape)}")
    x2 = x2.contiguous()
    m, k = x2.shape
    q = torch.empty((m, k), dtype=torch.int8, device=x2.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x2.device)
    outliers = cols is not None
    xo = torch.empty((m, k), dtype=torch.float32, device=x2.device) if outliers else s
    c = cols.to(torch.int8).contiguous() if outliers else q
    wrap_triton(_llm_int8_quantize_kernel)[(m,)](
        x2, c, q, s, xo, k, THRESHOLD=float(threshold), OUTLIERS=outliers, BLOCK=_ROW_BLOCK
    )
    return q, s, (xo if outliers else None)


def llm_int8_linear(
    x: Tensor,
    weight: Tensor,
    absmax: Tensor,
    bias: Tensor | None,
    threshold: float,
    decode: bool | None = None,
) -> Tensor:
    """x [..., K] · LLM.int8 W (int8 [N, K], row absmax fp32 [N]) → [..., N] in x's dtype: the
    CUDA lowering of ``fxquant::llm_int8_linear`` (same arguments, then ``decode``: force the
    decode (True) or prefill (False) GEMMs; None picks from M)."""
    k = x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    cols = outlier_columns(x2, threshold) if threshold > 0 else None
    q, s, xo = quantize(x2, cols, threshold=threshold)
    scale = absmax.float() * (1.0 / 127)
    y = int8_scaled_mm(q, s, weight, scale, bias, torch.float32, decode=decode)
    if xo is not None:
        y = y + channel_scaled_linear(
            xo, weight, scale, None, weight_dtype=torch.int8, decode=decode
        )
    return y.to(x.dtype).reshape(*x.shape[:-1], n)


# The launcher is the op's body: its signature is the op's schema.
triton_llm_int8_linear = triton_op(
    "fxquant::triton_llm_int8_linear", llm_int8_linear, mutates_args=()
)


@lowering("cuda", "llm_int8_linear")
def lower_llm_int8_linear(x, weight, absmax, bias, threshold):
    # the outlier column mask is computed inside the op (an aten reduction before the kernels)
    op = torch.ops.fxquant.triton_llm_int8_linear.default
    return gemm.linear(op, x, weight, absmax, bias, threshold)
