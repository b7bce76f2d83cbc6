"""Sibling fusion, a step of the CPU prepack where the native kernels serve: linears that read
the same activation with the same scheme (q, k and v after one norm; gate and up) become one
GEMM over their stacked weights, and its output is sliced back apart.

Where it sits: run by ``fxquant.passes.lower.prepack`` before the prepack rules (so the stacked
weights are what gets prepacked), on the semantic ops the rewrite and fusion passes emitted.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

import fxquant.core.ops  # noqa: F401  (registers the fxquant:: ops)
from fxquant.core.scheme import named_args
from fxquant.passes.cpu.prepack import unique_name

__all__ = ["fuse_siblings"]


@dataclass(frozen=True)
class _Siblings:
    """Which arguments of an op siblings share, and which they stack (by the op's names)."""

    consts: tuple[str, ...]  # weight-side constants, each stacked along its dim 0
    inputs: tuple[str, ...] = ("x",)  # the activation the siblings read: x, or xq and xs
    per_row: tuple[str, ...] = ()  # constants that must be one value per row to stack


_PER_CHANNEL = _Siblings(("weight", "scale"), per_row=("scale",))
_PER_CHANNEL_SCALED = _Siblings(("weight", "scale"), inputs=("xq", "xs"), per_row=("scale",))
_GROUPED = _Siblings(("weight", "scale", "zero"))

# op name → what its siblings share and stack; the bias is stacked too, and every other
# argument (group size, bits, dtype, ...) must be the same for all of them
_SIBLINGS = {
    "int8_weight_only_linear": _PER_CHANNEL,
    "int8_dynamic_linear": _PER_CHANNEL,
    "int8_scaled_linear": _PER_CHANNEL_SCALED,
    "int4_weight_only_linear": _GROUPED,
    "int8_dynamic_int4_linear": _GROUPED,
    "intx_weight_only_linear": _GROUPED,
    "float8_weight_only_linear": _PER_CHANNEL,
    "float8_dynamic_linear": _PER_CHANNEL,
    "float8_scaled_linear": _PER_CHANNEL_SCALED,
}
_BY_TARGET = {getattr(torch.ops.fxquant, name).default: s for name, s in _SIBLINGS.items()}


def _params(spec: _Siblings, args: dict) -> tuple:
    """The arguments that are neither the activation, the constants nor the bias."""
    skip = {*spec.inputs, *spec.consts, "bias"}
    return tuple(v for k, v in args.items() if k not in skip)


def fuse_siblings(editor) -> int:
    """Stack the weights of linears that read the same activation with the same scheme (q, k
    and v after one norm; gate and up) into one GEMM, and slice its output back apart.

    At M = 1 each GEMM is a pass over its weight plus a fixed cost (a parallel region, a call,
    an output buffer): three passes become one, with every byte still read once. The stacked
    constants replace the separate ones. Returns the groups fused.
    """
    from fxquant.passes.plan import node_value
    from fxquant.passes.rewrite import counters

    groups: dict[tuple, list[tuple[fx.Node, dict]]] = {}
    for node in editor.graph.nodes:
        spec = _BY_TARGET.get(node.target) if node.op == "call_function" else None
        if spec is None:
            continue
        args = named_args(node.target, node.args, node.kwargs)
        inputs = tuple(args[n] for n in spec.inputs)
        key = (node.target, inputs, _params(spec, args), args["bias"] is None)
        groups.setdefault(key, []).append((node, args))
    fused = 0
    for (target, _, _, no_bias), members in groups.items():
        if len(members) < 2:
            continue
        spec = _BY_TARGET[target]
        found = []
        for n, args in members:
            consts = {c: editor.weight_of(args[c], buffers=True) for c in spec.consts}
            bias = None if no_bias else editor.weight_of(args["bias"], buffers=True)
            if any(c is None for c in consts.values()) or (not no_bias and bias is None):
                break
            rows = consts[spec.consts[0]][1].shape[0]
            if any(consts[c][1].reshape(-1).shape[0] != rows for c in spec.per_row):
                break  # a per-tensor scale: one value for all rows cannot be stacked
            tensors = [consts[c][1] for c in spec.consts]
            found.append((n, args, tensors, None if no_bias else bias[1]))
        if len(found) != len(members):
            continue
        first, first_args, first_tensors, _ = found[0]
        prefix = editor.weight_of(first_args[spec.consts[0]], buffers=True)[0] + ".siblings"
        whole_args = dict(first_args)
        for i, name in enumerate(spec.consts):
            t = torch.cat([c[i].reshape(c[i].shape[0], -1) for _, _, c, _ in found])
            t = t.reshape(-1, *first_tensors[i].shape[1:])
            whole_args[name] = editor.add_constant(unique_name(editor, f"{prefix}.{i}"), t)
        whole_args["bias"] = None
        if not no_bias:
            whole_args["bias"] = editor.add_constant(
                unique_name(editor, f"{prefix}.bias"), torch.cat([b for _, _, _, b in found])
            )
        call_args = tuple(whole_args[a.name] for a in target._schema.arguments)
        with editor.graph.inserting_before(first):
            whole = editor.graph.call_function(target, call_args)
        whole.meta["val"] = _fake(editor, target, call_args, node_value)
        start = 0
        for n, args, consts, _ in found:
            width = consts[0].shape[0]
            with editor.graph.inserting_before(n):
                part = editor.graph.call_function(
                    torch.ops.aten.slice.Tensor, (whole, -1, start, start + width)
                )
                # contiguous again: consumers view the output as heads ([..., H, D])
                part2 = editor.graph.call_function(
                    torch.ops.aten.clone.default,
                    (part,),
                    {"memory_format": torch.contiguous_format},
                )
            part.meta["val"] = _fake(editor, part.target, part.args, node_value)
            part2.meta["val"] = _fake(editor, part2.target, part2.args, node_value, part2.kwargs)
            for key in ("nn_module_stack", "stack_trace", "custom"):
                if key in n.meta:
                    part2.meta[key] = n.meta[key]
            n.replace_all_uses_with(part2)
            old = [args[c] for c in spec.consts] + ([] if no_bias else [args["bias"]])
            editor.graph.erase_node(n)
            for c in old:
                editor.release(c)
            start += width
        counters["fuse.siblings"] += 1
        fused += 1
    return fused


def _fake(editor, target, args, node_value, kwargs=None):
    if editor.fake_mode is None:
        return None
    with editor.fake_mode:
        return target(*[node_value(a) for a in args], **(kwargs or {}))
