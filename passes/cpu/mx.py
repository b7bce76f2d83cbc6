"""The CPU lowering of the microscaling family (``fxquant/core/schemes/mx.py``): MXFP8, MXFP4
and NVFP4 linears (MXFP4's mixture-of-experts GEMM: ``passes/cpu/experts.py``).

Where it sits: registered by op name (``fxquant.core.registry``) and read by the lowering pass
(``fxquant.passes.lower``).

No CPU has block-scaled FP8/FP4 GEMMs, so both operands are dequantized to fp32 in aten ops
(frexp, bit shifts, the e2m1 decode as arithmetic) and multiplied by one fp32 matmul: the
reference itself, which Inductor compiles (tests/test_mx.py); correct, not faster than fp32.
The CUDA lowering (``passes/lower_cuda.py``) is where these formats are meant to pay.
"""

from __future__ import annotations

import fxquant.core.ops  # noqa: F401  (registers the fxquant:: ops)
from fxquant.core import reference_mx as ref_mx
from fxquant.core.registry import lowering


@lowering("cpu", "mxfp8_linear")
def _mxfp8(x, weight, scale, bias, scale_rule):
    return ref_mx.mxfp8_linear(x, weight, scale, bias, scale_rule=scale_rule)


@lowering("cpu", "mxfp4_linear")
def _mxfp4(x, weight, scale, bias, activations, scale_rule):
    rule = scale_rule if activations else None
    return ref_mx.mxfp4_linear(x, weight, scale, bias, activation_rule=rule)


@lowering("cpu", "nvfp4_linear")
def _nvfp4(x, weight, scale, tensor_scale, bias, activations, scale_rule):
    rule = scale_rule if activations else None
    return ref_mx.nvfp4_linear(x, weight, scale, tensor_scale, bias, activation_rule=rule)
