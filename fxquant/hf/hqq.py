"""``HqqConfig`` (``quant_method="hqq"``) → ``IntxWeightOnly(zero_point='float',
optimizer='hqq')`` (the solver is ``fxquant.core.hqq``): its ``HF_CONFIGS`` entry beside its
mapper; ``from_hf`` dispatches on quant_method."""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Any

from fxquant.core.config import IntxWeightOnly, QuantConfig
from fxquant.hf.base import SKIP, maps, not_converted, refuse

HQQ = {
    "class": "HqqConfig",
    "status": "mapped",
    # config.json holds HQQ's own dict (BaseQuantizeConfig) instead of the arguments
    "private_fields": ("quant_config",),
    "fields": {
        "nbits": "4, 3, 2 → IntxWeightOnly(bits=nbits, zero_point='float', "
        "optimizer='hqq'): HQQ's grid (the group's [min, max] onto [0, 2**nbits - 1], "
        "inverse scale capped at 2e4, float zero point) and its default solver "
        "(fxquant.core.hqq: p = 0.7, β = 10, κ = 1.01, 20 iterations, early stop), in fp32 as "
        "HQQ runs on CPU (on CUDA HQQ runs it in fp16 and keeps scale and zero in the "
        "compute dtype, so results differ by that rounding); 8 and 1 refused (no 8-bit "
        "asymmetric or 1-bit format)",
        "group_size": "32, 64, 128, 256 honoured; other sizes and None (whole rows) "
        "refused; layers whose K is not a multiple are skipped (HQQ would need groups "
        "spanning rows)",
        "view_as_float": "accepted: HQQ only reinterprets the packed bytes as floats for "
        "storage; the numerics are the same",
        "axis": "1 (groups along K; None means 1, as in transformers) honoured; 0 (groups "
        "strided along the output dim) refused",
        "dynamic_config": "{layer tag: params} → QuantConfig.overrides (the tag, e.g. "
        "'self_attn.q_proj', matches every module name ending in it); layers no tag "
        "names stay in float, as in transformers",
        "skip_modules": SKIP,
    },
}

_HQQ_DEFAULTS = {"channel_wise": True, "optimize": True, "axis": 1, "view_as_float": False}


def _hqq_scheme(params: Mapping[str, Any]) -> IntxWeightOnly:
    """HQQ's ``weight_quant_params`` (or HqqConfig's arguments) → the scheme, or a refusal."""
    cls = "HqqConfig"
    known = {"nbits", "group_size", "round_zero", "scale_quant_params", "zero_quant_params"}
    unknown = set(params) - known - set(_HQQ_DEFAULTS)
    if unknown:
        raise refuse(cls, "quant_config", sorted(unknown), "unknown HQQ parameters")
    p = {**_HQQ_DEFAULTS, **params}
    nbits = p.get("nbits", 4)
    if nbits not in (2, 3, 4):
        raise refuse(cls, "nbits", nbits, "allowed: 4, 3, 2 (no 8-bit asymmetric or 1-bit format)")
    if not p["channel_wise"]:
        raise refuse(cls, "channel_wise", False, "a single per-tensor scale is not a format")
    if p["axis"] not in (1, None):  # transformers turns None into 1
        raise refuse(cls, "axis", p["axis"], "fxquant groups run along K (axis=1)")
    group_size = p.get("group_size", 64)
    if group_size not in (32, 64, 128, 256):
        raise refuse(cls, "group_size", group_size, "allowed: 32, 64, 128, 256")
    optimize = bool(p["optimize"])
    # HQQ rounds the initial zero point for 4 bits only (its BaseQuantizeConfig's rule), and
    # fxquant's solver does the same; any other combination is a different starting point
    round_zero = p.get("round_zero", nbits == 4)
    if round_zero != (nbits == 4 and optimize):
        raise refuse(
            cls,
            "round_zero",
            round_zero,
            f"fxquant rounds the initial zero point exactly when HQQ's default does (nbits=4 "
            f"with optimize=True); got nbits={nbits}, optimize={optimize}",
        )
    for key in ("scale_quant_params", "zero_quant_params"):
        if params.get(key) is not None:
            raise refuse(cls, key, params[key], "8-bit quantized scales / zero points not built")
    return IntxWeightOnly(
        bits=nbits,
        group_size=group_size,
        zero_point="float",
        optimizer="hqq" if optimize else None,
    )


def _hqq_layer(cfg: Mapping[str, Any]) -> IntxWeightOnly:
    """One layer's HQQ config: BaseQuantizeConfig's dict, or HqqConfig's keyword arguments."""
    if "weight_quant_params" in cfg:
        # offload_meta only says where HQQ keeps scale and zero (CPU or GPU memory)
        extra = {k: cfg.get(k) for k in ("scale_quant_params", "zero_quant_params")}
        return _hqq_scheme({**cfg["weight_quant_params"], **extra})
    return _hqq_scheme(cfg)


@maps("hqq", HQQ)
def _hqq(f: dict[str, Any]) -> QuantConfig:
    skip = not_converted(f, "skip_modules")
    qc = f.get("quant_config")
    dynamic = f.get("dynamic_config")
    if qc is not None and "weight_quant_params" not in qc:
        dynamic = qc  # the serialised form of dynamic_config: {tag: BaseQuantizeConfig}
    if dynamic:
        overrides = {re.escape(tag): _hqq_layer(c) for tag, c in dynamic.items()}
        return QuantConfig(scheme=None, overrides=overrides, **skip)
    if qc is not None:
        return QuantConfig(scheme=_hqq_layer(qc), **skip)
    args = {k: f[k] for k in ("nbits", "group_size", "axis", "view_as_float") if k in f}
    return QuantConfig(scheme=_hqq_scheme(args), **skip)
