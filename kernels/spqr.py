"""SpQR on CUDA (``Spqr``): the weight decoded per call by the reference's aten ops, then one
GEMM.

Where it sits: ``fxquant.passes.lower`` (device="cuda") replaces ``fxquant::spqr_linear`` by
``fxquant.core.spqr.spqr_linear`` itself: shifts and masks on the 16×16 tile words, the
second-level fp16 grid, the sparse outliers (an accumulating index_put) and the column
permutation, which Inductor compiles into its own Triton kernels, then cuBLAS. A hand-written
kernel that decodes the tiles in the GEMM's K loop (as ``kernels.aqlm`` and ``kernels.vptq`` do
for their codes) is not built yet: SpQR's per-tile second-level word is spread over the tile's
rows, one byte in every other row.
"""

from __future__ import annotations

from fxquant.core import spqr
from fxquant.core.registry import lowering


@lowering("cuda", "spqr_linear")
def lower_spqr_linear(x, weight, row_offsets, col_vals, perm, bias):
    return spqr.spqr_linear(x, weight, row_offsets, col_vals, perm, bias)
