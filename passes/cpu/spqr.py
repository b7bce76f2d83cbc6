"""The CPU lowering of SpQR (``fxquant/core/schemes/spqr.py``): the weight decoded per call (the
bit fields of each 16×16 tile, its second-level fp16 grid, the sparse outliers, the column
permutation), then one fp32 GEMM.

Where it sits: registered by op name (``fxquant.core.registry``) and read by the lowering pass
(``fxquant.passes.lower``). Correct, and slower than fp32 (no CPU kernel reads the tiles).
"""

from __future__ import annotations

import fxquant.core.ops  # noqa: F401  (registers the fxquant:: ops)
from fxquant.core import spqr
from fxquant.core.registry import lowering


@lowering("cpu", "spqr_linear")
def _spqr(x, weight, row_offsets, col_vals, perm, bias):
    return spqr.spqr_linear(x, weight, row_offsets, col_vals, perm, bias)
