"""GPTQ and AWQ (GEMM) checkpoints → ``Int4WeightOnly`` / ``Int8WeightOnly`` constants.

Where it sits: readers behind ``fxquant.checkpoints.read_quantized``. Both store unsigned
integers packed into int32 words, lowest bits first, with fp16 scales and integer zero points per
group along K; w = (q - z) · s. They differ in the packing (the layouts of AutoGPTQ's /
gptqmodel's ``QuantLinear.pack`` and AutoAWQ's ``WQLinear_GEMM.from_linear``):

GPTQ, per linear ``<m>``:
    ``qweight`` int32 [K·bits/32, N], packed along K; ``qzeros`` int32 [G, N·bits/32], packed
    along N; ``scales`` [G, N]; ``g_idx`` int32 [K], the group of each input column;
    2- and 3-bit codes load as ``IntxWeightOnly`` (3 bits: a dense little-endian bit stream,
    32 codes in 3 words, as AutoGPTQ's pack writes it); 8 bits per channel as ``Int8WeightOnly``.
    ``checkpoint_format`` ``"gptq"`` (v1) stores every zero point minus one (z = stored + 1,
    so a zero of 0 reads as 16, as AutoGPTQ's own kernels read it), ``"gptq_v2"`` stores z.
    With ``desc_act`` (act-order) g_idx may jump between groups: such columns do not form
    contiguous groups, so that is refused (a permutation of K would be needed in the graph).
AWQ GEMM, per linear ``<m>``:
    ``qweight`` int32 [K, N/8] and ``qzeros`` int32 [K/g, N/8], both packed along N with the
    nibbles interleaved: field i of a word holds output column 8·c + [0, 2, 4, 6, 1, 3, 5, 7][i];
    ``scales`` [K/g, N].
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fxquant.checkpoints.base import (
    SCALE_DTYPES,
    CheckpointError,
    LoadedCheckpoint,
    TensorSource,
    expect,
    int4_weight,
    int_weight,
    need,
    quantized_modules,
    unpack_int32,
)
from fxquant.core.config import Int8WeightOnly
from fxquant.core.scheme import QuantizedWeight

__all__ = ["AWQ_ORDER", "read_awq", "read_gptq"]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # field i of an AWQ word → column 8·c + AWQ_ORDER[i]


def _rest(source: TensorSource, out: LoadedCheckpoint, consumed: set[str]) -> None:
    for name in source:
        if name in consumed:
            continue
        if name.rsplit(".", 1)[-1] in ("qweight", "qzeros", "scales", "g_idx"):
            raise CheckpointError(
                f"tensor {name!r} belongs to no quantized module (no "
                f"'{name.rsplit('.', 1)[0]}.qweight')"
            )
        out.tensors[name] = source[name]


def read_gptq(source: TensorSource, qcfg: Mapping[str, Any]) -> LoadedCheckpoint:
    bits = qcfg.get("bits", 4)
    group_size = qcfg.get("group_size", 128)
    fmt = qcfg.get("checkpoint_format", "gptq")
    if bits not in (2, 3, 4, 8):
        raise NotImplementedError(
            f"GPTQ bits={bits}: fxquant has no int{bits} format (2, 3, 4 and 8 bits load)"
        )
    if fmt not in ("gptq", "gptq_v2"):
        raise NotImplementedError(
            f"GPTQ checkpoint_format={fmt!r} is not supported; loaded: "
            "'gptq' (v1, zero minus one) and 'gptq_v2'"
        )
    if group_size in (None, 0):
        group_size = -1
    out = LoadedCheckpoint(format=f"gptq ({fmt}, {bits}-bit)")
    consumed: set[str] = set()
    modules = quantized_modules(source, "qweight", "GPTQ")
    for m in modules:
        qweight = expect(f"{m}.qweight", source[f"{m}.qweight"], dtype=torch.int32)
        qzeros = expect(
            f"{m}.qzeros", need(source, f"{m}.qzeros", f"GPTQ layer {m}"), dtype=torch.int32
        )
        scales = expect(
            f"{m}.scales", need(source, f"{m}.scales", f"GPTQ layer {m}"), dtype=SCALE_DTYPES
        )
        consumed |= {f"{m}.qweight", f"{m}.qzeros", f"{m}.scales"}
        if qweight.dim() != 2 or scales.dim() != 2:
            raise CheckpointError(
                f"{m}: qweight and scales must be 2-D, got "
                f"{list(qweight.shape)} and {list(scales.shape)}"
            )
        k, n = qweight.shape[0] * 32 // bits, qweight.shape[1]
        groups = 1 if group_size == -1 else -(-k // group_size)
        expect(f"{m}.scales", scales, shape=(groups, n))
        expect(f"{m}.qzeros", qzeros, shape=(groups, -(-n * bits // 32)))
        if f"{m}.g_idx" in source:
            consumed.add(f"{m}.g_idx")
            g_idx = expect(f"{m}.g_idx", source[f"{m}.g_idx"], shape=(k,))
            want = (
                torch.zeros(k, dtype=torch.long)
                if group_size == -1
                else (torch.arange(k) // group_size)
            )
            if not torch.equal(g_idx.long(), want):
                raise NotImplementedError(
                    f"{m}.g_idx: act-order (desc_act) GPTQ puts input columns into groups out of "
                    "order; Int4WeightOnly's groups are contiguous runs of K, so this layer "
                    "would need a column permutation of its input in the graph (not built). "
                    "Re-quantize with desc_act=False or static_groups=True"
                )
        u = unpack_int32(qweight.t().contiguous(), bits)  # [N, K]: along K, lowest bits first
        z = unpack_int32(qzeros, bits)[:, :n].t()  # [N, G]
        if fmt == "gptq":
            z = z + 1  # v1 stores zero - 1 (AutoGPTQ's pack does `zeros -= 1`)
        s = scales.t()
        if bits == 8:
            if group_size != -1 or not bool((z == 128).all()):
                raise NotImplementedError(
                    f"{m}: 8-bit GPTQ maps to Int8WeightOnly only per channel (group_size=-1) "
                    "and symmetric (zero 128); fxquant has no grouped or asymmetric int8 format"
                )
            q = (u - 128).to(torch.int8)
            weight = QuantizedWeight(
                {"qweight": q, "scale": s.float().reshape(n).contiguous()}, None
            )
            out.add(m, Int8WeightOnly(), weight, (n, k))
            continue
        scheme, weight = int_weight(m, u, s, z, None if group_size == -1 else group_size, bits=bits)
        out.add(m, scheme, weight, (n, k))
    _rest(source, out, consumed)
    return out


def read_awq(source: TensorSource, qcfg: Mapping[str, Any]) -> LoadedCheckpoint:
    bits = qcfg.get("bits", qcfg.get("w_bit", 4))
    group_size = qcfg.get("group_size", qcfg.get("q_group_size", 128))
    version = str(qcfg.get("version", "gemm")).lower()
    if bits != 4:
        raise NotImplementedError(f"AWQ bits={bits}: only 4-bit AWQ is defined and loaded")
    if version != "gemm":
        raise NotImplementedError(
            f"AWQ version={version!r}: only the GEMM layout loads (GEMV and the kernel-specific "
            "layouts, e.g. gemv_fast, marlin, exllama, pack their weights differently)"
        )
    if not qcfg.get("zero_point", True):
        raise NotImplementedError("AWQ zero_point=False: only the zero-point layout loads")
    out = LoadedCheckpoint(format="awq (gemm)")
    consumed: set[str] = set()
    modules = quantized_modules(source, "qweight", "AWQ")
    for m in modules:
        qweight = expect(f"{m}.qweight", source[f"{m}.qweight"], dtype=torch.int32)
        qzeros = expect(
            f"{m}.qzeros", need(source, f"{m}.qzeros", f"AWQ layer {m}"), dtype=torch.int32
        )
        scales = expect(
            f"{m}.scales", need(source, f"{m}.scales", f"AWQ layer {m}"), dtype=SCALE_DTYPES
        )
        consumed |= {f"{m}.qweight", f"{m}.qzeros", f"{m}.scales"}
        if qweight.dim() != 2:
            raise CheckpointError(
                f"tensor '{m}.qweight' has shape {list(qweight.shape)}, expected [K, N/8]"
            )
        k, n = qweight.shape[0], qweight.shape[1] * 8
        groups = -(-k // group_size)
        expect(f"{m}.scales", scales, shape=(groups, n))
        expect(f"{m}.qzeros", qzeros, shape=(groups, n // 8))
        u = unpack_int32(qweight, 4, order=AWQ_ORDER).t()  # [N, K]
        z = unpack_int32(qzeros, 4, order=AWQ_ORDER).t()  # [N, G]
        scheme, weight = int4_weight(m, u, scales.t(), z, group_size)
        out.add(m, scheme, weight, (n, k))
    _rest(source, out, consumed)
    return out
