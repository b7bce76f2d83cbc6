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

import importlib
import pkgutil

import fxquant.core.ops  # noqa: F401  (the semantic ops the table is keyed by)
import fxquant.kernels
from fxquant.core.registry import lowering_table

# Every kernel module registers its triton ops and CUDA lowerings as it is imported: all of
# them are, so a new kernel file needs no line here (the native CPU kernels' package, cpu/, is
# not a Triton module and is left alone).
for _module in pkgutil.iter_modules(fxquant.kernels.__path__):
    if not _module.ispkg:
        importlib.import_module(f"fxquant.kernels.{_module.name}")

CUDA_LOWERINGS = lowering_table("cuda")
