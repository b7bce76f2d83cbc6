"""The report row: what happened to one linear-like layer, as the passes hand it on.

Part of the core vocabulary. The rewrite pass (``fxquant.passes.rewrite``) makes one
``LayerRow`` per site and stores it as JSON in the node's ``meta["custom"][ROW_KEY]``, which
``torch.export.save`` keeps; the fusion pass marks the fused linears (``fused_norm``),
calibration adds its record (``calibration``), and ``fxquant.report`` reads the rows back, from
a fresh program or a reloaded ``.pt2``. Everything that reads or writes a row goes through this
type: ``LayerRow.from_node`` / ``with_row``.

The JSON is the one earlier releases wrote (the same keys, optional ones only when set), so
their programs still report; keys a later release adds are kept in ``extra`` and written back.
A row also reads as a mapping (``row["status"]``), as report rows always could.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["ROW_KEY", "LayerRow"]

ROW_KEY = "fxquant"  # node.meta["custom"][ROW_KEY]: the layer's row, as JSON


@dataclass(frozen=True, kw_only=True, eq=False)
class LayerRow(Mapping):
    """One linear-like site.

    Args:
        name: the layer's module name (its weight's name without ``.weight``).
        weight: the weight's name in the program.
        node: the graph node the site was.
        kind: ``linear``, ``addmm``, ``mm``, ``matmul``, ``grouped_mm`` (experts) or ``bmm``
            (experts every row goes through, Llama 4's; run as grouped experts once quantized).
        in_features, out_features: K and N of the float weight.
        dtype: the float weight's dtype (``float32``).
        status: ``quantized`` or ``skipped``.
        scheme: the scheme's dict (``Scheme.to_dict``), None when skipped.
        reason: why the scheme was chosen, or why the layer stays in float.
        bytes_before, bytes_after: the weight's bytes in float and as stored.
        sqnr_db: the stored weight's SQNR against the float one, dB (None: not known).
        experts: E, for a mixture-of-experts site.
        read_transposed: the node reads the weight through a transpose of it as stored
            ([N, K] under a ``matmul`` / ``mm`` / ``addmm``: ``x @ W.T``; experts [E, N, K]).
        padded_in_features: K after the scheme's zero padding.
        shared_with: the layer whose constants this one reuses (a tied weight).
        float_weight_kept: the float weight stays in the program (used elsewhere).
        fused_norm: the norm whose fused quantization feeds this layer.
        weights: ``"given"`` when the constants came from a checkpoint or a calibrator.
        calibration: what calibration measured for this layer.
        extra: keys this release does not know, kept as they were.
    """

    name: str
    weight: str
    node: str
    kind: str
    in_features: int
    out_features: int
    dtype: str
    status: str
    scheme: dict | None
    reason: str | None
    bytes_before: int
    bytes_after: int
    sqnr_db: float | None
    experts: int | None = None
    read_transposed: bool | None = None
    padded_in_features: int | None = None
    shared_with: str | None = None
    float_weight_kept: bool | None = None
    fused_norm: str | None = None
    weights: str | None = None
    calibration: dict | None = None
    extra: dict = field(default_factory=dict)

    # ---- JSON ----
    def to_dict(self) -> dict[str, Any]:
        """The row as earlier releases stored it: optional keys only when set."""
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "extra":
                continue
            if value is not None or f.default is dataclasses.MISSING:
                out[f.name] = value
        out.update(self.extra)
        return out

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LayerRow:
        known = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        return cls(
            **{k: v for k, v in d.items() if k in known},
            extra={k: v for k, v in d.items() if k not in known},
        )

    @classmethod
    def from_json(cls, text: str) -> LayerRow:
        return cls.from_dict(json.loads(text))

    def replace(self, **changes: Any) -> LayerRow:
        return dataclasses.replace(self, **changes)

    # ---- in the graph ----
    @classmethod
    def from_node(cls, node) -> LayerRow | None:
        """The row a pass left on ``node`` (an ``fx.Node``), or None."""
        text = (node.meta.get("custom") or {}).get(ROW_KEY)
        return None if text is None else cls.from_json(text)

    def store(self, node) -> None:
        """Leave this row on ``node`` (replacing any earlier one), where ``from_node`` and
        ``torch.export.save`` find it."""
        node.meta["custom"] = {**(node.meta.get("custom") or {}), ROW_KEY: self.to_json()}

    # ---- read as a mapping (report rows were dicts) ----
    def __getitem__(self, key: str) -> Any:
        return self.to_dict()[key]

    def __iter__(self) -> Iterator[str]:
        return iter(self.to_dict())

    def __len__(self) -> int:
        return len(self.to_dict())

    def __eq__(self, other: object) -> bool:
        # equal to another row or to a mapping with the same keys and values
        if isinstance(other, Mapping):
            return self.to_dict() == dict(other)
        return NotImplemented

    def __or__(self, other: Mapping) -> dict[str, Any]:
        return self.to_dict() | dict(other)

    __hash__ = None  # holds dicts; rows are compared, not hashed
