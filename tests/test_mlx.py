"""Apple MLX's affine groups (transformers' ``MetalConfig``): the grid against transformers'
own ``_affine_quantize_tensor`` / ``_affine_dequantize_tensor``, ``from_hf``, checkpoints in
both spellings (transformers' ``qbiases``, mlx-lm's ``biases`` + ``"quantization"``), the CPU
lowering."""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import fxquant
from conftest import check_package_without_fxquant
from fxquant.checkpoints import CheckpointError, read_quantized
from fxquant.core import reference_lowbit as ref_lowbit
from fxquant.core.config import IntxWeightOnly
from fxquant.core.reference import sqnr

metal = pytest.importorskip(
    "transformers.integrations.metal_quantization", reason="transformers has no MetalConfig here"
)

N, K, G = 48, 256, 64


def _weight(seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g)
    w[3, :G] = 0.7  # a constant group: MLX floors its scale at 1e-8
    w[5, G : 2 * G] = 0.0  # an all-zero group
    return w


class One(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(K, N)

    def forward(self, x):
        return self.proj(x)


@pytest.mark.parametrize("bits", [2, 4])
def test_the_mlx_grid_is_transformers_metal_quantization(bits):
    w = _weight(bits)
    scheme = IntxWeightOnly(bits=bits, group_size=G, zero_point="float", grid="mlx")
    q = scheme.quantize(w)
    words, scales, biases = metal._affine_quantize_tensor(w, G, bits)
    codes = ref_lowbit.unpack_intx(q.tensors["qweight"], bits)
    assert torch.equal(codes, ref_lowbit.unpack_mlx(words, bits))  # the same codes
    assert torch.equal(q.tensors["scale"], scales)  # and scales
    assert torch.equal(ref_lowbit.pack_mlx(codes, bits).view(torch.int32), words.view(torch.int32))
    want = metal._affine_dequantize_tensor(words, scales, biases, G, bits)
    # the bias kept as z = -bias / s: equal up to the fp32 rounding of that quotient
    torch.testing.assert_close(q.dequantized, want, rtol=0, atol=1e-6)
    assert not q.dequantized.isnan().any()


def test_the_grid_needs_a_float_zero_point_and_no_optimizer():
    with pytest.raises(ValueError, match="grid='mlx', zero_point='int'"):
        IntxWeightOnly(bits=2, group_size=G, grid="mlx")
    with pytest.raises(ValueError, match="optimizer='hqq'"):
        IntxWeightOnly(bits=4, group_size=G, zero_point="float", optimizer="hqq", grid="mlx")
    with pytest.raises(ValueError, match="grid"):
        IntxWeightOnly(bits=4, group_size=G, zero_point="float", grid="gptq")


def test_from_hf_metal_config_quantizes_as_transformers():
    from transformers import MetalConfig

    skip = fxquant.from_hf(MetalConfig(bits=2, group_size=32, modules_to_not_convert=["head"]))
    assert skip.modules_to_not_convert == ("head",) and skip.scheme.bits == 2
    cfg = fxquant.from_hf(MetalConfig(bits=4, group_size=G))
    assert cfg.scheme == IntxWeightOnly(bits=4, group_size=G, zero_point="float", grid="mlx")
    torch.manual_seed(0)
    model = One().eval()
    model.proj.weight.data = _weight()
    x = torch.randn(5, K)
    ep = fxquant.quantize(model, cfg, example_inputs=(x,))
    words, scales, biases = metal._affine_quantize_tensor(model.proj.weight.data, G, 4)
    w = metal._affine_dequantize_tensor(words, scales, biases, G, 4)
    want = x @ w.t() + model.proj.bias.data
    torch.testing.assert_close(ep.module()(x), want, rtol=1e-5, atol=1e-5)
    # the CPU lowering (the int4 kernel, native or aten) computes the same
    from fxquant.passes.lower import lower

    assert sqnr(want, lower(ep).module()(x)) > 40.0


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("bits", 8, "MetalConfig\\(bits=8\\).*float zero point"),
        ("group_size", 48, "allowed: 32, 64, 128, 256"),
        ("dequantize", True, "float model"),
    ],
)
def test_from_hf_refuses_what_it_cannot_honour(field, value, match):
    fields = {"quant_method": "metal", "bits": 4, "group_size": G, field: value}
    with pytest.raises(NotImplementedError, match=match):
        fxquant.from_hf(fields)


def _checkpoint(bits: int, *, mlx_names: bool, dtype=torch.bfloat16):
    """(tensors, dequantized weight) as transformers' MetalQuantize saves them (scales and biases
    in the model's dtype), or with mlx-lm's name for the biases."""
    w = _weight(7)
    words, scales, biases = metal._affine_quantize_tensor(w, G, bits)
    scales, biases = scales.to(dtype), biases.to(dtype)
    want = metal._affine_dequantize_tensor(words, scales, biases, G, bits)
    tensors = {
        "proj.weight": words,
        "proj.scales": scales,
        ("proj.biases" if mlx_names else "proj.qbiases"): biases,
        "proj.bias": torch.randn(N),
    }
    return tensors, want


@pytest.mark.parametrize("bits", [2, 4])
@pytest.mark.parametrize("mlx_names", [False, True])
def test_checkpoints_load_with_the_files_own_grid(bits, mlx_names):
    tensors, want = _checkpoint(bits, mlx_names=mlx_names)
    qcfg = {"quant_method": "mlx" if mlx_names else "metal", "bits": bits, "group_size": G}
    ckpt = read_quantized(tensors, quantization_config=qcfg)
    scheme = IntxWeightOnly(bits=bits, group_size=G, zero_point="float", grid="mlx")
    assert ckpt.schemes == {"proj": scheme}
    c = ckpt.weights["proj.weight"].tensors
    got = ref_lowbit.dequantize_intx_grouped(
        c["qweight"], c["scale"], c["zero"], bits=bits, group_size=G
    )
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    x = torch.randn(3, K)
    ep = fxquant.load_quantized(One(), ckpt, example_inputs=(x,))
    assert fxquant.report(ep).rows[0]["weights"] == "given"
    torch.testing.assert_close(ep.module()(x), x @ want.t() + tensors["proj.bias"])


def test_an_mlx_lm_directory_loads_from_its_quantization_key(tmp_path):
    from safetensors.torch import save_file

    tensors, want = _checkpoint(4, mlx_names=True, dtype=torch.float16)
    save_file(tensors, tmp_path / "model.safetensors")
    config = {"quantization": {"group_size": G, "bits": 4}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    ckpt = read_quantized(tmp_path)
    assert ckpt.format == "mlx affine (4-bit, groups of 64)"
    assert ckpt.tensors.keys() == {"proj.bias"}
    # fp16 flushed the constant group's scale (1e-8) to 0: it still reads as its bias
    c = ckpt.weights["proj.weight"].tensors
    got = ref_lowbit.dequantize_intx_grouped(
        c["qweight"], c["scale"], c["zero"], bits=4, group_size=G
    )
    assert torch.equal(got[3, :G], want[3, :G]) and float(want[3, 0]) != 0.0
    torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


def test_bad_mlx_checkpoints_say_what_is_wrong():
    tensors, _ = _checkpoint(4, mlx_names=False)
    qcfg = {"quant_method": "metal", "bits": 4, "group_size": G}
    with pytest.raises(NotImplementedError, match="MLX bits=3"):
        read_quantized(tensors, quantization_config={**qcfg, "bits": 3})
    missing = {k: v for k, v in tensors.items() if k != "proj.qbiases"}
    with pytest.raises(CheckpointError, match="'proj.biases' is missing"):
        read_quantized(missing, quantization_config=qcfg)
    short = {**tensors, "proj.scales": tensors["proj.scales"][:, :2]}
    with pytest.raises(CheckpointError, match="proj.qbiases"):
        read_quantized(short, quantization_config=qcfg)
    words = {**tensors, "proj.weight": tensors["proj.weight"].view(torch.int32).float()}
    with pytest.raises(CheckpointError, match="'proj.weight' has dtype float32"):
        read_quantized(words, quantization_config=qcfg)


@pytest.mark.slow
def test_an_mlx_program_saves_reports_and_packages(tmp_path):
    from torch.export import Dim

    torch.manual_seed(0)
    model = One().eval()
    x = torch.randn(3, K)
    cfg = fxquant.from_hf({"quant_method": "metal", "bits": 4, "group_size": G})
    qep = fxquant.quantize(model, cfg, example_inputs=(x,), dynamic_shapes=({0: Dim.DYNAMIC},))
    path = tmp_path / "mlx.pt2"
    torch.export.save(qep, path)
    loaded = torch.export.load(path)
    assert torch.equal(loaded.module()(x), qep.module()(x))
    row = fxquant.report(loaded).rows[0]
    assert row["status"] == "quantized" and "grid='mlx'" in str(fxquant.report(loaded).config)
    check_package_without_fxquant(qep, tmp_path, [torch.randn(m, K) for m in (1, 5)])
