"""Stock Inductor on fxquant ops: decompositions that let ``torch.compile``'s default backend run
each semantic op on the CPU lowering's kernels instead of the op's eager kernel.

Where it sits: beside ``fxquant.passes.lower``, whose tables it reads; registered once by the
modules that hand users programs or modules holding ``fxquant::`` ops (``fxquant.api``,
``fxquant.passes.eager``, which the ``from_pretrained`` bridge's modules call through).
``torch.compile(model, backend="fxquant")`` and :func:`fxquant.aot_compile` lower the ops
themselves before Inductor sees them, so nothing here changes what they build.

Without this, ``torch.compile(model)`` of a bridged model (the usual next line after
``from_pretrained``) or of ``fxquant.quantize(ep).module()`` kept each semantic op as an opaque
call of its eager kernel, the reference math (dequantize the whole weight, then multiply), on
every step: slower than the float model compiled the same way
(``benchmarks/bridge_moe.py``, a Qwen2-MoE-shaped model: 0.46-0.87× float Inductor on a
32-token forward, 0.19-0.80× on one token; with these entries 2.2-2.9× and 3.0-3.5×, near the
fxquant backend). Inductor reads its decomposition table while AOTAutograd traces, so an
entry for the op replaces it, in the compiled graph only, by the composition the lowering
would run: the native kernels chosen by M (a ``torch.cond`` when M is dynamic), their
epilogues fused by Inductor. ``torch.export`` and ``run_decompositions()`` use core ATen's
table, so saved and exported programs keep the semantic ops.

What the lowering's prepack step would do once (an int4 weight into the native kernel's layout)
has no constants to see here: the weights are graph inputs. An op whose native lowering needs
that layout (int4 weight-only and W4A8, low-bit and SINQ, int4 experts) becomes its twin
``fxquant::stock_<op>`` (:data:`STOCK_TWINS`), whose CPU
kernel, :func:`run_prepacked`, applies the prepack rule to the weights it is called with,
keeps the result per weight (until the weight changes: a new tensor, an in-place update) and
runs the device op's composition eagerly inside the compiled graph. Traced into the graph
instead, the prepack ran on every call, and an int4 layer was no faster than the float one.
The ops the native lowering runs on the stored layout (int8, fp8, MX, the other grouped
experts) are decomposed whole. Only CPU tensors are decomposed: on CUDA the op stays as it was
(its Triton lowering is not driven from here).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import torch
from torch import Tensor
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

import fxquant.core.ops  # noqa: F401  (the semantic ops the twins copy)
from fxquant.core.paths import source_digest
from fxquant.core.scheme import named_args
from fxquant.passes.cpu.prepack import is_new_constant

__all__ = [
    "composition",
    "held_bytes",
    "is_stock",
    "register_decompositions",
    "run_prepacked",
    "stock_op",
]


@functools.cache  # once per process: the entries stay for every later compile
def register_decompositions() -> None:
    """Put a decomposition of every fxquant semantic op that has a CPU lowering into the table
    Inductor reads (an entry already there, a user's own, is kept)."""
    import torch._inductor.config as inductor_config
    from torch._inductor.decomposition import select_decomp_table

    from fxquant.core.registry import lowering_table
    from fxquant.passes.cpu.common import NATIVE
    from fxquant.passes.lower import CPU_LOWERINGS

    native = lowering_table(NATIVE)
    prepacked = {op._opname for op in CPU_LOWERINGS if op not in native and _rule(op) is not None}
    if prepacked != set(STOCK_TWINS):
        raise RuntimeError(
            "fxquant.passes.stock.STOCK_TWINS must name the ops whose native CPU lowering prepacks "
            f"its weight with no composition on the stored layout: {sorted(prepacked)}; it "
            f"names {sorted(STOCK_TWINS)}"
        )
    table = select_decomp_table()
    for op in CPU_LOWERINGS:
        table.setdefault(op, functools.partial(_decompose, op))
    # Inductor's disk caches key a graph by its code and Inductor's config, not by the
    # decompositions it was built with: a process without these entries (one that imported only
    # the ops) could be served a graph compiled with them, which calls native ops it never
    # loaded, and the reverse. An entry here (the way Inductor gives custom ops a say in its
    # keys; no graph calls a function of this name) keys every graph by them and by fxquant's
    # source.
    import fxquant.core
    import fxquant.kernels

    roots = (Path(fxquant.core.__file__).parent, Path(fxquant.kernels.__file__).parent)
    marked = dict(inductor_config.unsafe_marked_cacheable_functions)
    marked[__name__] = source_digest(Path(__file__).parent, *roots)
    inductor_config.unsafe_marked_cacheable_functions = marked


def is_stock(decomposition: Any) -> bool:
    """Whether a decomposition table's entry is one :func:`register_decompositions` put there."""
    return isinstance(decomposition, functools.partial) and decomposition.func is _decompose


def _decompose(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Any:
    tensors = [a for a in pytree.tree_leaves((args, kwargs)) if isinstance(a, Tensor)]
    if not tensors or any(t.device.type != "cpu" for t in tensors):
        return NotImplemented  # the op stays: Inductor calls its kernel for that device
    return composition(op, args, kwargs)


def composition(op: torch._ops.OpOverload, args: tuple, kwargs: dict) -> Any:
    """What the CPU lowering computes for ``op(*args, **kwargs)`` with the constants unseen:
    the native composition on the stored layout, ``fxquant::stock_<op>`` where the native
    lowering prepacks, or the aten composition; NotImplemented where the table has nothing for
    ``op``."""
    from fxquant.passes.lower import lowerings, native_cpu

    if native_cpu() and op._opname in STOCK_TWINS:
        rule = _rule(op)
        if rule.when is None or rule.when(named_args(op, args, kwargs)):
            return stock_op(op)(*args, **kwargs)
    fn = lowerings("cpu").get(op)
    return NotImplemented if fn is None else fn(*args, **kwargs)


def stock_op(op: torch._ops.OpOverload) -> torch._ops.OpOverload:
    """``fxquant::stock_<name>`` of a semantic op in :data:`STOCK_TWINS`."""
    return getattr(torch.ops.fxquant, f"stock_{op._opname}").default


@functools.cache  # the tables are complete once fxquant.passes.lower is imported
def _rule(op: torch._ops.OpOverload):
    from fxquant.passes.cpu.common import NATIVE
    from fxquant.passes.cpu.prepack import prepack_table

    return prepack_table(NATIVE).get(op)


# weight → {semantic op: (its fingerprint, the device op's composition, its arguments:
# ("arg", name) | ("const", tensor) | ("value", v))}; dropped with the weight
_PACKED = WeakIdKeyDictionary()


def run_prepacked(op: torch._ops.OpOverload, *args: Any, **kwargs: Any) -> Tensor:
    """The CPU kernel of ``fxquant::stock_<op>``: ``op`` as its native lowering computes it, the
    prepack rule applied once per weight (again when a constant changes)."""
    named = named_args(op, args, kwargs)
    rule = _rule(op)
    consts = _consts(rule, named)
    weight = consts[rule.consts[0]]
    # the constants as they are now (a new tensor or an in-place update prepacks again), and
    # the op's other values (group size, bits), which a weight shared by two ops may not share
    key = tuple([(id(t), t._version, t.data_ptr()) for t in consts.values()]) + tuple(
        [v for v in named.values() if not isinstance(v, Tensor)]
    )
    # per call, a decode step's every layer: get first (setdefault makes a weak reference)
    per_op = _PACKED.get(weight)
    if per_op is None:
        per_op = _PACKED.setdefault(weight, {})
    held = per_op.get(op)
    if held is None or held[0] != key:
        from fxquant.passes.lower import lowerings  # at the first call: lower imports the tables

        with torch.no_grad():
            target, new = rule.rule(SimpleNamespace(target=op), named, consts)
        given = {id(v): k for k, v in named.items() if isinstance(v, Tensor) and k not in consts}
        plan = [
            ("const", a[1]) if is_new_constant(a)
            else ("arg", given[id(a)]) if isinstance(a, Tensor) and id(a) in given
            else ("value", a)
            for a in new
        ]  # fmt: skip
        per_op[op] = held = (key, lowerings("cpu")[target], plan)
    _, run, plan = held
    # below autograd, as in passes/eager.py: the native ops skip their Python autograd wrappers
    with torch._C._AutoDispatchBelowAutograd():
        return run(*(named[v] if kind == "arg" else v for kind, v in plan))


def held_bytes(weights: Iterable[Tensor]) -> int:
    """Bytes of the prepacked constants the ``stock_*`` ops hold for these weights: what a model
    compiled with the default backend pays for its int4 kernels (an eager one's is
    ``EagerKernels.extra_bytes``)."""
    return sum(
        v.numel() * v.element_size()
        for w in weights
        for _, _, plan in _PACKED.get(w, {}).values()
        for kind, v in plan
        if kind == "const"
    )


def _consts(rule, named: dict) -> dict[str, Tensor]:
    return {name: named[name] for name in rule.consts}


# The twins: the semantic ops whose native CPU lowering has no composition on the stored layout
# (register_decompositions checks the list against the tables). Defined at this module's import,
# which registration needs: a process is served a graph calling them from Inductor's disk cache
# only if it registered (its cache keys carry the registration), so it has them.
STOCK_TWINS = (
    "int4_weight_only_linear",
    "int8_dynamic_int4_linear",
    "intx_weight_only_linear",
    "sinq_weight_only_linear",
    "int4_weight_only_grouped_mm",
    "int8_dynamic_int4_grouped_mm",
)
_LIB = torch.library.Library("fxquant", "FRAGMENT")
for _name in STOCK_TWINS:
    _op = getattr(torch.ops.fxquant, _name).default
    _schema = str(_op._schema)
    _LIB.define(f"stock_{_name}" + _schema[_schema.index("(") :])
    _LIB.impl(f"stock_{_name}", functools.partial(run_prepacked, _op), "CPU")
    # the semantic op's own fake kernel gives the shapes
    torch.library.register_fake(f"fxquant::stock_{_name}", lib=_LIB)(_op)
