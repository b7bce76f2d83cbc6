"""The Hugging Face bridge: from_pretrained(..., quantization_config=FxquantHfConfig(...))."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fxquant  # noqa: E402
from fxquant.hf_quantizer import FxquantHfConfig, QuantizedLinear  # noqa: E402
from fxquant.reference import sqnr  # noqa: E402


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A small random Llama saved as a float checkpoint (what a Hub download looks like)."""
    cfg = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return path, model


def _load(path, config):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=FxquantHfConfig(config), dtype=torch.float32
    ).eval()


@pytest.mark.parametrize("recipe", ["int8wo", "int4wo-64", "fp8-row"])
def test_from_pretrained_runs_the_same_program_as_quantize(tiny_checkpoint, recipe):
    """The bridged model's forward is the rewrite's program: exporting it gives the same
    fxquant:: ops, and both give bit-identical logits to fxquant.quantize of the float model."""
    path, float_model = tiny_checkpoint
    model = _load(path, recipe)
    rep = model.fxquant_report
    assert len(rep.quantized) == 14 and [r["name"] for r in rep.skipped] == ["lm_head"]
    assert isinstance(model.model.layers[1].self_attn.o_proj, QuantizedLinear)
    assert not any(n.endswith("proj.weight") for n, _ in model.named_parameters())

    ids = torch.randint(0, 128, (2, 11))
    kw = {"use_cache": False}
    ref_ep = fxquant.quantize(float_model, recipe, example_inputs=(ids,), example_kwargs=kw)
    ep = torch.export.export(model, (ids,), kwargs=kw)
    ops = sorted({str(n.target) for n in ep.graph.nodes if str(n.target).startswith("fxquant")})
    ref_ops = {str(n.target) for n in ref_ep.graph.nodes if str(n.target).startswith("fxquant")}
    assert ops and set(ops) <= ref_ops  # the reference may also fuse norms into norm_quant
    with torch.no_grad():
        got = model(ids, use_cache=False).logits
        want = ref_ep.module()(ids, use_cache=False).logits
        base = float_model(ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ep.module()(ids, use_cache=False).logits, got)
    assert sqnr(base, got) > {"int8wo": 35, "int4wo-64": 12, "fp8-row": 20}[recipe]


def test_generate_and_config_round_trip(tiny_checkpoint):
    path, float_model = tiny_checkpoint
    cfg = fxquant.QuantConfig(
        scheme=fxquant.Int8WeightOnly(), modules_to_not_convert=("lm_head", "down_proj")
    )
    model = _load(path, cfg)
    skipped = {r["name"]: r["reason"] for r in model.fxquant_report.skipped}
    assert skipped["model.layers.0.mlp.down_proj"] == "modules_to_not_convert 'down_proj'"
    ids = torch.randint(0, 128, (1, 6))
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape == (1, 10)
    # config.json carries the fxquant config, and it reads back as the same QuantConfig
    stored = model.config.quantization_config
    assert FxquantHfConfig(stored.to_dict()["config"]).quant_config == cfg
    assert float_model.model.layers[0].mlp.up_proj.weight.dtype == torch.float32  # untouched


def test_errors(tiny_checkpoint, tmp_path):
    with pytest.raises(TypeError, match="unknown \\['bits'\\]"):
        FxquantHfConfig("int8wo", bits=4)
    with pytest.raises(TypeError, match="got int"):
        FxquantHfConfig(8)
    with pytest.raises(ValueError, match="recipe"):
        FxquantHfConfig("int9")
    path, _ = tiny_checkpoint
    model = _load(path, "int8wo")
    with pytest.raises(Exception, match="serializ|fxquant"):
        model.save_pretrained(tmp_path / "q")


@pytest.mark.slow
def test_smollm2_from_pretrained(smollm2, lee_ids, tmp_path):
    """The real model: SmolLM2-135M (its GGUF converted once to a float checkpoint, since
    transformers refuses a quantization_config with gguf_file) loads int8 through the bridge."""
    model, _ = smollm2
    # The GGUF-loaded model carries transformers' GGUF quantizer, which refuses save_pretrained:
    # write its float weights through a fresh model of the same config instead.
    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)
    fresh = transformers.AutoModelForCausalLM.from_config(type(model.config).from_dict(cfg))
    fresh.load_state_dict(model.state_dict())
    fresh.save_pretrained(tmp_path)
    del fresh
    q = _load(tmp_path, "int8wo")
    assert len(q.fxquant_report.quantized) == 210  # 30 blocks × 7 linears; lm_head kept
    ids = lee_ids[:96][None]
    with torch.no_grad():
        base = model(ids, use_cache=False).logits
        got = q(ids, use_cache=False).logits
    assert sqnr(base, got) > 25
    assert (base.argmax(-1) == got.argmax(-1)).float().mean() > 0.9
