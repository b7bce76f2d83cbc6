"""fp8 e4m3 activations × fp8 e4m3 weights, with per-tensor or per-row scales on either side.

Where it sits: the CUDA lowerings at the end of this file (collected by
``fxquant.passes.lower_cuda``) map ``fxquant::float8_dynamic_linear`` onto a quantizer of
``kernels.quantize`` (per token or per tensor) and ``fxquant::triton_float8_scaled_mm`` here,
``fxquant::float8_static_linear`` onto a fixed-scale cast (aten, fused by Inductor) and the same
GEMM, and ``fxquant::float8_scaled_linear`` (the norm-fusion pass already produced the e4m3
activation and its scales) onto the GEMM alone; ``fxquant::triton_float8_dynamic_linear`` is
quantizer and GEMM in one op. The oracle is ``fxquant.core.reference.float8_scaled_linear`` /
``float8_dynamic_linear``.

The GEMM multiplies e4m3 tiles with fp32 accumulation (on sm90 Triton's default lets the tensor
cores accumulate fp8 products at their own reduced precision; the tests bound the error), then
applies xs · ws (and the bias) in fp32 in the epilogue: it is ``int8_dynamic``'s kernel with
``INT8=False`` (one launcher, ``int8_dynamic.scaled_mm``), paths and scale strides included."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import triton_op

from fxquant.core import reference as ref
from fxquant.core.registry import lowering
from fxquant.kernels import gemm, quantize
from fxquant.kernels.int8_dynamic import scaled_mm

fxq = torch.ops.fxquant


def float8_scaled_mm(
    xq: Tensor,
    xs: Tensor,
    weight: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    decode: bool | None = None,
) -> Tensor:
    """xq e4m3 [M, K] with xs fp32 [M, 1] or [1] · e4m3 W [N, K] with scale fp32 [N] or [1].

    Returns [M, N] in ``out_dtype``: (xq · Wᵀ) · xs · scale (+ bias), accumulated in fp32.
    ``decode`` forces the decode (True) or prefill (False) path; None picks from M.
    """
    return scaled_mm(
        xq, xs, weight, scale, bias, out_dtype, operand_dtype=torch.float8_e4m3fn, decode=decode
    )


# The launcher is the op's body: its signature is the op's schema.
triton_float8_scaled_mm = triton_op(
    "fxquant::triton_float8_scaled_mm", float8_scaled_mm, mutates_args=()
)


@triton_op("fxquant::triton_float8_dynamic_linear", mutates_args=())
def triton_float8_dynamic_linear(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    per_row: bool,
    activation_scale_ub: float | None,
) -> Tensor:
    """``fxquant::float8_dynamic_linear`` on CUDA: x [..., K] float → [..., N] in x's dtype.

    x is quantized per token (``per_row``) or per tensor, its amax clamped to
    ``activation_scale_ub``; the weight scale is [N] or [1].
    """
    x2 = x.reshape(-1, x.shape[-1])
    if per_row:
        xq, xs = quantize.fp8_per_token(x2, activation_scale_ub)
    else:
        xq, xs, _ = quantize.fp8_per_tensor(x2, activation_scale_ub)
    y = float8_scaled_mm(xq, xs, weight, scale, bias, x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@lowering("cuda", "float8_scaled_linear")
def lower_float8_scaled_linear(xq, xs, weight, scale, bias, out_dtype):
    mm = fxq.triton_float8_scaled_mm.default
    return gemm.scaled_linear(mm, xq, xs, weight, scale, bias, out_dtype)


@lowering("cuda", "float8_dynamic_linear")
def lower_float8_dynamic_linear(x, weight, scale, bias, per_row, activation_scale_ub):
    if per_row:
        xq, xs = fxq.triton_quantize_fp8_per_token(gemm.rows(x), activation_scale_ub)
    else:
        xq, xs, _ = fxq.triton_quantize_fp8_per_tensor(gemm.rows(x), activation_scale_ub)
    y = lower_float8_scaled_linear(xq, xs, weight, scale, bias, x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@lowering("cuda", "float8_static_linear")
def lower_float8_static_linear(x, weight, scale, activation_scale, bias):
    # a fixed scale needs no reduction: Inductor fuses this cast into one pointwise kernel
    xq = ref.quantize_fp8_static(x, activation_scale)
    return lower_float8_scaled_linear(xq, activation_scale, weight, scale, bias, x.dtype)
