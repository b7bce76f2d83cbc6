"""The CPU lowering of the int8 family (``fxquant/core/schemes/int8.py``): int8 weight-only
(``int8_weight_only_linear``), w8a8 (``int8_dynamic_linear``) and the int8 linear that reads an
activation a fused norm already quantized (``int8_scaled_linear``, ``fxquant.passes.fuse``).

Where it sits: registered by op name (``fxquant.core.registry``, ``fxquant.passes.cpu.prepack``)
and read by the lowering pass (``fxquant.passes.lower``).

**aten kernels** (``"cpu"``), measured on the dev CPU (AVX2, 2 cores, no VNNI) by
``benchmarks/aten_kernels.py`` (results in ``benchmarks/results/aten_kernels.json``): all three
use ``_weight_int8pack_mm``, which is fast only with bf16 activations (fp32 takes a scalar path
10-30× slower) and returns bf16; the kernel gets a stored bf16 vector of ones and the fp32
per-channel (and per-token) scales are applied in the epilogue. w8a8's quantized activations
are integers in [-127, 127], exact in bf16 (so are the fused norm's, which ``int8_scaled_linear``
takes with their scale); int8 weight-only rounds x to bf16. Either way the bf16 rounding adds a
relative error of ~2-4e-3 per layer, under the ~8e-3 of int8 quantization itself
(tests/test_lower.py bounds it). The kernel reads K in steps of 16, so the prepack pads K with
zero columns to a multiple of 16 (shorter rows crashed it or summed past their end). The ones
and the padded weight are stored constants, never computed in the graph: Inductor's lowering
of ``_weight_int8pack_mm`` does not realize a computed scale argument and fails with
``LoweringException: AssertionError: Pointwise`` under AOTInductor.

**Native kernels** (``"cpu-native"``, ``fxquant.kernels.cpu``): each op is a short aten
composition around one ``fxquant::native_*`` op on the rewrite's own weights ([N, K] int8,
per-channel fp32 scales), so no prepack: activations flattened to fp32 rows (w8a8's quantized
per token inside the kernel, to the reference's bytes; for ``_int_mm`` here in aten ops, as the
reference does), the GEMM in the kernel, the bias and the caller's dtype in the epilogue, which
Inductor fuses. One exception: on AVX-512 VNNI machines
whose table runs w8a8's native GEMM at every M, the prepack stores w8a8's weight once in that
GEMM's 16-column panels (``fxquant.kernels.cpu.prepack_int8_vnni``), which it otherwise packs
on every call; one layout serves every M, decode included.
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
from fxquant.passes.cpu.common import BF16, NATIVE, device_op, epilogue, finish, row_scales, rows
from fxquant.passes.cpu.dispatch import by_m, candidates, dispatches, packed, packs
from fxquant.passes.cpu.prepack import prepack_rule

fxq = torch.ops.fxquant
_INT8_K_MULTIPLE = 16  # _weight_int8pack_mm's K step (see _int8_k16)


# --------------------------------------------------------------------------------------------
# aten: semantic ops without a prepack (weights the pass cannot see) lower to the reference math
# --------------------------------------------------------------------------------------------

lowering("cpu", "int8_weight_only_linear")(ref.int8_weight_only_linear)
lowering("cpu", "int8_dynamic_linear")(ref.int8_dynamic_linear)


@lowering("cpu", "int8_scaled_linear")
def _int8_scaled_linear(xq, xs, weight, scale, bias, out_dtype):
    return ref.int8_scaled_linear(xq, xs, weight, scale, bias, out_dtype=out_dtype)


# --------------------------------------------------------------------------------------------
# aten: the device ops (what prepack emits), on _weight_int8pack_mm
# --------------------------------------------------------------------------------------------


# The device ops' arguments: the rewrite's int8 weight (K padded to 16) and its scales, and a
# bf16 vector of ones for the kernel's own scale argument (see _prepack_int8).
_SCHEMA = "(Tensor x, Tensor qweight, Tensor scale, Tensor ones, Tensor? bias) -> Tensor"
_SCALED_SCHEMA = (
    "(Tensor xq, Tensor xs, Tensor qweight, Tensor scale, Tensor ones, Tensor? bias, "
    "ScalarType out_dtype) -> Tensor"
)


def _fake(x, qweight, *rest):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


def _scaled_fake(xq, xs, qweight, scale, ones, bias, out_dtype):
    return xq.new_empty((*xq.shape[:-1], qweight.shape[0]), dtype=out_dtype)


def _pad_k(x2: Tensor, qweight: Tensor) -> Tensor:
    # the prepacked int8 weight has K padded to a multiple of 16 (see _int8_k16)
    k = qweight.shape[1]
    return x2 if x2.shape[-1] == k else F.pad(x2, (0, k - x2.shape[-1]))


@device_op("cpu", "cpu_int8_weight_only_linear", schema=_SCHEMA, fake=_fake)
def _cpu_int8_weight_only(x, qweight, scale, ones, bias):
    x2 = _pad_k(x.reshape(-1, x.shape[-1]).to(BF16), qweight)
    y = torch.ops.aten._weight_int8pack_mm(x2, qweight, ones).float() * scale
    return epilogue(y, x, qweight.shape[0], bias)


@device_op("cpu", "cpu_int8_dynamic_linear", schema=_SCHEMA, fake=_fake)
def _cpu_int8_dynamic(x, qweight, scale, ones, bias):
    xq, xs = ref.quantize_int8_per_token(x.reshape(-1, x.shape[-1]))
    y = torch.ops.aten._weight_int8pack_mm(_pad_k(xq.to(BF16), qweight), qweight, ones).float()
    return epilogue(y * (xs * scale), x, qweight.shape[0], bias)


@device_op("cpu", "cpu_int8_scaled_linear", schema=_SCALED_SCHEMA, fake=_scaled_fake)
def _cpu_int8_scaled(xq, xs, qweight, scale, ones, bias, out_dtype):
    # int8 values are exact in bf16, the input the fast kernel wants (see the module docstring)
    x2 = _pad_k(xq.reshape(-1, xq.shape[-1]).to(BF16), qweight)
    y = torch.ops.aten._weight_int8pack_mm(x2, qweight, ones).float() * (xs.reshape(-1, 1) * scale)
    return epilogue(y, xq, qweight.shape[0], bias, out_dtype)


# --------------------------------------------------------------------------------------------
# aten: prepack rules (semantic node → device node with new constants, computed once)
# --------------------------------------------------------------------------------------------


def _int8_k16(weight_node, weight: Tensor):
    # _weight_int8pack_mm reads K in steps of 16: any other K reads past each row (measured on
    # torch 2.13, AVX2: wrong sums at K = 100, a segfault at K = 1..15). Zero columns, which the
    # compositions match with zero activations, change no sum.
    k_pad = -weight.shape[1] % _INT8_K_MULTIPLE
    return weight_node if not k_pad else ("qweight_k16", F.pad(weight, (0, k_pad)))


def _ones(weight: Tensor) -> tuple[str, Tensor]:
    return "ones", torch.ones(weight.shape[0], dtype=BF16)


@prepack_rule("cpu", "int8_weight_only_linear", "int8_dynamic_linear", consts=("weight", "scale"))
def _prepack_int8(node: fx.Node, args, consts):
    # both store the same weight: one layout, two device ops
    device_op = fxq.cpu_int8_weight_only_linear.default
    if node.target == fxq.int8_dynamic_linear.default:
        device_op = fxq.cpu_int8_dynamic_linear.default
    weight = _int8_k16(args["weight"], consts["weight"])
    return device_op, (args["x"], weight, args["scale"], _ones(consts["weight"]), args["bias"])


@prepack_rule("cpu", "int8_scaled_linear", consts=("weight", "scale"))
def _prepack_int8_scaled(node: fx.Node, args, consts):
    weight = _int8_k16(args["weight"], consts["weight"])
    return fxq.cpu_int8_scaled_linear.default, (
        args["xq"],
        args["xs"],
        weight,
        args["scale"],
        _ones(consts["weight"]),
        args["bias"],
        args["out_dtype"],
    )


# --------------------------------------------------------------------------------------------
# Native kernels: the rewrite's weights as they are (w8a8's on VNNI machines: the last section)
# --------------------------------------------------------------------------------------------


# Each GEMM on fp32 [M, N] rows has its candidates by M (``passes/cpu/dispatch.py``): the native
# kernel (the GEMV that decode wants) and, for large M where the table says so, a GEMM in a
# wider unit: int8 weight-only as a bf16 GEMM of the exact int8 values (x rounded to bf16, the
# products' sum rounded to bf16 before the fp32 scale: ~2e-3 relative, under int8's own error),
# w8a8 as ``_int_mm`` (VNNI / AMX int8; exact int32 sums, as the reference's).
# int8 weight-only has no int8-activation candidate (int4 weight-only has, passes/cpu/int4.py):
# measured on the Zen 4 it ran SmolLM2's linears 2x faster from M = 16, but it is w8a8's
# program, and at prefill it moved the demo package's perplexity from 31.60 to 32.71 (fp32
# 31.72) and its greedy tokens off fp32's: 15x the scheme's own error, where int4's rounding
# swamps the activation's. A user who wants that speed picks w8a8.


def _int8_rows_native(x2: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    return fxq.native_int8_weight_only_linear(x2, weight, row_scales(scale, weight.shape[0]))


def _int8_rows_bf16(x2: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    return F.linear(x2.to(BF16), weight.to(BF16)).float() * scale.float()


def _int8_scaled_rows_native(xq2: Tensor, xs2: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    return fxq.native_int8_scaled_linear(
        xq2.contiguous(),
        xs2.reshape(-1).float().contiguous(),
        weight,
        row_scales(scale, weight.shape[0]),
    )


def _int8_scaled_rows_int_mm(xq2: Tensor, xs2: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    # W [N, K] read as Wᵀ [K, N] column-major: oneDNN's fast layout for this product
    y = torch._int_mm(xq2.contiguous(), weight.t())
    return y.float() * (xs2.reshape(-1, 1).float() * scale.float())


dispatches("native_int8_weight_only_linear", "int8_weight_only_linear")
dispatches("native_int8_scaled_linear", "int8_dynamic_linear", "int8_scaled_linear")


def _int8_rows_bf16_dot(x2: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    # int8 widened to bf16 in registers (exact), x rounded to bf16, fp32 sums: AVX-512 BF16's
    # dot products, twice the fp32 GEMV's multiplies an instruction (kernels/cpu/int8_fp8.cpp:
    # a row kernel up to 31 rows, a packed-panel GEMM from 32); one row (decode) keeps fp32 x,
    # on the GEMV
    return fxq.native_int8_bf16dot_linear(x2, weight, row_scales(scale, weight.shape[0]))


_INT8_ROWS = candidates(
    "native_int8_weight_only_linear",
    native=_int8_rows_native,
    bf16=_int8_rows_bf16,
    bf16_dot=_int8_rows_bf16_dot,
)
_INT8_SCALED_ROWS = candidates(
    "native_int8_scaled_linear", native=_int8_scaled_rows_native, int_mm=_int8_scaled_rows_int_mm
)


def _native_int8_scaled_rows(xq2: Tensor, xs2: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    return by_m(
        "native_int8_scaled_linear", xq2.shape[0], _INT8_SCALED_ROWS, xq2, xs2, weight, scale
    )


@lowering(NATIVE, "int8_weight_only_linear")
def _native_int8_weight_only(x, weight, scale, bias):
    x2 = rows(x)
    y = by_m("native_int8_weight_only_linear", x2.shape[0], _INT8_ROWS, x2, weight, scale)
    return finish(y, x, weight.shape[0], bias)


# w8a8 from fp32 rows, per candidate: the native kernel quantizes x per token itself (the
# reference's bytes), where a quantization in the graph had Inductor evaluate the producer's
# pointwise math twice (once for the amax, once for x / scale); _int_mm takes it quantized here
def _int8_dynamic_rows_native(x2: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    return fxq.native_int8_dynamic_linear(x2, weight, row_scales(scale, weight.shape[0]))


def _int8_dynamic_rows_int_mm(x2: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    return _int8_scaled_rows_int_mm(*ref.quantize_int8_per_token(x2), weight, scale)


_INT8_DYNAMIC_ROWS = {"native": _int8_dynamic_rows_native, "int_mm": _int8_dynamic_rows_int_mm}


@lowering(NATIVE, "int8_dynamic_linear")
def _native_int8_dynamic(x, weight, scale, bias):
    x2 = rows(x)
    y = by_m("native_int8_scaled_linear", x2.shape[0], _INT8_DYNAMIC_ROWS, x2, weight, scale)
    return finish(y, x, weight.shape[0], bias)


@lowering(NATIVE, "int8_scaled_linear")
def _native_int8_scaled(xq, xs, weight, scale, bias, out_dtype):
    y = _native_int8_scaled_rows(xq.reshape(-1, xq.shape[-1]), xs, weight, scale)
    return finish(y, xq, weight.shape[0], bias, out_dtype)


# --------------------------------------------------------------------------------------------
# Native kernels on VNNI machines: w8a8's weight prepacked in the VNNI GEMM's panels
# --------------------------------------------------------------------------------------------

# Per call, the unpacked GEMM transposes each block of weight rows into panels before the
# activation rows meet it; stored packed, the tiles read the weight where it lies. On the Zen 4
# (two threads, the stack's 4096 x 1024 and 1024 x 4096, SmolLM2's 1536 x 576 and 576 x 1536;
# a one-off comparison, benchmarks/cpu_latency.py has the model-level rows): 2.1-3.8x faster at
# M = 1-4, 1.35-1.8x at 16, 1.05-1.25x at 128-512.
packs(
    "native_int8_scaled_linear",
    classes=("avx512_vnni_bf16", "amx"),
    layout=(
        "AVX-512 VNNI panels (16 columns x 4 k per 64 bytes; AMX B tiles, read by AMX int8 "
        "tiles from 8 rows where the CPU has them)"
    ),
)


def _vnni_packs(args) -> bool:
    return packed("native_int8_scaled_linear")


def _vnni_rows(xq2: Tensor, xs2: Tensor, weight, comp, scale) -> Tensor:
    # [M, K] int8 rows and their scales, in the layouts the kernel reads
    xs2 = xs2.reshape(-1).float().contiguous()
    return fxq.native_int8_scaled_vnni_linear(xq2.contiguous(), xs2, weight, comp, scale)


def _vnni_fake(x, weight, comp, scale, bias):
    return x.new_empty((*x.shape[:-1], scale.shape[0]))


def _vnni_scaled_fake(xq, xs, weight, comp, scale, bias, out_dtype):
    return xq.new_empty((*xq.shape[:-1], scale.shape[0]), dtype=out_dtype)


@device_op(
    NATIVE,
    "cpu_native_int8_dynamic_vnni_linear",
    schema="(Tensor x, Tensor weight, Tensor comp, Tensor scale, Tensor? bias) -> Tensor",
    fake=_vnni_fake,
)
def _cpu_native_int8_dynamic_vnni(x, weight, comp, scale, bias):
    # quantized per token inside the kernel (the reference's bytes): in the graph, Inductor fused
    # the quantization into the producer's loops and evaluated its pointwise math twice, once
    # for the amax and once for x / scale (the benchmark stack's GELU erf)
    y = fxq.native_int8_dynamic_vnni_linear(rows(x), weight, comp, scale)
    return finish(y, x, scale.shape[0], bias)


@device_op(
    NATIVE,
    "cpu_native_int8_scaled_vnni_linear",
    schema=(
        "(Tensor xq, Tensor xs, Tensor weight, Tensor comp, Tensor scale, Tensor? bias, "
        "ScalarType out_dtype) -> Tensor"
    ),
    fake=_vnni_scaled_fake,
)
def _cpu_native_int8_scaled_vnni(xq, xs, weight, comp, scale, bias, out_dtype):
    y = _vnni_rows(xq.reshape(-1, xq.shape[-1]), xs, weight, comp, scale)
    return finish(y, xq, scale.shape[0], bias, out_dtype)


@prepack_rule(
    NATIVE,
    "int8_dynamic_linear",
    "int8_scaled_linear",
    consts=("weight", "scale"),
    when=_vnni_packs,
)
def _native_prepack_int8_vnni(node: fx.Node, args, consts):
    weight = consts["weight"]
    panels, comp = native.prepack_int8_vnni(weight)
    scale = row_scales(consts["scale"], weight.shape[0])
    new = (("weight", panels), ("comp", comp), ("scale", scale))
    if node.target == fxq.int8_dynamic_linear.default:
        return fxq.cpu_native_int8_dynamic_vnni_linear.default, (args["x"], *new, args["bias"])
    return fxq.cpu_native_int8_scaled_vnni_linear.default, (
        args["xq"],
        args["xs"],
        *new,
        args["bias"],
        args["out_dtype"],
    )
