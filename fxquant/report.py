"""The report: what happened to each linear-like layer and norm, read back from a program.

The rewrite pass leaves one row per site on its node (``fxquant.core.row.LayerRow``, JSON in
``node.meta["custom"]``, which ``torch.export.save`` keeps), so this works on a program straight
from ``quantize`` and on one reloaded from a ``.pt2``: scheme, shapes, bytes before/after,
weight SQNR, or why it was skipped.
The fusion pass adds one record per norm that feeds activation-quantizing linears (fused into
``norm_quant``, or why not) and marks each fused linear's row with ``fused_norm``.
"""

from __future__ import annotations

import json
import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
from torch.export import ExportedProgram

from fxquant.core.config import QuantConfig, scheme_from_dict
from fxquant.core.row import LayerRow
from fxquant.passes.fuse import NORM_KEY
from fxquant.passes.rewrite import CONFIG_KEY

__all__ = ["Report", "read_graph", "report"]


@dataclass
class Report:
    """Per-layer rows (``LayerRow``) and per-norm fusion records (dicts), plus the config the
    program was made with."""

    rows: list[LayerRow] = field(default_factory=list)
    config: QuantConfig | None = None
    program_bytes: int = 0  # all parameters, buffers and constants of the program
    norms: list[dict] = field(default_factory=list)

    @property
    def fused_norms(self) -> list[dict]:
        return [n for n in self.norms if n["status"] == "fused"]

    @property
    def quantized(self) -> list[LayerRow]:
        return [r for r in self.rows if r.status == "quantized"]

    @property
    def skipped(self) -> list[LayerRow]:
        return [r for r in self.rows if r.status == "skipped"]

    def summary(self) -> str:
        """A few lines: layers quantized per scheme, layers skipped, weight bytes before/after."""
        by_scheme: dict[str, int] = {}
        for r in self.quantized:
            by_scheme[_scheme_str(r)] = by_scheme.get(_scheme_str(r), 0) + 1
        before = sum(r.bytes_before for r in self.quantized if not r.shared_with)
        after = sum(r.bytes_after for r in self.quantized)
        lines = [
            f"{len(self.quantized)} of {len(self.rows)} linear layers quantized, "
            f"{len(self.skipped)} kept in float",
        ]
        lines += [f"  {n:4d} × {s}" for s, n in by_scheme.items()]
        if before and after < before:  # FP8 training keeps its master weights: no line
            lines.append(
                f"quantized weights: {_mib(before)} → {_mib(after)} "
                f"({before / max(after, 1):.2f}× smaller)"
            )
        reasons: dict[str, int] = {}
        for r in self.skipped:
            reasons[r.reason] = reasons.get(r.reason, 0) + 1
        lines += [f"  skipped {n} × {why}" for why, n in reasons.items()]
        if self.norms:
            lines.append(
                f"{len(self.fused_norms)} of {len(self.norms)} norms feeding activation-quantizing "
                "linears fused with their quantization (norm_quant)"
            )
        lines.append(f"program constants: {_mib(self.program_bytes)}")
        return "\n".join(lines)

    def norms_table(self) -> str:
        """One line per norm next to activation-quantizing linears: fused into what, or why not."""
        width = max((len(n["name"]) for n in self.norms), default=0)
        lines = []
        for n in self.norms:
            if n["status"] == "fused":
                what = f"fused ({n['activation']}) → {', '.join(n['linears'])}"
            else:
                what = f"not fused: {n['reason']}"
            lines.append(f"{n['name'].ljust(width)}  {what}")
        return "\n".join(lines)

    def cpu_kernels(self, machine: str | None = None) -> list[dict]:
        """Which CPU kernel each quantized layer gets on ``machine`` (a CPU class of
        ``fxquant.passes.cpu.dispatch``; default: this one), by M, from the dispatch table the
        lowering reads: one record per scheme, ``{"scheme", "layers", "kernel"}``, and one for
        the fp32 linears kept in float where the native kernels serve. Fused layers run the
        same GEMM as their scheme's unfused op."""
        from fxquant.passes import cpu
        from fxquant.passes.cpu.dispatch import kernel_plan
        from fxquant.passes.cpu.experts import (
            BMM_ATEN_KERNEL,
            BMM_EXPERTS_KERNEL,
            EXPERT_KERNELS,
            FLOAT_EXPERTS_KERNEL,
        )

        native = cpu.available()
        aten = "aten lowering (the native kernels are not available here)"
        out: dict[str, dict] = {}
        for r in self.quantized:
            # a mixture-of-experts GEMM (grouped_mm, or Llama 4's bmm): its own op and kernel
            experts = r.experts is not None
            name = f"{_scheme_str(r)} experts" if experts else _scheme_str(r)
            if name not in out:  # the kernel once a group
                scheme = scheme_from_dict(r.scheme)
                if experts:
                    native_only, kernel = EXPERT_KERNELS[scheme.name]
                    kernel = aten if native_only and not native else kernel
                else:
                    kernel = kernel_plan(scheme.op_name(), r.scheme, machine) if native else aten
                out[name] = {"scheme": name, "layers": [], "kernel": kernel}
            out[name]["layers"].append(r.name)
        # experts kept in float: out of transformers' Python op (passes/cpu/experts.py)
        kept = [r.name for r in self.skipped if r.kind == "grouped_mm"]
        if kept:
            kernel = FLOAT_EXPERTS_KERNEL if native else aten
            out["experts"] = {"scheme": "experts (kept in float)", "layers": kept, "kernel": kernel}
        # Llama 4's experts kept in float: fp32 ones on the native fp32 grouped kernel
        # (lower_float_experts), others on aten's bmm
        for r in (r for r in self.skipped if r.kind == "bmm"):
            kernel = BMM_EXPERTS_KERNEL if native and r.dtype == "float32" else BMM_ATEN_KERNEL
            group = {"scheme": "experts (kept in float)", "layers": [], "kernel": kernel}
            out.setdefault(f"bmm experts: {kernel}", group)["layers"].append(r.name)
        # the layers kept in fp32, bf16 or fp16 (passes/cpu/float32.py rewrites those of a
        # linear's layout: an [N, K] weight, as it is or read through a transpose)
        if native:
            from fxquant.passes.cpu.float32 import KERNELS

            def nk(r) -> bool:
                return r.kind == "linear" or (bool(r.read_transposed) and r.experts is None)

            for dtype, kernel in KERNELS.items():
                kept = [r.name for r in self.skipped if nk(r) and r.dtype == dtype]
                if kept:
                    scheme = f"{dtype} (kept in float)"
                    out[dtype] = {"scheme": scheme, "layers": kept, "kernel": kernel}
        return list(out.values())

    def cpu_kernels_table(self, machine: str | None = None) -> str:
        """:meth:`cpu_kernels` as lines: ``<scheme> (<n> layers): <kernel by M>``, under a
        header naming the CPU class."""
        from fxquant.passes.cpu.dispatch import machine_class

        lines = [f"CPU kernels by M, CPU class {machine or machine_class()}:"]
        lines += [
            f"  {k['scheme']} ({len(k['layers'])} layers): {k['kernel']}"
            for k in self.cpu_kernels(machine)
        ]
        return "\n".join(lines)

    def to_dict(self) -> dict:
        """The report as JSON-ready data: config, per-layer rows, per-norm records."""
        return {
            "config": None if self.config is None else self.config.to_dict(),
            "layers": [r.to_dict() for r in self.rows],
            "norms": self.norms,
            "program_bytes": self.program_bytes,
        }

    def __str__(self) -> str:
        header = ("layer", "scheme", "N×K", "bytes before", "bytes after", "SQNR dB", "note")
        table = [header]
        for r in self.rows:
            note = r.reason if r.status == "skipped" else ""
            if r.shared_with:
                note = f"shares weights with {r.shared_with}"
            elif r.padded_in_features not in (None, r.in_features):
                note = f"K padded {r.in_features}→{r.padded_in_features}"
            notes = [note] if note else []
            if r.float_weight_kept:
                notes.append("float weight kept (used elsewhere)")
            if r.fused_norm:
                notes.append(f"input quantized by {r.fused_norm}")
            if r.weights == "given":  # a checkpoint's or a calibrator's own constants
                notes.append("weights given (not quantized here)")
            note = "; ".join(notes)
            table.append(
                (
                    r.name or "<root>",
                    _scheme_str(r) if r.status == "quantized" else "float (skipped)",
                    # experts' weights (grouped_mm and bmm sites): E×N×K
                    ("" if r.experts is None else f"{r.experts}×")
                    + f"{r.out_features}×{r.in_features}",
                    f"{r.bytes_before:,}",
                    f"{r.bytes_after:,}",
                    "" if r.sqnr_db is None else f"{r.sqnr_db:.1f}",
                    note,
                )
            )
        widths = [max(len(row[i]) for row in table) for i in range(len(header))]
        lines = [
            "  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)).rstrip()
            for row in table
        ]
        lines.insert(1, "  ".join("-" * w for w in widths))
        text = "\n".join(lines) + "\n\n"
        if self.norms:
            text += "norm → quantize fusion:\n" + self.norms_table() + "\n\n"
        return text + self.summary()


def _scheme_str(row: LayerRow) -> str:
    return str(scheme_from_dict(row.scheme))


def _mib(n: int) -> str:
    return f"{n / 2**20:.2f} MiB"


def report(ep: ExportedProgram) -> Report:
    """The report of a quantized program (from ``quantize`` or ``torch.export.load``)."""
    if not isinstance(ep, ExportedProgram):
        raise ValueError(f"report() takes an ExportedProgram, got {type(ep).__name__}")
    rows, norms, config = read_graph(ep.graph)
    # Tied weights appear under several names but are stored (and saved) once.
    storages = {}
    for t in [*ep.state_dict.values(), *ep.constants.values()]:
        if isinstance(t, torch.Tensor):
            storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return Report(rows=rows, config=config, program_bytes=sum(storages.values()), norms=norms)


def read_graph(graph: fx.Graph) -> tuple[list[LayerRow], list[dict], QuantConfig | None]:
    """(layer rows, norm records, config) that the passes left in a graph, in graph order."""
    rows, norms, config = [], [], None
    for node in graph.nodes:
        custom = node.meta.get("custom") or {}
        row = LayerRow.from_node(node)
        if row is not None:
            rows.append(row)
        # torch.export.load gives the getitems of a multi-output op (norm_quant) that op's
        # metadata: the record is read from the op alone
        if NORM_KEY in custom and node.target is not operator.getitem:
            norms.append(json.loads(custom[NORM_KEY]))
        if CONFIG_KEY in custom:
            config = QuantConfig.from_json(custom[CONFIG_KEY])
    return rows, norms, config
