"""NVFP4 GEMM: y = x · dequant(W)ᵀ + bias, W packed e2m1 [N, K/2] with e4m3 scales per 1×16
and one fp32 tensor scale.

Where it sits: the CUDA lowering at the end of this file (collected by
``fxquant.passes.lower_cuda``) maps ``fxquant::nvfp4_linear`` onto ``fxquant::triton_nvfp4_linear``
below, quantizing x to NVFP4 first (aten ops Inductor fuses) when the scheme quantizes
activations. NVFP4 differs from MXFP4 only in its scales, so the kernel is ``kernels.mxfp4``'s
with e4m3 block scales (read per byte, 16 values = 8 bytes a block) and the tensor scale applied
once in the epilogue; this file is the op and its lowering. The oracle is
``fxquant.core.reference_mx.nvfp4_linear``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import triton_op

from fxquant.core import reference_mx as ref_mx
from fxquant.core.registry import lowering
from fxquant.kernels import gemm
from fxquant.kernels.mxfp4 import fp4_linear


@triton_op("fxquant::triton_nvfp4_linear", mutates_args=())
def triton_nvfp4_linear(
    x: Tensor, weight: Tensor, scale: Tensor, tensor_scale: Tensor, bias: Tensor | None
) -> Tensor:
    """x [M, K] float (already NVFP4-quantized where the scheme quantizes activations) · packed
    e2m1 W [N, K/2] with e4m3 block scales [N, K/16] and fp32 ``tensor_scale`` [1] → fp32."""
    return fp4_linear(x, weight, scale, tensor_scale, bias, block=16)


@lowering("cuda", "nvfp4_linear")
def lower_nvfp4_linear(x, weight, scale, tensor_scale, bias, activations, scale_rule):
    x2 = gemm.rows(x)
    if activations:
        x2 = ref_mx.nvfp4_fake_quantize(x2, rule=scale_rule)
    y = torch.ops.fxquant.triton_nvfp4_linear(x2, weight, scale, tensor_scale, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)
