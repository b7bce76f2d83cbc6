"""``MetalConfig`` (``quant_method="metal"``) → ``IntxWeightOnly(zero_point='float',
grid='mlx')``: Apple MLX's affine groups (w = u·scale + bias per group along K), run wherever
fxquant runs, not only on Apple GPUs. Its ``HF_CONFIGS`` entry beside its mapper; checkpoints
in the format (transformers' ``weight`` / ``scales`` / ``qbiases``, or MLX's own files with
``biases``) load through ``fxquant.checkpoints`` (``mlx``)."""

from __future__ import annotations

from typing import Any

from fxquant.core.config import IntxWeightOnly, QuantConfig
from fxquant.hf.base import SKIP, maps, not_converted, refuse

METAL = {
    "class": "MetalConfig",
    "status": "mapped",
    "fields": {
        "bits": "2, 4 → IntxWeightOnly(bits, zero_point='float', grid='mlx'): the group's "
        "[min, max] onto [0, 2**bits - 1], scale (max - min) / (2**bits - 1) floored at 1e-8, "
        "bias = min, round to nearest, as transformers' _affine_quantize_tensor (the same "
        "codes and scales; bias kept as the zero point -bias / scale, equal up to fp32 "
        "rounding; transformers then stores scale and bias in the model's dtype, fxquant in "
        "fp32); 8 refused (fxquant has no grouped 8-bit format with a float zero point)",
        "group_size": "32, 64, 128, 256 honoured (MLX's own are 32, 64, 128); others refused; "
        "layers whose K is not a multiple are skipped",
        "modules_to_not_convert": SKIP,
        "dequantize": "False honoured (the layers run quantized, on CPU and CUDA); True refused: "
        "it asks transformers for a float model, which needs no quantization config",
    },
}


@maps("metal", METAL)
def _metal(f: dict[str, Any]) -> QuantConfig:
    cls = "MetalConfig"
    bits = f.get("bits", 4)
    if bits not in (2, 4):
        raise refuse(
            cls, "bits", bits, "allowed: 2, 4 (fxquant has no grouped 8-bit format with a float "
            "zero point)"
        )  # fmt: skip
    group_size = f.get("group_size", 64)
    if group_size not in (32, 64, 128, 256):
        raise refuse(cls, "group_size", group_size, "allowed: 32, 64, 128, 256")
    if f.get("dequantize", False):
        raise refuse(
            cls, "dequantize", True, "it asks for the float model: load it without a "
            "quantization config"
        )  # fmt: skip
    scheme = IntxWeightOnly(bits=bits, group_size=group_size, zero_point="float", grid="mlx")
    return QuantConfig(scheme=scheme, **not_converted(f))
