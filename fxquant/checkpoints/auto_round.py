"""AutoRound checkpoints (Intel's ``auto_round``; transformers' ``AutoRoundConfig``) → the GPTQ
and AWQ readers' constants.

Where it sits: a reader behind ``fxquant.checkpoints.read_quantized`` (``quant_method``
``"auto-round"``, or the legacy ``"intel/auto-round"``). AutoRound tunes the rounding, not the
format: its integer weight-only exports are GPTQ's and AutoAWQ's layouts (auto-round 0.15,
``export/export_to_autoround``), chosen by ``packing_format`` (legacy: ``backend``):

- ``"auto_round:auto_gptq"`` (symmetric models' default; also ``"auto_round:gptq"``): GPTQ v1,
  zero points stored minus one (``fxquant.checkpoints.gptq``, ``checkpoint_format="gptq"``);
- ``"auto_round"`` (asymmetric 2/3/8-bit, mixed bits; also ``"auto_round:gptqmodel"`` and the
  legacy ``"auto_round:exllamav2"``): the same packing with the zero points as they are (v2);
- ``"auto_round:auto_awq"`` (asymmetric 4-bit; also ``"auto_round:awq"``): AutoAWQ GEMM.

Symmetric AutoRound uses the full signed range: q in [-2^(b-1), 2^(b-1) - 1] with a scale that
may be negative (the larger-magnitude extreme maps to -2^(b-1)), stored as code q + 2^(b-1) and
zero 2^(b-1); w = (code - zero)·scale holds for either sign, so the readers take it as it is.
``extra_config`` overrides bits / group_size per layer (exact names or regexes); a layer it
gives 16 bits is float in the file and loads as a plain tensor. FP8 / MX / NV exports
(``"auto_round:fp8"``, ``"auto_round:llm_compressor"``) and non-integer ``data_type`` are
refused.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from fxquant.checkpoints.base import (
    CheckpointError,
    LoadedCheckpoint,
    TensorSource,
    quantized_modules,
)
from fxquant.checkpoints.gptq import read_awq, read_gptq

__all__ = ["read_auto_round"]

_GPTQ_V1 = ("auto_round:auto_gptq", "auto_round:gptq", "auto_round:gptq:exllamav2")
_GPTQ_V2 = ("auto_round", "auto_round:gptqmodel", "auto_round:exllamav2")
_AWQ = ("auto_round:auto_awq", "auto_round:awq")
_PARTS = ("qweight", "qzeros", "scales", "g_idx")


def read_auto_round(source: TensorSource, qcfg: Mapping[str, Any]) -> LoadedCheckpoint:
    """An AutoRound checkpoint's tensors → fxquant constants (module docstring)."""
    fmt = str(qcfg.get("packing_format") or qcfg.get("backend") or "auto_round:auto_gptq")
    data_type = str(qcfg.get("data_type", "int"))
    if not data_type.startswith("int"):
        raise NotImplementedError(
            f"AutoRound data_type={data_type!r}: only integer weight-only checkpoints load "
            "(their FP8 / MXFP4 / NVFP4 exports are compressed-tensors or fp8 files: load those "
            "with their own quant_method)"
        )
    if fmt not in (*_GPTQ_V1, *_GPTQ_V2, *_AWQ):
        raise NotImplementedError(
            f"AutoRound packing_format={fmt!r} is not supported; loaded: "
            f"{', '.join(repr(f) for f in (*_GPTQ_V1, *_GPTQ_V2, *_AWQ))}"
        )
    modules = quantized_modules(source, "qweight", "AutoRound")
    # one reader call per distinct (bits, group_size): extra_config may give layers their own
    by_layout: dict[tuple[int, int], list[str]] = {}
    for m in modules:
        layer = _layer_config(m, qcfg)
        by_layout.setdefault((int(layer["bits"]), int(layer["group_size"])), []).append(m)
    out = LoadedCheckpoint(format=f"auto-round ({fmt})")
    consumed: set[str] = set()
    for (bits, group_size), names in sorted(by_layout.items()):
        part = {
            f"{m}.{p}": source[f"{m}.{p}"] for m in names for p in _PARTS if f"{m}.{p}" in source
        }
        consumed |= part.keys()
        if fmt in _AWQ:
            sub = {"bits": bits, "group_size": group_size, "zero_point": True, "version": "gemm"}
            got = read_awq(TensorSource(part), sub)
        else:
            v = "gptq" if fmt in _GPTQ_V1 else "gptq_v2"
            sub = {"bits": bits, "group_size": group_size, "checkpoint_format": v}
            got = read_gptq(TensorSource(part), sub)
        out.schemes |= got.schemes
        out.weights |= got.weights
        out.shapes |= got.shapes
    for name in source:
        if name not in consumed:
            out.tensors[name] = source[name]
    return out


def _layer_config(module: str, qcfg: Mapping[str, Any]) -> dict[str, Any]:
    """The global bits / group_size, with ``extra_config``'s entry for ``module`` on top (its
    exact name first, then the first regex that matches the whole name)."""
    layer = {"bits": qcfg.get("bits", 4), "group_size": qcfg.get("group_size", 128)}
    extra = qcfg.get("extra_config") or {}
    entry = extra.get(module)
    if entry is None:
        entry = next((v for k, v in extra.items() if _matches(k, module)), None)
    if entry:
        layer |= {k: v for k, v in entry.items() if k in layer and v is not None}
        if str(entry.get("data_type", "int")).startswith(("fp", "mx", "nv")):
            raise NotImplementedError(
                f"AutoRound extra_config gives {module} data_type={entry['data_type']!r}: only "
                "integer layers load"
            )
    if int(layer["bits"]) >= 16:
        raise CheckpointError(
            f"AutoRound layer {module} has a qweight but extra_config keeps it in float "
            f"(bits={layer['bits']})"
        )
    return layer


def _matches(pattern: str, name: str) -> bool:
    try:
        return re.fullmatch(pattern, name) is not None
    except re.error:
        return False
