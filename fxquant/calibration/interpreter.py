"""The calibration interpreter: the exported graph, run node by node over the calibration
samples, with each planned linear's inputs in hand when the run reaches it.

Where this sits: ``fxquant.calibrate`` (``fxquant/calibration/api.py``) plans the program as
``fxquant.quantize`` would, then builds a ``CalibrationRun`` of the method's driver
(``GPTQRun``, ``AWQRun``, ``SmoothQuantRun``, one module each) and runs it. The graph is
interpreted over all samples at each node before the next, so each planned linear is met once, in
graph order, with the real inputs of every sample. The linears that read one input node form a
group; when the run reaches a group, the driver's ``calibrate_group`` sees that input's values
(``_stats``: the moments of ``input_moments``) and may

- fold a per-channel scale into the op before the input (``_fold``, into the op that
  ``fxquant/calibration/fold.py`` found), which rescales the input's values already computed;
- give a linear the weight it computes with from then on (``override``: GPTQ's dequantized
  weight, so later layers see what the quantized model gives them);
- record what it did for the layer's report row (``records``), or why it left the layer to
  round-to-nearest (``_skip``).

Only the nodes that lead to a planned linear are run (the logits are never computed), and each
value is dropped after its last use. Parameters are read from the run's own ``state`` when used,
so a folded scale is seen by every later node; the program itself is never modified.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from fxquant.core.scheme import QuantizedWeight
from fxquant.passes.plan import LayerPlan, Site

__all__ = ["CalibrationRun", "input_moments"]


@dataclass(frozen=True)
class _Param:
    """A placeholder for a parameter/buffer/constant: read from the run's state when used, so a
    folded scale is seen by every later node."""

    fqn: str


@dataclass(frozen=True)
class _Same:
    """A value that does not depend on the sample."""

    value: Any


def input_moments(values: list[torch.Tensor], k: int, *, first_token_weight: float = 1.0) -> dict:
    """Σ = XᵀX/n, mean |x| and max |x| per channel, and n, over every token of ``values`` (one
    linear's inputs [..., K], one tensor per sample): what GPTQ, AWQ and SmoothQuant see.

    With ``first_token_weight`` w ≠ 1 the first position of each sequence (index 0 of dim -2 of
    a 3-D or higher input) counts w times in Σ, mean |x| and n, as if it were there w times;
    max |x| is unweighted and ``"tokens"`` is the real count."""
    w0 = first_token_weight
    xtx, absum, amax, n, tokens = torch.zeros(k, k), torch.zeros(k), torch.zeros(k), 0.0, 0
    for v in values:
        v = v.detach().float()
        first = v.select(-2, 0).reshape(-1, k) if w0 != 1.0 and v.dim() >= 3 else None
        v = v.reshape(-1, k)
        xtx += v.t() @ v
        absum += v.abs().sum(0)
        amax = torch.maximum(amax, v.abs().amax(0))
        n += v.shape[0]
        tokens += v.shape[0]
        if first is not None:  # the first positions w - 1 more times
            xtx += (w0 - 1.0) * (first.t() @ first)
            absum += (w0 - 1.0) * first.abs().sum(0)
            n += (w0 - 1.0) * first.shape[0]
    n = max(n, 1.0)
    return {"sigma": xtx / n, "absmean": absum / n, "absmax": amax, "tokens": tokens}


class CalibrationRun:
    """One calibration run of one method over one program: the interpreter and the run's state.
    A method's driver subclasses it and defines ``calibrate_group`` (and ``check``)."""

    def __init__(self, editor, ep, plans, method, samples, *, progress: bool) -> None:
        self.editor, self.ep, self.method, self.samples = editor, ep, method, samples
        self.plans = plans
        self.progress = progress
        self.state: dict[str, torch.Tensor] = {**editor.constants, **editor.state_dict}
        self.changed: set[str] = set()
        self.records: dict[str, dict] = {}
        self.weights: dict[str, QuantizedWeight] = {}
        self.override: dict[fx.Node, torch.Tensor] = {}  # site node → weight it computes with
        self.sites_by_node: dict[fx.Node, Site] = {p.site.node: p.site for p in plans}
        self.weight_uses: dict[str, int] = {}
        for p in plans:
            self.weight_uses[p.site.weight_fqn] = self.weight_uses.get(p.site.weight_fqn, 0) + 1
        # Linears reading one input node form a group; groups with a planned linear are run.
        groups: dict[fx.Node, list[LayerPlan]] = {}
        for p in plans:
            if p.site.experts is not None:
                # every method's statistics are per linear ([N, K] and the rows it reads); an
                # expert's rows are a data-dependent slice of x (grouped_mm) or every row scaled
                # by the router's score for that expert, 0 where it was not chosen (bmm)
                self._skip(p, f"expert weights ({p.site.kind}) are not calibrated")
                continue
            groups.setdefault(p.site.x, []).append(p)
        self.groups = {x: g for x, g in groups.items() if any(p.scheme for p in g)}
        self.group_of = {p.site.node: x for x, g in self.groups.items() for p in g}

    # ------------------------------------------------------------------ what a driver defines

    def check(self) -> None:
        """Raise before any sample runs if the plan asks for what the method cannot do."""

    def calibrate_group(self, x: fx.Node, group: list[LayerPlan]) -> None:
        """Calibrate the linears ``group`` that read ``x``; called once, before they run."""
        raise NotImplementedError

    def also_run(self) -> list[fx.Node]:
        """Nodes to run besides those that lead to a planned linear (AutoRound: whole blocks,
        whose outputs its loss reads); their inputs then stay alive until they run."""
        return []

    def before_node(self, node: fx.Node) -> None:
        """Called before ``node`` runs, after every node before it (AutoRound tunes a block
        when the run reaches its first node)."""

    # ------------------------------------------------------------------ running the graph

    def run(self) -> None:
        from tqdm.auto import tqdm

        graph = self.editor.graph
        needed: set[fx.Node] = set()
        stack = [*self.group_of, *self.also_run()]
        while stack:
            n = stack.pop()
            if n not in needed:
                needed.add(n)
                stack.extend(n.all_input_nodes)
        order = [n for n in graph.nodes if n in needed]
        last_use = {a: i for i, n in enumerate(order) for a in n.all_input_nodes}
        env: dict[fx.Node, Any] = {}
        self.env = env
        self._bind_placeholders(env)
        done: set[fx.Node] = set()
        planned = {p.site.node for g in self.groups.values() for p in g if p.scheme is not None}
        bar = tqdm(
            total=len(planned), desc=f"calibrating ({self.method.name})", unit="layer",
            disable=not self.progress,
        )  # fmt: skip
        with torch.no_grad():
            for i, node in enumerate(order):
                self.before_node(node)
                x = self.group_of.get(node)
                if x is not None and x not in done:
                    done.add(x)
                    self.calibrate_group(x, self.groups[x])
                if node.op == "call_function":
                    env[node] = self._execute(node)
                    if node in planned:
                        bar.update(1)
                elif node.op == "get_attr":
                    env[node] = _Same(_fetch_attr(self.editor.gm, node.target))
                for a in node.all_input_nodes:
                    if last_use.get(a) == i and a.op != "placeholder":
                        env.pop(a, None)
        bar.close()

    def _bind_placeholders(self, env) -> None:
        user_specs = []
        placeholders = [n for n in self.editor.graph.nodes if n.op == "placeholder"]
        for node, spec in zip(placeholders, self.editor.input_specs, strict=True):
            if spec.kind == InputKind.USER_INPUT:
                user_specs.append(node)
            elif spec.kind in (InputKind.PARAMETER, InputKind.BUFFER, InputKind.CONSTANT_TENSOR):
                env[node] = _Param(spec.target)
            elif spec.kind == InputKind.CUSTOM_OBJ:
                env[node] = _Same(self.editor.constants[spec.target])
            else:
                raise ValueError(f"calibrate: program input {node.name} of kind {spec.kind.name} "
                                 "is not supported (an inference program has none)")  # fmt: skip
        per_sample = []
        for i, args in enumerate(self.samples):
            flat, spec = pytree.tree_flatten((args, {}))
            if spec != self.ep.call_spec.in_spec:
                raise ValueError(
                    f"calibrate: data[{i}] does not match the program's inputs: got {spec}, "
                    f"the program takes {self.ep.call_spec.in_spec}"
                )
            per_sample.append(flat)
        for j, node in enumerate(user_specs):
            env[node] = [flat[j] for flat in per_sample]

    def _value(self, node: fx.Node, i: int):
        v = self.env[node]
        if isinstance(v, _Param):
            return self.state[v.fqn]
        if isinstance(v, _Same):
            return v.value
        return v[i]

    def _execute(self, node: fx.Node):
        inputs = node.all_input_nodes
        override = self.override.get(node)
        site = self.sites_by_node.get(node)

        def call(i: int):
            def get(a: fx.Node):
                if site is None or a is not site.weight_node:
                    return self._value(a, i)
                # the weight as stored now (a fold may have rescaled it since a transpose of it
                # ran), or the one the driver gave the node
                stored = override if override is not None else self._value(site.weight_source, i)
                return site.weight_arg(stored)

            args = fx.map_arg(node.args, get)
            kwargs = fx.map_arg(node.kwargs, get)
            try:
                return node.target(*args, **kwargs)
            except Exception as e:
                raise RuntimeError(
                    f"calibrate: running node {node.name} ({node.target}) on calibration sample "
                    f"{i} failed (do the samples match the exported shapes?): {e}"
                ) from e

        if not any(isinstance(self.env[a], list) for a in inputs):
            return _Same(call(0))
        return [call(i) for i in range(len(self.samples))]

    # ------------------------------------------------------------------ weights in the state

    def param_of(self, node: fx.Node):
        v = self.env.get(node) if isinstance(node, fx.Node) else None
        if isinstance(v, _Param):
            return v.fqn, self.state[v.fqn]
        return None

    def weight_nk(self, site: Site) -> torch.Tensor:
        w = self.state[site.weight_fqn]
        return w.t() if site.transposed else w

    def set_weight_nk(self, site: Site, w_nk: torch.Tensor) -> None:
        w = w_nk.t() if site.transposed else w_nk
        self._set(site.weight_fqn, w.to(self.state[site.weight_fqn].dtype).contiguous())

    def _set(self, fqn: str, t: torch.Tensor) -> None:
        old = self.state[fqn]
        if isinstance(old, torch.nn.Parameter):  # a program's parameters must stay Parameters
            t = torch.nn.Parameter(t.detach(), requires_grad=old.requires_grad)
        self.state[fqn] = t
        self.changed.add(fqn)

    def _stats(self, x: fx.Node, k: int) -> dict:
        values = self.env[x]
        return input_moments(
            values if isinstance(values, list) else [values.value],
            k,
            first_token_weight=float(getattr(self.method, "first_token_weight", 1.0)),
        )

    def _scale_input(self, x: fx.Node, s: torch.Tensor) -> None:
        v = self.env[x]
        if isinstance(v, list):
            self.env[x] = [t / s.to(t.dtype) for t in v]
        else:
            self.env[x] = _Same(v.value / s.to(v.value.dtype))

    def _fold(self, x, group: list[LayerPlan], absorber, s: torch.Tensor) -> None:
        """x ← x/s through the absorber's parameters, every reader's W ← W·diag(s)."""
        for fqn, dim in absorber.params:
            t = self.state[fqn]
            shape = [1] * t.dim()
            shape[dim] = -1
            self._set(fqn, t / s.reshape(shape).to(t.dtype))
        for p in group:
            self.set_weight_nk(p.site, self.weight_nk(p.site).float() * s)
        self._scale_input(x, s)

    # ------------------------------------------------------------------ for the drivers

    def _skip(self, plan: LayerPlan, reason: str) -> None:
        if plan.scheme is not None:
            self.records[plan.site.weight_fqn] = {
                "method": self.method.name,
                "status": "skipped",
                "reason": f"{reason}; quantized by round-to-nearest",
            }


def _fetch_attr(root: torch.nn.Module, target: str):
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj
