"""One handler per scheme: how its weight is quantized and which ``fxquant::`` op replaces the node.

Used by the rewrite pass (``fxquant.passes.rewrite``). Handlers are found by the scheme's type
through a small registry, so adding a scheme is a config class, a reference, an op and one
handler here, with no mode strings anywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

import fxquant.core.ops  # noqa: F401  (registers the fxquant:: ops)
from fxquant.core import reference as ref
from fxquant.core import reference_bnb as ref_bnb
from fxquant.core import reference_lowbit as ref_lowbit
from fxquant.core import reference_mx as ref_mx
from fxquant.core.config import (
    MXFP4,
    MXFP8,
    NVFP4,
    BitNetTernary,
    Bnb4WeightOnly,
    Float8Block,
    Float8Dynamic,
    Float8Static,
    Float8WeightOnly,
    Int4WeightOnly,
    Int8DynamicActivation,
    Int8DynamicActivationInt4,
    Int8WeightOnly,
    IntxWeightOnly,
    LLMInt8,
    Scheme,
)

fxq = torch.ops.fxquant


@dataclass
class QuantizedWeight:
    """A weight in a scheme's storage form: the constants the op takes, in argument order."""

    tensors: dict[str, torch.Tensor]
    # fp32 [N, K], for the report's SQNR against the graph's float weight; None when that
    # weight is not the one these constants came from (a checkpoint loaded into a skeleton)
    dequantized: torch.Tensor | None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True)
class Handler:
    quantize: Callable[[Scheme, torch.Tensor], QuantizedWeight]
    # (scheme, x node, constant nodes in order, bias node or None) → (op overload, args)
    op_args: Callable[[Scheme, object, list, object], tuple]


HANDLERS: dict[type[Scheme], Handler] = {}


def register(scheme_type: type[Scheme], *, op_args):
    def wrap(quantize):
        HANDLERS[scheme_type] = Handler(quantize, op_args)
        return quantize

    return wrap


def check_layout(scheme: Scheme, weight_name: str, shape: tuple, given: QuantizedWeight) -> None:
    """Raise unless ``given`` has the constants (names, shapes, dtypes) the scheme's op takes for
    a weight of ``shape``: a precomputed weight (calibration, a loaded checkpoint) must be exactly
    what the rewrite would have stored, or the op would read it wrong."""
    # Quantizing zeros is cheap, exact about layout, and the all-zero path never NaNs.
    want = handler_for(scheme).quantize(scheme, torch.zeros(shape)).tensors
    got = given.tensors

    def layout(ts):
        return {k: (tuple(t.shape), t.dtype) for k, t in ts.items()}

    if list(got) != list(want) or layout(got) != layout(want):
        raise ValueError(
            f"precomputed weight for {weight_name!r} does not match the scheme "
            f"{scheme.to_dict()} for a weight of shape {list(shape)}: expected constants "
            f"{layout(want)}, got {layout(got)}"
        )


def handler_for(scheme: Scheme) -> Handler:
    try:
        return HANDLERS[type(scheme)]
    except KeyError:
        raise NotImplementedError(f"no rewrite handler for {type(scheme).__name__}") from None


# int8 weight-only and w8a8 store the same weight; only the op (what happens to x) differs.
@register(
    Int8DynamicActivation,
    op_args=lambda s, x, c, b: (fxq.int8_dynamic_linear.default, (x, *c, b)),
)
@register(
    Int8WeightOnly,
    op_args=lambda s, x, c, b: (fxq.int8_weight_only_linear.default, (x, *c, b)),
)
def _int8_per_channel(scheme, w):
    q, s = ref.quantize_int8_per_channel(w)
    return QuantizedWeight({"qweight": q, "scale": s}, ref.dequantize_int8_per_channel(q, s))


# W4A8 stores int4 weight-only's weight; only the op (x quantized per token first) differs.
@register(
    Int8DynamicActivationInt4,
    op_args=lambda s, x, c, b: (fxq.int8_dynamic_int4_linear.default, (x, *c, b, s.group_size)),
)
@register(
    Int4WeightOnly,
    op_args=lambda s, x, c, b: (fxq.int4_weight_only_linear.default, (x, *c, b, s.group_size)),
)
def _int4_grouped(scheme, w):
    packed, s, z = ref.quantize_int4_grouped(
        w, group_size=scheme.group_size, symmetric=scheme.symmetric
    )
    dq = ref.dequantize_int4_grouped(packed, s, z, group_size=scheme.group_size)
    return QuantizedWeight({"qweight": packed, "scale": s, "zero": z}, dq[:, : w.shape[1]])


@register(
    Float8WeightOnly,
    op_args=lambda s, x, c, b: (fxq.float8_weight_only_linear.default, (x, *c, b)),
)
def _(scheme, w):
    q, s = ref.quantize_fp8_per_channel(w)
    return QuantizedWeight({"qweight": q, "scale": s}, q.float() * s[:, None])


@register(
    Float8Dynamic,
    op_args=lambda s, x, c, b: (
        fxq.float8_dynamic_linear.default,
        (x, *c, b, s.per_row, s.activation_scale_ub),
    ),
)
def _(scheme, w):
    if scheme.per_row:
        q, s = ref.quantize_fp8_per_channel(w)
        dq = q.float() * s[:, None]
    else:
        q, s = ref.quantize_fp8_per_tensor(w)
        dq = q.float() * s
    return QuantizedWeight({"qweight": q, "scale": s}, dq)


@register(
    Float8Static,
    op_args=lambda s, x, c, b: (fxq.float8_static_linear.default, (x, *c, b)),
)
def _(scheme, w):
    q, s = ref.quantize_fp8_per_tensor(w)
    xs = torch.tensor([scheme.activation_scale], dtype=torch.float32)
    return QuantizedWeight({"qweight": q, "scale": s, "activation_scale": xs}, q.float() * s)


@register(
    Float8Block,
    op_args=lambda s, x, c, b: (fxq.float8_block_linear.default, (x, *c, b, s.block_size)),
)
def _(scheme, w):
    q, s = ref.quantize_fp8_blocks(w, block_size=scheme.block_size)
    n, k = w.shape
    dq = q.float() * ref.expand_block_scale(s, rows=n, cols=k, block_size=scheme.block_size)
    return QuantizedWeight({"qweight": q, "scale": s}, dq)


# Microscaling formats: the weight's blocks run along K, as the activation's do.


@register(
    MXFP8,
    op_args=lambda s, x, c, b: (fxq.mxfp8_linear.default, (x, *c, b, s.scale_rule)),
)
def _(scheme, w):
    q, s = ref_mx.mx_quantize(w, elem="e4m3", rule=scheme.scale_rule)
    return QuantizedWeight({"qweight": q, "scale": s}, ref_mx.mx_dequantize(q, s, elem="e4m3"))


@register(
    MXFP4,
    op_args=lambda s, x, c, b: (
        fxq.mxfp4_linear.default,
        (x, *c, b, s.activations, s.scale_rule),
    ),
)
def _(scheme, w):
    # W [N, K], or experts' [E, N, K]: the blocks run along K either way
    packed, s = ref_mx.quantize_mxfp4_weight(w, rule=scheme.scale_rule)
    dq = ref_mx.dequantize_mxfp4_weight(packed, s)
    return QuantizedWeight({"qweight": packed, "scale": s}, dq)


def grouped_op_args(scheme: Scheme, x, constants: list, offs) -> tuple:
    """The op replacing a mixture-of-experts ``grouped_mm`` site (planning admits only weight-only
    MXFP4 there: the format gpt-oss ships its experts in)."""
    if not (isinstance(scheme, MXFP4) and not scheme.activations):
        raise NotImplementedError(f"no grouped (experts) op for {scheme.to_dict()}")
    return fxq.mxfp4_grouped_mm.default, (x, *constants, offs)


@register(
    NVFP4,
    op_args=lambda s, x, c, b: (
        fxq.nvfp4_linear.default,
        (x, *c, b, s.activations, s.scale_rule),
    ),
)
def _(scheme, w):
    packed, s, g = ref_mx.quantize_nvfp4_weight(w, rule=scheme.scale_rule)
    dq = ref_mx.dequantize_nvfp4_weight(packed, s, g)
    return QuantizedWeight({"qweight": packed, "scale": s, "tensor_scale": g}, dq)


@register(
    IntxWeightOnly,
    op_args=lambda s, x, c, b: (
        fxq.intx_weight_only_linear.default,
        (x, *c, b, s.bits, s.group_size),
    ),
)
def _(scheme, w):
    packed, s, z = ref_lowbit.quantize_intx_grouped(
        w,
        bits=scheme.bits,
        group_size=scheme.group_size,
        symmetric=scheme.symmetric,
        zero_point=scheme.zero_point,
        optimizer=scheme.optimizer,
    )
    dq = ref_lowbit.dequantize_intx_grouped(
        packed, s, z, bits=scheme.bits, group_size=scheme.group_size
    )
    return QuantizedWeight({"qweight": packed, "scale": s, "zero": z}, dq[:, : w.shape[1]])


@register(
    BitNetTernary,
    op_args=lambda s, x, c, b: (fxq.bitnet_linear.default, (x, *c, b)),
)
def _(scheme, w):
    packed, ws = ref_lowbit.quantize_bitnet_weight(w)
    dq = ref_lowbit.unpack_bitnet(packed).float() / ws
    # "weight_scale": transformers' BitLinear buffer name, and its meaning (1 / mean|W|)
    return QuantizedWeight({"qweight": packed, "weight_scale": ws}, dq)


def _bnb4_op_args(scheme, x, c, b):
    # 3 constants (qweight, absmax, quant_map), or 6 with double quant (+ the nested three)
    nested = list(c[3:]) if len(c) == 6 else [None, None, None]
    return fxq.bnb4_weight_only_linear.default, (x, *c[:3], *nested, b, scheme.block_size)


@register(Bnb4WeightOnly, op_args=_bnb4_op_args)
def _(scheme, w):
    t = ref_bnb.quantize_4bit(
        w,
        quant_type=scheme.quant_type,
        block_size=scheme.block_size,
        double_quant=scheme.double_quant,
    )
    names = ("qweight", "absmax", "quant_map", "nested_absmax", "nested_quant_map")
    dq = ref_bnb.dequantize_4bit(
        *(t.get(n) for n in names), t.get("nested_offset"), block_size=scheme.block_size
    )
    return QuantizedWeight(t, dq)


@register(
    LLMInt8,
    op_args=lambda s, x, c, b: (fxq.llm_int8_linear.default, (x, *c, b, s.threshold)),
)
def _(scheme, w):
    q, scb = ref_bnb.quantize_llm_int8_weight(w)
    # "absmax": bnb's SCB, the row's absmax (the dequant multiplier is absmax / 127)
    return QuantizedWeight({"qweight": q, "absmax": scb}, q.float() * (scb[:, None] / 127))
