"""Planning: find every linear-like node and decide its scheme (or why it is skipped).

First pass of the data flow (plan → rewrite → fuse → lower). It reads the graph only. A *site* is a
node computing ``x @ W.T (+ b)`` with a constant W: ``aten.linear`` (``nn.Linear``, ``F.linear`` on
a bare parameter), ``aten.addmm``/``aten.mm``/``aten.matmul`` with W stored [K, N] (Hugging Face
``Conv1D``) or read through a transpose of W stored [N, K] (``x @ self.weight.T``: Falcon's
``FalconLinear``, hand-written linears), the torch-level spellings of the same calls that a Dynamo
graph holds; and a mixture-of-experts
``grouped_mm`` with a constant 3-D W [E, K, N], or the transpose of one stored [E, N, K]
(transformers' grouped experts: gpt-oss, Mixtral, Qwen3-MoE …), named after that parameter; and a
``bmm`` of x [E, T, K] with a constant 3-D W [E, K, N] (Llama 4's experts: every expert over the
same T rows), which the rewrite runs as the same grouped ops, each expert's T rows in turn. The
plan is data: the report prints it and the tests assert on it.
"""

from __future__ import annotations

import operator
import re
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxquant.core.config import EXPERT_SCHEMES, QuantConfig, Scheme

aten = torch.ops.aten

# target → (kind, index of x, index of W, index of bias or None); W of "mm" kinds is [K, N].
_LINEAR_TARGETS: dict[object, tuple[str, int, int, int | None]] = {
    aten.linear.default: ("linear", 0, 1, 2),
    torch._C._nn.linear: ("linear", 0, 1, 2),
    F.linear: ("linear", 0, 1, 2),
    aten.addmm.default: ("addmm", 1, 2, 0),
    torch.addmm: ("addmm", 1, 2, 0),
    aten.mm.default: ("mm", 0, 1, None),
    torch.mm: ("mm", 0, 1, None),
    aten.matmul.default: ("matmul", 0, 1, None),
    torch.matmul: ("matmul", 0, 1, None),
    operator.matmul: ("matmul", 0, 1, None),
}

# Mixture-of-experts GEMMs: x [S, K] (rows sorted by expert) · W [E, K, N] with ``offs`` [E]
# the experts' cumulative row ends, as transformers' grouped experts run them (``experts
# implementation`` "grouped_mm", its default): ``aten._grouped_mm`` or, where that cannot run,
# transformers' own custom op, matched by name so planning never imports transformers.
# A Dynamo graph holds the torch functions and transformers' op packet, offs as a keyword.
_GROUPED = ("grouped_mm", 0, 1, None)
_GROUPED_TARGETS = {
    aten._grouped_mm.default: _GROUPED,
    **({torch._grouped_mm: _GROUPED} if hasattr(torch, "_grouped_mm") else {}),
    **({F.grouped_mm: _GROUPED} if hasattr(F, "grouped_mm") else {}),
}
# transformers' grouped_mm fallback (a Python custom op), by name: what the CPU prepack rewrites
# where a config leaves the experts in float (passes/cpu/experts.py)
FALLBACK_OPS = ("transformers.grouped_mm_fallback.default", "transformers.grouped_mm_fallback")
_GROUPED_BY_NAME = dict.fromkeys(FALLBACK_OPS, _GROUPED)
# x [E, T, K] · W [E, K, N]: every expert's weight on the same T rows (Llama 4's
# Llama4TextExperts, which routes by scaling the rows: an expert a token did not choose sees it
# multiplied by 0). Quantized as grouped rows: x viewed [E·T, K], expert e's rows ending at (e+1)·T.
_BMM = ("bmm", 0, 1, None)
_BMM_TARGETS = {aten.bmm.default: _BMM, torch.bmm: _BMM}

FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def _spec(target) -> tuple[str, int, int, int | None] | None:
    """(kind, index of x, index of W, index of bias or None) of a site's target, or None."""
    spec = _LINEAR_TARGETS.get(target) or _GROUPED_TARGETS.get(target) or _BMM_TARGETS.get(target)
    if spec is None and isinstance(target, (torch._ops.OpOverload, torch._ops.OpOverloadPacket)):
        spec = _GROUPED_BY_NAME.get(str(target))
    return spec


# Looks up the constant behind a weight node: (fully qualified name, tensor) or None.
WeightLookup = Callable[[fx.Node], "tuple[str, torch.Tensor] | None"]


@dataclass
class Site:
    """One linear-like node with a constant weight."""

    node: fx.Node
    kind: str  # linear | addmm | mm | matmul | grouped_mm | bmm
    weight_fqn: str
    # as stored: [N, K] for linear, [K, N] otherwise ([E, K, N] for experts), or [N, K]
    # ([E, N, K]) when the node reads it through a transpose (``stored_nk``)
    weight: torch.Tensor
    stored_nk: bool = False

    # x and bias are read from the node each time: rewriting an earlier site (whose output is
    # this one's input) replaces the node they pointed to.
    @property
    def x(self) -> fx.Node:
        return self.node.args[_spec(self.node.target)[1]]

    @property
    def bias(self) -> fx.Node | None:
        bi = _spec(self.node.target)[3]
        if bi is not None and len(self.node.args) > bi:
            return self.node.args[bi]
        return self.node.kwargs.get("bias") if bi is not None else None

    @property
    def weight_node(self) -> fx.Node:
        return self.node.args[_spec(self.node.target)[2]]

    @property
    def weight_source(self) -> fx.Node:
        """The node holding the weight as stored: ``weight_node``, or the tensor it transposes."""
        return self.weight_node.args[0] if self.stored_nk else self.weight_node

    def weight_arg(self, stored: torch.Tensor) -> torch.Tensor:
        """The value the node's weight argument takes when the weight as stored is ``stored``
        (what a calibration run hands the node in place of the parameter it reads)."""
        return stored.transpose(-2, -1) if self.stored_nk else stored

    @property
    def offs(self) -> fx.Node | None:
        """A grouped site's cumulative row ends per expert (None for the other kinds)."""
        if self.kind != "grouped_mm":
            return None
        return self.node.args[2] if len(self.node.args) > 2 else self.node.kwargs.get("offs")

    @property
    def experts(self) -> int | None:
        return self.weight.shape[0] if self.kind in ("grouped_mm", "bmm") else None

    @property
    def transposed(self) -> bool:
        return self.kind != "linear" and not self.stored_nk

    @property
    def out_features(self) -> int:
        return self.weight.shape[-1 if self.transposed else -2]

    @property
    def in_features(self) -> int:
        return self.weight.shape[-2 if self.transposed else -1]

    @property
    def module_name(self) -> str:
        """The calling ``nn.Linear``'s name when the node records it, else the weight's owner:
        a weight tied to an embedding (lm_head) is named after the embedding in a Dynamo graph,
        which first met it there, but the linear that uses it is still ``lm_head``."""
        return _linear_module_name(self.node) or self.weight_fqn.removesuffix(".weight")

    def weight_nk(self) -> torch.Tensor:
        """The weight as [N, K] ([E, N, K] for experts), the layout every fxquant op takes."""
        return self.weight.transpose(-2, -1) if self.transposed else self.weight


@dataclass
class LayerPlan:
    """The decision for one site: a scheme, or ``None`` and the reason it stays in float."""

    site: Site
    scheme: Scheme | None
    reason: str

    @property
    def name(self) -> str:
        return self.site.module_name


def _linear_module_name(node: fx.Node) -> str | None:
    stack = node.meta.get("nn_module_stack")
    if not stack:
        return None
    path, cls = list(stack.values())[-1]
    is_linear = (
        issubclass(cls, torch.nn.Linear) if isinstance(cls, type) else str(cls).endswith("Linear")
    )
    if not is_linear or not isinstance(path, str):
        return None
    if not path.startswith("L["):
        return path  # torch.export: already the fully qualified name
    # Dynamo: L['self'].layers.0.q_proj, L['self']._modules['fc'], L['fn'][0], and through a
    # forward wrapper's bound method (contextual_fp8_autocast): L['model_forward'].__self__.fc
    parts = re.findall(r"\['([^']*)'\]|\[(\d+)\]|\.(\w+)", path)
    names = [a or b or c for a, b, c in parts][1:]  # the first is the root
    return ".".join(
        n for n in names if n not in ("_modules", "_parameters", "_buffers", "__self__")
    )


def node_value(node: object):
    """The (fake) value a node produces, in an exported graph or a Dynamo graph."""
    if not isinstance(node, fx.Node):
        return node
    return node.meta.get("val", node.meta.get("example_value"))


def find_sites(graph: fx.Graph, weight_of: WeightLookup) -> list[Site]:
    """Every linear-like node whose weight is a constant (parameter, buffer or lifted constant)."""
    sites = []
    for node in graph.nodes:
        spec = _spec(node.target) if node.op == "call_function" else None
        if spec is None:
            continue
        kind, _, wi, _ = spec
        args = node.args
        if len(args) <= wi or not isinstance(args[wi], fx.Node):
            continue
        found, stored_nk = weight_of(args[wi]), False
        if found is None and kind != "linear":
            # W [N, K] read through a transpose: ``x @ self.weight.T``; most transformers MoE
            # models store experts [E, N, K] and pass W.transpose(-2, -1)
            source = _transposed_last_two(args[wi])
            found, stored_nk = (None, False) if source is None else (weight_of(source), True)
        if found is None:
            continue
        fqn, weight = found
        if weight.dim() != (3 if kind in ("grouped_mm", "bmm") else 2):
            continue
        if kind == "addmm" and (
            node.kwargs.get("beta", 1) != 1 or node.kwargs.get("alpha", 1) != 1
        ):
            continue
        sites.append(Site(node, kind, fqn, weight, stored_nk))
    return sites


# How a graph spells a view that swaps dims: an exported graph's ATen ops, a Dynamo graph's torch
# functions and tensor methods (and ``getattr`` calls for ``W.T`` / ``W.mT``).
_SWAPS: dict[object, str] = {
    aten.transpose.int: "transpose",
    torch.transpose: "transpose",
    "transpose": "transpose",
    aten.permute.default: "permute",
    torch.permute: "permute",
    "permute": "permute",
    aten.t.default: "t",
    torch.t: "t",
    "t": "t",
    aten.numpy_T.default: "t",  # reverses every dim: a swap for a 2-D weight only
    aten.mT.default: "mT",
}


def _transposed_last_two(node: fx.Node) -> fx.Node | None:
    """The tensor node whose last two dims ``node`` swaps (and no other dim), or None."""
    if node.op == "call_function" and node.target is getattr and len(node.args) == 2:
        src, rest, how = node.args[0], (), {"T": "t", "mT": "mT"}.get(node.args[1])
    elif node.op in ("call_function", "call_method") and node.args:
        src, rest, how = node.args[0], node.args[1:], _SWAPS.get(node.target)
    else:
        return None
    value = node_value(src) if isinstance(src, fx.Node) else None
    if how is None or node.kwargs or not isinstance(value, torch.Tensor) or value.dim() < 2:
        return None
    rank = value.dim()
    if how == "transpose":
        ok = len(rest) == 2 and all(isinstance(d, int) for d in rest)
        ok = ok and {d % rank for d in rest} == {rank - 2, rank - 1}
    elif how == "permute":
        perm = rest[0] if len(rest) == 1 and isinstance(rest[0], (list, tuple)) else rest
        swapped = [*range(rank - 2), rank - 1, rank - 2]
        ok = all(isinstance(d, int) for d in perm) and [d % rank for d in perm] == swapped
    else:
        ok = how == "mT" or rank == 2
    return src if ok else None


def plan_sites(
    sites: list[Site],
    config: QuantConfig,
    *,
    choose: Callable[[Site], tuple[Scheme | None, str]] | None = None,
) -> list[LayerPlan]:
    """Decide each site's scheme from the config (or ``choose``, which FP8 regions pass) and
    what the shapes allow."""
    plans = []
    for site in sites:
        scheme, why = (choose or (lambda s: config.scheme_for(s.module_name)))(site)
        if scheme is not None:
            problem = _shape_problem(site, scheme)
            if problem is not None:
                scheme, why = None, problem
        plans.append(LayerPlan(site, scheme, why))
    return plans


def _shape_problem(site: Site, scheme: Scheme) -> str | None:
    """Why the scheme cannot take this site as it is, or None (the ``extra_check`` of a match)."""
    w, x = site.weight, node_value(site.x)
    if w.dtype not in FLOAT_DTYPES:
        return f"weight dtype {w.dtype} is not floating point"
    if not isinstance(x, torch.Tensor):
        return "the input has no recorded tensor value"
    if x.dtype not in FLOAT_DTYPES:
        return f"input dtype {x.dtype} is not floating point"
    if x.dim() < 1 or (isinstance(x.shape[-1], int) and x.shape[-1] != site.in_features):
        return f"input shape {tuple(x.shape)} does not end in K={site.in_features}"
    if site.kind == "matmul" and x.dim() < 2:
        return "matmul of a vector"
    if site.kind in ("grouped_mm", "bmm"):
        problem = _experts_problem(site, scheme, x)
        if problem is not None:
            return problem
    if site.bias is not None:
        b = node_value(site.bias)
        if not isinstance(b, torch.Tensor) or tuple(b.shape) != (site.out_features,):
            shape = tuple(b.shape) if isinstance(b, torch.Tensor) else b
            return f"bias of shape {shape} is not a per-output-channel [N] vector"
    return scheme.unsupported_reason(out_features=site.out_features, in_features=site.in_features)


def _experts_problem(site: Site, scheme: Scheme, x: torch.Tensor) -> str | None:
    node = site.node
    if site.kind == "bmm":
        # every expert over the same rows: x [E, T, K], its E the weight's (a static size)
        if x.dim() != 3 or x.shape[0] != site.experts:
            return f"bmm of an input of shape {tuple(x.shape)}, not [{site.experts}, T, K]"
        return _experts_scheme_problem(scheme, "bmm")
    # torch's grouped_mm also takes a bias and an out dtype (torch 2.13 refuses both, but for
    # bf16 out), transformers' op neither: the fxquant op has no bias and returns x's dtype
    if str(node.target) not in _GROUPED_BY_NAME:
        bias = node.args[3] if len(node.args) > 3 else node.kwargs.get("bias")
        out_dtype = node.args[4] if len(node.args) > 4 else node.kwargs.get("out_dtype")
        if bias is not None or out_dtype not in (None, x.dtype):
            return "grouped_mm with a bias or an out_dtype other than its input's"
    if site.offs is None or x.dim() != 2:
        return f"grouped_mm of a {x.dim()}-D input or without offsets (only 2-D x with offs)"
    return _experts_scheme_problem(scheme, "grouped_mm")


def _experts_scheme_problem(scheme: Scheme, kind: str) -> str | None:
    if scheme.takes_experts:
        return None
    return (
        f"expert weights ([E, K, N], {kind}) take only {EXPERT_SCHEMES}, "
        f"not {type(scheme).__name__}"
    )
