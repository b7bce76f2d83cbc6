"""Weight-only float8 GEMM: y = (x · Wᵀ) * scale + bias, W float8_e4m3fn [N, K], scale fp32 [N].

Where it sits: ``fxquant.passes.lower`` (device="cuda") replaces
``fxquant::float8_weight_only_linear`` by ``fxquant::triton_float8_weight_only_linear`` below.
Only the weight dtype differs from int8 weight-only (e4m3 values are exact in bf16, fp16 and
fp32), so the kernel, its decode/prefill launcher and its numerics are those of
``int8_weight_only``; this file is the op and its lowering.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fxquant.core.registry import lowering
from fxquant.kernels import gemm
from fxquant.kernels.int8_weight_only import channel_scaled_linear


@torch.library.triton_op("fxquant::triton_float8_weight_only_linear", mutates_args=())
def triton_float8_weight_only_linear(
    x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None, decode: bool | None = None
) -> Tensor:
    """CUDA lowering of ``fxquant::float8_weight_only_linear``: x [..., K] · e4m3 W [N, K].

    ``decode`` forces the decode (True) or prefill (False) path; None picks from M."""
    return channel_scaled_linear(
        x, weight, scale, bias, weight_dtype=torch.float8_e4m3fn, decode=decode
    )


@lowering("cuda", "float8_weight_only_linear")
def lower_float8_weight_only_linear(x, weight, scale, bias):
    op = torch.ops.fxquant.triton_float8_weight_only_linear.default
    return gemm.linear(op, x, weight, scale, bias)
