"""fxquant: quantization as a compiler pass.

``quantize`` (torch.export → plan → rewrite → fuse) returns an ExportedProgram with ``fxquant::``
ops; ``report`` says what happened to each layer; ``aot_compile`` lowers and packages it with
AOTInductor; ``torch.compile(model, backend="fxquant")`` does the same in process, and with a
``Float8Recipe`` trains with FP8 GEMMs (``fp8_state_dict`` / ``load_fp8_state_dict`` keep its
delayed-scaling state). ``calibrate`` runs GPTQ, AWQ, SmoothQuant or AutoRound over real data
first, then quantizes. ``export_llm`` captures a causal LM with its KV cache (prefill and decode
in one program) and ``generate`` serves its package (``fxquant.runtime``: torch only). Importing
fxquant registers the ``fxquant::`` ops, which loading a saved ``.pt2`` needs.
"""

import importlib
import sys
import types
from typing import TYPE_CHECKING

from fxquant.core import ops  # noqa: F401  (registers the fxquant:: ops and declares the schemes)
from fxquant.core.scheme import SCHEMES

# Everything else loads on first use (PEP 562), so a process that only serves a package
# (``fxquant generate``, ``fxquant.runtime``) never imports the passes, and ``import fxquant``
# stays as cheap as registering the ops.
_EXPORTS = {
    "from_accelerate": "fxquant.training.accelerate",
    "fp8_autocast": "fxquant.training.autocast",
    "aot_compile": "fxquant.api",
    "quantize": "fxquant.api",
    "AWQ": "fxquant.calibration.methods",
    "GPTQ": "fxquant.calibration.methods",
    "SmoothQuant": "fxquant.calibration.methods",
    "AutoRound": "fxquant.calibration.methods",
    "calibrate": "fxquant.calibration.api",
    "load_quantized": "fxquant.checkpoints",
    "read_quantized": "fxquant.checkpoints",
    "save_compressed_tensors": "fxquant.checkpoints",
    "fp8_state_dict": "fxquant.training.state",
    "load_fp8_state_dict": "fxquant.training.state",
    "calibration_from_hf": "fxquant.hf",
    "from_hf": "fxquant.hf",
    "export_llm": "fxquant.llm",
    "llm_info": "fxquant.llm",
    "Report": "fxquant.report",
    "report": "fxquant.report",
    "load_program": "fxquant.safe_load",
    "LLMPackage": "fxquant.runtime",
    "generate": "fxquant.runtime",
    "QuantConfig": "fxquant.core.config",
    "RECIPES": "fxquant.core.scheme",
    "Scheme": "fxquant.core.scheme",
    "from_recipe_name": "fxquant.core.scheme",
    "reference_math": "fxquant.passes.eager",
}
# Every declared scheme class (fxquant/core/schemes/), from its own module: a new scheme is a
# public name with no line here.
_EXPORTS.update({name: cls.__module__ for name, cls in SCHEMES.items()})


class _Package(types.ModuleType):
    """fxquant itself. The submodule ``fxquant.report`` shares its name with the function it
    defines; importing the submodule binds it on the package, which would shadow the function:
    here the function keeps its name."""

    def __setattr__(self, name: str, value) -> None:
        if name == "report" and isinstance(value, types.ModuleType):
            return  # the submodule stays reachable as sys.modules["fxquant.report"]
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    try:  # a submodule: fxquant.api, fxquant.passes, …
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module 'fxquant' has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))


if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly (the table
    # above is what runs; ruff's F401 cannot see that __all__ lists them)
    from fxquant.api import aot_compile, quantize  # noqa: F401
    from fxquant.calibration.api import calibrate  # noqa: F401
    from fxquant.calibration.methods import AWQ, GPTQ, AutoRound, SmoothQuant  # noqa: F401
    from fxquant.checkpoints import load_quantized, read_quantized, save_compressed_tensors  # noqa: F401
    from fxquant.core.config import QuantConfig  # noqa: F401
    from fxquant.core.scheme import RECIPES, Scheme, from_recipe_name  # noqa: F401
    from fxquant.core.schemes import *  # noqa: F403  (the scheme classes)
    from fxquant.hf import calibration_from_hf, from_hf  # noqa: F401
    from fxquant.llm import export_llm, llm_info  # noqa: F401
    from fxquant.passes.eager import reference_math  # noqa: F401
    from fxquant.report import Report, report  # noqa: F401
    from fxquant.runtime import LLMPackage, generate  # noqa: F401
    from fxquant.training.accelerate import from_accelerate  # noqa: F401
    from fxquant.training.autocast import fp8_autocast  # noqa: F401
    from fxquant.training.state import fp8_state_dict, load_fp8_state_dict  # noqa: F401

from fxquant.version import __version__ as __version__  # noqa: E402  (re-exported)

__all__ = sorted(_EXPORTS)  # noqa: PLE0605  (built from the table above)
