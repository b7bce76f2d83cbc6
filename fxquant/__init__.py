"""fxquant: quantization as a compiler pass.

``quantize`` (torch.export → plan → rewrite) returns an ExportedProgram with ``fxquant::`` ops;
``report`` says what happened to each layer; ``aot_compile`` lowers and packages it with
AOTInductor; ``torch.compile(model, backend="fxquant")`` does the same in process, and with a
``Float8Recipe`` trains with FP8 GEMMs (``fp8_state_dict`` / ``load_fp8_state_dict`` keep its
delayed-scaling state).
Importing fxquant registers the ``fxquant::`` ops, which loading a saved ``.pt2`` needs.
"""

from fxquant import ops  # noqa: F401  (registers the fxquant:: ops)
from fxquant.accelerate import from_accelerate
from fxquant.api import aot_compile, quantize
from fxquant.config import (
    RECIPES,
    Float8Block,
    Float8Dynamic,
    Float8Recipe,
    Float8WeightOnly,
    Int4WeightOnly,
    Int8DynamicActivation,
    Int8WeightOnly,
    QuantConfig,
    Scheme,
    from_recipe_name,
)
from fxquant.float8_state import fp8_state_dict, load_fp8_state_dict
from fxquant.hf import from_hf
from fxquant.report import Report, report

__version__ = "0.1.0"

__all__ = [
    "RECIPES",
    "Float8Block",
    "Float8Dynamic",
    "Float8Recipe",
    "Float8WeightOnly",
    "Int4WeightOnly",
    "Int8DynamicActivation",
    "Int8WeightOnly",
    "QuantConfig",
    "Report",
    "Scheme",
    "aot_compile",
    "fp8_state_dict",
    "from_accelerate",
    "from_hf",
    "from_recipe_name",
    "load_fp8_state_dict",
    "quantize",
    "report",
]
