"""AQLM (``Aqlm``, transformers' ``AqlmConfig``): checkpoints stored as the ``aqlm`` package
stores them load onto the weights its own decoder gives (tests/fixtures/aqlm_1.1.6.pt, written by
tests/fixtures/make_aqlm_fixture.py); the op, its CPU lowering and Triton kernel against the
reference; bad checkpoints and configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_checkpoints import One

import fxquant
from conftest import check_package_without_fxquant
from fxquant import Aqlm
from fxquant.checkpoints import CheckpointError, read_quantized
from fxquant.core import aqlm
from fxquant.core.reference import sqnr
from fxquant.passes.lower import lower

FIXTURE = torch.load(Path(__file__).parent / "fixtures" / "aqlm_1.1.6.pt")
N, K = 48, 128


def _id(case) -> str:
    c = case["quantization_config"]
    return f"{c['num_codebooks']}x{c['nbits_per_codebook']}-g{c['in_group_size']}"


def _loaded(case):
    bias = torch.randn(N)
    ckpt = read_quantized(
        {**case["tensors"], "proj.bias": bias}, quantization_config=case["quantization_config"]
    )
    x = torch.randn(3, K)
    dyn = ({0: torch.export.Dim.DYNAMIC},)
    return (
        ckpt,
        bias,
        fxquant.load_quantized(One(N, K), ckpt, example_inputs=(x,), dynamic_shapes=dyn),
    )


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=_id)
def test_aqlm_checkpoints_load_onto_the_packages_weights(case):
    ckpt, bias, ep = _loaded(case)
    c = case["quantization_config"]
    fields = ("in_group_size", "num_codebooks", "nbits_per_codebook")
    assert ckpt.schemes == {"proj": Aqlm(**{f: c[f] for f in fields})}
    t = ckpt.weights["proj.weight"].tensors
    w = aqlm.dequantize(t["qweight"], t["codebooks"], t["scale"])
    torch.testing.assert_close(w, case["weight"], rtol=1e-3, atol=1e-6)  # the package sums in fp16
    assert fxquant.report(ep).rows[0]["weights"] == "given"
    x = torch.randn(5, K)
    want = x @ w.t() + bias
    torch.testing.assert_close(ep.module()(x), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    args = (t["qweight"], t["codebooks"], t["scale"], bias)
    torch.library.opcheck(torch.ops.fxquant.aqlm_linear.default, (x, *args))


def test_the_cpu_lowering_computes_the_reference():
    ckpt, _, ep = _loaded(FIXTURE["cases"][1])
    lowered = lower(ep)
    targets = {str(n.target) for n in lowered.graph.nodes if n.op == "call_function"}
    assert not any(t.startswith("fxquant.") for t in targets), targets
    for m in (1, 6):
        x = torch.randn(m, K)
        assert sqnr(ep.module()(x), lowered.module()(x)) > 80


def test_sixteen_bit_codes_unwrap_as_the_package_does():
    codes = torch.tensor(
        [[[0]], [[32767]], [[-32768]], [[-1]]], dtype=torch.int16
    )  # 0, 2^15 - 1, 2^15, 2^16 - 1
    books = torch.zeros(1, 2**16, 1, 1)
    books[0, [0, 32767, 32768, 65535], 0, 0] = torch.tensor([1.0, 2.0, 3.0, 4.0])
    qcfg = {
        "quant_method": "aqlm",
        "in_group_size": 1,
        "num_codebooks": 1,
        "nbits_per_codebook": 16,
    }
    ckpt = read_quantized(
        {"p.codes": codes, "p.codebooks": books, "p.scales": torch.ones(4, 1, 1, 1)},
        quantization_config=qcfg,
    )
    t = ckpt.weights["p.weight"].tensors
    assert aqlm.dequantize(t["qweight"], t["codebooks"], t["scale"]).flatten().tolist() == [
        1.0,
        2.0,
        3.0,
        4.0,
    ]


@pytest.mark.interpreter
@pytest.mark.parametrize("case", FIXTURE["cases"], ids=_id)
@pytest.mark.parametrize(("m", "dtype"), [(1, torch.float32), (19, torch.bfloat16)])
def test_the_triton_kernel_is_the_reference(case, m, dtype):
    pytest.importorskip("triton")
    from fxquant.kernels.aqlm import lower_aqlm_linear

    ckpt = read_quantized(case["tensors"], quantization_config=case["quantization_config"])
    t = ckpt.weights["proj.weight"].tensors
    x, b = torch.randn(m, K).to(dtype), torch.randn(N)
    y = lower_aqlm_linear(x, t["qweight"], t["codebooks"], t["scale"], b)
    want = aqlm.aqlm_linear(x, t["qweight"], t["codebooks"], t["scale"], b)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    assert y.dtype == dtype and y.shape == (m, N)
    torch.testing.assert_close(y, want, rtol=tol, atol=tol * want.abs().max().item())


def test_bad_aqlm_checkpoints_and_configs_say_what_is_wrong():
    case = FIXTURE["cases"][0]
    qcfg, tensors = case["quantization_config"], case["tensors"]
    with pytest.raises(CheckpointError, match="'proj.codebooks' has shape"):
        read_quantized(tensors, quantization_config={**qcfg, "nbits_per_codebook": 12})
    with pytest.raises(CheckpointError, match="'proj.scales' is missing"):
        read_quantized(
            {k: v for k, v in tensors.items() if k != "proj.scales"}, quantization_config=qcfg
        )
    with pytest.raises(NotImplementedError, match="out_group_size=2"):
        read_quantized(tensors, quantization_config={**qcfg, "out_group_size": 2})
    with pytest.raises(NotImplementedError, match="hours of calibration"):
        fxquant.from_hf({"quant_method": "aqlm"})
    with pytest.raises(NotImplementedError, match="learned over hours"):
        Aqlm().quantize(torch.randn(8, 8))
    with pytest.raises(ValueError, match="Aqlm.out_group_size=8"):
        Aqlm(out_group_size=8)


@pytest.mark.slow
def test_an_aqlm_program_saves_and_packages(tmp_path):
    _, _, ep = _loaded(FIXTURE["cases"][0])
    path = tmp_path / "aqlm.pt2"
    torch.export.save(ep, path)
    x = torch.randn(4, K)
    assert torch.equal(torch.export.load(path).module()(x), ep.module()(x))
    check_package_without_fxquant(ep, tmp_path, [torch.randn(m, K) for m in (1, 6)])
