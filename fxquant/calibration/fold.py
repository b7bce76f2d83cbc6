"""Where a per-input-channel scale can be folded: the op that produced a linear's input.

Used by AWQ (``fxquant/calibration/awq.py``) and SmoothQuant
(``fxquant/calibration/smoothquant.py``) through ``fxquant.calibrate``. Both multiply the weights
of the linears that share one input ``x`` by a per-input-channel ``s`` and divide ``x`` by ``s``;
the float model is unchanged only if the op that produced ``x`` can take the ``1/s`` into its own
parameters:

- a norm whose last step is ``x̂ · γ`` (RMSNorm, as HF Llama writes it) or ``aten.layer_norm``
  with an affine weight (and bias): ``γ /= s`` (and ``β /= s``);
- a linear whose output reaches ``x`` channel-for-channel: ``x`` *is* its output, or
  ``x = a * linear(...)`` elementwise (Llama's ``silu(gate) * up`` → ``down``), or
  ``x = A @ linear(...)`` (attention probabilities times V → ``o_proj``, when V is not reshaped
  into heads on the way): its weight rows (and bias) ``/= s``.

The answer is read from the exported graph, not from module classes, so it holds for any model
that spells these ops the same way; anything else is reported as the reason the group is left
alone. Folding is only legal when ``x`` feeds nothing but the group's linears and each folded
parameter feeds nothing but that op; both are checked.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx

from fxquant.passes.plan import Site, node_value

aten = torch.ops.aten

__all__ = ["Absorber", "find_absorber"]


@dataclass
class Absorber:
    """The op that takes ``1/s``: which parameters to divide, along which dim."""

    kind: str  # "norm" | "linear"
    name: str  # the op's node name or the absorbing linear's weight, for the report
    params: list[tuple[str, int]]  # (parameter fqn, dim indexing the K channels of x)


def find_absorber(
    x: fx.Node,
    group: list[Site],
    sites_by_node: dict[fx.Node, Site],
    param_of,
    *,
    allow_linear: bool,
) -> Absorber | str:
    """The op before ``x`` that can absorb ``1/s`` for the linears ``group``, or why none can.

    Args:
        x: the input node the group's linears share.
        group: the sites reading ``x``.
        sites_by_node: every linear-like site of the graph by its node.
        param_of: ``node -> (fqn, tensor) | None`` for parameter/buffer placeholders.
        allow_linear: also fold into a preceding linear (AWQ), not only into norms.
    """
    k = group[0].in_features
    group_nodes = {s.node for s in group}
    others = [u for u in x.users if u not in group_nodes]
    if others:
        return f"its input {x.name} also feeds {others[0].name}, which would see the scaled input"

    def sole_param(node, shape) -> str | None:
        found = param_of(node) if isinstance(node, fx.Node) else None
        if found is None or len(node.users) != 1 or tuple(found[1].shape) != shape:
            return None
        return found[0]

    if x.target == aten.mul.Tensor:
        a, b = x.args[:2]
        for gamma, other in ((a, b), (b, a)):
            fqn = sole_param(gamma, (k,))
            if fqn is not None and isinstance(other, fx.Node) and param_of(other) is None:
                return Absorber("norm", x.name, [(fqn, 0)])
    if x.target == aten.layer_norm.default:
        weight = x.args[2] if len(x.args) > 2 else None
        bias = x.args[3] if len(x.args) > 3 else None
        w_fqn = sole_param(weight, (k,))
        if w_fqn is None:
            return f"LayerNorm {x.name} has no affine weight of its own to absorb the scale"
        params = [(w_fqn, 0)]
        if bias is not None:
            b_fqn = sole_param(bias, (k,))
            if b_fqn is None:
                return f"LayerNorm {x.name}'s bias is shared or not a parameter"
            params.append((b_fqn, 0))
        return Absorber("norm", x.name, params)
    if not allow_linear:
        return f"its input comes from {_describe(x)}, not a norm with its own weight"

    # A preceding linear whose output channels are x's channels.
    candidates = []
    if x in sites_by_node:
        candidates = [x]
    elif x.target == aten.mul.Tensor:
        candidates = [a for a in x.args[:2] if a in sites_by_node and _last_dim(a) == k]
        other = [a for a in x.args[:2] if a not in candidates]
        if len(candidates) == 1 and other and _last_dim(other[0]) not in (k, 1, None):
            candidates = []
    elif x.target in (aten.matmul.default, aten.bmm.default) and x.args[1] in sites_by_node:
        candidates = [x.args[1]]
    if len(candidates) != 1:
        return f"its input comes from {_describe(x)}, which cannot absorb a per-channel scale"
    prev = sites_by_node[candidates[0]]
    if prev.node is not x and len(prev.node.users) != 1:
        return f"{prev.weight_fqn}'s output also feeds other ops"
    if prev.out_features != k:
        return f"{prev.weight_fqn} has {prev.out_features} outputs, not this input's {k}"
    w_fqn = sole_param(prev.weight_source, tuple(prev.weight.shape))
    if w_fqn is None:
        return f"{prev.weight_fqn} is shared with other ops"
    params = [(w_fqn, 1 if prev.transposed else 0)]
    if prev.bias is not None:
        b_fqn = sole_param(prev.bias, (k,))
        if b_fqn is None:
            return f"{prev.weight_fqn}'s bias is shared or not a parameter"
        params.append((b_fqn, 0))
    return Absorber("linear", prev.weight_fqn, params)


def _last_dim(node) -> int | None:
    v = node_value(node)
    return int(v.shape[-1]) if isinstance(v, torch.Tensor) and v.dim() else None


def _describe(node: fx.Node) -> str:
    target = getattr(node.target, "__name__", str(node.target))
    return f"{target} ({node.name})"
