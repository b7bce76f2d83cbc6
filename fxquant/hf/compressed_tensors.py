"""``CompressedTensorsConfig`` (``quant_method="compressed-tensors"``, llm-compressor) → the
fxquant schemes with the same numerics: its ``HF_CONFIGS`` entry beside its mapper; ``from_hf``
dispatches on quant_method."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from fxquant.core.config import (
    MXFP4,
    NVFP4,
    Float8Block,
    Float8Dynamic,
    Float8WeightOnly,
    QuantConfig,
    Scheme,
)
from fxquant.hf.base import maps, refuse

COMPRESSED_TENSORS = {
    "class": "CompressedTensorsConfig",
    "status": "mapped",
    "fields": {
        "config_groups": "fp8 channel weights + fp8 dynamic token activations → "
        "Float8Dynamic('row'); fp8 tensor + dynamic tensor → Float8Dynamic('tensor'); fp8 "
        "channel weights alone → Float8WeightOnly; fp8 b×b block weights + dynamic 1×b "
        "group activations → Float8Block(b); presets FP8_DYNAMIC, FP8_BLOCK. Integer "
        "schemes refused (symmetric scale amax / 127.5 or / 7.5), static activations "
        "refused (calibration). FP4: NVFP4 weights (tensor_group, 16) alone → "
        "NVFP4(activations=False) (same two-level rule, except for blocks whose e4m3 "
        "scale falls below 2**-6: fxquant clamps it there as torchao, compressed-tensors "
        "rounds it and turns a zero into 0.125), with "
        "NVFP4 activations refused (their tensor scale is calibrated, fxquant's per "
        "call); MX weights (group 32, uint8 scales) → MXFP4(scale_rule='even', "
        "compressed-tensors' power-of-two rounding), with dynamic MX activations → "
        "activations=True; presets NVFP4A16, MXFP4A16, MXFP4. targets 'Linear' → default "
        "scheme, 're:<regex>' or names → overrides",
        "format": "accepted (the checkpoint layout; quantizing from float does not use it)",
        "quantization_status": "accepted, informational",
        "kv_cache_scheme": "None honoured; a KV-cache scheme is refused",
        "global_compression_ratio": "accepted, informational",
        "ignore": "QuantConfig.modules_to_not_convert ('re:' entries as regexes, names exactly)",
        "quant_method": "'compressed-tensors'",
        "run_compressed": "accepted: fxquant always runs the quantized ops",
        "dequantize": "True → no layer quantized",
        "use_optimized_inference": "accepted, no effect",
    },
}


_CT_NV4 = {"type": "float", "num_bits": 4, "strategy": "tensor_group", "group_size": 16}
# FP4 groups of 32 with uint8 (E8M0 exponent) scales: compressed-tensors' MXFP4
_CT_MX4 = {
    "type": "float",
    "num_bits": 4,
    "strategy": "group",
    "group_size": 32,
    "scale_dtype": "uint8",
}
_CT_PRESETS = {
    "FP8_DYNAMIC": (
        {"type": "float", "num_bits": 8, "strategy": "channel"},
        {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True},
    ),
    "FP8_BLOCK": (
        {"type": "float", "num_bits": 8, "strategy": "block", "block_structure": [128, 128]},
        {"type": "float", "num_bits": 8, "strategy": "group", "group_size": 128, "dynamic": True},
    ),
    "NVFP4A16": (_CT_NV4, None),
    "NVFP4": (_CT_NV4, {**_CT_NV4, "dynamic": "local"}),  # refused: calibrated tensor scale
    "MXFP4A16": (_CT_MX4, None),
    "MXFP4": (_CT_MX4, {**_CT_MX4, "dynamic": True}),
}


def _ct_fp4(name: str, w: Mapping, a: Mapping | None) -> Scheme:
    """compressed-tensors' FP4 groups: NVFP4 (tensor_group of 16, e4m3 scales) or MXFP4 (groups
    of 32, uint8 E8M0 scales)."""
    cls = "CompressedTensorsConfig"
    key = f"config_groups[{name!r}]"
    ws, g = w.get("strategy"), w.get("group_size")
    scale_dtype = str(w.get("scale_dtype")).removeprefix("torch.")
    if ws == "tensor_group" and g == 16:
        if a is not None:
            raise refuse(
                cls,
                f"{key}.input_activations",
                dict(a),
                "NVFP4 activations take a tensor scale calibrated offline (static_minmax); "
                "fxquant computes it from each call's activation",
            )
        return NVFP4(activations=False, scale_rule="six")
    if ws == "group" and g == 32 and scale_dtype == "uint8":
        if a is None:
            return MXFP4(activations=False, scale_rule="even")
        if (
            a.get("type") == "float"
            and a.get("num_bits") == 4
            and a.get("strategy") == "group"
            and a.get("group_size") == 32
            and a.get("dynamic") is True
        ):
            return MXFP4(activations=True, scale_rule="even")
        raise refuse(
            cls,
            f"{key}.input_activations",
            dict(a),
            "MXFP4 weights map alone or with dynamic MXFP4 activations (groups of 32)",
        )
    raise refuse(
        cls,
        f"{key}.weights",
        dict(w),
        "FP4 maps as NVFP4 (strategy 'tensor_group', group_size 16) or MXFP4 (strategy "
        "'group', group_size 32, scale_dtype uint8)",
    )


def _ct_scheme(name: str, w: Mapping | None, a: Mapping | None) -> Scheme:
    cls = "CompressedTensorsConfig"
    if w is None:
        raise refuse(cls, f"config_groups[{name!r}].weights", None, "weights must be quantized")
    if w.get("type") == "float" and w.get("num_bits") == 4:
        return _ct_fp4(name, w, a)
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise refuse(
            cls,
            f"config_groups[{name!r}].weights",
            dict(w),
            "only fp8 weights map: compressed-tensors scales symmetric integers by "
            "amax / 127.5 (int8) or amax / 7.5 (int4), fxquant by amax / 127 and / 7",
        )
    ws = w.get("strategy")
    if a is None:
        if ws == "channel":
            return Float8WeightOnly()
        raise refuse(
            cls,
            f"config_groups[{name!r}].weights.strategy",
            ws,
            "fp8 weight-only maps with strategy 'channel' only",
        )
    if a.get("type") != "float" or a.get("num_bits") != 8 or a.get("dynamic") is not True:
        raise refuse(
            cls,
            f"config_groups[{name!r}].input_activations",
            dict(a),
            "only dynamic fp8 activations map (static ones need calibration)",
        )
    ast = a.get("strategy")
    if ws == "channel" and ast == "token":
        return Float8Dynamic(granularity="row")
    if ws == "tensor" and ast == "tensor":
        return Float8Dynamic(granularity="tensor")
    if ws == "block" and ast == "group":
        bs = w.get("block_structure")
        if isinstance(bs, str):  # older files: "128x128"
            bs = [int(v) for v in bs.lower().split("x")]
        g = a.get("group_size")
        if bs and len(bs) == 2 and bs[0] == bs[1] == g and g in (32, 64, 128, 256):
            return Float8Block(block_size=int(g))
    raise refuse(
        cls,
        f"config_groups[{name!r}]",
        f"weights {ws} / activations {ast}",
        "maps: channel/token, tensor/tensor, b×b block / 1×b group (b = 32..256)",
    )


def _ct_pattern(target: str) -> str | None:
    """A compressed-tensors target or ignore entry as a module-name regex (None: a class)."""
    if target.startswith("re:"):
        return target[3:]
    if target in ("Linear", "torch.nn.Linear"):
        return None
    return re.escape(target)


@maps("compressed-tensors", COMPRESSED_TENSORS)
def _compressed_tensors(f: dict[str, Any]) -> QuantConfig:
    cls = "CompressedTensorsConfig"
    if f.get("kv_cache_scheme") is not None:
        raise refuse(
            cls, "kv_cache_scheme", f["kv_cache_scheme"], "KV-cache quantization is not supported"
        )
    skip = {}
    if f.get("ignore") is not None:
        skip = {
            "modules_to_not_convert": tuple(
                p for p in (_ct_pattern(t) for t in f["ignore"]) if p is not None
            )
        }
    if f.get("dequantize"):
        return QuantConfig(scheme=None, **skip)
    default: Scheme | None = None
    overrides: dict[str, Scheme] = {}
    for name, group in (f.get("config_groups") or {}).items():
        if isinstance(group, (list, tuple)):  # a preset named by the key: {"FP8_DYNAMIC": [...]}
            if name not in _CT_PRESETS:
                raise refuse(
                    cls, "config_groups", name, f"presets that map: {', '.join(_CT_PRESETS)}"
                )
            w, a = _CT_PRESETS[name]
            targets = list(group)
        else:
            w, a = group.get("weights"), group.get("input_activations")
            targets = list(group.get("targets") or ["Linear"])
            if group.get("output_activations") is not None:
                raise refuse(
                    cls,
                    f"config_groups[{name!r}].output_activations",
                    group["output_activations"],
                    "output quantization is not supported",
                )
        scheme = _ct_scheme(name, w, a)
        for t in targets:
            pattern = _ct_pattern(t)
            if pattern is None:
                default = scheme
            else:
                overrides[pattern] = scheme
    if default is None and not overrides:
        raise refuse(cls, "config_groups", f.get("config_groups"), "no group quantizes Linear")
    return QuantConfig(scheme=default, overrides=overrides, **skip)
