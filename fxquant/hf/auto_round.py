"""``AutoRoundConfig`` (``quant_method="auto-round"``): AutoRound chooses its weights from data,
so the mapper gives a ``QuantConfig`` *and* the ``AutoRound`` method for ``fxquant.calibrate``
(``calibration_from_hf``; ``from_hf`` refuses it, pointing there). Its checkpoints load through
``fxquant/checkpoints/auto_round.py``."""

from __future__ import annotations

from typing import Any

from fxquant.core.config import Int4WeightOnly, QuantConfig
from fxquant.hf.base import maps, refuse

AUTO_ROUND = {
    "class": "AutoRoundConfig",
    "status": "calibration",
    "why": "AutoRound tunes each weight's rounding and each group's clipping on calibration "
    "data: `fxquant.calibration_from_hf(cfg)` returns the QuantConfig and the `AutoRound` "
    "method for `fxquant.calibrate(model, config, data, method=...)`; its integer checkpoints "
    "(GPTQ v1/v2 and AWQ packings) load with `fxquant.load_quantized`",
    # what auto-round writes into config.json beside AutoRoundConfig's own fields
    "private_fields": (
        "packing_format",
        "data_type",
        "iters",
        "lr",
        "minmax_lr",
        "batch_size",
        "enable_minmax_tuning",
        "enable_quanted_input",
        "nsamples",
        "seqlen",
        "seed",
        "dataset",
        "extra_config",
        "block_name_to_quantize",
        "autoround_version",
        "amp",
        "gradient_accumulate_steps",
        "low_gpu_mem_usage",
        "scale_dtype",
        "act_bits",
        "act_group_size",
        "act_sym",
        "act_data_type",
        "act_dynamic",
        "super_bits",
        "super_group_size",
    ),
    "fields": {
        "bits": "4 → Int4WeightOnly with AutoRound's tuned rounding; other widths refused "
        "(fxquant's AutoRound produces int4; their checkpoints at 2, 3 and 8 bits load)",
        "group_size": "32, 64, 128 or 256 → Int4WeightOnly(group_size=...); others refused",
        "sym": "True → symmetric: auto-round's full signed range (scale ±max / 8, codes -8..7, "
        "zero 8); False → an integer zero point over [min(w, 0), max(w, 0)] / 15, auto-round's "
        "int_asym. The clipping factors scale both ends of the range",
        "backend": "accepted, no effect (a kernel choice)",
    },
}


@maps("auto-round", AUTO_ROUND)
def _auto_round(f: dict[str, Any]) -> tuple[QuantConfig, Any, None]:
    from fxquant.calibration.methods import AutoRound

    cls = "AutoRoundConfig"
    bits, group_size = f.get("bits", 4), f.get("group_size", 128)
    if bits != 4:
        raise refuse(cls, "bits", bits, "fxquant's AutoRound produces int4 weights (allowed: 4)")
    if group_size not in (32, 64, 128, 256):
        raise refuse(cls, "group_size", group_size, "allowed: 32, 64, 128, 256")
    data_type = str(f.get("data_type", "int"))
    if data_type != "int":
        raise refuse(cls, "data_type", data_type, "fxquant's AutoRound tunes integer grids")
    if int(f.get("act_bits", 16) or 16) < 16:
        raise refuse(cls, "act_bits", f["act_bits"], "AutoRound here is weight-only")
    knobs = {
        k: f[k] for k in ("iters", "lr", "minmax_lr", "batch_size", "seed") if f.get(k) is not None
    }
    for k in ("enable_minmax_tuning", "enable_quanted_input"):
        if f.get(k) is not None:
            knobs[k] = bool(f[k])
    scheme = Int4WeightOnly(group_size=group_size, symmetric=bool(f.get("sym", True)))
    return QuantConfig(scheme=scheme), AutoRound(**knobs), None
