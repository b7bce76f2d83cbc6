"""The Hugging Face bridge: ``from_pretrained(..., quantization_config=FxquantHfConfig(...))``.

Where it sits: transformers builds the model and loads its float weights, then calls this
quantizer, which swaps each ``nn.Linear`` the fxquant config plans for a ``QuantizedLinear``.
That module holds exactly the constants the graph rewrite (``fxquant.passes.rewrite``) would
store and calls the same ``fxquant::`` op through the same handler (``fxquant.passes.schemes``),
so the returned model's forward runs fxquant's quantized ops eagerly, in ``generate``, under
``torch.compile`` (the ops have fake kernels, so the graph compiles whole) and through
``torch.export`` — which yields the same ops on the same constants as ``fxquant.quantize`` on the
float model, and from there ``fxquant.aot_compile`` lowers and packages it.

Module swapping is what transformers' quantizer interface is built for; fxquant's own path (export,
then rewrite the graph) sees linears a module swap cannot (``F.linear`` on a bare parameter, HF
``Conv1D``), so this bridge covers ``nn.Linear`` and says so in its report.

Importing this module registers ``quant_method="fxquant"`` with transformers (which it needs);
``import fxquant`` alone does not import transformers.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.utils.quantization_config import QuantizationConfigMixin

from fxquant.config import QuantConfig, Scheme
from fxquant.passes.plan import FLOAT_DTYPES
from fxquant.passes.schemes import QuantizedWeight, handler_for
from fxquant.reference import sqnr
from fxquant.report import Report

__all__ = ["FxquantHfConfig", "FxquantHfQuantizer", "QuantizedLinear", "quantize_linears"]

QUANT_METHOD = "fxquant"


class QuantizedLinear(nn.Module):
    """An ``nn.Linear`` whose forward is one ``fxquant::`` op on quantized constants.

    The constants are buffers named as the rewrite names them (``qweight``, ``scale`` …), so a
    state dict reads like a quantized ``.pt2``'s and a saved model reloads into the same layout.
    """

    def __init__(
        self, scheme: Scheme, weight: QuantizedWeight, bias: torch.Tensor | None, *, in_features
    ) -> None:
        super().__init__()
        self.scheme = scheme
        self.in_features = in_features
        self._constants = list(weight.tensors)
        for name, t in weight.tensors.items():
            self.register_buffer(name, t)
        first = weight.tensors[self._constants[0]]
        self.out_features = first.shape[0]
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        consts = [getattr(self, n) for n in self._constants]
        op, args = handler_for(self.scheme).op_args(self.scheme, x, consts, self.bias)
        return op(*args)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme}"


def _problem(module: nn.Linear, scheme: Scheme) -> str | None:
    """Why this linear cannot take the scheme (the module-level twin of the planner's check)."""
    if module.weight.dtype not in FLOAT_DTYPES:
        return f"weight dtype {module.weight.dtype} is not floating point"
    if module.weight.device.type == "meta":
        return "weight is on the meta device (not loaded)"
    n, k = module.weight.shape
    return scheme.unsupported_reason(out_features=n, in_features=k)


def quantize_linears(model: nn.Module, config: QuantConfig | Scheme | str) -> Report:
    """Swap, in place, every ``nn.Linear`` of ``model`` the config gives a scheme for a
    ``QuantizedLinear``; returns the per-layer report (skips say why).

    In place because transformers hands the quantizer a model it has just built; callers with a
    model of their own should use ``fxquant.quantize`` (which never mutates its input). A weight
    shared by several linears is quantized once and its constants shared.
    """
    config = QuantConfig.coerce(config)
    rows, done = [], {}  # done: (id(weight), scheme) → (QuantizedWeight, first row)
    for name, module in list(model.named_modules()):
        if type(module) is not nn.Linear:
            continue
        w = module.weight
        row = {
            "name": name,
            "weight": f"{name}.weight",
            "node": None,
            "kind": "nn.Linear",
            "in_features": module.in_features,
            "out_features": module.out_features,
            "dtype": str(w.dtype).removeprefix("torch."),
            "bytes_before": w.numel() * w.element_size(),
            "bytes_after": w.numel() * w.element_size(),
            "sqnr_db": None,
        }
        scheme, why = config.scheme_for(name)
        if scheme is not None:
            problem = _problem(module, scheme)
            if problem is not None:
                scheme, why = None, problem
        row.update(
            status="skipped" if scheme is None else "quantized",
            scheme=None if scheme is None else scheme.to_dict(),
            reason=why,
        )
        if scheme is not None:
            key = (id(w), scheme)
            if key in done:
                q, first = done[key]
                row.update(bytes_after=0, sqnr_db=first["sqnr_db"], shared_with=first["name"])
            else:
                wf = w.detach().float().contiguous()
                q = handler_for(scheme).quantize(scheme, wf)
                row.update(bytes_after=q.nbytes, sqnr_db=round(sqnr(wf, q.dequantized), 2))
                done[key] = (q, row)
            new = QuantizedLinear(scheme, q, module.bias, in_features=module.in_features)
            parent_name, _, child = name.rpartition(".")
            setattr(model.get_submodule(parent_name), child, new)
        rows.append(row)
    return Report(rows=rows, config=config, program_bytes=_bytes(model))


def _bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


class FxquantHfConfig(QuantizationConfigMixin):
    """``quantization_config`` for ``from_pretrained``: any fxquant config.

    Args:
        config: a ``QuantConfig``, a scheme, a recipe name (``"int8wo"``, ``"int4wo-64"``,
            ``"fp8-row"`` …) or a ``QuantConfig`` dict (as stored in ``config.json``).
    """

    def __init__(self, config: QuantConfig | Scheme | str | dict = "int8wo", **kwargs: Any):
        if kwargs:
            raise TypeError(
                f"FxquantHfConfig takes one argument, config; unknown {sorted(kwargs)} "
                "(put scheme options in the fxquant config itself)"
            )
        self.quant_method = QUANT_METHOD
        if isinstance(config, dict):
            config = QuantConfig.from_dict(config)
        elif not isinstance(config, (QuantConfig, Scheme, str)):
            raise TypeError(
                "FxquantHfConfig(config=...) takes a QuantConfig, a scheme, a recipe name or a "
                f"QuantConfig dict, got {type(config).__name__}"
            )
        # Stored as a plain dict: transformers writes this object into config.json.
        self.config = QuantConfig.coerce(config).to_dict()

    @property
    def quant_config(self) -> QuantConfig:
        return QuantConfig.from_dict(self.config)

    def to_dict(self) -> dict[str, Any]:
        return {"quant_method": QUANT_METHOD, "config": self.config}


class FxquantHfQuantizer(HfQuantizer):
    """Quantizes a float checkpoint as it loads: the float weights load as usual, then
    ``quantize_linears`` swaps the planned linears. The report is ``model.fxquant_report``."""

    requires_calibration = False

    def __init__(self, quantization_config: FxquantHfConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        if self.pre_quantized:
            # A checkpoint saved from a quantized model: its buffers have no float weight to
            # start from, and rebuilding empty QuantizedLinears before loading is not done yet.
            raise NotImplementedError(
                "loading a checkpoint that was saved already quantized with fxquant is not "
                "supported yet; load the float checkpoint with "
                "quantization_config=FxquantHfConfig(...), or save with fxquant.quantize + "
                "torch.export.save"
            )

    def _process_model_after_weight_loading(self, model, **kwargs):
        model.fxquant_report = quantize_linears(model, self.quantization_config.quant_config)
        return model

    def is_serializable(self) -> bool:
        return False

    @property
    def is_trainable(self) -> bool:
        return False

    @property
    def is_compileable(self) -> bool:
        return True


# Register once (re-importing this module, e.g. under importlib.reload, must not fail).
if QUANT_METHOD not in AUTO_QUANTIZATION_CONFIG_MAPPING:
    register_quantization_config(QUANT_METHOD)(FxquantHfConfig)
if QUANT_METHOD not in AUTO_QUANTIZER_MAPPING:
    register_quantizer(QUANT_METHOD)(FxquantHfQuantizer)
