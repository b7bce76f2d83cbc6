"""The FP4 configs: ``Mxfp4Config`` (``quant_method="mxfp4"``, gpt-oss' experts) → ``MXFP4``
weights, ``NVFP4Config`` (``"nvfp4"``) → ``NVFP4`` (approximated: the mapping warns), and
``FourOverSixConfig`` (``"fouroversix"``) → ``NVFP4`` / ``MXFP4`` with their scale rules. Each
``HF_CONFIGS`` entry sits beside its mapper; ``from_hf`` dispatches on quant_method.
``fxquant/checkpoints/mxfp4.py`` loads gpt-oss checkpoints through ``from_hf``."""

from __future__ import annotations

from typing import Any

from fxquant.core.config import EXPERT_WEIGHTS, MXFP4, NVFP4, QuantConfig, Scheme
from fxquant.hf.base import SKIP, maps, not_converted, refuse

MXFP4_CONFIG = {
    "class": "Mxfp4Config",
    "status": "mapped",
    "fields": {
        "modules_to_not_convert": SKIP + ". → MXFP4(activations=False, "
        "scale_rule='ceil') on the mixture-of-experts weights only (`experts.gate_up_proj`"
        " / `experts.down_proj`, 3-D, run by transformers' grouped_mm), as transformers "
        "quantizes gpt-oss: every nn.Linear (attention, router, lm_head) stays float. e2m1 "
        "weights in blocks of 32 along K with an E8M0 scale each, rounded up "
        "(triton_kernels' downcast_to_mxfp), activations in float",
        "dequantize": "False honoured; True refused (it asks for float weights: load the "
        "model with transformers, no fxquant config is needed)",
    },
}

# the 3-D expert weights transformers' Mxfp4Config quantizes (gpt-oss' names)
MXFP4_EXPERTS = EXPERT_WEIGHTS


@maps("mxfp4", MXFP4_CONFIG)
def _mxfp4(f: dict[str, Any]) -> QuantConfig:
    if f.get("dequantize"):
        raise refuse(
            "Mxfp4Config",
            "dequantize",
            f["dequantize"],
            "it asks for float weights: load the model with transformers, no fxquant config is "
            "needed",
        )
    return QuantConfig(
        overrides={MXFP4_EXPERTS: MXFP4(activations=False, scale_rule="ceil")}, **not_converted(f)
    )


NVFP4_CONFIG = {
    "class": "NVFP4Config",
    "status": "mapped",
    "approximated": "the Hub kernel transformers loads for NVFP4Config runs decode (one "
    "token) with bf16 activations and quantizes only bias-free linears; fxquant quantizes "
    "activations at every batch size and biased linears too",
    "fields": {
        "modules_to_not_convert": SKIP + ". → NVFP4(activations=True, "
        "scale_rule='six'): e2m1 weights, e4m3 scales per 16, fp32 tensor scale amax / "
        "(6 · 448), activations quantized per call the same way. Approximated (the mapping "
        "warns): the Hub kernel transformers loads runs decode GEMVs with bf16 activations "
        "(W4A16) and only bias-free linears with K and N multiples of 16; fxquant "
        "quantizes activations at every M and takes biased linears too",
    },
}


@maps("nvfp4", NVFP4_CONFIG)
def _nvfp4(f: dict[str, Any]) -> QuantConfig:
    return QuantConfig(scheme=NVFP4(activations=True, scale_rule="six"), **not_converted(f))


FOUROVERSIX = {
    "class": "FourOverSixConfig",
    "status": "mapped",
    "fields": {
        "dtype": "'nvfp4' → NVFP4; 'mxfp4' → MXFP4(activations=True, scale_rule='ceil') "
        "(fouroversix's MXFP4: amax / 6 rounded up to a power of two), static_6 only; "
        "other dtypes refused",
        "scale_rule": "'mse' → NVFP4(scale_rule='four_over_six') (each 16-block keeps "
        "the lower squared error of amax → 6 and amax → 4, tensor scale amax / (6 · 256)); "
        "'static_6' → NVFP4(scale_rule='six') (block scales below 2**-6 are clamped there, "
        "as torchao; fouroversix leaves them unclamped); 'mae', 'abs_max', 'static_4' "
        "refused (not built)",
        "weight_dtype": "None or equal to dtype; anything else refused",
        "activation_dtype": "None or equal to dtype (weights and activations both "
        "quantized); anything else refused",
        "weight_scale_rule": "None or equal to scale_rule; anything else refused (one "
        "rule for weights and activations)",
        "activation_scale_rule": "None or equal to scale_rule; anything else refused",
        "gradient_dtype": "accepted, no effect (training only)",
        "gradient_scale_rule": "accepted, no effect (training only)",
        "keep_master_weights": "accepted: the weights quantize with the same rule once "
        "instead of every forward; no training",
        "matmul_backend": "accepted: every backend computes the dequantized product with "
        "fp32 accumulation, as fxquant",
        "quantize_backend": "accepted: the backends implement the same rounding",
        "output_dtype": "accepted: fxquant returns the activation's dtype (bf16 for a "
        "bf16 model) instead of forcing it",
        "weight_scale_2d": "False honoured; True (16×16 weight scale tiles, for training) refused",
        "module_config_overrides": "None or empty honoured; per-module overrides refused",
        "modules_to_not_convert": SKIP,
    },
}

_FOS_RULES = {"mse": "four_over_six", "static_6": "six"}


@maps("fouroversix", FOUROVERSIX)
def _fouroversix(f: dict[str, Any]) -> QuantConfig:
    cls = "FourOverSixConfig"

    def name(key: str, default: Any = None) -> Any:
        v = f.get(key, default)
        return getattr(v, "value", v)  # fouroversix's str enums

    dtype, rule = name("dtype", "nvfp4"), name("scale_rule", "mse")
    for key, want in (
        ("weight_dtype", dtype),
        ("activation_dtype", dtype),
        ("weight_scale_rule", rule),
        ("activation_scale_rule", rule),
    ):
        if name(key) not in (None, want):
            raise refuse(
                cls,
                key,
                name(key),
                "fxquant uses one format and rule for weights and activations; allowed: "
                f"None or {want!r}",
            )
    if f.get("weight_scale_2d"):
        raise refuse(cls, "weight_scale_2d", True, "16×16 weight scale tiles are not built")
    if f.get("module_config_overrides"):
        raise refuse(cls, "module_config_overrides", f["module_config_overrides"], "not supported")
    scheme: Scheme
    if dtype == "nvfp4":
        if rule not in _FOS_RULES:
            raise refuse(cls, "scale_rule", rule, "allowed: 'mse', 'static_6'")
        scheme = NVFP4(activations=True, scale_rule=_FOS_RULES[rule])
    elif dtype == "mxfp4":
        if rule != "static_6":
            raise refuse(cls, "scale_rule", rule, "MXFP4 maps with 'static_6' only")
        scheme = MXFP4(activations=True, scale_rule="ceil")
    else:
        raise refuse(cls, "dtype", dtype, "allowed: 'nvfp4', 'mxfp4'")
    return QuantConfig(scheme=scheme, **not_converted(f))
