"""The ``fxquant::`` ops: what a quantized program calls instead of ``aten.linear``.

The rewrite pass (``fxquant.passes.rewrite``) emits these; a saved ``.pt2`` keeps them (so
loading one needs ``import fxquant``, which registers them); ``fxquant.passes.lower`` replaces
them by per-device implementations before Inductor or AOTInductor.

Every op has four faces: the schema (from the signature below), a fake kernel (shapes and dtypes
only, for export and dynamic shapes), the eager kernel, which *is* the reference math of
``fxquant.core.reference``, and the per-device lowerings in ``fxquant.passes.lower``.
One op per scheme, named ``<scheme.name>_linear``. x is [..., K], the weight [N, K] (int4: packed
[N, Kp/2]); the output is [..., N] in x's dtype.

The fusion pass (``fxquant.passes.fuse``) adds ``norm_quant`` (a norm that writes its output
already quantized, with its scale) and the ``*_scaled_linear`` ops that read such an activation:
a dynamic-activation linear is exactly its activation quantizer followed by its scaled linear.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fxquant.core import reference as ref
from fxquant.core import reference_bnb as ref_bnb
from fxquant.core import reference_lowbit as ref_lowbit
from fxquant.core import reference_mx as ref_mx

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


@torch.library.custom_op(f"{_LIB}::int8_dynamic_int4_linear", mutates_args=())
def int8_dynamic_int4_linear(
    x: Tensor, weight: Tensor, scale: Tensor, zero: Tensor, bias: Tensor | None, group_size: int
) -> Tensor:
    """x quantized to int8 per token at run time · int4 W in ``int4_weight_only_linear``'s
    layout (packed uint4 [N, Kp/2], ``scale`` fp32 and ``zero`` uint8 [N, Kp/g])."""
    return ref.int8_dynamic_int4_linear(x, weight, scale, zero, bias, group_size=group_size)


@int8_dynamic_int4_linear.register_fake
def _(x, weight, scale, zero, bias, group_size):
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


# Microscaling formats (``fxquant.core.reference_mx``): blocks along K with E8M0 (MX) or e4m3
# (NVFP4) scales; e2m1 weights are packed two per byte along K.


@torch.library.custom_op(f"{_LIB}::mxfp8_linear", mutates_args=())
def mxfp8_linear(
    x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None, scale_rule: str
) -> Tensor:
    """x quantized to MXFP8 at run time · e4m3 W [N, K] with E8M0 (uint8) scales [N, K/32]."""
    return ref_mx.mxfp8_linear(x, weight, scale, bias, scale_rule=scale_rule)


@mxfp8_linear.register_fake
def _(x, weight, scale, bias, scale_rule):
    return _out_like(x, weight.shape[0])


@torch.library.custom_op(f"{_LIB}::mxfp4_linear", mutates_args=())
def mxfp4_linear(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    activations: bool,
    scale_rule: str,
) -> Tensor:
    """x (float, or MXFP4-quantized at run time if ``activations``) · packed e2m1 W [N, K/2]
    with E8M0 (uint8) scales [N, K/32]."""
    rule = scale_rule if activations else None
    return ref_mx.mxfp4_linear(x, weight, scale, bias, activation_rule=rule)


@mxfp4_linear.register_fake
def _(x, weight, scale, bias, activations, scale_rule):
    return _out_like(x, weight.shape[0])


@torch.library.custom_op(f"{_LIB}::mxfp4_grouped_mm", mutates_args=())
def mxfp4_grouped_mm(x: Tensor, weight: Tensor, scale: Tensor, offs: Tensor) -> Tensor:
    """Expert GEMM: x [S, K] (rows sorted by expert, ``offs`` [E] their cumulative ends) · the
    row's expert's packed e2m1 W [E, N, K/2] with E8M0 scales [E, N, K/32] → [S, N]."""
    return ref_mx.mxfp4_grouped_mm(x, weight, scale, offs)


@mxfp4_grouped_mm.register_fake
def _(x, weight, scale, offs):
    return x.new_empty((x.shape[0], weight.shape[1]))


@torch.library.custom_op(f"{_LIB}::nvfp4_linear", mutates_args=())
def nvfp4_linear(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    tensor_scale: Tensor,
    bias: Tensor | None,
    activations: bool,
    scale_rule: str,
) -> Tensor:
    """x (float, or NVFP4-quantized at run time if ``activations``) · packed e2m1 W [N, K/2]
    with e4m3 block scales [N, K/16] and an fp32 ``tensor_scale`` [1]."""
    rule = scale_rule if activations else None
    return ref_mx.nvfp4_linear(x, weight, scale, tensor_scale, bias, activation_rule=rule)


@nvfp4_linear.register_fake
def _(x, weight, scale, tensor_scale, bias, activations, scale_rule):
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


# --------------------------------------------------------------------------------------------
# Low-bit weights (``fxquant.core.reference_lowbit``): int2/int3/int6 (and float-zero int4) grouped
# weight-only, and BitNet's ternary weights × int8 per-token activations.
# --------------------------------------------------------------------------------------------


@torch.library.custom_op(f"{_LIB}::intx_weight_only_linear", mutates_args=())
def intx_weight_only_linear(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    zero: Tensor,
    bias: Tensor | None,
    bits: int,
    group_size: int,
) -> Tensor:
    """x float [..., K] · packed ``bits``-bit W [N, Kp*bits/8], ``scale`` fp32 and ``zero``
    (uint8 or fp32) [N, Kp/g]; w = (u - z) * s."""
    return ref_lowbit.intx_weight_only_linear(
        x, weight, scale, zero, bias, bits=bits, group_size=group_size
    )


@intx_weight_only_linear.register_fake
def _(x, weight, scale, zero, bias, bits, group_size):
    return _out_like(x, weight.shape[0])


@torch.library.custom_op(f"{_LIB}::bitnet_linear", mutates_args=())
def bitnet_linear(x: Tensor, weight: Tensor, weight_scale: Tensor, bias: Tensor | None) -> Tensor:
    """x quantized to int8 per token at run time (127 / amax) · ternary W packed uint8
    [N/4, K] (transformers' layout) with the multiplier ``weight_scale`` [1] = 1 / mean|W|."""
    return ref_lowbit.bitnet_linear(x, weight, weight_scale, bias)


@bitnet_linear.register_fake
def _(x, weight, weight_scale, bias):
    return _out_like(x, 4 * weight.shape[0])


# --------------------------------------------------------------------------------------------
# bitsandbytes formats (``fxquant.core.reference_bnb``): NF4 / FP4 4-bit weights and LLM.int8.
# --------------------------------------------------------------------------------------------


@torch.library.custom_op(f"{_LIB}::bnb4_weight_only_linear", mutates_args=())
def bnb4_weight_only_linear(
    x: Tensor,
    weight: Tensor,
    absmax: Tensor,
    quant_map: Tensor,
    nested_absmax: Tensor | None,
    nested_quant_map: Tensor | None,
    nested_offset: Tensor | None,
    bias: Tensor | None,
    block_size: int,
) -> Tensor:
    """x float [..., K] · bnb 4-bit W [N, K]: ``weight`` uint8 [N, K/2] (bnb's flat packing,
    high nibble first, viewed as N rows), ``absmax`` fp32 [ceil(N·K/b)] over the flattened W
    (uint8 with double quant, and then the three ``nested_*`` tensors are given), ``quant_map``
    fp32 [16]."""
    return ref_bnb.bnb4_weight_only_linear(
        x,
        weight,
        absmax,
        quant_map,
        nested_absmax,
        nested_quant_map,
        nested_offset,
        bias,
        block_size=block_size,
    )


@bnb4_weight_only_linear.register_fake
def _(
    x,
    weight,
    absmax,
    quant_map,
    nested_absmax,
    nested_quant_map,
    nested_offset,
    bias,
    block_size,
):
    return _out_like(x, weight.shape[0])


@torch.library.custom_op(f"{_LIB}::llm_int8_linear", mutates_args=())
def llm_int8_linear(
    x: Tensor, weight: Tensor, absmax: Tensor, bias: Tensor | None, threshold: float
) -> Tensor:
    """LLM.int8: x [..., K] quantized per token at run time (outlier columns, |x| >= threshold,
    in float) · int8 W [N, K] with its row absmax ``absmax`` fp32 [N] (bnb's SCB)."""
    return ref_bnb.llm_int8_linear(x, weight, absmax, bias, threshold=threshold)


@llm_int8_linear.register_fake
def _(x, weight, absmax, bias, threshold):
    return _out_like(x, weight.shape[0])
