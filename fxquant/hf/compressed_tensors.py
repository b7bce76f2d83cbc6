"""``CompressedTensorsConfig`` (``quant_method="compressed-tensors"``, llm-compressor) → the
fxquant schemes with the same numerics: its ``HF_CONFIGS`` entry beside its mapper; ``from_hf``
dispatches on quant_method. What each compressed-tensors scheme (a group's weights and activation
arguments, or a preset) maps to is the format's own knowledge, kept with its reader and writer:
``scheme_from_args`` in ``fxquant/checkpoints/compressed_tensors.py``. This module walks the
config around it (groups, targets, ignore, the fields that refuse or disable quantization)."""

from __future__ import annotations

from typing import Any

from fxquant.checkpoints.compressed_tensors import PRESETS, scheme_from_args, target_pattern
from fxquant.core.config import QuantConfig, Scheme
from fxquant.hf.base import maps, refuse

COMPRESSED_TENSORS = {
    "class": "CompressedTensorsConfig",
    "status": "mapped",
    "fields": {
        "config_groups": "fp8 channel weights + fp8 dynamic token activations → "
        "Float8Dynamic('row'); fp8 tensor + dynamic tensor → Float8Dynamic('tensor'); fp8 "
        "channel weights alone → Float8WeightOnly; fp8 b×b block weights + dynamic 1×b "
        "group activations → Float8Block(b); presets FP8_DYNAMIC, FP8_BLOCK. Integer "
        "weights alone: int8 channel symmetric (W8A16) → Int8WeightOnly(grid="
        "'compressed-tensors'), int4 groups of 32-256 (W4A16, symmetric or not) → "
        "Int4WeightOnly(group_size, symmetric, grid='compressed-tensors'): its amax / 127.5 "
        "and / 7.5 grids and asymmetric rule, bit for bit; integer weights with int8 "
        "activations refused (the / 127.5 activation grid), static activations refused "
        "(calibration). FP4: NVFP4 weights (tensor_group, 16) alone → "
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
                p for p in (target_pattern(t) for t in f["ignore"]) if p is not None
            )
        }
    if f.get("dequantize"):
        return QuantConfig(scheme=None, **skip)
    default: Scheme | None = None
    overrides: dict[str, Scheme] = {}
    for name, group in (f.get("config_groups") or {}).items():
        if isinstance(group, (list, tuple)):  # a preset named by the key: {"FP8_DYNAMIC": [...]}
            if name not in PRESETS:
                raise refuse(cls, "config_groups", name, f"presets that map: {', '.join(PRESETS)}")
            w, a = PRESETS[name]
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
        scheme = scheme_from_args(name, w, a)
        for t in targets:
            pattern = target_pattern(t)
            if pattern is None:
                default = scheme
            else:
                overrides[pattern] = scheme
    if default is None and not overrides:
        raise refuse(cls, "config_groups", f.get("config_groups"), "no group quantizes Linear")
    return QuantConfig(scheme=default, overrides=overrides, **skip)
