"""The CPU lowering onto fxquant's native kernels (``fxquant.kernels.cpu``), where they built.

Part of the lowering pass (``fxquant.passes.lower``), consulted for ``device="cpu"`` when
``fxquant.kernels.cpu.available()``. Each semantic op becomes a short aten composition around
one ``fxquant::native_*`` op: activations flattened to fp32 rows (and, for w8a8 and fp8,
quantized here in aten ops exactly as the reference does), the GEMM in the native kernel, the
bias and the caller's dtype in the epilogue, which Inductor fuses.

- int8 weight-only, w8a8 (``int8_dynamic_linear`` and the fused ``int8_scaled_linear``) and
  the fp8 weight-only / dynamic / static / scaled linears read the rewrite's own weights
  ([N, K] int8 or e4m3, per-channel fp32 scales): no prepack.
- int4 (and the int2 / int3 / float-zero int4 codes of ``IntxWeightOnly`` in groups of 32 or
  more) are repacked once into the kernel's nibble layout with ``offset = -z * s``
  (``prepack_codes``), which takes any code in [0, 15] and any zero point, integer or float:
  fp32 numerics, no bf16 rounding, no code shifting. W4A8 (``int8_dynamic_int4_linear``) takes
  the same layout into the int4 × int8 kernel, its activation quantized per token here.

The kernels pick their own path by M (a GEMV for decode, dequantize-a-chunk + MKL for
prefill), so one graph serves every M with no ``torch.cond``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import Tensor

import fxquant.core.ops  # noqa: F401  (registers the fxquant:: ops)
import fxquant.kernels.cpu as native
from fxquant.core import reference as ref
from fxquant.core import reference_lowbit as ref_lowbit
from fxquant.passes.prepack import PrepackRule, unique_name

fxq = torch.ops.fxquant

__all__ = ["LOWERINGS", "PREPACK", "available", "e4m3_values", "prepack_codes"]


def available() -> bool:
    """Whether the native kernels can serve this process (built and loaded)."""
    return native.available()


def _per_row(scale: Tensor, n: int) -> Tensor:
    # the kernels take one weight scale per output row: per-tensor scales ([1]) broadcast
    return scale.float().reshape(-1).expand(n).contiguous()


def _rows(x: Tensor) -> Tensor:
    return x.reshape(-1, x.shape[-1]).float().contiguous()


def _finish(y: Tensor, like: Tensor, n: int, bias: Tensor | None, dtype=None) -> Tensor:
    if bias is not None:
        y = y + bias.float()
    return y.reshape(like.shape[:-1] + (n,)).to(like.dtype if dtype is None else dtype)


def _int8_weight_only(x, weight, scale, bias):
    y = fxq.native_int8_weight_only_linear(_rows(x), weight, _per_row(scale, weight.shape[0]))
    return _finish(y, x, weight.shape[0], bias)


def _int8_scaled_rows(xq2: Tensor, xs2: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    return fxq.native_int8_scaled_linear(
        xq2.contiguous(),
        xs2.reshape(-1).float().contiguous(),
        weight,
        _per_row(scale, weight.shape[0]),
    )


def _int8_dynamic(x, weight, scale, bias):
    xq, xs = ref.quantize_int8_per_token(x.reshape(-1, x.shape[-1]))
    return _finish(_int8_scaled_rows(xq, xs, weight, scale), x, weight.shape[0], bias)


def _int8_scaled(xq, xs, weight, scale, bias, out_dtype):
    y = _int8_scaled_rows(xq.reshape(-1, xq.shape[-1]), xs, weight, scale)
    return _finish(y, xq, weight.shape[0], bias, out_dtype)


def _fp8_rows(x2: Tensor, weight: Tensor, scale: Tensor) -> Tensor:
    # e4m3 activations upcast exactly to fp32; the kernel decodes the e4m3 weight itself
    return fxq.native_float8_weight_only_linear(
        x2.float().contiguous(), weight, _per_row(scale, weight.shape[0])
    )


def _float8_weight_only(x, weight, scale, bias):
    return _finish(_fp8_rows(_rows(x), weight, scale), x, weight.shape[0], bias)


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


def _float8_dynamic(x, weight, scale, bias, per_row, activation_scale_ub):
    x2 = x.reshape(-1, x.shape[-1]).float()
    amax = x2.abs().amax(dim=-1, keepdim=True) if per_row else x2.abs().amax().reshape(1)
    xs = ref.fp8_scale(amax, activation_scale_ub)
    y = _fp8_rows(_fp8_quantized_values(x2, xs), weight, scale) * xs
    return _finish(y, x, weight.shape[0], bias)


def _float8_static(x, weight, scale, activation_scale, bias):
    xs = activation_scale.float()
    xq = _fp8_quantized_values(x.reshape(-1, x.shape[-1]).float(), xs)
    return _finish(_fp8_rows(xq, weight, scale) * xs, x, weight.shape[0], bias)


def _float8_scaled(xq, xs, weight, scale, bias, out_dtype):
    y = _fp8_rows(xq.reshape(-1, xq.shape[-1]), weight, scale) * xs.reshape(-1, 1).float()
    return _finish(y, xq, weight.shape[0], bias, out_dtype)


def _cpu_native_int4(x, weight, scale, offset, bias, group_size, out_features):
    x2 = native.pad_columns(_rows(x), 2 * weight.shape[1]).contiguous()
    y = fxq.native_int4_weight_only_linear(x2, weight, scale, offset, group_size)
    return _finish(y, x, out_features, bias)


def _cpu_native_int8_int4(x, weight, scale, offset, bias, group_size, out_features):
    # zero columns leave each token's amax (so its scale) and every sum as they were
    x2 = native.pad_columns(_rows(x), 2 * weight.shape[1])
    xq, xs = ref.quantize_int8_per_token(x2)
    y = fxq.native_int8_int4_linear(
        xq.contiguous(), xs.reshape(-1).contiguous(), weight, scale, offset, group_size
    )
    return _finish(y, x, out_features, bias)


# --------------------------------------------------------------------------------------------
# The int4-layout device ops (what prepack emits) and the prepack rules
# --------------------------------------------------------------------------------------------


@torch.library.custom_op("fxquant::cpu_native_int4_linear", mutates_args=())
def cpu_native_int4_linear(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    offset: Tensor,
    bias: Tensor | None,
    group_size: int,
    out_features: int,
) -> Tensor:
    return _cpu_native_int4(x, weight, scale, offset, bias, group_size, out_features)


@torch.library.custom_op("fxquant::cpu_native_int8_int4_linear", mutates_args=())
def cpu_native_int8_int4_linear(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    offset: Tensor,
    bias: Tensor | None,
    group_size: int,
    out_features: int,
) -> Tensor:
    return _cpu_native_int8_int4(x, weight, scale, offset, bias, group_size, out_features)


@cpu_native_int4_linear.register_fake
@cpu_native_int8_int4_linear.register_fake
def _(x, weight, scale, offset, bias, group_size, out_features):
    return x.new_empty((*x.shape[:-1], out_features))


def prepack_codes(
    u: Tensor, scale: Tensor, zero: Tensor, *, group_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """Codes u [N, Kp] in [0, 15] with w = (u - z) * s → the int4 kernel's three constants."""
    return native.prepack_int4(ref.pack_int4(u), scale, zero, group_size=group_size)


def _prepack_int4(editor, node: fx.Node, consts: list[Tensor]):
    # int4 weight-only and W4A8 store the same weight: one kernel layout, two device ops
    device_op = fxq.cpu_native_int4_linear.default
    if node.target == fxq.int8_dynamic_int4_linear.default:
        device_op = fxq.cpu_native_int8_int4_linear.default
    x, _, _, _, bias, group_size = node.args
    packed, scale, zero = consts
    w, s, o = native.prepack_int4(packed, scale, zero, group_size=group_size)
    args = (x, ("weight", w), ("scale", s), ("offset", o), bias, group_size, packed.shape[0])
    return device_op, args


def _prepack_intx(editor, node: fx.Node, consts: list[Tensor]):
    x, _, _, _, bias, bits, group_size = node.args
    packed, scale, zero = consts
    u = ref_lowbit.unpack_intx(packed, bits)
    w, s, o = prepack_codes(u, scale, zero, group_size=group_size)
    args = (x, ("weight", w), ("scale", s), ("offset", o), bias, group_size, packed.shape[0])
    return fxq.cpu_native_int4_linear.default, args


def _native_int4_takes(node: fx.Node) -> bool:
    # codes of at most 4 bits in groups that are whole 32-column blocks of the kernel layout
    bits, group_size = node.args[5], node.args[6]
    return bits <= 4 and group_size % native.INT4_BLOCK == 0


# --------------------------------------------------------------------------------------------
# Sibling fusion: linears that read the same input become one GEMM over their stacked weights
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Siblings:
    inputs: int  # leading activation args (x, or xq and xs)
    consts: int  # weight-side constants after them, each stacked along its dim 0
    bias: int  # index of the bias argument
    per_row: tuple[int, ...] = ()  # constant positions that must be one value per row


_SIBLINGS = {
    fxq.int8_weight_only_linear.default: _Siblings(1, 2, 3, per_row=(1,)),
    fxq.int8_dynamic_linear.default: _Siblings(1, 2, 3, per_row=(1,)),
    fxq.int8_scaled_linear.default: _Siblings(2, 2, 4, per_row=(1,)),
    fxq.int4_weight_only_linear.default: _Siblings(1, 3, 4),
    fxq.int8_dynamic_int4_linear.default: _Siblings(1, 3, 4),
    fxq.intx_weight_only_linear.default: _Siblings(1, 3, 4),
    fxq.float8_weight_only_linear.default: _Siblings(1, 2, 3, per_row=(1,)),
    fxq.float8_dynamic_linear.default: _Siblings(1, 2, 3, per_row=(1,)),
    fxq.float8_scaled_linear.default: _Siblings(2, 2, 4, per_row=(1,)),
}


def fuse_siblings(editor) -> int:
    """Stack the weights of linears that read the same activation with the same scheme (q, k
    and v after one norm; gate and up) into one GEMM, and slice its output back apart.

    At M = 1 each GEMM is a pass over its weight plus a fixed cost (a parallel region, a call,
    an output buffer): three passes become one, with every byte still read once. The stacked
    constants replace the separate ones. Returns the groups fused.
    """
    from fxquant.passes.plan import node_value
    from fxquant.passes.rewrite import counters

    groups: dict[tuple, list[fx.Node]] = {}
    for node in editor.graph.nodes:
        spec = _SIBLINGS.get(node.target) if node.op == "call_function" else None
        if spec is None:
            continue
        rest = tuple(node.args[spec.bias + 1 :])
        key = (node.target, tuple(node.args[: spec.inputs]), rest, node.args[spec.bias] is None)
        groups.setdefault(key, []).append(node)
    fused = 0
    for (target, _, _, no_bias), nodes in groups.items():
        if len(nodes) < 2:
            continue
        spec = _SIBLINGS[target]
        found = []
        for n in nodes:
            consts = [editor.weight_of(a) for a in n.args[spec.inputs : spec.inputs + spec.consts]]
            bias = None if no_bias else editor.weight_of(n.args[spec.bias])
            if any(c is None for c in consts) or (not no_bias and bias is None):
                break
            w = consts[0][1]
            if any(consts[i][1].reshape(-1).shape[0] != w.shape[0] for i in spec.per_row):
                break  # a per-tensor scale: one value for all rows cannot be stacked
            found.append((n, [t for _, t in consts], None if no_bias else bias[1]))
        if len(found) != len(nodes):
            continue
        first = found[0][0]
        prefix = editor.weight_of(first.args[spec.inputs])[0] + ".siblings"
        stacked = []
        for i in range(spec.consts):
            t = torch.cat([c[i].reshape(c[i].shape[0], -1) for _, c, _ in found])
            t = t.reshape(-1, *found[0][1][i].shape[1:])
            stacked.append(editor.add_constant(unique_name(editor, f"{prefix}.{i}"), t))
        bias = None
        if not no_bias:
            bias = editor.add_constant(
                unique_name(editor, f"{prefix}.bias"), torch.cat([b for _, _, b in found])
            )
        args = (*first.args[: spec.inputs], *stacked, bias, *first.args[spec.bias + 1 :])
        with editor.graph.inserting_before(first):
            whole = editor.graph.call_function(target, args)
        whole.meta["val"] = _fake(editor, target, args, node_value)
        start = 0
        for n, consts, _ in found:
            width = consts[0].shape[0]
            with editor.graph.inserting_before(n):
                part = editor.graph.call_function(
                    torch.ops.aten.slice.Tensor, (whole, -1, start, start + width)
                )
                # contiguous again: consumers view the output as heads ([..., H, D])
                part2 = editor.graph.call_function(
                    torch.ops.aten.clone.default,
                    (part,),
                    {"memory_format": torch.contiguous_format},
                )
            part.meta["val"] = _fake(editor, part.target, part.args, node_value)
            part2.meta["val"] = _fake(editor, part2.target, part2.args, node_value, part2.kwargs)
            for key in ("nn_module_stack", "stack_trace", "custom"):
                if key in n.meta:
                    part2.meta[key] = n.meta[key]
            n.replace_all_uses_with(part2)
            old = [*n.args[spec.inputs : spec.inputs + spec.consts]]
            old += [] if no_bias else [n.args[spec.bias]]
            editor.graph.erase_node(n)
            for c in old:
                editor.release(c)
            start += width
        counters["fuse.siblings"] += 1
        fused += 1
    return fused


def _fake(editor, target, args, node_value, kwargs=None):
    if editor.fake_mode is None:
        return None
    with editor.fake_mode:
        return target(*[node_value(a) for a in args], **(kwargs or {}))


def prepack_table():
    """The native prepack rules (``PrepackRule`` entries, as ``passes/lower.py`` has)."""
    return {
        fxq.int4_weight_only_linear.default: PrepackRule(_prepack_int4, 3),
        fxq.int8_dynamic_int4_linear.default: PrepackRule(_prepack_int4, 3),
        fxq.intx_weight_only_linear.default: PrepackRule(_prepack_intx, 3, when=_native_int4_takes),
    }


# Semantic and device ops → compositions around the native kernels.
LOWERINGS = {
    fxq.int8_weight_only_linear.default: _int8_weight_only,
    fxq.int8_dynamic_linear.default: _int8_dynamic,
    fxq.int8_scaled_linear.default: _int8_scaled,
    fxq.float8_weight_only_linear.default: _float8_weight_only,
    fxq.float8_dynamic_linear.default: _float8_dynamic,
    fxq.float8_static_linear.default: _float8_static,
    fxq.float8_scaled_linear.default: _float8_scaled,
    fxq.cpu_native_int4_linear.default: _cpu_native_int4,
    fxq.cpu_native_int8_int4_linear.default: _cpu_native_int8_int4,
}

PREPACK = prepack_table
