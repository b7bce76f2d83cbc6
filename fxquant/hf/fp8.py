"""The FP8 configs: ``FbgemmFp8Config`` (``quant_method="fbgemm_fp8"``) → ``Float8Dynamic``
per row, ``FineGrainedFP8Config`` (``"fp8"``, DeepSeek-style blocks) → ``Float8Block``. Each
``HF_CONFIGS`` entry sits beside its mapper; ``from_hf`` dispatches on quant_method.
``fxquant/checkpoints/fp8.py`` loads the checkpoints of the second, through ``from_hf``."""

from __future__ import annotations

import re
from typing import Any

from fxquant.core.config import Float8Block, Float8Dynamic, QuantConfig
from fxquant.hf.base import SKIP, maps, not_converted, refuse

FBGEMM_FP8 = {
    "class": "FbgemmFp8Config",
    "status": "mapped",
    "fields": {
        "activation_scale_ub": "Float8Dynamic(granularity='row', activation_scale_ub=...)",
        "modules_to_not_convert": SKIP,
    },
}


@maps("fbgemm_fp8", FBGEMM_FP8)
def _fbgemm(f: dict[str, Any]) -> QuantConfig:
    ub = f.get("activation_scale_ub", 1200.0)
    return QuantConfig(
        scheme=Float8Dynamic(granularity="row", activation_scale_ub=ub), **not_converted(f)
    )


FINE_GRAINED_FP8 = {
    "class": "FineGrainedFP8Config",
    "status": "mapped",
    "fields": {
        "activation_scheme": "'dynamic' → per-token 1×b groups (Float8Block); 'static' "
        "refused (needs a calibrated per-layer scale)",
        "weight_block_size": "(b, b), b in 32/64/128/256 → Float8Block(block_size=b); "
        "other shapes refused",
        "dequantize": "True → no layer quantized (the model stays in high precision)",
        "modules_to_not_convert": SKIP,
        "modules_to_convert": "only these modules are quantized (QuantConfig.overrides)",
        "scale_fmt": "'float' honoured; 'ue8m0' (power-of-two block scales) refused",
        "expert_dtype": "'fp8' honoured: experts that are nn.Linear and 3-D expert weights "
        "(FP8Experts: fxquant::float8_block_grouped_mm) take the blocks; 'fp4' refused "
        "(DeepSeek-V4's FP4 experts run with FP8 block activations, which fxquant's FP4 "
        "experts op lacks)",
    },
}


@maps("fp8", FINE_GRAINED_FP8)
def _fine_grained(f: dict[str, Any]) -> QuantConfig:
    cls = "FineGrainedFP8Config"
    if str(f.get("activation_scheme", "dynamic")).lower() != "dynamic":
        raise refuse(
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
        raise refuse(
            cls, "weight_block_size", block, "Float8Block takes square blocks of 32, 64, 128 or 256"
        )
    if f.get("scale_fmt", "float") != "float":
        raise refuse(
            cls,
            "scale_fmt",
            f["scale_fmt"],
            "power-of-two (ue8m0) block scales are not a Float8Block option yet",
        )
    if f.get("expert_dtype", "fp8") != "fp8":
        raise refuse(
            cls,
            "expert_dtype",
            f["expert_dtype"],
            "DeepSeek-V4's FP4 experts run with FP8 block activations; fxquant's grouped "
            "expert op (fxquant::mxfp4_grouped_mm) is MXFP4 weight-only",
        )
    if f.get("dequantize"):
        return QuantConfig(scheme=None, **not_converted(f))
    scheme = Float8Block(block_size=int(block[0]))
    only = f.get("modules_to_convert")
    if only:
        overrides = {re.escape(n): scheme for n in only}
        return QuantConfig(scheme=None, overrides=overrides, **not_converted(f))
    return QuantConfig(scheme=scheme, **not_converted(f))
