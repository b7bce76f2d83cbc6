"""``EetqConfig`` (``quant_method="eetq"``) → ``Int8WeightOnly``: its ``HF_CONFIGS`` entry
beside its mapper (``fxquant.hf``'s method modules; ``from_hf`` dispatches on quant_method)."""

from __future__ import annotations

from typing import Any

from fxquant.core.config import Int8WeightOnly, QuantConfig
from fxquant.hf.base import SKIP, maps, not_converted, refuse

EETQ = {
    "class": "EetqConfig",
    "status": "mapped",
    "fields": {
        "weights": "'int8' → Int8WeightOnly (per output channel, amax / 127, as EETQ); "
        "anything else refused",
        "modules_to_not_convert": SKIP,
    },
}


@maps("eetq", EETQ)
def _eetq(f: dict[str, Any]) -> QuantConfig:
    if f.get("weights", "int8") != "int8":
        raise refuse("EetqConfig", "weights", f["weights"], "EETQ only defines int8")
    return QuantConfig(scheme=Int8WeightOnly(), **not_converted(f))
