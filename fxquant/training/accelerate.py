"""``from_accelerate``: accelerate's FP8 recipe objects (``TERecipeKwargs``, ``AORecipeKwargs``,
the deprecated ``FP8RecipeKwargs``) or their dicts → a ``QuantConfig`` with a ``Float8Recipe``.

Where it sits: before everything else, beside ``fxquant.core.config``: it only builds a config,
which then goes to ``torch.compile(model, backend="fxquant", options={"config": cfg})``. accelerate
and torchao are not imported (their objects are read by attribute), so neither is a dependency.

How each field is honoured is the table in docs/fp8_training.md (``TE_FIELDS`` and ``AO_FIELDS``
below hold the same, and the tests check both cover every field). Where accelerate's documented
behaviour and what it actually ran differ, we do the documented thing and warn.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable, Mapping
from typing import Any

import torch

from fxquant.core.config import Float8Recipe, QuantConfig

__all__ = ["AO_FIELDS", "TE_FIELDS", "from_accelerate", "handler_kind", "te_module_filter"]

# accelerate ≥ 1.10: field → how fxquant honours it (docs/fp8_training.md shows this table).
TE_FIELDS = {
    "use_autocast_during_eval": "Float8Recipe.use_autocast_during_eval",
    "margin": "Float8Recipe.margin",
    "interval": "accepted; != 1 warns and is ignored (TE never implemented it)",
    "fp8_format": "Float8Recipe.fp8_format; 'E5M2' is rejected with a reason, as TE does",
    "amax_history_len": "Float8Recipe.amax_history_len",
    "amax_compute_algo": "Float8Recipe.amax_compute_algo as documented (default 'most_recent'); "
    "warns that accelerate never forwarded it, so TE ran 'max'",
    "override_linear_precision": "Float8Recipe.override_linear_precision, all three flags "
    "(TE honoured only wgrad; fprop/dgrad warn)",
    "use_mxfp8_block_scaling": "True → Float8Recipe(scaling='mxfp8'), else scaling='delayed'",
}
AO_FIELDS = {
    "config": "None → current per-tensor scaling (accelerate's default Float8LinearConfig); a "
    "torchao Float8LinearConfig, its dict or a recipe name ('tensorwise', 'rowwise', "
    "'rowwise_with_gw_hp') → scaling='current', granularity from cast_config_input, fp8_format "
    "from cast_config_grad_output, wgrad in high precision when its casts are disabled",
    "module_filter_func": "QuantConfig.module_filter; None → skip the first and last Linear",
    "pad_inner_dim": "Float8Recipe.pad_inner_dim (default True)",
    "enable_fsdp_float8_all_gather": "True: apply_fp8_autowrap, called before the model is "
    "sharded (fully_shard, or accelerator.prepare with FSDP2) in a process group of two or more "
    "ranks, sets up the FP8 all-gather of the linears that train in FP8 "
    "(fxquant.training.fsdp; current tensorwise scaling only); from_accelerate returns a "
    "config, which has no place for it",
}
# torchao Float8LinearConfig fields read through "config" (the rest of the table in the docs).
_AO_RECIPE_NAMES = {
    "tensorwise": {"granularity": "tensor", "fp8_format": "HYBRID", "wgrad_hp": False},
    "rowwise": {"granularity": "row", "fp8_format": "E4M3", "wgrad_hp": False},
    "rowwise_with_gw_hp": {"granularity": "row", "fp8_format": "E4M3", "wgrad_hp": True},
}
_TE_DEFAULTS = {
    "use_autocast_during_eval": False,
    "margin": 0,
    "interval": 1,
    "fp8_format": "HYBRID",
    "amax_history_len": 1024,
    "amax_compute_algo": "most_recent",
    "override_linear_precision": (False, False, False),
    "use_mxfp8_block_scaling": False,
}


def te_module_filter(module: torch.nn.Module, fqn: str) -> bool:
    """accelerate's TE conversion: every ``nn.Linear`` (its dims must divide by 16, which
    ``pad_inner_dim=False`` enforces), first and last included."""
    return isinstance(module, torch.nn.Linear)


def _fields(obj: Any) -> dict[str, Any]:
    if isinstance(obj, Mapping):
        return dict(obj)
    if dataclasses.is_dataclass(obj):
        return {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj)}
    return {k: v for k, v in vars(obj).items() if not k.startswith("_")}


def _kind(obj: Any, fields: dict[str, Any], kind: str | None) -> str:
    if kind is not None:
        if kind not in ("te", "ao"):
            raise ValueError(
                f"from_accelerate(kind={kind!r}) is not supported; allowed: 'te', 'ao'"
            )
        return kind
    name = type(obj).__name__
    if name in ("TERecipeKwargs", "FP8RecipeKwargs"):
        return "te"
    if name == "AORecipeKwargs":
        return "ao"
    keys = set(fields)
    if keys and keys <= set(TE_FIELDS) | {"backend"}:
        return "te"
    if keys and keys <= set(AO_FIELDS):
        return "ao"
    raise ValueError(
        f"from_accelerate cannot tell what {obj!r} is: pass a TERecipeKwargs / AORecipeKwargs "
        f"object, or a dict with TE fields ({', '.join(TE_FIELDS)}) or AO fields "
        f"({', '.join(AO_FIELDS)}), or say kind='te' / kind='ao'"
    )


def handler_kind(obj: Any) -> str:
    """'te' or 'ao': which of accelerate's recipe kwargs ``obj`` is (object or dict)."""
    return _kind(obj, _fields(obj), None)


def wants_fsdp_float8_all_gather(obj: Any) -> bool:
    """Whether accelerate's recipe kwargs ``obj`` ask for the FP8 all-gather under FSDP2
    (``AORecipeKwargs(enable_fsdp_float8_all_gather=True)``)."""
    return bool(_fields(obj).get("enable_fsdp_float8_all_gather"))


def from_accelerate(obj: Any, *, kind: str | None = None) -> QuantConfig:
    """The fxquant config for an accelerate FP8 recipe (object or dict; ``kind`` disambiguates
    an empty or mixed dict). TE recipes convert every ``nn.Linear`` with dims divisible by 16,
    as accelerate's TE conversion does; AO recipes skip the first and last Linear unless
    ``module_filter_func`` says otherwise."""
    fields = _fields(obj)
    which = _kind(obj, fields, kind)
    known, cls = (TE_FIELDS, "TERecipeKwargs") if which == "te" else (AO_FIELDS, "AORecipeKwargs")
    unknown = set(fields) - set(known) - {"backend"}
    if unknown:
        raise ValueError(
            f"from_accelerate: {sorted(unknown)} are not {cls} fields; known: {', '.join(known)}"
        )
    return _from_te(fields) if which == "te" else _from_ao(fields)


def _from_te(fields: dict[str, Any]) -> QuantConfig:
    backend = str(fields.get("backend") or "TE").upper()
    if backend != "TE":
        raise ValueError(
            f"FP8RecipeKwargs(backend={backend!r}) is not supported; allowed: 'TE' (MS-AMP's "
            "O1/O2 optimizer-state recipes are not FP8 GEMM recipes)"
        )
    f = {k: (_TE_DEFAULTS[k] if fields.get(k) is None else fields[k]) for k in TE_FIELDS}
    algo = str(f["amax_compute_algo"]).lower()
    if algo == "most_recent":
        warnings.warn(
            "amax_compute_algo='most_recent' (accelerate's documented default) is what fxquant "
            "runs; accelerate never passed it on, so the same kwargs under accelerate + "
            "Transformer Engine ran TE's default 'max'",
            stacklevel=3,
        )
    recipe = Float8Recipe(
        scaling="mxfp8" if f["use_mxfp8_block_scaling"] else "delayed",
        fp8_format=str(f["fp8_format"]).upper(),
        margin=int(f["margin"]),
        amax_history_len=int(f["amax_history_len"]),
        amax_compute_algo=algo,
        interval=int(f["interval"]),
        override_linear_precision=tuple(bool(v) for v in f["override_linear_precision"]),
        use_autocast_during_eval=bool(f["use_autocast_during_eval"]),
        pad_inner_dim=False,  # TE pads nothing: a Linear whose dims don't divide by 16 stays
    )
    return QuantConfig(scheme=recipe, modules_to_not_convert=(), module_filter=te_module_filter)


def _attr(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _value(v: Any) -> str:
    """An enum (torchao's ScalingType / ScalingGranularity), its name or its value → lowercase."""
    return str(getattr(v, "value", v)).lower()


def _from_torchao_config(config: Any) -> dict[str, Any]:
    if isinstance(config, str):
        if config not in _AO_RECIPE_NAMES:
            raise ValueError(
                f"AORecipeKwargs config recipe {config!r} is not supported; allowed: "
                + ", ".join(_AO_RECIPE_NAMES)
            )
        return dict(_AO_RECIPE_NAMES[config], pad_inner_dim=None, emulate=False)
    cast_in = _attr(config, "cast_config_input")
    grad = _attr(config, "cast_config_grad_output")
    for name in ("cast_config_input", "cast_config_weight", "cast_config_grad_output"):
        st = _value(_attr(_attr(config, name), "scaling_type", "dynamic"))
        if st != "dynamic":
            raise ValueError(
                f"Float8LinearConfig.{name}.scaling_type={st!r} is not supported; allowed: "
                "'dynamic' (torchao's delayed and static scaling were removed; use "
                "TERecipeKwargs for delayed scaling)"
            )
    gran = _value(_attr(cast_in, "scaling_granularity", "tensorwise"))
    if gran not in ("tensorwise", "axiswise"):
        raise ValueError(
            f"Float8LinearConfig scaling_granularity={gran!r} is not supported; allowed: "
            "'tensorwise', 'axiswise'"
        )
    target = _attr(grad, "target_dtype")
    e4m3 = target in (torch.float8_e4m3fn, "float8_e4m3fn", "torch.float8_e4m3fn")
    wgrad_hp = any(
        _value(_attr(_attr(config, n), "scaling_type", "dynamic")) == "disabled"
        for n in ("cast_config_input_for_grad_weight", "cast_config_grad_output_for_grad_weight")
    )
    if _attr(config, "round_scales_to_power_of_2", False):
        warnings.warn(
            "Float8LinearConfig.round_scales_to_power_of_2=True is not honoured: fxquant's "
            "current scaling uses amax / fp8_max exactly (use scaling='mxfp8' for power-of-two "
            "scales)",
            stacklevel=4,
        )
    return {
        "emulate": bool(_attr(config, "emulate", False)),
        "granularity": "row" if gran == "axiswise" else "tensor",
        "fp8_format": "E4M3" if e4m3 else "HYBRID",
        "wgrad_hp": wgrad_hp,
        "pad_inner_dim": _attr(config, "pad_inner_dim"),
    }


def _from_ao(fields: dict[str, Any]) -> QuantConfig:
    config = fields.get("config")
    parsed = (
        {
            "granularity": "tensor",
            "fp8_format": "HYBRID",
            "wgrad_hp": False,
            "pad_inner_dim": None,
            "emulate": False,
        }
        if config is None
        else _from_torchao_config(config)
    )
    pad = fields.get("pad_inner_dim")
    if pad is None:
        pad = parsed["pad_inner_dim"] if parsed["pad_inner_dim"] is not None else True
    recipe = Float8Recipe(
        scaling="current",
        granularity=parsed["granularity"],
        fp8_format=parsed["fp8_format"],
        override_linear_precision=(False, False, parsed["wgrad_hp"]),
        pad_inner_dim=bool(pad),
        emulate=parsed["emulate"],
    )
    module_filter: Callable | None = fields.get("module_filter_func")
    return QuantConfig(scheme=recipe, modules_to_not_convert=(), module_filter=module_filter)
