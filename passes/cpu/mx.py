"""The CPU lowering of the microscaling family (``fxquant/core/schemes/mx.py``): MXFP8, MXFP4
and NVFP4 linears, and MXFP4's mixture-of-experts GEMM (``mxfp4_grouped_mm``).

Where it sits: registered by op name (``fxquant.core.registry``) and read by the lowering pass
(``fxquant.passes.lower``).

No CPU has block-scaled FP8/FP4 GEMMs, so both operands are dequantized to fp32 in aten ops
(frexp, bit shifts, the e2m1 decode as arithmetic) and multiplied by one fp32 matmul: the
reference itself, which Inductor compiles (tests/test_mx.py); correct, not faster than fp32.
The CUDA lowering (``passes/lower_cuda.py``) is where these formats are meant to pay.
"""

from __future__ import annotations

import torch

import fxquant.core.ops  # noqa: F401  (registers the fxquant:: ops)
from fxquant.core import reference_mx as ref_mx
from fxquant.core.registry import lowering


@lowering("cpu", "mxfp8_linear")
def _mxfp8(x, weight, scale, bias, scale_rule):
    return ref_mx.mxfp8_linear(x, weight, scale, bias, scale_rule=scale_rule)


@lowering("cpu", "mxfp4_linear")
def _mxfp4(x, weight, scale, bias, activations, scale_rule):
    rule = scale_rule if activations else None
    return ref_mx.mxfp4_linear(x, weight, scale, bias, activation_rule=rule)


@lowering("cpu", "nvfp4_linear")
def _nvfp4(x, weight, scale, tensor_scale, bias, activations, scale_rule):
    rule = scale_rule if activations else None
    return ref_mx.nvfp4_linear(x, weight, scale, tensor_scale, bias, activation_rule=rule)


@lowering("cpu", "mxfp4_grouped_mm")
def _mxfp4_grouped_mm(x, weight, scale, offs):
    # The reference's loop over experts splits rows at data-dependent offsets, which does not
    # trace into aten. Instead every row meets every expert in one [S, E·N] GEMM and keeps its
    # own expert's N columns: E/top-k times the FLOPs, but one dense GEMM Inductor compiles and
    # AOTInductor packages. CUDA runs the grouped Triton kernel (lower_cuda.py).
    e, n = weight.shape[0], weight.shape[1]
    w = ref_mx.dequantize_mxfp4_weight(weight, scale)  # [E, N, K]
    every = (x.float() @ w.flatten(0, 1).t()).unflatten(-1, (e, n))  # [S, E, N]
    ids = ref_mx.expert_of_rows(offs, x.shape[0])
    mine = every.gather(1, ids.clamp(max=e - 1)[:, None, None].expand(-1, 1, n)).squeeze(1)
    return torch.where((ids < e)[:, None], mine, 0.0).to(x.dtype)
