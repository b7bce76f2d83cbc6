"""The CPU lowering of the bitsandbytes family (``fxquant/core/schemes/bnb.py``): NF4 / FP4
weights in blocks with an absmax (optionally double-quantized), and LLM.int8 (int8 weights with
float outlier columns of the activation).

Where it sits: registered by op name (``fxquant.core.registry``) and read by the lowering pass
(``fxquant.passes.lower``). No CPU kernel takes these formats: both lower to their reference
math in aten ops, which Inductor compiles.
"""

from __future__ import annotations

import fxquant.core.ops  # noqa: F401  (registers the fxquant:: ops)
from fxquant.core import reference_bnb as ref_bnb
from fxquant.core.registry import lowering


# No CPU kernel takes NF4/FP4 codes: the reference itself (unpack, look the codes up, scale by
# the (double-quant decoded) block absmax in fp32, then a dense linear); Inductor fuses the
# decode into one pointwise kernel. Correct, not fast: the fp32 weight is rebuilt on every call.
@lowering("cpu", "bnb4_weight_only_linear")
def _bnb4_weight_only(*args):
    *tensors, block_size = args  # x, the 4-bit constants, bias; then the op's block_size
    return ref_bnb.bnb4_weight_only_linear(*tensors, block_size=block_size)


@lowering("cpu", "llm_int8_linear")
def _llm_int8(x, weight, absmax, bias, threshold):
    # The reference in aten ops: the outlier columns are a mask (static shapes), so the float
    # part is a second dense GEMM on the masked activation.
    return ref_bnb.llm_int8_linear(x, weight, absmax, bias, threshold=threshold)
