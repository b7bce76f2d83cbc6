"""fxquant: quantization as a compiler pass.

``quantize`` (torch.export → plan → rewrite) returns an ExportedProgram with ``fxquant::`` ops;
``report`` says what happened to each layer; ``aot_compile`` lowers and packages it with
AOTInductor; ``torch.compile(model, backend="fxquant")`` does the same in process, and with a
``Float8Recipe`` trains with FP8 GEMMs (``fp8_state_dict`` / ``load_fp8_state_dict`` keep its
delayed-scaling state). ``calibrate`` runs GPTQ, AWQ or SmoothQuant over real data first, then
quantizes.
Importing fxquant registers the ``fxquant::`` ops, which loading a saved ``.pt2`` needs.
"""

from fxquant import ops  # noqa: F401  (registers the fxquant:: ops)
from fxquant.accelerate import from_accelerate
from fxquant.api import aot_compile, quantize
from fxquant.calibrate import AWQ, GPTQ, SmoothQuant, calibrate
from fxquant.checkpoints import load_quantized, read_quantized, save_compressed_tensors
from fxquant.config import (
    MXFP4,
    MXFP8,
    NVFP4,
    RECIPES,
    BitNetTernary,
    Bnb4WeightOnly,
    Float8Block,
    Float8Dynamic,
    Float8Recipe,
    Float8WeightOnly,
    Int4WeightOnly,
    Int8DynamicActivation,
    Int8WeightOnly,
    IntxWeightOnly,
    LLMInt8,
    QuantConfig,
    Scheme,
    from_recipe_name,
)
from fxquant.float8_state import fp8_state_dict, load_fp8_state_dict
from fxquant.hf import calibration_from_hf, from_hf
from fxquant.report import Report, report

__version__ = "0.1.0"

__all__ = [
    "AWQ",
    "GPTQ",
    "RECIPES",
    "BitNetTernary",
    "Bnb4WeightOnly",
    "Float8Block",
    "Float8Dynamic",
    "Float8Recipe",
    "Float8WeightOnly",
    "Int4WeightOnly",
    "Int8DynamicActivation",
    "Int8WeightOnly",
    "IntxWeightOnly",
    "LLMInt8",
    "MXFP4",
    "MXFP8",
    "NVFP4",
    "QuantConfig",
    "Report",
    "Scheme",
    "SmoothQuant",
    "aot_compile",
    "calibrate",
    "calibration_from_hf",
    "fp8_state_dict",
    "from_accelerate",
    "from_hf",
    "from_recipe_name",
    "load_fp8_state_dict",
    "load_quantized",
    "quantize",
    "read_quantized",
    "report",
    "save_compressed_tensors",
]
