"""What a prepack rule is: the record the CPU lowering's tables hold (``passes/lower.py`` for the
aten kernels, ``passes/lower_native.py`` for fxquant's native ones), and the naming helper both
use for the constants a rule adds.

Where it sits: below both lowering modules, so neither imports the other to share it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch.fx as fx


@dataclass(frozen=True)
class PrepackRule:
    """Rewrite one semantic op to its device op on prepacked constants, once, at lowering."""

    rule: Callable
    n_consts: int  # how many constant args the op has, in order from ``first_const``
    first_const: int = 1  # after x; 2 for the ops that take (xq, xs) from a norm_quant
    # None: every node of the op; else only the nodes it accepts (the rest keep the composition)
    when: Callable[[fx.Node], bool] | None = None


def unique_name(editor, fqn: str) -> str:
    """``fqn``, or ``fqn1``, ``fqn2``, ... : the first name the program does not hold yet."""
    name, i = fqn, 1
    while editor.taken(name):
        name, i = f"{fqn}{i}", i + 1
    return name
