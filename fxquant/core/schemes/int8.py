"""int8 weights, one scale per output channel: weight-only (``int8wo``) and × int8 activations
quantized per token at run time (``w8a8``). Both store the same weight; only the op (what
happens to x) differs.

Declarations (``fxquant.core.scheme``); reference math in ``fxquant.core.reference``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from fxquant.core import reference as ref
from fxquant.core.scheme import (
    ActivationQuant,
    QuantizedWeight,
    Scheme,
    check_choice,
    recipe,
    register_scheme,
)


class _Int8PerChannel(Scheme):
    constants = ("qweight", "scale")  # int8 [N, K], fp32 [N]
    # the weight grid; only Int8WeightOnly makes it a field (w8a8's activation is fxquant's)
    grid: str = "fxquant"

    def quantize(self, w):
        q, s = ref.quantize_int8_per_channel(w, grid=self.grid)
        return QuantizedWeight({"qweight": q, "scale": s}, ref.dequantize_int8_per_channel(q, s))


@register_scheme
@dataclass(frozen=True, kw_only=True)
class Int8WeightOnly(_Int8PerChannel):
    """int8 symmetric weights, one scale per output channel; activations stay in float.

    Recipe ``int8wo``. Halves (bf16) or quarters (fp32) the weight bytes; decode is memory bound,
    so this is the safest speed-up with almost no accuracy cost.

    Args:
        grid: ``"fxquant"`` (default; s = amax / 127, codes -127..127), or another library's,
            bit for bit (``fxquant.core.reference.library_grid``): ``"torchao"``
            (``Int8WeightOnlyConfig``) and ``"compressed-tensors"`` (W8A16), both s = amax /
            127.5 with codes down to -128. Same storage, ops and kernels.
    """

    name: ClassVar[str] = "int8_weight_only"
    reference = staticmethod(ref.int8_weight_only_linear)
    grid: str = field(default="fxquant", metadata={"omit_default": True})

    def __post_init__(self) -> None:
        check_choice("Int8WeightOnly", "grid", self.grid, ref.INT_GRIDS)

    @property
    def takes_experts(self) -> bool:  # type: ignore[override]
        return True

    def grouped_op_args(self, x, constants, offs):
        # experts [E, N, K] quantize per output channel of each expert, as a linear's [N, K]
        op = torch.ops.fxquant.int8_weight_only_grouped_mm.default
        return op, (x, constants["qweight"], constants["scale"], offs)


@register_scheme
@dataclass(frozen=True, kw_only=True)
class Int8DynamicActivation(_Int8PerChannel):
    """int8 weights per output channel × int8 activations per token, quantized at run time.

    Recipe ``w8a8``. The activation scale is amax(|x|) / 127 over each token's features.
    """

    name: ClassVar[str] = "int8_dynamic"
    quantizes_activation: ClassVar[bool] = True
    reference = staticmethod(ref.int8_dynamic_linear)

    @property
    def takes_experts(self) -> bool:  # type: ignore[override]
        return True

    def grouped_op_args(self, x, constants, offs):
        # experts [E, N, K] per output channel of each expert; x per token, whatever its expert
        op = torch.ops.fxquant.int8_dynamic_grouped_mm.default
        return op, (x, constants["qweight"], constants["scale"], offs)

    @classmethod
    def activation_quant(cls, args):
        return ActivationQuant(torch.int8, -1, None)

    @classmethod
    def scaled_linear(cls, q, s, args, out_dtype):
        op = torch.ops.fxquant.int8_scaled_linear.default
        return op, (q, s, args["weight"], args["scale"], args["bias"], out_dtype)


recipe("int8wo", Int8WeightOnly())
recipe("w8a8", Int8DynamicActivation())
