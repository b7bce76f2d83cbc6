"""AutoRound (``AutoRoundConfig``): checkpoints packed by auto-round's own exporters
(tests/fixtures/auto_round_0.15.0.pt, written by tests/fixtures/make_auto_round_fixture.py) load
onto the weights they encode, per-layer ``extra_config`` overrides, and what is refused."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_checkpoints import One, dequantize

import fxquant
from fxquant.checkpoints import CheckpointError, read_quantized

FIXTURE = torch.load(Path(__file__).parent / "fixtures" / "auto_round_0.15.0.pt")
N, K = 64, 256


def _id(case) -> str:
    c = case["quantization_config"]
    return f"{c['packing_format']}-{c['bits']}b-g{c['group_size']}-{'sym' if c['sym'] else 'asym'}"


def _encoded(case) -> torch.Tensor:
    g = K // case["scales"].shape[1]
    z = case["zeros"].float().repeat_interleave(g, 1)
    return (case["codes"].float() - z) * case["scales"].float().repeat_interleave(g, 1)


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=_id)
def test_auto_round_checkpoints_load_onto_the_weights_they_encode(case):
    qcfg = case["quantization_config"]
    bias = torch.randn(N)
    ckpt = read_quantized({**case["tensors"], "proj.bias": bias}, quantization_config=qcfg)
    assert ckpt.format == f"auto-round ({qcfg['packing_format']})"
    assert ckpt.tensors.keys() == {"proj.bias"}
    scheme = ckpt.schemes["proj"]
    want = _encoded(case)
    got = dequantize(scheme, ckpt.weights["proj.weight"].tensors, N, K)
    torch.testing.assert_close(got, want, rtol=0, atol=0)  # negative scales included
    x = torch.randn(3, K)
    ep = fxquant.load_quantized(One(N, K), ckpt, example_inputs=(x,))
    assert fxquant.report(ep).rows[0]["weights"] == "given"
    ref = x @ want.t() + bias  # fp32 sums in another order
    torch.testing.assert_close(ep.module()(x), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_extra_config_gives_layers_their_own_bits_and_float():
    four = next(c for c in FIXTURE["cases"] if c["quantization_config"]["bits"] == 4)
    two = next(c for c in FIXTURE["cases"] if c["quantization_config"]["bits"] == 2)
    qcfg = {
        **four["quantization_config"],
        "extra_config": {
            "model.layers.0.mlp.up": {"bits": 2, "group_size": 32},  # an exact name
            r".*lm_head.*": {"bits": 16},  # a regex: kept in float
        },
    }
    tensors = {f"model.layers.0.attn.q.{k.split('.')[-1]}": v for k, v in four["tensors"].items()}
    tensors |= {f"model.layers.0.mlp.up.{k.split('.')[-1]}": v for k, v in two["tensors"].items()}
    tensors["lm_head.weight"] = torch.randn(N, K)
    ckpt = read_quantized(tensors, quantization_config=qcfg)
    assert ckpt.tensors.keys() == {"lm_head.weight"}
    for m, case in (("model.layers.0.attn.q", four), ("model.layers.0.mlp.up", two)):
        got = dequantize(ckpt.schemes[m], ckpt.weights[f"{m}.weight"].tensors, N, K)
        torch.testing.assert_close(got, _encoded(case), rtol=0, atol=0)
    with pytest.raises(CheckpointError, match="keeps it in float"):
        bad = {**qcfg, "extra_config": {"model.layers.0.attn.q": {"bits": 16}}}
        read_quantized(tensors, quantization_config=bad)


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"packing_format": "auto_round:fp8"}, NotImplementedError, "packing_format"),
        ({"data_type": "nv_fp"}, NotImplementedError, "data_type='nv_fp'"),
        ({"bits": 5}, NotImplementedError, "bits=5"),
    ],
)
def test_what_auto_round_checkpoints_cannot_load_is_said(change, error, match):
    case = FIXTURE["cases"][0]
    with pytest.raises(error, match=match):
        read_quantized(
            case["tensors"], quantization_config={**case["quantization_config"], **change}
        )


def test_bad_auto_round_tensors_are_named():
    case = FIXTURE["cases"][0]
    qcfg = case["quantization_config"]
    missing = {k: v for k, v in case["tensors"].items() if k != "proj.qzeros"}
    with pytest.raises(CheckpointError, match="'proj.qzeros' is missing"):
        read_quantized(missing, quantization_config=qcfg)
    short = {**case["tensors"], "proj.scales": case["tensors"]["proj.scales"][:1, :8]}
    with pytest.raises(CheckpointError, match="proj.scales"):
        read_quantized(short, quantization_config=qcfg)


def test_a_legacy_intel_auto_round_config_reads_its_backend_key():
    case = next(
        c
        for c in FIXTURE["cases"]
        if c["quantization_config"]["packing_format"] == "auto_round:auto_gptq"
    )
    qcfg = {k: v for k, v in case["quantization_config"].items() if k != "packing_format"}
    qcfg |= {"quant_method": "intel/auto-round", "backend": "auto_round:gptq:exllamav2"}
    ckpt = read_quantized(case["tensors"], quantization_config=qcfg)
    got = dequantize(ckpt.schemes["proj"], ckpt.weights["proj.weight"].tensors, N, K)
    torch.testing.assert_close(got, _encoded(case), rtol=0, atol=0)


def test_negative_scales_survive_the_cpu_lowering(cpu_kernels):
    # AutoRound's symmetric grid signs its scales: the int4 CPU kernels must take them as given
    from fxquant.core.reference import sqnr
    from fxquant.passes.lower import lower

    case = FIXTURE["cases"][0]
    assert case["quantization_config"]["sym"] and (case["scales"] < 0).any()
    tensors = {**case["tensors"], "proj.bias": torch.randn(N)}
    ckpt = read_quantized(tensors, quantization_config=case["quantization_config"])
    x = torch.randn(5, K)
    ep = fxquant.load_quantized(One(N, K), ckpt, example_inputs=(x,))
    want = ep.module()(x)
    assert sqnr(want, lower(ep).module()(x)) > 35.0
