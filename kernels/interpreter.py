"""Triton's interpreter (``TRITON_INTERPRET=1``: the kernels run on CPU tensors, which is how the
tests and ``benchmarks/gpu/bench.py --smoke`` run them) under torch 2.11, the lent GPU image's
torch. Its ``wrap_triton`` refuses interpreted kernels, where 2.13's hands them back to be called
as they are; :func:`allow_interpreted_kernels` gives 2.11 that behaviour. Called by
tests/conftest.py and the GPU script's smoke mode before any kernel module is imported (the
kernel modules bind ``wrap_triton`` when they import); fxquant itself never calls it, and on a
GPU the kernels are compiled, not interpreted.
"""

from __future__ import annotations

import os

import torch

__all__ = ["allow_interpreted_kernels"]


def _interpreted(kernel) -> bool:
    """A ``@triton.jit`` kernel under the interpreter, or an autotuner / heuristics over one."""
    from triton.runtime.interpreter import InterpretedFunction

    while not isinstance(kernel, InterpretedFunction) and hasattr(kernel, "fn"):
        kernel = kernel.fn
    return isinstance(kernel, InterpretedFunction)


def allow_interpreted_kernels() -> None:
    """Under the interpreter with a torch before 2.13: ``torch.library.wrap_triton`` returns an
    interpreted kernel as it is (2.13's behaviour). Elsewhere nothing changes."""
    if os.environ.get("TRITON_INTERPRET") != "1" or torch.__version__ >= "2.13":
        return
    import torch._library.triton as library_triton

    real = library_triton.wrap_triton
    if getattr(real, "_fxquant_interpreted", False):
        return

    def wrap_triton(kernel):
        return kernel if _interpreted(kernel) else real(kernel)

    wrap_triton._fxquant_interpreted = True
    torch.library.wrap_triton = library_triton.wrap_triton = wrap_triton
