"""The linear rewrite: quantize each planned weight once and swap the node for one ``fxquant::`` op.

Second pass of the data flow (plan → rewrite → fuse → lower). It works on two kinds of graph through
a small *editor* that knows where constants live:

- ``ProgramEditor``: an ``ExportedProgram``. Quantized weights become new persistent buffers
  (lifted placeholders + state-dict entries) named after the layer (``fc.qweight``,
  ``fc.scale`` …); float weights that nothing uses any more leave the program, so a quantized
  ``.pt2`` is small. Tied weights still used elsewhere (an embedding) stay.
- ``DynamoEditor``: the GraphModule ``torch.compile`` hands the ``fxquant`` backend, whose
  parameters arrive as graph inputs; quantized weights become attributes of that GraphModule.

Each rewritten node carries its report row (``fxquant.core.row.LayerRow``, as JSON in
``node.meta["custom"]``), which ``torch.export.save`` keeps, so ``fxquant.report`` works on a
reloaded ``.pt2``.
"""

from __future__ import annotations

import copy
import dataclasses
import re
import warnings
from collections import Counter
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.fx as fx
from torch._guards import detect_fake_mode
from torch.export import ExportedProgram
from torch.export.graph_signature import (
    ExportGraphSignature,
    InputKind,
    InputSpec,
    TensorArgument,
)
from torch.utils.weak import WeakIdKeyDictionary
from tqdm.auto import tqdm

from fxquant.core.config import QuantConfig
from fxquant.core.reference import sqnr
from fxquant.core.row import LayerRow
from fxquant.core.scheme import QuantizedWeight, check_layout
from fxquant.passes.plan import LayerPlan, find_sites, node_value, plan_sites

aten = torch.ops.aten

CONFIG_KEY = "fxquant_config"  # ... and on the first site, the whole QuantConfig, as JSON
COPIED_META = (
    "nn_module_stack",
    "stack_trace",
    "source_fn_stack",
    "torch_fn",
    "from_node",
    "custom",
)

counters: Counter = Counter()  # "<scheme name>" → nodes rewritten; tests assert on these


class ProgramEditor:
    """Constants of an ExportedProgram: parameters, buffers and lifted tensor constants."""

    def __init__(self, ep: ExportedProgram) -> None:
        self.ep = ep
        self.gm = copy.deepcopy(ep.graph_module)
        self.graph = self.gm.graph
        # Copying a graph may rename nodes whose names shadow Python builtins (a user input
        # called ``input`` becomes ``input_1``): carry the signature over to the new names.
        self._renamed: dict[str, str] = {
            old.name: new.name
            for old, new in zip(ep.graph.nodes, self.graph.nodes, strict=True)
            if old.name != new.name
        }
        self.input_specs = [self._rename(s) for s in ep.graph_signature.input_specs]
        self.state_dict = dict(ep.state_dict)
        self.constants = dict(ep.constants)
        self._spec_of = {s.arg.name: s for s in self.input_specs if hasattr(s.arg, "name")}
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self.fake_mode = detect_fake_mode([n.meta.get("val") for n in placeholders])
        self._released: set[str] = set()

    def _rename(self, spec):
        if not isinstance(spec.arg, TensorArgument):
            return spec
        name = spec.arg.name
        while name in self._renamed:  # copied under a new name, then replaced by our op
            name = self._renamed[name]
        if name != spec.arg.name:
            spec = copy.copy(spec)
            spec.arg = TensorArgument(name)
        return spec

    def weight_of(self, node: fx.Node, *, buffers: bool = True):
        """(fqn, tensor) of the parameter, buffer or constant ``node`` reads, or None; a
        program's buffers are its constants as much as its parameters (``buffers`` is for
        ``DynamoEditor``'s signature)."""
        spec = self._spec_of.get(node.name) if node.op == "placeholder" else None
        if spec is None:
            return None
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER) and spec.target in self.state_dict:
            return spec.target, self.state_dict[spec.target]
        if spec.kind in (InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
            t = self.constants.get(spec.target)
            if isinstance(t, torch.Tensor):
                return spec.target, t
        return None

    def taken(self, fqn: str) -> bool:
        return fqn in self.state_dict or fqn in self.constants

    def add_constant(self, fqn: str, tensor: torch.Tensor) -> fx.Node:
        # New buffers go right after the existing parameters and buffers, keeping the lifted
        # inputs grouped by kind as torch.export lays them out.
        kinds = (InputKind.PARAMETER, InputKind.BUFFER)
        index = next((i for i, s in enumerate(self.input_specs) if s.kind not in kinds), None)
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        if index is None:
            index = len(self.input_specs)
        anchor = placeholders[index] if index < len(placeholders) else None
        name = "b_" + re.sub(r"\W", "_", fqn)
        if anchor is not None:
            with self.graph.inserting_before(anchor):
                node = self.graph.placeholder(name)
        else:
            with self.graph.inserting_after(placeholders[-1] if placeholders else None):
                node = self.graph.placeholder(name)
        node.target = node.name
        if self.fake_mode is not None:
            node.meta["val"] = self.fake_mode.from_tensor(tensor, static_shapes=True)
        spec = InputSpec(InputKind.BUFFER, TensorArgument(node.name), fqn, persistent=True)
        self.input_specs.insert(index, spec)
        self._spec_of[node.name] = spec
        self.state_dict[fqn] = tensor
        return node

    def release(self, weight_node: fx.Node) -> None:
        """The node no longer needs this constant: it leaves the program if nothing else uses it."""
        self._released.add(weight_node.name)

    def swap(self, node: fx.Node, target, args: tuple) -> fx.Node:
        new = _swap(self.graph, node, target, args, self.fake_mode)
        self._renamed[node.name] = new.name
        return new

    def kept(self, fqn: str) -> bool:
        """Whether a float weight stays in the program once rewriting is done (a tied weight
        still used elsewhere, e.g. by an embedding)."""
        return any(
            n.op == "placeholder" and n.users and self._spec_of[n.name].target == fqn
            for n in self.graph.nodes
            if n.name in self._spec_of
        )

    def finish(self) -> ExportedProgram:
        for node in list(self.graph.nodes):
            if node.op == "placeholder" and node.name in self._released and not node.users:
                spec = self._spec_of.pop(node.name)
                self.input_specs.remove(spec)
                self.state_dict.pop(spec.target, None)
                self.constants.pop(spec.target, None)
                self.graph.erase_node(node)
        self.graph.lint()
        self.gm.recompile()
        output_specs = [self._rename(s) for s in self.ep.graph_signature.output_specs]
        signature = ExportGraphSignature(input_specs=self.input_specs, output_specs=output_specs)
        return ExportedProgram(
            root=self.gm,
            graph=self.graph,
            graph_signature=signature,
            state_dict=self.state_dict,
            range_constraints=copy.copy(self.ep.range_constraints),
            module_call_graph=copy_call_graph(self.ep.module_call_graph),
            example_inputs=self.ep.example_inputs,
            constants=self.constants,
            verifiers=self.ep.verifiers,
        )


def copy_call_graph(module_call_graph):
    """A deep copy of a program's module call graph, without the FutureWarning torch 2.13's own
    pytree specs raise when copied (``isinstance(treespec, LeafSpec)``: torch's, not ours, and
    shown on every ``quantize`` otherwise)."""
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message=r".*isinstance\(treespec, LeafSpec\)", category=FutureWarning
        )
        return copy.deepcopy(module_call_graph)


class DynamoEditor:
    """Constants of a Dynamo GraphModule, whose parameters arrive as placeholders."""

    def __init__(self, gm: fx.GraphModule, example_inputs) -> None:
        self.gm = gm
        self.graph = gm.graph
        self.fake_mode = None
        placeholders = [n for n in self.graph.nodes if n.op == "placeholder"]
        self._inputs = dict(zip(placeholders, example_inputs, strict=True))
        self._index = {node: i for i, node in enumerate(placeholders)}
        self._attrs: set[str] = set()
        # the parameter inputs the passes looked at: placeholder → (Dynamo's source of it, the
        # tensor); and those a pass made constants from (``release``)
        self._params: dict[fx.Node, tuple[Any, torch.Tensor]] = {}
        self._baked: set[fx.Node] = set()

    def weight_of(self, node: fx.Node, *, buffers: bool = False):
        """(fqn, tensor) of the parameter (or, ``buffers``, the buffer) ``node`` reads, or None.
        Buffers are left out of planning (a model's buffers include what it computes with, such
        as rotary frequencies a matmul reads); prepacking asks for them, since the constants of
        ops already quantized (the from_pretrained bridge's) are module buffers."""
        if node.op == "get_attr":
            t = self.gm
            for part in node.target.split("."):
                t = getattr(t, part)
            return (node.target, t) if isinstance(t, torch.Tensor) else None
        value = self._inputs.get(node)
        grapharg = node.meta.get("grapharg")
        if grapharg is None or not isinstance(value, torch.Tensor):
            return None
        if not isinstance(value, torch.nn.Parameter) and not (buffers and _is_buffer(grapharg)):
            return None
        fqn = fqn_from_source(grapharg.source.name)
        self._params.setdefault(node, (grapharg.source, value))
        return fqn, value

    @property
    def frozen(self) -> dict[int, tuple[Any, torch.Tensor]]:
        """The parameter inputs whose values the passes baked into the graph (quantized,
        prepacked, concatenated with siblings), by input index: (Dynamo's source, the tensor).
        A weight only looked at, or still read as it is (a linear a config keeps in float, on
        the fp32 kernel; a norm's weight in the fused norm op), is read at run time: not
        frozen."""
        return {self._index[node]: self._params[node] for node in self._baked}

    def taken(self, fqn: str) -> bool:
        return fqn in self._attrs

    def add_constant(self, fqn: str, tensor: torch.Tensor) -> fx.Node:
        attr = "_fxquant_" + re.sub(r"\W", "_", fqn)
        self._attrs.add(fqn)
        self.gm.register_buffer(attr, tensor)
        # AOTAutograd matches every attribute of a Dynamo graph to the source Dynamo guarded it
        # by; ours are made here, so they get a constant source of their own name.
        if hasattr(self.gm, "_param_name_to_source"):
            from torch._dynamo.source import ConstantSource

            self.gm._param_name_to_source[attr] = ConstantSource(attr)
        first = next(n for n in self.graph.nodes if n.op != "placeholder")
        with self.graph.inserting_before(first):
            node = self.graph.get_attr(attr)
        node.meta["example_value"] = tensor
        return node

    def release(self, weight_node: fx.Node) -> None:
        """A pass made constants from this weight and no longer reads it here. The float
        parameter stays a graph input (it belongs to the caller's model); its values are now
        frozen into the graph."""
        node = weight_node
        while node.op != "placeholder" and node.args and isinstance(node.args[0], fx.Node):
            node = node.args[0]  # experts read through a transpose view that other nodes read
        if node in self._params:
            self._baked.add(node)

    def swap(self, node: fx.Node, target, args: tuple) -> fx.Node:
        return _swap(self.graph, node, target, args, None)

    def kept(self, fqn: str) -> bool:
        return True

    def finish(self) -> fx.GraphModule:
        self.graph.lint()
        self.gm.recompile()
        return self.gm


def _is_buffer(grapharg) -> bool:
    """Dynamo's input is a module buffer (its source reads ``_buffers[...]``)."""
    return "_buffers" in grapharg.source.name


def fqn_from_source(source_name: str) -> str:
    """``L['self']._modules['fc']._parameters['weight']`` → ``fc.weight``."""
    parts = re.findall(r"\['([^']*)'\]|\.([A-Za-z_]\w*)", source_name)
    names = [a or b for a, b in parts][1:]  # the first is the root module (L['self'])
    return ".".join(
        n for n in names if n not in ("_modules", "_parameters", "_buffers", "__self__")
    )


# Quantized weights by float weight tensor (held weakly) and scheme, for the life of that
# tensor: torch.compile recompiles a model's graph for each new shape or guard (Hugging Face's
# generate: prefill and decode, each cache length), and every compile would quantize all its
# weights again; with this, only the first does. The key includes the tensor's version counter
# and data pointer, so an in-place update or a new .data quantizes anew.
_QUANTIZED: WeakIdKeyDictionary = WeakIdKeyDictionary()  # keyed by identity, held weakly


def _quantized(scheme, weight: torch.Tensor, w_nk: torch.Tensor) -> QuantizedWeight:
    key = (scheme, weight._version, weight.data_ptr(), tuple(w_nk.shape), w_nk.dtype)
    try:
        per_weight = _QUANTIZED.setdefault(weight, {})
    except TypeError:  # a tensor that cannot be weakly referenced: no caching
        return scheme.quantize(w_nk)
    if key not in per_weight:
        for stale in [k for k in per_weight if k[1:3] != key[1:3]]:
            del per_weight[stale]  # an older version of this weight is never used again
        per_weight[key] = scheme.quantize(w_nk)
        counters["quantize.computed"] += 1
    else:
        counters["quantize.reused"] += 1
    return per_weight[key]


def rewrite(
    editor,
    config: QuantConfig,
    *,
    progress: bool = False,
    weights: Mapping[str, QuantizedWeight] | None = None,
    whole_model: bool = False,
) -> list[LayerRow]:
    """Plan and rewrite every linear-like site; returns the report rows (one per site).

    ``weights`` maps a weight's name (``model.layers.0.mlp.up_proj.weight``) to constants made
    elsewhere (GPTQ, a loaded checkpoint), used instead of quantizing the graph's float weight;
    each must have the layout its planned scheme stores, and each must be used.
    ``whole_model``: the graph is the whole model (an export, not one of Dynamo's pieces), so a
    config pattern that matches none of its layers matches nothing at all: warned of, or an
    error under ``QuantConfig(strict=True)``.
    """
    graph = editor.graph
    plans = plan_sites(find_sites(graph, editor.weight_of), config)
    if whole_model:
        _check_patterns(plans, config)
    plans = _nonfinite(plans, config)
    weights = dict(weights or {})
    used: set[str] = set()
    cache: dict[tuple, tuple[dict[str, fx.Node], LayerRow]] = {}  # (weight, scheme) → consts, row
    rows = []
    for plan in tqdm(plans, desc="quantizing", unit="layer", disable=not progress):
        site = plan.site
        row = _row(plan)
        if plan.scheme is None:
            rows.append((site.node, row))
            continue
        key = (site.weight_fqn, plan.scheme)
        if key in cache:
            nodes, first = cache[key]
            row = row.replace(bytes_after=0, sqnr_db=first.sqnr_db, shared_with=first.name)
        else:
            w = site.weight_nk().detach().contiguous()
            given = weights.get(site.weight_fqn)
            if given is None:
                q = _quantized(plan.scheme, site.weight, w)
            else:
                check_layout(plan.scheme, site.weight_fqn, tuple(w.shape), given)
                q = given
                used.add(site.weight_fqn)
                row = row.replace(weights="given")
            prefix = _constant_prefix(editor, site.weight_fqn, plan.scheme)
            nodes = {n: editor.add_constant(f"{prefix}{n}", t) for n, t in q.tensors.items()}
            row = row.replace(
                bytes_after=q.nbytes,
                sqnr_db=None if q.dequantized is None else round(sqnr(w.float(), q.dequantized), 2),
                padded_in_features=plan.scheme.padded_in_features(site.in_features),
            )
            cache[key] = (nodes, row)
        new = _replace(editor, plan, nodes)
        counters[plan.scheme.name] += 1
        rows.append((new, row))
    unused = sorted(set(weights) - used)
    if unused:
        # A name the plan skipped or never saw: silently keeping its float weight would be wrong.
        reasons = {r.weight: r.reason for _, r in rows if r.status == "skipped"}
        raise ValueError(
            f"precomputed weights were given for {len(unused)} weight(s) the plan did not "
            f"quantize: "
            + ", ".join(f"{n} ({reasons.get(n, 'no linear uses it')})" for n in unused[:5])
        )
    result = []
    for node, row in rows:
        if row.status == "quantized":
            row = row.replace(float_weight_kept=editor.kept(row.weight))
        row.store(node)
        result.append(row)
    if rows:
        rows[0][0].meta["custom"][CONFIG_KEY] = config.to_json()
    return result


def _check_patterns(plans: list[LayerPlan], config: QuantConfig) -> None:
    unmatched = config.unmatched_patterns(p.site.module_name for p in plans)
    if not unmatched:
        return
    text = (
        f"{len(unmatched)} config pattern(s) match no layer of this model: "
        + "; ".join(unmatched)
        + f" (its {len(plans)} linear layers are named like "
        + ", ".join(repr(p.site.module_name) for p in plans[:3])
        + ")"
    )
    if config.strict:
        raise ValueError(text + "; refused under QuantConfig(strict=True)")
    warnings.warn(text + "; QuantConfig(strict=True) makes this an error", stacklevel=3)


def _nonfinite(plans: list[LayerPlan], config: QuantConfig) -> list[LayerPlan]:
    """The plans, with each layer whose float weight holds NaN or inf refused (``"error"``: one
    error naming them all, before anything is quantized) or kept in float (``"skip"``)."""
    bad: dict[str, int] = {}
    for plan in plans:
        w = plan.site.weight
        if plan.scheme is None or plan.site.weight_fqn in bad or not _has_values(w):
            continue
        count = int((~torch.isfinite(w.detach())).sum())
        if count:
            bad[plan.site.weight_fqn] = count
    if not bad:
        return plans
    if config.nonfinite == "error":
        listed = ", ".join(f"{name} ({n} of them)" for name, n in list(bad.items())[:8])
        more = f" and {len(bad) - 8} more" if len(bad) > 8 else ""
        raise ValueError(
            f"{len(bad)} weight(s) hold NaN or inf values: {listed}{more}. Quantizing them would "
            "spread or hide the non-finite values; fix the weights, or pass "
            "QuantConfig(nonfinite='skip') to keep those layers in float (reported)"
        )
    return [
        dataclasses.replace(
            p,
            scheme=None,
            reason=f"the weight holds {bad[p.site.weight_fqn]} NaN/inf value(s): kept in float "
            "(QuantConfig.nonfinite='skip')",
        )
        if p.scheme is not None and p.site.weight_fqn in bad
        else p
        for p in plans
    ]


def _has_values(t: torch.Tensor) -> bool:
    # a meta or fake weight (a skeleton whose values come from a checkpoint) has none to check
    return t.device.type != "meta" and not isinstance(t, torch._subclasses.FakeTensor)


def _row(plan: LayerPlan) -> LayerRow:
    site = plan.site
    nbytes = site.weight.numel() * site.weight.element_size()
    return LayerRow(
        name=plan.name,
        weight=site.weight_fqn,
        node=site.node.name,
        kind=site.kind,
        in_features=site.in_features,
        out_features=site.out_features,
        dtype=str(site.weight.dtype).removeprefix("torch."),
        status="skipped" if plan.scheme is None else "quantized",
        scheme=None if plan.scheme is None else plan.scheme.to_dict(),
        reason=plan.reason,
        bytes_before=nbytes,
        bytes_after=nbytes,
        sqnr_db=None,
        experts=site.experts,
        read_transposed=site.stored_nk or None,
    )


def _constant_prefix(editor, weight_fqn: str, scheme) -> str:
    """``fc.weight`` → ``fc.`` (so the buffers read ``fc.qweight``, ``fc.scale``), made unique
    when the name is taken (a tied weight quantized two ways, a module with a ``qweight``)."""
    base = weight_fqn.removesuffix("weight") if weight_fqn.endswith(".weight") else weight_fqn + "_"
    prefix, i = base, 1
    while editor.taken(f"{prefix}qweight"):
        prefix, i = f"{base}{scheme.name}{i}_", i + 1
    return prefix


def _replace(editor, plan: LayerPlan, constants: dict[str, fx.Node]) -> fx.Node:
    site = plan.site
    weight_node, source = site.weight_node, site.weight_source  # read before the swap
    if site.kind == "bmm":

        def make(rows, offs):
            return plan.scheme.grouped_op_args(rows, constants, offs)

        new, dropped = swap_bmm_site(editor, site, make)
    else:
        if site.kind == "grouped_mm":
            op, args = plan.scheme.grouped_op_args(site.x, constants, site.offs)
        else:
            op, args = plan.scheme.op_args(site.x, constants, site.bias)
        new, dropped = swap_site(editor, site, op, args)
    # a weight read through a transpose: the view is gone, release the parameter it read
    editor.release(source if dropped else weight_node)
    return new


def swap_bmm_site(editor, site, make: Callable) -> tuple[fx.Node, bool]:
    """Swap a ``bmm`` site (x [E, T, K] · W [E, K, N], every expert over the same T rows) for a
    grouped experts op: ``make(rows, offs)`` gives (op, args) for x viewed as [E·T, K] with
    expert e's rows ending at offs[e] = (e + 1)·T, and the op's [E·T, N] rows are viewed back as
    [E, T, N] for the site's users. Returns what ``swap_site`` does (the op's node first)."""
    op, args = make(*_bmm_as_grouped_rows(editor, site))
    new, dropped = swap_site(editor, site, op, args)
    _reshape_users(editor, new, [site.experts, -1, site.out_features])
    return new, dropped


def _bmm_as_grouped_rows(editor, site) -> tuple[fx.Node, fx.Node]:
    """A bmm site's x [E, T, K] as the grouped ops read rows: (x viewed [E·T, K], offs [E] =
    T, 2T … E·T, int32), new nodes before the site. T may be symbolic (a prompt's length)."""
    x = site.x
    value = node_value(x)
    call = _inserter(editor, before=site.node, like=value)
    rows = call(aten.reshape.default, (x, [-1, site.in_features]))
    t = value.shape[1]
    if not isinstance(t, int):
        t = call(aten.sym_size.int, (x, 1))
    ends = call(aten.arange.start, (1, site.experts + 1), dtype=torch.int32, device=value.device)
    return rows, call(aten.mul.Tensor, (ends, t))


def _reshape_users(editor, node: fx.Node, shape: list[int]) -> None:
    """Every user of ``node`` reads ``node`` reshaped to ``shape`` instead."""
    users = list(node.users)
    call = _inserter(editor, before=node.next, like=node_value(node))
    view = call(aten.reshape.default, (node, shape))
    for user in users:
        user.replace_input_with(node, view)


def _inserter(editor, *, before: fx.Node, like: torch.Tensor):
    """``call(target, args, **kwargs)``: a new node before ``before`` with the fake value an
    exported graph (``meta["val"]``) or a Dynamo graph (``meta["example_value"]``) records, made
    in the fake mode of the graph's values (``like``, one of them)."""
    graph = editor.graph
    mode, key = editor.fake_mode, "val"
    if mode is None:
        mode, key = getattr(like, "fake_mode", None), "example_value"

    def call(target, args: tuple, **kwargs) -> fx.Node:
        with graph.inserting_before(before):
            node = graph.call_function(target, args, kwargs)
        if mode is not None:
            with mode:
                node.meta[key] = target(*[node_value(a) for a in args], **kwargs)
        return node

    return call


def swap_site(editor, site, target, args: tuple) -> tuple[fx.Node, bool]:
    """Swap ``site``'s node for ``target(*args)``, whose args read the weight as stored
    (``site.weight_source``); a transpose view the site read it through (``x @ W.T``, experts
    stored [E, N, K]) that nothing else reads is erased. Returns (new node, whether it was)."""
    view = site.weight_node  # read before the swap
    new = editor.swap(site.node, target, args)
    dropped = site.stored_nk and not view.users
    if dropped:
        editor.graph.erase_node(view)
    return new, dropped


def _swap(graph: fx.Graph, node: fx.Node, target, args: tuple, fake_mode) -> fx.Node:
    """Replace ``node`` by ``target(*args)``, keeping its source metadata (module stack, stack
    trace, report row) and, in an exported graph, a fresh ``meta["val"]``."""
    with graph.inserting_before(node):
        new = graph.call_function(target, args)
    for key in COPIED_META:
        if key in node.meta:
            new.meta[key] = node.meta[key]
    if fake_mode is not None:
        with fake_mode:
            new.meta["val"] = target(*[node_value(a) for a in args])
    node.replace_all_uses_with(new)
    graph.erase_node(node)
    return new
