"""The plan and rewrite passes on exported programs: what they emit, what they skip, and that the
quantized program computes the reference math at every dynamic size and survives save/load."""

from __future__ import annotations

import copy
import io

import expecttest
import pytest
import torch
from torch.export import Dim

import fxquant
from conftest import Mixed
from fxquant.core.reference import sqnr
from fxquant.passes.rewrite import counters

DYN = {0: Dim.DYNAMIC, 1: Dim.DYNAMIC}
# Output SQNR floors (dB) of a 2-block TinyLlama against fp32, per recipe.
FLOORS = {
    "int8wo": 35,
    "int4wo-32": 14,
    "int4wo-64": 13,
    "int4wo-128": 12,
    "w8a8": 30,
    "fp8wo": 25,
    "fp8-row": 22,
    "fp8-tensor": 20,
    "fp8-block": 22,
}


def _ids(b, t, vocab=96):
    return torch.randint(0, vocab, (b, t))


def _fxquant_ops(ep):
    return sorted(str(n.target) for n in ep.graph.nodes if str(n.target).startswith("fxquant."))


@pytest.mark.parametrize("recipe", list(FLOORS))
def test_each_recipe_quantizes_llama_and_stays_dynamic(tiny_llama, recipe):
    torch.manual_seed(0)
    ep = torch.export.export(tiny_llama, (_ids(2, 8),), dynamic_shapes=(DYN,))
    before = counters[fxquant.from_recipe_name(recipe).name]
    qep = fxquant.quantize(ep, recipe)
    # 2 blocks × 7 projections; lm_head is skipped by default (and for the dynamic-activation
    # recipes, 4 norm_quant ops feed q/k/v and gate/up: tests/test_fuse.py)
    assert counters[fxquant.from_recipe_name(recipe).name] - before == 14
    assert sum(op.endswith("_linear.default") for op in _fxquant_ops(qep)) == 14
    for b, t in [(1, 1), (3, 5), (2, 17)]:
        ids = _ids(b, t)
        with torch.no_grad():
            ref = tiny_llama(ids)
            out = qep.module()(ids)
        assert out.shape == ref.shape
        assert sqnr(ref, out) >= FLOORS[recipe], (recipe, b, t, sqnr(ref, out))


def test_quantized_program_equals_reference_math(mixed):
    """The rewritten program computes exactly the reference linears on the same weights."""
    from fxquant.core import reference as ref

    x = torch.randn(3, 4, 64)
    qep = fxquant.quantize(mixed, "int8wo", example_inputs=(x,), dynamic_shapes=(DYN,))
    with torch.no_grad():
        h = torch.nn.functional.gelu(
            ref.int8_weight_only_linear(
                x, *ref.quantize_int8_per_channel(mixed.fc.weight), mixed.fc.bias
            )
        )
        h = ref.int8_weight_only_linear(h, *ref.quantize_int8_per_channel(mixed.proj), None)
        w = mixed.c_fc.weight.t()
        y = ref.int8_weight_only_linear(h, *ref.quantize_int8_per_channel(w), mixed.c_fc.bias)
        torch.testing.assert_close(qep.module()(x), y)


class GoldenGraphs(expecttest.TestCase):
    def test_mixed_linear_spellings(self):
        """nn.Linear, F.linear on a bare parameter and GPT-2 Conv1D (addmm, W [in, out])."""
        torch.manual_seed(0)
        model = Mixed().eval()
        cfg = fxquant.QuantConfig(
            scheme=fxquant.Int8WeightOnly(),
            overrides={
                "proj": fxquant.Int4WeightOnly(group_size=32),
                "c_fc": fxquant.Float8Dynamic(),
            },
        )
        qep = fxquant.quantize(model, cfg, example_inputs=(torch.randn(2, 3, 64),))
        self.assertExpectedInline(
            qep.graph_module.code.strip(),
            """\
def forward(self, p_fc_bias, p_c_fc_bias, b_fc_qweight, b_fc_scale, b_proj_qweight, b_proj_scale, b_proj_zero, b_c_fc_qweight, b_c_fc_scale, x):
    int8_weight_only_linear_default = torch.ops.fxquant.int8_weight_only_linear.default(x, b_fc_qweight, b_fc_scale, p_fc_bias);  x = b_fc_qweight = b_fc_scale = p_fc_bias = None
    gelu = torch.ops.aten.gelu.default(int8_weight_only_linear_default);  int8_weight_only_linear_default = None
    int4_weight_only_linear_default = torch.ops.fxquant.int4_weight_only_linear.default(gelu, b_proj_qweight, b_proj_scale, b_proj_zero, None, 32);  gelu = b_proj_qweight = b_proj_scale = b_proj_zero = None
    view = torch.ops.aten.view.default(int4_weight_only_linear_default, [-1, 64]);  int4_weight_only_linear_default = None
    float8_dynamic_linear_default = torch.ops.fxquant.float8_dynamic_linear.default(view, b_c_fc_qweight, b_c_fc_scale, p_c_fc_bias, True, None);  view = b_c_fc_qweight = b_c_fc_scale = p_c_fc_bias = None
    view_1 = torch.ops.aten.view.default(float8_dynamic_linear_default, [2, 3, 64]);  float8_dynamic_linear_default = None
    return (view_1,)""",
        )
        self.assertExpectedInline(
            "\n".join(f"{s.kind.name} {s.target}" for s in qep.graph_signature.input_specs),
            """\
PARAMETER fc.bias
PARAMETER c_fc.bias
BUFFER fc.qweight
BUFFER fc.scale
BUFFER proj_qweight
BUFFER proj_scale
BUFFER proj_zero
BUFFER c_fc.qweight
BUFFER c_fc.scale
USER_INPUT None""",
        )


def test_float_weights_leave_the_program_and_it_gets_small(tiny_llama):
    ep = torch.export.export(tiny_llama, (_ids(1, 4),))
    qep = fxquant.quantize(ep, "int8wo")
    names = set(qep.state_dict)
    assert "layers.0.q_proj.weight" not in names
    assert {"layers.0.q_proj.qweight", "layers.0.q_proj.scale"} <= names
    # the embedding is tied to lm_head (skipped), so it stays, once
    assert "embed_tokens.weight" in names
    f32, q = io.BytesIO(), io.BytesIO()
    torch.export.save(ep, f32)
    torch.export.save(qep, q)
    linear_bytes = sum(p.numel() * 4 for n, p in tiny_llama.named_parameters() if "proj" in n)
    assert len(f32.getvalue()) - len(q.getvalue()) > 0.7 * linear_bytes


def test_tied_weight_quantized_for_lm_head_keeps_the_embedding(tiny_llama):
    cfg = fxquant.QuantConfig(scheme=fxquant.Int8WeightOnly(), modules_to_not_convert=())
    ids = _ids(2, 6)
    qep = fxquant.quantize(tiny_llama, cfg, example_inputs=(ids,))
    rows = {r["name"]: r for r in fxquant.report(qep).rows}
    # torch.export names the tied parameter once (here lm_head.weight); the embedding still
    # gathers from the float weight, so it stays beside the quantized copy
    head = rows["lm_head"]
    assert head["status"] == "quantized" and head["float_weight_kept"]
    assert head["weight"] in qep.state_dict and "lm_head.qweight" in qep.state_dict
    with torch.no_grad():
        assert sqnr(tiny_llama(ids), qep.module()(ids)) > 30


def test_shared_weight_is_quantized_once():
    class Shared(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(32, 32)

        def forward(self, x):
            return self.fc(torch.relu(self.fc(x)))

    qep = fxquant.quantize(Shared(), "int8wo", example_inputs=(torch.randn(2, 32),))
    rows = fxquant.report(qep).rows
    assert len(rows) == 2 and rows[1]["shared_with"] == "fc" and rows[1]["bytes_after"] == 0
    assert sum(1 for k in qep.state_dict if k.endswith("qweight")) == 1


def test_skips_are_reported_with_reasons(tiny_llama):
    cfg = fxquant.QuantConfig(
        scheme=fxquant.Int8WeightOnly(),
        overrides={
            r".*\.o_proj": None,
            r"layers\.0\..*": fxquant.Float8Dynamic(granularity="tensor"),
        },
    )
    qep = fxquant.quantize(tiny_llama, cfg, example_inputs=(_ids(1, 4),))
    rows = {r["name"]: r for r in fxquant.report(qep).rows}
    assert rows["lm_head"]["status"] == "skipped"
    assert rows["lm_head"]["reason"] == "modules_to_not_convert 'lm_head'"
    assert rows["layers.0.o_proj"] == rows["layers.0.o_proj"] | {
        "status": "skipped",
        "reason": r"override '.*\\.o_proj'",
    }
    assert rows["layers.0.q_proj"]["scheme"] == {
        "type": "Float8Dynamic",
        "granularity": "tensor",
        "activation_scale_ub": None,
    }
    assert rows["layers.1.q_proj"]["scheme"] == {"type": "Int8WeightOnly"}
    text = str(fxquant.report(qep))
    assert "layers.1.o_proj" in text and "override" in text
    assert "12 of 15 linear layers quantized" in fxquant.report(qep).summary()


def test_int4_pads_k_and_reports_it():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(576, 96)  # SmolLM2's d=576 is not a multiple of 128

        def forward(self, x):
            return self.fc(x)

    torch.manual_seed(0)
    m = Odd()
    x = torch.randn(3, 576)
    qep = fxquant.quantize(m, "int4wo-128", example_inputs=(x,))
    (row,) = fxquant.report(qep).rows
    assert row["padded_in_features"] == 640
    assert "K padded 576→640" in str(fxquant.report(qep))
    with torch.no_grad():
        assert sqnr(m(x), qep.module()(x)) > 15


def test_non_float_and_odd_sites_are_skipped_not_wrong():
    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.w = torch.nn.Parameter(torch.randn(16, 8))
            self.b = torch.nn.Parameter(torch.randn(3, 8))

        def forward(self, x):
            # addmm with a broadcast [3, 8] "bias" is not a linear layer's bias
            return torch.addmm(self.b, x, self.w)

    m = Odd()
    x = torch.randn(3, 16)
    qep = fxquant.quantize(m, "int8wo", example_inputs=(x,))
    (row,) = fxquant.report(qep).rows
    assert row["status"] == "skipped" and "bias of shape (3, 8)" in row["reason"]
    torch.testing.assert_close(qep.module()(x), m(x))


def test_caller_model_and_program_are_not_mutated(tiny_llama):
    ids = _ids(2, 5)
    state = copy.deepcopy(tiny_llama.state_dict())
    with torch.no_grad():
        expected = tiny_llama(ids)
    ep = torch.export.export(tiny_llama, (ids,))
    code, sd = ep.graph_module.code, dict(ep.state_dict)
    fxquant.quantize(ep, "int4wo-32")
    fxquant.quantize(tiny_llama, "fp8-row", example_inputs=(ids,))
    assert ep.graph_module.code == code and ep.state_dict.keys() == sd.keys()
    for k, v in tiny_llama.state_dict().items():
        assert torch.equal(v, state[k])
    with torch.no_grad():
        assert torch.equal(ep.module()(ids), expected)
        assert torch.equal(tiny_llama(ids), expected)


def test_save_load_round_trip_is_bit_exact_and_keeps_the_report(tiny_llama, tmp_path):
    cfg = fxquant.QuantConfig(
        scheme=fxquant.Int4WeightOnly(group_size=64),
        overrides={r"layers\.1\..*": fxquant.Float8Block()},
    )
    qep = fxquant.quantize(tiny_llama, cfg, example_inputs=(_ids(2, 6),), dynamic_shapes=(DYN,))
    path = tmp_path / "q.pt2"
    torch.export.save(qep, path)
    loaded = torch.export.load(path)
    for b, t in [(1, 3), (4, 9)]:
        ids = _ids(b, t)
        assert torch.equal(loaded.module()(ids), qep.module()(ids))
    rep = fxquant.report(loaded)
    assert rep.config == cfg
    assert rep.rows == fxquant.report(qep).rows


def test_quantize_errors():
    with pytest.raises(ValueError, match="needs example_inputs"):
        fxquant.quantize(torch.nn.Linear(4, 4), "int8wo")
    with pytest.raises(ValueError, match="takes an nn.Module or"):
        fxquant.quantize("model.pt", "int8wo")
    with pytest.raises(ValueError, match="unknown recipe 'int9'"):
        fxquant.quantize(torch.nn.Linear(4, 4), "int9", example_inputs=(torch.randn(1, 4),))
    with pytest.raises(ValueError, match="must be a tuple"):
        fxquant.quantize(torch.nn.Linear(4, 4), "int8wo", example_inputs=torch.randn(1, 4))


def test_hf_gpt2_conv1d_model():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100, n_positions=64)
    torch.manual_seed(0)
    model = transformers.GPT2LMHeadModel(cfg).eval()

    class Logits(torch.nn.Module):
        def __init__(self, m):
            super().__init__()
            self.m = m

        def forward(self, ids):
            return self.m(input_ids=ids, use_cache=False).logits

    ids = torch.randint(0, 100, (2, 10))
    qep = fxquant.quantize(Logits(model), "int8wo", example_inputs=(ids,))
    rep = fxquant.report(qep)
    kinds = {r["kind"] for r in rep.quantized}
    assert kinds == {"addmm"} and len(rep.quantized) == 8  # c_attn, c_proj, c_fc, mlp.c_proj × 2
    with torch.no_grad():
        assert sqnr(Logits(model)(ids), qep.module()(ids)) > 30


@pytest.mark.parametrize("recipe", list(fxquant.RECIPES))
def test_all_zero_weights_and_inputs_give_zeros_not_nan(recipe):
    from fxquant.passes.lower import lower

    model = torch.nn.Sequential(torch.nn.Linear(256, 64), torch.nn.Linear(64, 32)).eval()
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.zero_()
    x = torch.zeros(3, 256)
    qep = fxquant.quantize(model, recipe, example_inputs=(x,))
    for program in (qep, lower(qep)):
        y = program.module()(x)
        assert torch.isfinite(y).all()
        torch.testing.assert_close(y, model(x), atol=0.05, rtol=0.05)
    # every layer the scheme takes is quantized (higgs-int4's groups of 256 skip K = 64)
    scheme = fxquant.RECIPES[recipe]
    want = [
        "quantized"
        if scheme.unsupported_reason(out_features=n, in_features=k) is None
        else "skipped"
        for n, k in ((64, 256), (32, 64))
    ]
    assert [r["status"] for r in fxquant.report(qep).rows] == want


def test_precomputed_weights_are_used_checked_and_all_consumed():
    """``quantize(weights=...)`` stores given constants as they are (calibration and checkpoint
    loaders rely on it), refuses a wrong layout and a name the plan did not quantize."""
    from fxquant.core import reference as ref
    from fxquant.core.scheme import QuantizedWeight

    class Two(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a = torch.nn.Linear(32, 16)
            self.lm_head = torch.nn.Linear(16, 8)

        def forward(self, x):
            return self.lm_head(self.a(x))

    torch.manual_seed(0)
    model, x = Two(), torch.randn(2, 32)
    other = torch.randn(16, 32)  # a weight the graph does not hold: it must still be the one used
    q, s = ref.quantize_int8_per_channel(other)
    given = {"a.weight": QuantizedWeight({"qweight": q, "scale": s}, None)}
    qep = fxquant.quantize(model, "int8wo", example_inputs=(x,), weights=given)
    torch.testing.assert_close(qep.state_dict["a.qweight"], q)
    row = fxquant.report(qep).rows[0]
    assert row["weights"] == "given" and row["sqnr_db"] is None
    with torch.no_grad():
        want = model.lm_head(ref.int8_weight_only_linear(x, q, s, model.a.bias))
    torch.testing.assert_close(qep.module()(x), want)

    bad = {"a.weight": QuantizedWeight({"qweight": q[:, :8], "scale": s}, None)}
    with pytest.raises(ValueError, match=r"'a.weight' does not match .*Int8WeightOnly.*\[16, 32\]"):
        fxquant.quantize(model, "int8wo", example_inputs=(x,), weights=bad)
    skipped = {"lm_head.weight": QuantizedWeight({"qweight": q, "scale": s}, None)}
    with pytest.raises(ValueError, match=r"lm_head.weight \(.*modules_to_not_convert"):
        fxquant.quantize(model, "int8wo", example_inputs=(x,), weights=skipped)


def _two_linears_with_nonfinite():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32)).eval()
    with torch.no_grad():
        model[1].weight[3, 5] = float("nan")
        model[1].weight[7, 0] = float("inf")
    return model


@pytest.mark.parametrize("recipe", ["int8wo", "fp8-block", "mxfp4"])
def test_nonfinite_weights_are_refused_naming_the_layer(recipe):
    model = _two_linears_with_nonfinite()
    before = copy.deepcopy(model.state_dict())
    with pytest.raises(ValueError, match=r"1 weight\(s\) hold NaN or inf values: 1\.weight \(2 of"):
        fxquant.quantize(model, recipe, example_inputs=(torch.randn(2, 64),))
    for k, v in model.state_dict().items():
        torch.testing.assert_close(v, before[k], rtol=0, atol=0, equal_nan=True)


def test_nonfinite_skip_keeps_the_layer_in_float_and_reports_it():
    model = _two_linears_with_nonfinite()
    cfg = fxquant.QuantConfig(scheme=fxquant.Int8WeightOnly(), nonfinite="skip")
    ep = fxquant.quantize(model, cfg, example_inputs=(torch.randn(2, 64),))
    rows = {r["weight"]: r for r in fxquant.report(ep).rows}
    assert rows["0.weight"]["status"] == "quantized"
    assert rows["1.weight"]["status"] == "skipped"
    assert "2 NaN/inf" in rows["1.weight"]["reason"]
    assert fxquant.QuantConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="nonfinite='ignore' is not supported; allowed: 'error'"):
        fxquant.QuantConfig(scheme=fxquant.Int8WeightOnly(), nonfinite="ignore")


def test_config_patterns_that_match_nothing_warn_or_fail_under_strict():
    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.Linear(64, 32)).eval()
    x = (torch.randn(2, 64),)
    typo = {"overrides": {r"layers\.0": None}, "modules_to_not_convert": ("lm_haed",)}
    cfg = fxquant.QuantConfig(scheme=fxquant.Int8WeightOnly(), **typo)
    with pytest.warns(UserWarning, match=r"2 config pattern\(s\) match no layer") as seen:
        ep = fxquant.quantize(model, cfg, example_inputs=x)
    assert "overrides: 'layers\\\\.0'" in str(seen[0].message)
    assert "modules_to_not_convert: 'lm_haed'" in str(seen[0].message)
    assert len(fxquant.report(ep).rows) == 2  # still quantized: a warning, not a change
    strict = fxquant.QuantConfig(scheme=fxquant.Int8WeightOnly(), strict=True, **typo)
    with pytest.raises(ValueError, match=r"refused under QuantConfig\(strict=True\)"):
        fxquant.quantize(model, strict, example_inputs=x)
    assert fxquant.QuantConfig.from_json(strict.to_json()) == strict
    # patterns that match, and the default lm_head on a model without one, are silent
    fine = fxquant.QuantConfig(scheme=fxquant.Int8WeightOnly(), overrides={"1": None}, strict=True)
    fxquant.quantize(model, fine, example_inputs=x)


def test_quantize_prints_no_torch_treespec_warning():
    import warnings

    model = torch.nn.Sequential(torch.nn.Linear(64, 64)).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)  # above pytest's own ignore filter
        fxquant.quantize(model, "int8wo", example_inputs=(torch.randn(2, 64),))
