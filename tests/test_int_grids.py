"""Other libraries' integer grids as options of fxquant's integer schemes (``grid=``): torchao's
(amax / 127.5 and / 7.5, tests/fixtures/torchao_0.18.0_grids.pt, written by
tests/fixtures/make_torchao_grid_fixture.py) and compressed-tensors' (its own
``calculate_qparams`` and ``quantize``, live), bit for bit, in fp32 and bf16; the configs that
now map (TorchAoConfig int8 / IntxWeightOnlyConfig int4, CompressedTensorsConfig W8A16 /
W4A16); and a float model quantized into a compressed-tensors int4 checkpoint that the library
decompresses to the weights its own quantizer gives."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fxquant
from conftest import TinyLlama
from fxquant import Int4WeightOnly, Int8WeightOnly
from fxquant.core import reference as ref
from fxquant.core.reference import sqnr
from fxquant.passes.lower import lower

TORCHAO = torch.load(Path(__file__).parent / "fixtures" / "torchao_0.18.0_grids.pt")


@pytest.mark.parametrize(
    "case", TORCHAO["cases"], ids=lambda c: f"{c['config'][:14]}-{c['weight'].dtype}"
)
def test_the_torchao_grid_is_torchaos_quantize(case):
    w = case["weight"]
    if case["config"].startswith("Int8"):
        t = Int8WeightOnly(grid="torchao").quantize(w).tensors
        assert torch.equal(t["qweight"], case["qdata"])
        assert torch.equal(t["scale"], case["scale"].float().reshape(-1))
    else:
        t = Int4WeightOnly(group_size=32, symmetric=True, grid="torchao").quantize(w).tensors
        assert torch.equal(ref.unpack_int4(t["qweight"]).to(torch.int8) - 8, case["qdata"])
        assert torch.equal(t["scale"], case["scale"].float().reshape(16, -1))
        assert torch.equal(t["zero"], torch.full_like(t["zero"], 8))
    if w.dtype == torch.float32:  # the code fxquant's own grid never uses (bf16's rounding of
        assert int(case["qdata"].min()) in (-128, -8)  # the scale can keep the int8 one away)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("bits", "group", "symmetric"), [(8, None, True), (4, 32, True), (4, 128, True), (4, 32, False)]
)
def test_the_compressed_tensors_grid_is_its_quantizer(bits, group, symmetric, dtype):
    ct = pytest.importorskip("compressed_tensors.quantization")
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    torch.manual_seed(bits + (group or 0))
    w = torch.randn(16, 256) * 0.05
    w[1, 7] = -w[1].abs().max() * 1.5
    w[2] = 0.0  # an all-zero row: its scale is the dtype's eps, its zero point 0
    w[3, :128] = 0.01  # groups that do not straddle zero
    w = w.to(dtype)
    strategy = "channel" if group is None else "group"
    args = ct.QuantizationArgs(
        num_bits=bits, type="int", symmetric=symmetric, strategy=strategy, group_size=group
    )
    view = w if group is None else w.reshape(16, -1, group)
    mn, mx = view.amin(-1, keepdim=group is None), view.amax(-1, keepdim=group is None)
    s, zp = calculate_qparams(mn, mx, args)
    q = quantize(w, s, zp, args, dtype=torch.int8)
    if bits == 8:
        t = Int8WeightOnly(grid="compressed-tensors").quantize(w).tensors
        assert torch.equal(t["qweight"], q) and torch.equal(t["scale"], s.float().reshape(-1))
    else:
        scheme = Int4WeightOnly(group_size=group, symmetric=symmetric, grid="compressed-tensors")
        t = scheme.quantize(w).tensors
        assert torch.equal(ref.unpack_int4(t["qweight"]).to(torch.int8) - 8, q)
        assert torch.equal(t["scale"], s.float())
        assert torch.equal(t["zero"].to(torch.int8) - 8, zp.to(torch.int8))


def test_codes_of_minus_128_and_minus_8_run_through_the_ops_and_lowerings(cpu_kernels):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(256, 64), torch.nn.ReLU(), torch.nn.Linear(64, 32)
    ).eval()
    with torch.no_grad():
        model[0].weight[:, 3] = -model[0].weight.abs().amax(1) * 2  # every row reaches -128 / -8
    x = torch.randn(5, 256)
    for scheme in (
        Int8WeightOnly(grid="torchao"),
        Int4WeightOnly(group_size=32, symmetric=True, grid="compressed-tensors"),
    ):
        qep = fxquant.quantize(model, scheme, example_inputs=(x,))
        t = scheme.quantize(model[0].weight.data).tensors
        if scheme.name == "int8_weight_only":
            assert int(t["qweight"].min()) == -128
        else:
            assert int(ref.unpack_int4(t["qweight"]).min()) == 0  # the code -8
        want = model(x)
        got = qep.module()(x)
        assert sqnr(want, got) > 15  # int4 with an outlier column
        assert sqnr(got, lower(qep).module()(x)) > 35  # the CPU kernels take the new codes


def test_from_hf_maps_torchao_and_compressed_tensors_integer_configs():
    cfg = fxquant.from_hf({"quant_method": "torchao", "quant_type": "int8_weight_only"})
    assert cfg.scheme == Int8WeightOnly(grid="torchao")
    intx = {"default": {"_type": "IntxWeightOnlyConfig", "_data": {
        "weight_dtype": {"_type": "torch.dtype", "_data": "int4"},
        "granularity": {"_type": "PerGroup", "_data": {"group_size": 64}},
        "mapping_type": {"_type": "MappingType", "_data": "SYMMETRIC"},
    }}}  # fmt: skip
    cfg = fxquant.from_hf({"quant_method": "torchao", "quant_type": intx})
    assert cfg.scheme == Int4WeightOnly(group_size=64, symmetric=True, grid="torchao")
    data = {
        **intx["default"]["_data"],
        "mapping_type": {"_type": "MappingType", "_data": "ASYMMETRIC"},
    }
    asym = {"default": {"_type": "IntxWeightOnlyConfig", "_data": data}}
    with pytest.raises(NotImplementedError, match="SYMMETRIC"):
        fxquant.from_hf({"quant_method": "torchao", "quant_type": asym})
    w4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128, "symmetric": False}
    ct = {
        "quant_method": "compressed-tensors",
        "config_groups": {"g": {"targets": ["Linear"], "weights": w4}},
    }
    cfg = fxquant.from_hf(ct)
    assert cfg.scheme == Int4WeightOnly(group_size=128, symmetric=False, grid="compressed-tensors")
    with pytest.raises(ValueError, match="grid='torchao', symmetric=False"):
        Int4WeightOnly(symmetric=False, grid="torchao")


def test_a_float_model_quantizes_into_a_compressed_tensors_int4_checkpoint(tmp_path):
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
        CompressedTensorsDequantizer,
    )
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import dequantize, quantize
    from compressed_tensors.quantization.utils import calculate_qparams
    from safetensors.torch import load_file

    torch.manual_seed(0)
    model = TinyLlama(layers=1).eval()
    w4 = {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": True}
    groups = {"g": {"targets": ["Linear"], "weights": w4}}
    ct = {"quant_method": "compressed-tensors", "config_groups": groups, "ignore": ["lm_head"]}
    ids = torch.randint(0, 96, (2, 5))
    qep = fxquant.quantize(model, fxquant.from_hf(ct), example_inputs=(ids,))
    out = fxquant.save_compressed_tensors(qep, tmp_path / "ckpt", model_config={"vocab_size": 96})
    deq = CompressedTensorsDequantizer(out, dtype=torch.float32).process(
        dict(load_file(str(out / "model.safetensors")))
    )
    args = QuantizationArgs(num_bits=4, type="int", symmetric=True, strategy="group", group_size=32)
    for name, p in model.named_parameters():
        if not name.startswith("layers.0.") or not name.endswith("proj.weight"):
            continue
        g = p.detach().reshape(p.shape[0], -1, 32)
        s, zp = calculate_qparams(g.amin(-1), g.amax(-1), args)
        want = dequantize(quantize(p.detach(), s, zp, args), s, zp, args)  # the library's own QDQ
        assert torch.equal(deq[name], want), name


def test_torchaos_own_config_objects_map():
    pytest.importorskip("torchao")
    from torchao.quantization import Int8WeightOnlyConfig, IntxWeightOnlyConfig
    from torchao.quantization.granularity import PerGroup
    from transformers import TorchAoConfig

    assert fxquant.from_hf(TorchAoConfig(Int8WeightOnlyConfig())).scheme == Int8WeightOnly(
        grid="torchao"
    )
    cfg = TorchAoConfig(IntxWeightOnlyConfig(weight_dtype=torch.int4, granularity=PerGroup(32)))
    assert fxquant.from_hf(cfg).scheme == Int4WeightOnly(
        group_size=32, symmetric=True, grid="torchao"
    )
