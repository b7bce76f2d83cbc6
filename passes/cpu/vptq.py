"""The CPU lowering of VPTQ (``fxquant/core/schemes/vptq.py``): the weight decoded from its
packed indices and codebooks per call, then one fp32 GEMM.

Where it sits: registered by op name (``fxquant.core.registry``) and read by the lowering pass
(``fxquant.passes.lower``).

Decoding is shifts and gathers on the index words, two codebook gathers, the outlier columns
(decoded at load) in front, a column permutation and the per-column scale and bias (aten ops
Inductor compiles), then ``x @ Wᵀ``: correct, and slower than fp32 (a lookup-table CPU kernel is
not built).
"""

from __future__ import annotations

import fxquant.core.ops  # noqa: F401  (registers the fxquant:: ops)
from fxquant.core import vptq
from fxquant.core.registry import lowering

# the reference itself: its arguments are the op's, in the op's order
lowering("cpu", "vptq_linear")(vptq.vptq_linear)
