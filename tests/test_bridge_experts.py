"""The from_pretrained bridge on mixture-of-experts models (fxquant/hf/bridge_experts.py):
transformers' experts modules run their grouped GEMMs on fxquant's experts ops.

The oracle is the export path: ``fxquant.quantize`` of the same float model with the same config
stores the same constants and runs the same ops, so the bridged model's logits equal the
quantized program's bit for bit (routers kept float: Qwen2-MoE's router is not an nn.Linear the
bridge swaps, while the export path quantizes its F.linear). A saved bridged model reloads to
the same logits, its experts' constants stored stacked as they are.
"""

from __future__ import annotations

import importlib

import pytest
import torch

transformers = pytest.importorskip("transformers")
importlib.import_module("transformers.integrations.moe")  # registers grouped_mm_fallback

from test_int8_experts import IDS, logits, mixtral, qwen2_moe  # noqa: E402

import fxquant  # noqa: E402
from fxquant.hf.bridge import FxquantHfConfig  # noqa: E402
from fxquant.hf.bridge_experts import ExpertWeights  # noqa: E402

SKIP = ("lm_head", "gate", "shared_expert_gate")  # the routers (and the head) stay float
EXPERTS = ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj")


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Qwen2-MoE saved as transformers saves it (each expert as linears) and its export."""
    model = qwen2_moe()
    path = tmp_path_factory.mktemp("qwen2_moe")
    model.save_pretrained(path)
    return path, torch.export.export(model, (IDS,), kwargs={"use_cache": False})


def _bridged(path, config):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=FxquantHfConfig(config)
    )


@pytest.mark.parametrize(
    "scheme",
    [
        fxquant.Int8WeightOnly(),
        fxquant.Int8DynamicActivation(),
        fxquant.Int4WeightOnly(group_size=32),
        fxquant.Float8Block(block_size=32),
    ],
    ids=["int8wo", "w8a8", "int4wo-32", "fp8-block-32"],
)
def test_the_bridge_quantizes_the_experts_as_the_export_path(saved, tmp_path, scheme):
    path, ep = saved
    config = fxquant.QuantConfig(scheme=scheme, modules_to_not_convert=SKIP)
    model = _bridged(path, config)
    rows = {r["name"]: r for r in model.fxquant_report.rows}
    for name in EXPERTS:
        row = rows[name]
        assert row["status"] == "quantized" and row["kind"] == "experts" and row["experts"] == 4
        assert row["sqnr_db"] > 20 and row["bytes_after"] < row["bytes_before"] / 2
    experts = model.model.layers[0].mlp.experts
    assert type(experts).__name__ == "FxquantQwen2MoeExperts"
    assert isinstance(experts.gate_up_proj, ExpertWeights)
    got = logits(model)
    want = logits(fxquant.quantize(ep, config).module())
    torch.testing.assert_close(got, want, rtol=0, atol=0)

    model.save_pretrained(tmp_path / "q")
    keys = _keys(tmp_path / "q")
    assert f"{EXPERTS[0]}.qweight" in keys  # stacked as held, not split per expert
    assert not any(".experts.0." in k for k in keys)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    assert isinstance(again.model.layers[1].mlp.experts.down_proj, ExpertWeights)
    torch.testing.assert_close(logits(again), got, rtol=0, atol=0)
    again_rows = {r["name"]: r for r in again.fxquant_report.rows}
    assert again_rows[EXPERTS[0]]["bytes_after"] == rows[EXPERTS[0]]["bytes_after"]


def _keys(directory):
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return set(f.keys())


def test_a_scheme_without_an_experts_op_leaves_them_float_and_says_so(saved):
    path, _ = saved
    config = fxquant.QuantConfig(scheme=fxquant.Float8Dynamic(granularity="tensor"),
                                 modules_to_not_convert=SKIP)  # fmt: skip
    model = _bridged(path, config)
    rows = {r["name"]: r for r in model.fxquant_report.rows}
    row = rows[EXPERTS[0]]
    assert row["status"] == "skipped" and "no experts op; experts take Int8WeightOnly" in row[
        "reason"]  # fmt: skip
    assert rows["model.layers.1.self_attn.q_proj"]["status"] == "quantized"
    assert type(model.model.layers[0].mlp.experts).__name__ == "Qwen2MoeExperts"


def test_the_bridged_experts_export_to_fxquants_experts_op(saved):
    path, _ = saved
    model = _bridged(path, fxquant.QuantConfig(scheme=fxquant.Int8WeightOnly(),
                                               modules_to_not_convert=SKIP))  # fmt: skip
    ep = torch.export.export(model, (IDS,), kwargs={"use_cache": False})
    targets = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
    assert targets.count("fxquant.int8_weight_only_grouped_mm.default") == 4
    assert "transformers.grouped_mm_fallback.default" not in targets
    torch.testing.assert_close(logits(ep.module()), logits(model), rtol=0, atol=0)


def test_mixtral_through_the_bridge(tmp_path):
    """Mixtral's checkpoint names (block_sparse_moe, w1 / w3 / w2) load, its experts quantize."""
    model = mixtral()
    model.save_pretrained(tmp_path / "float")
    ep = torch.export.export(model, (IDS,), kwargs={"use_cache": False})
    config = fxquant.QuantConfig(scheme=fxquant.Int8DynamicActivation(),
                                 modules_to_not_convert=SKIP)  # fmt: skip
    bridged = _bridged(tmp_path / "float", config)
    assert isinstance(bridged.model.layers[0].mlp.experts.gate_up_proj, ExpertWeights)
    want = logits(fxquant.quantize(ep, config).module())
    torch.testing.assert_close(logits(bridged), want, rtol=0, atol=0)


def test_the_fxquant_backend_prepacks_the_bridges_constants(saved, monkeypatch):
    """Compiled with ``backend="fxquant"``, the bridged model's ops (constants held as module
    buffers, Dynamo's graph inputs) get the native kernels' prepacked constants, as the export
    path's do: no int4 linear is left to its unpacked fallback, which ran int4 at 0.16× float
    Inductor here (benchmarks/bridge_moe.py)."""
    import fxquant.backend as backend
    from fxquant.core.reference import sqnr

    path, _ = saved
    left, real = [], backend.prepack
    int4 = torch.ops.fxquant.int4_weight_only_linear.default

    def prepack(editor, **kw):
        done = real(editor, **kw)
        left.append(sum(n.target is int4 for n in editor.graph.nodes))
        return done

    monkeypatch.setattr(backend, "prepack", prepack)
    model = _bridged(path, fxquant.QuantConfig(scheme=fxquant.Int4WeightOnly(group_size=32),
                                               modules_to_not_convert=SKIP))  # fmt: skip
    compiled = torch.compile(model, backend="fxquant", options={"config": fxquant.QuantConfig()})
    assert sqnr(logits(model), logits(compiled)) > 30
    assert left == [0]
