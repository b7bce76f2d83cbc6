"""The CPU lowering of the int4 family (``fxquant/core/schemes/int4.py``): int4 weight-only
(``int4_weight_only_linear``) and W4A8 (``int8_dynamic_int4_linear``, int4 weights × int8
activations per token). Both store the same weight, so each kernel has one prepacked layout and
two device ops; the int2 / int3 / float-zero int4 codes of the lowbit family
(``fxquant.passes.cpu.lowbit``) run on the same device ops.

Where it sits: registered by op name (``fxquant.core.registry``, ``fxquant.passes.cpu.prepack``)
and read by the lowering pass (``fxquant.passes.lower``).

**aten kernels** (``"cpu"``), measured on the dev CPU (AVX2, 2 cores, no VNNI) by
``benchmarks/aten_kernels.py`` (results in ``benchmarks/results/aten_kernels.json``): int4 uses
``_weight_int4pack_mm_for_cpu`` with the weight repacked by
``_convert_weight_to_int4pack_for_cpu`` and a bf16 [K/g, N, 2] scale/zero table; it needs N
divisible by 16 (padded here) and K a multiple of the group (padded at quantize time). W4A8
takes the same kernel with the int8 codes of its per-token activation as the bf16 input (exact
in bf16) and the token scale after.

**Native kernels** (``"cpu-native"``, ``fxquant.kernels.cpu``): the weight is repacked once into
the kernel's nibble layout with ``offset = -z * s`` (``prepack_codes``), which takes any code in
[0, 15] and any zero point, integer or float: fp32 numerics, no bf16 rounding, no code
shifting. W4A8 takes the same layout into the int4 × int8 kernel, its activation quantized per
token here in aten ops exactly as the reference does. The kernels pick their own path by M (a
GEMV for decode, dequantize-a-chunk + MKL for prefill), so one graph serves every M with no
``torch.cond``.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor

import fxquant.core.ops  # noqa: F401  (registers the fxquant:: ops)
import fxquant.kernels.cpu as native
from fxquant.core import reference as ref
from fxquant.core.registry import lowering
from fxquant.passes.cpu.common import BF16, NATIVE, device_op, epilogue, finish, rows
from fxquant.passes.cpu.dispatch import by_m, candidates, dispatches
from fxquant.passes.cpu.prepack import prepack_rule

fxq = torch.ops.fxquant
_INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu: "expect N to be dividable by 16"
_GROUPED = ("weight", "scale", "zero")  # the constant arguments both ops' prepack rules read
W4A8_GROUPS = (32, 64, 128, 256)  # native_int8_int4_linear's group sizes (its int16 sums)


# --------------------------------------------------------------------------------------------
# aten: semantic ops without a prepack (weights the pass cannot see) lower to the reference math
# --------------------------------------------------------------------------------------------


@lowering("cpu", "int4_weight_only_linear")
def _int4_weight_only_linear(x, weight, scale, zero, bias, group_size):
    return ref.int4_weight_only_linear(x, weight, scale, zero, bias, group_size=group_size)


@lowering("cpu", "int8_dynamic_int4_linear")
def _int8_dynamic_int4_linear(x, weight, scale, zero, bias, group_size):
    return ref.int8_dynamic_int4_linear(x, weight, scale, zero, bias, group_size=group_size)


# The device ops' arguments: the kernel's layout (aten: packed codes and a bf16 scale/zero
# table; native: nibbles, scales and offsets), then N, which the padded layout does not show.
_ATEN_SCHEMA = (
    "(Tensor x, Tensor packed, Tensor scale_zero, Tensor? bias, SymInt group_size, "
    "SymInt out_features) -> Tensor"
)
_NATIVE_SCHEMA = (
    "(Tensor x, Tensor weight, Tensor scale, Tensor offset, Tensor? bias, SymInt group_size, "
    "SymInt out_features) -> Tensor"
)


def _int4_fake(x, *args):
    return x.new_empty((*x.shape[:-1], args[-1]))


# --------------------------------------------------------------------------------------------
# aten: the device ops (what prepack emits), on _weight_int4pack_mm_for_cpu
# --------------------------------------------------------------------------------------------


@device_op("cpu", "cpu_int4_weight_only_linear", schema=_ATEN_SCHEMA, fake=_int4_fake)
def _cpu_int4_weight_only(x, packed, scale_zero, bias, group_size, out_features):
    x2 = x.reshape(-1, x.shape[-1])
    kp = scale_zero.shape[0] * group_size
    if x2.shape[-1] != kp:
        x2 = F.pad(x2, (0, kp - x2.shape[-1]))
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(BF16), packed, group_size, scale_zero)
    return epilogue(y.float(), x, out_features, bias)


@device_op("cpu", "cpu_int8_dynamic_int4_linear", schema=_ATEN_SCHEMA, fake=_int4_fake)
def _cpu_int8_dynamic_int4(x, packed, scale_zero, bias, group_size, out_features):
    # W4A8 on the int4 kernel: the int8 codes are exact in its bf16 input, xs goes in after
    xq, xs = ref.quantize_int8_per_token(x.reshape(-1, x.shape[-1]))
    kp = scale_zero.shape[0] * group_size
    if xq.shape[-1] != kp:
        xq = F.pad(xq, (0, kp - xq.shape[-1]))
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(xq.to(BF16), packed, group_size, scale_zero)
    return epilogue(y.float() * xs, x, out_features, bias)


# --------------------------------------------------------------------------------------------
# aten: prepack rules (semantic node → device node with new constants, computed once)
# --------------------------------------------------------------------------------------------


def aten_int4_layout(u: Tensor, scale: Tensor, zp: Tensor) -> tuple[Tensor, Tensor]:
    """Codes u [N, Kp] (int32, in [0, 15]) with w = (u - 8) * scale + zp, scale and zp
    [N, Kp/g] → (packed, scale_zero): the kernel's weight and bf16 [Kp/g, N', 2] table, N
    padded to a multiple of 16 with zero rows."""
    n_pad = -u.shape[0] % _INT4_N_MULTIPLE
    u = F.pad(u, (0, 0, 0, n_pad))
    s = F.pad(scale, (0, 0, 0, n_pad))
    zp = F.pad(zp, (0, 0, 0, n_pad))
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1)
    scale_zero = torch.stack([s, zp], dim=-1).transpose(0, 1).contiguous().to(BF16)
    return packed, scale_zero


@prepack_rule("cpu", "int4_weight_only_linear", "int8_dynamic_int4_linear", consts=_GROUPED)
def _prepack_int4(node: fx.Node, args, consts):
    # int4 weight-only and W4A8 store the same weight: one layout, two device ops
    device_op = fxq.cpu_int4_weight_only_linear.default
    if node.target == fxq.int8_dynamic_int4_linear.default:
        device_op = fxq.cpu_int8_dynamic_int4_linear.default
    weight, scale, zero = consts["weight"], consts["scale"], consts["zero"]
    # The CPU kernel dequantizes w = (u - 8) * s + zp; ours is w = (u - z) * s: zp = (8 - z) * s.
    u = ref.unpack_int4(weight).to(torch.int32)
    packed, scale_zero = aten_int4_layout(u, scale, (8 - zero.float()) * scale)
    out_features = weight.shape[0]
    return device_op, (
        args["x"],
        ("packed", packed),
        ("scale_zero", scale_zero),
        args["bias"],
        args["group_size"],
        out_features,
    )


# --------------------------------------------------------------------------------------------
# Native kernels: the int4-layout device ops (what prepack emits) and the prepack rules
# --------------------------------------------------------------------------------------------


def dequantize_native_int4(
    weight: Tensor, scale: Tensor, offset: Tensor, group_size: int, dtype: torch.dtype
) -> Tensor:
    """The native kernel's int4 layout (``kernels/cpu/int4.cpp``: per 32 columns 16 bytes, byte
    i holding column i low and column i + 16 high; w = u * scale + offset per group) → W [N, K]
    in ``dtype``, in aten ops: the layout's reading in plain torch, which the native decoder
    (``fxquant::native_int4_to_bfloat16``) is tested against."""
    n, half = weight.shape
    b = weight.reshape(n, half // 16, 16)
    u = torch.stack([b & 0x0F, b >> 4], dim=2).reshape(n, -1, group_size).float()
    return (u * scale[..., None] + offset[..., None]).reshape(n, 2 * half).to(dtype)


# The GEMMs by M (``passes/cpu/dispatch.py``): the native kernel (decode's GEMV), and for large
# M where the table says so the weight dequantized to bf16 once per call and a bf16 GEMM (x, or
# W4A8's int8 codes, exact, in bf16; W rounded to bf16, ~2e-3 relative; the sum rounded to
# bf16 before the per-token scale), or, for int4 weight-only, x quantized to int8 per token and
# the W4A8 kernel: on AVX2 its panel GEMM (maddubs, exact integer sums per group) runs ~1.8x the
# dequantize + fp32 sgemm path at M = 128, and the int8 rounding of x (~8e-3 relative) is small
# beside the int4 weight's own error (~4e-2: the stack's accuracy row reads the same for int4wo
# and w4a8); or, on CPUs with AVX-512 BF16, the int4 weight-only product on bf16 dot products
# (x and the dequantized weight rounded to bf16, ~2e-3 relative each, fp32 sums; one row is the
# native GEMV: kernels/cpu/int4.cpp, bf16_dot.h).


def _int4_rows_native(x2, weight, scale, offset, group_size):
    return fxq.native_int4_weight_only_linear(x2, weight, scale, offset, group_size)


def _int4_rows_bf16(x2, weight, scale, offset, group_size):
    w = fxq.native_int4_to_bfloat16(weight, scale, offset, group_size)  # kernels/cpu/decode.cpp
    return F.linear(x2.to(BF16), w).float()


def _int4_rows_bf16_dot(x2, weight, scale, offset, group_size):
    return fxq.native_int4_bf16dot_linear(x2, weight, scale, offset, group_size)


def _int4_rows_int8_act(x2, weight, scale, offset, group_size):
    if group_size not in W4A8_GROUPS:  # the W4A8 kernel's groups; the weight-only one takes more
        return _int4_rows_native(x2, weight, scale, offset, group_size)
    return _int8_int4_rows_native(x2, weight, scale, offset, group_size)


# W4A8's candidates take the fp32 rows: the native one quantizes them per token inside the
# kernel (the reference's bytes), where a quantization in the graph had Inductor evaluate the
# producer's pointwise math twice (a GELU's erf: once for the amax, once for x / scale)
def _int8_int4_rows_native(x2, weight, scale, offset, group_size):
    return fxq.native_int8_dynamic_int4_linear(x2, weight, scale, offset, group_size)


def _int8_int4_rows_bf16(x2, weight, scale, offset, group_size):
    xq, xs = ref.quantize_int8_per_token(x2)
    return _int4_rows_bf16(xq, weight, scale, offset, group_size) * xs


dispatches("native_int4_weight_only_linear", "int4_weight_only_linear")
dispatches("native_int8_int4_linear", "int8_dynamic_int4_linear")
_INT4_ROWS = candidates(
    "native_int4_weight_only_linear",
    native=_int4_rows_native,
    bf16=_int4_rows_bf16,
    bf16_dot=_int4_rows_bf16_dot,
    int8_act=_int4_rows_int8_act,
)
_INT8_INT4_ROWS = candidates(
    "native_int8_int4_linear", native=_int8_int4_rows_native, bf16=_int8_int4_rows_bf16
)


@device_op(NATIVE, "cpu_native_int4_linear", schema=_NATIVE_SCHEMA, fake=_int4_fake)
def _cpu_native_int4(x, weight, scale, offset, bias, group_size, out_features):
    x2 = native.pad_columns(rows(x), 2 * weight.shape[1]).contiguous()
    args = (x2, weight, scale, offset, group_size)
    y = by_m("native_int4_weight_only_linear", x2.shape[0], _INT4_ROWS, *args)
    return finish(y, x, out_features, bias)


@device_op(NATIVE, "cpu_native_int8_int4_linear", schema=_NATIVE_SCHEMA, fake=_int4_fake)
def _cpu_native_int8_int4(x, weight, scale, offset, bias, group_size, out_features):
    # zero columns leave each token's amax (so its scale) and every sum as they were
    x2 = native.pad_columns(rows(x), 2 * weight.shape[1]).contiguous()
    args = (x2, weight, scale, offset, group_size)
    y = by_m("native_int8_int4_linear", x2.shape[0], _INT8_INT4_ROWS, *args)
    return finish(y, x, out_features, bias)


def prepack_codes(
    u: Tensor, scale: Tensor, zero: Tensor, *, group_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Codes u [N, Kp] in [0, 15] with w = (u - z) * s → the int4 kernel's three constants."""
    return native.prepack_int4(ref.pack_int4(u), scale, zero, group_size=group_size)


def native_int4_args(args, layout: tuple[Tensor, Tensor, Tensor], out_features: int) -> tuple:
    """The ``cpu_native_*int4_linear`` arguments: the node's x, bias and group size around the
    kernel's three new constants."""
    w, s, o = layout
    return (
        args["x"],
        ("weight", w),
        ("scale", s),
        ("offset", o),
        args["bias"],
        args["group_size"],
        out_features,
    )


@prepack_rule(NATIVE, "int4_weight_only_linear", "int8_dynamic_int4_linear", consts=_GROUPED)
def _native_prepack_int4(node: fx.Node, args, consts):
    # int4 weight-only and W4A8 store the same weight: one kernel layout, two device ops
    device_op = fxq.cpu_native_int4_linear.default
    if node.target == fxq.int8_dynamic_int4_linear.default:
        device_op = fxq.cpu_native_int8_int4_linear.default
    weight, scale, zero = consts["weight"], consts["scale"], consts["zero"]
    layout = native.prepack_int4(weight, scale, zero, group_size=args["group_size"])
    return device_op, native_int4_args(args, layout, weight.shape[0])
