"""SINQ's dual-scaled weights on CUDA (``SinqWeightOnly``): the grouped int-N GEMM of
``kernels/intx_weight_only.py`` on x scaled per input column.

Where it sits: ``fxquant.passes.lower`` (device="cuda") replaces
``fxquant::sinq_weight_only_linear`` by ``x ⊙ col_scale`` and
``fxquant::triton_intx_weight_only_linear`` on the same codes, scales and float zero points:
SINQ's column scales are an elementwise multiply Inductor fuses into whatever produces x, and
the rest of the weight is exactly an intx one (``fxquant.core.sinq``), so the kernel is that
one, not a copy of it. The product x ⊙ col_scale is rounded to x's dtype (for a bf16 model, one
rounding of the activation, which the kernel's bf16 operand would make anyway).
"""

from __future__ import annotations

import torch

from fxquant.core.registry import lowering
from fxquant.kernels import gemm
from fxquant.kernels import intx_weight_only as _intx  # noqa: F401  (defines the triton op)


@lowering("cuda", "sinq_weight_only_linear")
def lower_sinq_weight_only_linear(x, weight, scale, zero, col_scale, bias, bits, group_size):
    op = torch.ops.fxquant.triton_intx_weight_only_linear.default
    xs = x * col_scale[: x.shape[-1]].to(x.dtype)
    return gemm.linear(op, xs, weight, scale, zero, bias, bits, group_size)
