"""The ``fxquant::`` ops: what a quantized program calls instead of ``aten.linear``.

The rewrite pass (``fxquant.passes.rewrite``) emits these; a saved ``.pt2`` keeps them (so
loading one needs ``import fxquant``, which registers them); ``fxquant.passes.lower`` replaces
them by per-device implementations before Inductor or AOTInductor.

Every op has four faces: the schema (from the signature below), a fake kernel (shapes and dtypes
only, for export and dynamic shapes), the eager kernel, which *is* the reference math of
``fxquant.reference``, and the per-device lowerings in ``fxquant.passes.lower``.
One op per scheme, named ``<scheme.name>_linear``. x is [..., K], the weight [N, K] (int4: packed
[N, Kp/2]); the output is [..., N] in x's dtype.

The fusion pass (``fxquant.passes.fuse``) adds ``norm_quant`` (a norm that writes its output
already quantized, with its scale) and the ``*_scaled_linear`` ops that read such an activation:
a dynamic-activation linear is exactly its activation quantizer followed by its scaled linear.
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


@torch.library.custom_op(f"{_LIB}::float8_static_linear", mutates_args=())
def float8_static_linear(
    x: Tensor, weight: Tensor, scale: Tensor, activation_scale: Tensor, bias: Tensor | None
) -> Tensor:
    """x quantized to e4m3 with the fixed per-tensor ``activation_scale`` [1] · e4m3 W [N, K]
    with ``scale`` [1]."""
    return ref.float8_static_linear(x, weight, scale, activation_scale, bias)


@float8_static_linear.register_fake
def _(x, weight, scale, activation_scale, bias):
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


# --------------------------------------------------------------------------------------------
# Norm → quantize fusion (``fxquant.passes.fuse``): one op normalizes and quantizes the
# activation once, and the linears that read it take the quantized activation and its scale.
# --------------------------------------------------------------------------------------------


@torch.library.custom_op(f"{_LIB}::norm_quant", mutates_args=())
def norm_quant(
    x: Tensor,
    weight: Tensor | None,
    bias: Tensor | None,
    eps: float,
    rms: bool,
    quant_dtype: torch.dtype,
    group_size: int,
    scale_ub: float | None,
) -> tuple[Tensor, Tensor]:
    """RMSNorm (``rms``) or LayerNorm of x [..., K], quantized to ``quant_dtype`` (int8 or e4m3)
    → (q [..., K], fp32 scale [..., 1] per token (``group_size`` -1) or [..., ceil(K/g)])."""
    q, scale, _ = ref.norm_quant(
        x,
        weight,
        bias,
        eps=eps,
        rms=rms,
        quant_dtype=quant_dtype,
        group_size=group_size,
        scale_ub=scale_ub,
    )
    # fp8 groups with a ragged last group come back as a slice of the padded tensor: the op
    # returns dense tensors, as its fake kernel says (and as a kernel would write them)
    return q.contiguous(), scale


@norm_quant.register_fake
def _(x, weight, bias, eps, rms, quant_dtype, group_size, scale_ub):
    groups = 1 if group_size == -1 else -(-x.shape[-1] // group_size)
    q = x.new_empty(x.shape, dtype=quant_dtype)
    return q, x.new_empty((*x.shape[:-1], groups), dtype=torch.float32)


def _scaled_out(xq: Tensor, n: int, out_dtype: torch.dtype) -> Tensor:
    return xq.new_empty((*xq.shape[:-1], n), dtype=out_dtype)


@torch.library.custom_op(f"{_LIB}::int8_scaled_linear", mutates_args=())
def int8_scaled_linear(
    xq: Tensor,
    xs: Tensor,
    weight: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """int8 xq [..., K] with per-token scale xs [..., 1] · int8 W [N, K] with ``scale`` [N]."""
    return ref.int8_scaled_linear(xq, xs, weight, scale, bias, out_dtype=out_dtype)


@int8_scaled_linear.register_fake
def _(xq, xs, weight, scale, bias, out_dtype):
    return _scaled_out(xq, weight.shape[0], out_dtype)


@torch.library.custom_op(f"{_LIB}::float8_scaled_linear", mutates_args=())
def float8_scaled_linear(
    xq: Tensor,
    xs: Tensor,
    weight: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    """e4m3 xq [..., K] with per-token scale xs [..., 1] · e4m3 W [N, K] with ``scale`` [N]."""
    return ref.float8_scaled_linear(xq, xs, weight, scale, bias, out_dtype=out_dtype)


@float8_scaled_linear.register_fake
def _(xq, xs, weight, scale, bias, out_dtype):
    return _scaled_out(xq, weight.shape[0], out_dtype)


@torch.library.custom_op(f"{_LIB}::float8_block_scaled_linear", mutates_args=())
def float8_block_scaled_linear(
    xq: Tensor,
    xs: Tensor,
    weight: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    block_size: int,
    out_dtype: torch.dtype,
) -> Tensor:
    """e4m3 xq [..., K] with 1×b group scales xs [..., ceil(K/b)] · e4m3 W [N, K] with b×b tile
    scales."""
    return ref.float8_block_scaled_linear(
        xq, xs, weight, scale, bias, block_size=block_size, out_dtype=out_dtype
    )


@float8_block_scaled_linear.register_fake
def _(xq, xs, weight, scale, bias, block_size, out_dtype):
    return _scaled_out(xq, weight.shape[0], out_dtype)
