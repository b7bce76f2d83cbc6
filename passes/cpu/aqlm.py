"""The CPU lowering of AQLM (``fxquant/core/schemes/aqlm.py``): the weight decoded from its
codebooks per call, then one fp32 GEMM.

Where it sits: registered by op name (``fxquant.core.registry``) and read by the lowering pass
(``fxquant.passes.lower``).

Decoding is a gather of 2^b-entry codebook rows and a sum over codebooks (aten ops Inductor
compiles), then ``x @ Wᵀ``: correct, and slower than fp32 (AQLM's CPU speed in its own package
comes from a numba lookup-table kernel; not built here).
"""

from __future__ import annotations

import fxquant.core.ops  # noqa: F401  (registers the fxquant:: ops)
from fxquant.core import aqlm
from fxquant.core.registry import lowering


@lowering("cpu", "aqlm_linear")
def _aqlm(x, weight, codebooks, scale, bias):
    return aqlm.aqlm_linear(x, weight, codebooks, scale, bias)
