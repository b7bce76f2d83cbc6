"""The ``fxquant::`` ops: what a quantized program calls instead of ``aten.linear``.

The rewrite pass (``fxquant.passes.rewrite``) emits these; a saved ``.pt2`` keeps them (so
loading one needs ``import fxquant``, which registers them); ``fxquant.passes.lower`` replaces
them by per-device implementations before Inductor or AOTInductor.

Every op has four faces: the schema, a fake kernel (shapes and dtypes only, for export and
dynamic shapes), the eager kernel, which *is* the reference math of ``fxquant.core.reference*``,
and the per-device lowerings (``fxquant.core.registry``). One op per scheme, named
``<scheme.name>_linear``, derived from the scheme's declaration (``fxquant.core.scheme``,
``fxquant/core/schemes/``): importing this module imports them all. x is [..., K], the weight
[N, K] (packed formats: fewer bytes per row); the output is [..., N] in x's dtype.

Written here are the ops no single scheme declares: the fusion pass's (``fxquant.passes.fuse``)
``norm_quant`` (a norm that writes its output already quantized, with its scale) and the
``*_scaled_linear`` ops that read such an activation (a dynamic-activation linear is exactly
its activation quantizer followed by its scaled linear), the experts GEMMs of MXFP4 and int8
weight-only, int4 weight-only and W4A8 (``mxfp4_grouped_mm``, ``int8_weight_only_grouped_mm``,
``int4_weight_only_grouped_mm``, ``int8_dynamic_int4_grouped_mm``), of W8A8
(``int8_dynamic_grouped_mm``) and of fp8 weight-only, with per-row or with block scales
(``float8_weight_only_grouped_mm``, ``float8_dynamic_grouped_mm``, ``float8_block_grouped_mm``),
and the attention
``fxquant.export_llm`` emits on CPU where fxquant's
native kernels are built (``native_gqa_attention``: its CPU kernel is kernels/cpu/attention.cpp,
registered when ``fxquant.kernels.cpu`` loads the library).
"""

from __future__ import annotations

import torch
from torch import Tensor

import fxquant.core.schemes  # noqa: F401  (declares every scheme's fxquant::<name>_linear op)
from fxquant.core import reference as ref
from fxquant.core import reference_mx as ref_mx

_LIB = "fxquant"


@torch.library.custom_op(f"{_LIB}::mxfp4_grouped_mm", mutates_args=())
def mxfp4_grouped_mm(x: Tensor, weight: Tensor, scale: Tensor, offs: Tensor) -> Tensor:
    """Expert GEMM: x [S, K] (rows sorted by expert, ``offs`` [E] their cumulative ends) · the
    row's expert's packed e2m1 W [E, N, K/2] with E8M0 scales [E, N, K/32] → [S, N]."""
    return ref_mx.mxfp4_grouped_mm(x, weight, scale, offs)


@mxfp4_grouped_mm.register_fake
def _(x, weight, scale, offs):
    return x.new_empty((x.shape[0], weight.shape[1]))


@torch.library.custom_op(f"{_LIB}::int8_weight_only_grouped_mm", mutates_args=())
def int8_weight_only_grouped_mm(x: Tensor, weight: Tensor, scale: Tensor, offs: Tensor) -> Tensor:
    """Expert GEMM: x [S, K] (rows sorted by expert, ``offs`` [E] their cumulative ends) · the
    row's expert's int8 W [E, N, K] with per-channel scales [E, N] → [S, N]."""
    return ref.int8_weight_only_grouped_mm(x, weight, scale, offs)


@int8_weight_only_grouped_mm.register_fake
def _(x, weight, scale, offs):
    return x.new_empty((x.shape[0], weight.shape[1]))


@torch.library.custom_op(f"{_LIB}::float8_weight_only_grouped_mm", mutates_args=())
def float8_weight_only_grouped_mm(x: Tensor, weight: Tensor, scale: Tensor, offs: Tensor) -> Tensor:
    """Expert GEMM (``fp8wo``): x [S, K] (rows sorted by expert, ``offs`` [E] their cumulative
    ends) · the row's expert's e4m3 W [E, N, K] with per-channel scales [E, N] → [S, N]."""
    return ref.float8_weight_only_grouped_mm(x, weight, scale, offs)


@float8_weight_only_grouped_mm.register_fake
def _(x, weight, scale, offs):
    return x.new_empty((x.shape[0], weight.shape[1]))


def _int4_grouped_fake(x, weight, scale, zero, offs, group_size):
    return x.new_empty((x.shape[0], weight.shape[1]))


@torch.library.custom_op(f"{_LIB}::int4_weight_only_grouped_mm", mutates_args=())
def int4_weight_only_grouped_mm(
    x: Tensor, weight: Tensor, scale: Tensor, zero: Tensor, offs: Tensor, group_size: int
) -> Tensor:
    """Expert GEMM: x [S, K] (rows sorted by expert, ``offs`` [E] their cumulative ends) · the
    row's expert's packed int4 W [E, N, Kp/2] with scales and zero points [E, N, Kp/g] → [S, N]."""
    return ref.int4_weight_only_grouped_mm(x, weight, scale, zero, offs, group_size=group_size)


@torch.library.custom_op(f"{_LIB}::int8_dynamic_int4_grouped_mm", mutates_args=())
def int8_dynamic_int4_grouped_mm(
    x: Tensor, weight: Tensor, scale: Tensor, zero: Tensor, offs: Tensor, group_size: int
) -> Tensor:
    """W4A8 expert GEMM: ``int4_weight_only_grouped_mm``'s weights, x quantized per token to
    int8 at run time (``w4a8-<g>``'s activation) → [S, N]."""
    return ref.int8_dynamic_int4_grouped_mm(x, weight, scale, zero, offs, group_size=group_size)


int4_weight_only_grouped_mm.register_fake(_int4_grouped_fake)
int8_dynamic_int4_grouped_mm.register_fake(_int4_grouped_fake)


@torch.library.custom_op(f"{_LIB}::int8_dynamic_grouped_mm", mutates_args=())
def int8_dynamic_grouped_mm(x: Tensor, weight: Tensor, scale: Tensor, offs: Tensor) -> Tensor:
    """W8A8 expert GEMM (``w8a8``): x [S, K] (rows sorted by expert, ``offs`` [E] their
    cumulative ends) quantized per token to int8 at run time · the row's expert's int8 W
    [E, N, K] with per-channel scales [E, N] → [S, N]."""
    return ref.int8_dynamic_grouped_mm(x, weight, scale, offs)


@int8_dynamic_grouped_mm.register_fake
def _(x, weight, scale, offs):
    return x.new_empty((x.shape[0], weight.shape[1]))


@torch.library.custom_op(f"{_LIB}::float8_dynamic_grouped_mm", mutates_args=())
def float8_dynamic_grouped_mm(
    x: Tensor, weight: Tensor, scale: Tensor, offs: Tensor, activation_scale_ub: float | None
) -> Tensor:
    """fp8 expert GEMM (``fp8-row``, FbgemmFp8Config): x [S, K] (rows sorted by expert, ``offs``
    [E] their cumulative ends) quantized per token to e4m3 at run time · the row's expert's
    e4m3 W [E, N, K] with per-channel scales [E, N] → [S, N]."""
    return ref.float8_dynamic_grouped_mm(
        x, weight, scale, offs, activation_scale_ub=activation_scale_ub
    )  # fmt: skip


@float8_dynamic_grouped_mm.register_fake
def _(x, weight, scale, offs, activation_scale_ub):
    return x.new_empty((x.shape[0], weight.shape[1]))


@torch.library.custom_op(f"{_LIB}::float8_block_grouped_mm", mutates_args=())
def float8_block_grouped_mm(
    x: Tensor, weight: Tensor, scale: Tensor, offs: Tensor, block_size: int
) -> Tensor:
    """fp8 expert GEMM with block scales (``fp8-block``, FineGrainedFP8Config): x [S, K] (rows
    sorted by expert, ``offs`` [E] their cumulative ends) quantized in 1×b groups at run time ·
    the row's expert's e4m3 W [E, N, K] with b×b tile scales [E, ceil(N/b), ceil(K/b)] → [S, N]."""
    return ref.float8_block_grouped_mm(x, weight, scale, offs, block_size=block_size)


@float8_block_grouped_mm.register_fake
def _(x, weight, scale, offs, block_size):
    return x.new_empty((x.shape[0], weight.shape[1]))


# --------------------------------------------------------------------------------------------
# Norm → quantize fusion (``fxquant.passes.fuse``): one op normalizes and quantizes the
# activation once, and the linears that read it take the quantized activation and its scale.
# --------------------------------------------------------------------------------------------


def norm_quant_reference(x, weight, bias, eps, rms, quant_dtype, group_size, scale_ub):
    """``fxquant::norm_quant``'s eager kernel (and its CPU lowering): the reference math."""
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
    return norm_quant_reference(x, weight, bias, eps, rms, quant_dtype, group_size, scale_ub)


@norm_quant.register_fake
def _(x, weight, bias, eps, rms, quant_dtype, group_size, scale_ub):
    groups = 1 if group_size == -1 else -(-x.shape[-1] // group_size)
    q = x.new_empty(x.shape, dtype=quant_dtype)
    return q, x.new_empty((*x.shape[:-1], groups), dtype=torch.float32)


def _scaled_linear(name: str, reference, *, params: str = "", doc: str) -> None:
    """Define ``fxquant::<name>(Tensor xq, Tensor xs, Tensor weight, Tensor scale, Tensor? bias,
    <params>, ScalarType out_dtype) -> Tensor``: a linear reading an activation that a fused
    norm already quantized (``xq``, with its scales ``xs``). The schema is the one these ops
    were always defined with; ``reference`` takes ``params`` and ``out_dtype`` by keyword."""
    names = [p.split()[1] for p in params.split(", ") if p]
    schema = (
        "(Tensor xq, Tensor xs, Tensor weight, Tensor scale, Tensor? bias, "
        + "".join(f"{p}, " for p in params.split(", ") if p)
        + "ScalarType out_dtype) -> Tensor"
    )

    def kernel(xq, xs, weight, scale, bias, *rest):
        kw = dict(zip([*names, "out_dtype"], rest, strict=True))
        return reference(xq, xs, weight, scale, bias, **kw)

    kernel.__name__, kernel.__doc__ = name, doc
    op = torch.library.custom_op(f"{_LIB}::{name}", kernel, mutates_args=(), schema=schema)

    @op.register_fake
    def _(xq, xs, weight, scale, bias, *rest):
        return xq.new_empty((*xq.shape[:-1], weight.shape[0]), dtype=rest[-1])


_scaled_linear(
    "int8_scaled_linear",
    ref.int8_scaled_linear,
    doc="int8 xq [..., K] with per-token scale xs [..., 1] · int8 W [N, K] with ``scale`` [N].",
)
_scaled_linear(
    "float8_scaled_linear",
    ref.float8_scaled_linear,
    doc="e4m3 xq [..., K] with per-token scale xs [..., 1] · e4m3 W [N, K] with ``scale`` [N].",
)
_scaled_linear(
    "float8_block_scaled_linear",
    ref.float8_block_scaled_linear,
    params="SymInt block_size",
    doc="e4m3 xq [..., K] with 1×b group scales xs [..., ceil(K/b)] · e4m3 W [N, K] with b×b "
    "tile scales.",
)


# Packed grouped-query attention over the KV cache (fxquant.llm). Declared here, with import
# fxquant, so that a program export_llm made can be loaded (torch.export.load) by a process that
# never imported fxquant.kernels.cpu; the C shim is in fxquant.kernels.cpu.NATIVE_OPS.
# flexible_layout: under the default (the exact strides of the trace) Inductor met the layout with
# a copy of each input for each call, and an input several calls share, the model's causal mask
# handed to every layer, was computed again for each (30 times a SmolLM2 step); the kernel reads
# any layout (kernels/cpu/attention.cpp copies what its loops cannot read as it lies).
_attention = torch.library.Library(_LIB, "FRAGMENT")
_attention.define(
    "native_gqa_attention(Tensor q, Tensor key, Tensor value, Tensor mask, float scale) -> Tensor",
    tags=(torch.Tag.flexible_layout,),
)
torch.library.register_fake(f"{_LIB}::native_gqa_attention", lib=_attention)(
    lambda q, key, value, mask, scale: q.new_empty(q.shape, dtype=torch.float32)
)


def gqa_attention_reference(q, key, value, mask, scale):
    """softmax(q kᵀ · scale, masked) v over q [B, Hkv, R, D], key and value [B, Hkv, L, D] (all
    fp32, bf16 or fp16), mask [Bm, 1, Rm, L] bool (True = attend; Rm divides R: row r reads mask
    row r % Rm, so a prompt's T rows serve the G · T packed rows of a group), in fp32 and
    returned in fp32; a row with nothing visible gives zeros. The op's kernel wherever the
    native library has not registered its CPU one: a saved program run in a process that has
    not loaded the library (any fxquant build or compile loads it), or on another device."""
    q, key, value = q.float(), key.float(), value.float()
    rows = mask.shape[2]
    if rows != q.shape[2]:
        if q.shape[2] % rows:
            raise ValueError(
                f"native_gqa_attention: the mask's {rows} rows do not divide the query's "
                f"{q.shape[2]}"
            )
        mask = mask.repeat(1, 1, q.shape[2] // rows, 1)
    scores = (q @ key.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ value


_attention.impl("native_gqa_attention", gqa_attention_reference, "CompositeExplicitAutograd")


def packed_gqa_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor,
    scale: float,
    *,
    native: bool,
    heads_first: bool = True,
) -> Tensor:
    """Grouped-query attention with the query heads packed, not the cache repeated: query
    [B, H, T, D], key and value [B, Hkv, L, D] (H = G · Hkv), mask [Bm, 1, T, L] (bool: True =
    attend, or additive) → [B, H, T, Dv], what sdpa gives on the repeated cache, or with
    ``heads_first=False`` [B, T, H, Dv], what transformers' attention functions return.

    The G query heads of a group become G · T query rows of its one key/value head (the mask repeats
    along those rows), so the cache is read as it lies. ``native``: one
    ``fxquant::native_gqa_attention`` (fp32, bf16 or fp16, bool mask, the kernels built; fp32
    inside but for a bf16 prompt on AMX, the result rounded to the value's dtype), handed the
    mask as it is (the op repeats its T rows: the model's one causal mask serves every layer,
    where a mask expanded here was built again in each); else two batched matmuls in the tensors'
    dtype and a softmax in fp32, as transformers' eager attention. Traced by
    ``fxquant.export_llm`` (``fxquant.llm``) and put in place of sdpa over a repeated cache by the
    backend's CPU pass (``fxquant.passes.cpu.attention``)."""
    b, h, t, d = query.shape
    hk = key.shape[1]
    groups = h // hk
    # head hk * G + g, row t → head hk, row g * T + t (contiguous first: a plain view, no guards)
    q = query.contiguous().view(b, hk, groups * t, d)
    if native:
        if torch.compiler.is_dynamo_compiling():
            # a computation, not a view: under torch.compile with the attended length captured,
            # Inductor cannot hand the op a view of a mask whose last size is data-dependent
            # (GuardOnDataDependentSymNode); exported programs get one such copy for all layers
            # from passes/cpu/attention.py's share_attention_masks
            mask = mask.ne(0)
        out = torch.ops.fxquant.native_gqa_attention(q, key, value, mask, scale).to(value.dtype)
    else:
        mb, lm = mask.shape[0], mask.shape[-1]
        mask = mask[:, :, None].expand(mb, 1, groups, t, lm).reshape(mb, 1, groups * t, lm)
        scores = torch.matmul(q, key.transpose(-1, -2)) * scale
        bool_mask = mask.dtype == torch.bool
        scores = scores.masked_fill(~mask, float("-inf")) if bool_mask else scores + mask
        # softmax in fp32 whatever the model's dtype, as transformers' eager attention does
        probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(value.dtype)
        out = torch.matmul(probs, value)
    # the G row blocks stacked as heads, in [B, T, Hkv, G, Dv] so that the merge of Hkv and G is
    # a view whose strides hold no T: splitting the G * T rows with a view guards on T, which
    # export refuses, and merging [Hkv, G] axes strided by T made torch 2.11's export guard on T
    # (its collapse_view takes a min of the strides)
    out = torch.stack([out[:, :, g * t : (g + 1) * t].transpose(1, 2) for g in range(groups)], 3)
    out = out.flatten(2, 3)
    return out.transpose(1, 2).contiguous() if heads_first else out
