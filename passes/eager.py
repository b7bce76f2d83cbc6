"""Eager calls on the lowering's kernels: one ``fxquant::`` op, called by a module that holds its
constants, run as the CPU lowering would run it inside a compiled graph.

Where it sits: beside ``fxquant.passes.lower``, which it drives on a graph of one node. The
``from_pretrained`` bridge's modules (``QuantizedLinear``, ``ExpertWeights``) call their op
through an :class:`EagerKernels`; in a trace (``torch.export``, ``torch.compile``, ``make_fx``)
that is the op itself, so exported and compiled graphs hold the same ``fxquant::`` ops as
before. Called eagerly on CPU tensors, it builds once (per module, per input dtype) the graph
the lowering makes of that one node — the prepack rules' constants (an int4 weight in the
native kernel's layout …), the semantic op replaced by its composition around the native
kernels, which pick their path by M — and runs that graph. Without it an eager call runs the
op's eager kernel, its reference math (dequantize the whole weight, then multiply): a bridged
SmolLM2 decoding with ``generate`` ran int4 at 0.35× the fp32 model it replaced and int8 at
0.86× (``benchmarks/bridge_generate.py``).

The numerics are the compiled backend's (``torch.compile(backend="fxquant")`` runs the same
compositions), not the reference's bit for bit: fp32 accumulation in another order and, where
the CPU dispatch table picks one, bf16 or int8 activations (``Report.cpu_kernels_table()``
names the path). ``reference_math()`` turns the kernels off for a block, for a check that
wants the reference.

Kept out of the kernels (the op runs as it is): calls under a trace (Dynamo, export,
``make_fx``, ``fx.symbolic_trace``), on tensors that are not plain CPU tensors (fake,
functional, subclasses) and on any device other than the CPU (CUDA's lowering is its Triton
kernels, which this does not drive yet). Grad mode changes nothing: the ops and the native
kernels have no derivative formula (a backward through either raises), and a composition of
aten ops differentiates in x as the reference does.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch
import torch.fx as fx
from torch import Tensor, nn

from fxquant.passes.lower import lowerings, prepack
from fxquant.passes.rewrite import DynamoEditor
from fxquant.passes.stock import register_decompositions

__all__ = ["EagerKernels", "reference_math"]

# a bridged model under torch.compile's default backend: the same kernels (passes/stock.py)
register_decompositions()

_state = threading.local()
_CONST = "const"  # the built graph's names of the module's own constants (const0, const1 …)


@contextlib.contextmanager
def reference_math() -> Iterator[None]:
    """Within the block, :class:`EagerKernels` run each op's eager kernel (its reference math)
    instead of the lowering's kernels, as before they existed."""
    before = getattr(_state, "reference", False)
    _state.reference = True
    try:
        yield
    finally:
        _state.reference = before


# nn.Parameter is the only subclass that is still a plain tensor underneath
_PLAIN = (Tensor, nn.Parameter)


def _eager(args: Sequence[Any]) -> bool:
    """Whether a call with ``args`` runs eagerly on plain CPU tensors, outside any trace."""
    # is_compiling first: Dynamo folds it to True and never reaches the thread-local
    if torch.compiler.is_compiling() or getattr(_state, "reference", False):
        return False
    # one pass, every call of every layer: an fx.Proxy (fx.symbolic_trace records the op), a
    # tensor subclass or another device's tensor each leave the op as it is
    for a in args:
        if isinstance(a, Tensor):
            if type(a) not in _PLAIN or not a.is_cpu:
                return False
        elif isinstance(a, fx.Proxy):
            return False
    return True


def _token(a: Any, constants: set[int]) -> Any:
    """What of one argument the built graph depends on: a constant by identity, version and
    storage (an in-place update or a new tensor rebuilds), an input by dtype, the rest by value."""
    if not isinstance(a, Tensor):
        return a
    if id(a) in constants:
        return ("const", id(a), a._version, a.data_ptr(), a.dtype)
    return ("input", a.dtype)


@torch.no_grad()  # the prepack rules' new tensors are constants
def lower_call(op: torch._ops.OpOverload, args: Sequence[Any], constants: set[int]):
    """(GraphModule, input positions): the CPU lowering of ``op(*args)`` as a graph whose
    constants are the tensors of ``args`` whose ids are in ``constants`` (prepacked where a rule
    says) and whose inputs are the other tensors, in order."""
    root, graph = nn.Module(), fx.Graph()
    nodes, inputs, positions = [], [], []
    for i, a in enumerate(args):
        if isinstance(a, Tensor) and id(a) in constants:
            root.register_buffer(f"{_CONST}{i}", a)
            nodes.append(graph.get_attr(f"{_CONST}{i}"))
        elif isinstance(a, Tensor):
            nodes.append(graph.placeholder(f"input{i}"))
            inputs.append(a)
            positions.append(i)
        else:
            nodes.append(a)
    graph.output(graph.call_function(op, tuple(nodes)))
    editor = DynamoEditor(fx.GraphModule(root, graph), inputs)
    prepack(editor, device="cpu")
    gm = editor.finish()
    # what decomposition does inside a compile, done once here: each fxquant op left (a semantic
    # op no rule prepacked) calls its composition directly (device ops' eager kernels already
    # are theirs)
    table = lowerings("cpu")
    for node in gm.graph.nodes:
        if node.op == "call_function" and node.target in table:
            node.target = table[node.target]
    gm.graph.eliminate_dead_code()
    gm.recompile()
    return gm, tuple(positions)


class EagerKernels:
    """A module's eager calls of its op on the CPU lowering's kernels (see the module docstring).

    ``kernels(op, args, constants)`` returns ``op(*args)`` as the lowering computes it, or the op
    itself where the call is not eager (a trace, another device). ``constants`` are the
    module's frozen tensors among ``args`` (its quantized buffers and bias); the graph built for
    them is kept until one of them changes (a new tensor, an in-place update such as
    ``load_state_dict``) or the input dtype does. Never copied or pickled with the module (a copy
    builds its own).
    """

    def __init__(self) -> None:
        self._key: tuple | None = None
        self._built: tuple[fx.GraphModule, tuple[int, ...]] | None = None

    def __call__(
        self, op: torch._ops.OpOverload, args: Sequence[Any], constants: Iterable[Tensor]
    ) -> Tensor:
        if not _eager(args):
            return op(*args)
        ids = {id(t) for t in constants if t is not None}
        key = (op, *[_token(a, ids) for a in args])
        if key != self._key:
            self._built, self._key = None, None  # drop the old prepacked constants first
            self._built, self._key = lower_call(op, args, ids), key
        gm, positions = self._built
        inputs = [args[i] for i in positions]
        if torch.is_grad_enabled() and any(t.requires_grad for t in inputs):
            return gm.forward(*inputs)  # recorded: a backward raises at the native ops
        # Nothing to record (the constants need no gradient): below autograd, the native ops
        # skip their Python autograd wrappers, a fifth of a decode GEMM's eager call.
        with torch._C._AutoDispatchBelowAutograd():
            return gm.forward(*inputs)

    @property
    def built(self) -> bool:
        """Whether a lowered graph is held (for tests and reports)."""
        return self._built is not None

    @property
    def extra_bytes(self) -> int:
        """Bytes the built graph holds beyond the module's own constants: the prepack rules' new
        tensors (an int4 weight in the kernel's layout, w8a8's VNNI panels), the memory an eager
        model pays for its kernels, as a compiled one does."""
        if self._built is None:
            return 0
        return sum(
            t.numel() * t.element_size()
            for name, t in self._built[0].named_buffers()
            if not name.startswith(_CONST)
        )

    def __deepcopy__(self, memo) -> EagerKernels:
        return EagerKernels()

    def __getstate__(self) -> dict:
        return {"_key": None, "_built": None}
