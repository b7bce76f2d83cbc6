"""Triton kernels for the CUDA lowering, one file per scheme family (kernel → launcher → op).

Each family file holds the ``@triton.jit`` kernel, a launcher that picks the grid (and, for the
GEMMs, the decode or prefill path), and a ``torch.library.triton_op`` registration
(``fxquant::triton_*``) whose body calls the kernel through ``wrap_triton``, so Inductor sees
the kernel and AOTInductor embeds it in the package. ``fxquant.passes.lower`` maps each semantic
``fxquant::`` op onto these ops for ``device="cuda"``; nothing here is imported for CPU work
(Inductor traces ``triton_op`` bodies even for CPU tensors and fails there).

Shared pieces: ``rounding`` (round-half-even to int8 and to fp8 e4m3, exact on the GPU and under
``TRITON_INTERPRET=1``) and ``configs`` (every autotune config in one place).

Tests run every kernel on CPU tensors with ``TRITON_INTERPRET=1`` against
``fxquant.core.reference``.
"""
