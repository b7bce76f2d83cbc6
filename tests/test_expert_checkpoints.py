"""Mixture-of-experts weights in checkpoints that store each expert as linears (compressed-tensors
from llm-compressor / vLLM, FineGrainedFP8, GPTQ, AWQ; what transformers 5 saves):
``save_compressed_tensors`` splits a model's stacked experts into them, ``load_quantized``
stacks them back where the model stacks its experts (fxquant/checkpoints/experts.py).

The oracles: the program that was written (loading it back must compute the same, bit for bit),
the compressed-tensors library's own dequantizer (each expert's linear decompresses to the
weight fxquant's constants stand for), and transformers 5 (its conversion mapping stacks the
dequantized per-expert checkpoint into the model's experts, so the names are the ones it reads).
"""

from __future__ import annotations

import importlib
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
importlib.import_module("transformers.integrations.moe")  # registers grouped_mm_fallback

from test_bmm_experts import llama4  # noqa: E402
from test_checkpoints import dequantize  # noqa: E402
from test_int8_experts import IDS, logits, mixtral, qwen2_moe  # noqa: E402

import fxquant  # noqa: E402
from fxquant.checkpoints import CheckpointError, LoadedCheckpoint, read_quantized  # noqa: E402
from fxquant.checkpoints.experts import stack_expert_linears  # noqa: E402

# every scheme that takes experts and has a compressed-tensors form
SCHEMES = {
    "w8a8": fxquant.Int8DynamicActivation(),
    "int8wo": fxquant.Int8WeightOnly(),
    "fp8wo": fxquant.Float8WeightOnly(),
    "fp8-row": fxquant.Float8Dynamic(granularity="row"),
    "fp8-block-32": fxquant.Float8Block(block_size=32),  # I = 32: one tile of gate, one of up
    "int4wo-32": fxquant.Int4WeightOnly(group_size=32),
}


@pytest.fixture(scope="module")
def moe():
    model = qwen2_moe()
    return model, torch.export.export(model, (IDS,), kwargs={"use_cache": False})


def _written(ep, scheme, directory, model):
    # the routers stay float, as llm-compressor's MoE recipes keep them (ignore: mlp.gate)
    skip = ("lm_head", "gate", "shared_expert_gate")
    config = fxquant.QuantConfig(scheme=scheme, modules_to_not_convert=skip)
    qep = fxquant.quantize(ep, config)
    fxquant.save_compressed_tensors(qep, directory, model_config=model.config.to_dict())
    return qep


def _keys(directory):
    from safetensors import safe_open

    with safe_open(str(directory / "model.safetensors"), "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("name", list(SCHEMES))
def test_moe_checkpoints_write_each_expert_as_linears_and_load_back_exactly(moe, tmp_path, name):
    model, ep = moe
    qep = _written(ep, SCHEMES[name], tmp_path, model)
    keys = _keys(tmp_path)
    for proj in ("gate_proj", "up_proj", "down_proj"):
        assert any(k.startswith(f"model.layers.1.mlp.experts.3.{proj}.weight") for k in keys)
    assert not any("gate_up_proj" in k or k.endswith("experts.down_proj") for k in keys)
    ckpt = read_quantized(tmp_path)  # without a model: the linears, as stored
    assert ckpt.schemes["model.layers.0.mlp.experts.2.up_proj"] == SCHEMES[name]
    loaded = fxquant.load_quantized(ep, tmp_path)
    rows = {r["name"]: r for r in fxquant.report(loaded).rows}
    for layer in range(2):
        for p in ("gate_up_proj", "down_proj"):
            row = rows[f"model.layers.{layer}.mlp.experts.{p}"]
            assert row["status"] == "quantized" and row["experts"] == 4, row
            assert row["weights"] == "given"
    torch.testing.assert_close(logits(loaded.module()), logits(qep.module()), rtol=0, atol=0)


def _dequantized_checkpoint(directory, out):
    """The written checkpoint decompressed by the compressed-tensors library, as a float
    checkpoint (``out``) of the same names that transformers' from_pretrained reads."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
        CompressedTensorsDequantizer,
    )
    from safetensors.torch import load_file, save_file

    tensors = load_file(str(directory / "model.safetensors"))
    deq = CompressedTensorsDequantizer(directory, dtype=torch.float32).process(dict(tensors))
    out.mkdir()
    save_file({k: v.contiguous() for k, v in deq.items()}, str(out / "model.safetensors"))
    config = json.loads((directory / "config.json").read_text())
    del config["quantization_config"]
    (out / "config.json").write_text(json.dumps(config))
    return deq


@pytest.mark.parametrize(
    ("family", "scheme", "first"),
    [
        ("qwen2_moe", fxquant.Int4WeightOnly(group_size=32), "mlp.experts.0.gate_proj"),
        ("mixtral", fxquant.Float8Dynamic(granularity="row"), "block_sparse_moe.experts.0.w1"),
    ],
)
def test_the_library_and_transformers_read_the_written_experts(tmp_path, family, scheme, first):
    """compressed-tensors decompresses each expert's linear to the weight fxquant's constants
    stand for; transformers 5 stacks those float linears, under the names written, into its
    model's experts: the stacked weights fxquant's experts op computes with."""
    model = qwen2_moe() if family == "qwen2_moe" else mixtral()
    ep = torch.export.export(model, (IDS,), kwargs={"use_cache": False})
    ckpt_dir = tmp_path / "ckpt"
    _written(ep, scheme, ckpt_dir, model)
    assert any(k.startswith(f"model.layers.0.{first}.weight") for k in _keys(ckpt_dir))
    deq = _dequantized_checkpoint(ckpt_dir, tmp_path / "float")
    ckpt = read_quantized(ckpt_dir)
    for module, s in ckpt.schemes.items():
        n, k = ckpt.shapes[f"{module}.weight"]
        want = dequantize(s, ckpt.weights[f"{module}.weight"].tensors, n, k)
        torch.testing.assert_close(deq[f"{module}.weight"], want, rtol=0, atol=0)
    reloaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "float").eval()
    stacked = stack_expert_linears(ckpt, ep.state_dict.keys())
    for name in ("model.layers.1.mlp.experts.gate_up_proj", "model.layers.1.mlp.experts.down_proj"):
        s, (e, n, k) = stacked.schemes[name], stacked.shapes[name]
        consts = stacked.weights[name].tensors
        want = torch.stack([dequantize(s, {c: t[i] for c, t in consts.items()}, n, k)
                            for i in range(e)])  # fmt: skip
        got = reloaded.get_parameter(name).detach()
        torch.testing.assert_close(got, want, rtol=0, atol=0)


def test_mixtral_checkpoints_name_the_block_and_experts_as_mixtrals(tmp_path):
    """w1 / w3 / w2 in ``block_sparse_moe``, its router too (quantized here by the plain recipe),
    loaded back under transformers 5's ``mlp`` exactly."""
    model = mixtral()
    ep = torch.export.export(model, (IDS,), kwargs={"use_cache": False})
    qep = fxquant.quantize(ep, "w8a8")
    fxquant.save_compressed_tensors(qep, tmp_path, model_config=model.config.to_dict())
    keys = _keys(tmp_path)
    assert "model.layers.0.block_sparse_moe.experts.3.w2.weight" in keys
    assert "model.layers.0.block_sparse_moe.gate.weight_scale" in keys
    assert not any(".mlp." in k for k in keys)
    loaded = fxquant.load_quantized(ep, tmp_path)
    rows = {r["name"]: r for r in fxquant.report(loaded).rows}
    assert rows["model.layers.1.mlp.experts.down_proj"]["weights"] == "given"
    assert rows["model.layers.1.mlp.gate"]["weights"] == "given"
    torch.testing.assert_close(logits(loaded.module()), logits(qep.module()), rtol=0, atol=0)


def test_experts_a_checkpoint_keeps_float_stack_as_float_tensors(moe, tmp_path):
    """A block the quantization config ignored keeps its experts float, one linear each (as
    transformers 5 saves them): they stack into the model's float experts, beside quantized
    blocks."""
    from safetensors.torch import load_file

    model, ep = moe
    kept = fxquant.QuantConfig(
        scheme=fxquant.Int8WeightOnly(),
        overrides={r"layers\.0\.mlp\.experts\.(gate_up_proj|down_proj)": None},
        modules_to_not_convert=("lm_head", "gate", "shared_expert_gate"),
    )
    qep = fxquant.quantize(ep, kept)
    fxquant.save_compressed_tensors(qep, tmp_path, model_config=model.config.to_dict())
    tensors = load_file(str(tmp_path / "model.safetensors"))
    qcfg = json.loads((tmp_path / "config.json").read_text())["quantization_config"]
    block = "model.layers.0.mlp.experts"
    gate_up, down = tensors.pop(f"{block}.gate_up_proj"), tensors.pop(f"{block}.down_proj")
    half = gate_up.shape[1] // 2
    for i in range(gate_up.shape[0]):  # the layout transformers 5's save_pretrained writes
        tensors[f"{block}.{i}.gate_proj.weight"] = gate_up[i, :half].clone()
        tensors[f"{block}.{i}.up_proj.weight"] = gate_up[i, half:].clone()
        tensors[f"{block}.{i}.down_proj.weight"] = down[i].clone()
    loaded = fxquant.load_quantized(ep, tensors, quantization_config=qcfg)
    rows = {r["name"]: r for r in fxquant.report(loaded).rows}
    assert rows[f"{block}.gate_up_proj"]["status"] == "skipped"
    assert rows["model.layers.1.mlp.experts.gate_up_proj"]["weights"] == "given"
    torch.testing.assert_close(logits(loaded.module()), logits(qep.module()), rtol=0, atol=0)
    del tensors[f"{block}.3.down_proj.weight"]
    with pytest.raises(CheckpointError, match=r"experts\.3: no float down_proj"):
        fxquant.load_quantized(ep, tensors, quantization_config=qcfg)


# --------------------------------------------------------------------------------------------
# What cannot stack, or need not
# --------------------------------------------------------------------------------------------


def _linears(scheme, *, experts=2, i_dim=32, h=64, skip=(), seed=0):
    """A LoadedCheckpoint of one block's per-expert linears, each quantized by ``scheme``."""
    g = torch.Generator().manual_seed(seed)
    out = LoadedCheckpoint(format="test")
    for i in range(experts):
        for proj, shape in (("gate_proj", (i_dim, h)), ("up_proj", (i_dim, h)),
                            ("down_proj", (h, i_dim))):  # fmt: skip
            if (i, proj) in skip:
                continue
            w = torch.randn(*shape, generator=g)
            out.add(f"mlp.experts.{i}.{proj}", scheme, scheme.quantize(w), shape)
    return out


STACKED = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")


def test_experts_stack_only_where_the_model_stacks_them():
    ckpt = _linears(fxquant.Int8WeightOnly())
    stacked = stack_expert_linears(ckpt, STACKED)
    assert set(stacked.schemes) == set(STACKED)
    assert stacked.shapes["mlp.experts.gate_up_proj"] == (2, 64, 64)
    assert len(ckpt.schemes) == 6  # the checkpoint read is not changed
    # a model that keeps its experts as linears (transformers 4's, remote code) takes them so
    as_linears = [f"mlp.experts.{i}.{p}.weight" for i in range(2) for p in ("gate_proj", "up_proj")]
    assert stack_expert_linears(ckpt, [*STACKED, *as_linears]) is ckpt


def test_experts_that_cannot_stack_are_refused_by_name():
    with pytest.raises(NotImplementedError, match=r"mlp\.experts: the experts are quantized .*"
                       r"tensor.* no experts op.*experts take Int8WeightOnly"):  # fmt: skip
        stack_expert_linears(_linears(fxquant.Float8Dynamic(granularity="tensor")), STACKED)
    missing = _linears(fxquant.Int8WeightOnly(), skip={(1, "up_proj")})
    with pytest.raises(CheckpointError, match=r"mlp\.experts\.1: no quantized up_proj"):
        stack_expert_linears(missing, STACKED)
    mixed = _linears(fxquant.Int8WeightOnly())
    w = torch.randn(32, 64)
    mixed.add("mlp.experts.1.gate_proj", fxquant.Float8WeightOnly(),
              fxquant.Float8WeightOnly().quantize(w), (32, 64))  # fmt: skip
    with pytest.raises(NotImplementedError, match="quantized by 2 schemes"):
        stack_expert_linears(mixed, STACKED)
    gap = _linears(fxquant.Int8WeightOnly(), experts=3, skip={(1, p) for p in
                   ("gate_proj", "up_proj", "down_proj")})  # fmt: skip
    with pytest.raises(CheckpointError, match=r"experts \[0, 2\] are not numbered 0 … 1"):
        stack_expert_linears(gap, STACKED)


def test_experts_stored_k_by_n_are_not_written(tmp_path):
    """Llama 4's (and gpt-oss') experts are [E, K, N]: no per-expert layout is written for them,
    and nothing is written at all."""
    model = llama4()
    ep = torch.export.export(model, (IDS,), kwargs={"use_cache": False})
    qep = fxquant.quantize(ep, "int8wo")
    with pytest.raises(CheckpointError, match=r"feed_forward\.experts\..* stored \[E, K, N\]"):
        fxquant.save_compressed_tensors(qep, tmp_path / "ckpt")
    assert not (tmp_path / "ckpt").exists()


@pytest.mark.parametrize("method", ["gptq", "awq"])
def test_a_gptq_or_awq_moe_checkpoint_stacks_its_int4_experts(moe, method):
    """GPTQ and AWQ MoE checkpoints (Qwen3-30B-A3B-GPTQ-Int4 / -AWQ, Mixtral's) store each
    expert as a linear: they stack into Int4WeightOnly experts whose weights are the
    checkpoint's, code for code."""
    from test_checkpoints import _pack_rows, awq_pack

    model, ep = moe
    g, torch_gen = 32, torch.Generator().manual_seed(0)
    tensors, want = {}, {}
    for name, t in model.state_dict().items():
        if not name.endswith(("experts.gate_up_proj", "experts.down_proj")):
            tensors[name] = t
            continue
        block, _, leaf = name.rpartition(".")
        n, k = t.shape[1] // (2 if leaf == "gate_up_proj" else 1), t.shape[2]
        per_expert = []
        for i in range(t.shape[0]):
            parts = []
            for proj in ("gate_proj", "up_proj") if leaf == "gate_up_proj" else ("down_proj",):
                q = torch.randint(0, 16, (k, n), generator=torch_gen)  # GPTQ keeps W as [K, N]
                z = torch.randint(0, 16, (k // g, n), generator=torch_gen)
                s = torch.rand(k // g, n, generator=torch_gen).half() * 0.1 + 0.01
                parts.append(
                    ((q - z.repeat_interleave(g, 0)) * s.float().repeat_interleave(g, 0)).t()
                )
                m = f"{block}.{i}.{proj}"
                if method == "awq":  # packed along N
                    tensors |= {f"{m}.qweight": awq_pack(q), f"{m}.qzeros": awq_pack(z)}
                else:  # packed along K, zeros along N
                    tensors |= {
                        f"{m}.qweight": _pack_rows(q, 4),
                        f"{m}.qzeros": _pack_rows(z.t(), 4).t().contiguous(),
                        f"{m}.g_idx": (torch.arange(k) // g).to(torch.int32),
                    }
                tensors[f"{m}.scales"] = s
            per_expert.append(torch.cat(parts))
        want[name] = torch.stack(per_expert)
    qcfg = {"quant_method": "gptq", "bits": 4, "group_size": g, "desc_act": False,
            "sym": False, "checkpoint_format": "gptq_v2"}  # fmt: skip
    if method == "awq":
        qcfg = {"quant_method": "awq", "bits": 4, "group_size": g, "zero_point": True,
                "version": "gemm"}  # fmt: skip
    stacked = stack_expert_linears(read_quantized(tensors, quantization_config=qcfg),
                                   ep.state_dict.keys())  # fmt: skip
    for name, w in want.items():
        s, (e, n, k) = stacked.schemes[name], stacked.shapes[name]
        assert s == fxquant.Int4WeightOnly(group_size=g, symmetric=False)
        consts = stacked.weights[name].tensors
        got = torch.stack([dequantize(s, {c: t[i] for c, t in consts.items()}, n, k)
                           for i in range(e)])  # fmt: skip
        torch.testing.assert_close(got, w, rtol=0, atol=0)
    loaded = fxquant.load_quantized(ep, tensors, quantization_config=qcfg)
    rows = {r["name"]: r for r in fxquant.report(loaded).rows}
    assert rows["model.layers.0.mlp.experts.gate_up_proj"]["weights"] == "given"
    fake = qwen2_moe()  # the float model on the checkpoint's weights, through its grouped_mm
    with torch.no_grad():
        for name, w in want.items():
            fake.get_parameter(name).copy_(w)
    torch.testing.assert_close(logits(loaded.module()), logits(fake), rtol=1e-4, atol=1e-4)
