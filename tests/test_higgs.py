"""HIGGS (``Higgs``, transformers' ``HiggsConfig``): the grids against what they claim to be
(Lloyd-Max quantizers of N(0, 1) for p = 1; Lloyd fixed points of the 2-D Gaussian for p = 2),
the quantizer against transformers' own ``quantize_with_higgs``, the op, its CPU lowering and
Triton kernel against the reference math, from_hf, and a package in a fresh process."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn
from torch.export import Dim

import fxquant
from conftest import check_package_without_fxquant
from fxquant import Higgs
from fxquant.core import higgs
from fxquant.core.reference import sqnr, sylvester_hadamard
from fxquant.passes.lower import lower

SCHEMES = [Higgs(), Higgs(bits=2), Higgs(bits=3, p=1, hadamard_size=256), Higgs(hadamard_size=1024)]


def _id(s: Higgs) -> str:
    return f"{s.bits}b-p{s.p}-h{s.hadamard_size}"


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_scalar_grids_are_the_lloyd_max_quantizers_of_the_gaussian(bits):
    n = 2**bits
    c = torch.linspace(-2, 2, n, dtype=torch.float64)
    pdf = lambda t: torch.exp(-(t**2) / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda t: 0.5 * (1 + torch.erf(t / math.sqrt(2)))  # noqa: E731
    inf = torch.tensor([math.inf], dtype=torch.float64)
    for _ in range(3000):  # Lloyd: cells at the midpoints, each point its cell's mean
        t = torch.cat([-inf, (c[1:] + c[:-1]) / 2, inf])
        c = (pdf(t[:-1]) - pdf(t[1:])) / (cdf(t[1:]) - cdf(t[:-1]))
    torch.testing.assert_close(higgs.grid(1, bits)[:, 0].double(), c, rtol=0, atol=2e-4)


@pytest.mark.parametrize("bits", [2, 3, 4])
def test_vector_grids_are_lloyd_fixed_points_of_the_2d_gaussian(bits):
    g = higgs.grid(2, bits)
    x = torch.randn(400_000, 2, generator=torch.Generator().manual_seed(bits))
    cell = torch.argmax(2 * x @ g.t() - g.pow(2).sum(-1), dim=-1)
    counts = torch.bincount(cell, minlength=g.shape[0]).clamp(min=1)
    means = torch.zeros_like(g).index_add_(0, cell, x) / counts[:, None]
    # every point is (up to sampling noise) the mean of its cell: an MSE-optimal grid
    assert float((means - g).norm(dim=-1).max()) < 0.12
    mse = float((x - g[cell]).pow(2).sum(-1).mean()) / 2
    assert mse < {2: 0.12, 3: 0.037, 4: 0.0115}[bits]  # per coordinate, near 2^-2b·π√3/2


def test_the_quantizer_is_transformers_quantize_with_higgs(monkeypatch):
    th = pytest.importorskip("transformers.integrations.higgs")
    got = {}

    def capture(codes, scales, grid, **kw):  # FLUTE's packing, which the codes go into
        got.update(codes=codes, scales=scales, grid=grid, **kw)
        return codes, scales, grid, grid, None

    def hadamard_transform(x, scale):  # fast_hadamard_transform's: x·H·scale, Sylvester's H
        return x @ sylvester_hadamard(x.shape[-1]) * scale

    monkeypatch.setattr(th, "hadamard_transform", hadamard_transform, raising=False)
    monkeypatch.setattr(th, "prepare_data_transposed", capture, raising=False)
    torch.manual_seed(0)
    w = torch.randn(32, 768) * 0.05
    w[:, 7] *= 20
    for bits, p, h, g in ((4, 2, 512, 256), (3, 1, 256, 64), (2, 2, 1024, 128)):
        th.quantize_with_higgs(w, bits=bits, p=p, group_size=g, hadamard_size=h)
        codes, scale = higgs.quantize(w, bits=bits, p=p, hadamard_size=h)
        assert torch.equal(got["codes"], codes)
        assert torch.equal(got["scales"], scale.repeat_interleave(h // g, dim=1))
        assert torch.equal(got["grid"], higgs.grid(p, bits))


@pytest.mark.parametrize("scheme", SCHEMES, ids=_id)
def test_the_op_is_the_reference_and_passes_opcheck(scheme):
    torch.manual_seed(0)
    w = torch.randn(24, 768) * 0.05
    q = scheme.quantize(w)
    assert sqnr(w, q.dequantized) > {2: 8, 3: 13, 4: 19}[scheme.bits]
    t = q.tensors
    x, b = torch.randn(2, 3, 768), torch.randn(24)
    op = torch.ops.fxquant.higgs_linear
    y = op(x, t["qweight"], t["scale"], t["grid"], b, scheme.hadamard_size)
    want = higgs.higgs_linear(
        x, t["qweight"], t["scale"], t["grid"], b, hadamard_size=scheme.hadamard_size
    )
    assert torch.equal(y, want) and y.shape == (2, 3, 24)
    torch.library.opcheck(
        op.default, (x, t["qweight"], t["scale"], t["grid"], b, scheme.hadamard_size)
    )
    assert (
        op(x.bfloat16(), t["qweight"], t["scale"], t["grid"], None, scheme.hadamard_size).dtype
        == torch.bfloat16
    )


def test_all_zero_blocks_give_zeros():
    q = Higgs().quantize(torch.zeros(8, 512))
    assert torch.equal(q.dequantized, torch.zeros(8, 512)) and torch.equal(
        q.tensors["scale"], torch.zeros(8, 1)
    )


class Two(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(768, 64), nn.Linear(64, 32, bias=False)

    def forward(self, x):
        return self.b(torch.relu(self.a(x)))


def _quantized(dtype=torch.float32):
    torch.manual_seed(0)
    model = Two().eval().to(dtype)
    x = torch.randn(5, 768, dtype=dtype)
    cfg = fxquant.QuantConfig(scheme=Higgs(group_size=64))
    qep = fxquant.quantize(model, cfg, example_inputs=(x,), dynamic_shapes=({0: Dim.DYNAMIC},))
    return model, qep


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cpu_lowering_computes_the_reference(dtype):
    model, qep = _quantized(dtype)
    assert [r["status"] for r in fxquant.report(qep).rows] == ["quantized", "quantized"]
    lowered = lower(qep)
    targets = {str(n.target) for n in lowered.graph.nodes if n.op == "call_function"}
    assert not any(t.startswith("fxquant.") for t in targets), targets
    for m in (1, 7):
        x = torch.randn(m, 768, dtype=dtype)
        got, want = lowered.module()(x), qep.module()(x)
        floor = 80.0 if dtype == torch.float32 else 35.0
        assert got.dtype == want.dtype and sqnr(want.float(), got.float()) >= floor, m


def test_layers_higgs_cannot_take_are_skipped_and_reported():
    model = nn.Sequential(nn.Linear(300, 64), nn.Linear(64, 8)).eval()
    qep = fxquant.quantize(model, "higgs-int4", example_inputs=(torch.randn(2, 300),))
    rows = fxquant.report(qep).rows
    assert [r["status"] for r in rows] == ["skipped", "skipped"]
    assert "multiple of group_size=256" in rows[0]["reason"]


@pytest.mark.interpreter
@pytest.mark.parametrize("scheme", SCHEMES, ids=_id)
@pytest.mark.parametrize(("m", "dtype"), [(1, torch.float32), (19, torch.bfloat16)])
def test_the_triton_kernel_is_the_reference(scheme, m, dtype):
    pytest.importorskip("triton")
    from fxquant.kernels.higgs import lower_higgs_linear

    torch.manual_seed(m)
    w = torch.randn(40, 768) * 0.05
    t = scheme.quantize(w).tensors
    x, b = torch.randn(m, 768).to(dtype), torch.randn(40)
    args = (t["qweight"], t["scale"], t["grid"], b)
    y = lower_higgs_linear(x, *args, scheme.hadamard_size)
    want = higgs.higgs_linear(x, *args, hadamard_size=scheme.hadamard_size)
    assert y.dtype == dtype and y.shape == (m, 40)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    torch.testing.assert_close(y, want, rtol=tol, atol=tol * want.abs().max().item())


def test_from_hf_maps_higgs_config():
    from transformers import HiggsConfig

    cfg = fxquant.from_hf(HiggsConfig())
    assert cfg.scheme == Higgs() == fxquant.RECIPES["higgs-int4"]
    cfg = fxquant.from_hf(
        HiggsConfig(bits=3, p=1, hadamard_size=1024, group_size=128, tune_metadata={"a": 1})
    )
    assert cfg.scheme == Higgs(bits=3, p=1, hadamard_size=1024, group_size=128)
    for field, value, match in (
        ("bits", 8, "allowed: 2, 3, 4"),
        ("p", 3, "allowed: 1, 2"),
        ("group_size", 32, "allowed: 64, 128, 256"),
        ("hadamard_size", 384, "a power of two"),
    ):
        with pytest.raises(NotImplementedError, match=match):
            fxquant.from_hf({"quant_method": "higgs", field: value})
    with pytest.raises(ValueError, match="Higgs.hadamard_size=128"):
        Higgs(hadamard_size=128)
    with pytest.raises(NotImplementedError, match="FLUTE"):
        fxquant.read_quantized(
            {"a.weight": torch.zeros(1)}, quantization_config={"quant_method": "higgs"}
        )


@pytest.mark.slow
def test_a_higgs_package_runs_without_fxquant(tmp_path):
    _, qep = _quantized()
    path = tmp_path / "h.pt2"
    torch.export.save(qep, path)
    loaded = torch.export.load(path)
    x = torch.randn(4, 768)
    assert torch.equal(loaded.module()(x), qep.module()(x))
    check_package_without_fxquant(qep, tmp_path, [torch.randn(m, 768) for m in (1, 6)])
