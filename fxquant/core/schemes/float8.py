"""float8 e4m3 inference schemes: weight-only (``fp8wo``), dynamic activations per token or
per tensor (``fp8-row``, ``fp8-tensor``), a fixed activation scale (``Float8Static``, the
inference form of delayed-scaling FP8 training) and DeepSeek-V3 blocks (``fp8-block``).

Declarations (``fxquant.core.scheme``); reference math in ``fxquant.core.reference``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from fxquant.core import reference as ref
from fxquant.core.scheme import (
    ActivationQuant,
    QuantizedWeight,
    Scheme,
    check_choice,
    check_number,
    recipe,
    register_scheme,
)

_E4M3 = torch.float8_e4m3fn

PER_TENSOR_REASON = (
    "quantizes its activation per tensor, whose scale needs the whole tensor's amax before any "
    "row is written"
)


class _Float8PerRow(Scheme):
    constants = ("qweight", "scale")  # e4m3 [N, K], fp32 [N]

    def quantize(self, w):  # W [N, K], or experts' [E, N, K]: a scale per expert and channel
        q, s = ref.quantize_fp8_per_channel(w)
        return QuantizedWeight({"qweight": q, "scale": s}, q.float() * s[..., None])


@register_scheme
@dataclass(frozen=True, kw_only=True)
class Float8WeightOnly(_Float8PerRow):
    """float8 e4m3 weights, one scale (amax / 448) per output channel; activations in float.

    Recipe ``fp8wo``.
    """

    name: ClassVar[str] = "float8_weight_only"
    reference = staticmethod(ref.float8_weight_only_linear)

    @property
    def takes_experts(self) -> bool:  # type: ignore[override]
        return True

    def grouped_op_args(self, x, constants, offs):
        # experts [E, N, K] per output channel of each expert, as int8wo's
        op = torch.ops.fxquant.float8_weight_only_grouped_mm.default
        return op, (x, constants["qweight"], constants["scale"], offs)


@register_scheme
@dataclass(frozen=True, kw_only=True)
class Float8Dynamic(Scheme):
    """float8 e4m3 weights and activations, the activation scale computed at run time.

    Args:
        granularity: ``"row"``: weights per output channel, activations per token (recipe
            ``fp8-row``, FbgemmFp8Config's layout); ``"tensor"``: one scale for each
            (``fp8-tensor``).
        activation_scale_ub: upper bound on the activation amax before the scale is taken, so one
            outlier token cannot flatten the rest; FbgemmFp8Config uses 1200. ``None``: no bound.
    """

    name: ClassVar[str] = "float8_dynamic"
    quantizes_activation: ClassVar[bool] = True
    constants = ("qweight", "scale")  # e4m3 [N, K], fp32 [N] (per row) or [1] (per tensor)
    op_params = (("per_row", "bool"), ("activation_scale_ub", "float?"))
    reference = staticmethod(ref.float8_dynamic_linear)
    granularity: str = "row"
    activation_scale_ub: float | None = None

    def __post_init__(self) -> None:
        check_choice("Float8Dynamic", "granularity", self.granularity, ("row", "tensor"))
        if self.activation_scale_ub is not None:
            ub = check_number(
                "Float8Dynamic",
                "activation_scale_ub",
                self.activation_scale_ub,
                ok=lambda v: v > 0,
                allowed="None or a positive number (FbgemmFp8Config uses 1200.0)",
            )
            object.__setattr__(self, "activation_scale_ub", ub)

    @property
    def per_row(self) -> bool:
        return self.granularity == "row"

    def quantize(self, w):
        if self.per_row:  # W [N, K], or experts' [E, N, K]: a scale per expert and channel
            q, s = ref.quantize_fp8_per_channel(w)
            return QuantizedWeight({"qweight": q, "scale": s}, q.float() * s[..., None])
        q, s = ref.quantize_fp8_per_tensor(w)
        return QuantizedWeight({"qweight": q, "scale": s}, q.float() * s)

    @property
    def takes_experts(self) -> bool:  # type: ignore[override]
        # per row only (FbgemmFp8Config's experts): one per-tensor scale over every expert is
        # no layout any library stores
        return self.per_row

    def grouped_op_args(self, x, constants, offs):
        if not self.per_row:
            return super().grouped_op_args(x, constants, offs)
        op = torch.ops.fxquant.float8_dynamic_grouped_mm.default
        ub = self.activation_scale_ub
        return op, (x, constants["qweight"], constants["scale"], offs, ub)

    @classmethod
    def activation_quant(cls, args):
        if not args["per_row"]:
            return PER_TENSOR_REASON
        return ActivationQuant(_E4M3, -1, args["activation_scale_ub"])

    @classmethod
    def scaled_linear(cls, q, s, args, out_dtype):
        op = torch.ops.fxquant.float8_scaled_linear.default
        return op, (q, s, args["weight"], args["scale"], args["bias"], out_dtype)


@register_scheme
@dataclass(frozen=True, kw_only=True)
class Float8Static(Scheme):
    """float8 e4m3 weights (one per-tensor scale) × activations quantized with a fixed
    per-tensor scale: the inference form of an FP8-trained layer with delayed scaling, whose
    trained input scale is frozen in (``fxquant.quantize`` with a ``Float8Recipe`` makes one per
    layer). Values beyond ``448 · activation_scale`` saturate.

    Args:
        activation_scale: the activation's dequant multiplier (``1 / scale`` of Transformer
            Engine's input role), a positive finite number.
    """

    name: ClassVar[str] = "float8_static"
    quantizes_activation: ClassVar[bool] = True
    constants = ("qweight", "scale", "activation_scale")  # e4m3 [N, K], fp32 [1], fp32 [1]
    reference = staticmethod(ref.float8_static_linear)
    activation_scale: float

    def __post_init__(self) -> None:
        a = check_number(
            "Float8Static",
            "activation_scale",
            self.activation_scale,
            ok=lambda v: 0 < v < float("inf"),
            allowed="a positive finite number (the activation's dequant multiplier)",
        )
        object.__setattr__(self, "activation_scale", a)

    def quantize(self, w):
        q, s = ref.quantize_fp8_per_tensor(w)
        xs = torch.tensor([self.activation_scale], dtype=torch.float32)
        return QuantizedWeight({"qweight": q, "scale": s, "activation_scale": xs}, q.float() * s)


@register_scheme
@dataclass(frozen=True, kw_only=True)
class Float8Block(Scheme):
    """float8 e4m3 with DeepSeek-V3-style block scales: weights in ``block_size``² tiles,
    activations in 1×``block_size`` groups per token, quantized at run time.

    Recipe ``fp8-block``. Shapes that are not a multiple of the block keep a smaller last block
    (its scale is taken over the elements that exist), so no padding is needed.
    """

    name: ClassVar[str] = "float8_block"
    quantizes_activation: ClassVar[bool] = True
    constants = ("qweight", "scale")  # e4m3 [N, K], fp32 [ceil(N/b), ceil(K/b)]
    op_params = (("block_size", "SymInt"),)
    reference = staticmethod(ref.float8_block_linear)
    block_size: int = 128

    def __post_init__(self) -> None:
        check_choice("Float8Block", "block_size", self.block_size, (32, 64, 128, 256))

    def quantize(self, w):
        if w.dim() == 3:  # experts' [E, N, K]: each expert's tiles as a linear's
            parts = [self.quantize(we) for we in w.unbind(0)]
            stored = {c: torch.stack([p.tensors[c] for p in parts]) for c in self.constants}
            return QuantizedWeight(stored, torch.stack([p.dequantized for p in parts]))
        q, s = ref.quantize_fp8_blocks(w, block_size=self.block_size)
        n, k = w.shape
        dq = q.float() * ref.expand_block_scale(s, rows=n, cols=k, block_size=self.block_size)
        return QuantizedWeight({"qweight": q, "scale": s}, dq)

    @property
    def takes_experts(self) -> bool:  # type: ignore[override]
        return True

    def grouped_op_args(self, x, constants, offs):
        # FineGrainedFP8Config's experts: [E, N, K] in b×b tiles, x in 1×b groups per token
        op = torch.ops.fxquant.float8_block_grouped_mm.default
        return op, (x, constants["qweight"], constants["scale"], offs, self.block_size)

    @classmethod
    def activation_quant(cls, args):
        return ActivationQuant(_E4M3, args["block_size"], None)

    @classmethod
    def scaled_linear(cls, q, s, args, out_dtype):
        op = torch.ops.fxquant.float8_block_scaled_linear.default
        w = (args["weight"], args["scale"], args["bias"], args["block_size"])
        return op, (q, s, *w, out_dtype)


recipe("fp8wo", Float8WeightOnly())
recipe("fp8-row", Float8Dynamic(granularity="row"))
recipe("fp8-tensor", Float8Dynamic(granularity="tensor"))
recipe("fp8-block", Float8Block(block_size=128))
