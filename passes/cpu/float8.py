"""The CPU lowering of the float8 family (``fxquant/core/schemes/float8.py``): fp8 e4m3 weight-only,
dynamic (per-row or per-tensor activations), static and block (128×128 weights, 1×128
activations) linears, and the ones that read an activation a fused norm already quantized
(``float8_scaled_linear``, ``float8_block_scaled_linear``; ``fxquant.passes.fuse``).

Where it sits: registered by op name (``fxquant.core.registry``) and read by the lowering pass
(``fxquant.passes.lower``). No prepack: every kernel reads the rewrite's [N, K] e4m3 weight and
its fp32 scales as they are.

**aten** (``"cpu"``): fp8 has no kernel on the dev CPU (``_scaled_mm`` is emulated, ~100×
slower, measured by ``benchmarks/aten_kernels.py``): the weight is upcast per call, correct but
slower than fp32. The CUDA lowering is where fp8 pays.

**Native kernels** (``"cpu-native"``, ``fxquant.kernels.cpu``): the weight-only, dynamic,
static and scaled linears are short aten compositions around the e4m3 kernel, which decodes the
weight itself; the block ones (128×128 weight tiles, 1×128 activation groups) have their own
kernel. Activations are quantized here in aten ops exactly as the reference does, onto the e4m3
grid in fp32 arithmetic (``e4m3_values``: the kernel takes them as fp32 values, which upcast
from e4m3 exactly), but for per-row dynamic and block ones, which the native kernels quantize
themselves to the same values; the bias and the caller's dtype go in the epilogue, which
Inductor fuses.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

import fxquant.core.ops  # noqa: F401  (registers the fxquant:: ops)
from fxquant.core import reference as ref
from fxquant.core.registry import lowering
from fxquant.passes.cpu.common import NATIVE, epilogue, finish, row_scales, rows
from fxquant.passes.cpu.dispatch import by_m, candidates, dispatches

fxq = torch.ops.fxquant

__all__ = ["e4m3_values"]


# --------------------------------------------------------------------------------------------
# aten: the weight upcast per call
# --------------------------------------------------------------------------------------------


@lowering("cpu", "float8_weight_only_linear")
def _upcast_weight_linear(x, weight, scale, bias):
    y = F.linear(x.float(), weight.float()) * scale
    return epilogue(y.reshape(-1, weight.shape[0]), x, weight.shape[0], bias)


@lowering("cpu", "float8_dynamic_linear")
def _float8_dynamic(x, weight, scale, bias, per_row, activation_scale_ub):
    x2 = x.reshape(-1, x.shape[-1])
    if per_row:
        xq, xs = ref.quantize_fp8_per_token(x2, scale_ub=activation_scale_ub)
    else:
        xq, xs = ref.quantize_fp8_per_tensor(x2, scale_ub=activation_scale_ub)
    y = F.linear(xq.float(), weight.float()) * (xs * scale)
    return epilogue(y, x, weight.shape[0], bias)


@lowering("cpu", "float8_static_linear")
def _float8_static(x, weight, scale, activation_scale, bias):
    xq = ref.quantize_fp8_static(x, activation_scale)
    return _float8_scaled(xq, activation_scale, weight, scale, bias, x.dtype)


@lowering("cpu", "float8_block_linear")
def _float8_block(x, weight, scale, bias, block_size):
    return ref.float8_block_linear(x, weight, scale, bias, block_size=block_size)


@lowering("cpu", "float8_scaled_linear")
def _float8_scaled(xq, xs, weight, scale, bias, out_dtype):
    x2 = xq.reshape(-1, xq.shape[-1])
    y = F.linear(x2.float(), weight.float()) * (xs.reshape(-1, 1) * scale)
    return epilogue(y, xq, weight.shape[0], bias, out_dtype)


@lowering("cpu", "float8_block_scaled_linear")
def _float8_block_scaled(xq, xs, weight, scale, bias, block_size, out_dtype):
    return ref.float8_block_scaled_linear(
        xq, xs, weight, scale, bias, block_size=block_size, out_dtype=out_dtype
    )


# --------------------------------------------------------------------------------------------
# Native kernels: the e4m3 weight decoded in the kernel
# --------------------------------------------------------------------------------------------


# The GEMM by M (``passes/cpu/dispatch.py``): the native kernel (decode's GEMV; the kernel
# decodes the e4m3 weight itself) and, for large M where the table says so, a bf16 GEMM of the
# weight's exact values (x rounded to bf16 unless it is e4m3 already; the sum rounded to bf16).
# The weight goes to bf16 in a native decoder (``kernels/cpu/decode.cpp``): Inductor's CPU code
# converts e4m3 one element at a time (~30× slower, all of SmolLM2's weights ~420 ms a call).


def _fp8_rows_native(x2: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    return fxq.native_float8_weight_only_linear(x2, weight, row_scales(scale, weight.shape[0]))


def _fp8_rows_bf16(x2: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    w = fxq.native_float8_to_bfloat16(weight.contiguous())
    return F.linear(x2.to(torch.bfloat16), w).float() * scale.float()


dispatches(
    "native_float8_weight_only_linear",
    "float8_weight_only_linear",
    "float8_dynamic_linear",
    "float8_static_linear",
    "float8_scaled_linear",
)


def _fp8_rows_bf16_dot(x2: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    # e4m3 widened to bf16 in registers (exact), x rounded to bf16 (exact when it is e4m3
    # already: fp8 dynamic and static), fp32 sums: AVX-512 BF16's dot products; one row
    # (decode) keeps fp32 x, on the GEMV
    return fxq.native_float8_bf16dot_linear(x2, weight, row_scales(scale, weight.shape[0]))


_FP8_ROWS = candidates(
    "native_float8_weight_only_linear",
    native=_fp8_rows_native,
    bf16=_fp8_rows_bf16,
    bf16_dot=_fp8_rows_bf16_dot,
)


def _fp8_rows(x2: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    # e4m3 activations upcast exactly to fp32
    x2 = x2.float().contiguous()
    return by_m("native_float8_weight_only_linear", x2.shape[0], _FP8_ROWS, x2, weight, scale)


@lowering(NATIVE, "float8_weight_only_linear")
def _native_float8_weight_only(x, weight, scale, bias):
    return finish(_fp8_rows(rows(x), weight, scale), x, weight.shape[0], bias)


def e4m3_values(v: Tensor) -> Tensor:
    """fp32 ``v`` with ``|v| <= 448`` → the nearest e4m3 value (ties to even), still fp32.

    Exactly ``v.to(torch.float8_e4m3fn).float()`` (NaN stays NaN), in the int32 and fp32
    arithmetic Inductor vectorizes: its CPU code converts to and from fp8 one element at a
    time. Per-token quantization of a [128, 1536] activation, compiled (AVX2 EPYC): 837 µs
    through an fp8 tensor, 157 µs here. The kernels take the activation as fp32 values anyway.
    """
    bits = v.view(torch.int32)
    # normal range: keep 3 of fp32's 23 mantissa bits, rounding half to even at bit 20 (the
    # carry into the exponent is the right answer at a binade's top)
    normal = ((bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000).view(torch.float32)
    # below 2^-6 e4m3 is subnormal: a fixed step of 2^-9 (scaling by 2^9 is exact)
    subnormal = torch.round(v * 512.0) * (1.0 / 512.0)
    return torch.where(v.abs() < 2.0**-6, subnormal, normal)


def _fp8_quantized_values(x2: Tensor, scale: Tensor) -> Tensor:
    # reference._to_fp8 without the fp8 tensor: (x / scale) clamped, on the e4m3 grid
    return e4m3_values((x2 / scale).clamp(-ref.FP8_E4M3_MAX, ref.FP8_E4M3_MAX))


# Per-row dynamic activations, per candidate of the e4m3 GEMM: the native ops quantize x per
# token inside the kernel (the reference's e4m3 values and scales) and scale each output row;
# quantized in the graph, Inductor fused the amax and the division into the producer's loops
# and evaluated its pointwise math twice (the benchmark stack's GELU). The bf16 candidate
# quantizes in the graph, as the per-tensor path does.
def _fp8_dynamic_rows_native(x2, weight, scale, ub):
    return fxq.native_float8_dynamic_linear(x2, weight, row_scales(scale, weight.shape[0]), ub)


def _fp8_dynamic_rows_bf16_dot(x2, weight, scale, ub):
    n = weight.shape[0]
    return fxq.native_float8_dynamic_bf16dot_linear(x2, weight, row_scales(scale, n), ub)


def _fp8_dynamic_rows_bf16(x2, weight, scale, ub):
    xs = ref.fp8_scale(x2.abs().amax(dim=-1, keepdim=True), ub)  # a cap of inf caps nothing
    return _fp8_rows_bf16(_fp8_quantized_values(x2, xs), weight, scale) * xs


_FP8_DYNAMIC_ROWS = {
    "native": _fp8_dynamic_rows_native,
    "bf16": _fp8_dynamic_rows_bf16,
    "bf16_dot": _fp8_dynamic_rows_bf16_dot,
}


@lowering(NATIVE, "float8_dynamic_linear")
def _native_float8_dynamic(x, weight, scale, bias, per_row, activation_scale_ub):
    if per_row:
        x2 = rows(x)
        ub = math.inf if activation_scale_ub is None else float(activation_scale_ub)
        args = (x2, weight, scale, ub)
        y = by_m("native_float8_weight_only_linear", x2.shape[0], _FP8_DYNAMIC_ROWS, *args)
        return finish(y, x, weight.shape[0], bias)
    x2 = x.reshape(-1, x.shape[-1]).float()
    xs = ref.fp8_scale(x2.abs().amax().reshape(1), activation_scale_ub)
    y = _fp8_rows(_fp8_quantized_values(x2, xs), weight, scale) * xs
    return finish(y, x, weight.shape[0], bias)


@lowering(NATIVE, "float8_static_linear")
def _native_float8_static(x, weight, scale, activation_scale, bias):
    xs = activation_scale.float()
    xq = _fp8_quantized_values(x.reshape(-1, x.shape[-1]).float(), xs)
    return finish(_fp8_rows(xq, weight, scale) * xs, x, weight.shape[0], bias)


@lowering(NATIVE, "float8_scaled_linear")
def _native_float8_scaled(xq, xs, weight, scale, bias, out_dtype):
    y = _fp8_rows(xq.reshape(-1, xq.shape[-1]), weight, scale) * xs.reshape(-1, 1).float()
    return finish(y, xq, weight.shape[0], bias, out_dtype)


# DeepSeek-V3 blocks: one native op at every M (``kernels/cpu/int8_fp8.cpp``), which picks its
# kernel by M: a GEMV that decodes each b-wide span of a weight row once and applies the tile
# and group scales once a span; from 2 rows on AVX-512 BF16 CPUs bf16 dot products (exact for
# e4m3 × e4m3) with the same span scales; without them, past 32 rows, both operands dequantized
# as the reference does, for ATen's mm. x is quantized in 1 × b groups inside the op (the
# reference's values and scales), or comes quantized from a fused norm.
@lowering(NATIVE, "float8_block_linear")
def _native_float8_block(x, weight, scale, bias, block_size):
    w, s = weight.contiguous(), scale.float().contiguous()
    y = fxq.native_float8_block_linear(rows(x), w, s, block_size)
    return finish(y, x, weight.shape[0], bias)


@lowering(NATIVE, "float8_block_scaled_linear")
def _native_float8_block_scaled(xq, xs, weight, scale, bias, block_size, out_dtype):
    w, s = weight.contiguous(), scale.float().contiguous()
    xs2 = xs.reshape(-1, xs.shape[-1]).float().contiguous()
    y = fxq.native_float8_block_scaled_linear(rows(xq), xs2, w, s, block_size)
    return finish(y, xq, weight.shape[0], bias, out_dtype)
