"""Where each ``fxquant::`` op's per-device implementation is found: by the op's name.

Part of the core vocabulary. A lowering is registered where it is written, next to the
kernel it calls (``kernels/<scheme>.py`` for CUDA) or in the CPU lowering of its scheme family
(``fxquant.passes``), with ``@lowering("cuda", "int8_weight_only_linear")``; the lowering pass
(``fxquant.passes.lower``) reads the table for its device. An implementation takes the op's
arguments by the op's own argument names (it is called as a decomposition of that op).
"""

from __future__ import annotations

from collections.abc import Callable

import torch

__all__ = ["LOWERINGS", "lowering", "lowering_table"]

# device ("cpu", "cuda", …) → op name (``fxquant::<name>``) → implementation
LOWERINGS: dict[str, dict[str, Callable]] = {}


def lowering(device: str, *op_names: str) -> Callable[[Callable], Callable]:
    """Register the decorated function as ``device``'s implementation of each
    ``fxquant::<op_name>``. Registering one op twice for a device is an error (two modules
    would race for it)."""

    def wrap(fn: Callable) -> Callable:
        table = LOWERINGS.setdefault(device, {})
        for name in op_names:
            if name in table and table[name] is not fn:
                raise RuntimeError(
                    f"fxquant::{name} already has a {device} lowering "
                    f"({table[name].__module__}.{table[name].__qualname__})"
                )
            table[name] = fn
        return fn

    return wrap


def lowering_table(device: str) -> dict[torch._ops.OpOverload, Callable]:
    """``{fxquant::<name>.default: implementation}`` for every op registered for ``device``."""
    ops = torch.ops.fxquant
    return {getattr(ops, name).default: fn for name, fn in LOWERINGS.get(device, {}).items()}
