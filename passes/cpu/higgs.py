"""The CPU lowering of HIGGS (``fxquant/core/schemes/higgs.py``): the activation's block
rotation, the grid lookup and the GEMM in aten ops, as the reference computes them.

Where it sits: registered by op name (``fxquant.core.registry``) and read by the lowering pass
(``fxquant.passes.lower``).

No CPU kernel reads HIGGS' vector codes: the weight is decoded per call (a gather from the grid
times the block scales) and meets the rotated activation in one fp32 matmul. Correct, not faster
than fp32; HIGGS' speed is its GPU kernel's (FLUTE; here ``kernels/higgs.py``).
"""

from __future__ import annotations

import fxquant.core.ops  # noqa: F401  (registers the fxquant:: ops)
from fxquant.core import higgs
from fxquant.core.registry import lowering


@lowering("cpu", "higgs_linear")
def _higgs(x, weight, scale, grid, bias, hadamard_size):
    return higgs.higgs_linear(x, weight, scale, grid, bias, hadamard_size=hadamard_size)
