"""Lowering: replace each ``fxquant::`` op by its implementation for the target device.

Last pass of the data flow, run only before Inductor or AOTInductor (a saved ``.pt2`` keeps the
semantic ops). It has two steps:

1. **Prepack** (once, at lowering time): where the fast kernel of a device wants its own weight
   layout, the op's constants are converted and stored as new constants, and the node is
   rewritten to a *device op* (``fxquant::cpu_*``) that takes them. Kernel-side tensors must be
   stored constants, never computed in the graph: Inductor's lowering of
   ``aten._weight_int8pack_mm`` does not realize a computed scale argument and fails with
   ``LoweringException: AssertionError: Pointwise`` under AOTInductor.
2. **Decompose**: ``run_decompositions`` (export path) or ``compile_fx``'s ``decompositions``
   (backend path) traces each semantic op and device op into its registered composition.
   Nothing Python-only survives, so an AOTInductor package runs where fxquant was never
   imported.

On CPU the implementations are registered by op name, one module per scheme family
(``passes/cpu/``: ``int8``, ``int4``, ``float8``, ``mx``, ``bnb``, ``lowbit``, ``norm``), each
with the measurements and kernel preconditions that shaped it: aten compositions (``"cpu"``)
and, where fxquant's native kernels build (``fxquant.kernels.cpu``), compositions around them
(``"cpu-native"``, which override the aten ones and bring their own prepack rules, sibling
fusion, ``passes/cpu/siblings.py``, and a native kernel for the linears left in fp32,
``passes/cpu/float32.py``). The native kernels pick their own path by M (a GEMV for
decode, dequantize-a-chunk + MKL for prefill), so one CPU graph serves every M with no
``torch.cond``.

On CUDA (``lowerings("cuda")``, the table in ``lower_cuda.py``) there is no prepack: each
semantic op becomes the Triton ops of ``fxquant.kernels`` on the rewrite's own layouts, with
the decode (M ≤ 16) and prefill kernels of a GEMM under a ``torch.cond`` on M when M is
dynamic.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.fx as fx
from torch import Tensor
from torch.export import ExportedProgram

import fxquant.core.ops  # noqa: F401  (registers the fxquant:: ops)
from fxquant.core.registry import lowering_table
from fxquant.core.scheme import named_args
from fxquant.passes import cpu
from fxquant.passes.cpu.attention import share_attention_masks
from fxquant.passes.cpu.common import NATIVE
from fxquant.passes.cpu.experts import lower_float_experts
from fxquant.passes.cpu.float32 import lower_float32_linears
from fxquant.passes.cpu.prepack import is_new_constant, prepack_table, unique_name
from fxquant.passes.cpu.siblings import fuse_siblings
from fxquant.passes.plan import node_value

# The CPU tables as registered (by ``passes/cpu/``), for tests and tools: the semantic ops'
# aten lowerings, the ``fxquant::cpu_*`` device ops' (what the aten prepack emits), and the
# native-kernel ones (semantic ops and the ``fxquant::cpu_native_*`` device ops).
_ATEN = lowering_table("cpu")
CPU_LOWERINGS = {op: fn for op, fn in _ATEN.items() if not op._opname.startswith("cpu_")}
CPU_DECOMPOSITIONS = {op: fn for op, fn in _ATEN.items() if op._opname.startswith("cpu_")}
NATIVE_LOWERINGS = lowering_table(NATIVE)


def _device_type(device: str | torch.device) -> str:
    device_type = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    if device_type not in ("cpu", "cuda"):
        raise ValueError(f"device={device!r} is not supported for lowering; allowed: 'cpu', 'cuda'")
    return device_type


def native_cpu() -> bool:
    """Whether the CPU lowering targets fxquant's native kernels (``fxquant.kernels.cpu``, built
    on first use); False where they cannot be built, and with ``FXQUANT_NATIVE=0``."""
    return cpu.available()


def lowerings(device: str | torch.device = "cpu") -> dict:
    """The op → aten composition table for a device type (semantic and device ops)."""
    if _device_type(device) == "cuda":
        # Imported here: it defines the Triton kernels, which CPU-only work never needs.
        from fxquant.passes.lower_cuda import CUDA_LOWERINGS

        return dict(CUDA_LOWERINGS)
    table = lowering_table("cpu")
    if native_cpu():
        table.update(lowering_table(NATIVE))
    return table


def prepack(editor, *, device: str | torch.device = "cpu") -> int:
    """Rewrite every semantic op whose constants the editor can see to its device op, adding the
    prepacked constants (shared between nodes that share weights). Returns the nodes rewritten."""
    from fxquant.passes.rewrite import counters

    if _device_type(device) != "cpu":
        return 0
    native = native_cpu()
    if native:
        fuse_siblings(editor)
    # a whole table each: the native kernels read int8 and fp8 weights as they are (no rule),
    # but for w8a8's on VNNI machines (passes/cpu/int8.py)
    rules = prepack_table(NATIVE if native else "cpu")
    done = 0
    cache: dict[tuple, fx.Node] = {}
    for node in list(editor.graph.nodes):
        rule = rules.get(node.target) if node.op == "call_function" else None
        if rule is None:
            continue
        args = named_args(node.target, node.args, node.kwargs)
        if rule.when is not None and not rule.when(args):
            continue
        const_nodes = [args[name] for name in rule.consts]
        found = [editor.weight_of(n, buffers=True) for n in const_nodes]
        if any(f is None for f in found):
            continue
        consts = {name: t for name, (_, t) in zip(rule.consts, found, strict=True)}
        target, new_args = rule.rule(node, args, consts)
        # "fc.qweight" → "fc.cpu_ones"; "proj_qweight" (a root parameter's) → "proj_cpu_ones"
        first = found[0][0]
        prefix = first.removesuffix("qweight") if first.endswith("qweight") else first + "_"
        prefix += "cpu_"
        out = []
        for a in new_args:
            if is_new_constant(a):
                key = (found[0][0], a[0])
                if key not in cache:
                    cache[key] = editor.add_constant(unique_name(editor, prefix + a[0]), a[1])
                a = cache[key]
            out.append(a)
        editor.swap(node, target, tuple(out))
        for old in const_nodes:
            editor.release(old)
        counters[f"prepack.{target._opname}"] += 1
        done += 1
    if native:
        # the linears the config left in fp32: the native fp32 kernel (passes/cpu/float32.py)
        done += lower_float32_linears(editor)
    # experts left in float: out of transformers' Python op, into the package
    done += lower_float_experts(editor, native=native)
    return done


def prepacked(ep: ExportedProgram, *, device: str | torch.device = "cpu") -> ExportedProgram:
    """A new program with the prepack step done (device ops on their new constants) and every
    other op as it was: what :func:`lower` decomposes, or what AOTInductor traces itself under
    :func:`inductor_decompositions`."""
    from fxquant.passes.rewrite import ProgramEditor

    editor = ProgramEditor(ep)
    prepack(editor, device=device)
    drop_no_ops(editor.graph)
    if _device_type(device) == "cpu":
        share_attention_masks(editor.graph)
    return editor.finish()


def drop_no_ops(graph: fx.Graph) -> int:
    """Remove what export records but computes nothing: ``aten.to`` to the dtype the tensor
    already has (it returns its input) and the dtype assertions export puts beside every ``to``
    (the program's dtypes are fixed). A Hugging Face decoder carries two of each per norm; each
    costs a node in every later trace, the one AOTInductor makes included. Returns the nodes
    removed."""
    aten = torch.ops.aten
    done = 0
    for node in list(graph.nodes):
        if node.op != "call_function":
            continue
        if node.target is aten._assert_tensor_metadata.default and not node.users:
            graph.erase_node(node)
            done += 1
        elif node.target is aten.to.dtype and _same_dtype(node):
            node.replace_all_uses_with(node.args[0])
            graph.erase_node(node)
            done += 1
    return done


def _same_dtype(node: fx.Node) -> bool:
    val, out = node_value(node.args[0]), node_value(node)
    # only the plain cast: copy=True or a memory format asks for a new tensor
    plain = len(node.args) <= 3 and not node.kwargs
    # an output stays a node of its own (it must not become the program's input)
    inner = all(user.op != "output" for user in node.users)
    same = isinstance(val, Tensor) and isinstance(out, Tensor) and val.dtype == out.dtype
    return plain and inner and same


def lower(ep: ExportedProgram, *, device: str | torch.device = "cpu") -> ExportedProgram:
    """A new program with every ``fxquant::`` op replaced by ``device``'s implementation, and the
    rest decomposed to the core aten opset Inductor and AOTInductor expect."""
    table = torch.export.default_decompositions()
    table.update(lowerings(device))
    return prepacked(ep, device=device).run_decompositions(table)


@contextlib.contextmanager
def inductor_decompositions(table: dict) -> Iterator[None]:
    """Add ``table`` to the decompositions Inductor applies while it traces, for the duration.

    ``aoti_compile_and_package`` traces the program once more whatever it is given; handing it
    the prepacked program with our lowerings in Inductor's own table saves :func:`lower`'s
    separate full retrace (about 30 s of a 2.5-minute SmolLM2 build on two cores). Inductor
    takes no decompositions argument on that path, so the entries go into the table it reads
    (``select_decomp_table()``, a cached dict) and come out again afterwards; they are keyed by
    fxquant's own ops only, so nothing else that compiles meanwhile can see a difference. They
    replace, for the duration, entries already there for those ops (``fxquant.passes.stock``'s,
    for stock Inductor, may call a Python op that a package could not run without fxquant).
    """
    from torch._inductor.decomposition import select_decomp_table

    current = select_decomp_table()
    saved = {k: current[k] for k in table if k in current}
    current.update(table)
    try:
        yield
    finally:
        for k in table:
            current.pop(k, None)
        current.update(saved)
