"""AMD Quark checkpoints (``quant_method: "quark"``): each per-layer scheme fxquant has loads onto
the weights it encodes, written in the layout amd/Quark's exporter packs (``quark/torch/utils/
pack.py``: transposed int4 words in AWQ's nibble order or plain order, two's-complement int4,
MXFP4 bytes, fp8 with 0-d or per-channel scales); the config's exclude / layer patterns pick
each layer's spec; what has no fxquant form is refused with the reason."""

from __future__ import annotations

import pytest
import torch
from test_checkpoints import K, N, check_loaded, dequantize

from fxquant.checkpoints import CheckpointError, read_quantized
from fxquant.checkpoints.quark import layer_config
from fxquant.core import reference_mx as ref_mx
from fxquant.core.config import (
    MXFP4,
    Float8Dynamic,
    Float8Static,
    Float8WeightOnly,
    Int4WeightOnly,
    Int8DynamicActivation,
    Int8WeightOnly,
)


def spec(dtype, qscheme, *, dynamic=False, group_size=None, symmetric=True, **more):
    axis = 1 if qscheme == "per_group" else 0
    return {"dtype": dtype, "qscheme": qscheme, "is_dynamic": dynamic, "group_size": group_size,
            "symmetric": symmetric, "ch_axis": axis, **more}  # fmt: skip


def config(weight, inputs=None, **top):
    layer = {"weight": weight, "input_tensors": inputs, "output_tensors": None, "bias": None}
    return {
        "quant_method": "quark",
        "global_quant_config": layer,
        "layer_quant_config": {},
        "layer_type_quant_config": {},
        "exclude": ["lm_head"],
        "export": {"weight_format": "real_quantized", "pack_method": "reorder"},
        **top,
    }


def _pack_words(v: torch.Tensor, order) -> torch.Tensor:
    """Quark's Pack_4_bits along the last dim: nibble i of word c holds column 8c + order[i]."""
    out = torch.zeros(v.shape[0], v.shape[1] // 8, dtype=torch.int64)
    for i, col in enumerate(order):
        out |= (v[:, col::8].to(torch.int64) & 0xF) << (4 * i)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def _fp8(n=N, k=K, per_channel=False):
    torch.manual_seed(0)
    w = (torch.randn(n, k) * 3).clamp(-448, 448).to(torch.float8_e4m3fn)
    s = torch.rand(n) * 0.01 + 0.001 if per_channel else torch.tensor(0.004)
    want = w.float() * (s[:, None] if per_channel else s)
    return w, s, want


@pytest.mark.parametrize(
    ("weight", "inputs", "scheme"),
    [
        (spec("fp8_e4m3", "per_channel"), None, Float8WeightOnly()),
        (spec("fp8_e4m3", "per_tensor"), None, Float8WeightOnly()),
        (
            spec("fp8_e4m3", "per_channel"),
            spec("fp8_e4m3", "per_channel", dynamic=True),
            Float8Dynamic(granularity="row"),
        ),
        (
            spec("fp8_e4m3", "per_tensor"),
            spec("fp8_e4m3", "per_tensor", dynamic=True),
            Float8Dynamic(granularity="tensor"),
        ),
        (
            spec("fp8_e4m3", "per_tensor"),
            spec("fp8_e4m3", "per_tensor"),
            Float8Static(activation_scale=0.25),
        ),
    ],
    ids=["channel", "tensor", "channel-token", "tensor-tensor", "tensor-static"],
)
def test_fp8_layers_load(weight, inputs, scheme):
    w, s, want = _fp8(per_channel=weight["qscheme"] == "per_channel")
    tensors = {"proj.weight": w, "proj.weight_scale": s, "proj.bias": torch.randn(N)}
    if inputs is not None and not inputs["is_dynamic"]:
        tensors["proj.input_scale"] = torch.tensor(0.25)
    check_loaded(tensors, config(weight, inputs), want, scheme)


@pytest.mark.parametrize("inputs", [None, spec("int8", "per_channel", dynamic=True)])
def test_int8_layers_load(inputs):
    torch.manual_seed(0)
    q = torch.randint(-127, 128, (N, K), dtype=torch.int8)
    s = torch.rand(N) * 0.01 + 0.001
    tensors = {
        "proj.weight": q,
        "proj.weight_scale": s,
        "proj.weight_zero_point": torch.zeros(N, dtype=torch.int8),  # Quark writes it, all zero
        "proj.bias": torch.randn(N),
    }
    scheme = Int8WeightOnly() if inputs is None else Int8DynamicActivation()
    check_loaded(
        tensors, config(spec("int8", "per_channel"), inputs), q.float() * s[:, None], scheme
    )
    static = config(spec("int8", "per_channel"), spec("int8", "per_tensor"))
    with pytest.raises(NotImplementedError, match="int8"):
        read_quantized(
            {**tensors, "proj.input_scale": torch.tensor(0.1)}, quantization_config=static
        )


@pytest.mark.parametrize(
    ("dtype", "pack_method"), [("uint4", "reorder"), ("int4", "reorder"), ("uint4", "order")]
)
def test_int4_groups_load_from_the_transposed_awq_layout(dtype, pack_method):
    torch.manual_seed(0)
    g = 32
    if dtype == "uint4":
        q = torch.randint(0, 16, (K, N))  # Quark keeps the int4 weight as [K, N]
        z = torch.randint(0, 16, (K // g, N))
    else:  # signed codes against an all-zero zero point, stored as two's complement nibbles
        q = torch.randint(-8, 8, (K, N))
        z = torch.zeros(K // g, N, dtype=torch.long)
    s = torch.rand(K // g, N).half() * 0.1 + 0.01
    want = ((q - z.repeat_interleave(g, 0)) * s.float().repeat_interleave(g, 0)).t()
    order = (0, 2, 4, 6, 1, 3, 5, 7) if pack_method == "reorder" else tuple(range(8))
    tensors = {
        "proj.weight": _pack_words(q, order),
        "proj.weight_scale": s,
        "proj.weight_zero_point": _pack_words(z, order),
        "proj.bias": torch.randn(N),
    }
    qcfg = config(spec(dtype, "per_group", group_size=g, symmetric=dtype == "int4"))
    qcfg["export"]["pack_method"] = pack_method
    check_loaded(tensors, qcfg, want, Int4WeightOnly(group_size=32, symmetric=dtype == "int4"))


@pytest.mark.parametrize("activations", [False, True])
def test_mxfp4_layers_load(activations):
    torch.manual_seed(0)
    w = torch.randn(N, K)
    packed, s = ref_mx.quantize_mxfp4_weight(w, rule="even")
    want = ref_mx.dequantize_mxfp4_weight(packed, s)
    mx = spec("fp4", "per_group", group_size=32, scale_format="e8m0", symmetric=None)
    mx_in = {**mx, "is_dynamic": True, "scale_calculation_mode": "even"}
    tensors = {"proj.weight": packed, "proj.weight_scale": s, "proj.bias": torch.randn(N)}
    scheme = MXFP4(activations=activations, scale_rule="even" if activations else "floor")
    qcfg = config(mx, mx_in if activations else None)
    if not activations:  # the weight, and the layer's output on float inputs
        check_loaded(tensors, qcfg, want, scheme)
        return
    ckpt = read_quantized(tensors, quantization_config=qcfg)
    assert ckpt.schemes == {"proj": scheme}  # inputs quantized per call with Quark's rule
    assert torch.equal(dequantize(scheme, ckpt.weights["proj.weight"].tensors, N, K), want)


def test_exclude_and_layer_patterns_pick_each_layers_spec():
    fp8 = {"weight": spec("fp8_e4m3", "per_channel"), "input_tensors": None}
    int8 = {"weight": spec("int8", "per_channel"), "input_tensors": None}
    qcfg = config(
        fp8["weight"], layer_quant_config={"*down_proj": int8}, exclude=["lm_head", "*.gate"]
    )
    assert layer_config("model.layers.0.mlp.down_proj", qcfg) is int8
    assert layer_config("model.layers.0.mlp.up_proj", qcfg) is qcfg["global_quant_config"]
    assert (
        layer_config("lm_head", qcfg) is None
        and layer_config("model.layers.3.mlp.gate", qcfg) is None
    )
    assert layer_config("model.layers.3.mlp.gate.weight_proj", qcfg) is None  # x also covers x.*
    typed = {**qcfg, "layer_type_quant_config": {"Linear": int8}}
    assert layer_config("model.layers.0.mlp.up_proj", typed) is int8


@pytest.mark.parametrize(
    ("change", "error", "match"),
    [
        ({"output_tensors": spec("fp8_e4m3", "per_tensor")}, NotImplementedError, "KV-cache"),
        ({"weight": spec("fp6_e2m3", "per_group", group_size=32)}, NotImplementedError, "fp6_e2m3"),
        ({"weight": [spec("fp4", "per_group", group_size=16), spec("fp8_e4m3", "per_tensor")]},
         NotImplementedError, "two-level"),
    ],
)  # fmt: skip
def test_what_quark_checkpoints_cannot_load_is_said(change, error, match):
    w, s, _ = _fp8(per_channel=True)
    qcfg = config(spec("fp8_e4m3", "per_channel"))
    qcfg["global_quant_config"] = {**qcfg["global_quant_config"], **change}
    with pytest.raises(error, match=match):
        read_quantized({"proj.weight": w, "proj.weight_scale": s}, quantization_config=qcfg)


def test_bad_quark_checkpoints_say_what_is_wrong():
    w, s, _ = _fp8(per_channel=True)
    qcfg = config(spec("fp8_e4m3", "per_channel"))
    with pytest.raises(CheckpointError, match=r"'proj.weight_scale' has shape \[5\]"):
        read_quantized({"proj.weight": w, "proj.weight_scale": s[:5]}, quantization_config=qcfg)
    with pytest.raises(CheckpointError, match="excludes it"):
        read_quantized({"lm_head.weight": w, "lm_head.weight_scale": s}, quantization_config=qcfg)
    fake = {**qcfg, "export": {"weight_format": "fake_quantized"}}
    with pytest.raises(NotImplementedError, match="fake_quantized"):
        read_quantized({"proj.weight": w, "proj.weight_scale": s}, quantization_config=fake)
    rotated = {**qcfg, "algo_config": [{"name": "rotation"}]}
    with pytest.raises(NotImplementedError, match="Hadamard"):
        read_quantized({"proj.weight": w, "proj.weight_scale": s}, quantization_config=rotated)
    missing = config(spec("fp8_e4m3", "per_tensor"), spec("fp8_e4m3", "per_tensor"))
    with pytest.raises(CheckpointError, match="'proj.input_scale' is missing"):
        read_quantized(
            {"proj.weight": w, "proj.weight_scale": torch.tensor(0.1)}, quantization_config=missing
        )
