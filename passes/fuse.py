"""Norm → quantize fusion: one op normalizes the activation and quantizes it for all its linears.

Third pass of the data flow (plan → rewrite → fuse → lower). After the rewrite, a decoder block
computes its RMSNorm once and then q, k and v (or gate and up) each quantize that same output
again, per token: the normed activation is written, read back three times and quantized three
times identically. Where every user of a norm's output is a dynamic-activation ``fxquant::``
linear that quantizes it the same way, this pass replaces the norm and those quantizers by one
``fxquant::norm_quant`` whose (q, scale) outputs feed ``fxquant::*_scaled_linear`` GEMMs. In the
reference math a dynamic-activation linear *is* its activation quantizer followed by its scaled
linear, so nothing else changes.

Norms are matched as ``torch.export`` and Dynamo leave them (checked on real graphs):

- ``nn.LayerNorm``/``F.layer_norm``: ``aten.layer_norm`` (``F.layer_norm`` in a Dynamo graph;
  ``torch.export`` keeps it whole, and a program decomposed further has no linears to fuse with:
  they become ``addmm`` of a permuted weight behind a ``view``);
- ``nn.RMSNorm``/``F.rms_norm``: ``aten.rms_norm`` (``torch.rms_norm`` in a Dynamo graph), its
  ``eps=None`` meaning the epsilon of fp32, the dtype it computes in;
- RMSNorm written out, ``x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w``, including Hugging
  Face's LlamaRMSNorm: ``x.to(float32)`` first, ``.to(input dtype)`` before ``w * ...``. The
  ``_assert_tensor_metadata`` checks export puts after each cast go with them.

Every piece is verified before anything is fused: the reduction is over the last dim only with
keepdim, eps is a number, weight and bias are 1-D constants of size K, the norm's own nodes are
used nowhere else, and it returns x's dtype. A norm that fails a check is left as it is.

Numerics: the fused op computes the norm in fp32 and rounds once to x's dtype
(``reference.norm_quant``). In fp32 every spelling above computes exactly that, so fused and
unfused programs agree bit for bit. In bf16/fp16 a spelling that rounds between its steps (the
hand-written one, or HF's ``w * normed`` in bf16) differs from the fused op by those roundings.

Per-tensor fp8 is never fused: its scale is the amax of the whole tensor, known only once every
row of the norm is written, so no single pass can quantize rows as it normalizes them.

Each fused norm bumps ``counters["fuse.norm_quant"]``, and its linears' report rows get
``fused_norm``. Every norm that feeds an activation-quantizing linear leaves a record (fused, or
why not) in ``node.meta["custom"][NORM_KEY]``, which ``torch.export.save`` keeps and
``fxquant.report`` prints.
"""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

import fxquant.core.ops  # noqa: F401  (registers the fxquant:: ops)
from fxquant.core.row import LayerRow
from fxquant.core.scheme import OPS, ActivationQuant, Scheme, named_args
from fxquant.passes.plan import FLOAT_DTYPES, node_value
from fxquant.passes.rewrite import COPIED_META, counters

__all__ = ["NORM_KEY", "ActivationQuant", "fuse_norms"]

aten = torch.ops.aten
fxq = torch.ops.fxquant

NORM_KEY = "fxquant_norm"  # node.meta["custom"][NORM_KEY]: the norm's fusion record, as JSON

# --------------------------------------------------------------------------------------------
# Consumers: the dynamic-activation linears. Each scheme declares how its op quantizes the
# activation and which scaled linear it becomes once norm_quant has done that
# (``Scheme.activation_quant`` / ``Scheme.scaled_linear``, reading the op's arguments by name).
# --------------------------------------------------------------------------------------------


def _consumer(node: fx.Node) -> tuple[type[Scheme], dict] | None:
    """(the scheme whose op ``node`` calls, its arguments by name) when that op quantizes its
    activation in a way a norm_quant can take over; else None."""
    target = node.target if node.op == "call_function" else None
    if not isinstance(target, torch._ops.OpOverload) or target.namespace != "fxquant":
        return None
    cls = OPS.get(target._opname)
    if cls is None:
        return None
    args = named_args(target, node.args, node.kwargs)
    return None if cls.activation_quant(args) is None else (cls, args)


# --------------------------------------------------------------------------------------------
# Matching: the spellings of each step of a norm in an exported graph (aten) and in a Dynamo
# graph (torch functions, operators and tensor methods).
# --------------------------------------------------------------------------------------------

_FUNCTION_ROLES = {
    aten.mul.Tensor: "mul",
    operator.mul: "mul",
    torch.mul: "mul",
    aten.add.Tensor: "add",
    aten.add.Scalar: "add",
    operator.add: "add",
    torch.add: "add",
    aten.rsqrt.default: "rsqrt",
    torch.rsqrt: "rsqrt",
    aten.mean.dim: "mean",
    torch.mean: "mean",
    aten.pow.Tensor_Scalar: "pow",
    torch.pow: "pow",
    operator.pow: "pow",
    aten.to.dtype: "cast",
    aten._to_copy.default: "cast",
    aten.layer_norm.default: "layer_norm",
    torch.layer_norm: "layer_norm",
    F.layer_norm: "layer_norm",
    aten.rms_norm.default: "rms_norm",
    torch.rms_norm: "rms_norm",
    F.rms_norm: "rms_norm",
}
_METHOD_ROLES = {
    "mul": "mul",
    "add": "add",
    "rsqrt": "rsqrt",
    "mean": "mean",
    "pow": "pow",
    "to": "cast",
    "float": "cast",
}
# Nodes that only check a value (export adds one after each dtype cast): they go with the norm.
_CHECKS = (aten._assert_tensor_metadata.default,)


def _role(node: object) -> str | None:
    if not isinstance(node, fx.Node):
        return None
    if node.op == "call_function":
        return _FUNCTION_ROLES.get(node.target)
    if node.op == "call_method":
        return _METHOD_ROLES.get(node.target)
    return None


def _arg(node: fx.Node, index: int, name: str, default=None):
    return node.args[index] if len(node.args) > index else node.kwargs.get(name, default)


def _is_number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


@dataclass
class NormMatch:
    """A verified norm: ``out`` = norm(x) with these parameters, computed by ``nodes``."""

    out: fx.Node
    x: fx.Node
    weight: fx.Node | None
    bias: fx.Node | None
    eps: float
    rms: bool
    nodes: list[fx.Node]  # the norm's own nodes, ``out`` last; each is removed once unused

    @property
    def kind(self) -> str:
        return "rms_norm" if self.rms else "layer_norm"


def match_norm(editor, out: fx.Node) -> NormMatch | str | None:
    """The norm whose output is ``out``; a reason string when it is one but fails a check;
    ``None`` when ``out`` is not a norm at all."""
    found = _match_norm_op(out)
    if found is None:
        found = _match_rms_written_out(out)
    if found is None or isinstance(found, str):
        return found
    return _verify(editor, found)


def _match_norm_op(out: fx.Node) -> NormMatch | str | None:
    """``aten.layer_norm`` / ``aten.rms_norm`` (or their torch spellings)."""
    if _role(out) not in ("layer_norm", "rms_norm"):
        return None
    rms = _role(out) == "rms_norm"
    x, shape, weight = out.args[0], _arg(out, 1, "normalized_shape"), _arg(out, 2, "weight")
    if not isinstance(node_value(x), torch.Tensor):
        return "its input has no recorded tensor value"
    if rms:
        bias, eps = None, _arg(out, 3, "eps")
        if eps is None:  # aten.rms_norm computes in fp32 (opmath) and uses that type's epsilon
            eps = torch.finfo(torch.promote_types(node_value(x).dtype, torch.float32)).eps
    else:
        bias, eps = _arg(out, 3, "bias"), _arg(out, 4, "eps", 1e-5)
    k = node_value(x).shape[-1]
    if len(shape) != 1 or shape[0] != k:
        return f"it normalizes over the last {len(shape)} dims {list(shape)}, not only K={k}"
    return NormMatch(out, x, weight, bias, eps, rms, [out])


def _match_rms_written_out(out: fx.Node) -> NormMatch | str | None:
    """``[w *] [to(dtype)] (xf * rsqrt(mean(xf ** 2, -1, keepdim) + eps))``, xf = [to(fp32)](x)."""
    weight, node = None, out
    if _role(out) == "mul" and not any(_role(a) == "rsqrt" for a in out.args[:2]):
        a, b = out.args[:2]
        # The weight is whichever side is not the normalized x; _verify checks it is a constant.
        weight, node = (b, a) if _role(a) in ("mul", "cast") else (a, b)
    cast = node if _role(node) == "cast" else None
    core = node.args[0] if cast is not None else node
    if _role(core) != "mul":
        return None
    a, b = core.args[:2]
    rsqrt, xf = (a, b) if _role(a) == "rsqrt" else (b, a)
    if _role(rsqrt) != "rsqrt" or not isinstance(node_value(xf), torch.Tensor):
        return None
    # From here on it is an RMSNorm by its shape; what does not fit is a reason.
    add = rsqrt.args[0]
    if _role(add) != "add" or add.kwargs:
        return "rsqrt of something other than mean(x²) + eps"
    mean, eps = add.args[:2]
    if _is_number(mean):
        mean, eps = eps, mean
    if not _is_number(eps):
        return "eps is not a constant number"
    if _role(mean) != "mean" or _role(mean.args[0]) != "pow":
        return "rsqrt of something other than mean(x²) + eps"
    power = mean.args[0]
    if power.args[0] is not xf or _arg(power, 1, "exponent") != 2:
        return "the mean is not over the square of the normalized tensor"
    dims = _arg(mean, 1, "dim")
    dims = list(dims) if isinstance(dims, (list, tuple)) else [dims]
    ndim = node_value(xf).dim()
    if dims not in ([-1], [ndim - 1]) or not _arg(mean, 2, "keepdim", False):
        return f"the mean is over dims {dims} (keepdim={_arg(mean, 2, 'keepdim', False)}), not -1"
    if mean.kwargs.get("dtype") is not None:
        return "the mean changes dtype"
    x, nodes = xf, [power, mean, add, rsqrt, core]
    if _role(xf) == "cast" and node_value(xf).dtype == torch.float32:
        x, nodes = xf.args[0], [xf, *nodes]  # HF: x.to(float32) first
    nodes += [n for n in dict.fromkeys((cast, out)) if n is not None and n is not core]
    return NormMatch(out, x, weight, None, float(eps), True, nodes)


def _verify(editor, m: NormMatch) -> NormMatch | str:
    """What a pattern cannot say: dtypes, constant 1-D parameters, no users outside the norm."""
    x, out = node_value(m.x), node_value(m.out)
    if not isinstance(x, torch.Tensor) or x.dtype not in FLOAT_DTYPES:
        return "its input is not an fp32, bf16 or fp16 tensor"
    if out.dtype != x.dtype or out.device != x.device:
        return f"it turns {x.dtype} into {out.dtype}; the fused op returns its input's dtype"
    k = x.shape[-1]
    for role, p in (("weight", m.weight), ("bias", m.bias)):
        if p is None:
            continue
        found = editor.weight_of(p) if isinstance(p, fx.Node) else None
        if found is None:
            return f"its {role} is computed in the graph, not a constant"
        t = found[1]
        if t.dim() != 1 or t.shape[0] != k or not t.is_floating_point():
            return f"its {role} has shape {tuple(t.shape)} and dtype {t.dtype}, not float [{k}]"
    if not _is_number(m.eps):
        return f"eps={m.eps!r} is not a number"
    inside = set(m.nodes)
    for n in m.nodes[:-1]:
        if n is m.nodes[0] and n is not m.x and _role(n) == "cast" and n.args[0] is m.x:
            continue  # HF's x.to(float32) may also feed the residual; it stays for that
        others = [u for u in n.users if u not in inside and u.target not in _CHECKS]
        if others:
            return f"its intermediate {n.name} is also used by {others[0].name}"
    return m


# --------------------------------------------------------------------------------------------
# The pass
# --------------------------------------------------------------------------------------------


def fuse_norms(editor) -> list[dict]:
    """Fuse each norm whose output only feeds linears that quantize it the same way.

    Args:
        editor: a ``ProgramEditor`` or ``DynamoEditor`` (``fxquant.passes.rewrite``) on which
            the rewrite pass has run.

    Returns:
        One record per norm feeding an activation-quantizing linear: ``name``, ``kind``,
        ``status`` ("fused" or "not fused"), ``reason`` (None when fused), ``linears`` and
        ``activation``; the same record is stored in the graph for the report.
    """
    graph = editor.graph
    # Collected first: fusing erases the consumers this loop would otherwise visit.
    outs = list(
        dict.fromkeys(
            n.args[0]
            for n in graph.nodes
            if _consumer(n) is not None and isinstance(n.args[0], fx.Node)
        )
    )
    # Users in graph order (a node's users are in the order the rewrite made them), so records
    # and reasons name the linears as the model lists them.
    position = {n: i for i, n in enumerate(graph.nodes)}
    records = []
    for out in outs:
        m = match_norm(editor, out)
        if m is None:
            continue
        users = sorted(out.users, key=position.__getitem__)
        name = _norm_name(editor, m if isinstance(m, NormMatch) else None, out)
        record = {"name": name, "kind": None, "status": "not fused", "reason": None}
        record["activation"] = None
        record["linears"] = [_describe(u, short=True) for u in users if LayerRow.from_node(u)]
        if isinstance(m, str):
            record["reason"] = m
        else:
            record["kind"] = m.kind
            quant = _common_quant(out, users)
            if isinstance(quant, str):
                record["reason"] = quant
            else:
                record.update(status="fused", activation=str(quant))
                _fuse(editor, m, quant, record)
                counters["fuse.norm_quant"] += 1
        if record["status"] != "fused":
            out.meta["custom"] = {**_custom(out), NORM_KEY: json.dumps(record, sort_keys=True)}
        records.append(record)
    return records


def _common_quant(out: fx.Node, users: list[fx.Node]) -> ActivationQuant | str:
    """The one activation quantization all ``users`` of ``out`` apply to it, or why there is
    none."""
    quants: dict[fx.Node, ActivationQuant] = {}
    for user in users:
        found = _consumer(user)
        if found is None or user.args[0] is not out or out in user.args[1:]:
            return f"its output is also read by {_describe(user)}"
        cls, args = found
        quant = cls.activation_quant(args)
        if isinstance(quant, str):
            return f"{_describe(user, short=True)} {quant}"
        quants[user] = quant
    if len(set(quants.values())) > 1:
        return "its linears quantize the activation differently: " + ", ".join(
            f"{_describe(u, short=True)} {q}" for u, q in quants.items()
        )
    return next(iter(quants.values()))


def _fuse(editor, m: NormMatch, quant: ActivationQuant, record: dict) -> None:
    graph = editor.graph
    out_dtype = node_value(m.out).dtype
    q_args = (quant.quant_dtype, quant.group_size, quant.scale_ub)
    args = (m.x, m.weight, m.bias, m.eps, m.rms, *q_args)
    with graph.inserting_after(m.out):
        fused = graph.call_function(fxq.norm_quant.default, args)
    with graph.inserting_after(fused):
        q = graph.call_function(operator.getitem, (fused, 0))
    with graph.inserting_after(q):
        scale = graph.call_function(operator.getitem, (fused, 1))
    for new in (fused, q, scale):
        for key in COPIED_META:
            if key in m.out.meta and key != "custom":
                new.meta[key] = m.out.meta[key]
    if editor.fake_mode is not None:
        with editor.fake_mode:
            val = fxq.norm_quant.default(*[node_value(a) for a in args])
        fused.meta["val"], q.meta["val"], scale.meta["val"] = val, val[0], val[1]
    fused.meta["custom"] = {NORM_KEY: json.dumps(record, sort_keys=True)}
    for user in list(m.out.users):
        cls, user_args = _consumer(user)
        op, new_args = cls.scaled_linear(q, scale, user_args, out_dtype)
        new = editor.swap(user, op, new_args)
        row = LayerRow.from_node(new)
        if row is not None:  # None: an op the rewrite did not place (the from_pretrained bridge's)
            row.replace(fused_norm=record["name"]).store(new)
    # The norm's own nodes, last first, with the checks export hung on them; one still in use
    # (HF's x.to(float32), also read by the residual) stays.
    for node in reversed(m.nodes):
        checks = [u for u in node.users if u.target in _CHECKS]
        if len(checks) == len(node.users):
            for check in checks:
                graph.erase_node(check)
            graph.erase_node(node)


def _custom(node: fx.Node) -> dict:
    return node.meta.get("custom") or {}


def _norm_name(editor, m: NormMatch | None, out: fx.Node) -> str:
    """The norm's module name: its weight's name without ``.weight`` (the way linear rows are
    named), else the innermost module export recorded, else the node's name."""
    if m is not None and isinstance(m.weight, fx.Node):
        found = editor.weight_of(m.weight)
        if found is not None:
            return found[0].removesuffix(".weight")
    stack = out.meta.get("nn_module_stack")
    path = list(stack.values())[-1][0] if stack else ""
    return path or out.name  # "" is the root module: a functional norm in its forward


def _describe(node: fx.Node, *, short: bool = False) -> str:
    """A consumer as the report names it: the linear's layer name (and what it does with its
    activation), else the op."""
    row = LayerRow.from_node(node)
    if row is not None:
        if short:
            return row.name
        if row.status == "skipped":
            return f"{row.name}, kept in float ({row.reason})"
        return f"{row.name}, a {row.scheme['type']} linear (float activation)"
    if node.op == "output":
        return "the program's output"
    if isinstance(node.target, torch._ops.OpOverload):
        return str(node.target)  # aten.add.Tensor
    return getattr(node.target, "__name__", str(node.target))
