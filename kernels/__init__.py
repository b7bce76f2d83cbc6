"""Triton kernels for the CUDA lowering, one file per scheme family (kernel → launcher → op).

Empty until the kernels issue: on CUDA the lowering uses the aten compositions of
``fxquant.passes.lower`` meanwhile.
"""
