"""One handler per scheme: how its weight is quantized and which ``fxquant::`` op replaces the node.

Used by the rewrite pass (``fxquant.passes.rewrite``). Handlers are found by the scheme's type
through a small registry, so adding a scheme is a config class, a reference, an op and one
handler here, with no mode strings anywhere.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

import fxquant.ops  # noqa: F401  (registers the fxquant:: ops)
from fxquant import reference as ref
from fxquant.config import (
    Float8Block,
    Float8Dynamic,
    Float8Static,
    Float8WeightOnly,
    Int4WeightOnly,
    Int8DynamicActivation,
    Int8WeightOnly,
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


@register(
    Int4WeightOnly,
    op_args=lambda s, x, c, b: (fxq.int4_weight_only_linear.default, (x, *c, b, s.group_size)),
)
def _(scheme, w):
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
