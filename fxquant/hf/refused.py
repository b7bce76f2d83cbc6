"""The Hugging Face configs fxquant refuses whole, each with why: ``from_hf`` raises
``NotImplementedError`` with that reason, and docs/hf_configs.md prints it. A method moves out of
here into its own module when a mapping for it is built."""

from __future__ import annotations

from fxquant.hf.base import refuses

refuses(
    "aqlm",
    "AqlmConfig",
    "AQLM learns its additive codebooks over hours of calibration (the aqlm package), which "
    "fxquant does not do, so a float model is not quantized to it: "
    "`fxquant.load_quantized(ep, path)` loads AQLM checkpoints (the 1x16 and 2x8 formats, one "
    "output row a group) exactly, and runs them with the weight decoded from its codebooks",
)

refuses(
    "vptq",
    "VptqConfig",
    "VPTQ's vector codebooks come from hours of Hessian-weighted k-means (the vptq package), "
    "which fxquant does not run, so a float model is not quantized to it: "
    "`fxquant.load_quantized(ep, path)` loads VPTQ checkpoints (packed indices, residual "
    "codebooks, outlier columns, permutation and column scales) and runs them with the "
    "weight decoded from its codebooks",
)

refuses(
    "spqr",
    "SpQRConfig",
    "SpQR finds its outliers and rounding with its own calibration (the SpQR repository), which "
    "fxquant does not run, so a float model is not quantized to it: "
    "`fxquant.load_quantized(ep, path)` loads SpQR checkpoints (3-bit 16×16 bilevel tiles, CSR "
    "or PTCSR fp16 outliers, the input permutation) and runs them with the weight decoded per "
    "call",
)

refuses(
    "quark",
    "QuarkConfig",
    "a Quark config describes a finished export (its static activation scales and AWQ / GPTQ "
    "rounding come from Quark's own calibration), not a way to quantize a float model: "
    "`fxquant.load_quantized(ep, path)` loads Quark checkpoints layer by layer (fp8 per "
    "tensor / channel with dynamic or static inputs, int8, int4 / uint4 groups, MXFP4), "
    "refusing output / KV-cache quantization, fp6, NVFP4 and rotations with the reason",
)

refuses(
    "gguf",
    "GgufConfig",
    "GGUF is a checkpoint format, not a way to quantize a float model: "
    "`fxquant.load_quantized(ep, 'model.gguf')` loads Q4_0, Q6_K and Q8_0 exactly and Q4_1 / "
    "Q4_K with float zero points into fxquant constants (5-bit types refused: no 5-bit "
    "format); `fxquant quantize model.gguf` dequantizes and requantizes instead",
)
