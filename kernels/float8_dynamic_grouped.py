"""fp8 e4m3 grouped GEMM (mixture-of-experts, ``fp8-row``: FbgemmFp8Config's Llama 4 experts):
row s of the per-token e4m3 activation xq [S, K] (scale xs [S, 1]) times its expert's e4m3
W [E, N, K] with per-channel scales [E, N] → [S, N].

Where it sits: the CUDA lowering at the end of this file (collected by
``fxquant.passes.lower_cuda``) maps ``fxquant::float8_dynamic_grouped_mm`` (the op the rewrite
puts where an exported MoE layer had its grouped_mm, under ``fp8-row``) onto the per-token
quantizer of ``kernels.quantize`` (``fxquant::triton_quantize_fp8_per_token``: a row's scale
does not depend on its expert, so one launch quantizes every row) and
``fxquant::triton_float8_scaled_grouped_mm`` below: W8A8's grouped kernel with ``INT8=False``
(``kernels.int8_dynamic_grouped.scaled_grouped_mm``, where rows, tiles and numerics are told),
as the dense fp8 GEMM is W8A8's. The oracle is
``fxquant.core.reference.float8_dynamic_grouped_mm``.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.library import triton_op

from fxquant.core.registry import lowering
from fxquant.kernels import quantize  # noqa: F401  (registers triton_quantize_fp8_per_token)
from fxquant.kernels.int8_dynamic_grouped import scaled_grouped_mm

fxq = torch.ops.fxquant


@triton_op("fxquant::triton_float8_scaled_grouped_mm", mutates_args=())
def triton_float8_scaled_grouped_mm(
    xq: Tensor, xs: Tensor, weight: Tensor, scale: Tensor, offs: Tensor, out_dtype: torch.dtype
) -> Tensor:
    """``scaled_grouped_mm`` on e4m3 xq [S, K] and W [E, N, K]."""
    return scaled_grouped_mm(
        xq, xs, weight, scale, offs, out_dtype, operand_dtype=torch.float8_e4m3fn
    )


@lowering("cuda", "float8_dynamic_grouped_mm")
def lower_float8_dynamic_grouped_mm(x, weight, scale, offs, activation_scale_ub):
    # x [S, K] as the op has it: every row quantized per token in one launch, then the grouped
    # GEMM back in x's dtype
    xq, xs = fxq.triton_quantize_fp8_per_token(x, activation_scale_ub)
    return fxq.triton_float8_scaled_grouped_mm(xq, xs, weight, scale, offs, x.dtype)
