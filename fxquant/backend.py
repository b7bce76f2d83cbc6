"""``torch.compile(model, backend="fxquant", options={"config": cfg})``.

The Dynamo entry of the data flow. Dynamo hands us a torch-level GraphModule whose parameters are
graph inputs; the same pass pipeline as the export path (``fxquant.passes.pipeline``: plan →
rewrite → fuse) quantizes each chosen weight once, here at compile time (inference semantics:
a weight changed in place afterwards is refused, ``_FrozenWeights``), and Inductor compiles the
result with the lowerings of ``fxquant.passes.lower`` as decompositions. A config with a
``Float8Recipe``, a forward with ``fxquant.fp8_autocast`` regions, or (with no config) a model
with ``convert_model``'s FP8 layers takes the training branch instead (``_float8_training``).
Inductor settings go through ``config_patches``, scoped to this compile, never set globally.

Found without ``import fxquant`` through the ``torch_dynamo_backends`` entry point.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from fxquant.core.config import Float8Recipe, QuantConfig
from fxquant.passes.cpu.attention import pack_repeated_attention
from fxquant.passes.cpu.compiler_check import inductor_patches
from fxquant.passes.cpu.parallel import keyed as sized_regions_keyed
from fxquant.passes.cpu.parallel import sized_regions
from fxquant.passes.float8_regions import (
    copy_graph_module,
    float8_regions,
    root_and_linears,
    uses_float8_training,
)
from fxquant.passes.lower import lowerings, native_cpu, prepack
from fxquant.passes.pipeline import run_passes
from fxquant.passes.rewrite import DynamoEditor, fqn_from_source
from fxquant.report import read_graph
from fxquant.training.autocast import has_regions
from fxquant.training.layers import has_fp8_layers

__all__ = ["CallWatch", "fxquant_backend", "last_reports", "recompile_limit_hit", "watch"]

DEFAULT_RECIPE = "int8wo"
_OPTIONS = ("config", "inductor_config")

# The report rows of the most recent compiles (one list per graph Dynamo compiled).
last_reports: list[list[dict]] = []

# Calls that ran through a graph this backend quantized (all of them, this process).
_quantized_calls = 0
# Dynamo's recompile limit, once hit in this process: (limit name, value, function)
recompile_limit_hit: tuple[str, int, str] | None = None


@dataclass
class CallWatch:
    """What :func:`watch` saw: ``quantized`` is True when a quantized graph ran inside it."""

    quantized: bool = False
    calls: int = 0


@contextlib.contextmanager
def watch() -> Iterator[CallWatch]:
    """``with fxquant.backend.watch() as w: model(x)`` → ``w.quantized``: whether the calls
    inside went through a graph this backend quantized. A call Dynamo sends to eager (its
    recompile limit reached, a graph break around the linears) runs the float model and
    leaves ``w.quantized`` False."""
    seen = CallWatch()
    start = _quantized_calls
    try:
        yield seen
    finally:
        seen.calls = _quantized_calls - start
        seen.quantized = seen.calls > 0


class _RecompileLimitWatch(logging.Handler):
    """Dynamo's "hit config.recompile_limit" log record, turned into a warning users see: past
    the limit, Dynamo runs that function eagerly, which for this backend means unquantized."""

    def emit(self, record: logging.LogRecord) -> None:
        global recompile_limit_hit
        if not str(record.msg).startswith("torch._dynamo hit config.") or not record.args:
            return
        limit, value, function = (list(record.args) + [None, None, None])[:3]
        recompile_limit_hit = (str(limit), value, str(function))
        # Dynamo logs it once per function it gives up on; Python's filter shows each once
        warnings.warn(
            f"torch.compile(backend='fxquant'): Dynamo reached torch._dynamo.config.{limit} "
            f"({value}) for {function}; from here on that function runs eagerly: in float, "
            f"NOT quantized. Raise the limit (torch._dynamo.config.{limit} = 64) or avoid "
            "the recompiles (a fixed StaticCache length, Hugging Face's compile_config); "
            "fxquant.backend.watch() tells whether a call ran quantized",
            RuntimeWarning,
            stacklevel=2,
        )


# Inductor's Python wrapper checks, on every call, the size and stride of each graph input and
# each extern kernel's output, and the alignment it assumed: ~2 checks per linear, ~0.5 ms of a
# 7.5 ms SmolLM2 decode step under the backend (int8wo+lm_head, Zen 4, by hand: 7.54 -> 7.08 ms
# median; the AOTInductor package of the same recipe, which has none of them, 5.7). Dynamo's
# guards have checked the inputs' sizes and strides before the graph runs, the weights are the
# ones this compile froze (_FrozenWeights), and fxquant's ops return what their fake kernels say
# (opcheck-tested). The scalar checks stay: they are the bounds of a cache position.
# `options["inductor_config"]` may turn them back on.
_RUNTIME_CHECKS_OFF = {"size_asserts": False, "alignment_asserts": False}


def _watch_recompile_limit() -> None:
    logger = logging.getLogger("torch._dynamo.convert_frame")
    if not any(isinstance(h, _RecompileLimitWatch) for h in logger.handlers):
        logger.addHandler(_RecompileLimitWatch(level=logging.WARNING))


def fxquant_backend(
    gm: torch.fx.GraphModule, example_inputs, options: dict[str, Any] | None = None
):
    """Quantize the graph's linear layers as ``options["config"]`` says (a QuantConfig, a scheme
    or a recipe name; default ``"int8wo"``), then compile with Inductor.
    ``options["inductor_config"]`` holds Inductor config patches for this compile."""
    from torch._inductor.compile_fx import compile_fx
    from torch._inductor.decomposition import select_decomp_table

    options = dict(options or {})
    unknown = set(options) - set(_OPTIONS)
    if unknown:
        raise ValueError(
            f"fxquant backend options {sorted(unknown)} are not known; allowed: {list(_OPTIONS)}"
        )
    config = QuantConfig.coerce(options.get("config", DEFAULT_RECIPE))
    inductor_config = dict(options.get("inductor_config") or {})
    devices = {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
    device = "cuda" if "cuda" in devices else "cpu"
    if device == "cpu":
        # where the host compiler needs a mend for Inductor's CPU code (passes.cpu.compiler_check)
        inductor_config = {**inductor_patches(), **inductor_config}
    _watch_recompile_limit()
    if has_regions(gm.graph) or ("config" not in options and _has_fp8_layers(gm)):
        # regions decide; a model with FP8 layers (convert_model) and no region trains them in
        # high precision, as te.Linear outside te.fp8_autocast does
        config = _autocast_config(config if "config" in options else None)
        return _float8_training(gm, example_inputs, config, inductor_config, autocast=True)
    if uses_float8_training(config):
        return _float8_training(gm, example_inputs, config, inductor_config)
    inductor_config = {**_RUNTIME_CHECKS_OFF, **inductor_config}  # inference: weights frozen
    editor = DynamoEditor(gm, example_inputs)
    run_passes(editor, config)
    last_reports.append(read_graph(editor.graph)[0])  # the rows, with fusion marked
    del last_reports[:-16]
    if device == "cpu" and native_cpu():
        # sdpa over transformers' repeated KV cache: the packed attention on the cache in place
        # (the native kernel for fp32, the composition for bf16 / fp16)
        pack_repeated_attention(editor.graph)
    prepack(editor, device=device)
    frozen = _FrozenWeights(editor.frozen)
    gm = editor.finish()
    decompositions = dict(select_decomp_table())
    decompositions.update(lowerings(device))
    regions = contextlib.nullcontext()
    if device == "cpu":
        # a graph of dynamic batch (mark_dynamic / mark_unbacked) is traced at one size and run
        # at others: its kernels open their OpenMP regions by the size they run at, as in
        # aot_compile (fxquant.passes.cpu.parallel)
        regions = sized_regions()
        inductor_config = sized_regions_keyed(inductor_config)
    # Inference semantics: the quantized ops have no autograd formula, and the weights they read
    # were frozen at compile time, so the graph is compiled (and runs) without autograd; outputs
    # do not require grad even when the caller's grad mode is on.
    with torch.no_grad(), regions:
        compiled = compile_fx(
            gm,
            example_inputs,
            config_patches=inductor_config,
            decompositions=decompositions,
        )

    def run(*args):
        global _quantized_calls
        frozen.check(args)
        _quantized_calls += 1
        with torch.no_grad():
            return compiled(*args)

    return run


class _FrozenWeights:
    """The parameters whose values a compile froze into its graph (quantized, prepacked).

    Dynamo guards a parameter input by its metadata only (it inlines nn modules), so a second
    instance of the same class (the same code, the same shapes, other weights) would run the
    first one's graph: its weights, silently. Each frozen parameter gets an identity guard here
    (Dynamo then compiles anew for other tensors; a guard filter that skips module guards drops
    it), and every call checks identity and version counter: another model's tensors, or an
    in-place update after compiling (``load_state_dict``), is an error, never a run on the
    values frozen before. ~0.15 µs a weight a call."""

    def __init__(self, frozen: dict[int, tuple[Any, torch.Tensor]]) -> None:
        from torch._dynamo.guards import GuardBuilder
        from torch._guards import TracingContext

        context = TracingContext.try_get()  # None: called outside Dynamo, nothing to guard
        if context is not None:
            for source, _ in frozen.values():
                context.guards_context.dynamo_guards.add(source.make_guard(GuardBuilder.ID_MATCH))
        self._at = [
            (i, weakref.ref(t), t._version, fqn_from_source(source.name))
            for i, (source, t) in sorted(frozen.items())
        ]

    def check(self, args) -> None:
        for i, ref, version, name in self._at:
            t = args[i]
            if t is not ref():
                raise RuntimeError(
                    f"torch.compile(backend='fxquant'): this graph froze and quantized the "
                    f"weights of another model ({name} is another tensor now): Dynamo reused it "
                    "because its module guards were skipped (guard_filter_fn). Compile each "
                    "model with a forward of its own (docs/llm.md) or keep the module guards"
                )
            if t._version != version:
                raise RuntimeError(
                    f"torch.compile(backend='fxquant'): {name} was changed in place after the "
                    "compile quantized it (load_state_dict, copy_, an optimizer step); the "
                    "compiled graph holds the old values. Compile again after changing "
                    "weights: torch._dynamo.reset(), then call the compiled model"
                )


def _has_fp8_layers(gm: torch.fx.GraphModule) -> bool:
    root, _ = root_and_linears(gm)
    return root is not None and has_fp8_layers(root)


def _autocast_config(config: QuantConfig | None) -> QuantConfig:
    """The config of a forward with ``fxquant.fp8_autocast`` regions: the one given when it is
    an FP8 training config, else every linear with ``Float8Recipe()`` (TE's defaults), the
    regions choosing which run in FP8."""
    if config is None or not config.schemes:
        return QuantConfig(scheme=Float8Recipe(), modules_to_not_convert=())
    if not uses_float8_training(config):
        names = sorted({type(s).__name__ for s in config.schemes})
        raise ValueError(
            f"the forward has fxquant.fp8_autocast regions (FP8 training), but the config "
            f"assigns inference schemes ({', '.join(names)}); compile it with a Float8Recipe "
            "config, or with no config (the regions' recipes apply)"
        )
    return config


def _float8_training(
    gm, example_inputs, config: QuantConfig, inductor_config: dict, *, autocast: bool = False
):
    """The training branch: FP8 autocast regions (``fxquant.passes.float8_regions``), compiled
    by Inductor with autograd (AOTAutograd traces the FP8 backward too), wrapped in the runtime
    that keeps the delayed-scaling state (``fxquant.training.state``). With ``autocast`` the
    forward's ``fp8_autocast`` regions decide, in eval as in training (a forward that reads
    ``self.training``, as ``contextual_fp8_autocast`` does, is compiled once per mode)."""
    from torch._inductor.compile_fx import compile_fx

    from fxquant.training.state import Float8TrainingProgram, remember_owners

    fg = float8_regions(gm, example_inputs, config, autocast=autocast)
    if fg.root is not None:
        remember_owners(fg.root)
    last_reports.append(fg.rows)
    del last_reports[:-16]
    # model.eval() runs the graph as the user wrote it; compiled on first use, by Dynamo, so it
    # gets its own guards and dynamic shapes.
    original = copy_graph_module(gm)[0]
    eval_fn = _Lazy(
        lambda: torch.compile(original, backend="inductor", options=inductor_config or None)
    )
    extra = _static_fakes(fg.extra_inputs, example_inputs)
    compiled = compile_fx(fg.gm, [*example_inputs, *extra], config_patches=inductor_config)
    return Float8TrainingProgram(
        compiled,
        n_outputs=fg.n_outputs,
        sites=fg.sites,
        probe=fg.probe,
        eval_fn=eval_fn,
        autocast_during_eval=autocast or any(s.use_autocast_during_eval for s in config.schemes),
    )


def _static_fakes(tensors: list[torch.Tensor], example_inputs) -> list[torch.Tensor]:
    """``tensors`` (the inputs ``float8_regions`` added: scales, amax sink) as fake tensors of
    static shape in the fake mode of Dynamo's trace.

    Why: handed over real, AOTAutograd fakeifies a tensor Dynamo never saw with a fresh size
    symbol per dim (duck-sized, even under ``dynamic=False``) whose source Dynamo does not know.
    A guard Inductor then puts on one (the Triton backend's 32-bit indexing check,
    ``simd.py can_use_32bit_indexing``: ``2*s66 <= 2147483647`` on the sink's [sites, 2])
    makes Dynamo's guard creation fail with ``IndexError: list index out of range`` (the
    delayed recipe on a GPU). Their shapes are fixed by the graph anyway."""
    fake_mode = torch._guards.detect_fake_mode(example_inputs)
    if fake_mode is None:  # not under Dynamo (a direct call): nothing to guard
        return list(tensors)
    return [fake_mode.from_tensor(t, static_shapes=True) for t in tensors]


class _Lazy:
    """A callable made on first call."""

    def __init__(self, make) -> None:
        self._make, self._fn = make, None

    def __call__(self, *args):
        if self._fn is None:
            self._fn = self._make()
        return self._fn(*args)
