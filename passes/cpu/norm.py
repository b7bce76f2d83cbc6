"""The CPU lowering of the fused norm → quantize op (``norm_quant``, written by the fusion pass
``fxquant.passes.fuse``; its op in ``fxquant/core/ops.py``): the reference math in aten ops, for
Inductor to compile into the norm's own kernel. The linears it feeds (``int8_scaled_linear``,
``float8_scaled_linear``, ``float8_block_scaled_linear``) are lowered with their families
(``fxquant.passes.cpu.int8``, ``fxquant.passes.cpu.float8``).

Where it sits: registered by op name (``fxquant.core.registry``) and read by the lowering pass
(``fxquant.passes.lower``).
"""

from __future__ import annotations

from fxquant.core.ops import norm_quant_reference
from fxquant.core.registry import lowering

lowering("cpu", "norm_quant")(norm_quant_reference)
