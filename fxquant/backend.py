"""``torch.compile(model, backend="fxquant", options={"config": cfg})``.

The Dynamo entry of the data flow. Dynamo hands us a torch-level GraphModule whose parameters are
graph inputs; the same plan, rewrite and norm fusion passes as the export path quantize each
chosen weight once, here at compile time (inference semantics: recompile after changing the
weights), and Inductor compiles the result with the lowerings of ``fxquant.passes.lower`` as
decompositions.
Inductor settings go through ``config_patches``, scoped to this compile, never set globally.

Found without ``import fxquant`` through the ``torch_dynamo_backends`` entry point.
"""

from __future__ import annotations

from typing import Any

import torch

from fxquant.config import QuantConfig
from fxquant.passes.float8_regions import (
    copy_graph_module,
    float8_regions,
    uses_float8_training,
)
from fxquant.passes.fuse import fuse_norms
from fxquant.passes.lower import lowerings, prepack
from fxquant.passes.rewrite import DynamoEditor, rewrite
from fxquant.report import read_graph

__all__ = ["fxquant_backend", "last_reports"]

DEFAULT_RECIPE = "int8wo"
_OPTIONS = ("config", "inductor_config")

# The report rows of the most recent compiles (one list per graph Dynamo compiled).
last_reports: list[list[dict]] = []


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
    if uses_float8_training(config):
        return _float8_training(gm, example_inputs, config, inductor_config)
    editor = DynamoEditor(gm, example_inputs)
    rewrite(editor, config)
    if config.fuse_norms:
        fuse_norms(editor)
    last_reports.append(read_graph(editor.graph)[0])  # the rows, with fusion marked
    del last_reports[:-16]
    devices = {t.device.type for t in example_inputs if isinstance(t, torch.Tensor)}
    device = "cuda" if "cuda" in devices else "cpu"
    prepack(editor, device=device)
    gm = editor.finish()
    decompositions = dict(select_decomp_table())
    decompositions.update(lowerings(device))
    # Inference semantics: the quantized ops have no autograd formula, and the weights they read
    # were frozen at compile time, so the graph is compiled (and runs) without autograd; outputs
    # do not require grad even when the caller's grad mode is on.
    with torch.no_grad():
        compiled = compile_fx(
            gm,
            example_inputs,
            config_patches=inductor_config,
            decompositions=decompositions,
        )

    def run(*args):
        with torch.no_grad():
            return compiled(*args)

    return run


def _float8_training(gm, example_inputs, config: QuantConfig, inductor_config: dict):
    """The training branch: FP8 autocast regions (``fxquant.passes.float8_regions``), compiled
    by Inductor with autograd (AOTAutograd traces the FP8 backward too), wrapped in the runtime
    that keeps the delayed-scaling state (``fxquant.float8_state``)."""
    from torch._inductor.compile_fx import compile_fx

    from fxquant.float8_state import Float8TrainingProgram, remember_owners

    fg = float8_regions(gm, example_inputs, config)
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
    compiled = compile_fx(
        fg.gm, [*example_inputs, *fg.extra_inputs], config_patches=inductor_config
    )
    return Float8TrainingProgram(
        compiled,
        n_outputs=fg.n_outputs,
        sites=fg.sites,
        probe=fg.probe,
        eval_fn=eval_fn,
        autocast_during_eval=any(s.use_autocast_during_eval for s in config.schemes),
    )


class _Lazy:
    """A callable made on first call."""

    def __init__(self, make) -> None:
        self._make, self._fn = make, None

    def __call__(self, *args):
        if self._fn is None:
            self._fn = self._make()
        return self._fn(*args)
