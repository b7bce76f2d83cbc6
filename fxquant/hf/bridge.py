"""The Hugging Face bridge: ``from_pretrained(..., quantization_config=FxquantHfConfig(...))``.

Where it sits: transformers builds the model and loads its float weights, then calls this
quantizer, which swaps each ``nn.Linear`` the fxquant config plans for a ``QuantizedLinear``.
That module holds exactly the constants the graph rewrite (``fxquant.passes.rewrite``) would
store and calls the same ``fxquant::`` op through the same declaration (``fxquant.core.scheme``),
so the returned model's forward runs fxquant's quantized ops eagerly, in ``generate``, under
``torch.compile`` (the ops have fake kernels, so the graph compiles whole) and through
``torch.export`` — which yields the same ops on the same constants as ``fxquant.quantize`` on the
float model, and from there ``fxquant.aot_compile`` lowers and packages it.

Saving and reloading: ``save_pretrained`` writes the ``QuantizedLinear`` buffers to safetensors
as they are (``<layer>.qweight``, ``<layer>.scale`` …), ``config.json`` carries
``quantization_config = {"quant_method": "fxquant", "config": {...}}`` and the safetensors header
the report's rows (``fxquant_layers``). ``from_pretrained`` on that folder, with no
``quantization_config`` argument, plans again on the skeleton transformers builds before loading
(on the meta device: names, shapes, which linears hold the same weight tensor, and the float
dtype each linear had when it was quantized, read from the saved rows — never values), checks the
decisions against the saved rows and the checkpoint's tensors against the scheme's exact layout,
and swaps in ``QuantizedLinear``s with empty buffers of that layout for transformers to fill. No
float weight is materialised, and the reloaded model's logits are the saved model's bit for bit.

A weight shared by several linears (tied) is quantized once: the first linear owns the constants
and the others hold the same tensors as non-persistent buffers, so the checkpoint stores them
once and the reload ties them again. transformers' own tie of a quantized linear's ``weight``
(e.g. ``lm_head`` to the embedding) is dropped: that linear no longer has a ``weight``.

Module swapping is what transformers' quantizer interface is built for; fxquant's own path (export,
then rewrite the graph) sees linears a module swap cannot (``F.linear`` on a bare parameter, HF
``Conv1D``), so this bridge covers ``nn.Linear`` and says so in its report. A subclass with a
forward of its own is swapped only where that forward is known to be nn.Linear's math (Falcon's
``FalconLinear``, ``x @ W.T + b``); any other (bitsandbytes' layers, a user's scaled linear) is
reported as skipped, since the swap would drop what its forward does.

Importing this module registers ``quant_method="fxquant"`` with transformers (which it needs);
``import fxquant`` and ``import fxquant.hf`` alone do not import transformers. Its old path,
``fxquant.hf_quantizer``, re-exports it.
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from safetensors import safe_open
from torch import nn
from transformers.quantizers import HfQuantizer
from transformers.quantizers.auto import (
    AUTO_QUANTIZATION_CONFIG_MAPPING,
    AUTO_QUANTIZER_MAPPING,
    register_quantization_config,
    register_quantizer,
)
from transformers.utils.quantization_config import QuantizationConfigMixin

from fxquant.core.config import QuantConfig, Scheme
from fxquant.core.reference import sqnr
from fxquant.core.row import LayerRow
from fxquant.core.scheme import QuantizedWeight, layout_of
from fxquant.hf.bridge_experts import (
    ExpertWeights,
    build_experts_skeleton,
    keep_stacked_on_save,
    quantize_experts,
    unknown_expert_rows,
)
from fxquant.passes.eager import EagerKernels
from fxquant.passes.plan import FLOAT_DTYPES
from fxquant.report import Report

__all__ = ["FxquantHfConfig", "FxquantHfQuantizer", "QuantizedLinear", "quantize_linears"]

QUANT_METHOD = "fxquant"
# safetensors metadata key under which save_pretrained stores the report's rows (JSON)
ROWS_KEY = "fxquant_layers"

# Constant dtypes save_pretrained writes, by their safetensors names: transformers loads each back
# unchanged (integers as stored; floats cast to the empty buffer's dtype, which is their own). A
# scheme whose constants have another dtype is refused at save rather than written unchecked.
_SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.float16: "F16",
    torch.bfloat16: "BF16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.float8_e5m2: "F8_E5M2",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


class QuantizedLinear(nn.Module):
    """An ``nn.Linear`` whose forward is one ``fxquant::`` op on quantized constants (called
    eagerly on CPU, on the CPU lowering's kernels: ``fxquant.passes.eager``).

    The constants are buffers named as the rewrite names them (``qweight``, ``scale`` …), so a
    state dict reads like a quantized ``.pt2``'s and a saved model reloads into the same layout.
    ``persistent=False`` (a linear sharing another's constants) keeps them out of the state dict.
    """

    def __init__(
        self,
        scheme: Scheme,
        weight: QuantizedWeight,
        bias: torch.Tensor | None,
        *,
        in_features: int,
        out_features: int,
        persistent: bool = True,
    ) -> None:
        super().__init__()
        self.scheme = scheme
        self.in_features = in_features
        self.out_features = out_features
        self._constants = list(weight.tensors)
        for name, t in weight.tensors.items():
            self.register_buffer(name, t, persistent=persistent)
        self.bias = None if bias is None else nn.Parameter(bias.detach().clone(), False)
        self._kernels = EagerKernels()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        consts = {n: getattr(self, n) for n in self._constants}
        op, args = self.scheme.op_args(x, consts, self.bias)
        return self._kernels(op, args, (*consts.values(), self.bias))

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.scheme}"


# ---- planning: the decision, from names, shapes and dtypes only --------------------------------


@dataclass
class _Site:
    """One ``nn.Linear`` and what the plan decided for it."""

    name: str
    module: nn.Linear
    scheme: Scheme | None
    row: LayerRow
    # the earlier linear holding the same weight tensor, whose constants this one shares
    owner: str | None


# Subclasses of nn.Linear whose own forward computes nn.Linear's function (checked by the tests
# against the class as installed): swapping them for a QuantizedLinear keeps what they compute.
_LINEAR_FORWARDS = frozenset({"transformers.models.falcon.modeling_falcon.FalconLinear"})


def _own_forward(cls: type) -> str | None:
    """Why a swap cannot take an ``nn.Linear`` of class ``cls``, or None where it can."""
    if cls.forward is nn.Linear.forward or f"{cls.__module__}.{cls.__qualname__}" in (
        _LINEAR_FORWARDS
    ):
        return None
    return (
        f"{cls.__name__} subclasses nn.Linear with a forward of its own, which swapping it for "
        "a QuantizedLinear would drop: export the model and use fxquant.quantize, which "
        "quantizes the linear that forward computes, if it computes one"
    )


def _plan(
    model: nn.Module,
    config: QuantConfig,
    *,
    skeleton: bool = False,
    quantized_from: Mapping[str, torch.dtype] | None = None,
) -> list[_Site]:
    """A site per ``nn.Linear`` of ``model``, with its report row (the numbers that need the
    quantized weight left out).

    Nothing here reads a weight's values, so it decides the same on transformers' meta skeleton
    (``skeleton=True``) as on the loaded model, given two things the skeleton does not show:

    - which linears hold the same weight: the loaded model's tied weights are one tensor; the
      skeleton is built untied (transformers ties after loading), so there its
      ``all_tied_weights_keys`` ({weight: weight it is tied to}) says it;
    - ``quantized_from``: per linear, the dtype its weight had when it was quantized; the
      skeleton's dtype follows ``from_pretrained``'s ``dtype`` argument instead.
    """
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    sites, owners = [], {}  # owners: (weight identity, scheme) → name of the first linear
    for name, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        w = module.weight
        identity = tied.get(f"{name}.weight", f"{name}.weight") if skeleton else id(w)
        dtype = (quantized_from or {}).get(name, w.dtype)
        n, k = w.shape
        scheme, why = config.scheme_for(name)
        if scheme is not None:
            if dtype not in FLOAT_DTYPES:
                problem = f"weight dtype {dtype} is not floating point"
            elif w.device.type == "meta" and not skeleton:
                problem = "weight is on the meta device (not loaded)"
            else:
                problem = scheme.unsupported_reason(out_features=n, in_features=k)
            problem = _own_forward(type(module)) or problem
            if problem is not None:
                scheme, why = None, problem
        row = LayerRow(
            name=name,
            weight=f"{name}.weight",
            node=None,
            kind="nn.Linear",
            in_features=module.in_features,
            out_features=module.out_features,
            dtype=str(dtype).removeprefix("torch."),
            status="skipped" if scheme is None else "quantized",
            scheme=None if scheme is None else scheme.to_dict(),
            reason=why,
            bytes_before=w.numel() * dtype.itemsize,
            bytes_after=w.numel() * dtype.itemsize,
            sqnr_db=None,
        )
        owner = None
        if scheme is not None:
            owner = owners.setdefault((identity, scheme), name)
            if owner == name:
                owner = None
            else:
                row = row.replace(bytes_after=0, shared_with=owner)
        sites.append(_Site(name, module, scheme, row, owner))
    return sites


def _swap(model: nn.Module, site: _Site, weight: QuantizedWeight) -> None:
    new = QuantizedLinear(
        site.scheme,
        weight,
        site.module.bias,
        in_features=site.module.in_features,
        out_features=site.module.out_features,
        persistent=site.owner is None,
    )
    parent_name, _, child = site.name.rpartition(".")
    setattr(model.get_submodule(parent_name), child, new)


def quantize_linears(model: nn.Module, config: QuantConfig | Scheme | str) -> Report:
    """Swap, in place, every ``nn.Linear`` of ``model`` the config gives a scheme for a
    ``QuantizedLinear``, and quantize the experts weights it plans (``bridge_experts``);
    returns the per-layer report (skips say why).

    In place because transformers hands the quantizer a model it has just built; callers with a
    model of their own should use ``fxquant.quantize`` (which never mutates its input). A weight
    shared by several linears is quantized once and its constants shared.
    """
    config = QuantConfig.coerce(config)
    sites = _plan(model, config)
    done: dict[str, QuantizedWeight] = {}
    by_name = {s.name: s for s in sites}
    for site in sites:
        if site.scheme is None:
            continue
        if site.owner is not None:
            q = done[site.owner]
            site.row = site.row.replace(sqnr_db=by_name[site.owner].row.sqnr_db)
        else:
            wf = site.module.weight.detach().float().contiguous()
            q = site.scheme.quantize(wf)
            db = round(sqnr(wf, q.dequantized), 2)
            site.row = site.row.replace(bytes_after=q.nbytes, sqnr_db=db)
            done[site.name] = q
        _swap(model, site, q)
    experts = quantize_experts(model, config)
    keep_stacked_on_save(model, experts)
    rows = [s.row for s in sites] + experts + unknown_expert_rows(model, config)
    return Report(rows=rows, config=config, program_bytes=_bytes(model))


def _bytes(model: nn.Module) -> int:
    seen, total = set(), 0
    for t in [*model.parameters(), *model.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def _untie(model: nn.Module, weights: set[str]) -> None:
    """Drop transformers' ties that involve one of ``weights`` (swapped linears' ``weight``,
    which is gone): left in, ``from_pretrained`` would look that parameter up to tie it."""
    tied = getattr(model, "all_tied_weights_keys", None) or {}
    for target, source in list(tied.items()):
        if target in weights or source in weights:
            del tied[target]


# ---- reloading a saved model: skeleton, checkpoint checks, fill -------------------------------


def _layout(scheme: Scheme, n: int, k: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    # On the CPU: transformers builds the skeleton under a meta default device, where the probe
    # (quantizing zeros) could compute nothing.
    with torch.device("cpu"):
        return layout_of(scheme, (n, k))


def _build_skeleton(
    model: nn.Module, config: QuantConfig, quantized_from: Mapping[str, torch.dtype] | None
) -> tuple[list[_Site], dict[str, tuple[tuple[int, ...], torch.dtype]]]:
    """Swap the planned linears of the (meta) skeleton for ``QuantizedLinear``s whose buffers
    are empty, with the exact layout of the scheme's constants; returns the plan and the layout
    ({buffer name: (shape, dtype)}) of every constant the checkpoint must hold."""
    sites = _plan(model, config, skeleton=True, quantized_from=quantized_from)
    by_shape, owned, layouts = {}, {}, {}
    for site in sites:
        if site.scheme is None:
            continue
        if site.owner is not None:
            tensors = owned[site.owner]
        else:
            n, k = site.module.weight.shape
            key = (site.scheme, n, k)
            if key not in by_shape:  # linears repeat a few shapes: quantize zeros once per shape
                by_shape[key] = _layout(site.scheme, n, k)
            device = site.module.weight.device
            tensors = {
                c: torch.empty(shape, dtype=dtype, device=device)
                for c, (shape, dtype) in by_shape[key].items()
            }
            owned[site.name] = tensors
            layouts.update({f"{site.name}.{c}": layout for c, layout in by_shape[key].items()})
        _swap(model, site, QuantizedWeight(tensors, dequantized=None))
    return sites, layouts


def _read_checkpoint(files: list[str] | None) -> tuple[dict[str, tuple] | None, list | None]:
    """({tensor name: (shape, safetensors dtype, file)}, saved report rows or None) from the
    safetensors headers (no tensor data is read); (None, None) for other formats."""
    if not files or not all(str(f).endswith(".safetensors") for f in files):
        return None, None
    tensors, rows = {}, None
    for f in files:
        with safe_open(f, framework="pt") as h:
            for key in list(h.keys()):  # a safe_open handle is not iterable
                sl = h.get_slice(key)
                tensors[key] = (tuple(sl.get_shape()), sl.get_dtype(), os.path.basename(f))
            meta = h.metadata() or {}
            if rows is None and ROWS_KEY in meta:
                rows = [LayerRow.from_dict(r) for r in json.loads(meta[ROWS_KEY])]
    return tensors, rows


def _lookup(mapping: Mapping[str, Any], key: str, prefix: str) -> Any:
    """``mapping[key]``, allowing for the base-model prefix transformers adds or strips when a
    checkpoint of one head class loads into another (``model.layers.0…`` ↔ ``layers.0…``)."""
    for k in (key, f"{prefix}.{key}", key.removeprefix(f"{prefix}.")):
        if k in mapping:
            return mapping[k]
    return None


def _decision(row: LayerRow) -> tuple:
    return row.status, row.scheme, row.shared_with


def _check_plan(sites: list[_Site], saved: dict[str, LayerRow], prefix: str) -> None:
    """The skeleton's plan is the one the checkpoint was saved with, layer by layer."""
    for site in sites:
        was = _lookup(saved, site.name, prefix)
        if was is not None and _decision(was) != _decision(site.row):
            raise ValueError(
                f"the checkpoint was saved with {site.name!r} {_decision(was)}, but the fxquant "
                f"config in config.json plans {_decision(site.row)} on this model: config.json "
                "and the weights disagree (was one of them edited?)"
            )


def _check_tensors(sites: list[_Site], layouts: dict[str, tuple], found: dict, prefix: str) -> None:
    """Every constant the plan expects (``layouts``: name → shape, dtype) is in the checkpoint
    (``found``: its header) with that shape and dtype."""
    rows = {s.name: s.row for s in sites}
    for key, (shape, dtype) in layouts.items():
        row = rows[key.rpartition(".")[0]]
        what = (
            f"the {row.scheme['type']} constants of a {row.out_features}×{row.in_features} linear"
        )
        want = (tuple(shape), _SAFETENSORS_DTYPES.get(dtype, str(dtype)))
        got = _lookup(found, key, prefix)
        if got is None:
            raise ValueError(
                f"the checkpoint has no tensor {key!r}: the fxquant config in config.json plans "
                f"{what} there, {list(want[0])} {want[1]}"
            )
        if got[:2] != want:
            raise ValueError(
                f"tensor {key!r} in {got[2]} is {list(got[0])} {got[1]}; {what} take "
                f"{list(want[0])} {want[1]}"
            )


def _check_storable(model: nn.Module) -> None:
    for name, module in model.named_modules():
        if not isinstance(module, (QuantizedLinear, ExpertWeights)):
            continue
        for c in module._constants:
            t = getattr(module, c)
            if t.dtype not in _SAFETENSORS_DTYPES:
                raise ValueError(
                    f"cannot save_pretrained {module.scheme}: its constant {name}.{c} has dtype "
                    f"{t.dtype}, which fxquant does not write to a checkpoint yet (it writes "
                    f"{', '.join(str(d).removeprefix('torch.') for d in _SAFETENSORS_DTYPES)}); "
                    "save with fxquant.quantize + torch.export.save instead"
                )


class FxquantHfConfig(QuantizationConfigMixin):
    """``quantization_config`` for ``from_pretrained``: any fxquant config.

    Args:
        config: a ``QuantConfig``, a scheme, a recipe name (``"int8wo"``, ``"int4wo-64"``,
            ``"fp8-row"`` …) or a ``QuantConfig`` dict (as stored in ``config.json``).
    """

    def __init__(self, config: QuantConfig | Scheme | str | dict = "int8wo", **kwargs: Any):
        # config.json's dict comes back as keyword arguments: quant_method with it
        if kwargs.get("quant_method", QUANT_METHOD) == QUANT_METHOD:
            kwargs.pop("quant_method", None)
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
    """Quantizes a float checkpoint as it loads (the float weights load as usual, then
    ``quantize_linears`` swaps the planned linears), or reloads one ``save_pretrained`` wrote
    (the planned linears are swapped before loading, and their buffers load as saved). The
    report is ``model.fxquant_report``."""

    requires_calibration = False

    def __init__(self, quantization_config: FxquantHfConfig, **kwargs: Any) -> None:
        super().__init__(quantization_config, **kwargs)
        self._sites: list[_Site] = []  # the skeleton's plan (reloading only)
        self._experts: list = []  # its experts weights' plan (bridge_experts)
        self._layouts: dict[str, tuple] = {}  # constant → (shape, dtype) it must load as
        self._saved_rows: dict[str, LayerRow] = {}

    def _process_model_before_weight_loading(self, model, checkpoint_files=None, **kwargs):
        if not self.pre_quantized:
            return model  # float weights load first; quantized after loading
        found, rows = _read_checkpoint(checkpoint_files)
        prefix = getattr(model, "base_model_prefix", "")
        saved = self._saved_rows = {r.name: r for r in rows or ()}
        quantized_from = {
            name: getattr(torch, row.dtype)
            for name, m in model.named_modules()
            if isinstance(m, nn.Linear) and (row := _lookup(saved, name, prefix)) is not None
        }
        experts_from = {
            name: getattr(torch, row.dtype)
            for name, p in model.named_parameters()
            if p.dim() == 3 and (row := _lookup(saved, name, prefix)) is not None
        }
        config = self.quantization_config.quant_config
        self._sites, self._layouts = _build_skeleton(model, config, quantized_from)
        self._experts, layouts = build_experts_skeleton(model, config, experts_from)
        self._layouts |= layouts
        _check_plan([*self._sites, *self._experts], saved, prefix)
        if found is not None:
            _check_tensors([*self._sites, *self._experts], self._layouts, found, prefix)
        _untie(model, {s.row.weight for s in self._sites if s.scheme is not None})
        return model

    def _process_model_after_weight_loading(self, model, **kwargs):
        config = self.quantization_config.quant_config
        if not self.pre_quantized:
            model.fxquant_report = quantize_linears(model, config)
            _untie(model, {r.weight for r in model.fxquant_report.quantized})
            return model
        # What transformers loaded must be what the op reads (a dtype policy such as
        # keep_in_fp32 could have cast a constant on the way).
        for key, (shape, dtype) in self._layouts.items():
            t = model.get_buffer(key)
            if t.device.type == "meta" or (tuple(t.shape), t.dtype) != (shape, dtype):
                raise ValueError(
                    f"{key} loaded as {list(t.shape)} {t.dtype} on {t.device}; the fxquant "
                    f"constant must be {list(shape)} {dtype}, loaded from the checkpoint"
                )
        prefix = getattr(model, "base_model_prefix", "")
        for site in self._sites:
            if site.scheme is None:
                continue
            module = model.get_submodule(site.name)
            if site.owner is None:
                nbytes = sum(getattr(module, c).nbytes for c in module._constants)
                site.row = site.row.replace(bytes_after=nbytes)
            else:
                # transformers gave the non-persistent aliases fresh storage: tie them again
                owner = model.get_submodule(site.owner)
                for c in module._constants:
                    setattr(module, c, getattr(owner, c))
            saved = _lookup(self._saved_rows, site.name, prefix)
            site.row = site.row.replace(sqnr_db=None if saved is None else saved.sqnr_db)
        for w in self._experts:
            saved = _lookup(self._saved_rows, w.name, prefix)
            w.row = w.row.replace(sqnr_db=None if saved is None else saved.sqnr_db)
            if w.scheme is not None:
                nbytes = sum(t.nbytes for t in model.get_submodule(w.name).buffers())
                w.row = w.row.replace(bytes_after=nbytes)
        model.fxquant_report = Report(
            rows=[s.row for s in self._sites]
            + [w.row for w in self._experts]
            + unknown_expert_rows(model, config),
            config=config,
            program_bytes=_bytes(model),
        )
        return model

    def get_state_dict_and_metadata(self, model):
        _check_storable(model)
        report = getattr(model, "fxquant_report", None)
        rows = None if report is None else [r.to_dict() for r in report.rows]
        metadata = {} if rows is None else {ROWS_KEY: json.dumps(rows)}
        return None, metadata  # None: transformers takes the model's own state dict

    def is_serializable(self) -> bool:
        return True

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
