"""``BitNetQuantConfig`` (``quant_method="bitnet"``) → ``BitNetTernary``: its ``HF_CONFIGS``
entry beside its mapper; ``from_hf`` dispatches on quant_method."""

from __future__ import annotations

from typing import Any

from fxquant.core.config import BitNetTernary, QuantConfig
from fxquant.hf.base import SKIP, maps, not_converted, refuse

BITNET = {
    "class": "BitNetQuantConfig",
    "status": "mapped",
    "fields": {
        "linear_class": "'bitlinear' and 'autobitlinear' → BitNetTernary: ternary "
        "weights round(W / mean(abs(W))) clamped to ±1 and int8 activations per token "
        "(127 / amax, clamp [-128, 127]), both with transformers' eps 1e-5, integer "
        "products scaled once in fp32 (AutoBitLinear multiplies the dequantized operands "
        "in the model dtype instead: same grids, different rounding order)",
        "quantization_mode": "'offline' and 'online' both honoured: they say when "
        "transformers quantizes the weight (in the checkpoint, or at each forward), not "
        "how; fxquant quantizes it once with the same rule",
        "use_rms_norm": "False honoured; True refused (it puts an RMSNorm with its own "
        "trained weights inside each BitLinear, a layer the float model does not have)",
        "rms_norm_eps": "accepted; used only with use_rms_norm=True, which is refused",
        "modules_to_not_convert": SKIP,
    },
}


@maps("bitnet", BITNET)
def _bitnet(f: dict[str, Any]) -> QuantConfig:
    cls = "BitNetQuantConfig"
    linear_class = f.get("linear_class", "bitlinear")
    if linear_class not in ("bitlinear", "autobitlinear"):
        raise refuse(cls, "linear_class", linear_class, "allowed: 'bitlinear', 'autobitlinear'")
    mode = f.get("quantization_mode", "offline")
    if mode not in ("offline", "online"):
        raise refuse(cls, "quantization_mode", mode, "allowed: 'offline', 'online'")
    if f.get("use_rms_norm"):
        raise refuse(
            cls,
            "use_rms_norm",
            True,
            "it adds an RMSNorm with its own trained weights inside each linear; fxquant "
            "quantizes the model's layers and adds none",
        )
    return QuantConfig(scheme=BitNetTernary(), **not_converted(f))
