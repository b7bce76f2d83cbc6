"""Microscaling formats: OCP MXFP8 (``mxfp8``) and MXFP4 (``mxfp4``, also mixture-of-experts
weights), NVIDIA NVFP4 (``nvfp4``).

Declarations (``fxquant.core.scheme``); reference math in ``fxquant.core.reference_mx``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from fxquant.core import reference_mx as ref_mx
from fxquant.core.scheme import QuantizedWeight, Scheme, check_choice, recipe, register_scheme

# --------------------------------------------------------------------------------------------
# Blocks run along K, so K must be a multiple of the block; such a layer is skipped with the
# reason, never padded (a zero-padded activation block would still need a real scale, and the
# checkpoints these formats come from never pad).
# --------------------------------------------------------------------------------------------

_MX_RULES = ("floor", "ceil", "even")


def _block_reason(scheme: str, in_features: int, block: int) -> str | None:
    if in_features % block:
        return f"in_features={in_features} is not a multiple of {block} ({scheme} blocks along K)"
    return None


@register_scheme
@dataclass(frozen=True, kw_only=True)
class MXFP8(Scheme):
    """OCP MXFP8: e4m3 weights and activations, one power-of-two (E8M0) scale per 32 values
    along K (weights per output row, activations per token, at run time).

    Recipe ``mxfp8``. ``fxquant.quantize`` with an MXFP8-trained ``Float8Recipe`` exports this
    scheme with ``scale_rule="ceil"``, the rule its training casts used.

    Args:
        scale_rule: the shared exponent: ``"floor"`` (default), floor(log2(amax)) - 8 as the
            OCP spec and torchao's default (the block's largest values may saturate at 448);
            ``"ceil"``, ceil(log2(amax / 448)) as Transformer Engine and torchao's RCEIL (nothing
            saturates).
    """

    name: ClassVar[str] = "mxfp8"
    quantizes_activation: ClassVar[bool] = True
    constants = ("qweight", "scale")  # e4m3 [N, K], E8M0 uint8 [N, K/32]
    op_params = (("scale_rule", "str"),)
    reference = staticmethod(ref_mx.mxfp8_linear)
    scale_rule: str = "floor"

    def __post_init__(self) -> None:
        check_choice("MXFP8", "scale_rule", self.scale_rule, ("floor", "ceil"))

    def unsupported_reason(self, *, out_features: int, in_features: int) -> str | None:
        return _block_reason("MXFP8", in_features, 32)

    def quantize(self, w):
        q, s = ref_mx.mx_quantize(w, elem="e4m3", rule=self.scale_rule)
        return QuantizedWeight({"qweight": q, "scale": s}, ref_mx.mx_dequantize(q, s, elem="e4m3"))


@register_scheme
@dataclass(frozen=True, kw_only=True)
class MXFP4(Scheme):
    """OCP MXFP4: e2m1 weights (two per byte), one E8M0 scale per 32 values along K; activations
    in float, or quantized to MXFP4 per token at run time.

    Recipe ``mxfp4`` (weight-only, the form gpt-oss ships). Sizes: 4.25 bits a weight.

    Args:
        activations: ``False`` (default): activations stay in float (w4a16); ``True``: they are
            MXFP4-quantized too (w4a4, compressed-tensors' ``MXFP4`` preset).
        scale_rule: the shared exponent: ``"floor"`` (default), floor(log2(amax)) - 2, the OCP
            spec's and torchao's default (values above 6 × scale saturate); ``"ceil"``,
            ceil(log2(amax / 6)), triton_kernels' ``downcast_to_mxfp`` (ROUND_UP, how
            transformers quantizes gpt-oss) and fouroversix; ``"even"``, amax rounded to one
            mantissa bit first, torchao's EVEN and compressed-tensors' rule.
    """

    name: ClassVar[str] = "mxfp4"
    constants = ("qweight", "scale")  # e2m1 packed [N, K/2] (experts [E, N, K/2]), E8M0 [N, K/32]
    op_params = (("activations", "bool"), ("scale_rule", "str"))

    @staticmethod
    def reference(x, weight, scale, bias, *, activations, scale_rule):
        rule = scale_rule if activations else None
        return ref_mx.mxfp4_linear(x, weight, scale, bias, activation_rule=rule)

    activations: bool = False
    scale_rule: str = "floor"

    def __post_init__(self) -> None:
        check_choice("MXFP4", "activations", self.activations, (True, False))
        check_choice("MXFP4", "scale_rule", self.scale_rule, _MX_RULES)

    @property
    def quantizes_activation(self) -> bool:  # type: ignore[override]
        return self.activations

    def unsupported_reason(self, *, out_features: int, in_features: int) -> str | None:
        return _block_reason("MXFP4", in_features, 32)

    def quantize(self, w):
        # W [N, K], or experts' [E, N, K]: the blocks run along K either way
        packed, s = ref_mx.quantize_mxfp4_weight(w, rule=self.scale_rule)
        dq = ref_mx.dequantize_mxfp4_weight(packed, s)
        return QuantizedWeight({"qweight": packed, "scale": s}, dq)

    @property
    def takes_experts(self) -> bool:  # type: ignore[override]
        return not self.activations  # weight-only MXFP4: the format gpt-oss ships

    def grouped_op_args(self, x, constants, offs):
        if not self.takes_experts:
            return super().grouped_op_args(x, constants, offs)
        op = torch.ops.fxquant.mxfp4_grouped_mm.default
        return op, (x, constants["qweight"], constants["scale"], offs)


@register_scheme
@dataclass(frozen=True, kw_only=True)
class NVFP4(Scheme):
    """NVIDIA NVFP4: e2m1 values (two per byte), one e4m3 scale per 16 values along K and one
    fp32 scale per tensor (amax / (6 · 448)); activations quantized the same way at run time
    (their tensor scale from the whole activation's amax), or kept in float.

    Recipe ``nvfp4`` (w4a4). Sizes: 4.5 bits a weight.

    Args:
        activations: ``True`` (default): w4a4; ``False``: weights only, activations in float.
        scale_rule: ``"six"`` (default): every block's amax maps to 6 (standard NVFP4);
            ``"four_over_six"``: each block is quantized with its amax mapped to 6 and to 4 and
            keeps the lower squared error (Four Over Six, ``FourOverSixConfig``'s default
            ``"mse"``); the tensor scale is then amax / (6 · 256), as fouroversix does. Weights
            and activations use the same rule.
    """

    name: ClassVar[str] = "nvfp4"
    # e2m1 packed [N, K/2], e4m3 block scales [N, K/16], fp32 tensor scale [1]
    constants = ("qweight", "scale", "tensor_scale")
    op_params = (("activations", "bool"), ("scale_rule", "str"))

    @staticmethod
    def reference(x, weight, scale, tensor_scale, bias, *, activations, scale_rule):
        rule = scale_rule if activations else None
        return ref_mx.nvfp4_linear(x, weight, scale, tensor_scale, bias, activation_rule=rule)

    activations: bool = True
    scale_rule: str = "six"

    def __post_init__(self) -> None:
        check_choice("NVFP4", "activations", self.activations, (True, False))
        check_choice("NVFP4", "scale_rule", self.scale_rule, ("six", "four_over_six"))

    @property
    def quantizes_activation(self) -> bool:  # type: ignore[override]
        return self.activations

    def unsupported_reason(self, *, out_features: int, in_features: int) -> str | None:
        return _block_reason("NVFP4", in_features, 16)

    def quantize(self, w):
        packed, s, g = ref_mx.quantize_nvfp4_weight(w, rule=self.scale_rule)
        dq = ref_mx.dequantize_nvfp4_weight(packed, s, g)
        return QuantizedWeight({"qweight": packed, "scale": s, "tensor_scale": g}, dq)


recipe("mxfp8", MXFP8())
recipe("mxfp4", MXFP4())
recipe("nvfp4", NVFP4())
