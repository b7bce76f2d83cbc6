"""A program saved by an earlier fxquant still reports: ``fixtures/report_v1.pt2`` was written
before report rows were typed (``fixtures/make_report_v1.py`` says how), and its report must read
as it did then (``fixtures/report_v1.txt``), row for row, and run."""

from __future__ import annotations

from pathlib import Path

import torch

import fxquant
from fxquant.core.row import LayerRow

FIXTURES = Path(__file__).resolve().parent / "fixtures"


def test_a_program_saved_before_typed_rows_reports_as_it_did():
    ep = fxquant.load_program(FIXTURES / "report_v1.pt2")
    rep = fxquant.report(ep)
    assert str(rep) + "\n" == (FIXTURES / "report_v1.txt").read_text()
    assert all(isinstance(r, LayerRow) for r in rep.rows)
    assert [r.name for r in rep.quantized] == ["q", "k", "up", "down", "lm_head"]
    assert rep.rows[0]["fused_norm"] == rep.rows[0].fused_norm == "norm"  # read as a mapping too
    assert rep.rows[3].padded_in_features == 64 and rep.rows[4].reason == "override 'keep'"
    out = ep.module()(torch.randint(0, 48, (1, 5)))  # exported with these static sizes
    assert out.shape == (1, 5, 48) and torch.isfinite(out).all()


def test_a_row_round_trips_through_json_and_keeps_what_it_does_not_know():
    row = LayerRow.from_json(
        '{"name": "fc", "weight": "fc.weight", "node": "linear", "kind": "linear",'
        ' "in_features": 8, "out_features": 4, "dtype": "float32", "status": "skipped",'
        ' "scheme": null, "reason": "why", "bytes_before": 128, "bytes_after": 128,'
        ' "sqnr_db": null, "a_later_key": [1, 2]}'
    )
    assert row.status == "skipped" and row.extra == {"a_later_key": [1, 2]}
    assert LayerRow.from_json(row.to_json()) == row
    assert dict(row)["a_later_key"] == [1, 2] and "experts" not in row
