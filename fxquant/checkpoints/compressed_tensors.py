"""compressed-tensors checkpoints (llm-compressor, vLLM) ↔ fxquant constants.

Where it sits: a reader behind ``fxquant.checkpoints.read_quantized`` and the writer behind
``fxquant.save_compressed_tensors``. The layouts follow the compressed-tensors library's
compressors (``naive_quantized``, ``pack_quantized``): per quantized module ``<m>``

- ``naive-quantized`` / ``int-quantized`` / ``float-quantized``: ``<m>.weight`` int8 or
  float8_e4m3fn [N, K], ``<m>.weight_scale`` ([N, 1] channel, [1] tensor, [N/b, K/b] block,
  [N, K/g] group), ``<m>.input_scale`` for static activations; w = q · s.
- ``pack-quantized``: ``<m>.weight_packed`` int32 [N, ceil(K·bits/32)], consecutive K values in
  rising bit order, each stored as q + 2^(bits-1); ``<m>.weight_shape`` [N, K];
  ``<m>.weight_scale`` [N, G]; asymmetric: ``<m>.weight_zero_point`` packed the same way but
  along N ([ceil(N·bits/32), G]); w = (q - zp) · s with q, zp signed.

So symmetric int4 (q in [-8, 7], zp = 0) is ``Int4WeightOnly``'s u = q + 8, z = 8, exactly, and
an asymmetric zp is z = zp + 8. How compressed-tensors *chose* its scales (amax / 127.5 for int8,
which ``fxquant.from_hf`` refuses when quantizing from float) does not matter here: the stored
integers and scales are used as they are.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

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
from fxquant.core import reference as ref
from fxquant.core import reference_lowbit as ref_lowbit
from fxquant.core.config import (
    Float8Block,
    Float8Dynamic,
    Float8Static,
    Float8WeightOnly,
    Int4WeightOnly,
    Int8DynamicActivation,
    Int8WeightOnly,
    IntxWeightOnly,
    Scheme,
)
from fxquant.core.scheme import QuantizedWeight

__all__ = ["read_compressed_tensors", "save_compressed_tensors"]

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


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


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
        bs = w.get("block_structure")
        if isinstance(bs, str):  # older files: "128x128"
            bs = [int(v) for v in bs.lower().split("x")]
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


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def _pack_int32(u: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] unsigned values → int32 [R, ceil(C·bits/32)], the inverse of ``unpack_int32``:
    one little-endian bit stream per row (for 2, 4 and 8 bits, whole fields per word)."""
    r, c = u.shape
    u = torch.nn.functional.pad(u.to(torch.int64), (0, -c % 32))
    stream = ((u[..., None] >> torch.arange(bits)) & 1).reshape(r, -1, 32)  # bits, lowest first
    words = (stream << torch.arange(32)).sum(-1)[:, : -(-c * bits // 32)]
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement, as stored
    return words.to(torch.int32).contiguous()


def _weight_args(**kw) -> dict[str, Any]:
    return {"symmetric": True, "dynamic": False, **kw}


_TOKEN_INT8 = {
    "type": "int",
    "num_bits": 8,
    "strategy": "token",
    "symmetric": True,
    "dynamic": True,
}


def _layer_entry(scheme: Scheme, c: dict[str, torch.Tensor], n: int, k: int):
    """(format, weights args, activation args, tensors without the module prefix)."""
    if isinstance(scheme, (Int8WeightOnly, Int8DynamicActivation)):
        w = _weight_args(type="int", num_bits=8, strategy="channel")
        scale = c["scale"].reshape(n, 1)
        if isinstance(scheme, Int8DynamicActivation):
            return (
                "int-quantized",
                w,
                dict(_TOKEN_INT8),
                {"weight": c["qweight"], "weight_scale": scale},
            )
        # W8A16: compressed-tensors packs int8 weight-only layers (4 per int32, stored q + 128)
        u = c["qweight"].to(torch.int32) + 128
        return (
            "pack-quantized",
            w,
            None,
            {
                "weight_packed": _pack_int32(u, 8),
                "weight_shape": torch.tensor([n, k], dtype=torch.int64),
                "weight_scale": scale,
            },
        )
    if isinstance(scheme, (Int4WeightOnly, IntxWeightOnly)):
        bits = getattr(scheme, "bits", 4)
        if isinstance(scheme, IntxWeightOnly):
            if scheme.zero_point == "float":
                raise NotImplementedError(
                    "IntxWeightOnly(zero_point='float') has no compressed-tensors form (its zero "
                    "points are integers)"
                )
            u = ref_lowbit.unpack_intx(c["qweight"], bits)[:, :k]
        else:
            u = ref.unpack_int4(c["qweight"])[:, :k]
        g, z, mid = scheme.group_size, c["zero"], 1 << (bits - 1)
        symmetric = bool((z == mid).all())
        if int(z.max()) >= 2 * mid:
            raise NotImplementedError(
                f"int{bits} zero points above {2 * mid - 1} (a GPTQ v1 'zero minus one' layer) "
                f"have no compressed-tensors form (its zero points are int{bits} too)"
            )
        w = _weight_args(
            type="int", num_bits=bits, strategy="group", group_size=g, symmetric=symmetric
        )
        tensors = {
            "weight_packed": _pack_int32(u, bits),
            "weight_shape": torch.tensor([n, k], dtype=torch.int64),
            "weight_scale": c["scale"].contiguous(),
        }
        if not symmetric:
            zp = _pack_int32(z.t().contiguous(), bits).t().contiguous()
            tensors["weight_zero_point"] = zp
        return "pack-quantized", w, None, tensors
    if isinstance(scheme, Float8WeightOnly):
        w = _weight_args(type="float", num_bits=8, strategy="channel")
        return (
            "naive-quantized",
            w,
            None,
            {"weight": c["qweight"], "weight_scale": c["scale"].reshape(n, 1)},
        )
    if isinstance(scheme, Float8Dynamic):
        if scheme.activation_scale_ub is not None:
            raise NotImplementedError(
                "Float8Dynamic(activation_scale_ub=...) has no "
                "compressed-tensors form (no activation scale bound)"
            )
        if scheme.per_row:
            w = _weight_args(type="float", num_bits=8, strategy="channel")
            a = {
                "type": "float",
                "num_bits": 8,
                "strategy": "token",
                "symmetric": True,
                "dynamic": True,
            }
            scale = c["scale"].reshape(n, 1)
        else:
            w = _weight_args(type="float", num_bits=8, strategy="tensor")
            a = {
                "type": "float",
                "num_bits": 8,
                "strategy": "tensor",
                "symmetric": True,
                "dynamic": True,
            }
            scale = c["scale"].reshape(1)
        return "float-quantized", w, a, {"weight": c["qweight"], "weight_scale": scale}
    if isinstance(scheme, Float8Static):
        w = _weight_args(type="float", num_bits=8, strategy="tensor")
        a = {
            "type": "float",
            "num_bits": 8,
            "strategy": "tensor",
            "symmetric": True,
            "dynamic": False,
        }
        return (
            "float-quantized",
            w,
            a,
            {
                "weight": c["qweight"],
                "weight_scale": c["scale"],
                "input_scale": c["activation_scale"].reshape(1),
            },
        )
    if isinstance(scheme, Float8Block):
        b = scheme.block_size
        w = _weight_args(type="float", num_bits=8, strategy="block", block_structure=[b, b])
        a = {
            "type": "float",
            "num_bits": 8,
            "strategy": "group",
            "group_size": b,
            "symmetric": True,
            "dynamic": True,
        }
        return "float-quantized", w, a, {"weight": c["qweight"], "weight_scale": c["scale"]}
    raise NotImplementedError(f"{type(scheme).__name__} has no compressed-tensors writer yet")


def _quantized_layers(ep: ExportedProgram):
    """(module name, scheme, {constant name: tensor}, N, K, constant fqns) per quantized weight."""
    from fxquant.core.config import scheme_from_dict
    from fxquant.passes.rewrite import META_KEY

    by_node = {
        s.arg.name: s.target for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")
    }
    state = ep.state_dict
    seen: dict[str, tuple] = {}
    for node in ep.graph.nodes:
        row = node.meta.get("custom", {}).get(META_KEY)
        if node.op != "call_function" or row is None:
            continue
        row = json.loads(row)
        if row["status"] != "quantized":
            continue
        fqns = [by_node.get(a.name) for a in node.args if isinstance(a, torch.fx.Node)]
        qfqn = next((f for f in fqns if f and f.endswith("qweight")), None)
        if qfqn is None:
            raise CheckpointError(f"layer {row['name']!r}: no quantized weight constant found")
        prefix = qfqn.removesuffix("qweight")
        if prefix in seen:
            continue  # a weight shared by two layers is written once
        scheme = scheme_from_dict(row["scheme"])
        n, k = row["out_features"], row["in_features"]
        names = list(scheme.quantize(torch.zeros(n, k)).tensors)
        consts = {name: state[prefix + name] for name in names}
        if row.get("float_weight_kept"):
            raise NotImplementedError(
                f"{row['weight']!r} is quantized for {row['name']!r} and kept in float for "
                "another use (a tied weight): a compressed-tensors module holds one form"
            )
        module = row["weight"].removesuffix(".weight")
        seen[prefix] = (module, scheme, consts, n, k, {prefix + name for name in names})
    return list(seen.values())


def save_compressed_tensors(
    ep: ExportedProgram,
    directory: str | os.PathLike,
    *,
    model_config: Mapping[str, Any] | None = None,
) -> Path:
    """Write a quantized program as a compressed-tensors checkpoint.

    ``directory/model.safetensors`` gets each quantized layer in compressed-tensors' layout
    (int8 and fp8 unpacked, int4 packed into int32 with its shape) and every other parameter and
    buffer of the program as it is; ``directory/config.json`` gets ``model_config`` (e.g.
    ``model.config.to_dict()``) plus a ``quantization_config`` with one config group per scheme,
    targeting the layers by name. The compressed-tensors library (and engines that read it, such
    as vLLM) decompress it to exactly the weights fxquant computes with.

    Everything is built in memory first, then each file is written to a temporary name and
    renamed, so an error leaves no partial checkpoint behind.

    Returns:
        The directory.
    """
    from fxquant.api import atomic_path

    try:
        from safetensors.torch import save_file
    except ImportError as e:  # pragma: no cover - an optional dependency
        raise ImportError("save_compressed_tensors needs `pip install safetensors`") from e
    if not isinstance(ep, ExportedProgram):
        raise ValueError(
            f"save_compressed_tensors takes an ExportedProgram, got {type(ep).__name__}"
        )
    layers = _quantized_layers(ep)
    if not layers:
        raise ValueError("the program has no quantized layer (run fxquant.quantize first)")
    tensors: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[str, Any]] = {}
    formats, quantized_consts = set(), set()
    for module, scheme, consts, n, k, fqns in layers:
        fmt, w, a, own = _layer_entry(scheme, consts, n, k)
        formats.add(fmt)
        quantized_consts |= fqns
        key = json.dumps([fmt, w, a], sort_keys=True)
        group = groups.setdefault(
            key,
            {
                "targets": [],
                "weights": w,
                "input_activations": a,
                "output_activations": None,
                "format": fmt,
            },
        )
        group["targets"].append(module)
        for name, t in own.items():
            tensors[f"{module}.{name}"] = t.detach().contiguous()
    seen_ids = set()
    graph_inputs = [s.target for s in ep.graph_signature.input_specs if s.target in ep.state_dict]
    for name in [*graph_inputs, *ep.state_dict]:  # a tied tensor under the name the graph uses
        t = ep.state_dict[name]
        if name in quantized_consts or id(t) in seen_ids or name in tensors:
            continue
        seen_ids.add(id(t))
        tensors[name] = t.detach().contiguous()
    qcfg = {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": {f"group_{i}": g for i, g in enumerate(groups.values())},
        "ignore": [],
        "kv_cache_scheme": None,
    }
    config = {**dict(model_config or {}), "quantization_config": qcfg}
    text = json.dumps(config, indent=2, sort_keys=True, default=str)
    directory = Path(directory)
    with atomic_path(directory / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    with atomic_path(directory / "config.json") as tmp:
        tmp.write_text(text)
    return directory
