"""The ``fxquant::`` ops: what a quantized program calls instead of ``aten.linear``.

The rewrite pass (``fxquant.passes.rewrite``) emits these; a saved ``.pt2`` keeps them (so
loading one needs ``import fxquant``, which registers them); ``fxquant.passes.lower`` replaces
them by per-device implementations before Inductor or AOTInductor.

Every op has four faces: the schema (from the signature below), a fake kernel (shapes and dtypes
only, for export and dynamic shapes), the eager kernel, which *is* the reference math of
``fxquant.reference``, and the per-device lowerings in ``fxquant.passes.lower``.
One op per scheme, named ``<scheme.name>_linear``. x is [..., K], the weight [N, K] (int4: packed
[N, Kp/2]); the output is [..., N] in x's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fxquant import reference as ref

_LIB = "fxquant"


def _out_like(x: Tensor, n: int) -> Tensor:
    return x.new_empty((*x.shape[:-1], n))


@torch.library.custom_op(f"{_LIB}::int8_weight_only_linear", mutates_args=())
def int8_weight_only_linear(
    x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None
) -> Tensor:
    """x float [..., K] · int8 W [N, K] with fp32 per-channel ``scale`` [N]."""
    return ref.int8_weight_only_linear(x, weight, scale, bias)


@int8_weight_only_linear.register_fake
def _(x, weight, scale, bias):
    return _out_like(x, weight.shape[0])


@torch.library.custom_op(f"{_LIB}::int4_weight_only_linear", mutates_args=())
def int4_weight_only_linear(
    x: Tensor, weight: Tensor, scale: Tensor, zero: Tensor, bias: Tensor | None, group_size: int
) -> Tensor:
    """x float [..., K] · packed uint4 W [N, Kp/2], ``scale`` fp32 and ``zero`` uint8 [N, Kp/g]."""
    return ref.int4_weight_only_linear(x, weight, scale, zero, bias, group_size=group_size)


@int4_weight_only_linear.register_fake
def _(x, weight, scale, zero, bias, group_size):
    return _out_like(x, weight.shape[0])


@torch.library.custom_op(f"{_LIB}::int8_dynamic_linear", mutates_args=())
def int8_dynamic_linear(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """x quantized to int8 per token at run time · int8 W [N, K], per-channel ``scale`` [N]."""
    return ref.int8_dynamic_linear(x, weight, scale, bias)


@int8_dynamic_linear.register_fake
def _(x, weight, scale, bias):
    return _out_like(x, weight.shape[0])


@torch.library.custom_op(f"{_LIB}::float8_weight_only_linear", mutates_args=())
def float8_weight_only_linear(
    x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None
) -> Tensor:
    """x float [..., K] · e4m3 W [N, K] with fp32 per-channel ``scale`` [N]."""
    return ref.float8_weight_only_linear(x, weight, scale, bias)


@float8_weight_only_linear.register_fake
def _(x, weight, scale, bias):
    return _out_like(x, weight.shape[0])


@torch.library.custom_op(f"{_LIB}::float8_dynamic_linear", mutates_args=())
def float8_dynamic_linear(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    per_row: bool,
    activation_scale_ub: float | None,
) -> Tensor:
    """x quantized to e4m3 at run time (per token if ``per_row``, else per tensor) · e4m3 W [N, K]
    with ``scale`` [N] (per row) or [1] (per tensor)."""
    return ref.float8_dynamic_linear(
        x, weight, scale, bias, per_row=per_row, activation_scale_ub=activation_scale_ub
    )


@float8_dynamic_linear.register_fake
def _(x, weight, scale, bias, per_row, activation_scale_ub):
    return _out_like(x, weight.shape[0])


@torch.library.custom_op(f"{_LIB}::float8_block_linear", mutates_args=())
def float8_block_linear(
    x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None, block_size: int
) -> Tensor:
    """x quantized to e4m3 in 1×b groups at run time · e4m3 W [N, K] with b×b tile scales."""
    return ref.float8_block_linear(x, weight, scale, bias, block_size=block_size)


@float8_block_linear.register_fake
def _(x, weight, scale, bias, block_size):
    return _out_like(x, weight.shape[0])
