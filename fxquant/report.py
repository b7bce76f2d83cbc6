"""The report: what happened to each linear-like layer, read back from a quantized program.

The rewrite pass leaves one JSON row per site in ``node.meta["custom"]`` (which
``torch.export.save`` keeps), so this works on a program straight from ``quantize`` and on one
reloaded from a ``.pt2``: scheme, shapes, bytes before/after, weight SQNR, or why it was skipped.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import torch
from torch.export import ExportedProgram

from fxquant.config import QuantConfig, scheme_from_dict
from fxquant.passes.rewrite import CONFIG_KEY, META_KEY

__all__ = ["Report", "report"]


@dataclass
class Report:
    """Per-layer rows (dicts) plus the config the program was made with."""

    rows: list[dict] = field(default_factory=list)
    config: QuantConfig | None = None
    program_bytes: int = 0  # all parameters, buffers and constants of the program

    @property
    def quantized(self) -> list[dict]:
        return [r for r in self.rows if r["status"] == "quantized"]

    @property
    def skipped(self) -> list[dict]:
        return [r for r in self.rows if r["status"] == "skipped"]

    def summary(self) -> str:
        """A few lines: layers quantized per scheme, layers skipped, weight bytes before/after."""
        by_scheme: dict[str, int] = {}
        for r in self.quantized:
            by_scheme[_scheme_str(r)] = by_scheme.get(_scheme_str(r), 0) + 1
        before = sum(r["bytes_before"] for r in self.quantized if not r.get("shared_with"))
        after = sum(r["bytes_after"] for r in self.quantized)
        lines = [
            f"{len(self.quantized)} of {len(self.rows)} linear layers quantized, "
            f"{len(self.skipped)} kept in float",
        ]
        lines += [f"  {n:4d} × {s}" for s, n in by_scheme.items()]
        if before:
            lines.append(
                f"quantized weights: {_mib(before)} → {_mib(after)} "
                f"({before / max(after, 1):.2f}× smaller)"
            )
        reasons: dict[str, int] = {}
        for r in self.skipped:
            reasons[r["reason"]] = reasons.get(r["reason"], 0) + 1
        lines += [f"  skipped {n} × {why}" for why, n in reasons.items()]
        lines.append(f"program constants: {_mib(self.program_bytes)}")
        return "\n".join(lines)

    def __str__(self) -> str:
        header = ("layer", "scheme", "N×K", "bytes before", "bytes after", "SQNR dB", "note")
        table = [header]
        for r in self.rows:
            note = r["reason"] if r["status"] == "skipped" else ""
            if r.get("shared_with"):
                note = f"shares weights with {r['shared_with']}"
            elif r.get("padded_in_features", r["in_features"]) != r["in_features"]:
                note = f"K padded {r['in_features']}→{r['padded_in_features']}"
            if r.get("float_weight_kept"):
                note = (note + "; " if note else "") + "float weight kept (used elsewhere)"
            table.append(
                (
                    r["name"] or "<root>",
                    _scheme_str(r) if r["status"] == "quantized" else "float (skipped)",
                    f"{r['out_features']}×{r['in_features']}",
                    f"{r['bytes_before']:,}",
                    f"{r['bytes_after']:,}",
                    "" if r["sqnr_db"] is None else f"{r['sqnr_db']:.1f}",
                    note,
                )
            )
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in table
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        return "\n".join(lines) + "\n\n" + self.summary()


def _scheme_str(row: dict) -> str:
    return str(scheme_from_dict(row["scheme"]))


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def report(ep: ExportedProgram) -> Report:
    """The report of a quantized program (from ``quantize`` or ``torch.export.load``)."""
    if not isinstance(ep, ExportedProgram):
        raise ValueError(f"report() takes an ExportedProgram, got {type(ep).__name__}")
    rows, config = [], None
    for node in ep.graph.nodes:
        custom = node.meta.get("custom") or {}
        if META_KEY in custom:
            rows.append(json.loads(custom[META_KEY]))
        if CONFIG_KEY in custom:
            config = QuantConfig.from_json(custom[CONFIG_KEY])
    # Tied weights appear under several names but are stored (and saved) once.
    storages = {}
    for t in [*ep.state_dict.values(), *ep.constants.values()]:
        if isinstance(t, torch.Tensor):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return Report(rows=rows, config=config, program_bytes=sum(storages.values()))
