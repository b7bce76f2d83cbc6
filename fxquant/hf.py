"""``from_hf``: a Hugging Face quantization config (a transformers ``*Config`` object, or the
``quantization_config`` dict of a model's ``config.json``) → a ``QuantConfig`` with the same
numerics, or ``NotImplementedError`` saying exactly what fxquant lacks for it.

Where it sits: before everything else, beside ``fxquant.config``; it only builds a config.
transformers is not imported: objects are read by attribute, so plain dicts work without it.

A config maps only where an fxquant scheme computes what the original does: the same grid, the
same scale rule, the same activation handling. Where one detail differs (torchao and
compressed-tensors scale symmetric int8 by amax / 127.5, fxquant by amax / 127) the config is
refused, not approximated. ``HF_CONFIGS`` says, per config and per field, how it is honoured;
docs/hf_configs.md is generated from it (``python -m fxquant.hf > docs/hf_configs.md``) and a
test checks it covers every field transformers defines.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from fxquant.config import (
    Float8Block,
    Float8Dynamic,
    Float8WeightOnly,
    Int8WeightOnly,
    QuantConfig,
    Scheme,
)

__all__ = ["HF_CONFIGS", "docs_table", "from_hf"]

_SKIP = "QuantConfig.modules_to_not_convert (names; None keeps fxquant's default, lm_head)"
_NOT_YET = "refused with the config"

# quant_method → (transformers class, status, why / how, {field: how it is honoured}).
HF_CONFIGS: dict[str, dict[str, Any]] = {
    "eetq": {
        "class": "EetqConfig",
        "status": "mapped",
        "fields": {
            "weights": "'int8' → Int8WeightOnly (per output channel, amax / 127, as EETQ); "
            "anything else refused",
            "modules_to_not_convert": _SKIP,
        },
    },
    "fbgemm_fp8": {
        "class": "FbgemmFp8Config",
        "status": "mapped",
        "fields": {
            "activation_scale_ub": "Float8Dynamic(granularity='row', activation_scale_ub=...)",
            "modules_to_not_convert": _SKIP,
        },
    },
    "fp8": {
        "class": "FineGrainedFP8Config",
        "status": "mapped",
        "fields": {
            "activation_scheme": "'dynamic' → per-token 1×b groups (Float8Block); 'static' "
            "refused (needs a calibrated per-layer scale)",
            "weight_block_size": "(b, b), b in 32/64/128/256 → Float8Block(block_size=b); "
            "other shapes refused",
            "dequantize": "True → no layer quantized (the model stays in high precision)",
            "modules_to_not_convert": _SKIP,
            "modules_to_convert": "only these modules are quantized (QuantConfig.overrides)",
            "scale_fmt": "'float' honoured; 'ue8m0' (power-of-two block scales) refused",
            "expert_dtype": "'fp8' honoured for experts that are nn.Linear; 'fp4' refused",
        },
    },
    "quanto": {
        "class": "QuantoConfig",
        "status": "mapped",
        "fields": {
            "weights": "'int8' → Int8WeightOnly, 'float8' → Float8WeightOnly (per output "
            "channel, absmax / qmax, as quanto); 'int4' refused (quanto's affine groups "
            "carry a float shift, Int4WeightOnly an integer zero point), 'int2' refused (no "
            "int2 format yet)",
            "activations": "None honoured; 'int8' / 'float8' refused (quanto calibrates "
            "static activation scales; no calibration yet)",
            "modules_to_not_convert": _SKIP,
        },
    },
    "torchao": {
        "class": "TorchAoConfig",
        "status": "mapped",
        "fields": {
            "quant_type": "'float8_weight_only' / Float8WeightOnlyConfig → Float8WeightOnly; "
            "'float8_dynamic_activation_float8_weight' / "
            "Float8DynamicActivationFloat8WeightConfig → Float8Dynamic (PerTensor → 'tensor', "
            "PerRow → 'row', activation_value_ub → activation_scale_ub); int8 configs refused "
            "(torchao scales symmetric int8 by amax / 127.5), int4 refused (float zero-point "
            "domain), the rest refused",
            "modules_to_not_convert": _SKIP,
            "include_input_output_embeddings": "False honoured; True refused (embeddings "
            "are not quantized)",
            "untie_embedding_weights": "accepted; no effect while embeddings stay in float",
        },
    },
    "compressed-tensors": {
        "class": "CompressedTensorsConfig",
        "status": "mapped",
        "fields": {
            "config_groups": "fp8 channel weights + fp8 dynamic token activations → "
            "Float8Dynamic('row'); fp8 tensor + dynamic tensor → Float8Dynamic('tensor'); fp8 "
            "channel weights alone → Float8WeightOnly; fp8 b×b block weights + dynamic 1×b "
            "group activations → Float8Block(b); presets FP8_DYNAMIC, FP8_BLOCK. Integer "
            "schemes refused (symmetric scale amax / 127.5 or / 7.5), static activations "
            "refused (calibration), FP4 refused (no format yet). targets 'Linear' → default "
            "scheme, 're:<regex>' or names → overrides",
            "format": "accepted (the checkpoint layout; quantizing from float does not use it)",
            "quantization_status": "accepted, informational",
            "kv_cache_scheme": "None honoured; a KV-cache scheme is refused",
            "global_compression_ratio": "accepted, informational",
            "ignore": "QuantConfig.modules_to_not_convert ('re:' entries as regexes, names "
            "exactly)",
            "quant_method": "'compressed-tensors'",
            "run_compressed": "accepted: fxquant always runs the quantized ops",
            "dequantize": "True → no layer quantized",
            "use_optimized_inference": "accepted, no effect",
        },
    },
    "gptq": {
        "class": "GPTQConfig",
        "status": "refused",
        "why": "GPTQ needs calibration "
        "(Hessian-based error feedback over real data: fxquant.calibrate is not built yet), "
        "int2/int3 formats for bits < 4, and a loader for GPTQ checkpoints",
    },
    "awq": {
        "class": "AwqConfig",
        "status": "refused",
        "why": "AWQ needs its activation-aware "
        "scale search over calibration data (not built yet) and a loader for its "
        "interleaved GEMM checkpoint layout",
    },
    "auto-round": {
        "class": "AutoRoundConfig",
        "status": "refused",
        "why": "AutoRound tunes "
        "rounding with signed gradient descent over calibration data (not built); "
        "its checkpoints use the GPTQ/AWQ layouts, whose loaders are not built",
    },
    "bitsandbytes": {
        "class": "BitsAndBytesConfig",
        "status": "refused",
        "why": "NF4/FP4 "
        "(blocks of 64, absmax, double quant) and LLM.int8 (outlier columns in "
        "float) have no fxquant format yet",
    },
    "hqq": {
        "class": "HqqConfig",
        "status": "refused",
        "why": "HQQ's half-quadratic "
        "optimiser of zero points and scales is not built; int3/int2 formats are missing",
    },
    "sinq": {
        "class": "SinqConfig",
        "status": "refused",
        "why": "SINQ's Sinkhorn-normalised dual scales are not built",
    },
    "higgs": {
        "class": "HiggsConfig",
        "status": "refused",
        "why": "HIGGS needs a Hadamard "
        "rotation and vector quantization onto Gaussian-optimal grids: not built",
    },
    "aqlm": {
        "class": "AqlmConfig",
        "status": "refused",
        "why": "AQLM's additive codebooks "
        "(weights as sums of learned codewords) have no fxquant format",
    },
    "vptq": {
        "class": "VptqConfig",
        "status": "refused",
        "why": "VPTQ's vector codebooks with residual and outlier codebooks have no fxquant format",
    },
    "spqr": {
        "class": "SpQRConfig",
        "status": "refused",
        "why": "SpQR's 3-bit groups with "
        "bilevel scales and sparse fp16 outliers have no fxquant format",
    },
    "bitnet": {
        "class": "BitNetQuantConfig",
        "status": "refused",
        "why": "ternary BitNet weights with int8 per-token activations have no fxquant format yet",
    },
    "mxfp4": {
        "class": "Mxfp4Config",
        "status": "refused",
        "why": "MXFP4 (E2M1 values, E8M0 scales per 32) has no fxquant format yet",
    },
    "nvfp4": {
        "class": "NVFP4Config",
        "status": "refused",
        "why": "NVFP4 (E2M1 values, E4M3 "
        "scales per 16 and an fp32 tensor scale) has no fxquant format yet",
    },
    "fouroversix": {
        "class": "FourOverSixConfig",
        "status": "refused",
        "why": "NVFP4 with a "
        "per-block choice of 4 or 6 as the scale target has no fxquant format yet",
    },
    "fp_quant": {
        "class": "FPQuantConfig",
        "status": "refused",
        "why": "FP-Quant's Hadamard-rotated MXFP4/NVFP4 has no fxquant format yet",
    },
    "metal": {
        "class": "MetalConfig",
        "status": "refused",
        "why": "Apple Metal's affine "
        "groups (float scale and bias per group) have no fxquant format yet",
    },
    "quark": {
        "class": "QuarkConfig",
        "status": "refused",
        "why": "Quark configs name AMD Quark's own per-layer schemes; no mapping is built yet",
    },
    "gguf": {
        "class": "GgufConfig",
        "status": "refused",
        "why": "GGUF is a checkpoint format "
        "(Q8_0, Q4_K, ...): loading it into fxquant constants is not built yet "
        "(`fxquant quantize model.gguf` dequantizes and requantizes instead)",
    },
}
_BY_CLASS = {v["class"]: k for k, v in HF_CONFIGS.items()}


def _fields(obj: Any) -> dict[str, Any]:
    if isinstance(obj, Mapping):
        return dict(obj)
    if hasattr(obj, "to_dict"):  # transformers' QuantizationConfigMixin
        d = dict(obj.to_dict())
        # to_dict serialises some objects (torchao configs); keep the live ones
        for key in ("quant_type",):
            if hasattr(obj, key):
                d[key] = getattr(obj, key)
        return d
    return {k: v for k, v in vars(obj).items() if not k.startswith("_")}


def _method(obj: Any, fields: dict[str, Any]) -> str:
    name = type(obj).__name__
    if name in _BY_CLASS:
        return _BY_CLASS[name]
    method = fields.get("quant_method")
    method = getattr(method, "value", method)
    if method in HF_CONFIGS:
        return str(method)
    raise ValueError(
        f"from_hf cannot tell which quantization config {obj!r} is: pass a transformers "
        "*Config object or a quantization_config dict with 'quant_method' (one of "
        f"{', '.join(sorted(HF_CONFIGS))})"
    )


def from_hf(config: Any) -> QuantConfig:
    """The fxquant config with the same numerics as a Hugging Face quantization config, or
    ``NotImplementedError`` naming what is missing. See ``HF_CONFIGS`` / docs/hf_configs.md."""
    fields = _fields(config)
    method = _method(config, fields)
    entry = HF_CONFIGS[method]
    if entry["status"] == "refused":
        raise NotImplementedError(f"{entry['class']} is not supported yet: {entry['why']}")
    if isinstance(config, Mapping):
        # a config.json dict may carry keys a transformers object would have rejected: a key we
        # do not know could change the numerics, so it is refused rather than ignored
        unknown = set(fields) - set(entry["fields"]) - {"quant_method", "fmt"}
        if unknown:
            raise NotImplementedError(
                f"{entry['class']} fields {sorted(unknown)} are not known to fxquant; known: "
                + ", ".join(entry["fields"])
            )
        if fields.get("fmt", "e4m3") != "e4m3":
            raise _refuse(entry["class"], "fmt", fields["fmt"], "fxquant's fp8 is e4m3")
    return _MAPPERS[method](fields)


def _refuse(cls: str, field: str, value: Any, why: str) -> NotImplementedError:
    return NotImplementedError(f"{cls}({field}={value!r}) is not supported: {why}")


def _skip(fields: dict[str, Any], key: str = "modules_to_not_convert") -> dict[str, Any]:
    names = fields.get(key)
    return {} if names is None else {"modules_to_not_convert": tuple(names)}


def _eetq(f: dict[str, Any]) -> QuantConfig:
    if f.get("weights", "int8") != "int8":
        raise _refuse("EetqConfig", "weights", f["weights"], "EETQ only defines int8")
    return QuantConfig(scheme=Int8WeightOnly(), **_skip(f))


def _fbgemm(f: dict[str, Any]) -> QuantConfig:
    ub = f.get("activation_scale_ub", 1200.0)
    return QuantConfig(scheme=Float8Dynamic(granularity="row", activation_scale_ub=ub), **_skip(f))


def _fine_grained(f: dict[str, Any]) -> QuantConfig:
    cls = "FineGrainedFP8Config"
    if str(f.get("activation_scheme", "dynamic")).lower() != "dynamic":
        raise _refuse(
            cls,
            "activation_scheme",
            f["activation_scheme"],
            "static activation scales need calibration (not built yet)",
        )
    block = f.get("weight_block_size", (128, 128))
    if (
        block is None
        or len(block) != 2
        or block[0] != block[1]
        or block[0] not in (32, 64, 128, 256)
    ):
        raise _refuse(
            cls, "weight_block_size", block, "Float8Block takes square blocks of 32, 64, 128 or 256"
        )
    if f.get("scale_fmt", "float") != "float":
        raise _refuse(
            cls,
            "scale_fmt",
            f["scale_fmt"],
            "power-of-two (ue8m0) block scales are not a Float8Block option yet",
        )
    if f.get("expert_dtype", "fp8") != "fp8":
        raise _refuse(cls, "expert_dtype", f["expert_dtype"], "no FP4 format yet")
    if f.get("dequantize"):
        return QuantConfig(scheme=None, **_skip(f))
    scheme = Float8Block(block_size=int(block[0]))
    only = f.get("modules_to_convert")
    if only:
        overrides = {re.escape(n): scheme for n in only}
        return QuantConfig(scheme=None, overrides=overrides, **_skip(f))
    return QuantConfig(scheme=scheme, **_skip(f))


def _quanto(f: dict[str, Any]) -> QuantConfig:
    cls = "QuantoConfig"
    if f.get("activations") is not None:
        raise _refuse(
            cls,
            "activations",
            f["activations"],
            "quanto calibrates static activation scales; calibration is not built yet",
        )
    weights = f.get("weights", "int8")
    schemes = {"int8": Int8WeightOnly(), "float8": Float8WeightOnly()}
    if weights not in schemes:
        why = {
            "int4": "quanto's int4 groups are affine with a float shift; Int4WeightOnly "
            "stores an integer zero point, so the grids differ",
            "int2": "there is no int2 format yet",
        }.get(weights, "unknown weight type")
        raise _refuse(cls, "weights", weights, why)
    return QuantConfig(scheme=schemes[weights], **_skip(f))


def _type_name(quant_type: Any) -> tuple[str, Any]:
    """(config class name or string alias, the object or its _data dict)."""
    if isinstance(quant_type, str):
        return quant_type, {}
    if isinstance(quant_type, Mapping):
        if "default" in quant_type:  # config.json: {"default": {"_type": ..., "_data": ...}}
            quant_type = quant_type["default"]
        if "_type" in quant_type:
            return str(quant_type["_type"]), quant_type.get("_data", {})
    return type(quant_type).__name__, quant_type


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _granularity(g: Any) -> str:
    """torchao PerTensor / PerRow (objects, their config.json dicts, or a pair of them)."""
    if isinstance(g, (list, tuple)) and g:
        kinds = {_granularity(x) for x in g}
        if len(kinds) != 1:
            raise _refuse(
                "Float8DynamicActivationFloat8WeightConfig",
                "granularity",
                g,
                "activation and weight granularities must agree",
            )
        return kinds.pop()
    name = _get(g, "_type", type(g).__name__) if g is not None else "PerTensor"
    if name in ("PerTensor", "NoneType"):
        return "tensor"
    if name == "PerRow":
        return "row"
    raise _refuse(
        "Float8DynamicActivationFloat8WeightConfig",
        "granularity",
        name,
        "allowed: PerTensor, PerRow",
    )


def _torchao(f: dict[str, Any]) -> QuantConfig:
    cls = "TorchAoConfig"
    if f.get("include_input_output_embeddings"):
        raise _refuse(
            cls,
            "include_input_output_embeddings",
            True,
            "fxquant quantizes linear layers, not embeddings",
        )
    name, data = _type_name(f.get("quant_type"))
    scheme: Scheme
    if name in ("float8_weight_only", "Float8WeightOnlyConfig"):
        scheme = Float8WeightOnly()
    elif name in (
        "float8_dynamic_activation_float8_weight",
        "Float8DynamicActivationFloat8WeightConfig",
    ):
        if _get(data, "activation_value_lb") is not None:
            raise _refuse(
                cls,
                "quant_type.activation_value_lb",
                _get(data, "activation_value_lb"),
                "fxquant bounds the activation amax from above only",
            )
        scheme = Float8Dynamic(
            granularity=_granularity(_get(data, "granularity")),
            activation_scale_ub=_get(data, "activation_value_ub"),
        )
    elif "int8" in name.lower() or "Int8" in name:
        raise _refuse(
            cls,
            "quant_type",
            name,
            "torchao scales symmetric int8 by amax / 127.5 "
            "(half the int8 range), fxquant's int8 schemes by amax / 127",
        )
    elif "int4" in name.lower():
        raise _refuse(
            cls,
            "quant_type",
            name,
            "torchao's int4 keeps zero points in the float domain; Int4WeightOnly's are integers",
        )
    else:
        raise _refuse(cls, "quant_type", name, "no fxquant scheme computes it")
    return QuantConfig(scheme=scheme, **_skip(f))


_CT_PRESETS = {
    "FP8_DYNAMIC": (
        {"type": "float", "num_bits": 8, "strategy": "channel"},
        {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True},
    ),
    "FP8_BLOCK": (
        {"type": "float", "num_bits": 8, "strategy": "block", "block_structure": [128, 128]},
        {"type": "float", "num_bits": 8, "strategy": "group", "group_size": 128, "dynamic": True},
    ),
}


def _ct_scheme(name: str, w: Mapping | None, a: Mapping | None) -> Scheme:
    cls = "CompressedTensorsConfig"
    if w is None:
        raise _refuse(cls, f"config_groups[{name!r}].weights", None, "weights must be quantized")
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise _refuse(
            cls,
            f"config_groups[{name!r}].weights",
            dict(w),
            "only fp8 weights map: compressed-tensors scales symmetric integers by "
            "amax / 127.5 (int8) or amax / 7.5 (int4), fxquant by amax / 127 and / 7; "
            "FP4 has no format yet",
        )
    ws = w.get("strategy")
    if a is None:
        if ws == "channel":
            return Float8WeightOnly()
        raise _refuse(
            cls,
            f"config_groups[{name!r}].weights.strategy",
            ws,
            "fp8 weight-only maps with strategy 'channel' only",
        )
    if a.get("type") != "float" or a.get("num_bits") != 8 or a.get("dynamic") is not True:
        raise _refuse(
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
    raise _refuse(
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


def _compressed_tensors(f: dict[str, Any]) -> QuantConfig:
    cls = "CompressedTensorsConfig"
    if f.get("kv_cache_scheme") is not None:
        raise _refuse(
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
                raise _refuse(
                    cls, "config_groups", name, f"presets that map: {', '.join(_CT_PRESETS)}"
                )
            w, a = _CT_PRESETS[name]
            targets = list(group)
        else:
            w, a = group.get("weights"), group.get("input_activations")
            targets = list(group.get("targets") or ["Linear"])
            if group.get("output_activations") is not None:
                raise _refuse(
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
        raise _refuse(cls, "config_groups", f.get("config_groups"), "no group quantizes Linear")
    return QuantConfig(scheme=default, overrides=overrides, **skip)


_MAPPERS = {
    "eetq": _eetq,
    "fbgemm_fp8": _fbgemm,
    "fp8": _fine_grained,
    "quanto": _quanto,
    "torchao": _torchao,
    "compressed-tensors": _compressed_tensors,
}


def docs_table(field_names: Mapping[str, list[str]], transformers_version: str) -> str:
    """docs/hf_configs.md: every config and every field (``field_names``: class → fields, as
    transformers defines them), with how fxquant honours it."""
    lines = [
        "# Hugging Face quantization configs → fxquant",
        "",
        "Generated by `python -m fxquant.hf > docs/hf_configs.md` from `fxquant.hf.HF_CONFIGS`",
        f"and the config signatures of transformers {transformers_version}; a test checks it is",
        "current. `fxquant.from_hf(cfg)`",
        "takes a transformers config object or a `quantization_config` dict. A config maps only",
        "where fxquant computes the same numerics; otherwise `from_hf` raises",
        "`NotImplementedError` with the reason below. Nothing is approximated.",
        "",
        "| config | field | how fxquant honours it |",
        "|---|---|---|",
    ]
    for method, entry in sorted(HF_CONFIGS.items(), key=lambda kv: kv[1]["class"]):
        cls = entry["class"]
        if entry["status"] == "refused":
            lines.append(f"| `{cls}` (`{method}`) | — | **refused**: {entry['why']} |")
        for name in field_names.get(cls, []):
            how = entry.get("fields", {}).get(name, _NOT_YET)
            lines.append(f"| `{cls}` | `{name}` | {how} |")
    return "\n".join(lines) + "\n"


def transformers_fields() -> dict[str, list[str]]:
    """class name → the keyword fields of its ``__init__`` in the installed transformers."""
    import inspect

    import transformers.utils.quantization_config as q

    out = {}
    for entry in HF_CONFIGS.values():
        init = getattr(q, entry["class"]).__init__
        out[entry["class"]] = [
            p.name
            for p in list(inspect.signature(init).parameters.values())[1:]
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        ]
    return out


if __name__ == "__main__":
    import transformers

    print(docs_table(transformers_fields(), transformers.__version__), end="")
