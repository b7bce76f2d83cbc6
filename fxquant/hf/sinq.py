"""``SinqConfig`` (``quant_method="sinq"``) → ``SinqWeightOnly`` (``fxquant.core.sinq``: the
``sinq`` package's calibration-free quantizer, bit for bit): its ``HF_CONFIGS`` entry beside its
mapper; ``from_hf`` dispatches on quant_method."""

from __future__ import annotations

from typing import Any

from fxquant.core.config import QuantConfig, SinqWeightOnly
from fxquant.hf.base import SKIP, maps, not_converted, refuse

SINQ = {
    "class": "SinqConfig",
    "status": "mapped",
    "fields": {
        "nbits": "4, 3, 2 → SinqWeightOnly(bits=nbits): the sinq package's method 'sinq' "
        "(Quantizer.quantize with method 'sinq_quantAux', tiling '1D', fp32 on CPU): the "
        "kurtosis gate, 16 Sinkhorn steps per group of columns, round to nearest with integer "
        "zeros, then the row scales and zeros rounded to 8 bits; the same codes, scales, zeros "
        "and column scales (tests/fixtures/sinq_0.2.0.pt). 8, 6, 5 and 1-bit refused (no "
        "fxquant format with a float zero point at those widths)",
        "group_size": "32, 64, 128, 256 honoured; others refused; layers whose K is not a "
        "multiple, or whose N·K/group_size is not a multiple of 32 (SINQ's 8-bit rounding of "
        "the row scales needs it), are skipped",
        "tiling_mode": "'1D' honoured; '2D' refused (square tiles give each block of rows its "
        "own column scales, which no per-input-column multiply can apply)",
        "method": "'sinq' honoured; 'asinq' refused (it needs calibration activations, and "
        "transformers does not support it either)",
        "modules_to_not_convert": SKIP,
    },
}


@maps("sinq", SINQ)
def _sinq(f: dict[str, Any]) -> QuantConfig:
    cls = "SinqConfig"
    method = str(f.get("method", "sinq")).lower()
    if method != "sinq":
        raise refuse(cls, "method", method, "allowed: 'sinq' (A-SINQ needs calibration data)")
    if f.get("tiling_mode", "1D") != "1D":
        raise refuse(
            cls, "tiling_mode", f["tiling_mode"], "allowed: '1D' (2D tiles have per-block "
            "column scales)"
        )  # fmt: skip
    nbits = int(f.get("nbits", 4))
    if nbits not in (2, 3, 4):
        raise refuse(cls, "nbits", nbits, "allowed: 4, 3, 2")
    group_size = int(f.get("group_size", 64))
    if group_size not in (32, 64, 128, 256):
        raise refuse(cls, "group_size", group_size, "allowed: 32, 64, 128, 256")
    return QuantConfig(scheme=SinqWeightOnly(bits=nbits, group_size=group_size), **not_converted(f))
