"""``fxquant.fp8_autocast``: FP8 regions written in a model's forward, as Transformer Engine users
write ``te.fp8_autocast``.

Where it sits: in the user's forward, read by Dynamo. The context manager adds nothing to the
graph: it annotates the nodes traced inside it (``torch.fx.traceback.annotate``, which Dynamo
traces without a graph break), and ``fxquant.passes.float8_regions`` reads the annotation of each
linear to decide whether it trains in FP8 and with which recipe. So a region costs nothing at run
time and compiles into the same one forward / one backward graph.

Semantics (Transformer Engine's): a linear called inside an enabled region trains in FP8 with
the region's recipe; outside every region, or inside ``enabled=False``, it runs in high
precision; the innermost region wins. ``recipe=None`` means the compile's recipe (the
``Float8Recipe`` of its config, else ``Float8Recipe()``, TE's ``DelayedScaling`` defaults).

A region entered outside a compiled graph still reaches the layers ``convert_model`` marked
(``Float8Linear``) in the frames compiled inside it: that happens whenever the forward holding
the region graph-breaks (FSDP2 breaks the graph at every ``fully_shard`` module, so under FSDP2
this is the rule), Dynamo then running that forward eagerly and compiling the modules it calls
as frames of their own. Such a region is kept on a stack (``ambient``), which
``Float8Linear.forward`` reads while Dynamo traces it (so the frame's guards hold the region and
a change of region recompiles) and writes as an annotation of its own (``AMBIENT``); a region
traced in the graph is always inside it, and wins. The same holds for a region around the call
of a compiled model (Transformer Engine's layers read the region when they run, so there too).
Plain ``nn.Linear`` layers have no such forward: where no compile took the region up (eager
code, or no marked layer), it has no effect and says so, once.
"""

from __future__ import annotations

import ast
import contextlib
import warnings
from collections.abc import Iterator
from dataclasses import dataclass

import torch
import torch.fx as fx

from fxquant.core.config import Float8Recipe

__all__ = ["AMBIENT", "ANNOTATION", "Region", "ambient", "fp8_autocast", "has_regions", "region_of"]

# The key of the node annotation (node.meta["custom"]) a region writes.
ANNOTATION = "fxquant_fp8_autocast"
# The key Float8Linear.forward writes for the region entered outside the graph (module docstring)
AMBIENT = "fxquant_fp8_autocast_ambient"
# The recipe travels as its ``region_key`` (a string of its fields): Dynamo can put constants
# in an annotation, not a dataclass instance.

_warned_eager = False
# The regions entered outside a compiled graph, innermost last: (enabled, recipe key)
_EAGER_REGIONS: list[tuple[bool, str | None]] = []
# Whether a compile ever took an eager region up (the "no effect" warning is then wrong)
_ambient_taken = False


@dataclass(frozen=True)
class Region:
    """The innermost ``fp8_autocast`` a node was traced in."""

    enabled: bool
    recipe: Float8Recipe | None  # None: the compile's recipe


@contextlib.contextmanager
def fp8_autocast(
    enabled: bool = True,
    recipe: Float8Recipe | None = None,
    *,
    fp8_recipe: Float8Recipe | None = None,
) -> Iterator[None]:
    """Mark an FP8 region in the forward of a model compiled with ``backend="fxquant"``.

    ``with fxquant.fp8_autocast(enabled=self.training, recipe=Float8Recipe(...)):`` — the
    linears called inside train in FP8 (those the compile's config admits: its names and
    ``module_filter``, and when ``convert_model`` converted some layers, only those). ``recipe``
    is a ``Float8Recipe`` (``fp8_recipe=`` is accepted as Transformer Engine spells it).
    """
    if fp8_recipe is not None:
        if recipe is not None:
            raise ValueError("fp8_autocast: pass recipe= or fp8_recipe=, not both")
        recipe = fp8_recipe
    if recipe is not None and not isinstance(recipe, Float8Recipe):
        raise TypeError(
            f"fp8_autocast(recipe=...) takes a fxquant.Float8Recipe or None, not "
            f"{type(recipe).__name__}; convert accelerate / Transformer Engine recipe kwargs with "
            "fxquant.from_accelerate(...).scheme"
        )
    key = None if recipe is None else recipe.region_key
    if torch.compiler.is_compiling():
        with torch.fx.traceback.annotate({ANNOTATION: (bool(enabled), key)}):
            yield
        return
    _EAGER_REGIONS.append((bool(enabled), key))
    try:
        yield
    finally:
        _EAGER_REGIONS.pop()
    if not _ambient_taken:
        _warn_eager()


def ambient() -> tuple[bool, str | None] | None:
    """The innermost region entered outside a compiled graph, or None."""
    return _EAGER_REGIONS[-1] if _EAGER_REGIONS else None


def _warn_eager() -> None:
    global _warned_eager
    if not _warned_eager:
        _warned_eager = True
        warnings.warn(
            "fxquant.fp8_autocast has no effect here: it marks FP8 regions inside the forward "
            "of a model compiled with torch.compile(model, backend='fxquant'), and no compiled "
            "frame took this one up (it ran eagerly, or around the call of a compiled model "
            "whose layers convert_model did not mark, the only ones a region entered outside "
            "the graph reaches). Put it inside the forward (fxquant.accelerate."
            "apply_fp8_autowrap does that), mark the layers, or give the compile a "
            "Float8Recipe config",
            UserWarning,
            stacklevel=4,
        )


def region_of(node: fx.Node) -> Region | None:
    """The innermost region ``node`` was traced in, or None (outside every region): one traced
    in the graph, else one entered outside it (module docstring)."""
    custom = node.meta.get("custom") or {}
    value = custom.get(ANNOTATION, custom.get(AMBIENT))
    if value is None:
        return None
    enabled, key = value
    recipe = None if key is None else Float8Recipe(**dict(ast.literal_eval(key)))
    return Region(enabled=bool(enabled), recipe=recipe)


def has_regions(graph: fx.Graph) -> bool:
    """Whether any node of ``graph`` was traced inside ``fp8_autocast`` (in the graph, or around
    it for a ``Float8Linear``)."""
    global _ambient_taken
    keys = {k for n in graph.nodes for k in (n.meta.get("custom") or {})}
    if AMBIENT in keys:
        _ambient_taken = True
    return bool(keys & {ANNOTATION, AMBIENT})
