"""VPTQ (``Vptq``, transformers' ``VptqConfig``): checkpoints packed by the ``vptq`` package's own
``pack_index`` load onto the weights its own ``dequant`` gives, outlier columns included
(tests/fixtures/vptq_950716d.pt, written by tests/fixtures/make_vptq_fixture.py); the op, its
CPU lowering and Triton kernel against the reference; bad checkpoints and configs."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from test_checkpoints import One

import fxquant
from conftest import check_package_without_fxquant
from fxquant import Vptq
from fxquant.checkpoints import CheckpointError, read_quantized
from fxquant.core import vptq
from fxquant.core.reference import sqnr
from fxquant.passes.lower import lower

FIXTURE = torch.load(Path(__file__).parent / "fixtures" / "vptq_950716d.pt")
# two codebook groups, a padded last block, and outlier columns whose last block pads too
OUTLIERS = FIXTURE["cases"][3]


def _id(case) -> str:
    cfg = case["quantization_config"]["config_for_layers"]["proj"]
    vl, k, r = cfg["vector_lens"][1], cfg["num_centroids"][1], cfg["num_res_centroids"][1]
    return f"v{vl}-k{k}-{r}-c{cfg['group_num']}-o{cfg['outlier_size']}"


def _dims(case) -> tuple[int, int]:
    layer = case["quantization_config"]["config_for_layers"]["proj"]
    return layer["out_features"], layer["in_features"]


def _loaded(case):
    n, k = _dims(case)
    bias = torch.randn(n)
    ckpt = read_quantized(
        {**case["tensors"], "proj.bias": bias}, quantization_config=case["quantization_config"]
    )
    dyn = ({0: torch.export.Dim.DYNAMIC},)
    ep = fxquant.load_quantized(
        One(n, k), ckpt, example_inputs=(torch.randn(3, k),), dynamic_shapes=dyn
    )
    return ckpt, bias, ep


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=_id)
def test_vptq_checkpoints_load_onto_the_packages_weights(case):
    ckpt, bias, ep = _loaded(case)
    n, k = _dims(case)
    t = ckpt.weights["proj.weight"].tensors
    w = vptq.dequantize(*(t.get(c) for c in (*Vptq.constants, *Vptq.optional_constants)))
    # the package adds, permutes and scales in fp16; fxquant decodes in fp32
    torch.testing.assert_close(w, case["weight"], rtol=2e-3, atol=1e-4)
    assert fxquant.report(ep).rows[0]["weights"] == "given"
    x = torch.randn(5, k)
    want = x @ w.t() + bias
    torch.testing.assert_close(ep.module()(x), want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    args = (*(t.get(c) for c in (*Vptq.constants, *Vptq.optional_constants)), bias)
    torch.library.opcheck(torch.ops.fxquant.vptq_linear.default, (x, *args))


def test_the_index_stream_is_read_across_words():
    # fields of 12 bits, least significant bit first: the third straddles words 0 and 1
    fields = torch.tensor([0xABC, 0x123, 0xFED, 0x456, 0x789, 0x0F0])
    stream = sum(int(f) << (12 * i) for i, f in enumerate(fields.tolist()))
    words = [(stream >> (32 * j)) & 0xFFFFFFFF for j in range(3)]
    packed = torch.tensor(
        [[[w - (1 << 32) if w >= 1 << 31 else w for w in words]]], dtype=torch.int32
    )
    assert torch.equal(vptq.unpack_indices(packed, group_size=6, bits=12)[0, 0], fields)


def test_the_cpu_lowering_computes_the_reference():
    _, _, ep = _loaded(OUTLIERS)
    lowered = lower(ep)
    targets = {str(n.target) for n in lowered.graph.nodes if n.op == "call_function"}
    assert not any(t.startswith("fxquant.") for t in targets), targets
    k = _dims(OUTLIERS)[1]
    for m in (1, 6):
        x = torch.randn(m, k)
        assert sqnr(ep.module()(x), lowered.module()(x)) > 80


@pytest.mark.interpreter
@pytest.mark.parametrize("case", FIXTURE["cases"], ids=_id)
@pytest.mark.parametrize(("m", "dtype"), [(1, torch.float32), (19, torch.bfloat16)])
def test_the_triton_kernel_is_the_reference(case, m, dtype):
    pytest.importorskip("triton")
    from fxquant.kernels.vptq import lower_vptq_linear

    ckpt = read_quantized(case["tensors"], quantization_config=case["quantization_config"])
    t = ckpt.weights["proj.weight"].tensors
    n, k = _dims(case)
    x, b = torch.randn(m, k).to(dtype), torch.randn(n)
    args = (*(t.get(c) for c in (*Vptq.constants, *Vptq.optional_constants)), b)
    y = lower_vptq_linear(x, *args)
    want = vptq.vptq_linear(x, *args)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2
    assert y.dtype == dtype and y.shape == (m, n)
    torch.testing.assert_close(y, want, rtol=tol, atol=tol * want.abs().max().item())


def test_bad_vptq_checkpoints_and_configs_say_what_is_wrong():
    case = FIXTURE["cases"][0]
    qcfg, tensors = case["quantization_config"], case["tensors"]
    layer = qcfg["config_for_layers"]["proj"]
    wrong = {**qcfg, "config_for_layers": {"proj": {**layer, "num_centroids": [-1, 512]}}}
    with pytest.raises(CheckpointError, match="'proj.indices' has shape"):
        read_quantized(tensors, quantization_config=wrong)
    with pytest.raises(CheckpointError, match="'proj.perm' is missing"):
        read_quantized(
            {k: v for k, v in tensors.items() if k != "proj.perm"}, quantization_config=qcfg
        )
    wider = {**qcfg, "config_for_layers": {"proj": {**layer, "in_features": 66}}}
    with pytest.raises(CheckpointError, match="in_features=66 is not outlier_size"):
        read_quantized(tensors, quantization_config=wider)
    ocfg, otensors = OUTLIERS["quantization_config"], OUTLIERS["tensors"]
    olayer = ocfg["config_for_layers"]["proj"]
    no_book = {**ocfg, "config_for_layers": {"proj": {**olayer, "vector_lens": [-1, 12]}}}
    with pytest.raises(CheckpointError, match="outlier_size=5 but no outlier codebook"):
        read_quantized(otensors, quantization_config=no_book)
    res = {**ocfg, "config_for_layers": {"proj": {**olayer, "num_res_centroids": [4, -1]}}}
    with pytest.raises(NotImplementedError, match="residual codebooks on the outlier columns"):
        read_quantized(otensors, quantization_config=res)
    with pytest.raises(CheckpointError, match="'proj.outlier_indices' is missing"):
        read_quantized(
            {k: v for k, v in otensors.items() if k != "proj.outlier_indices"},
            quantization_config=ocfg,
        )
    big = {**otensors, "proj.outlier_indices": otensors["proj.outlier_indices"].clone()}
    big["proj.outlier_indices"][0, 0, 0] = 16
    with pytest.raises(CheckpointError, match="holds index 16; the outlier codebook has 16"):
        read_quantized(big, quantization_config=ocfg)
    with pytest.raises(CheckpointError, match="no entry in config_for_layers"):
        read_quantized(
            tensors, quantization_config={"quant_method": "vptq", "config_for_layers": {}}
        )
    shared = {"quant_method": "vptq", "shared_layer_config": {"proj": layer}}
    assert read_quantized(tensors, quantization_config=shared).schemes["proj"] == Vptq(
        vector_len=8, num_centroids=256, num_res_centroids=16, group_num=1, group_size=64
    )
    with pytest.raises(NotImplementedError, match="k-means"):
        fxquant.from_hf({"quant_method": "vptq"})
    with pytest.raises(ValueError, match="Vptq.num_centroids=300"):
        Vptq(num_centroids=300)


@pytest.mark.slow
def test_a_vptq_program_saves_and_packages(tmp_path):
    _, _, ep = _loaded(OUTLIERS)
    k = _dims(OUTLIERS)[1]
    path = tmp_path / "vptq.pt2"
    torch.export.save(ep, path)
    x = torch.randn(4, k)
    assert torch.equal(torch.export.load(path).module()(x), ep.module()(x))
    check_package_without_fxquant(ep, tmp_path, [torch.randn(m, k) for m in (1, 6)])
