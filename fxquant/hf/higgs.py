"""``HiggsConfig`` (``quant_method="higgs"``) → ``Higgs`` (a Hadamard rotation per block, then
vector quantization onto Gaussian MSE-optimal grids, ``fxquant.core.higgs``): its
``HF_CONFIGS`` entry beside its mapper; ``from_hf`` dispatches on quant_method."""

from __future__ import annotations

from typing import Any

from fxquant.core.config import Higgs, QuantConfig
from fxquant.core.higgs import HIGGS_BITS, HIGGS_GROUP_SIZES, HIGGS_P
from fxquant.hf.base import SKIP, maps, not_converted, refuse

HIGGS = {
    "class": "HiggsConfig",
    "status": "mapped",
    "fields": {
        "bits": "2, 3, 4 → Higgs(bits=...): grids of 2^(p·bits) points, the method's tables "
        "(fxquant/core/higgs_grids.json, as transformers ships them); codes and block scales "
        "as transformers' quantize_with_higgs computes them (tests/test_higgs.py)",
        "p": "1 or 2 → Higgs(p=...): scalar or 2-D grids",
        "hadamard_size": "→ Higgs(hadamard_size=...): the rotation block, a power of two that "
        "group_size divides; K is padded with zeros to it, as transformers does",
        "group_size": "64, 128, 256 → Higgs(group_size=...): the GPU kernel's storage group "
        "(its scales repeat each rotation block's); no numeric effect; layers whose K is not "
        "a multiple are skipped, as transformers asserts",
        "tune_metadata": "accepted, no effect (FLUTE's kernel tuning; fxquant's kernels need none)",
        "modules_to_not_convert": SKIP,
    },
}


@maps("higgs", HIGGS)
def _higgs(f: dict[str, Any]) -> QuantConfig:
    cls = "HiggsConfig"
    bits, p = int(f.get("bits", 4)), int(f.get("p", 2))
    group_size, h = int(f.get("group_size", 256)), int(f.get("hadamard_size", 512))
    if bits not in HIGGS_BITS:
        raise refuse(cls, "bits", bits, "allowed: 2, 3, 4")
    if p not in HIGGS_P:
        raise refuse(cls, "p", p, "allowed: 1, 2")
    if group_size not in HIGGS_GROUP_SIZES:
        raise refuse(cls, "group_size", group_size, "allowed: 64, 128, 256")
    if h < group_size or h & (h - 1) or h % group_size:
        raise refuse(cls, "hadamard_size", h, f"allowed: a power of two >= group_size={group_size}")
    scheme = Higgs(bits=bits, p=p, hadamard_size=h, group_size=group_size)
    return QuantConfig(scheme=scheme, **not_converted(f))
