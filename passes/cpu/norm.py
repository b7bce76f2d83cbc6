"""The CPU lowering of the fused norm → quantize op (``norm_quant``, written by the fusion pass
``fxquant.passes.fuse``; its op in ``fxquant/core/ops.py``): the reference math in aten ops, for
Inductor to compile into the norm's own kernel. The linears it feeds (``int8_scaled_linear``,
``float8_scaled_linear``, ``float8_block_scaled_linear``) are lowered with their families
(``fxquant.passes.cpu.int8``, ``fxquant.passes.cpu.float8``).

Where it sits: registered by op name (``fxquant.core.registry``) and read by the lowering pass
(``fxquant.passes.lower``).
"""

from __future__ import annotations

import fxquant.core.ops  # noqa: F401  (registers the fxquant:: ops)
from fxquant.core import reference as ref
from fxquant.core.registry import lowering


@lowering("cpu", "norm_quant")
def _norm_quant(x, weight, bias, eps, rms, quant_dtype, group_size, scale_ub):
    q, scale, _ = ref.norm_quant(
        x,
        weight,
        bias,
        eps=eps,
        rms=rms,
        quant_dtype=quant_dtype,
        group_size=group_size,
        scale_ub=scale_ub,
    )
    return q, scale
