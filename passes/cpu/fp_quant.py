"""The CPU lowering of FP-Quant (``fxquant/core/schemes/fp_quant.py``): the rotation, the
activation quantizer and the GEMM in aten ops, as the reference computes them.

Where it sits: registered by op name (``fxquant.core.registry``) and read by the lowering pass
(``fxquant.passes.lower``).

As for MXFP4 and NVFP4 (``passes/cpu/mx.py``), no CPU has an FP4 GEMM: the rotation is one
batched matmul per K group, the quantizer elementwise aten ops Inductor fuses, and both operands
meet in one fp32 matmul. Correct, not faster than fp32: FP-Quant's speed is QuTLASS's on
Blackwell tensor cores; the CUDA lowering here (``kernels/fp_quant.py``) runs the Triton FP4
kernels.
"""

from __future__ import annotations

import fxquant.core.ops  # noqa: F401  (registers the fxquant:: ops)
from fxquant.core import reference_fp_quant as ref_fpq
from fxquant.core.registry import lowering


@lowering("cpu", "fp_quant_linear")
def _fp_quant(
    x, weight, scale, rotation, weight_global_scale, act_global_scale, bias, dtype, method
):
    return ref_fpq.fp_quant_linear(
        x,
        weight,
        scale,
        rotation,
        weight_global_scale,
        act_global_scale,
        bias,
        dtype=dtype,
        method=method,
    )
