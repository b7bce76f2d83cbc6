"""The pass pipeline, written once: plan → rewrite → fuse (→ lower, per device).

Where it sits: the entry to ``fxquant.passes``. ``fxquant.quantize`` runs it on an export
(a ``ProgramEditor``) and the ``torch.compile`` backend on each Dynamo graph (a
``DynamoEditor``); calibration runs the plan alone and hands the constants it made back in
through ``weights``. Lowering comes after, for one device (``fxquant.passes.lower``): inside
Inductor for the backend, in ``lower()`` / ``aot_compile`` for a program.
"""

from __future__ import annotations

from fxquant.core.config import QuantConfig
from fxquant.core.row import LayerRow
from fxquant.passes.fuse import fuse_norms
from fxquant.passes.rewrite import rewrite

__all__ = ["run_passes"]


def run_passes(editor, config: QuantConfig, **rewrite_options) -> list[LayerRow]:
    """Plan every linear-like site, rewrite the planned ones to ``fxquant::`` ops and, under
    ``config.fuse_norms``, fuse each norm into the quantization of the linears it feeds.
    Returns the report rows of the rewrite.

    ``rewrite_options`` are :func:`~fxquant.passes.rewrite.rewrite`'s: ``progress``,
    ``weights`` (constants made elsewhere, by weight name) and ``whole_model`` (the graph is the
    whole model).
    """
    rows = rewrite(editor, config, **rewrite_options)
    if config.fuse_norms:
        fuse_norms(editor)
    return rows
