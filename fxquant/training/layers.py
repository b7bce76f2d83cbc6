"""FP8 layers: the ``nn.Linear`` / ``nn.LayerNorm`` a model marks for FP8 training, as
accelerate's ``convert_model`` swaps in Transformer Engine's ``te.Linear`` / ``te.LayerNorm``.

Where it sits: on the user's model, before ``torch.compile(model, backend="fxquant")``. The
layers compute exactly what their parents compute (same parameters, same forward), so the swap is
lossless both ways and keeps the ``Parameter`` objects an optimizer already holds. What the mark
changes is which linears an ``fp8_autocast`` region trains in FP8: once a model has FP8 layers,
only they do (``fxquant.passes.float8_regions``), as only ``te.Linear`` does under TE.
``Float8LayerNorm`` changes nothing in the numerics (neither does ``te.LayerNorm``); it marks the
norm as converted, for ``has_fp8_layers``.
"""

from __future__ import annotations

import torch
from torch import nn

from fxquant.training import autocast

__all__ = ["Float8LayerNorm", "Float8Linear", "convert_layers", "has_fp8_layers"]


class Float8Linear(nn.Linear):
    """An ``nn.Linear`` that trains in FP8 inside an ``fp8_autocast`` region of a compiled
    forward (and in high precision elsewhere).

    Its forward is ``nn.Linear``'s; traced by Dynamo inside a region entered outside the graph
    (the region's forward broke the graph, as FSDP2 makes it), it annotates itself with that
    region (``fxquant.training.autocast``)."""

    def forward(self, x):
        region = autocast.ambient() if torch.compiler.is_compiling() else None
        if region is None:
            return super().forward(x)
        with torch.fx.traceback.annotate({autocast.AMBIENT: region}):
            return super().forward(x)


class Float8LayerNorm(nn.LayerNorm):
    """An ``nn.LayerNorm`` marked by ``convert_model``: its numerics are ``nn.LayerNorm``'s."""


_TO_FP8 = {nn.Linear: Float8Linear, nn.LayerNorm: Float8LayerNorm}
_FROM_FP8 = {v: k for k, v in _TO_FP8.items()}


def _why_not(module: nn.Module) -> str | None:
    if isinstance(module, nn.Linear) and (module.in_features % 16 or module.out_features % 16):
        return (
            f"dims {module.out_features}x{module.in_features} are not multiples of 16 "
            "(FP8 GEMMs need them)"
        )
    return None


def convert_layers(
    model: nn.Module, *, to_fp8: bool, linear: bool = True, layernorm: bool = True
) -> dict[str, str]:
    """Swap the class of each ``nn.Linear`` / ``nn.LayerNorm`` of ``model`` to its FP8 layer
    (``to_fp8``) or back, in place; ``{name: what happened}`` for every layer considered.

    Only the exact classes are swapped: a subclass may compute something else in its forward,
    so it is left as it is and reported."""
    kinds = tuple(k for k, on in ((nn.Linear, linear), (nn.LayerNorm, layernorm)) if on)
    table = _TO_FP8 if to_fp8 else _FROM_FP8
    done: dict[str, str] = {}
    for name, module in model.named_modules():
        if not isinstance(module, kinds):
            continue
        cls = type(module)
        if cls in table:
            why = _why_not(module) if to_fp8 else None
            if why is None:
                module.__class__ = table[cls]
                done[name] = f"{cls.__name__} -> {table[cls].__name__}"
            else:
                done[name] = "skipped: " + why
        elif to_fp8 and cls not in _FROM_FP8:
            done[name] = (
                f"skipped: {cls.__name__} subclasses {cls.__mro__[1].__name__}; its forward may "
                "differ, so it is not swapped"
            )
    return done


def has_fp8_layers(model: nn.Module) -> bool:
    """Whether ``model`` (or its ``torch.compile`` wrapper) has FP8 layers."""
    model = getattr(model, "_orig_mod", model)
    return any(isinstance(m, (Float8Linear, Float8LayerNorm)) for m in model.modules())


def fp8_linear_names(root: nn.Module | None) -> set[str] | None:
    """The names of ``root``'s ``Float8Linear`` layers, or None when it has none (then every
    linear may train in FP8)."""
    if root is None:
        return None
    names = {n for n, m in root.named_modules() if isinstance(m, Float8Linear)}
    return names or None
