"""``QuantoConfig`` (``quant_method="quanto"``) → ``Int8WeightOnly`` / ``Float8WeightOnly``:
its ``HF_CONFIGS`` entry beside its mapper; ``from_hf`` dispatches on quant_method."""

from __future__ import annotations

from typing import Any

from fxquant.core.config import Float8WeightOnly, Int8WeightOnly, QuantConfig
from fxquant.hf.base import SKIP, maps, not_converted, refuse

QUANTO = {
    "class": "QuantoConfig",
    "status": "mapped",
    "fields": {
        "weights": "'int8' → Int8WeightOnly, 'float8' → Float8WeightOnly (per output "
        "channel, absmax / qmax, as quanto); 'int4' refused (quanto's affine groups "
        "carry a float shift, Int4WeightOnly an integer zero point), 'int2' refused "
        "(quanto's groups are 128, 96, 64 or 32 wide or per channel depending on K, and "
        "dequantize u·s - shift in the weight dtype; the nearest fxquant scheme, "
        "IntxWeightOnly(bits=2, zero_point='float'), computes (u - z)·s in fp32)",
        "activations": "None honoured; 'int8' / 'float8' refused (quanto calibrates "
        "static activation scales; no calibration yet)",
        "modules_to_not_convert": SKIP,
    },
}


@maps("quanto", QUANTO)
def _quanto(f: dict[str, Any]) -> QuantConfig:
    cls = "QuantoConfig"
    if f.get("activations") is not None:
        raise refuse(
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
            "int2": "quanto's int2 groups are 128, 96, 64 or 32 wide or per channel "
            "depending on K, with a float shift dequantized as u·s - shift in the weight "
            "dtype; IntxWeightOnly(bits=2, zero_point='float') has the same grid rule but "
            "computes (u - z)·s in fp32, so it is not the same numerics (use it directly to "
            "accept that)",
        }.get(weights, "unknown weight type")
        raise refuse(cls, "weights", weights, why)
    return QuantConfig(scheme=schemes[weights], **not_converted(f))
