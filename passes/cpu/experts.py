"""The CPU lowering of the mixture-of-experts GEMMs (``int8_weight_only_grouped_mm``,
``int4_weight_only_grouped_mm``, ``int8_dynamic_int4_grouped_mm``, ``int8_dynamic_grouped_mm``,
``float8_weight_only_grouped_mm``, ``float8_dynamic_grouped_mm``, ``float8_block_grouped_mm``,
``mxfp4_grouped_mm``, and the experts a config leaves in float):
each row of x [S, K] times its own expert's weight.

Where it sits: registered by op name (``fxquant.core.registry``) and read by the lowering pass
(``fxquant.passes.lower``), and ``lower_float_experts``, a step of its prepack; the oracles are
``fxquant.core.reference.grouped_linear`` and the ops' references.

The reference loops over experts and slices rows at data-dependent offsets, which does not trace
into aten. Where fxquant's native kernels are built, int8 and fp32 experts go to a native op
that reads the offsets on the host and runs each expert's rows on the linear's own GEMV or GEMM
(kernels/cpu/int8_fp8.cpp, float32.cpp): decode reads only the experts its token chose, prefill
runs one GEMM per expert. Measured by hand on a 2-core Zen 4 (16 experts of 1024 × 1024, int8 on
its fp32 paths, against transformers' fallback loop on the fp32 weights): S = 1 2.6× faster,
S = 4 4.0×, S = 64 4.8×, S = 512 even. Where the machine's dispatch table runs the int8 linear's
large rows on its bf16-dot GEMM (AVX-512 BF16, AMX), the experts' rows do too from 2 rows an
expert (x rounded to bf16, as there): on the Zen 4 a 32-row expert took 0.21 ms there against
0.63 on the fp32 path (1024 × 1024). Elsewhere every row gathers its expert's weight
(``weight[ids]``, ``ids`` from ``offs``) and reduces over K in one product Inductor fuses (no
[S, N, K] copy, indirect loads): at S = 4 2.0× the fallback, at S = 512 0.8× (32 experts).
int4 experts (weight-only and W4A8) are prepacked once into the int4 linear's kernel layout and
run the same way on its kernels (kernels/cpu/int4.cpp), each expert's rows on the path that
linear takes at that row count on this machine (``int4_row_paths``). The quantized experts' native
kernels skip rows of zeros (their product with a finite weight is zeros) and count the rows that
remain: Llama 4 sends every token through every expert, 0 where it did not choose it, so its
decode step reads the chosen expert's weights only (kernels/cpu/native.h, ``run_grouped``).
W8A8 and fp8 experts (per-row and block scales) quantize x in the native op as their linear
does, then run each expert's rows on that linear's kernels with the rows' scales.
MXFP4's e2m1 decode is dear per value: its gather serves decode (2-3 ms where one GEMM of every
row with every expert took 54 ms), that dense GEMM prefill (past three rows per expert). No CPU
kernel here has FP4 arithmetic.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

import fxquant.core.ops  # noqa: F401  (registers the fxquant:: ops)
import fxquant.kernels.cpu as native  # declares the fxquant::native_* ops
from fxquant.core import reference as ref
from fxquant.core import reference_mx as ref_mx
from fxquant.core.registry import lowering
from fxquant.passes.cpu.common import NATIVE, device_op
from fxquant.passes.cpu.dispatch import by_plan, plan_for
from fxquant.passes.cpu.float8 import e4m3_values
from fxquant.passes.cpu.prepack import prepack_rule
from fxquant.passes.plan import FALLBACK_OPS, find_sites, node_value

fxq = torch.ops.fxquant


# what each experts op runs on CPU, in words (the report's CPU-kernel lines), by scheme name:
# (needs the native kernels, the words)
EXPERT_KERNELS = {
    "int8_weight_only": (
        True,
        "fxquant native int8 grouped kernel: each expert's rows on the int8 linear's kernels "
        "(its bf16-dot GEMM from 2 rows, x rounded to bf16, where this CPU class's table runs the "
        "int8 linear so; else the fp32 GEMV up to M = 32, then the chunked fp32 GEMM); rows of "
        "zeros (Llama 4's unchosen experts) give zeros without running",
    ),
    "int4_weight_only": (
        True,
        "fxquant native int4 grouped kernel: each expert's rows on the int4 linear's kernels at "
        "that row count, as this CPU class's table runs that linear (fp32 GEMV, bf16-dot GEMM, or "
        "x quantized per token to int8 on the W4A8 kernels); rows of zeros give zeros without "
        "running",
    ),
    "int8_dynamic_int4": (
        True,
        "fxquant native int4 grouped kernel: each expert's rows quantized per token to int8 on "
        "the W4A8 linear's kernels (GEMV, then the integer GEMM); rows of zeros give zeros "
        "without running",
    ),
    "float8_weight_only": (
        True,
        "fxquant native fp8 grouped kernel: each expert's rows on the fp8 weight-only linear's "
        "kernels (its bf16-dot GEMM from 2 rows, x rounded to bf16, where this CPU class's table "
        "runs that linear so; else the fp32 GEMV, then the chunked fp32 GEMM); rows of zeros give "
        "zeros without running",
    ),
    "int8_dynamic": (
        True,
        "fxquant native W8A8 grouped kernel: each expert's rows quantized per token to int8 in "
        "the kernel, then the w8a8 linear's integer kernels on the expert's stored weight (the "
        "int8 × int8 GEMV for a few rows, then the integer panel GEMM, VNNI where the CPU has "
        "it); rows of zeros give zeros without running",
    ),
    "float8_dynamic": (
        True,
        "fxquant native fp8 grouped kernel: x quantized per token to e4m3 in the kernel, then "
        "each expert's rows on the fp8 linear's kernels (its bf16-dot GEMM from 2 rows, exact "
        "for e4m3 values, where this CPU class's table runs that linear so; else the fp32 GEMV "
        "up to M = 32, then the chunked fp32 GEMM), each row times its scale; rows of zeros give "
        "zeros without running",
    ),
    "float8_block": (
        True,
        "fxquant native fp8 block grouped kernel: x quantized in 1 × b groups in the kernel, then "
        "each expert's rows on the fp8 block linear's kernels at that row count (the GEMV with "
        "span scales, bf16 dot products from 2 rows on AVX-512 BF16, else the dequantized GEMM "
        "past 32 rows); rows of zeros give zeros without running",
    ),
    "mxfp4": (
        False,
        "aten: each row decodes its expert's e2m1 bytes up to 3 rows an expert, then every "
        "expert decoded once and one dense GEMM (no CPU has FP4 arithmetic)",
    ),
}
BMM_ATEN_KERNEL = "aten.bmm, as the model runs it (every token through every expert)"
BMM_EXPERTS_KERNEL = (
    "fxquant native fp32 grouped kernel: every expert's rows (every token, as the model sends "
    "them) on ATen's mm, rows of zeros (the experts a token did not choose) left at zero where "
    "the weight is finite"
)
FLOAT_EXPERTS_KERNEL = (
    "fxquant native fp32 grouped kernel: each expert's rows on the fp32 GEMV up to M = 8, then "
    "ATen's mm (bf16 weights: each row gathers its expert)"
)


def per_row_expert(x: Tensor, offs: Tensor, experts: int, product: Callable) -> Tensor:
    """fp32 [S, N]: ``product(x, ids)`` with ``ids`` [S] each row's expert, zeros for the rows
    past ``offs[-1]`` (no expert owns them, as in the reference)."""
    ids = ref.expert_of_rows(offs, x.shape[0])
    owned = ids < experts
    y = product(x.float(), ids.clamp(max=experts - 1))
    return torch.where(owned[:, None], y, 0.0)


def bf16_experts() -> bool:
    """Whether int8 experts take the bf16-dot GEMM from 2 rows on this machine: where the
    dispatch table (``dispatch_table.json``) runs the int8 linear's largest rows on it."""
    return plan_for("native_int8_weight_only_linear")[-1][1] == "bf16_dot"


@lowering(NATIVE, "int8_weight_only_grouped_mm")
def _native_int8_weight_only_grouped_mm(x, weight, scale, offs):
    # the native kernel splits the rows by expert on the host and runs each expert's rows on the
    # int8 linear's own GEMV / GEMM (kernels/cpu/int8_fp8.cpp): fp32 x, the reference's products,
    # or from 2 rows its bf16-dot GEMM (x rounded to bf16) where the machine's table picks it
    y = fxq.native_int8_weight_only_grouped_mm(
        x.float().contiguous(), weight.contiguous(), scale.float().contiguous(), offs.long(),
        bf16_experts(),
    )  # fmt: skip
    return y.to(x.dtype)


@lowering("cpu", "int8_weight_only_grouped_mm")
def _int8_weight_only_grouped_mm(x, weight, scale, offs):
    def product(xf, ids):  # the codes' product, then the scale (the reference's order)
        return (xf[:, None, :] * weight[ids].float()).sum(-1) * scale[ids]

    return per_row_expert(x, offs, weight.shape[0], product).to(x.dtype)


@lowering(NATIVE, "float8_weight_only_grouped_mm")
def _native_float8_weight_only_grouped_mm(x, weight, scale, offs):
    # int8wo's kernel on e4m3 bytes (kernels/cpu/int8_fp8.cpp, bytes_grouped_mm)
    y = fxq.native_float8_weight_only_grouped_mm(
        x.float().contiguous(), weight.contiguous(), scale.float().contiguous(), offs.long(),
        fp8_bf16_experts(),
    )  # fmt: skip
    return y.to(x.dtype)


@lowering("cpu", "float8_weight_only_grouped_mm")
def _float8_weight_only_grouped_mm(x, weight, scale, offs):
    def product(xf, ids):  # the e4m3 values' product, then the scale (the reference's order)
        return (xf[:, None, :] * weight[ids].float()).sum(-1) * scale[ids]

    return per_row_expert(x, offs, weight.shape[0], product).to(x.dtype)


@lowering(NATIVE, "int8_dynamic_grouped_mm")
def _native_int8_dynamic_grouped_mm(x, weight, scale, offs):
    # per token int8 and the integer kernels of the w8a8 linear, each expert's rows on its own
    # stored weight (kernels/cpu/int8_fp8.cpp)
    y = fxq.native_int8_dynamic_grouped_mm(
        x.float().contiguous(), weight.contiguous(), scale.float().contiguous(), offs.long()
    )
    return y.to(x.dtype)


@lowering("cpu", "int8_dynamic_grouped_mm")
def _int8_dynamic_grouped_mm(x, weight, scale, offs):
    xq, xs = ref.quantize_int8_per_token(x)  # per row: the grid does not depend on the expert

    def product(xv, ids):  # the integer codes' products, then the scales (the reference's order)
        return (xv[:, None, :] * weight[ids].float()).sum(-1) * scale[ids]

    return (per_row_expert(xq.float(), offs, weight.shape[0], product) * xs).to(x.dtype)


# --------------------------------------------------------------------------------------------
# fp8 experts (fp8-row: FbgemmFp8Config's; fp8-block: FineGrainedFP8Config's): x quantized as
# the linear quantizes it (a row's grid does not depend on its expert), each expert's rows on
# the fp8 linear's native kernels; elsewhere each row gathers its expert's e4m3 weight
# --------------------------------------------------------------------------------------------


def fp8_bf16_experts() -> bool:
    """Whether fp8 experts take the bf16-dot GEMM from 2 rows on this machine: where the
    dispatch table runs the fp8 linear's largest rows on it."""
    return plan_for("native_float8_weight_only_linear")[-1][1] == "bf16_dot"


@lowering(NATIVE, "float8_dynamic_grouped_mm")
def _native_float8_dynamic_grouped_mm(x, weight, scale, offs, activation_scale_ub):
    ub = math.inf if activation_scale_ub is None else float(activation_scale_ub)
    y = fxq.native_float8_dynamic_grouped_mm(
        x.float().contiguous(), weight.contiguous(), scale.float().contiguous(), offs.long(), ub,
        fp8_bf16_experts(),
    )  # fmt: skip
    return y.to(x.dtype)


@lowering("cpu", "float8_dynamic_grouped_mm")
def _float8_dynamic_grouped_mm(x, weight, scale, offs, activation_scale_ub):
    xf = x.float()
    xs = ref.fp8_scale(xf.abs().amax(dim=-1, keepdim=True), activation_scale_ub)
    xq = e4m3_values((xf / xs).clamp(-ref.FP8_E4M3_MAX, ref.FP8_E4M3_MAX))

    def product(xv, ids):  # the e4m3 products, then the channel scale (the reference's order)
        return (xv[:, None, :] * weight[ids].float()).sum(-1) * scale[ids]

    return (per_row_expert(xq, offs, weight.shape[0], product) * xs).to(x.dtype)


@lowering(NATIVE, "float8_block_grouped_mm")
def _native_float8_block_grouped_mm(x, weight, scale, offs, block_size):
    y = fxq.native_float8_block_grouped_mm(
        x.float().contiguous(), weight.contiguous(), scale.float().contiguous(), offs.long(),
        block_size,
    )  # fmt: skip
    return y.to(x.dtype)


@lowering("cpu", "float8_block_grouped_mm")
def _float8_block_grouped_mm(x, weight, scale, offs, block_size):
    n, k = weight.shape[1], weight.shape[2]
    xq, xs = ref.quantize_fp8_groups(x, group_size=block_size)
    xd = xq.float() * ref.expand_group_scale(xs, cols=k, group_size=block_size)

    def product(xv, ids):  # each row's expert dequantized tile by tile, inside the reduction
        ws = ref.expand_block_scale(scale[ids], rows=n, cols=k, block_size=block_size)
        return (xv[:, None, :] * (weight[ids].float() * ws)).sum(-1)

    return per_row_expert(xd, offs, weight.shape[0], product).to(x.dtype)


# --------------------------------------------------------------------------------------------
# int4 experts (int4wo-<g>, w4a8-<g>): the int4 linear's layout and kernels per expert
# --------------------------------------------------------------------------------------------


def _int4_gather(x, weight, scale, zero, group_size):
    """fp32 [S, N]: each row of x times its gathered expert's int4 weight, decoded inside the
    reduction (x zero-padded to the stored Kp columns, which decode to exactly zero)."""
    kp = 2 * weight.shape[-1]
    xp = F.pad(x.float(), (0, kp - x.shape[-1]))

    def product(xf, ids):
        u = ref.unpack_int4(weight[ids]).float()  # [S, N, Kp]
        u = u.unflatten(-1, (kp // group_size, group_size))
        w = (u - zero[ids].float()[..., None]) * scale[ids][..., None]
        return (xf[:, None, :] * w.flatten(-2)).sum(-1)

    return product, xp


@lowering("cpu", "int4_weight_only_grouped_mm")
def _int4_weight_only_grouped_mm(x, weight, scale, zero, offs, group_size):
    product, xp = _int4_gather(x, weight, scale, zero, group_size)
    return per_row_expert(xp, offs, weight.shape[0], product).to(x.dtype)


@lowering("cpu", "int8_dynamic_int4_grouped_mm")
def _int8_dynamic_int4_grouped_mm(x, weight, scale, zero, offs, group_size):
    xq, xs = ref.quantize_int8_per_token(x)  # per row: the grid does not depend on the expert
    product, xp = _int4_gather(xq, weight, scale, zero, group_size)
    return (per_row_expert(xp, offs, weight.shape[0], product) * xs).to(x.dtype)


def int4_row_paths() -> tuple[int, int]:
    """(bf16_from, int8_from) of ``native_int4_grouped_mm`` for int4 weight-only experts: the
    first M at which the machine's dispatch table runs the int4 linear on bf16 dot products and
    on the W4A8 kernel with x quantized per token (0: at no M), so an expert's rows run as a
    linear's would at that M."""
    bf16_from = int8_from = 0
    first = 1
    for max_m, name in plan_for("native_int4_weight_only_linear"):
        if name in ("bf16_dot", "bf16") and not bf16_from:
            bf16_from = first
        if name == "int8_act" and not int8_from:
            int8_from = first
        if max_m is None:
            break
        first = max_m + 1
    return bf16_from, int8_from


def _native_int4_fake(x, weight, scale, offset, offs, group_size):
    return x.new_empty((x.shape[0], weight.shape[1]))


_NATIVE_INT4_SCHEMA = (
    "(Tensor x, Tensor weight, Tensor scale, Tensor offset, Tensor offs, SymInt group_size) "
    "-> Tensor"
)


def _native_int4_experts(x, weight, scale, offset, offs, group_size, paths):
    x2 = native.pad_columns(x.float(), 2 * weight.shape[-1]).contiguous()
    y = fxq.native_int4_grouped_mm(
        x2, weight, scale, offset, offs.long(), group_size, *paths
    )  # fmt: skip
    return y.to(x.dtype)


@device_op(NATIVE, "cpu_native_int4_grouped_mm", schema=_NATIVE_INT4_SCHEMA, fake=_native_int4_fake)
def _cpu_native_int4_grouped_mm(x, weight, scale, offset, offs, group_size):
    return _native_int4_experts(x, weight, scale, offset, offs, group_size, int4_row_paths())


@device_op(
    NATIVE, "cpu_native_int8_int4_grouped_mm", schema=_NATIVE_INT4_SCHEMA, fake=_native_int4_fake
)
def _cpu_native_int8_int4_grouped_mm(x, weight, scale, offset, offs, group_size):
    # W4A8: every expert's rows quantized per token inside the kernel (the reference's bytes)
    return _native_int4_experts(x, weight, scale, offset, offs, group_size, (0, 1))


@prepack_rule(
    NATIVE, "int4_weight_only_grouped_mm", "int8_dynamic_int4_grouped_mm",
    consts=("weight", "scale", "zero"),
)  # fmt: skip
def _native_prepack_int4_experts(node, args, consts):
    # the int4 linear's kernel layout, each expert's rows as a linear's [N, K/2]
    device_op = fxq.cpu_native_int4_grouped_mm.default
    if node.target == fxq.int8_dynamic_int4_grouped_mm.default:
        device_op = fxq.cpu_native_int8_int4_grouped_mm.default
    weight, scale, zero = consts["weight"], consts["scale"], consts["zero"]
    e, n = weight.shape[0], weight.shape[1]
    flat = (t.flatten(0, 1) for t in (weight, scale, zero))
    w, s, o = (
        t.unflatten(0, (e, n)).contiguous()
        for t in native.prepack_int4(*flat, group_size=args["group_size"])
    )
    return device_op, (
        args["x"], ("weight", w), ("scale", s), ("offset", o), args["offs"], args["group_size"]
    )  # fmt: skip


# --------------------------------------------------------------------------------------------
# Experts a config leaves in float: transformers' own grouped_mm fallback op is a Python custom
# op, which an AOTInductor package calls back into (so the package needed transformers imported
# where it runs, and fxquant's runtime does not import it). The prepack step rewrites it to a
# device op whose compositions run in the package: the native fp32 kernel (each expert's rows on
# the fp32 linear's GEMV / mm, kernels/cpu/float32.cpp), else each row gathering its expert.
# --------------------------------------------------------------------------------------------


def _float_fake(x, weight, offs, kn, skip_zero_rows=False):
    return x.new_empty((x.shape[0], weight.shape[2] if kn else weight.shape[1]))


# skip_zero_rows: the native kernel leaves rows of zeros at zero without running them, which the
# rewrite asks for where the weight is finite (Llama 4's experts, every token through every
# expert, 0 where unchosen); the gather computes them, zeros all the same
@device_op(
    "cpu", "cpu_float_grouped_mm",
    schema="(Tensor x, Tensor weight, Tensor offs, bool kn, bool skip_zero_rows=False) -> Tensor",
    fake=_float_fake,
)  # fmt: skip
def _cpu_float_grouped_mm(x, weight, offs, kn, skip_zero_rows=False):
    w = weight.transpose(-2, -1) if kn else weight  # as [E, N, K]

    def product(xf, ids):
        return (xf[:, None, :] * w[ids].float()).sum(-1)

    return per_row_expert(x, offs, w.shape[0], product).to(x.dtype)


@lowering(NATIVE, "cpu_float_grouped_mm")
def _native_float_grouped_mm(x, weight, offs, kn, skip_zero_rows=False):
    if x.dtype != torch.float32 or weight.dtype != torch.float32:
        return _cpu_float_grouped_mm(x, weight, offs, kn)
    return fxq.native_float32_grouped_mm(
        x.contiguous(), weight.contiguous(), offs.long(), kn, skip_zero_rows
    )


def lower_float_experts(editor, *, native: bool) -> int:
    """Rewrite every transformers ``grouped_mm_fallback`` on a stored float expert weight (the
    experts a config left in float) to ``fxquant::cpu_float_grouped_mm``; where the native
    kernels serve, Llama 4's experts left in fp32 (``bmm`` sites) too, their rows of zeros
    skipped where the weight is finite. Returns how many."""
    from fxquant.passes.rewrite import counters, swap_bmm_site, swap_site

    op = fxq.cpu_float_grouped_mm.default
    done = 0
    for site in find_sites(editor.graph, editor.weight_of):
        x = node_value(site.x)
        if site.kind == "bmm" and native and _float32_bmm(site, x):
            # the weight is read as it is at run time; its values decide once whether rows of
            # zeros may be skipped (an inf or NaN weight times a zero row is NaN)
            finite = bool(torch.isfinite(site.weight).all())

            def make(rows, offs, w=site.weight_source, finite=finite):
                return op, (rows, w, offs, True, finite)  # stored [E, K, N]: kn

            swap_bmm_site(editor, site, make)
            counters[f"prepack.{op._opname}"] += 1
            done += 1
            continue
        if site.kind != "grouped_mm" or str(site.node.target) not in FALLBACK_OPS:
            continue
        if not (isinstance(x, Tensor) and x.dim() == 2 and site.weight.is_floating_point()):
            continue
        # stored [E, N, K] and read through its transpose, or stored [E, K, N] as grouped_mm takes
        swap_site(editor, site, op, (site.x, site.weight_source, site.offs, not site.stored_nk))
        counters[f"prepack.{op._opname}"] += 1
        done += 1
    return done


def _float32_bmm(site, x) -> bool:
    """A bmm site the native fp32 grouped kernel takes: fp32 x [E, T, K] and a stored fp32
    [E, K, N] weight with values to check (bf16 ones stay on aten's bmm: the kernel's bf16 path
    gathers per row)."""
    return (
        isinstance(x, Tensor)
        and x.dim() == 3
        and x.dtype == torch.float32
        and x.shape[0] == site.experts
        and not site.stored_nk
        and site.weight.dtype == torch.float32
        and site.weight.device.type == "cpu"
        and not isinstance(site.weight, torch._subclasses.FakeTensor)
    )


# Measured on a 2-core Zen 4 (32 experts of 1024 × 1024, Inductor): the gather costs about 2 ms a
# row, the dense path about 230 ms at any S up to 512, so they cross near 3.5 rows per expert.
_GATHER_ROWS_PER_EXPERT = 3


@lowering("cpu", "mxfp4_grouped_mm")
def _mxfp4_grouped_mm(x, weight, scale, offs):
    # Per row, the gather decodes one expert's N·K values; the dense path decodes all E·N·K
    # once and multiplies every row by every expert ([S, E·N], each row keeping its expert's N
    # columns). Both scale with N·K, so they cross at a number of rows proportional to E.
    e = weight.shape[0]
    plan = [(_GATHER_ROWS_PER_EXPERT * e, "gather"), (None, "dense")]
    return by_plan(plan, x.shape[0], _MXFP4, x, weight, scale, offs)


def _mxfp4_gather(x, weight, scale, offs):
    def product(xf, ids):  # e2m1 decode of the gathered bytes, inside the reduction
        return (xf[:, None, :] * ref_mx.dequantize_mxfp4_weight(weight[ids], scale[ids])).sum(-1)

    return per_row_expert(x, offs, weight.shape[0], product).to(x.dtype)


def _mxfp4_dense(x, weight, scale, offs):
    e, n = weight.shape[0], weight.shape[1]
    w = ref_mx.dequantize_mxfp4_weight(weight, scale)  # [E, N, K]

    def product(xf, ids):
        every = (xf @ w.flatten(0, 1).t()).unflatten(-1, (e, n))  # [S, E, N]
        return every.gather(1, ids[:, None, None].expand(-1, 1, n)).squeeze(1)

    return per_row_expert(x, offs, e, product).to(x.dtype)


_MXFP4 = {"gather": _mxfp4_gather, "dense": _mxfp4_dense}
