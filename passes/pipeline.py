"""The pass pipeline, written once: plan → rewrite → fuse.

Where it sits: the entry to ``fxquant.passes``. ``fxquant.quantize`` runs it on an export
(a ``ProgramEditor``) and the ``torch.compile`` backend on each Dynamo graph (a
``DynamoEditor``); calibration runs the plan alone and hands the constants it made back in
through ``weights``. Lowering comes after, for one device (``fxquant.passes.lower``): inside
Inductor for the backend, in ``lower()`` / ``aot_compile`` for a program.
"""

from __future__ import annotations

from collections.abc import Mapping

from fxquant.core.config import QuantConfig
from fxquant.core.row import LayerRow
from fxquant.core.scheme import QuantizedWeight
from fxquant.passes.fuse import fuse_norms
from fxquant.passes.rewrite import rewrite

__all__ = ["run_passes"]


def run_passes(
    editor,
    config: QuantConfig,
    *,
    progress: bool = False,
    weights: Mapping[str, QuantizedWeight] | None = None,
    whole_model: bool = False,
) -> list[LayerRow]:
    """Plan every linear-like site, rewrite the planned ones to ``fxquant::`` ops (``weights``:
    constants made elsewhere, by weight name) and, under ``config.fuse_norms``, fuse each norm
    into the quantization of the linears it feeds. Returns the report rows of the rewrite.
    ``whole_model``: the graph is the whole model (see ``rewrite``)."""
    rows = rewrite(editor, config, progress=progress, weights=weights, whole_model=whole_model)
    if config.fuse_norms:
        fuse_norms(editor)
    return rows
