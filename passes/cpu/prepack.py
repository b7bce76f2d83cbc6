"""Prepack rules, registered by op name: where a CPU kernel wants its own weight layout, the
rule that converts an op's constants once, at lowering time, and the device op that takes them.

Where it sits: below every family module of ``fxquant.passes.cpu``, which register their rules
here with ``@prepack_rule(device, op_name, consts=...)`` next to the kernels the rules feed;
the lowering pass (``fxquant.passes.lower.prepack``) reads ``prepack_table(device)``. The device
is ``"cpu"`` (aten kernels) or ``"cpu-native"`` (fxquant's own, ``fxquant.kernels.cpu``); each is
a whole table: where the native kernels serve, the aten rules do not apply.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor

__all__ = [
    "PREPACK",
    "PrepackRule",
    "is_new_constant",
    "prepack_rule",
    "prepack_table",
    "unique_name",
]


@dataclass(frozen=True)
class PrepackRule:
    """Rewrite one semantic op to its device op on prepacked constants, once, at lowering.

    ``rule(node, args, consts)`` gets the node, its arguments by the op's names and the values
    of ``consts`` by name; it returns ``(device op, device args)``, where an argument
    ``(name, tensor)`` is a new constant (stored once per weight, named after it).
    """

    rule: Callable[[fx.Node, Mapping[str, Any], Mapping[str, Tensor]], tuple]
    # the op's constant arguments the rule reads, by name; the first is the weight, whose name
    # the new constants take ("fc.qweight" → "fc.cpu_ones")
    consts: tuple[str, ...]
    # None: every node of the op; else only the nodes whose arguments (by name) it accepts (the
    # rest keep the composition)
    when: Callable[[Mapping[str, Any]], bool] | None = None


def is_new_constant(arg: Any) -> bool:
    """Whether a device argument a rule returned is a new constant, ``(name, tensor)``."""
    return isinstance(arg, tuple) and len(arg) == 2 and isinstance(arg[1], Tensor)


# device ("cpu", "cpu-native") → op name (``fxquant::<name>``) → rule
PREPACK: dict[str, dict[str, PrepackRule]] = {}


def prepack_rule(
    device: str,
    *op_names: str,
    consts: tuple[str, ...],
    when: Callable[[Mapping[str, Any]], bool] | None = None,
) -> Callable[[Callable], Callable]:
    """Register the decorated function as ``device``'s prepack rule of each
    ``fxquant::<op_name>``, reading the constant arguments ``consts``. One rule per op and
    device (two would race for it)."""

    def wrap(fn: Callable) -> Callable:
        table = PREPACK.setdefault(device, {})
        for name in op_names:
            if name in table:
                raise RuntimeError(
                    f"fxquant::{name} already has a {device} prepack rule "
                    f"({table[name].rule.__module__}.{table[name].rule.__qualname__})"
                )
            table[name] = PrepackRule(fn, consts, when)
        return fn

    return wrap


def prepack_table(device: str) -> dict[torch._ops.OpOverload, PrepackRule]:
    """``{fxquant::<name>.default: rule}`` for every op with a prepack rule on ``device``."""
    ops = torch.ops.fxquant
    return {getattr(ops, name).default: rule for name, rule in PREPACK.get(device, {}).items()}


def unique_name(editor, fqn: str) -> str:
    """``fqn``, or ``fqn1``, ``fqn2``, ... : the first name the program does not hold yet."""
    name, i = fqn, 1
    while editor.taken(name):
        name, i = f"{fqn}{i}", i + 1
    return name
