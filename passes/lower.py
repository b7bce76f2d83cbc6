"""Lowering: replace each ``fxquant::`` op by its implementation for the target device.

Last pass of the data flow, run only before Inductor or AOTInductor (a saved ``.pt2`` keeps the
semantic ops). It has two steps:

1. **Prepack** (once, at lowering time): where the fast kernel of a device wants its own weight
   layout, the op's constants are converted and stored as new constants, and the node is
   rewritten to a *device op* (``fxquant::cpu_*``) that takes them. Kernel-side tensors must be
   stored constants, never computed in the graph: Inductor's lowering of
   ``aten._weight_int8pack_mm`` does not realize a computed scale argument and fails with
   ``LoweringException: AssertionError: Pointwise`` under AOTInductor.
2. **Decompose**: ``run_decompositions`` (export path) or ``compile_fx``'s ``decompositions``
   (backend path) traces each semantic op and device op into the aten composition below.
   Nothing Python-only survives, so an AOTInductor package runs where fxquant was never
   imported.

Why each CPU lowering looks the way it does was measured on the dev CPU (AVX2, 2 cores, no
VNNI) by ``benchmarks/cpu_kernels.py`` (results in ``benchmarks/results/cpu_kernels.json``):

- int8 weight-only and w8a8 use ``_weight_int8pack_mm``, which is fast only with bf16
  activations (fp32 takes a scalar path 10-30× slower) and returns bf16; the kernel gets a
  stored bf16 vector of ones and the fp32 per-channel (and per-token) scales are applied in the
  epilogue. w8a8's quantized activations are integers in [-127, 127], exact in bf16; int8
  weight-only rounds x to bf16. Either way the bf16 rounding adds a relative error of ~2-4e-3
  per layer, under the ~8e-3 of int8 quantization itself (tests/test_lower.py bounds it).
  The kernel reads K in steps of 16, so the prepack pads K with zero columns to a multiple of
  16 (shorter rows crashed it or summed past their end).
- int4 uses ``_weight_int4pack_mm_for_cpu`` with the weight repacked by
  ``_convert_weight_to_int4pack_for_cpu`` and a bf16 [K/g, N, 2] scale/zero table; it needs
  N divisible by 16 (padded here) and K a multiple of the group (padded at quantize time).
  int2 / int3 (and float-zero int4, ``IntxWeightOnly``) codes are int4 codes too: they take
  the same kernel (4 bits a code in memory at run time), their zero points folded the same way.
  6-bit codes (GGUF ``Q6_K``, groups of 16) fit neither that kernel's codes nor its groups
  (32 to 256): they keep the reference composition, which dequantizes the weight per call.
  BitNet (int8 per token × ternary) lowers to its reference math in aten ops.
- W4A8 (``int8_dynamic_int4_linear``) takes the same int4 kernel with the int8 codes of its
  per-token activation as the bf16 input (exact in bf16) and the token scale after.
- fp8 has no kernel on this CPU (``_scaled_mm`` is emulated, ~100× slower): the weight is
  upcast per call, correct but slower than fp32. The CUDA lowering is where fp8 pays.
- The fused ``norm_quant`` (``fxquant.passes.fuse``) lowers to its reference math in aten ops
  for Inductor to compile; the int8 linears it feeds (``int8_scaled_linear``) take the same
  ``_weight_int8pack_mm`` path as w8a8, with their quantized input and scale from it.

On CUDA (``lowerings("cuda")``, the table in ``lower_cuda.py``) there is no prepack: each
semantic op becomes the Triton ops of ``fxquant.kernels`` on the rewrite's own layouts, with
the decode (M ≤ 16) and prefill kernels of a GEMM under a ``torch.cond`` on M when M is
dynamic.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.fx as fx
import torch.nn.functional as F
from torch import Tensor
from torch.export import ExportedProgram

import fxquant.core.ops  # noqa: F401  (registers the fxquant:: ops)
from fxquant.core import reference as ref
from fxquant.core import reference_bnb as ref_bnb
from fxquant.core import reference_lowbit as ref_lowbit
from fxquant.core import reference_mx as ref_mx
from fxquant.passes.prepack import PrepackRule, unique_name

fxq = torch.ops.fxquant
_BF16 = torch.bfloat16
_INT4_N_MULTIPLE = 16  # _convert_weight_to_int4pack_for_cpu: "expect N to be dividable by 16"
_INT8_K_MULTIPLE = 16  # _weight_int8pack_mm's K step (see _int8_k16)


# --------------------------------------------------------------------------------------------
# CPU compositions (aten only). Device ops take prepacked constants; semantic ops without a
# prepack lower straight to a composition.
# --------------------------------------------------------------------------------------------


def _epilogue(
    y: Tensor, x: Tensor, n: int, bias: Tensor | None, dtype: torch.dtype | None = None
) -> Tensor:
    """fp32 [M, N'] → x's leading dims × N, plus bias, in ``dtype`` (default: x's)."""
    y = y[:, :n]
    if bias is not None:
        y = y + bias.float()
    return y.reshape(x.shape[:-1] + (n,)).to(x.dtype if dtype is None else dtype)


def _pad_k(x2: Tensor, qweight: Tensor) -> Tensor:
    # the prepacked int8 weight has K padded to a multiple of 16 (see _prepack_int8)
    k = qweight.shape[1]
    return x2 if x2.shape[-1] == k else F.pad(x2, (0, k - x2.shape[-1]))


def _cpu_int8_weight_only(x, qweight, scale, ones, bias):
    x2 = _pad_k(x.reshape(-1, x.shape[-1]).to(_BF16), qweight)
    y = torch.ops.aten._weight_int8pack_mm(x2, qweight, ones).float() * scale
    return _epilogue(y, x, qweight.shape[0], bias)


def _cpu_int8_dynamic(x, qweight, scale, ones, bias):
    xq, xs = ref.quantize_int8_per_token(x.reshape(-1, x.shape[-1]))
    y = torch.ops.aten._weight_int8pack_mm(_pad_k(xq.to(_BF16), qweight), qweight, ones).float()
    return _epilogue(y * (xs * scale), x, qweight.shape[0], bias)


def _cpu_int4_weight_only(x, packed, scale_zero, bias, group_size, out_features):
    x2 = x.reshape(-1, x.shape[-1])
    kp = scale_zero.shape[0] * group_size
    if x2.shape[-1] != kp:
        x2 = F.pad(x2, (0, kp - x2.shape[-1]))
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x2.to(_BF16), packed, group_size, scale_zero)
    return _epilogue(y.float(), x, out_features, bias)


def _cpu_int8_dynamic_int4(x, packed, scale_zero, bias, group_size, out_features):
    # W4A8 on the int4 kernel: the int8 codes are exact in its bf16 input, xs goes in after
    xq, xs = ref.quantize_int8_per_token(x.reshape(-1, x.shape[-1]))
    kp = scale_zero.shape[0] * group_size
    if xq.shape[-1] != kp:
        xq = F.pad(xq, (0, kp - xq.shape[-1]))
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(xq.to(_BF16), packed, group_size, scale_zero)
    return _epilogue(y.float() * xs, x, out_features, bias)


def _upcast_weight_linear(x, weight, scale, bias):
    y = F.linear(x.float(), weight.float()) * scale
    return _epilogue(y.reshape(-1, weight.shape[0]), x, weight.shape[0], bias)


def _float8_dynamic(x, weight, scale, bias, per_row, activation_scale_ub):
    x2 = x.reshape(-1, x.shape[-1])
    if per_row:
        xq, xs = ref.quantize_fp8_per_token(x2, scale_ub=activation_scale_ub)
    else:
        xq, xs = ref.quantize_fp8_per_tensor(x2, scale_ub=activation_scale_ub)
    y = F.linear(xq.float(), weight.float()) * (xs * scale)
    return _epilogue(y, x, weight.shape[0], bias)


def _float8_static(x, weight, scale, activation_scale, bias):
    xq = ref.quantize_fp8_static(x, activation_scale)
    return _float8_scaled(xq, activation_scale, weight, scale, bias, x.dtype)


def _float8_block(x, weight, scale, bias, block_size):
    return ref.float8_block_linear(x, weight, scale, bias, block_size=block_size)


def _cpu_int8_scaled(xq, xs, qweight, scale, ones, bias, out_dtype):
    # int8 values are exact in bf16, the input the fast kernel wants (see the module docstring)
    x2 = _pad_k(xq.reshape(-1, xq.shape[-1]).to(_BF16), qweight)
    y = torch.ops.aten._weight_int8pack_mm(x2, qweight, ones).float() * (xs.reshape(-1, 1) * scale)
    return _epilogue(y, xq, qweight.shape[0], bias, out_dtype)


def _float8_scaled(xq, xs, weight, scale, bias, out_dtype):
    x2 = xq.reshape(-1, xq.shape[-1])
    y = F.linear(x2.float(), weight.float()) * (xs.reshape(-1, 1) * scale)
    return _epilogue(y, xq, weight.shape[0], bias, out_dtype)


def _intx_weight_only(x, weight, scale, zero, bias, bits, group_size):
    # 6-bit codes, and where prepack cannot see the weights (see _prepack_intx): unpack with
    # shifts and masks, dequantize in fp32 and run a dense linear, the reference math in aten.
    w = ref_lowbit.dequantize_intx_grouped(weight, scale, zero, bits=bits, group_size=group_size)
    y = F.linear(x.reshape(-1, x.shape[-1]).float(), w[:, : x.shape[-1]])
    return _epilogue(y, x, weight.shape[0], bias)


def _bitnet(x, weight, weight_scale, bias):
    # transformers' BitLinear: int8 activations per token, ternary weights, fp32 accumulation
    # (|x_q · w_q| <= 128 K is exact in fp32 up to K = 2**17), one division by both multipliers.
    xq, inv = ref_lowbit.quantize_bitnet_activation(x.reshape(-1, x.shape[-1]))
    y = F.linear(xq.float(), ref_lowbit.unpack_bitnet(weight).float()) / (inv * weight_scale)
    return _epilogue(y, x, 4 * weight.shape[0], bias)


def _bnb4_weight_only(x, weight, absmax, quant_map, na, nqm, noff, bias, block_size):
    # No CPU kernel takes NF4/FP4 codes: unpack, look the codes up, scale by the (double-quant
    # decoded) block absmax in fp32, then a dense linear; Inductor fuses the decode into one
    # pointwise kernel. Correct, not fast: the fp32 weight is rebuilt on every call.
    w = ref_bnb.dequantize_4bit(weight, absmax, quant_map, na, nqm, noff, block_size=block_size)
    y = F.linear(x.reshape(-1, x.shape[-1]).float(), w)
    return _epilogue(y, x, weight.shape[0], bias)


def _llm_int8(x, weight, absmax, bias, threshold):
    # The reference in aten ops: the outlier columns are a mask (static shapes), so the float
    # part is a second dense GEMM on the masked activation.
    return ref_bnb.llm_int8_linear(x, weight, absmax, bias, threshold=threshold)


# Microscaling formats: no CPU has block-scaled FP8/FP4 GEMMs, so both operands are dequantized
# to fp32 in aten ops (frexp, bit shifts, the e2m1 decode as arithmetic) and multiplied by one
# fp32 matmul: the reference itself, which Inductor compiles (tests/test_mx.py); correct, not
# faster than fp32. The CUDA lowering is where these formats are meant to pay.


def _mxfp8(x, weight, scale, bias, scale_rule):
    return ref_mx.mxfp8_linear(x, weight, scale, bias, scale_rule=scale_rule)


def _mxfp4(x, weight, scale, bias, activations, scale_rule):
    rule = scale_rule if activations else None
    return ref_mx.mxfp4_linear(x, weight, scale, bias, activation_rule=rule)


def _mxfp4_grouped_mm(x, weight, scale, offs):
    # The reference's loop over experts splits rows at data-dependent offsets, which does not
    # trace into aten. Instead every row meets every expert in one [S, E·N] GEMM and keeps its
    # own expert's N columns: E/top-k times the FLOPs, but one dense GEMM Inductor compiles and
    # AOTInductor packages. CUDA runs the grouped Triton kernel (lower_cuda.py).
    e, n = weight.shape[0], weight.shape[1]
    w = ref_mx.dequantize_mxfp4_weight(weight, scale)  # [E, N, K]
    every = (x.float() @ w.flatten(0, 1).t()).unflatten(-1, (e, n))  # [S, E, N]
    ids = ref_mx.expert_of_rows(offs, x.shape[0])
    mine = every.gather(1, ids.clamp(max=e - 1)[:, None, None].expand(-1, 1, n)).squeeze(1)
    return torch.where((ids < e)[:, None], mine, 0.0).to(x.dtype)


def _nvfp4(x, weight, scale, tensor_scale, bias, activations, scale_rule):
    rule = scale_rule if activations else None
    return ref_mx.nvfp4_linear(x, weight, scale, tensor_scale, bias, activation_rule=rule)


def _norm_quant(x, weight, bias, eps, rms, quant_dtype, group_size, scale_ub):
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
    return q, scale


# --------------------------------------------------------------------------------------------
# Device ops: what a node becomes after prepack, decomposed again right away.
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("fxquant::cpu_int8_weight_only_linear", mutates_args=())
def cpu_int8_weight_only_linear(
    x: Tensor, qweight: Tensor, scale: Tensor, ones: Tensor, bias: Tensor | None
) -> Tensor:
    return _cpu_int8_weight_only(x, qweight, scale, ones, bias)


@torch.library.custom_op("fxquant::cpu_int8_dynamic_linear", mutates_args=())
def cpu_int8_dynamic_linear(
    x: Tensor, qweight: Tensor, scale: Tensor, ones: Tensor, bias: Tensor | None
) -> Tensor:
    return _cpu_int8_dynamic(x, qweight, scale, ones, bias)


@torch.library.custom_op("fxquant::cpu_int4_weight_only_linear", mutates_args=())
def cpu_int4_weight_only_linear(
    x: Tensor,
    packed: Tensor,
    scale_zero: Tensor,
    bias: Tensor | None,
    group_size: int,
    out_features: int,
) -> Tensor:
    return _cpu_int4_weight_only(x, packed, scale_zero, bias, group_size, out_features)


@torch.library.custom_op("fxquant::cpu_int8_dynamic_int4_linear", mutates_args=())
def cpu_int8_dynamic_int4_linear(
    x: Tensor,
    packed: Tensor,
    scale_zero: Tensor,
    bias: Tensor | None,
    group_size: int,
    out_features: int,
) -> Tensor:
    return _cpu_int8_dynamic_int4(x, packed, scale_zero, bias, group_size, out_features)


@cpu_int8_weight_only_linear.register_fake
@cpu_int8_dynamic_linear.register_fake
def _(x, qweight, scale, ones, bias):
    return x.new_empty((*x.shape[:-1], qweight.shape[0]))


@cpu_int4_weight_only_linear.register_fake
@cpu_int8_dynamic_int4_linear.register_fake
def _(x, packed, scale_zero, bias, group_size, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


@torch.library.custom_op("fxquant::cpu_int8_scaled_linear", mutates_args=())
def cpu_int8_scaled_linear(
    xq: Tensor,
    xs: Tensor,
    qweight: Tensor,
    scale: Tensor,
    ones: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
) -> Tensor:
    return _cpu_int8_scaled(xq, xs, qweight, scale, ones, bias, out_dtype)


@cpu_int8_scaled_linear.register_fake
def _(xq, xs, qweight, scale, ones, bias, out_dtype):
    return xq.new_empty((*xq.shape[:-1], qweight.shape[0]), dtype=out_dtype)


# --------------------------------------------------------------------------------------------
# Prepack rules: semantic node → device node with new constants (computed once).
# --------------------------------------------------------------------------------------------


def _int8_k16(qweight_node, qweight: Tensor):
    # _weight_int8pack_mm reads K in steps of 16: any other K reads past each row (measured on
    # torch 2.13, AVX2: wrong sums at K = 100, a segfault at K = 1..15). Zero columns, which the
    # compositions match with zero activations, change no sum.
    k_pad = -qweight.shape[1] % _INT8_K_MULTIPLE
    return qweight_node if not k_pad else ("qweight_k16", F.pad(qweight, (0, k_pad)))


def _prepack_int8(device_op):
    def rule(editor, node: fx.Node, consts: list[Tensor]):
        x, qweight, scale, bias = node.args
        ones = torch.ones(consts[0].shape[0], dtype=_BF16)
        return device_op, (x, _int8_k16(qweight, consts[0]), scale, ("ones", ones), bias)

    return rule


def _prepack_int8_scaled(editor, node: fx.Node, consts: list[Tensor]):
    xq, xs, qweight, scale, bias, out_dtype = node.args
    ones = torch.ones(consts[0].shape[0], dtype=_BF16)
    args = (xq, xs, _int8_k16(qweight, consts[0]), scale, ("ones", ones), bias, out_dtype)
    return fxq.cpu_int8_scaled_linear.default, args


def _prepack_int4(editor, node: fx.Node, consts: list[Tensor]):
    # int4 weight-only and W4A8 store the same weight: one layout, two device ops
    device_op = fxq.cpu_int4_weight_only_linear.default
    if node.target == fxq.int8_dynamic_int4_linear.default:
        device_op = fxq.cpu_int8_dynamic_int4_linear.default
    x, _, _, _, bias, group_size = node.args
    packed, scale, zero = consts
    n = packed.shape[0]
    n_pad = -n % _INT4_N_MULTIPLE
    # The CPU kernel dequantizes w = (u - 8) * s + zp; ours is w = (u - z) * s: zp = (8 - z) * s.
    u = F.pad(ref.unpack_int4(packed), (0, 0, 0, n_pad)).to(torch.int32)
    s = F.pad(scale, (0, 0, 0, n_pad))
    zp = F.pad((8 - zero.float()) * scale, (0, 0, 0, n_pad))
    cpu_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1)
    scale_zero = torch.stack([s, zp], dim=-1).transpose(0, 1).contiguous().to(_BF16)
    args = (x, ("packed", cpu_packed), ("scale_zero", scale_zero), bias, group_size, n)
    return device_op, args


def _prepack_intx(editor, node: fx.Node, consts: list[Tensor]):
    # int2 / int3 codes (and float-zero int4) are valid int4 codes: the int4 CPU kernel runs
    # them at int4 speed (the composition below would materialise the fp32 weight per call).
    # It computes w = (u - 8) * s + zp in bf16. With zp = (8 - z) * s as for int4, a 2-bit
    # group would cancel two values near 8s down to at most 3s (measured: 26 dB from the
    # reference instead of int4's 40+). So each group's codes move up by c = round(8 - z)
    # (clamped so they stay in [0, 15]): zp = (8 - c - z) * s is 0 for an integer z and at
    # most s/2 for a float one, and (u + c - 8) * s is as small as w itself.
    x, _, _, _, bias, bits, group_size = node.args
    packed, scale, zero = consts
    n = packed.shape[0]
    n_pad = -n % _INT4_N_MULTIPLE
    z = zero.float()
    shift = torch.round(8 - z).clamp(0, 16 - 2**bits)
    u = ref_lowbit.unpack_intx(packed, bits).to(torch.int32)
    u = u + shift.to(torch.int32).repeat_interleave(group_size, dim=1)
    u = F.pad(u, (0, 0, 0, n_pad))
    s = F.pad(scale, (0, 0, 0, n_pad))
    zp = F.pad((8 - shift - z) * scale, (0, 0, 0, n_pad))
    cpu_packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1)
    scale_zero = torch.stack([s, zp], dim=-1).transpose(0, 1).contiguous().to(_BF16)
    args = (x, ("packed", cpu_packed), ("scale_zero", scale_zero), bias, group_size, n)
    return fxq.cpu_int4_weight_only_linear.default, args


def _int4_kernel_takes(node: fx.Node) -> bool:
    # codes of 2 to 4 bits in groups of 32 to 256: the int4 kernel's (6-bit codes in groups of
    # 16, GGUF Q6_K's, are neither)
    bits, group_size = node.args[5], node.args[6]
    return bits <= 4 and group_size >= 32


CPU_PREPACK = {
    fxq.int8_weight_only_linear.default: PrepackRule(
        _prepack_int8(fxq.cpu_int8_weight_only_linear.default), 2
    ),
    fxq.int8_dynamic_linear.default: PrepackRule(
        _prepack_int8(fxq.cpu_int8_dynamic_linear.default), 2
    ),
    fxq.int4_weight_only_linear.default: PrepackRule(_prepack_int4, 3),
    fxq.int8_dynamic_int4_linear.default: PrepackRule(_prepack_int4, 3),
    fxq.intx_weight_only_linear.default: PrepackRule(_prepack_intx, 3, when=_int4_kernel_takes),
    fxq.int8_scaled_linear.default: PrepackRule(_prepack_int8_scaled, 2, first_const=2),
}

# Device ops (what prepack emits) → their aten compositions.
CPU_DECOMPOSITIONS = {
    fxq.cpu_int8_weight_only_linear.default: _cpu_int8_weight_only,
    fxq.cpu_int8_dynamic_linear.default: _cpu_int8_dynamic,
    fxq.cpu_int4_weight_only_linear.default: _cpu_int4_weight_only,
    fxq.cpu_int8_dynamic_int4_linear.default: _cpu_int8_dynamic_int4,
    fxq.cpu_int8_scaled_linear.default: _cpu_int8_scaled,
}

# Semantic ops → aten compositions. The ones with a prepack rule fall back to the reference math
# when a node's weights are not constants the pass can see.
CPU_LOWERINGS = {
    fxq.int8_weight_only_linear.default: ref.int8_weight_only_linear,
    fxq.int8_dynamic_linear.default: ref.int8_dynamic_linear,
    fxq.int4_weight_only_linear.default: lambda x, w, s, z, b, g: ref.int4_weight_only_linear(
        x, w, s, z, b, group_size=g
    ),
    fxq.int8_dynamic_int4_linear.default: lambda x, w, s, z, b, g: ref.int8_dynamic_int4_linear(
        x, w, s, z, b, group_size=g
    ),
    fxq.float8_weight_only_linear.default: _upcast_weight_linear,
    fxq.float8_dynamic_linear.default: _float8_dynamic,
    fxq.float8_static_linear.default: _float8_static,
    fxq.float8_block_linear.default: _float8_block,
    fxq.norm_quant.default: _norm_quant,
    fxq.intx_weight_only_linear.default: _intx_weight_only,
    fxq.bitnet_linear.default: _bitnet,
    fxq.bnb4_weight_only_linear.default: _bnb4_weight_only,
    fxq.llm_int8_linear.default: _llm_int8,
    fxq.mxfp8_linear.default: _mxfp8,
    fxq.mxfp4_linear.default: _mxfp4,
    fxq.mxfp4_grouped_mm.default: _mxfp4_grouped_mm,
    fxq.nvfp4_linear.default: _nvfp4,
    fxq.int8_scaled_linear.default: lambda xq, xs, w, s, b, dtype: ref.int8_scaled_linear(
        xq, xs, w, s, b, out_dtype=dtype
    ),
    fxq.float8_scaled_linear.default: _float8_scaled,
    fxq.float8_block_scaled_linear.default: lambda xq, xs, w, s, b, bs, dtype: (
        ref.float8_block_scaled_linear(xq, xs, w, s, b, block_size=bs, out_dtype=dtype)
    ),
}


def _device_type(device: str | torch.device) -> str:
    device_type = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not supported for lowering; allowed: 'cpu', 'cuda'")
    return device_type


def native_cpu() -> bool:
    """Whether the CPU lowering targets fxquant's native kernels (``fxquant.kernels.cpu``, built
    on first use); False where they cannot be built, and with ``FXQUANT_NATIVE=0``."""
    from fxquant.passes import lower_native

    return lower_native.available()


def lowerings(device: str | torch.device = "cpu") -> dict:
    """The op → aten composition table for a device type (semantic and device ops)."""
    if _device_type(device) == "cuda":
        # Imported here: it defines the Triton kernels, which CPU-only work never needs.
        from fxquant.passes.lower_cuda import CUDA_LOWERINGS

        return dict(CUDA_LOWERINGS)
    table = {**CPU_LOWERINGS, **CPU_DECOMPOSITIONS}
    if native_cpu():
        from fxquant.passes import lower_native

        table.update(lower_native.LOWERINGS)
    return table


def _cpu_prepack_rules() -> dict:
    if native_cpu():
        from fxquant.passes import lower_native

        return lower_native.prepack_table()  # int8 and fp8 need none: the kernels read W as is
    return CPU_PREPACK


def prepack(editor, *, device: str | torch.device = "cpu") -> int:
    """Rewrite every semantic op whose constants the editor can see to its device op, adding the
    prepacked constants (shared between nodes that share weights). Returns the nodes rewritten."""
    from fxquant.passes.rewrite import counters

    if _device_type(device) != "cpu":
        return 0
    if native_cpu():
        from fxquant.passes import lower_native

        lower_native.fuse_siblings(editor)
    rules = _cpu_prepack_rules()
    done = 0
    cache: dict[tuple, fx.Node] = {}
    for node in list(editor.graph.nodes):
        rule = rules.get(node.target) if node.op == "call_function" else None
        if rule is None or (rule.when is not None and not rule.when(node)):
            continue
        const_nodes = node.args[rule.first_const : rule.first_const + rule.n_consts]
        found = [editor.weight_of(n) for n in const_nodes]
        if any(f is None for f in found):
            continue
        target, args = rule.rule(editor, node, [t for _, t in found])
        # "fc.qweight" → "fc.cpu_ones"; "proj_qweight" (a root parameter's) → "proj_cpu_ones"
        first = found[0][0]
        prefix = first.removesuffix("qweight") if first.endswith("qweight") else first + "_"
        prefix += "cpu_"
        new_args = []
        for a in args:
            if isinstance(a, tuple) and len(a) == 2 and isinstance(a[1], Tensor):
                key = (found[0][0], a[0])
                if key not in cache:
                    cache[key] = editor.add_constant(unique_name(editor, prefix + a[0]), a[1])
                a = cache[key]
            new_args.append(a)
        editor.swap(node, target, tuple(new_args))
        for old in const_nodes:
            editor.release(old)
        counters[f"prepack.{target._opname}"] += 1
        done += 1
    return done


def prepacked(ep: ExportedProgram, *, device: str | torch.device = "cpu") -> ExportedProgram:
    """A new program with the prepack step done (device ops on their new constants) and every
    other op as it was: what :func:`lower` decomposes, or what AOTInductor traces itself under
    :func:`inductor_decompositions`."""
    from fxquant.passes.rewrite import ProgramEditor

    editor = ProgramEditor(ep)
    prepack(editor, device=device)
    return editor.finish()


def lower(ep: ExportedProgram, *, device: str | torch.device = "cpu") -> ExportedProgram:
    """A new program with every ``fxquant::`` op replaced by ``device``'s implementation, and the
    rest decomposed to the core aten opset Inductor and AOTInductor expect."""
    table = torch.export.default_decompositions()
    table.update(lowerings(device))
    return prepacked(ep, device=device).run_decompositions(table)


@contextlib.contextmanager
def inductor_decompositions(table: dict) -> Iterator[None]:
    """Add ``table`` to the decompositions Inductor applies while it traces, for the duration.

    ``aoti_compile_and_package`` traces the program once more whatever it is given; handing it
    the prepacked program with our lowerings in Inductor's own table saves :func:`lower`'s
    separate full retrace (about 30 s of a 2.5-minute SmolLM2 build on two cores). Inductor
    takes no decompositions argument on that path, so the entries go into the table it reads
    (``select_decomp_table()``, a cached dict) and come out again afterwards; they are keyed by
    fxquant's own ops only, so nothing else that compiles meanwhile can see a difference.
    """
    from torch._inductor.decomposition import select_decomp_table

    current = select_decomp_table()
    added = {k: v for k, v in table.items() if k not in current}
    current.update(added)
    try:
        yield
    finally:
        for k in added:
            current.pop(k, None)
