"""accelerate's FP8 entry points with fxquant as the engine: where an accelerate user looks.

Where it sits: on the user's model and forward, before ``torch.compile(model, backend="fxquant")``.
accelerate's ``accelerate.utils.transformer_engine`` has four functions that need Transformer
Engine; these are the same four, same signatures, run by fxquant's compiled FP8 training
(``fxquant.training``) and needing neither TE nor a GPU:

=================================  ==========================================================
accelerate (Transformer Engine)    here
=================================  ==========================================================
``convert_model``                  marks ``nn.Linear`` / ``nn.LayerNorm`` as FP8 layers in
                                   place (a class swap keeping the same parameters: lossless,
                                   and an optimizer made before it stays valid); back with
                                   ``to_transformer_engine=False``; returns what it did per
                                   layer. TE swaps in new ``te.Linear`` modules.
``has_transformer_engine_layers``  whether the model has FP8 layers or an FP8-autocast forward
``contextual_fp8_autocast``        the forward wrapper entering ``fxquant.fp8_autocast``
                                   while training (and in eval when ``use_during_eval``)
``apply_fp8_autowrap``             wraps ``model.forward`` with it, the recipe read from a
                                   ``TERecipeKwargs`` / ``AORecipeKwargs``-shaped handler
=================================  ==========================================================

The accelerate loop, with fxquant as its FP8 engine (``Accelerator()`` without
``mixed_precision="fp8"``, which would ask for TE or torchao)::

    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    model = fxquant.accelerate.apply_fp8_autowrap(model, {"fp8_format": "HYBRID"})
    model = torch.compile(model, backend="fxquant")

Under FSDP2 with ``AORecipeKwargs(enable_fsdp_float8_all_gather=True)``, call
``apply_fp8_autowrap`` before ``accelerator.prepare``: the FP8 all-gather wraps the weights
before ``fully_shard`` shards them.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable
from types import MethodType
from typing import Any

import torch.distributed as dist
from torch import nn

from fxquant.core.config import Float8Recipe, QuantConfig
from fxquant.training.accelerate import (
    from_accelerate,
    te_module_filter,
    wants_fsdp_float8_all_gather,
)
from fxquant.training.autocast import fp8_autocast
from fxquant.training.fsdp import enable_fsdp_float8_all_gather
from fxquant.training.layers import Float8Linear, convert_layers, has_fp8_layers

__all__ = [
    "apply_fp8_autowrap",
    "contextual_fp8_autocast",
    "convert_model",
    "fp8_autocast",
    "from_accelerate",
    "has_transformer_engine_layers",
]

# Set on the forward ``contextual_fp8_autocast`` returns, for ``has_transformer_engine_layers``.
_AUTOCAST_MARK = "__fxquant_fp8_autocast__"


def convert_model(
    model: nn.Module,
    to_transformer_engine: bool = True,
    _convert_linear: bool = True,
    _convert_ln: bool = True,
) -> dict[str, str]:
    """Mark ``model``'s ``nn.Linear`` (dims multiples of 16) and ``nn.LayerNorm`` as FP8 layers,
    in place, or turn them back (``to_transformer_engine=False``). Lossless: the layers keep
    their parameters and compute the same forward; what changes is that, once a model has FP8
    layers, only they train in FP8 inside ``fp8_autocast``. Returns ``{layer: what happened}``
    (converted, or skipped and why)."""
    return convert_layers(
        model, to_fp8=to_transformer_engine, linear=_convert_linear, layernorm=_convert_ln
    )


def has_transformer_engine_layers(model: nn.Module) -> bool:
    """Whether ``model`` has FP8 layers (``convert_model``) or a forward wrapped by
    ``contextual_fp8_autocast`` / ``apply_fp8_autowrap``."""
    inner = getattr(model, "_orig_mod", model)
    forward = getattr(inner, "forward", None)
    wrapped = getattr(getattr(forward, "__func__", forward), _AUTOCAST_MARK, False)
    return bool(wrapped) or has_fp8_layers(inner)


def _recipe(obj: Any) -> Float8Recipe | None:
    """A Float8Recipe from what accelerate users pass: one, a config holding one, accelerate's
    recipe kwargs (object or dict), or None (the compile's recipe)."""
    if obj is None or isinstance(obj, Float8Recipe):
        return obj
    config = obj if isinstance(obj, QuantConfig) else from_accelerate(obj)
    if not isinstance(config.scheme, Float8Recipe):
        raise TypeError(f"{obj!r} holds no Float8Recipe (its scheme is {config.scheme!r})")
    return config.scheme


def contextual_fp8_autocast(
    model_forward: Callable, fp8_recipe: Any, use_during_eval: bool = False
) -> Callable:
    """A ``forward(self, *args, **kwargs)`` that runs ``model_forward`` inside
    ``fxquant.fp8_autocast(enabled=use_during_eval or self.training, recipe=fp8_recipe)``: FP8
    while training, high precision in eval unless ``use_during_eval``. ``fp8_recipe`` is a
    ``Float8Recipe``, accelerate recipe kwargs or None. ``__wrapped__`` is ``model_forward``, as
    accelerate's ``extract_model_from_parallel`` expects."""
    recipe = _recipe(fp8_recipe)

    @functools.wraps(model_forward)
    def forward(self, *args, **kwargs):
        with fp8_autocast(enabled=use_during_eval or self.training, recipe=recipe):
            return model_forward(*args, **kwargs)

    forward.__wrapped__ = model_forward
    setattr(forward, _AUTOCAST_MARK, True)
    return forward


def apply_fp8_autowrap(model: nn.Module, fp8_recipe_handler: Any) -> nn.Module:
    """Wrap ``model.forward`` with ``contextual_fp8_autocast``, in place, and return the model.

    ``fp8_recipe_handler``: a ``TERecipeKwargs`` / ``AORecipeKwargs`` (or one's dict), a
    ``Float8Recipe``, or None (``Float8Recipe()``, TE's ``DelayedScaling`` defaults). Its
    ``use_autocast_during_eval`` becomes ``use_during_eval``. The handler also says which linears
    train in FP8 (``TERecipeKwargs``, a ``Float8Recipe`` or None: every Linear with dims
    multiples of 16, as accelerate's TE conversion; ``AORecipeKwargs``: its
    ``module_filter_func``, else accelerate's default: not the first and last Linear): unless
    ``convert_model`` already marked some, those are marked here, as accelerate converts them,
    which is also what lets the region reach them across graph breaks (FSDP2's at every sharded
    module; ``fxquant.training.autocast``). With ``enable_fsdp_float8_all_gather=True``, the FP8
    layers' weights get FSDP2's FP8 all-gather (``fxquant.training.fsdp``): call this before the
    model is sharded, with the process group up (``Accelerator()`` starts it)."""
    accelerate_kwargs = not (
        fp8_recipe_handler is None or isinstance(fp8_recipe_handler, Float8Recipe)
    )
    if accelerate_kwargs:
        config = from_accelerate(fp8_recipe_handler)
        recipe = config.scheme
    else:
        recipe = fp8_recipe_handler or Float8Recipe()
        config = QuantConfig(
            scheme=recipe, modules_to_not_convert=(), module_filter=te_module_filter
        )
    if not has_fp8_layers(model):
        _mark_admitted(model, config)
    if accelerate_kwargs and wants_fsdp_float8_all_gather(fp8_recipe_handler):
        _fp8_all_gather(model, recipe)
    forward = contextual_fp8_autocast(model.forward, recipe, recipe.use_autocast_during_eval)
    if hasattr(model.forward, "__func__"):
        model.forward = MethodType(forward, model)
    else:  # a forward set on the instance (another wrapper): bind it to the model as well
        bound = functools.partial(forward, model)
        setattr(bound, _AUTOCAST_MARK, True)
        model.forward = bound
    return model


def _fp8_all_gather(model: nn.Module, recipe: Float8Recipe) -> None:
    """``enable_fsdp_float8_all_gather=True``: the FP8 all-gather for the FP8 layers' weights,
    which must be wrapped before ``fully_shard`` (as torchao's conversion does them)."""
    if isinstance(model, nn.parallel.DistributedDataParallel):
        # DDP replicates the weights and all-reduces gradients: it has no all-gather to make
        # FP8, and it holds the parameters that wrapping them would replace
        warnings.warn(
            "enable_fsdp_float8_all_gather=True has no effect under DDP (FSDP2 only)",
            stacklevel=3,
        )
        return
    # a sharded parameter is a DTensor (by name: torch builds without distributed lack the class)
    if any(type(p).__name__ == "DTensor" for p in model.parameters()):
        raise ValueError(
            "enable_fsdp_float8_all_gather=True: the model is sharded already (its parameters "
            "are DTensors); call apply_fp8_autowrap before fully_shard / accelerator.prepare"
        )
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        warnings.warn(
            "enable_fsdp_float8_all_gather=True has no effect here: no process group of two or "
            "more ranks is up (create the Accelerator, or init_process_group, first)",
            stacklevel=3,
        )
        return
    # Only the FP8 layers: a high-precision layer's weight must not be rounded to e4m3 on the
    # way. The shard group is the world, as in FSDP2 without a mesh of its own (no HSDP).
    enable_fsdp_float8_all_gather(
        model,
        recipe=recipe,
        world_size=dist.get_world_size(),
        module_filter=lambda module, fqn: isinstance(module, Float8Linear),
    )


def _mark_admitted(model: nn.Module, config: QuantConfig) -> None:
    """Mark as FP8 layers the linears the handler's config admits (its filter, or the first/last
    rule); ``convert_layers`` skips those whose dims are not multiples of 16."""
    from fxquant.passes.float8_regions import region_choice

    linears = [n for n, m in model.named_modules() if type(m) is nn.Linear]
    for name in linears:
        recipe, _ = region_choice(name, config, root=model, linears=linears)
        if recipe is not None:
            convert_layers(model.get_submodule(name), to_fp8=True, layernorm=False)
