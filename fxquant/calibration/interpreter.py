"""``fxquant.calibrate``: quantize with an algorithm that sees real data (GPTQ, AWQ, SmoothQuant).

Where this sits: in front of ``fxquant.quantize``. The model is exported (or an
``ExportedProgram`` is taken as it is), the planning pass decides which linears get which scheme
(the same plan ``quantize`` makes, so weight names match), and then the exported graph itself is
*interpreted* over the calibration samples, node by node, all samples at each node before the
next. Each planned linear is therefore met once, in graph order, with the real inputs of every
sample in hand:

- **GPTQ** (``fxquant/gptq.py``): the Hessian ``2/n·XᵀX`` of those inputs drives GPTQ; the
  linear's output is then computed with the GPTQ weight, so every later layer is calibrated on
  the inputs the quantized model really gives it (``sequential=True``, the standard; finer than
  block by block: ``o_proj`` sees quantized q/k/v). Linears sharing one input (q/k/v, gate/up)
  share one Hessian and are solved as one stacked matrix. The result is in the scheme's storage
  form and goes to ``quantize(..., weights=...)`` untouched.
- **AWQ** (``fxquant/awq.py``) and **SmoothQuant** (``fxquant/smoothquant.py``): the group of
  linears reading one input gets a per-channel scale chosen from its statistics, folded into the
  op before it (``fxquant/fold.py``); the graph runs on in float with the folded weights. The
  folded float program is then quantized by round-to-nearest (``quantize``).

The whole run is one forward pass over the data (only the nodes that lead to a planned linear
are run, so e.g. the logits are never computed). The caller's model or program is never
modified: changed weights are new tensors in a new program.

What calibration did to each layer is added to that layer's report row under ``"calibration"``
(``fxquant.report(qep).rows``): GPTQ's output error against round-to-nearest on the same inputs,
AWQ's chosen α and group loss, SmoothQuant's activation maxima before/after; or why a layer was
left to round-to-nearest.
"""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
import torch.fx as fx
from torch.export import ExportedProgram
from torch.export.graph_signature import InputKind
from torch.utils import _pytree as pytree

from fxquant.awq import output_mse, search_clip, search_scale
from fxquant.core import reference as ref
from fxquant.core.config import (
    Float8Dynamic,
    Int4WeightOnly,
    Int8DynamicActivation,
    QuantConfig,
    Scheme,
    name_matches,
)
from fxquant.fold import find_absorber
from fxquant.gptq import GPTQ_SCHEMES, gptq_quantize, output_error
from fxquant.passes.plan import LayerPlan, Site, find_sites, plan_sites
from fxquant.passes.rewrite import META_KEY, ProgramEditor
from fxquant.passes.schemes import QuantizedWeight, handler_for
from fxquant.smoothquant import smoothing_scale

__all__ = [
    "AWQ",
    "GPTQ",
    "CalibrationResult",
    "SmoothQuant",
    "calibrate",
    "calibration_pass",
    "input_moments",
]


def _check_number(cls: str, name: str, value: Any, lo: float, hi: float, *, lo_open: bool):
    ok = isinstance(value, (int, float)) and not isinstance(value, bool)
    ok = ok and (lo < value if lo_open else lo <= value) and value <= hi
    if not ok:
        lo_s = f"{lo} < " if lo_open else f"{lo} <= "
        raise ValueError(f"{cls}.{name}={value!r} is not supported; allowed: {lo_s}{name} <= {hi}")


def _check_bool(cls: str, name: str, value: Any) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{cls}.{name}={value!r} is not supported; allowed: True or False")


def _check_int(cls: str, name: str, value: Any, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{cls}.{name}={value!r} is not supported; allowed: an int >= {minimum}")


@dataclass(frozen=True, kw_only=True)
class GPTQ:
    """GPTQ for ``Int4WeightOnly`` (and int8 per-channel weights: ``Int8WeightOnly``, the weight
    of ``Int8DynamicActivation``). Field names follow Hugging Face's ``GPTQConfig``.

    Args:
        damp_percent: damping added to diag(H), as a fraction of its mean (the GPTQ paper's and
            AutoGPTQ's 0.01; Hugging Face ``GPTQConfig`` defaults to 0.1).
        blocksize: columns per lazy batch update.
        desc_act: act-order: quantize columns by decreasing ``diag(H)``. With int4 groups this
            needs ``static_groups=True``: fxquant stores contiguous groups along K (no
            ``g_idx``), so group scales must be fixed in column order before the permuted pass.
            On SmolLM2-135M int4 g64 it gives GPTQ's best results (best with ``mse=2.4``,
            ``first_token_weight=32`` and ``damp_percent=0.1``, after ``AWQ(clip=False)``: +9.8 %
            perplexity), and plain GPTQ does not beat round-to-nearest there
            (``benchmarks/results/calibration*.json``, docs/calibration.md).
        static_groups: int4: fit every group's scale up front from the original weight.
        act_group_aware: int4 without ``desc_act``: group-aware reordering (GAR, GPTQModel's
            and ``GPTQConfig``'s ``act_group_aware``): groups visited by decreasing max
            ``diag(H)``, each group's columns by decreasing ``diag(H)``. Groups stay whole, so it
            needs neither ``g_idx`` nor static groups.
        sequential: ``True``: each linear's Hessian comes from the inputs the already-quantized
            layers before it produce; ``False``: all Hessians from one float pass.
        mse: ``0`` (default): each group's range is its min/max; ``p > 0``: shrink it by the
            factor (1 down to 0.21) minimising the p-norm of the group's rounding error (the
            GPTQ reference quantizer's and GPTQModel's ``mse``; they use p = 2.4).
        first_token_weight: how many times the first position of each calibration sequence
            counts in the Hessian (``1``: once, as the reference). The first position is the
            attention sink every later token attends to, so its error costs far more than one
            token's share; docs/calibration.md has the measurements.
    """

    name: ClassVar[str] = "gptq"
    damp_percent: float = 0.01
    blocksize: int = 128
    desc_act: bool = False
    static_groups: bool = False
    act_group_aware: bool = False
    sequential: bool = True
    mse: float = 0.0
    first_token_weight: float = 1.0

    def __post_init__(self) -> None:
        _check_number("GPTQ", "damp_percent", self.damp_percent, 0.0, 1.0, lo_open=True)
        _check_number("GPTQ", "mse", self.mse, 0.0, 10.0, lo_open=False)
        _check_number("GPTQ", "first_token_weight", self.first_token_weight, 0.0, 1e6, lo_open=True)
        _check_int("GPTQ", "blocksize", self.blocksize, 1)
        for f in ("desc_act", "static_groups", "act_group_aware", "sequential"):
            _check_bool("GPTQ", f, getattr(self, f))


@dataclass(frozen=True, kw_only=True)
class AWQ:
    """AWQ for ``Int4WeightOnly``: activation-aware input-channel scales, then weight clipping.

    Args:
        n_grid: α = 0, 1/n_grid, … for the scale search (and clipping ratios 1 - i/n_grid).
        clip: search a per-group clipping range after scaling (llm-awq ``auto_clip``).
        clip_max_shrink: smallest range tried is ``(1 - clip_max_shrink) · amax``.
        no_clip: module-name patterns whose weights are not clipped; llm-awq leaves q/k out,
            since their error is seen through the attention scores, not the linear outputs.
        first_token_weight: how many times the first position of each calibration sequence
            counts in the statistics the searches use (``1``: once, as llm-awq); see ``GPTQ``.
    """

    name: ClassVar[str] = "awq"
    n_grid: int = 20
    clip: bool = True
    clip_max_shrink: float = 0.5
    no_clip: tuple[str, ...] = ("q_proj", "k_proj", "query", "key")
    first_token_weight: float = 1.0

    def __post_init__(self) -> None:
        _check_number("AWQ", "first_token_weight", self.first_token_weight, 0.0, 1e6, lo_open=True)
        _check_int("AWQ", "n_grid", self.n_grid, 2)
        _check_bool("AWQ", "clip", self.clip)
        _check_number("AWQ", "clip_max_shrink", self.clip_max_shrink, 0.0, 1.0, lo_open=True)
        if isinstance(self.no_clip, str) or not all(isinstance(p, str) for p in self.no_clip):
            raise ValueError(
                f"AWQ.no_clip={self.no_clip!r} is not supported; allowed: a tuple of patterns"
            )
        object.__setattr__(self, "no_clip", tuple(self.no_clip))


@dataclass(frozen=True, kw_only=True)
class SmoothQuant:
    """SmoothQuant for activation-quantizing schemes (``Int8DynamicActivation``,
    ``Float8Dynamic``): migrate activation outliers into the weights through the preceding norm.

    Args:
        alpha: migration strength in [0, 1]; 0.5 is the paper's default for most models.
    """

    name: ClassVar[str] = "smoothquant"
    alpha: float = 0.5

    def __post_init__(self) -> None:
        _check_number("SmoothQuant", "alpha", self.alpha, 0.0, 1.0, lo_open=False)


Method = GPTQ | AWQ | SmoothQuant
_SMOOTH_SCHEMES = (Int8DynamicActivation, Float8Dynamic)


def calibrate(
    model: torch.nn.Module | ExportedProgram,
    config: QuantConfig | Scheme | str,
    data: Iterable,
    *,
    method: Method | tuple[Method, ...],
    progress: bool = True,
    dynamic_shapes: Any = None,
) -> ExportedProgram:
    """Run a calibration algorithm over ``data``, then quantize.

    Args:
        model: an ``nn.Module`` (exported here with the first sample as example input) or an
            ``ExportedProgram``; it is never modified.
        config: what to quantize to, as for ``fxquant.quantize`` (e.g. ``Int4WeightOnly(
            group_size=64)``); the algorithm applies to the layers whose scheme it supports, the
            others are quantized by round-to-nearest (their report rows say so).
        data: calibration samples; each a tensor (the model's one positional input) or a tuple
            of positional inputs. Without ``dynamic_shapes`` all samples must have the shape of
            the first (the exported graph is specialised to it).
        method: ``GPTQ(...)``, ``AWQ(...)`` or ``SmoothQuant(...)``, or several in a tuple, run
            one after the other, each on the program the one before left (e.g. ``(AWQ(clip=False),
            GPTQ(...))``: AWQ's scales folded in, then GPTQ rounds the scaled weights). Only the
            last may be GPTQ, since GPTQ's output is quantized constants, not a float program.
        progress: show a progress bar (calibration, then quantization).
        dynamic_shapes: passed to ``torch.export.export`` when ``model`` is a module.

    Returns:
        The quantized ``ExportedProgram``; ``fxquant.report(qep).rows[i]["calibration"]`` says
        what calibration did to each layer.
    """
    config = QuantConfig.coerce(config)
    methods = method if isinstance(method, tuple) else (method,)
    if not methods or not all(isinstance(m, (GPTQ, AWQ, SmoothQuant)) for m in methods):
        raise ValueError(
            f"calibrate: method={method!r} is not supported; allowed: GPTQ(...), AWQ(...) or "
            "SmoothQuant(...) from fxquant.calibrate, or a tuple of them"
        )
    if any(isinstance(m, GPTQ) for m in methods[:-1]):
        raise ValueError(
            f"calibrate: method={method!r}: GPTQ must come last (it yields quantized constants, "
            "which no later method can take)"
        )
    samples = [_as_args(s, i) for i, s in enumerate(data)]
    if not samples:
        raise ValueError("calibrate: data is empty; pass at least one calibration sample")
    if isinstance(model, ExportedProgram):
        if dynamic_shapes is not None:
            raise ValueError("calibrate: dynamic_shapes is only used to export an nn.Module")
        ep = model
    elif isinstance(model, torch.nn.Module):
        ep = torch.export.export(model, samples[0], dynamic_shapes=dynamic_shapes)
    else:
        raise ValueError(
            f"calibrate() takes an nn.Module or an ExportedProgram, got {type(model).__name__}"
        )

    program, records = ep, {}
    for m in methods:
        result = calibration_pass(program, config, samples, method=m, progress=progress)
        program = result.program
        for fqn, rec in result.records.items():
            # a later method's record leads; what the earlier ones did is kept under it
            before = records.pop(fqn, None)
            records[fqn] = rec if before is None else {**rec, "after": before}

    from fxquant.api import quantize  # api imports the passes; keep this module light to import

    qep = quantize(program, config, progress=progress, weights=result.weights)
    _attach(qep, records)
    return qep


@dataclass
class CalibrationResult:
    """What ``calibration_pass`` found, before quantization."""

    # a new float program: the input's, with AWQ/SmoothQuant scales folded into its weights
    program: ExportedProgram
    weights: dict[str, QuantizedWeight]  # GPTQ's constants by weight name, for quantize()
    records: dict[str, dict]  # per weight name: what calibration did, or why it did not


def calibration_pass(
    ep: ExportedProgram,
    config: QuantConfig | Scheme | str,
    samples: list[tuple],
    *,
    method: Method,
    progress: bool = False,
) -> CalibrationResult:
    """The calibration run of ``calibrate`` on an exported program, without the quantization:
    the graph interpreted over ``samples`` (tuples of positional inputs), the algorithm applied
    at each planned linear. ``ep`` is not modified."""
    config = QuantConfig.coerce(config)
    editor = ProgramEditor(ep)
    plans = plan_sites(find_sites(editor.graph, editor.weight_of), config)
    _check_method(method, plans)
    run = _Run(editor, ep, plans, method, samples, progress=progress)
    run.run()
    for fqn in run.changed:
        target = editor.state_dict if fqn in editor.state_dict else editor.constants
        target[fqn] = run.state[fqn]
    return CalibrationResult(editor.finish(), run.weights, run.records)


def _as_args(sample: Any, i: int) -> tuple:
    if isinstance(sample, torch.Tensor):
        return (sample,)
    if isinstance(sample, tuple):
        return sample
    raise ValueError(
        f"calibrate: data[{i}] is a {type(sample).__name__}; allowed: a tensor (the model's one "
        "input) or a tuple of positional inputs"
    )


def _check_method(method: Method, plans: list[LayerPlan]) -> None:
    if isinstance(method, GPTQ) and method.desc_act and not method.static_groups:
        grouped = [p.name for p in plans if isinstance(p.scheme, Int4WeightOnly)]
        if grouped:
            raise ValueError(
                f"GPTQ(desc_act=True) with int4 groups (e.g. {grouped[0]}) needs "
                "static_groups=True: fxquant stores contiguous groups along K with no g_idx, so "
                "the group scales must be fixed in column order before the act-order pass"
            )


# ---------------------------------------------------------------------------------------------
# The interpreter: the exported graph, run node by node over all samples
# ---------------------------------------------------------------------------------------------


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


class _Run:
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
            groups.setdefault(p.site.x, []).append(p)
        self.groups = {x: g for x, g in groups.items() if any(p.scheme for p in g)}
        self.group_of = {p.site.node: x for x, g in self.groups.items() for p in g}

    # ------------------------------------------------------------------ running the graph

    def run(self) -> None:
        from tqdm.auto import tqdm

        graph = self.editor.graph
        needed: set[fx.Node] = set()
        stack = list(self.group_of)
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
                x = self.group_of.get(node)
                if x is not None and x not in done:
                    done.add(x)
                    self._group(x, self.groups[x])
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
        weight_node = self.sites_by_node[node].weight_node if override is not None else None

        def call(i: int):
            def get(a: fx.Node):
                return override if a is weight_node else self._value(a, i)

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

    # ------------------------------------------------------------------ the algorithms

    def _skip(self, plan: LayerPlan, reason: str) -> None:
        if plan.scheme is not None:
            self.records[plan.site.weight_fqn] = {
                "method": self.method.name,
                "status": "skipped",
                "reason": f"{reason}; quantized by round-to-nearest",
            }

    def _group(self, x: fx.Node, group: list[LayerPlan]) -> None:
        if isinstance(self.method, GPTQ):
            self._gptq(x, group)
        elif isinstance(self.method, AWQ):
            self._awq(x, group)
        else:
            self._smoothquant(x, group)

    def _gptq(self, x: fx.Node, group: list[LayerPlan]) -> None:
        m: GPTQ = self.method
        todo: dict[Scheme, list[LayerPlan]] = {}
        for p in group:
            if p.scheme is None:
                continue
            if not isinstance(p.scheme, GPTQ_SCHEMES):
                self._skip(p, f"GPTQ does not produce {type(p.scheme).__name__} weights")
            elif self.weight_uses[p.site.weight_fqn] > 1:
                self._skip(p, "the weight is shared by several linears (one Hessian per weight)")
            else:
                todo.setdefault(p.scheme, []).append(p)
        if not todo:
            return
        k = group[0].site.in_features
        stats = self._stats(x, k)
        H = 2 * stats["sigma"]
        for scheme, plans in todo.items():
            ws = [self.weight_nk(p.site).float() for p in plans]
            res = gptq_quantize(
                torch.cat(ws), H, scheme, percdamp=m.damp_percent, blocksize=m.blocksize,
                act_order=m.desc_act, static_groups=m.static_groups,
                group_aware=m.act_group_aware, mse=m.mse,
            )  # fmt: skip
            sizes = [w.shape[0] for w in ws]
            parts = {n: t.split(sizes) for n, t in res.weight.tensors.items()}
            dqs = res.dequantized.split(sizes)
            for j, (p, w, dq) in enumerate(zip(plans, ws, dqs, strict=True)):
                tensors = {n: parts[n][j].contiguous() for n in parts}
                self.weights[p.site.weight_fqn] = QuantizedWeight(tensors, dq.contiguous())
                rtn = handler_for(scheme).quantize(scheme, w).dequantized
                self.records[p.site.weight_fqn] = {
                    "method": "gptq",
                    "status": "calibrated",
                    "tokens": stats["tokens"],
                    "inputs": "from the quantized layers before" if m.sequential else "float",
                    "stacked_with": [q.name for q in plans if q is not p],
                    "output_mse_rtn": output_error(w, rtn, H),
                    "output_mse": output_error(w, dq, H),
                }
                if m.sequential:
                    stored = self.state[p.site.weight_fqn]
                    deq = dq.t() if p.site.transposed else dq
                    self.override[p.site.node] = deq.to(stored.dtype).contiguous()

    def _awq(self, x: fx.Node, group: list[LayerPlan]) -> None:
        m: AWQ = self.method
        int4 = []
        for p in group:
            if p.scheme is None:
                continue
            if not isinstance(p.scheme, Int4WeightOnly):
                self._skip(
                    p, f"AWQ searches scales for int4 weights, not {type(p.scheme).__name__}"
                )
            else:
                int4.append(p)
        if not int4:
            return
        schemes = {p.scheme for p in int4}
        if len(schemes) > 1:
            for p in int4:
                self._skip(p, "the linears sharing this input have different int4 schemes")
            return
        scheme = int4[0].scheme
        k = group[0].site.in_features
        stats = self._stats(x, k)
        sigma = stats["sigma"]
        orig = {p.site.weight_fqn: self.weight_nk(p.site).float() for p in int4}
        shared = [p.site.weight_fqn for p in group if self.weight_uses[p.site.weight_fqn] > 1]
        absorber = (
            f"{shared[0]} is shared by several linears"
            if shared
            else find_absorber(
                x, [p.site for p in group], self.sites_by_node, self.param_of, allow_linear=True
            )
        )
        rec: dict[str, Any] = {"method": "awq", "tokens": stats["tokens"]}
        s = torch.ones(k)
        if isinstance(absorber, str):
            rec.update(status="skipped", note=f"scale not folded: {absorber}")
        else:
            found = search_scale(
                torch.cat(list(orig.values())), sigma, stats["absmean"], scheme, n_grid=m.n_grid
            )
            s = found.scale
            self._fold(x, group, absorber, s)
            rec.update(
                status="calibrated",
                folded_into=f"{absorber.kind} {absorber.name}",
                alpha=found.alpha,
                group_loss_rtn=found.loss_rtn,
                group_loss=found.loss,
            )
        sigma_s = sigma / (s[:, None] * s[None, :])  # statistics of the scaled input x / s
        for p in int4:
            fqn = p.site.weight_fqn
            w_scaled = self.weight_nk(p.site).float()
            final = w_scaled
            r = dict(rec)
            if m.clip and not any(name_matches(pat, p.name) for pat in m.no_clip):
                final, before, after = search_clip(
                    w_scaled, sigma_s, scheme, n_grid=m.n_grid, max_shrink=m.clip_max_shrink
                )
                r["clip_loss_before"], r["clip_loss_after"] = before, after
                if final is not w_scaled:
                    self.set_weight_nk(p.site, final)
                    r["status"] = "calibrated"
                    # the pass runs on in float, as llm-awq's does: later layers see the
                    # unclipped (scaled) weight's output
                    stored = w_scaled.t() if p.site.transposed else w_scaled
                    self.override[p.site.node] = stored.to(self.state[fqn].dtype).contiguous()
            rtn = handler_for(scheme).quantize(scheme, orig[fqn]).dequantized
            r["output_mse_rtn"] = output_mse(orig[fqn] - rtn, sigma)
            q = handler_for(scheme).quantize(scheme, final).dequantized
            r["output_mse"] = output_mse(w_scaled - q, sigma_s)
            self.records[fqn] = r

    def _smoothquant(self, x: fx.Node, group: list[LayerPlan]) -> None:
        m: SmoothQuant = self.method
        act = []
        for p in group:
            if p.scheme is None:
                continue
            if not isinstance(p.scheme, _SMOOTH_SCHEMES):
                self._skip(
                    p, f"SmoothQuant is for activation-quantizing schemes, not "
                    f"{type(p.scheme).__name__}",
                )  # fmt: skip
            else:
                act.append(p)
        if not act:
            return
        shared = [p.site.weight_fqn for p in group if self.weight_uses[p.site.weight_fqn] > 1]
        absorber = (
            f"{shared[0]} is shared by several linears"
            if shared
            else find_absorber(
                x, [p.site for p in group], self.sites_by_node, self.param_of, allow_linear=False
            )
        )
        if isinstance(absorber, str):
            for p in act:
                self._skip(p, f"no smoothing: {absorber}")
            return
        k = group[0].site.in_features
        stats = self._stats(x, k)
        sample = self._token_sample(x, k, 2048)
        before = {p.site.weight_fqn: self.weight_nk(p.site).float() for p in act}
        weights = torch.cat([self.weight_nk(p.site).float() for p in group])
        s = smoothing_scale(stats["absmax"], weights, alpha=m.alpha)
        self._fold(x, group, absorber, s)
        amax_after = stats["absmax"] / s
        for p in act:
            w_after = self.weight_nk(p.site).float()
            y = sample @ before[p.site.weight_fqn].t()
            self.records[p.site.weight_fqn] = {
                "method": "smoothquant",
                "status": "calibrated",
                "tokens": stats["tokens"],
                "alpha": m.alpha,
                "folded_into": f"{absorber.kind} {absorber.name}",
                "act_absmax_before": float(stats["absmax"].max()),
                "act_absmax_after": float(amax_after.max()),
                "output_mse_rtn": _mse(_simulate(p.scheme, sample, before[p.site.weight_fqn]), y),
                "output_mse": _mse(_simulate(p.scheme, sample / s, w_after), y),
                "output_mse_tokens": sample.shape[0],
            }

    def _token_sample(self, x: fx.Node, k: int, n: int) -> torch.Tensor:
        """The first ``n`` calibration tokens reaching ``x`` as fp32 [n, K]."""
        v = self.env[x]
        rows = torch.cat([t.reshape(-1, k) for t in (v if isinstance(v, list) else [v.value])])
        return rows[:n].float()


def _mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).pow(2).mean())


def _simulate(scheme: Scheme, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The scheme's reference linear on ``x`` with round-to-nearest weights (no bias)."""
    q = handler_for(scheme).quantize(scheme, w).tensors
    if isinstance(scheme, Int8DynamicActivation):
        return ref.int8_dynamic_linear(x, q["qweight"], q["scale"])
    return ref.float8_dynamic_linear(
        x, q["qweight"], q["scale"], per_row=scheme.per_row,
        activation_scale_ub=scheme.activation_scale_ub,
    )  # fmt: skip


def _fetch_attr(root: torch.nn.Module, target: str):
    obj = root
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


def _attach(qep: ExportedProgram, records: dict[str, dict]) -> None:
    """Add each layer's calibration record to its report row (kept by ``torch.export.save``)."""
    for node in qep.graph.nodes:
        custom = node.meta.get("custom") or {}
        if META_KEY not in custom:
            continue
        row = json.loads(custom[META_KEY])
        rec = records.get(row["weight"])
        if rec is not None and row["status"] == "quantized":
            row["calibration"] = rec
            custom[META_KEY] = json.dumps(row, sort_keys=True)
