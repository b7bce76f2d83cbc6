"""``FPQuantConfig`` (``quant_method="fp_quant"``) → ``FPQuant`` (a block rotation, then MXFP4 /
NVFP4 with FP-Quant's scale rules, ``fxquant.core.reference_fp_quant``): its ``HF_CONFIGS``
entry beside its mapper; ``from_hf`` dispatches on quant_method. Its checkpoints load through
``fxquant.checkpoints.fp_quant``."""

from __future__ import annotations

from typing import Any

from fxquant.core.config import FPQuant, QuantConfig
from fxquant.core.reference_fp_quant import (
    FP_QUANT_METHODS,
    FP_QUANT_ROTATION_SIZES,
    FP_QUANT_ROTATIONS,
)
from fxquant.hf.base import SKIP, maps, not_converted, refuse

FP_QUANT = {
    "class": "FPQuantConfig",
    "status": "mapped",
    "fields": {
        "forward_dtype": "'nvfp4' → FPQuant(dtype='nvfp4'): e2m1 with e4m3 scales per 16; "
        "'mxfp4' → FPQuant(dtype='mxfp4'): E8M0 scales per 32. Weights quantized once, "
        "activations at every call, as QuTLASS's fused rotate-and-quantize kernel does; "
        "the checkpoints' qweight / scales / global scales / rotation load as they are",
        "forward_method": "'abs_max' (block amax: NVFP4 e4m3(3 · amax / 6), MXFP4 "
        "2**floor(log2 amax) with the gain 3) and 'quest' (MXFP4 only: 2**floor(log2(σ · "
        "2.92 / 6)), tails clipped) honoured, with QuTLASS's round-to-nearest-even e2m1; "
        "equal to fp_quant's Triton quantizers except at exact ties, which those round toward "
        "zero (tests/fixtures/fp_quant_0.3.2.pt)",
        "hadamard_group_size": "→ FPQuant(rotation_size): 32, 64, 128 (MXFP4), 16, 32, 64, "
        "128 (NVFP4); None → 16 for NVFP4, 32 for MXFP4, as transformers; layers whose K is "
        "not a multiple are skipped",
        "transform_init": "'hadamard', 'gsr' (Hadamard columns in sequency order), "
        "'identity' → FPQuant(rotation): the g×g matrix in bf16, as FP-Quant builds it; a "
        "checkpoint's own forward_hadamard_matrix is what its layers use",
        "backward_dtype": "accepted, no effect: the gradients' format (bf16, mxfp8, mxfp4) "
        "matters in training only; the forward pass is the same",
        "store_master_weights": "accepted: quantizing from float gives the weights FP-Quant "
        "re-quantizes from its master copy at every step; a checkpoint that holds only "
        "master weights is a float checkpoint (load the model, then quantize with this "
        "config)",
        "pseudoquantization": "accepted: FP-Quant's Triton emulation computes the same "
        "quantizer (ties toward zero instead of to even, the only difference); its "
        "checkpoints store only dequantized bf16 weights (dqweight), which do not fix the "
        "codes and scales, and are refused by the loader (load them as float and quantize)",
        "modules_to_not_convert": SKIP,
    },
}


@maps("fp_quant", FP_QUANT)
def _fp_quant(f: dict[str, Any]) -> QuantConfig:
    cls = "FPQuantConfig"
    dtype = str(f.get("forward_dtype", "nvfp4"))
    if dtype not in FP_QUANT_METHODS:
        raise refuse(cls, "forward_dtype", dtype, "allowed: 'nvfp4', 'mxfp4'")
    method = str(f.get("forward_method", "abs_max"))
    if method not in FP_QUANT_METHODS[dtype]:
        allowed = ", ".join(repr(m) for m in FP_QUANT_METHODS[dtype])
        raise refuse(cls, "forward_method", method, f"allowed with {dtype}: {allowed}")
    size = f.get("hadamard_group_size")
    size = (16 if dtype == "nvfp4" else 32) if size is None else int(size)
    if size not in FP_QUANT_ROTATION_SIZES[dtype]:
        allowed = ", ".join(str(s) for s in FP_QUANT_ROTATION_SIZES[dtype])
        raise refuse(cls, "hadamard_group_size", size, f"allowed with {dtype}: {allowed}")
    rotation = str(f.get("transform_init", "hadamard"))
    if rotation not in FP_QUANT_ROTATIONS:
        raise refuse(cls, "transform_init", rotation, "allowed: 'hadamard', 'gsr', 'identity'")
    scheme = FPQuant(dtype=dtype, method=method, rotation=rotation, rotation_size=size)
    return QuantConfig(scheme=scheme, **not_converted(f))
