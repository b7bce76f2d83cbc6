"""Llama 4's experts: a bmm of every expert's weight [E, K, N] over the same T rows (x [E, T, K],
``Llama4TextExperts``), quantized by the grouped experts' schemes and run by their ops as E
groups of T rows (``passes/rewrite.py``, ``_bmm_as_grouped_rows``).

The oracle is transformers' own model with each expert weight replaced by the values the scheme
dequantizes to, run by its own bmm: what the rewrite computes, up to fp32 summation order. The
grouped ops themselves: tests/test_int8_experts.py, tests/test_int4_experts.py; the Llama 4
package (int8 experts on the native kernel, offsets computed in the program):
tests/test_llm.py.
"""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")

import fxquant  # noqa: E402
import fxquant.kernels.cpu as native  # noqa: E402
from fxquant.core.reference import sqnr  # noqa: E402
from fxquant.passes.cpu.experts import BMM_EXPERTS_KERNEL, EXPERT_KERNELS  # noqa: E402
from fxquant.passes.eager import reference_math  # noqa: E402
from fxquant.passes.lower import lower  # noqa: E402

AT_BMM = "aten.bmm, as the model runs it (every token through every expert)"
VOCAB = 96
IDS = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(4))
EXPERTS = [
    f"model.layers.{i}.feed_forward.experts.{w}"
    for i in range(2)
    for w in ("gate_up_proj", "down_proj")
]


def llama4(seed: int = 0):
    config = transformers.Llama4TextConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, intermediate_size_mlp=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
        num_local_experts=4, max_position_embeddings=128, attention_chunk_size=48,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def fake_quantized(model, scheme, layers=(0, 1)):
    """The float model with each expert weight [E, K, N] of these layers replaced by its
    dequantized values."""
    for layer in (model.model.layers[i] for i in layers):
        experts = layer.feed_forward.experts
        for name in ("gate_up_proj", "down_proj"):
            p = getattr(experts, name)
            dq = scheme.quantize(p.data.transpose(-2, -1).contiguous()).dequantized
            p.data = dq.transpose(-2, -1).contiguous()
    return model


def logits(fn, ids=IDS) -> torch.Tensor:
    # a bridged model's ops on their reference math, as an exported program runs them (its
    # eager kernels are tests/test_bridge_eager.py's)
    with torch.no_grad(), reference_math():
        return fn(ids, use_cache=False).logits


@pytest.fixture(scope="module")
def exported():
    return torch.export.export(llama4(), (IDS,), kwargs={"use_cache": False})


@pytest.mark.parametrize(
    "scheme",
    [
        fxquant.Int8WeightOnly(),
        fxquant.Int4WeightOnly(group_size=32),
        fxquant.MXFP4(activations=False),
    ],
    ids=["int8wo", "int4wo-32", "mxfp4-weights"],
)
def test_experts_quantized_equal_the_model_on_their_dequantized_weights(exported, scheme):
    config = fxquant.QuantConfig(overrides={fxquant.core.config.EXPERT_WEIGHTS: scheme})
    qep = fxquant.quantize(exported, config)
    rep = fxquant.report(qep)
    rows = {r.name: r for r in rep.quantized}
    assert sorted(rows) == sorted(EXPERTS)  # the experts only, as the config says
    assert all(r.kind == "bmm" and r.experts == 4 for r in rows.values())
    assert "4×64×64" in str(rep)  # E×N×K of down_proj
    targets = {str(n.target) for n in qep.graph.nodes if n.op == "call_function"}
    assert f"fxquant.{scheme.name}_grouped_mm.default" in targets
    assert "aten.bmm.default" not in targets
    assert not any(k.endswith("experts.gate_up_proj") for k in qep.state_dict)  # float released
    want = logits(fake_quantized(llama4(), scheme))
    torch.testing.assert_close(logits(qep.module()), want, rtol=1e-5, atol=1e-5)
    # the CPU lowering: the native grouped kernels (bf16 dot products from 2 rows an expert on
    # some CPU classes), else the aten gather (MXFP4: always)
    assert sqnr(want, logits(lower(qep).module())) > 35
    (experts,) = [k for k in rep.cpu_kernels() if k["scheme"].endswith(" experts")]
    assert len(experts["layers"]) == 4
    native_only, kernel = EXPERT_KERNELS[scheme.name]  # the grouped_mm experts' kernel
    if native.available() or not native_only:
        assert experts["kernel"] == kernel


def test_recipes_take_the_experts_or_say_why_not(exported):
    for recipe in ("w4a8-32", "w8a8", "fp8-row"):
        taken = fxquant.report(fxquant.quantize(exported, recipe))
        assert {r.name for r in taken.quantized} >= set(EXPERTS), recipe
    per_tensor = fxquant.report(fxquant.quantize(exported, "fp8-tensor"))
    kept = {r.name: r for r in per_tensor.skipped if r.kind == "bmm"}
    assert sorted(kept) == sorted(EXPERTS)
    assert all(
        "([E, K, N], bmm) take only Int8WeightOnly" in r.reason and r.experts == 4
        for r in kept.values()
    )
    (row,) = [k for k in per_tensor.cpu_kernels() if k["layers"] == list(kept)]
    assert row["kernel"] == (BMM_EXPERTS_KERNEL if native.available() else AT_BMM)


@pytest.mark.skipif(not native.available(), reason="the native fp32 grouped kernel")
def test_float_experts_lower_to_the_native_kernel_that_skips_rows_of_zeros(exported):
    """Experts left in fp32 leave aten's bmm over every expert for the native fp32 grouped kernel,
    told to skip rows of zeros (the weight is finite): the program's logits, to fp32 sums."""
    lowered = lower(exported)
    nodes = [
        n
        for n in lowered.graph.nodes
        if n.target == torch.ops.fxquant.native_float32_grouped_mm.default
    ]
    assert len(nodes) == 4 and all(n.args[3:] == (1, 1) for n in nodes)  # kn, skip_zero_rows
    torch.testing.assert_close(
        logits(lowered.module()), logits(exported.module()), rtol=1e-4, atol=1e-4
    )


def test_calibration_quantizes_the_experts_to_nearest_and_says_so():
    from fxquant.evaluate import export_causal_lm

    samples = [torch.randint(0, VOCAB, (1, 10)) for _ in range(2)]
    ep = export_causal_lm(llama4())
    qep = fxquant.calibrate(ep, "int8wo", samples, method=fxquant.GPTQ(), progress=False)
    rows = {r["name"]: r for r in fxquant.report(qep).rows}  # export_causal_lm's names
    row = rows[f"model.{EXPERTS[0]}"]
    assert row["status"] == "quantized" and row["kind"] == "bmm"
    assert "expert weights (bmm) are not calibrated" in row["calibration"]["reason"]
    assert rows["model.model.layers.0.self_attn.q_proj"]["calibration"]["status"] == "calibrated"


def test_the_from_pretrained_bridge_runs_the_experts_as_the_export_path(exported, tmp_path):
    """The bridge runs Llama 4's experts (every token through every expert, [E, K, N] weights,
    N the output) on the grouped experts op, E groups of T rows, as the export path rewrites
    the bmm: the same logits, bit for bit; saved and reloaded as they are."""
    from transformers import AutoModelForCausalLM

    from fxquant.hf.bridge import FxquantHfConfig

    llama4().save_pretrained(tmp_path / "float")
    config = fxquant.QuantConfig(scheme=fxquant.Int8WeightOnly(), modules_to_not_convert=(
        "lm_head", "router"))  # fmt: skip
    model = AutoModelForCausalLM.from_pretrained(
        tmp_path / "float", quantization_config=FxquantHfConfig(config)
    )
    rows = {r["name"]: r for r in model.fxquant_report.rows}
    gate_up, down = (rows[name] for name in EXPERTS[:2])
    assert gate_up["status"] == "quantized" and gate_up["kind"] == "experts"
    assert (gate_up["experts"], gate_up["out_features"], gate_up["in_features"]) == (4, 128, 64)
    assert (down["out_features"], down["in_features"]) == (64, 64)
    assert type(model.model.layers[0].feed_forward.experts).__name__ == "FxquantLlama4TextExperts"
    got = logits(model)
    want = logits(fxquant.quantize(exported, config).module())
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    model.save_pretrained(tmp_path / "q")
    again = AutoModelForCausalLM.from_pretrained(tmp_path / "q")
    torch.testing.assert_close(logits(again), got, rtol=0, atol=0)


@pytest.mark.slow
def test_the_torch_compile_backend_quantizes_the_experts_at_every_length():
    """Layer 0's experts int8, layer 1's left in fp32 (on the native fp32 grouped kernel where it
    builds), at a fixed and then a symbolic length."""
    from fxquant.backend import last_reports
    from fxquant.passes.cpu.experts import bf16_experts
    from fxquant.passes.rewrite import counters

    scheme = fxquant.Int8WeightOnly()
    config = fxquant.QuantConfig(overrides={r"layers\.0\.feed_forward\.experts\..*": scheme})
    model = llama4()
    compiled = torch.compile(model, backend="fxquant", options={"config": config})
    oracle = fake_quantized(llama4(), scheme, layers=(0,))
    tol = 1e-2 if native.available() and bf16_experts() else 1e-5
    floats = counters["prepack.cpu_float_grouped_mm"]
    for t in (10, 7, 5):  # a second length recompiles with the length symbolic
        ids = IDS[:, :t]
        torch.testing.assert_close(logits(compiled, ids), logits(oracle, ids), rtol=tol, atol=tol)
    rows = {r.name: r.status for r in last_reports[-1] if r.kind == "bmm"}
    assert list(rows.values()) == ["quantized"] * 2 + ["skipped"] * 2, rows
    # layer 1's two experts, in each of the two compiles
    assert counters["prepack.cpu_float_grouped_mm"] - floats == (4 if native.available() else 0)
    assert not torch.equal(logits(compiled), logits(model))  # the caller's model stays float
    torch._dynamo.reset()
