"""The CPU lowering of the lowbit family (``fxquant/core/schemes/lowbit.py``): int2 / int3 / int6
codes and float-zero int4 in groups along K (``intx_weight_only_linear``), and BitNet's ternary
weights × int8 per-token activations (``bitnet_linear``).

Where it sits: registered by op name (``fxquant.core.registry``, ``fxquant.passes.cpu.prepack``)
and read by the lowering pass (``fxquant.passes.lower``).

- int2 / int3 codes (and float-zero int4) are int4 codes too: in groups of 32 or more they run
  on the int4 family's kernels (``fxquant.passes.cpu.int4``'s device ops), 4 bits a code in
  memory at run time. On the aten kernel (``"cpu"``) their zero points are folded as int4's,
  with each group's codes shifted so a 2-bit group keeps its precision (see ``_prepack_intx``);
  on the native one (``"cpu-native"``) the nibble layout takes any code in [0, 15] and any zero
  point, integer or float, as it is.
- 6-bit codes (GGUF ``Q6_K``, groups of 16) fit neither kernel's codes nor its groups (32 to
  256): they keep the reference composition, which dequantizes the weight per call (correct,
  slower than fp32).
- SINQ (``sinq_weight_only_linear``): x times its column scales, then the intx path above.
- BitNet (int8 per token × ternary) lowers to its reference math in aten ops.
"""

from __future__ import annotations

import torch
import torch.fx as fx
import torch.nn.functional as F

import fxquant.core.ops  # noqa: F401  (registers the fxquant:: ops)
import fxquant.kernels.cpu as native
from fxquant.core import reference_lowbit as ref_lowbit
from fxquant.core.registry import lowering
from fxquant.passes.cpu.common import NATIVE, device_op, epilogue
from fxquant.passes.cpu.dispatch import dispatches
from fxquant.passes.cpu.int4 import (
    _cpu_int4_weight_only,
    _cpu_native_int4,
    _int4_fake,
    aten_int4_layout,
    native_int4_args,
    prepack_codes,
)
from fxquant.passes.cpu.prepack import prepack_rule

fxq = torch.ops.fxquant


# --------------------------------------------------------------------------------------------
# aten compositions
# --------------------------------------------------------------------------------------------


@lowering("cpu", "intx_weight_only_linear")
def _intx_weight_only(x, weight, scale, zero, bias, bits, group_size):
    # 6-bit codes, and where prepack cannot see the weights (see _prepack_intx): unpack with
    # shifts and masks, dequantize in fp32 and run a dense linear, the reference math in aten.
    w = ref_lowbit.dequantize_intx_grouped(weight, scale, zero, bits=bits, group_size=group_size)
    y = F.linear(x.reshape(-1, x.shape[-1]).float(), w[:, : x.shape[-1]])
    return epilogue(y, x, weight.shape[0], bias)


@lowering("cpu", "bitnet_linear")
def _bitnet(x, weight, weight_scale, bias):
    # transformers' BitLinear: int8 activations per token, ternary weights, fp32 accumulation
    # (|x_q · w_q| <= 128 K is exact in fp32 up to K = 2**17), one division by both multipliers.
    xq, inv = ref_lowbit.quantize_bitnet_activation(x.reshape(-1, x.shape[-1]))
    y = F.linear(xq.float(), ref_lowbit.unpack_bitnet(weight).float()) / (inv * weight_scale)
    return epilogue(y, x, 4 * weight.shape[0], bias)


# --------------------------------------------------------------------------------------------
# aten: prepack onto the int4 kernel
# --------------------------------------------------------------------------------------------


def _int4_kernel_takes(args) -> bool:
    # codes of 2 to 4 bits in groups of 32 to 256: the int4 kernel's (6-bit codes in groups of
    # 16, GGUF Q6_K's, are neither)
    return args["bits"] <= 4 and args["group_size"] >= 32


@prepack_rule(
    "cpu", "intx_weight_only_linear", consts=("weight", "scale", "zero"), when=_int4_kernel_takes
)
def _prepack_intx(node: fx.Node, args, consts):
    # int2 / int3 codes (and float-zero int4) are valid int4 codes: the int4 CPU kernel runs
    # them at int4 speed (the composition above would materialise the fp32 weight per call).
    # It computes w = (u - 8) * s + zp in bf16. With zp = (8 - z) * s as for int4, a 2-bit
    # group would cancel two values near 8s down to at most 3s (measured: 26 dB from the
    # reference instead of int4's 40+). So each group's codes move up by c = round(8 - z)
    # (clamped so they stay in [0, 15]): zp = (8 - c - z) * s is 0 for an integer z and at
    # most s/2 for a float one, and (u + c - 8) * s is as small as w itself.
    packed, scale_zero = _aten_intx_layout(consts, args["bits"], args["group_size"])
    return fxq.cpu_int4_weight_only_linear.default, (
        args["x"],
        ("packed", packed),
        ("scale_zero", scale_zero),
        args["bias"],
        args["group_size"],
        consts["weight"].shape[0],
    )


def _aten_intx_layout(consts, bits: int, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    # the codes shifted per group into the int4 kernel's grid (see _prepack_intx)
    weight, scale, zero = consts["weight"], consts["scale"], consts["zero"]
    z = zero.float()
    shift = torch.round(8 - z).clamp(0, 16 - 2**bits)
    u = ref_lowbit.unpack_intx(weight, bits).to(torch.int32)
    u = u + shift.to(torch.int32).repeat_interleave(group_size, dim=1)
    return aten_int4_layout(u, scale, (8 - shift - z) * scale)


# --------------------------------------------------------------------------------------------
# Native kernels: prepack onto the int4 kernel's nibble layout
# --------------------------------------------------------------------------------------------


def _native_int4_takes(args) -> bool:
    # codes of at most 4 bits in groups that are whole 32-column blocks of the kernel layout
    return args["bits"] <= 4 and args["group_size"] % native.INT4_BLOCK == 0


dispatches("native_int4_weight_only_linear", "intx_weight_only_linear", when=_native_int4_takes)


@prepack_rule(
    NATIVE, "intx_weight_only_linear", consts=("weight", "scale", "zero"), when=_native_int4_takes
)
def _native_prepack_intx(node: fx.Node, args, consts):
    return fxq.cpu_native_int4_linear.default, _native_intx_args(args, consts)


def _native_intx_args(args, consts) -> tuple:
    # the codes in the native int4 kernel's nibble layout, as cpu_native_int4_linear takes them
    weight, scale, zero = consts["weight"], consts["scale"], consts["zero"]
    u = ref_lowbit.unpack_intx(weight, args["bits"])
    layout = prepack_codes(u, scale, zero, group_size=args["group_size"])
    return native_int4_args(args, layout, weight.shape[0])


# --------------------------------------------------------------------------------------------
# SINQ: the same codes on the int4 kernels, x scaled per column first
# --------------------------------------------------------------------------------------------

# SINQ's weight is an intx one (codes, per-group scale, float zero point) times one scale per
# input column, which multiplies x before the GEMM: an elementwise op Inductor fuses with the
# fp32 conversion of x the int4 compositions make anyway (they run here on x ⊙ col).
_SINQ_CONSTS = ("weight", "scale", "zero", "col_scale")


def _scaled(x, col_scale):
    # in fp32, what the compositions below compute in anyway (their output then takes x's dtype)
    return x.float() * col_scale[: x.shape[-1]].float()


@lowering("cpu", "sinq_weight_only_linear")
def _sinq_weight_only(x, weight, scale, zero, col_scale, bias, bits, group_size):
    # where prepack cannot see the weights: the reference composition (dequantized per call)
    xs = _scaled(x, col_scale)
    return _intx_weight_only(xs, weight, scale, zero, bias, bits, group_size).to(x.dtype)


@device_op(
    "cpu",
    "cpu_sinq_int4_linear",
    schema="(Tensor x, Tensor col_scale, Tensor packed, Tensor scale_zero, Tensor? bias, "
    "SymInt group_size, SymInt out_features) -> Tensor",
    fake=_int4_fake,
)
def _cpu_sinq_int4(x, col_scale, packed, scale_zero, bias, group_size, out_features):
    xs = _scaled(x, col_scale)
    return _cpu_int4_weight_only(xs, packed, scale_zero, bias, group_size, out_features).to(x.dtype)


@prepack_rule("cpu", "sinq_weight_only_linear", consts=_SINQ_CONSTS)
def _prepack_sinq(node: fx.Node, args, consts):
    packed, scale_zero = _aten_intx_layout(consts, args["bits"], args["group_size"])
    return fxq.cpu_sinq_int4_linear.default, (
        args["x"],
        args["col_scale"],
        ("packed", packed),
        ("scale_zero", scale_zero),
        args["bias"],
        args["group_size"],
        consts["weight"].shape[0],
    )


@device_op(
    NATIVE,
    "cpu_native_sinq_linear",
    schema="(Tensor x, Tensor col_scale, Tensor weight, Tensor scale, Tensor offset, "
    "Tensor? bias, SymInt group_size, SymInt out_features) -> Tensor",
    fake=_int4_fake,
)
def _cpu_native_sinq(x, col_scale, weight, scale, offset, bias, group_size, out_features):
    xs = _scaled(x, col_scale)
    return _cpu_native_int4(xs, weight, scale, offset, bias, group_size, out_features).to(x.dtype)


dispatches("native_int4_weight_only_linear", "sinq_weight_only_linear")


@prepack_rule(NATIVE, "sinq_weight_only_linear", consts=_SINQ_CONSTS)
def _native_prepack_sinq(node: fx.Node, args, consts):
    x, *rest = _native_intx_args(args, consts)
    return fxq.cpu_native_sinq_linear.default, (x, args["col_scale"], *rest)
