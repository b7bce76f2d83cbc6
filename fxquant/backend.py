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
            config_patches=dict(options.get("inductor_config") or {}),
            decompositions=decompositions,
        )

    def run(*args):
        with torch.no_grad():
            return compiled(*args)

    return run
