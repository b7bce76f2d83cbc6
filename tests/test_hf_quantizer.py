"""The Hugging Face bridge: from_pretrained(..., quantization_config=FxquantHfConfig(...))."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import json  # noqa: E402

from safetensors import safe_open  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

import fxquant  # noqa: E402
from fxquant.core.reference import sqnr  # noqa: E402
from fxquant.hf.bridge import FxquantHfConfig, QuantizedLinear  # noqa: E402
from fxquant.passes.eager import reference_math  # noqa: E402


def _llama_config(**kw) -> transformers.LlamaConfig:
    return transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        **kw,
    )


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    """A small random Llama saved as a float checkpoint (what a Hub download looks like)."""
    cfg = _llama_config(max_position_embeddings=64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return path, model


def test_the_old_path_re_exports_the_bridge():
    """``fxquant.hf_quantizer`` (the path the README showed before the bridge moved into
    ``fxquant.hf``) still gives the same classes, and transformers knows quant_method="fxquant"."""
    from transformers.quantizers.auto import AUTO_QUANTIZER_MAPPING

    import fxquant.hf_quantizer as old

    assert old.FxquantHfConfig is FxquantHfConfig and old.QuantizedLinear is QuantizedLinear
    assert AUTO_QUANTIZER_MAPPING["fxquant"] is old.FxquantHfQuantizer


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
        got = _logits(model, ids)
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
    with pytest.raises(TypeError, match="unknown \\['quant_method'\\]"):
        FxquantHfConfig("int8wo", quant_method="gptq")
    assert FxquantHfConfig(quant_method="fxquant", config="int4wo-64").config == (
        FxquantHfConfig("int4wo-64").config
    )


def _ids():
    return torch.randint(0, 128, (2, 11), generator=torch.Generator().manual_seed(1))


def _logits(model, ids):
    # the ops' reference math, as the exported program's (eager kernels: test_bridge_eager.py)
    with torch.no_grad(), reference_math():
        return model(ids, use_cache=False).logits


@pytest.mark.parametrize("recipe", ["int8wo", "int4wo-64", "fp8-row"])
def test_save_pretrained_round_trip(tiny_checkpoint, tmp_path, recipe):
    """save_pretrained writes the QuantizedLinear buffers; from_pretrained of that folder (no
    quantization_config) rebuilds the same modules before loading them: same buffers, same
    report, bit-identical logits, and it exports to the same fxquant:: ops."""
    path, _ = tiny_checkpoint
    model = _load(path, recipe)
    model.save_pretrained(tmp_path)
    stored = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    assert stored == {"quant_method": "fxquant", "config": FxquantHfConfig(recipe).config}
    with safe_open(tmp_path / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    assert "model.layers.0.self_attn.q_proj.qweight" in keys and "lm_head.weight" in keys
    assert not any(k.endswith("proj.weight") for k in keys)  # no float copy of a quantized weight

    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    assert isinstance(again.model.layers[1].self_attn.o_proj, QuantizedLinear)
    assert again.fxquant_report.rows == model.fxquant_report.rows
    want, got = model.state_dict(), again.state_dict()
    assert want.keys() == got.keys()
    for k in want:
        assert want[k].dtype == got[k].dtype and torch.equal(want[k], got[k]), k
    ids = _ids()
    logits = _logits(again, ids)
    assert torch.equal(logits, _logits(model, ids))

    kw = {"use_cache": False}
    ep = torch.export.export(again, (ids,), kwargs=kw)
    ops = {str(n.target) for n in ep.graph.nodes if str(n.target).startswith("fxquant")}
    ref = torch.export.export(model, (ids,), kwargs=kw)
    assert ops and ops == {
        str(n.target) for n in ref.graph.nodes if str(n.target).startswith("fxquant")
    }
    torch.testing.assert_close(ep.module()(ids, **kw).logits, logits, rtol=0, atol=0)


def test_reload_plans_with_the_dtype_it_was_quantized_from(tiny_checkpoint, tmp_path):
    """Reloading in another dtype rebuilds the layers the checkpoint holds: the plan's dtype
    check reads the dtype each weight was quantized from (float32), not the skeleton's
    (float64, which the planner would keep in float)."""
    path, _ = tiny_checkpoint
    model = _load(path, "int8wo")
    model.save_pretrained(tmp_path)
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float64)
    assert again.model.embed_tokens.weight.dtype == torch.float64
    assert again.fxquant_report.rows == model.fxquant_report.rows
    q, q2 = model.model.layers[0].mlp.up_proj, again.model.layers[0].mlp.up_proj
    assert torch.equal(q2.qweight, q.qweight) and torch.equal(q2.scale, q.scale)


class _TiedLlama(transformers.LlamaForCausalLM):
    # lm_head tied to the embedding (as in most small models), and two linears tied to each other
    _tied_weights_keys = {
        "lm_head.weight": "model.embed_tokens.weight",
        "model.layers.1.mlp.up_proj.weight": "model.layers.0.mlp.up_proj.weight",
    }


def test_save_pretrained_round_trip_tied_weights(tmp_path):
    """A weight two linears share is quantized once and stored once; a quantized lm_head tied
    to the embedding drops the tie (it has no weight left). Both come back from a bf16 save."""
    cfg = _llama_config(tie_word_embeddings=True)
    torch.manual_seed(0)
    _TiedLlama(cfg).save_pretrained(tmp_path / "float")
    qcfg = fxquant.QuantConfig(scheme=fxquant.Int8WeightOnly(), modules_to_not_convert=())
    model = _TiedLlama.from_pretrained(
        tmp_path / "float", quantization_config=FxquantHfConfig(qcfg), dtype=torch.bfloat16
    ).eval()
    up0, up1 = (model.model.layers[i].mlp.up_proj for i in (0, 1))
    assert up1.qweight is up0.qweight
    rows = {r["name"]: r for r in model.fxquant_report.rows}
    assert rows["model.layers.1.mlp.up_proj"]["shared_with"] == "model.layers.0.mlp.up_proj"
    assert rows["lm_head"]["status"] == "quantized"

    model.save_pretrained(tmp_path / "q")
    with safe_open(tmp_path / "q" / "model.safetensors", framework="pt") as f:
        keys = set(f.keys())
    assert not any(k.startswith("model.layers.1.mlp.up_proj") for k in keys)
    assert {"lm_head.qweight", "model.embed_tokens.weight"} <= keys

    again = _TiedLlama.from_pretrained(tmp_path / "q").eval()
    assert again.dtype == torch.bfloat16
    assert again.model.layers[1].mlp.up_proj.qweight is again.model.layers[0].mlp.up_proj.qweight
    assert isinstance(again.lm_head, QuantizedLinear)
    assert again.fxquant_report.rows == model.fxquant_report.rows
    ids = _ids()
    assert torch.equal(_logits(again, ids), _logits(model, ids))


def _rewrite(path, edit):
    """Rewrite model.safetensors in ``path`` through ``edit(tensors)``, keeping its metadata."""
    f = path / "model.safetensors"
    with safe_open(f, framework="pt") as h:
        metadata = h.metadata()
    tensors = load_file(f)
    edit(tensors)
    save_file(tensors, f, metadata=metadata)


def test_reload_refuses_a_checkpoint_that_does_not_match(tiny_checkpoint, tmp_path):
    path, _ = tiny_checkpoint
    model = _load(path, "int4wo-64")
    model.save_pretrained(tmp_path)
    key = "model.layers.1.mlp.down_proj.scale"

    _rewrite(tmp_path, lambda t: t.update({key: t[key][:, :1].contiguous()}))
    with pytest.raises(ValueError, match=f"tensor '{key}' .* is \\[64, 1\\] F32; .*\\[64, 2\\]"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)

    _rewrite(tmp_path, lambda t: t.pop(key))
    with pytest.raises(ValueError, match=f"no tensor '{key}'"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)

    # config.json says int8 while the weights are int4: refused before any tensor is read
    cfg = json.loads((tmp_path / "config.json").read_text())
    cfg["quantization_config"] = FxquantHfConfig("int8wo").to_dict()
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="config.json and the weights disagree"):
        transformers.AutoModelForCausalLM.from_pretrained(tmp_path)


def test_save_pretrained_refuses_constants_it_cannot_store(tiny_checkpoint, tmp_path):
    path, _ = tiny_checkpoint
    model = _load(path, "int8wo")
    o_proj = model.model.layers[0].self_attn.o_proj
    o_proj.scale = torch.ones(o_proj.scale.shape, dtype=torch.float8_e8m0fnu)
    with pytest.raises(ValueError, match="Int8WeightOnly.*o_proj.scale.*float8_e8m0fnu"):
        model.save_pretrained(tmp_path / "q")
    assert not (tmp_path / "q" / "model.safetensors").exists()
    assert not (tmp_path / "q" / "config.json").exists()


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


class _ScaledLinear(torch.nn.Linear):
    """A linear with a forward of its own (what bitsandbytes' layers and LoRA wrappers are)."""

    def forward(self, x):
        return 2 * super().forward(x)


def test_subclasses_of_linear_are_swapped_only_where_their_forward_is_a_linear(tmp_path):
    from transformers.models.falcon.modeling_falcon import FalconLinear

    from fxquant.hf.bridge import quantize_linears

    # Falcon's FalconLinear computes x @ W.T + b: nn.Linear's function, so it is swapped
    x = torch.randn(3, 64)
    torch.manual_seed(0)
    falcon = FalconLinear(64, 32)
    torch.testing.assert_close(falcon(x), torch.nn.functional.linear(x, falcon.weight, falcon.bias))
    cfg = transformers.FalconConfig(
        vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4
    )
    torch.manual_seed(0)
    transformers.FalconForCausalLM(cfg).save_pretrained(tmp_path / "falcon")
    float_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "falcon").eval()
    model = _load(tmp_path / "falcon", "int8wo")
    rows = {r["name"]: r for r in model.fxquant_report.rows}
    assert len([r for r in rows.values() if r["status"] == "quantized"]) == 8
    assert isinstance(model.transformer.h[0].mlp.dense_4h_to_h, QuantizedLinear)
    ids = torch.randint(0, 128, (1, 9))
    with torch.no_grad():
        assert sqnr(float_model(ids).logits, model(ids).logits) > 30
    model.save_pretrained(tmp_path / "q")  # and it reloads onto the swapped skeleton
    again = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "q").eval()
    with torch.no_grad():
        assert torch.equal(again(ids).logits, model(ids).logits)

    # any other forward is kept and the report says why
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), _ScaledLinear(64, 64))
    y = net(x)
    rows = {r["name"]: r for r in quantize_linears(net, "int8wo").rows}
    assert rows["0"]["status"] == "quantized" and rows["1"]["status"] == "skipped"
    assert "_ScaledLinear subclasses nn.Linear with a forward of its own" in rows["1"]["reason"]
    assert type(net[1]) is _ScaledLinear
    assert sqnr(y, net(x)) > 30  # the doubling is still there
