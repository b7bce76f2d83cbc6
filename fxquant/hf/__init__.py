"""``from_hf``: a Hugging Face quantization config (a transformers ``*Config`` object, or the
``quantization_config`` dict of a model's ``config.json``) → a ``QuantConfig`` with the same
numerics, or ``NotImplementedError`` saying exactly what fxquant lacks for it.

Where it sits: before everything else, beside ``fxquant.core.config``; it only builds a config.
transformers is not imported: objects are read by attribute, so plain dicts work without it.
(``fxquant.hf.bridge``, the ``from_pretrained`` quantizer, does import it, and is not imported
here.)

A config maps only where an fxquant scheme computes what the original does: the same grid, the
same scale rule, the same activation handling. Where one detail differs (torchao and
compressed-tensors scale symmetric int8 by amax / 127.5, fxquant by amax / 127) the config is
refused, not approximated. The exceptions are NVFP4Config's scope (its Hub kernel
takes bias-free linears and decodes with bf16 activations) and AwqConfig's asymmetric grid:
their rows say "Approximated" and how, and mapping them warns (``ApproximationWarning``).
GPTQConfig, AwqConfig and AutoRoundConfig choose their weights from data:
``calibration_from_hf`` returns the config *and* the calibration method for
``fxquant.calibrate``; ``from_hf`` refuses them, pointing there. ``HF_CONFIGS`` says, per
config and per field, how it is honoured; docs/hf_configs.md is generated from it
(``python -P -m fxquant.hf > docs/hf_configs.md``) and a test checks it covers every field
transformers defines.

One module per method or small family, each holding its ``HF_CONFIGS`` entry right beside its
mapper (registered with ``fxquant.hf.base.maps``): ``eetq``, ``fp8`` (FbgemmFp8Config,
FineGrainedFP8Config), ``quanto``, ``torchao``, ``compressed_tensors``, ``bitsandbytes``,
``hqq``, ``higgs``, ``metal``, ``sinq``, ``bitnet``, ``fp4`` (Mxfp4Config, NVFP4Config,
FourOverSixConfig), ``fp_quant`` (FPQuantConfig), ``gptq_awq`` and ``auto_round``
(calibration) and ``refused`` (the configs refused whole). This module dispatches on
``quant_method``; ``docs`` writes the table.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Mapping
from typing import Any

from fxquant.core.config import EXPERT_WEIGHTS, LLAMA4_EXPERTS, QuantConfig

# each method module registers its HF_CONFIGS entry and mapper on import
from fxquant.hf import (  # noqa: F401
    auto_round,
    bitnet,
    bitsandbytes,
    compressed_tensors,
    eetq,
    fp4,
    fp8,
    fp_quant,
    gptq_awq,
    higgs,
    hqq,
    metal,
    quanto,
    refused,
    sinq,
    torchao,
)
from fxquant.hf.base import HF_CONFIGS, MAPPERS, ApproximationWarning, refuse
from fxquant.hf.docs import docs_table, transformers_fields
from fxquant.hf.fp4 import MXFP4_EXPERTS

__all__ = [
    "HF_CONFIGS",
    "MXFP4_EXPERTS",
    "ApproximationWarning",
    "calibration_from_hf",
    "docs_table",
    "from_hf",
    "transformers_fields",
]

_BY_CLASS = {v["class"]: k for k, v in HF_CONFIGS.items()}


def _fields(obj: Any) -> dict[str, Any]:
    if isinstance(obj, Mapping):
        return dict(obj)
    if hasattr(obj, "to_dict"):  # transformers' QuantizationConfigMixin
        d = dict(obj.to_dict())
        # to_dict serialises some objects (torchao configs); keep the live ones. Mxfp4Config's
        # to_dict drops dequantize, which changes what the config asks for.
        for key in ("quant_type", "dequantize"):
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
    ``NotImplementedError`` naming what is missing. See ``HF_CONFIGS`` / docs/hf_configs.md.
    A mapping with a documented approximation (NVFP4Config's scope) warns with
    ``ApproximationWarning``."""
    fields = _fields(config)
    method = _method(config, fields)
    entry = HF_CONFIGS[method]
    if entry["status"] == "refused":
        raise NotImplementedError(f"{entry['class']} is not supported yet: {entry['why']}")
    if entry["status"] == "calibration":
        raise NotImplementedError(f"from_hf({entry['class']}): {entry['why']}")
    _check_fields(entry, config, fields)
    return _approximated(entry, _linears_only(method, MAPPERS[method](fields)))


def calibration_from_hf(config: Any) -> tuple[QuantConfig, Any]:
    """``(QuantConfig, method)`` for a config whose weights come from calibration (``GPTQConfig``,
    ``AwqConfig``, ``AutoRoundConfig``): ``fxquant.calibrate(model, config, data,
    method=method)`` then quantizes as the original would. Other configs raise ``ValueError``
    (use ``from_hf``)."""
    fields = _fields(config)
    method = _method(config, fields)
    entry = HF_CONFIGS[method]
    if entry["status"] != "calibration":
        raise ValueError(
            f"calibration_from_hf({entry['class']}): this config needs no calibration data; "
            "use fxquant.from_hf"
        )
    _check_fields(entry, config, fields)
    qconfig, algorithm, approximation = MAPPERS[method](fields)
    qconfig = _linears_only(method, qconfig)
    if approximation:
        warnings.warn(f"{entry['class']} mapped approximately: {approximation}",
                      ApproximationWarning, stacklevel=2)  # fmt: skip
    return qconfig, algorithm


def _check_fields(entry: Mapping[str, Any], config: Any, fields: Mapping[str, Any]) -> None:
    if not isinstance(config, Mapping):
        return
    # a config.json dict may carry keys a transformers object would have rejected: a key we do
    # not know could change the numerics, so it is refused rather than ignored
    unknown = (
        set(fields)
        - set(entry["fields"])
        - set(entry.get("private_fields", ()))
        - {"quant_method", "fmt"}
    )
    if unknown:
        raise NotImplementedError(
            f"{entry['class']} fields {sorted(unknown)} are not known to fxquant; known: "
            + ", ".join(entry["fields"])
        )
    if fields.get("fmt", "e4m3") != "e4m3":
        raise refuse(entry["class"], "fmt", fields["fmt"], "fxquant's fp8 is e4m3")


def _linears_only(method: str, config: QuantConfig) -> QuantConfig:
    """A mixture-of-experts model's 3-D expert weights (``EXPERT_WEIGHTS``, run by grouped_mm
    or, in Llama 4, bmm) take the config's scheme where transformers 5.25's quantizer replaces
    the experts module too, and stay float elsewhere, to compute what transformers would:
    Mxfp4Config and FineGrainedFP8Config (``FP8Experts``) take every model's experts,
    FbgemmFp8Config Llama 4's only (``FbgemmFp8Llama4TextExperts``; matched by module path, so
    the three other models whose experts sit under ``feed_forward`` (Aria, Jamba, LFM2-MoE)
    have theirs quantized too), every other quantizer nn.Linear modules only. Per-expert
    nn.Linear modules (``experts.0.gate_proj``) are linears and do not match."""
    if method in ("mxfp4", "fp8") or not any(s.takes_experts for s in config.schemes):
        return config
    overrides = {EXPERT_WEIGHTS: None, **config.overrides}
    if method == "fbgemm_fp8" and config.scheme is not None:
        overrides = {LLAMA4_EXPERTS: config.scheme, **overrides}
    return dataclasses.replace(config, overrides=overrides)


def _approximated(entry: Mapping[str, Any], result: QuantConfig) -> QuantConfig:
    how = entry.get("approximated")
    if how and (result.scheme is not None or result.overrides):
        warnings.warn(f"{entry['class']} mapped approximately: {how}", ApproximationWarning,
                      stacklevel=3)  # fmt: skip
    return result
