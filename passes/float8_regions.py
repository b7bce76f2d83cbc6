"""FP8 autocast regions: decide which linears of a Dynamo training graph run in FP8, and rewrite
them to ``fxquant.training.numerics.float8_training_linear``.

Where it sits: the training branch of the backend (``fxquant.backend``). A region is the part of
the graph the config assigns a ``Float8Recipe``: ``modules_to_not_convert`` and ``overrides`` by
module name, then ``module_filter(module, fqn)`` when given, else accelerate's default (skip the
first and the last linear of the model, in ``named_modules()`` order), then what the shapes allow
(dims divisible by 16 unless ``pad_inner_dim``; by 32 / 128 for MX / block). When the forward
has ``fxquant.fp8_autocast`` (``fxquant.training.autocast``), the regions it marks come first:
only linears called inside an enabled one may train in FP8, with the region's recipe. Every
decision is a report row. Outside a region the graph is untouched.

The rewritten graph is a copy (Dynamo keeps using the graph it handed over). With delayed scaling it
gains inputs (per site a forward and a backward scale, then one amax sink [sites, 2]) and outputs
(per site the forward amaxes): ``fxquant.training.state.Float8TrainingProgram`` feeds and reads
them.
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxquant.core.config import Float8Recipe, QuantConfig, Scheme
from fxquant.core.row import LayerRow
from fxquant.passes.plan import LayerPlan, Site, find_sites, plan_sites
from fxquant.passes.rewrite import COPIED_META, DynamoEditor, _row, counters
from fxquant.training.autocast import has_regions, region_of
from fxquant.training.fsdp import ALL_GATHER_ATTR
from fxquant.training.layers import Float8Linear, fp8_linear_names
from fxquant.training.numerics import (
    float8_training_linear,
    gemm_kind,
    missing_gemm,
    reads_gathered,
    scaled_gemm_note,
)
from fxquant.training.state import state_for

__all__ = [
    "Float8Graph",
    "inference_config",
    "copy_graph_module",
    "float8_regions",
    "plan_regions",
    "root_and_linears",
    "uses_float8_training",
]


def uses_float8_training(config: QuantConfig) -> bool:
    """Whether a config asks for FP8 training (then it may ask for nothing else)."""
    schemes = config.schemes
    fp8 = [s for s in schemes if isinstance(s, Float8Recipe)]
    if fp8 and len(fp8) != len(schemes):
        others = sorted({type(s).__name__ for s in schemes if not isinstance(s, Float8Recipe)})
        raise ValueError(
            f"a config with a Float8Recipe (FP8 training) cannot also assign inference schemes "
            f"({', '.join(others)}); use None to keep layers in high precision"
        )
    return bool(fp8)


def _all_gather_extra(root: torch.nn.Module | None, name: str) -> dict:
    """The row keys for the layer ``name``'s FSDP2 all-gather, as
    :func:`fxquant.training.fsdp.enable_fsdp_float8_all_gather` chose it (none when it was not
    called): the graph FSDP hands Dynamo holds the gathered weight, not that choice."""
    if root is None:
        return {}
    try:
        module = root.get_submodule(name) if name else root
    except AttributeError:
        return {}
    tag = getattr(module, ALL_GATHER_ATTR, None)
    if tag is None:
        return {}
    extra = {"all_gather": tag["all_gather"]}
    if tag.get("reason"):
        extra["all_gather_reason"] = tag["reason"]
    return extra


def root_and_linears(gm: fx.GraphModule):
    """The module whose frame Dynamo is compiling (the root the weight names are relative to)
    and its Linear names in ``named_modules()`` order, or (None, None). Dynamo hands a backend
    no module; the frame it is tracing still holds it, and the first/last rule and
    ``module_filter`` read its submodules."""
    try:
        from torch._dynamo.symbolic_convert import InstructionTranslator

        tx = InstructionTranslator.current_tx()
    except (ImportError, AttributeError):  # a torch without it: fall back to call order
        return None, None
    for node in gm.graph.find_nodes(op="placeholder"):
        grapharg = node.meta.get("grapharg")
        if tx is None or grapharg is None or not isinstance(grapharg.example, torch.nn.Parameter):
            continue
        source = grapharg.source
        while getattr(source, "base", None) is not None:
            source = source.base
        root = tx.f_locals.get(getattr(source, "local_name", None))
        if isinstance(root, torch.nn.Module):
            linears = [n for n, m in root.named_modules() if isinstance(m, torch.nn.Linear)]
            return root, linears
    return None, None


def _module_class(node: torch.fx.Node) -> type | None:
    """The class of the module whose forward made ``node`` (Dynamo's ``nn_module_stack``), or
    None where the graph does not say."""
    stack = node.meta.get("nn_module_stack") or {}
    if not stack:
        return None
    cls = list(stack.values())[-1][1]
    return cls if isinstance(cls, type) else None


def region_choice(
    name: str,
    config: QuantConfig,
    *,
    root: torch.nn.Module | None,
    linears: list[str],
) -> tuple[Float8Recipe | None, str]:
    """The recipe for the linear ``name`` (or None) and why, before shapes are considered:
    names first, then ``module_filter`` or the first/last rule."""
    scheme, why = config.scheme_for(name)
    if scheme is None:
        return None, why
    if config.module_filter is not None:
        if root is None:
            raise ValueError(
                "QuantConfig.module_filter needs the compiled module, which fxquant could "
                "not find for this graph; use overrides / modules_to_not_convert instead"
            )
        module = root.get_submodule(name) if name else root
        if not config.module_filter(module, name):
            return None, "module_filter returned False"
        return scheme, why + "; module_filter returned True"
    if linears and name in (linears[0], linears[-1]):
        which = "first" if name == linears[0] else "last"
        return None, (
            f"{which} Linear of the model (accelerate's default filter; pass module_filter "
            "to choose yourself)"
        )
    return scheme, why


def plan_regions(
    sites: list[Site],
    config: QuantConfig,
    *,
    root: torch.nn.Module | None,
    linears: list[str] | None,
    autocast: bool = False,
) -> list[LayerPlan]:
    """The region decision for each site, in graph order. With ``autocast`` (the forward has
    ``fxquant.fp8_autocast``), a site trains in FP8 only inside an enabled region, only if it is
    a ``Float8Linear`` when the model has any, and with its region's recipe when it names one."""
    if autocast:  # the regions say where FP8 runs: accelerate's first/last rule is not TE's
        linears = []
    elif linears is None:  # no root module found: the graph's own call order stands in
        linears = list(dict.fromkeys(s.module_name for s in sites))
    fp8_names = fp8_linear_names(root) if autocast else None
    classes = {id(s): _module_class(s.node) for s in sites}
    # the model has FP8 layers: found under the root, or by class where the root's names do
    # not match the graph's (a module reached through a closure, ``L['f'].__closure__[0]...``)
    marked = fp8_names is not None or any(
        c is not None and issubclass(c, Float8Linear) for c in classes.values()
    )

    def is_fp8_layer(site: Site) -> bool:
        cls = classes[id(site)]
        if cls is not None:
            return issubclass(cls, Float8Linear)
        return site.module_name in (fp8_names or ())

    def choose(site: Site) -> tuple[Float8Recipe | None, str]:
        region = region_of(site.node) if autocast else None
        if autocast:
            if region is None:
                return None, "outside every fxquant.fp8_autocast region"
            if not region.enabled:
                return None, "inside fxquant.fp8_autocast(enabled=False)"
            if marked and not is_fp8_layer(site):
                return None, (
                    "not converted by convert_model (the model has FP8 layers: only they "
                    "train in FP8)"
                )
        recipe, why = region_choice(site.module_name, config, root=root, linears=linears)
        if recipe is not None and region is not None:
            if region.recipe is not None:
                recipe, why = region.recipe, why + "; recipe of its fp8_autocast region"
            else:
                why += "; inside fp8_autocast"
        return recipe, why

    return plan_sites(sites, config, choose=choose)


def inference_config(model: torch.nn.Module, config: QuantConfig) -> QuantConfig:
    """The inference config ``fxquant.quantize`` uses for a model trained with ``config``: the
    same regions, each layer's recipe as an inference scheme. Delayed scaling freezes the
    layer's trained input scale in (``Float8Static``; the weight, now constant, takes its own
    per-tensor scale); current scaling becomes ``Float8Dynamic`` (tensor or row), block becomes
    ``Float8Block(128)``, MXFP8 ``MXFP8(scale_rule="ceil")`` (E8M0 scales per 32, the exponent
    rule of the training casts). A layer trained with fprop in high precision stays in float."""
    from fxquant.core.config import MXFP8, Float8Block, Float8Dynamic, Float8Static
    from fxquant.training.state import layer_states

    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    states = layer_states(model)
    overrides: dict[str, Scheme | None] = {}
    for name in linears:
        recipe, _ = region_choice(name, config, root=model, linears=linears)
        scheme: Scheme | None = None
        if recipe is None or recipe.override_linear_precision[0]:
            scheme = None
        elif recipe.scaling == "delayed":
            state = states.get(name)
            trained = state is not None and bool(state.fwd_amax_history.any() or state.pending)
            if trained:
                scheme = Float8Static(activation_scale=1.0 / float(state.fwd_scale[0]))
        elif recipe.scaling == "current":
            scheme = Float8Dynamic(granularity=recipe.granularity)
        elif recipe.scaling == "mxfp8":
            scheme = MXFP8(scale_rule="ceil")
        else:
            scheme = Float8Block(block_size=recipe.block_size)
        overrides[re.escape(name)] = scheme
    return QuantConfig(
        scheme=None, overrides=overrides, modules_to_not_convert=(), fuse_norms=config.fuse_norms
    )


@dataclass(frozen=True)
class StateSite:
    """Where a delayed-scaling site's weight comes from at run time: the position of its
    placeholder among the graph's inputs, or the tensor itself when it is a graph attribute.
    The state is looked up from the weight on every call, because Dynamo reuses a compiled
    graph for another instance of the same model whose guards pass."""

    weight: int | torch.Tensor
    recipe: Float8Recipe
    fqn: str

    def resolve(self, args) -> torch.Tensor:
        return args[self.weight] if isinstance(self.weight, int) else self.weight


@dataclass
class Float8Graph:
    """The rewritten graph and what its runtime needs."""

    gm: fx.GraphModule
    rows: list[LayerRow]
    sites: list[StateSite]  # per delayed-scaling site, in input order
    n_outputs: int  # the outputs of the original graph (amaxes follow)
    extra_inputs: list[torch.Tensor]  # example values of the added inputs
    probe: int | torch.Tensor | None  # a weight of the region: its Linear says train or eval
    root: torch.nn.Module | None  # the module compiled (owner of the weights), if found


def copy_graph_module(gm: fx.GraphModule) -> tuple[fx.GraphModule, dict[fx.Node, fx.Node]]:
    """A copy of a Dynamo GraphModule that AOTAutograd still accepts as one; node metadata is
    shared (shallow), not deep-copied."""
    graph = fx.Graph()
    env: dict[fx.Node, fx.Node] = {}
    graph.output(graph.graph_copy(gm.graph, env))
    for old, new in env.items():
        if hasattr(old, "_dynamo_source"):  # AOTAutograd matches inputs to Dynamo's sources
            new._dynamo_source = old._dynamo_source
    new_gm = fx.GraphModule(gm, graph)
    new_gm.meta.update(gm.meta)
    if hasattr(gm, "_param_name_to_source"):
        new_gm._param_name_to_source = gm._param_name_to_source
    return new_gm, env


def float8_regions(
    gm: fx.GraphModule, example_inputs, config: QuantConfig, *, autocast: bool | None = None
) -> Float8Graph:
    """Plan the regions of a Dynamo graph and rewrite a copy of it. ``autocast``: whether the
    ``fp8_autocast`` regions decide (default: when the graph has any)."""
    root, linears = root_and_linears(gm)
    plans = plan_regions(
        find_sites(gm.graph, DynamoEditor(gm, example_inputs).weight_of),
        config,
        root=root,
        linears=linears,
        autocast=has_regions(gm.graph) if autocast is None else autocast,
    )
    chosen = [p for p in plans if p.scheme is not None]
    for p in chosen:
        problem = missing_gemm(p.scheme)
        if problem is not None:
            raise ValueError(f"layer {p.name or '<root>'!r}: {problem}")
    new_gm, env = copy_graph_module(gm)
    graph = new_gm.graph
    delayed = [p for p in chosen if p.scheme.scaling == "delayed"]

    anchor = [n for n in graph.nodes if n.op == "placeholder"][-1]

    def add_input(name: str) -> fx.Node:
        nonlocal anchor
        with graph.inserting_after(anchor):
            anchor = graph.placeholder(name)
        anchor._dynamo_source = None  # ours, not the user's: no source for Dynamo to guard
        return anchor

    positions = {n: i for i, n in enumerate(gm.graph.find_nodes(op="placeholder"))}

    def where(site: Site) -> int | torch.Tensor:
        return positions.get(site.weight_source, site.weight)

    sites, extra_inputs, scale_nodes = [], [], []
    for p in delayed:
        sites.append(StateSite(where(p.site), p.scheme, p.site.weight_fqn))
        s = state_for(p.site.weight, p.scheme, p.site.weight_fqn)
        extra_inputs += [s.fwd_scale, s.bwd_scale]
        name = "fxquant_" + (p.name.replace(".", "_") or "root")
        scale_nodes.append((add_input(f"{name}_fwd_scale"), add_input(f"{name}_bwd_scale")))
    sink = None
    if delayed:
        sink = add_input("fxquant_amax_sink")
        # requires grad as the graph's calls will (Dynamo guards grad mode: a no-grad call
        # compiles its own graph), so AOTAutograd builds the backward that fills it
        extra_inputs.append(
            torch.zeros(
                len(delayed),
                2,
                device=extra_inputs[0].device,
                requires_grad=torch.is_grad_enabled(),
            )
        )

    amax_nodes = []
    rows = []
    index = {p.site.node: i for i, p in enumerate(delayed)}
    for plan in plans:
        row = _row(plan)
        gather = _all_gather_extra(root, plan.name)
        if gather:
            row = row.replace(extra={**row.extra, **gather})
        if plan.scheme is None:
            rows.append(row)
            continue
        recipe = plan.scheme
        padded = recipe.padded_in_features(plan.site.in_features)
        # which GEMM each of fprop, dgrad, wgrad runs: _scaled_mm, emulated, or high precision
        gemms = {
            role: "high precision" if hp else gemm_kind(recipe)
            for role, hp in zip(
                ("fprop", "dgrad", "wgrad"), recipe.override_linear_precision, strict=True
            )
        }
        extra = {**row.extra, "fp8_gemms": gemms}
        note = scaled_gemm_note(recipe, plan.site.weight.device)
        if note and "_scaled_mm" in gemms.values():
            extra["fp8_gemm_kernel"] = note
        if (
            not plan.site.transposed  # torch.t of the gathered weight dequantizes it
            and not all(recipe.override_linear_precision[:2])
            and reads_gathered(plan.site.weight, recipe)
        ):
            # FSDP2's FP8 all-gather handed the graph e4m3 values and their scale: fprop and
            # dgrad read them as they are (fxquant.training.gathered)
            extra["fp8_weight"] = "as all-gathered (e4m3 and its scale, no cast)"
        rows.append(
            row.replace(padded_in_features=padded, bytes_after=row.bytes_before, extra=extra)
        )
        node = env[plan.site.node]
        # W as stored: [N, K], or [K, N] (Conv1D, mm) for the op to transpose; a view that
        # transposed a stored [N, K] is left to dead-code elimination
        x, w = env_arg(env, plan.site.x), env[plan.site.weight_source]
        bias = env_arg(env, plan.site.bias)
        i = index.get(plan.site.node)
        with graph.inserting_before(node):
            if plan.site.transposed:  # Conv1D / mm: W is stored [K, N]
                w = graph.call_function(torch.t, (w,))
            if i is None:
                fs = bs = sink_i = None
            else:
                fs, bs = scale_nodes[i]
                sink_i = graph.call_function(operator.getitem, (sink, i))
            call = graph.call_function(
                float8_training_linear, (x, w, bias, fs, bs, sink_i), {"recipe": recipe}
            )
            y = graph.call_function(operator.getitem, (call, 0))
            if i is not None:
                amax_nodes.append(graph.call_function(operator.getitem, (call, 1)))
        for key in COPIED_META:
            if key in node.meta:
                y.meta[key] = node.meta[key]
        node.replace_all_uses_with(y)
        graph.erase_node(node)
        env[plan.site.node] = y  # a later site whose input this was reads y
        counters["float8_training"] += 1

    output = next(n for n in graph.nodes if n.op == "output")
    outs = output.args[0]
    if not isinstance(outs, (tuple, list)):
        raise TypeError(f"a Dynamo graph returns a tuple of outputs, this one {type(outs)}")
    n_outputs = len(outs)
    if amax_nodes:
        output.args = (type(outs)([*outs, *amax_nodes]),)
    graph.lint()
    new_gm.recompile()
    probe = where(chosen[0].site) if chosen else None
    return Float8Graph(new_gm, rows, sites, n_outputs, extra_inputs, probe, root)


def env_arg(env: dict[fx.Node, fx.Node], a):
    return env[a] if isinstance(a, fx.Node) else a
