"""The CUDA lowering table: each semantic ``fxquant::`` op → the Triton ops of ``fxquant.kernels``.

Used by ``fxquant.passes.lower.lowerings("cuda")`` (the last pass before Inductor or
AOTInductor on a CUDA program). Each lowering is written next to the kernel it calls, in
``kernels/<scheme>.py``, and registered there by op name (``fxquant.core.registry``): a small
aten-level composition around one or two ``fxquant::triton_*`` ops. Those are
``torch.library.triton_op``s, so Inductor traces into their ``wrap_triton`` kernels and
AOTInductor embeds the compiled kernels in the package, and the package runs where fxquant is
not installed. A GEMM whose M is dynamic gets its decode and prefill kernels under a
``torch.cond`` on M (``kernels/gemm.py``).

No prepack on CUDA: the kernels read the rewrite pass's storage layouts as they are (W [N, K]
row-major, int4 packed along K), so a quantized ``.pt2`` lowers for either device.

Imported only when a CUDA lowering is asked for: importing ``fxquant.kernels`` defines Triton
kernels, which CPU-only work never needs.
"""

from __future__ import annotations

import fxquant.core.ops  # noqa: F401  (the semantic ops the table is keyed by)
import fxquant.kernels.bitnet  # noqa: F401  (each import registers its ops and CUDA lowerings)
import fxquant.kernels.bnb4_weight_only  # noqa: F401
import fxquant.kernels.float8_block  # noqa: F401
import fxquant.kernels.float8_dynamic  # noqa: F401
import fxquant.kernels.float8_weight_only  # noqa: F401
import fxquant.kernels.int4_weight_only  # noqa: F401
import fxquant.kernels.int8_dynamic  # noqa: F401
import fxquant.kernels.int8_weight_only  # noqa: F401
import fxquant.kernels.intx_weight_only  # noqa: F401
import fxquant.kernels.llm_int8  # noqa: F401
import fxquant.kernels.mxfp4  # noqa: F401
import fxquant.kernels.mxfp4_grouped  # noqa: F401
import fxquant.kernels.mxfp8  # noqa: F401
import fxquant.kernels.norm_quant  # noqa: F401
import fxquant.kernels.nvfp4  # noqa: F401
import fxquant.kernels.quantize  # noqa: F401
from fxquant.core.registry import lowering_table

CUDA_LOWERINGS = lowering_table("cuda")
