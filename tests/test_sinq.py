"""SINQ (``SinqWeightOnly``, transformers' ``SinqConfig``): the quantizer against what the ``sinq``
package itself made of the same weights (tests/fixtures/sinq_0.2.0.pt, written by
tests/fixtures/make_sinq_fixture.py), the op and its CPU lowerings against the reference math,
from_hf, and a package in a fresh process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.export import Dim

import fxquant
from conftest import Two, check_package_without_fxquant
from fxquant import SinqWeightOnly
from fxquant.core import sinq
from fxquant.core.reference import sqnr
from fxquant.passes.lower import lower

FIXTURE = torch.load(Path(__file__).parent / "fixtures" / "sinq_0.2.0.pt")


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=lambda c: f"{c['bits']}b-g{c['group_size']}")
def test_the_quantizer_is_the_sinq_package(case):
    # the codes and zero points bit for bit; the fp32 scales to a few units in the last place:
    # the Sinkhorn iterations' reductions round in another order on another CPU's vector width
    # (the fixture's machine and an AVX-512 / AMX Xeon differ by 1-2 ulps, ~2e-7 relative)
    got = sinq.sinq_quantize(case["weight"], bits=case["bits"], group_size=case["group_size"])
    assert torch.equal(got.codes, case["codes"])
    assert torch.equal(got.zero, case["zero"])
    for name in ("scale", "col_scale"):
        torch.testing.assert_close(getattr(got, name), case[name], rtol=1e-6, atol=0)
    torch.testing.assert_close(got.dequantize(), case["dequantized"], rtol=1e-6, atol=1e-6)


def test_the_kurtosis_gate_falls_back_to_round_to_nearest():
    gated = [sinq.kurtosis(c["weight"]) > sinq.SINQ_KURTOSIS_GATE for c in FIXTURE["cases"]]
    assert gated == [False, True, False, False]  # the fixture's outlier column
    heavy = FIXTURE["cases"][1]
    q = sinq.sinq_quantize(heavy["weight"], bits=4, group_size=64)
    assert q.gated and torch.equal(q.col_scale, torch.ones(128))


def test_sinkhorn_balances_the_tile():
    torch.manual_seed(0)
    w = torch.randn(64, 64) * torch.logspace(-1, 1, 64)  # columns of very different spread

    def spread(t):  # max / min standard deviation over rows and columns
        stds = torch.cat([t.std(0), t.std(1)])
        return float(stds.max() / stds.min())

    normed, col, row = sinq.sinkhorn_scales(w)
    assert spread(normed) < spread(w) / 3
    assert torch.allclose(normed * col * row, w, rtol=1e-5, atol=1e-6)


def _quantized(dtype=torch.float32):
    torch.manual_seed(0)
    model = Two().eval().to(dtype)
    x = torch.randn(5, 128, dtype=dtype)
    qep = fxquant.quantize(
        model, "sinq-int4-64", example_inputs=(x,), dynamic_shapes=({0: Dim.DYNAMIC},)
    )
    return model, qep


def test_the_op_is_the_dequantized_weight_on_x():
    model, qep = _quantized()
    rep = fxquant.report(qep)
    assert [r["status"] for r in rep.rows] == ["quantized", "quantized"]
    w = model.a.weight.data
    q = SinqWeightOnly(bits=4, group_size=64).quantize(w)
    t = q.tensors
    x = torch.randn(3, 128)
    got = torch.ops.fxquant.sinq_weight_only_linear(
        x, t["qweight"], t["scale"], t["zero"], t["col_scale"], None, 4, 64
    )
    torch.testing.assert_close(got, x @ q.dequantized.t(), rtol=1e-5, atol=1e-5)
    torch.library.opcheck(
        torch.ops.fxquant.sinq_weight_only_linear.default,
        (x, t["qweight"], t["scale"], t["zero"], t["col_scale"], model.a.bias.data, 4, 64),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_lowering_computes_the_reference(dtype, cpu_kernels):
    _, qep = _quantized(dtype)
    lowered = lower(qep)
    targets = {str(n.target) for n in lowered.graph.nodes if n.op == "call_function"}
    assert not any("sinq_weight_only_linear" in t for t in targets), targets  # prepacked
    floor = 80.0 if cpu_kernels == "native" and dtype == torch.float32 else 35.0
    for m in (1, 7):
        x = torch.randn(m, 128, dtype=dtype)
        got, want = lowered.module()(x), qep.module()(x)
        assert got.dtype == want.dtype and sqnr(want.float(), got.float()) >= floor, m


def test_layers_sinq_cannot_take_are_skipped_and_reported():
    model = nn.Sequential(nn.Linear(96, 64), nn.Linear(64, 8)).eval()
    qep = fxquant.quantize(model, "sinq-int4-64", example_inputs=(torch.randn(2, 96),))
    rows = fxquant.report(qep).rows
    assert [r["status"] for r in rows] == ["skipped", "skipped"]
    assert "multiple of group_size=64" in rows[0]["reason"]
    assert "multiple of 32" in rows[1]["reason"]  # 64 · 8 / 64 = 8 row scales


def test_from_hf_maps_sinq_config_and_refuses_the_rest():
    from transformers import SinqConfig

    cfg = fxquant.from_hf(SinqConfig(nbits=3, group_size=128, modules_to_not_convert=["lm_head"]))
    assert cfg.scheme == SinqWeightOnly(bits=3, group_size=128)
    assert cfg.modules_to_not_convert == ("lm_head",)
    for field, value, match in (
        ("method", "asinq", "calibration"),
        ("tiling_mode", "2D", "column scales"),
        ("nbits", 8, "allowed: 4, 3, 2"),
        ("group_size", 48, "allowed: 32, 64"),
    ):
        with pytest.raises(NotImplementedError, match=match):
            fxquant.from_hf({"quant_method": "sinq", field: value})
    with pytest.raises(ValueError, match="SinqWeightOnly.bits=5"):
        SinqWeightOnly(bits=5)


@pytest.mark.slow
def test_a_sinq_package_runs_without_fxquant(tmp_path):
    _, qep = _quantized()
    path = tmp_path / "q.pt2"
    torch.export.save(qep, path)
    loaded = torch.export.load(path)
    x = torch.randn(4, 128)
    assert torch.equal(loaded.module()(x), qep.module()(x))
    check_package_without_fxquant(qep, tmp_path, [torch.randn(m, 128) for m in (1, 6)])
