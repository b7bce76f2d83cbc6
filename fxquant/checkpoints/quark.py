"""AMD Quark checkpoints (``quant_method: "quark"``, transformers' ``QuarkConfig``) → fxquant
constants, one scheme per layer.

Where it sits: a reader behind ``fxquant.checkpoints.read_quantized``. Quark's config names a
quantization spec per tensor role (``weight``, ``input_tensors``, ``output_tensors``, ``bias``)
for every layer: ``exclude`` first (fnmatch on the module name; an entry ``x`` also covers
``x.*``), then the first ``layer_quant_config`` pattern that matches (fnmatch, in order), then
``layer_type_quant_config["Linear"]``, then ``global_quant_config``, as Quark's own loader
resolves them. A spec is ``{dtype, qscheme, is_dynamic, group_size, symmetric, scale_format,
...}``; ``export.weight_format`` must be ``"real_quantized"``. Per linear ``<m>`` (amd/Quark
``quark/torch/utils/pack.py`` and ``export/nn/modules/realquantizer.py``):

- fp8_e4m3 ``weight`` [N, K] with ``weight_scale`` [] (per tensor) or [N] (per channel), and
  ``input_scale`` [] for static activations → ``Float8WeightOnly`` (no activation spec),
  ``Float8Dynamic`` (dynamic per-token or per-tensor), ``Float8Static`` (static per tensor);
- int8 ``weight`` [N, K] with ``weight_scale`` [N], ``weight_zero_point`` (all zero: symmetric)
  → ``Int8WeightOnly`` or, with dynamic per-token int8 activations, ``Int8DynamicActivation``;
- int4 / uint4 per group: ``weight`` int32 [K, N/8], ``weight_scale`` [K/g, N],
  ``weight_zero_point`` int32 [K/g, N/8], transposed and packed along N, nibble i of a word
  holding column 8c + [0, 2, 4, 6, 1, 3, 5, 7][i] (``pack_method: "reorder"``, AWQ's order) or
  8c + i (``"order"``); int4 nibbles are two's complement → ``Int4WeightOnly`` (u = q + 8);
- fp4 with E8M0 scales per 32 (OCP MXFP4): ``weight`` uint8 [N, K/2] (even column in the low
  nibble), ``weight_scale`` uint8 [N, K/32] → ``MXFP4``, activations in float or quantized to
  MXFP4 per token at run time (its ``scale_calculation_mode``: even / floor / ceil).

Everything dequantizes as (q - zp)·scale. Refused, per layer and with the reason: output or bias
quantization (Quark's FP8 KV-cache scales on k/v_proj), static int8 activations, fp6, NVFP4 and
block fp8 specs, Quark's rotations (an input Hadamard the graph would need), fake-quantized
exports.
"""

from __future__ import annotations

import fnmatch
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
    quantized_modules,
    unpack_int32,
)
from fxquant.checkpoints.compressed_tensors_read import _float8, _int8_scheme
from fxquant.checkpoints.gptq import AWQ_ORDER
from fxquant.core.scheme import QuantizedWeight

__all__ = ["layer_config", "read_quark"]

_MX_RULES = {"even": "even", "floor": "floor", "ceil": "ceil"}


def read_quark(source: TensorSource, qcfg: Mapping[str, Any]) -> LoadedCheckpoint:
    """A Quark checkpoint's tensors → fxquant constants (module docstring)."""
    export = qcfg.get("export") or {}
    if export.get("weight_format", "real_quantized") != "real_quantized":
        raise NotImplementedError(
            f"Quark weight_format={export['weight_format']!r}: only 'real_quantized' exports "
            "load (a fake-quantized export holds float weights: load it as a float model)"
        )
    algos = qcfg.get("algo_config") or []
    algos = [algos] if isinstance(algos, Mapping) else algos
    if any(str(a.get("name", "")).lower() == "rotation" for a in algos):
        raise NotImplementedError(
            "Quark rotation (algo_config 'rotation'): its layers multiply their input by a "
            "Hadamard matrix at run time, which the graph would need; not mapped"
        )
    order = AWQ_ORDER if export.get("pack_method", "reorder") == "reorder" else None
    modules = quantized_modules(source, "weight_scale", "Quark")
    out = LoadedCheckpoint(format="quark")
    consumed: set[str] = set()
    for m in modules:
        cfg = layer_config(m, qcfg)
        if cfg is None:
            raise CheckpointError(
                f"Quark layer {m} has a weight_scale but the config excludes it from quantization"
            )
        scheme, weight, shape, used = _layer(source, m, cfg, order)
        out.add(m, scheme, weight, shape)
        consumed |= used
    for name in source:
        if name not in consumed:
            out.tensors[name] = source[name]
    return out


def layer_config(module: str, qcfg: Mapping[str, Any]) -> Mapping[str, Any] | None:
    """The layer spec Quark applies to ``module``, or None where ``exclude`` keeps it float."""
    for pattern in qcfg.get("exclude") or ():
        if fnmatch.fnmatch(module, pattern) or fnmatch.fnmatch(module, f"{pattern}.*"):
            return None
    for pattern, cfg in (qcfg.get("layer_quant_config") or {}).items():
        if fnmatch.fnmatch(module, pattern):
            return cfg
    by_type = (qcfg.get("layer_type_quant_config") or {}).get("Linear")
    return by_type if by_type is not None else qcfg.get("global_quant_config")


def _ct_args(spec: Mapping[str, Any] | None, *, weight: bool) -> dict[str, Any] | None:
    """A Quark tensor spec in compressed-tensors' terms (type, num_bits, strategy, dynamic)."""
    if spec is None:
        return None
    dtype = str(spec.get("dtype"))
    kinds = {"fp8_e4m3": ("float", 8), "int8": ("int", 8), "int4": ("int", 4), "uint4": ("int", 4)}
    kind = kinds.get(dtype, ("float", 4) if dtype == "fp4" else (dtype, None))
    qscheme = spec.get("qscheme")
    dynamic = bool(spec.get("is_dynamic", False))
    strategy = {
        "per_tensor": "tensor",
        "per_channel": "token" if (dynamic and not weight) else "channel",
        "per_group": "group",
        "per_block": "block",
    }.get(qscheme, qscheme)
    return {
        "type": kind[0],
        "num_bits": kind[1],
        "strategy": strategy,
        "dynamic": dynamic,
        "symmetric": spec.get("symmetric", True) is not False,
        "group_size": spec.get("group_size"),
    }


def _layer(source, m: str, cfg: Mapping[str, Any], order):
    where = f"Quark layer {m}"
    for role in ("output_tensors", "bias"):
        if cfg.get(role) is not None:
            raise NotImplementedError(
                f"{where}: {role} quantization (Quark's KV-cache / output scales) is not "
                "supported; fxquant quantizes weights and inputs only"
            )
    wspec, aspec = cfg.get("weight"), cfg.get("input_tensors")
    if isinstance(wspec, list) or isinstance(aspec, list):
        raise NotImplementedError(
            f"{where}: two-level specs (NVFP4's second scale) have no fxquant mapping from Quark"
        )
    if wspec is None:
        raise CheckpointError(f"{where}: has a weight_scale but its config quantizes no weight")
    dtype = str(wspec.get("dtype"))
    w, a = _ct_args(wspec, weight=True), _ct_args(aspec, weight=False)
    sname = f"{m}.weight_scale"
    scale = source[sname]
    used = {sname, f"{m}.weight"}
    if dtype == "fp8_e4m3":
        if w["strategy"] not in ("tensor", "channel"):
            raise NotImplementedError(f"{where}: fp8 {wspec.get('qscheme')} weights not mapped")
        wt = expect(f"{m}.weight", need(source, f"{m}.weight", where), dtype=torch.float8_e4m3fn)
        n, k = wt.shape
        expect(sname, scale, dtype=SCALE_DTYPES)
        if w["strategy"] == "channel":
            scale = expect(sname, scale, shape=(n,)).reshape(n, 1)
        if a is not None and (a["type"], a["num_bits"]) != ("float", 8):
            raise NotImplementedError(f"{where}: fp8 weights with {aspec.get('dtype')} inputs")
        scheme, tensors, more = _float8(source, m, where, w, a, scale, n, k)
        return scheme, QuantizedWeight({"qweight": wt, **tensors}, None), (n, k), used | more
    if dtype == "int8":
        wt = expect(f"{m}.weight", need(source, f"{m}.weight", where), dtype=torch.int8)
        n, k = wt.shape
        if w["strategy"] != "channel":
            raise NotImplementedError(f"{where}: int8 {wspec.get('qscheme')} weights not mapped")
        _zero_points(source, m, where, used)
        s = expect(sname, scale, shape=(n,), dtype=SCALE_DTYPES).float().contiguous()
        scheme = _int8_scheme(where, a)
        return scheme, QuantizedWeight({"qweight": wt, "scale": s}, None), (n, k), used
    if dtype in ("int4", "uint4"):
        if a is not None:
            raise NotImplementedError(f"{where}: int4 weights with quantized inputs not mapped")
        return _int4(source, m, where, wspec, scale, order, used)
    if dtype == "fp4" and wspec.get("scale_format") == "e8m0" and wspec.get("group_size") == 32:
        return _mxfp4(source, m, where, aspec, scale, used)
    raise NotImplementedError(
        f"{where}: weight dtype {dtype!r} ({wspec.get('qscheme')}) has no fxquant mapping "
        "(fp8_e4m3, int8, int4 / uint4 per group and fp4 with E8M0 scales per 32 load)"
    )


def _zero_points(source, m: str, where: str, used: set[str]) -> None:
    zname = f"{m}.weight_zero_point"
    if zname in source:
        used.add(zname)
        if bool(source[zname].ne(0).any()):
            raise NotImplementedError(f"{where}: asymmetric int8 weights have no fxquant form")


def _int4(source, m: str, where: str, spec, scale, order, used):
    if spec.get("qscheme") != "per_group":
        raise NotImplementedError(f"{where}: int4 {spec.get('qscheme')} weights not mapped")
    g = spec.get("group_size")
    words = expect(f"{m}.weight", need(source, f"{m}.weight", where), dtype=torch.int32)
    zname = f"{m}.weight_zero_point"
    zwords = expect(zname, need(source, zname, where), dtype=torch.int32)
    used.add(zname)
    if words.dim() != 2:
        raise CheckpointError(
            f"tensor '{m}.weight' has shape {list(words.shape)}, expected [K, N/8]"
        )
    k, n = words.shape[0], words.shape[1] * 8
    groups = -(-k // g)
    s = expect(f"{m}.weight_scale", scale, shape=(groups, n), dtype=SCALE_DTYPES)
    expect(zname, zwords, shape=(groups, n // 8))
    q = unpack_int32(words, 4, order=order).t().to(torch.int32)  # [N, K]
    z = unpack_int32(zwords, 4, order=order).t().to(torch.int32)  # [N, G]
    if spec.get("dtype") == "int4":  # two's complement nibbles: codes and zeros in [-8, 7]
        q, z = torch.where(q >= 8, q - 16, q) + 8, torch.where(z >= 8, z - 16, z) + 8
    scheme, weight = int_weight(m, q, s.t(), z, g, bits=4)
    return scheme, weight, (n, k), used


def _mxfp4(source, m: str, where: str, aspec, scale, used):
    from fxquant.core.config import MXFP4

    wt = expect(f"{m}.weight", need(source, f"{m}.weight", where), dtype=torch.uint8)
    n, k = wt.shape[0], wt.shape[1] * 2
    s = expect(f"{m}.weight_scale", scale, shape=(n, k // 32), dtype=torch.uint8)
    if aspec is None:
        scheme = MXFP4(activations=False)
    else:
        rule = _MX_RULES.get(str(aspec.get("scale_calculation_mode") or "even"))
        mx = (aspec.get("dtype"), aspec.get("group_size"), aspec.get("scale_format"))
        if mx != ("fp4", 32, "e8m0") or not aspec.get("is_dynamic") or rule is None:
            raise NotImplementedError(
                f"{where}: MXFP4 weights with inputs {dict(aspec)} not mapped (dynamic MXFP4 "
                "inputs with an even / floor / ceil scale rule load)"
            )
        scheme = MXFP4(activations=True, scale_rule=rule)
    return scheme, QuantizedWeight({"qweight": wt, "scale": s}, None), (n, k), used
