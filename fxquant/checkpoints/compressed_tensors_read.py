"""compressed-tensors checkpoints (llm-compressor, vLLM) → fxquant constants: the reader.

Where it sits: behind ``fxquant.checkpoints.read_quantized`` (``read.py`` dispatches
``quant_method="compressed-tensors"`` here). The layouts it reads, and what the format's schemes
map to when quantizing from float, are in ``fxquant/checkpoints/compressed_tensors.py`` beside
the writer. Loading is looser than quantizing from float: the stored integers and scales are
used as they are, so how compressed-tensors *chose* them (amax / 127.5 for int8) does not matter.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

import torch

from fxquant.checkpoints.base import (
    SCALE_DTYPES,
    CheckpointError,
    LoadedCheckpoint,
    TensorSource,
    expect,
    int_weight,
    need,
    unpack_int32,
)
from fxquant.checkpoints.compressed_tensors import block_structure
from fxquant.core.config import (
    Float8Block,
    Float8Dynamic,
    Float8Static,
    Float8WeightOnly,
    Int8DynamicActivation,
    Int8WeightOnly,
    Scheme,
)
from fxquant.core.scheme import QuantizedWeight

__all__ = ["read_compressed_tensors"]

_FORMATS = (
    "naive-quantized",
    "int-quantized",
    "float-quantized",
    "pack-quantized",
    "mxfp4-pack-quantized",
    "nvfp4-pack-quantized",
)
# Tensors a quantized module may carry besides its weight: all consumed or checked here.
_PARAMS = (
    "weight_scale",
    "weight_zero_point",
    "weight_packed",
    "weight_shape",
    "input_scale",
    "weight_global_scale",
    "input_global_scale",
    "input_zero_point",
)


def _matches(target: str, module: str) -> bool:
    if target.startswith("re:"):
        return re.match(target[3:], module) is not None
    return target == module


def _is_class_target(target: str) -> bool:
    return not target.startswith("re:") and "." not in target and target[:1].isupper()


def read_compressed_tensors(source: TensorSource, qcfg: Mapping[str, Any]) -> LoadedCheckpoint:
    """compressed-tensors tensors → fxquant constants (see the module docstring for layouts)."""
    status = qcfg.get("quantization_status", "compressed")
    if status not in ("compressed", None):
        raise NotImplementedError(
            f"compressed-tensors quantization_status={status!r}: the weights are stored in float "
            "(fake-quantized), not as integers; quantize them with fxquant.from_hf(...) instead"
        )
    if qcfg.get("kv_cache_scheme") is not None:
        raise NotImplementedError(
            "compressed-tensors kv_cache_scheme: KV-cache quantization is not supported"
        )
    groups = qcfg.get("config_groups") or {}
    if not groups:
        raise CheckpointError("compressed-tensors quantization_config has no config_groups")
    global_format = qcfg.get("format")
    ignore = list(qcfg.get("ignore") or [])

    modules = sorted(
        {
            n.rsplit(".", 1)[0]
            for n in source
            if n.rsplit(".", 1)[-1] in ("weight_scale", "weight_packed")
        }
    )
    out = LoadedCheckpoint(format=f"compressed-tensors/{global_format}")
    consumed: set[str] = set()
    for module in modules:
        if any(_matches(t, module) for t in ignore if not _is_class_target(t)):
            raise CheckpointError(
                f"module {module!r} is in the config's ignore list but carries quantization "
                "parameters"
            )
        name, group = _group_for(module, groups)
        fmt = group.get("format") or global_format
        if fmt in (None, "mixed-precision"):
            fmt = "pack-quantized" if f"{module}.weight_packed" in source else "naive-quantized"
        if fmt not in _FORMATS:
            raise NotImplementedError(
                f"{module}: compressed-tensors format {fmt!r} has no fxquant loader (loaded: "
                f"{', '.join(_FORMATS)})"
            )
        scheme, weight, shape, used = _convert(source, module, name, group, fmt)
        out.add(module, scheme, weight, shape)
        consumed |= used
    if not modules:
        raise CheckpointError(
            "compressed-tensors checkpoint has no quantized module (no '*.weight_scale' tensor)"
        )
    for n in source:
        if n in consumed:
            continue
        if n.rsplit(".", 1)[-1] in _PARAMS:
            raise CheckpointError(f"tensor {n!r} belongs to no quantized module this loader read")
        out.tensors[n] = source[n]
    return out


def _group_for(module: str, groups: Mapping[str, Any]) -> tuple[str, Mapping[str, Any]]:
    by_name = [
        (k, g)
        for k, g in groups.items()
        if any(_matches(t, module) for t in g.get("targets", []) if not _is_class_target(t))
    ]
    by_class = [
        (k, g) for k, g in groups.items() if any(_is_class_target(t) for t in g.get("targets", []))
    ]
    found = by_name or by_class
    if not found:
        raise CheckpointError(
            f"module {module!r} has quantization parameters but no config group targets it"
        )
    return found[0]


def _convert(source, module, group_name, group, fmt):
    w_args = group.get("weights")
    a_args = group.get("input_activations")
    where = f"{module} (config group {group_name!r})"
    if not w_args:
        raise CheckpointError(f"{where}: the group quantizes no weights")
    if group.get("output_activations"):
        raise NotImplementedError(f"{where}: output activation quantization is not supported")
    wtype, bits = w_args.get("type", "int"), w_args.get("num_bits")
    strategy = w_args.get("strategy")
    scale_name = f"{module}.weight_scale"
    scale = need(source, scale_name, f"{where} weights")
    used = {scale_name}
    if fmt in ("mxfp4-pack-quantized", "nvfp4-pack-quantized"):
        scheme, weight, shape, more = _fp4(source, module, where, fmt, w_args, a_args, scale)
        return scheme, weight, shape, used | more
    expect(scale_name, scale, dtype=SCALE_DTYPES)
    if fmt == "pack-quantized":
        if wtype != "int" or bits not in (2, 3, 4, 6, 8):
            raise NotImplementedError(
                f"{where}: pack-quantized {wtype}{bits} weights have no "
                "fxquant form (int2, int3, int4, int6 and int8 load)"
            )
        scheme, weight, shape, more = _packed(source, module, where, w_args, a_args, scale)
        return scheme, weight, shape, used | more
    wname = f"{module}.weight"
    w = need(source, wname, f"{where} weights")
    used.add(wname)
    if w.dim() != 2:
        raise CheckpointError(f"tensor {wname!r} has shape {list(w.shape)}, expected [N, K]")
    n, k = w.shape
    if wtype == "int" and bits == 8:
        expect(wname, w, dtype=torch.int8)
        if not w_args.get("symmetric", True):
            raise NotImplementedError(
                f"{where}: asymmetric int8 weights (a zero point) have no fxquant form"
            )
        s = _per_channel(scale_name, scale, strategy, n)
        scheme = _int8_scheme(where, a_args)
        return scheme, QuantizedWeight({"qweight": w, "scale": s}, None), (n, k), used
    if wtype == "float" and bits == 8:
        expect(wname, w, dtype=torch.float8_e4m3fn)
        scheme, tensors, more = _float8(source, module, where, w_args, a_args, scale, n, k)
        return scheme, QuantizedWeight({"qweight": w, **tensors}, None), (n, k), used | more
    raise NotImplementedError(
        f"{where}: {fmt} {wtype}{bits} weights have no fxquant form "
        "(int8 and float8 e4m3 load unpacked; int4 as pack-quantized)"
    )


def _per_channel(name: str, scale: torch.Tensor, strategy: str, n: int) -> torch.Tensor:
    """A channel or tensor scale as fxquant's fp32 [N] (a tensor scale repeated: exact)."""
    if strategy == "channel":
        return expect(name, scale, shape=(n, 1)).float().reshape(n).contiguous()
    if strategy == "tensor":
        if scale.numel() != 1:
            raise CheckpointError(
                f"tensor {name!r} has shape {list(scale.shape)}, expected one "
                "value (strategy 'tensor')"
            )
        return scale.float().reshape(1).expand(n).contiguous()
    raise NotImplementedError(
        f"{name}: weight strategy {strategy!r} has no fxquant int8/fp8 "
        "per-channel form (channel and tensor load)"
    )


def _int8_scheme(where: str, a: Mapping | None) -> Scheme:
    if a is None:
        return Int8WeightOnly()
    if (
        a.get("type", "int"),
        a.get("num_bits"),
        a.get("strategy"),
        a.get("dynamic"),
        a.get("symmetric", True),
    ) == ("int", 8, "token", True, True):
        # vLLM quantizes these activations per token with amax / 127 at run time, as fxquant does
        return Int8DynamicActivation()
    raise NotImplementedError(
        f"{where}: int8 weights with activations {dict(a)} have no "
        "fxquant form (dynamic symmetric per-token int8 loads)"
    )


def _float8(source, module, where, w, a, scale, n, k):
    strategy = w.get("strategy")
    sname = f"{module}.weight_scale"
    if a is None:  # weight-only: per-channel scales (a tensor scale repeated per channel)
        return Float8WeightOnly(), {"scale": _per_channel(sname, scale, strategy, n)}, set()
    if a.get("type") != "float" or a.get("num_bits") != 8:
        raise NotImplementedError(
            f"{where}: fp8 weights with activations {dict(a)} have no fxquant form"
        )
    ast, dynamic = a.get("strategy"), a.get("dynamic")
    if dynamic is True and ast == "token" and strategy in ("channel", "tensor"):
        return (
            Float8Dynamic(granularity="row"),
            {"scale": _per_channel(sname, scale, strategy, n)},
            set(),
        )
    if dynamic is True and ast == "tensor" and strategy == "tensor":
        s = _per_channel(sname, scale, strategy, n)[:1].contiguous()
        return Float8Dynamic(granularity="tensor"), {"scale": s}, set()
    if dynamic is True and ast == "group" and strategy == "block":
        bs = block_structure(w)
        g = a.get("group_size")
        if not (bs and len(bs) == 2 and bs[0] == bs[1] == g and g in (32, 64, 128, 256)):
            raise NotImplementedError(
                f"{where}: fp8 blocks {bs} with activation groups {g} "
                "have no fxquant form (square b×b weights with 1×b "
                "activations, b in 32/64/128/256)"
            )
        shape = (-(-n // g), -(-k // g))
        s = expect(sname, scale, shape=shape).float().contiguous()
        return Float8Block(block_size=int(g)), {"scale": s}, set()
    if dynamic is False and ast == "tensor" and strategy == "tensor":
        iname = f"{module}.input_scale"
        xs = expect(iname, need(source, iname, f"{where} static activations"), dtype=SCALE_DTYPES)
        if xs.numel() != 1:
            raise CheckpointError(
                f"tensor {iname!r} has shape {list(xs.shape)}, expected one value"
            )
        scheme = Float8Static(activation_scale=float(xs.float().reshape(())))
        s = _per_channel(sname, scale, strategy, n)[:1].contiguous()
        return scheme, {"scale": s, "activation_scale": xs.float().reshape(1)}, {iname}
    raise NotImplementedError(
        f"{where}: fp8 weights ({strategy}) with activations ({ast}, dynamic={dynamic}) have no "
        "fxquant form (loaded: channel or tensor / dynamic token; tensor / dynamic tensor; "
        "block / dynamic group; tensor / static tensor)"
    )


def _fp4(source, module, where, fmt, w, a, scale):
    """e2m1 codes packed two per byte, low nibble first (fxquant's MXFP4/NVFP4 layout too), with
    E8M0 scales per 32 (``mxfp4``) or e4m3 scales per 16 and an fp32 global scale (``nvfp4``)."""
    from fxquant.core.config import MXFP4, NVFP4

    pname = f"{module}.weight_packed"
    packed = expect(pname, need(source, pname, f"{where} weights"), dtype=torch.uint8)
    if packed.dim() != 2:
        raise CheckpointError(f"tensor {pname!r} has shape {list(packed.shape)}, expected [N, K/2]")
    n, k = packed.shape[0], packed.shape[1] * 2
    sname = f"{module}.weight_scale"
    if fmt == "mxfp4-pack-quantized":
        expect(sname, scale, shape=(n, k // 32), dtype=torch.uint8)
        if a is None:
            scheme = MXFP4(activations=False)
        elif (a.get("type"), a.get("num_bits"), a.get("group_size"), a.get("dynamic")) == (
            "float",
            4,
            32,
            True,
        ):
            # compressed-tensors rounds the activation amax to one mantissa bit ("even")
            scheme = MXFP4(activations=True, scale_rule="even")
        else:
            raise NotImplementedError(
                f"{where}: MXFP4 weights with activations {dict(a)} have "
                "no fxquant form (none, or dynamic MXFP4)"
            )
        return scheme, QuantizedWeight({"qweight": packed, "scale": scale}, None), (n, k), {pname}
    if a is not None:
        raise NotImplementedError(
            f"{where}: NVFP4 activations here use a calibrated, static input_global_scale; "
            "fxquant's NVFP4 computes the activation's tensor scale at run time, so only "
            "NVFP4A16 (weights only) loads"
        )
    expect(sname, scale, shape=(n, k // 16), dtype=torch.float8_e4m3fn)
    gname = f"{module}.weight_global_scale"
    gs = expect(gname, need(source, gname, f"{where} NVFP4"), shape=(1,), dtype=torch.float32)
    # compressed-tensors divides by its global scale, fxquant multiplies by a tensor scale: the
    # reciprocal is rounded once to fp32, so weights agree to fp32 rounding, not bit for bit
    tensor_scale = (1.0 / gs.double()).float()
    weight = QuantizedWeight(
        {"qweight": packed, "scale": scale, "tensor_scale": tensor_scale}, None
    )
    return NVFP4(activations=False), weight, (n, k), {pname, gname}


def _packed(source, module, where, w, a, scale):
    if a is not None:
        raise NotImplementedError(
            f"{where}: packed integer weights with quantized activations "
            f"({dict(a)}) have no fxquant form"
        )
    bits = w["num_bits"]
    pname, shname = f"{module}.weight_packed", f"{module}.weight_shape"
    packed = expect(pname, need(source, pname, f"{where} weights"), dtype=torch.int32)
    shape_t = need(source, shname, f"{where}: the unpacked [N, K]")
    if shape_t.numel() != 2:
        raise CheckpointError(f"tensor {shname!r} has {shape_t.numel()} values, expected [N, K]")
    n, k = (int(v) for v in shape_t.reshape(2))
    expect(pname, packed, shape=(n, -(-k * bits // 32)))
    offset = 1 << (bits - 1)
    u = unpack_int32(packed, bits)[:, :k]
    strategy, symmetric = w.get("strategy"), w.get("symmetric", True)
    used = {pname, shname}
    if bits == 8:  # W8A16: stored q + 128, per channel (or tensor)
        if not symmetric:
            raise NotImplementedError(f"{where}: asymmetric int8 weights have no fxquant form")
        s = _per_channel(f"{module}.weight_scale", scale, strategy, n)
        q = (u - offset).to(torch.int8)
        return Int8WeightOnly(), QuantizedWeight({"qweight": q, "scale": s}, None), (n, k), used
    if strategy == "group":
        group_size = w.get("group_size")
        if not isinstance(group_size, int) or group_size <= 0:
            raise CheckpointError(
                f"{where}: strategy 'group' needs a positive group_size, got {group_size!r}"
            )
    elif strategy in ("channel", "tensor"):
        group_size = None
        if strategy == "tensor":
            scale = scale.float().reshape(1, 1).expand(n, 1)
    else:
        raise NotImplementedError(
            f"{where}: int4 weight strategy {strategy!r} has no fxquant "
            "form (group, channel and tensor load)"
        )
    groups = 1 if group_size is None else -(-k // group_size)
    expect(f"{module}.weight_scale", scale, shape=(n, groups))
    if symmetric:
        zero = torch.full((n, groups), offset, dtype=torch.int32)
    else:
        zname = f"{module}.weight_zero_point"
        zp = expect(zname, need(source, zname, f"{where}: asymmetric weights"), dtype=torch.int32)
        expect(zname, zp, shape=(-(-n * bits // 32), groups))
        # packed along N: unpack the transpose, then back; stored zp + 8 is z itself
        zero = unpack_int32(zp.t().contiguous(), bits)[:, :n].t()
        used.add(zname)
    scheme, weight = int_weight(where, u, scale, zero, group_size, bits=bits)
    return scheme, weight, (n, k), used
