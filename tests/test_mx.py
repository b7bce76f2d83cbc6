"""Microscaling formats (MXFP8, MXFP4, NVFP4 and Four Over Six): the codecs in
``fxquant.core.reference_mx`` against hand-computed values, the ops against the reference, the
rewrite end to end on the tiny Llama, the CPU lowering, the config checks and the Hugging Face
mappings. The Triton kernels are in test_kernels_mx.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import fxquant
from fxquant.core import reference_mx as rmx
from fxquant.core.config import MXFP4, MXFP8, NVFP4, Float8Recipe, QuantConfig, Scheme
from fxquant.core.reference import sqnr
from fxquant.hf import from_hf
from fxquant.passes.lower import lower
from fxquant.training.numerics import E4M3, cast_mx

fxq = torch.ops.fxquant
NO_SCHEMA_TEST = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
DEFAULT_TESTS = ("test_schema", *NO_SCHEMA_TEST)
GRID = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]

# --------------------------------------------------------------------------------------------
# Codecs against hand values
# --------------------------------------------------------------------------------------------


def test_e2m1_codes_decode_to_the_grid_and_round_to_nearest_even():
    codes = torch.arange(16, dtype=torch.uint8)
    assert rmx.decode_e2m1(codes).tolist() == GRID + [-v for v in GRID]
    assert torch.equal(rmx.encode_e2m1(rmx.decode_e2m1(codes)), codes)  # -0 is code 8
    v = torch.tensor([0.25, 0.26, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 5.01, 7.0, 1e9, -0.74, -2.6])
    want = [0.0, 0.5, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, 6.0, 6.0, -0.5, -3.0]
    assert rmx.round_to_e2m1(v).tolist() == want  # ties to the even mantissa; ±6 saturates


@pytest.mark.parametrize(
    "rule, e4m3, e2m1",
    [
        # amax:     0  1   448 449 500  6   7  1.75 1.74 3.5
        ("floor", [0, -8, 0, 0, 0, -6, -6, -8, -8, -7], [0, -2, 6, 6, 6, 0, 0, -2, -2, -1]),
        ("ceil", [0, -8, 0, 1, 1, -6, -6, -8, -8, -7], [0, -2, 7, 7, 7, 0, 1, -1, -1, 0]),
        ("even", [0, -8, 0, 0, 1, -6, -6, -8, -8, -7], [0, -2, 7, 7, 7, 0, 1, -1, -2, 0]),
    ],
)
def test_e8m0_exponent_rules(rule, e4m3, e2m1):
    amax = torch.tensor([0.0, 1.0, 448.0, 449.0, 500.0, 6.0, 7.0, 1.75, 1.74, 3.5])
    assert rmx.e8m0_exponent(amax, elem_max=448.0, rule=rule, mbits=3).tolist() == e4m3
    assert rmx.e8m0_exponent(amax, elem_max=6.0, rule=rule, mbits=1).tolist() == e2m1
    tiny = torch.tensor([2.0**-140])  # below E8M0's range: clamped (fp32 never exceeds it)
    assert rmx.e8m0_exponent(tiny, elem_max=6.0, rule=rule).tolist() == [-127]


def test_e8m0_to_float_is_exact_over_the_whole_range():
    s = torch.arange(0, 255, dtype=torch.uint8)
    want = torch.tensor([2.0 ** (i - 127) for i in range(255)], dtype=torch.float64)
    assert torch.equal(rmx.e8m0_to_float(s).double(), want)


def test_mx_round_trip_by_hand():
    # one block: amax 6 → floor exponent 0 (scale 1): the grid values come back exactly;
    # a second block ×2**-5 has exponent -5 and the same codes
    w = torch.tensor(GRID * 4).reshape(1, 32)
    w = torch.cat([w, -w * 2.0**-5], dim=1)
    codes, s = rmx.mx_quantize(w, elem="e2m1", rule="floor")
    assert s.tolist() == [[127, 122]]
    assert torch.equal(rmx.mx_dequantize(codes, s, elem="e2m1"), w)
    packed = rmx.pack_fp4(codes)
    assert packed.shape == (1, 32) and packed[0, 0].item() == (1 << 4) | 0  # 0.5 high, 0 low
    assert torch.equal(rmx.dequantize_mxfp4_weight(packed, s), w)
    # MXFP8: amax 448 · 2**3 → exponent 11 - 8 = 3; amax 1 → 0 - 8
    x = torch.zeros(2, 32)
    x[0, 0], x[0, 1], x[1, 5] = 448 * 8, 3.0, -1.0
    q, s = rmx.mx_quantize(x, elem="e4m3", rule="floor")
    assert s.tolist() == [[130], [119]]
    assert torch.equal(rmx.mx_dequantize(q, s, elem="e4m3"), x)


def test_nvfp4_two_level_scales_by_hand():
    # tensor amax 2688 = 6 · 448 → tensor scale 1; block 0's scale 448, block 1 (amax 3) 0.5
    w = torch.zeros(1, 32)
    w[0, 0], w[0, 1] = 2688.0, -448.0
    w[0, 16], w[0, 17] = 3.0, 0.25
    codes, s, g = rmx.nvfp4_quantize(w, rule="six")
    assert g.tolist() == [1.0]
    assert s.float().tolist() == [[448.0, 0.5]]
    assert rmx.decode_e2m1(codes)[0, [0, 1, 16, 17]].tolist() == [6.0, -1.0, 6.0, 0.5]
    assert torch.equal(rmx.nvfp4_dequantize(codes, s, g), w)


def test_four_over_six_keeps_the_block_with_the_lower_squared_error():
    # tensor amax 6 → tensor scale 6 / (6 · 256); block scales 256 (→ 6) and 384 (→ 4)
    w = torch.zeros(2, 16)
    w[0, 0], w[0, 1:] = 6.0, 5.0  # to 4: 6 → 4·1.5 exact, 5 → 3·1.5 (err .5) beats 4 or 6 (1)
    w[1, 0], w[1, 1] = 6.0, 0.5  # to 6: both exact; to 4: 0.5 → 0.75
    codes, s, g = rmx.nvfp4_quantize(w, rule="four_over_six")
    assert g.item() == 6 / 1536
    assert s.float().flatten().tolist() == [384.0, 256.0]
    dq = rmx.nvfp4_dequantize(codes, s, g)
    assert dq[0, :3].tolist() == [6.0, 4.5, 4.5] and torch.equal(dq[1], w[1])
    # on Gaussian weights the choice never loses to plain NVFP4 by more than the tensor scale
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(0))
    six, fos = (rmx.nvfp4_fake_quantize(x, rule=r) for r in ("six", "four_over_six"))
    assert sqnr(x, fos) > sqnr(x, six) > 18


@pytest.mark.parametrize(
    "fake",
    [
        lambda t: rmx.mx_fake_quantize(t, elem="e4m3", rule="floor"),
        lambda t: rmx.mx_fake_quantize(t, elem="e2m1", rule="even"),
        lambda t: rmx.nvfp4_fake_quantize(t, rule="six"),
        lambda t: rmx.nvfp4_fake_quantize(t, rule="four_over_six"),
    ],
)
def test_all_zero_blocks_and_tensors_give_zeros_not_nan(fake):
    t = torch.zeros(3, 64)
    t[0, 32:] = torch.randn(32)  # a zero block next to a live one
    out = fake(t)
    assert torch.isfinite(out).all() and out[1:].abs().sum() == 0 and out[0, :32].abs().sum() == 0
    assert torch.equal(fake(torch.zeros(2, 32)), torch.zeros(2, 32))


def test_blocks_must_divide_k():
    with pytest.raises(ValueError, match="K=48 is not a multiple of the block size 32"):
        rmx.mx_quantize(torch.ones(2, 48), elem="e2m1", rule="floor")
    with pytest.raises(ValueError, match="allowed: 'e4m3', 'e2m1'"):
        rmx.mx_quantize(torch.ones(2, 32), elem="e5m2", rule="floor")
    with pytest.raises(ValueError, match="NVFP4 scale rule 'mse'"):
        rmx.nvfp4_quantize(torch.ones(2, 32), rule="mse")


def test_mxfp8_training_cast_is_the_inference_reference():
    # the FP8 training cast (dim=1: along K of W [N, K]) takes its exponent from reference_mx
    w = torch.randn(8, 64) * torch.logspace(-3, 3, 64)
    q, s = rmx.mx_quantize(w, elem="e4m3", rule="ceil")
    assert torch.equal(cast_mx(w, E4M3, dim=1), rmx.mx_dequantize(q, s, elem="e4m3"))


def _weights():
    g = torch.Generator().manual_seed(0)
    return torch.randn(16, 128, generator=g) * torch.logspace(-4, 4, 128)  # unlike blocks


@pytest.mark.parametrize("rule", ["floor", "even", "ceil"])
def test_mx_is_bit_exact_with_torchao(rule):
    mx = pytest.importorskip("torchao.prototype.mx_formats.mx_tensor")
    modes = pytest.importorskip("torchao.prototype.mx_formats.config").ScaleCalculationMode
    mode = {"floor": modes.FLOOR, "even": modes.EVEN, "ceil": modes.RCEIL}[rule]
    w = _weights()
    for elem, dtype in (("e4m3", torch.float8_e4m3fn), ("e2m1", torch.float4_e2m1fn_x2)):
        s_ao, q_ao = mx.to_mx(w, dtype, 32, scaling_mode=mode)
        q, s = rmx.mx_quantize(w, elem=elem, rule=rule)
        assert torch.equal(s_ao.view(torch.uint8).reshape(s.shape), s)
        mine = q.view(torch.uint8) if elem == "e4m3" else rmx.pack_fp4(q)
        assert torch.equal(q_ao.view(torch.uint8), mine)


def test_nvfp4_is_bit_exact_with_torchao():
    nt = pytest.importorskip("torchao.prototype.mx_formats.nvfp4_tensor")
    w = _weights()
    codes, s, g = rmx.nvfp4_quantize(w, rule="six")
    tensor_scale = nt.per_tensor_amax_to_scale(w.abs().amax())
    assert torch.equal(tensor_scale.reshape(1), g)
    s_ao, q_ao = nt.nvfp4_quantize(w, block_size=16, per_tensor_scale=tensor_scale)
    assert torch.equal(s_ao.view(torch.uint8).reshape(s.shape), s.view(torch.uint8))
    assert torch.equal(q_ao.view(torch.uint8), rmx.pack_fp4(codes))


def test_mxfp4_weights_read_as_gpt_oss_blocks_and_scales():
    # transformers' own gpt-oss dequantizer on our bytes: *_blocks [E, N, K/32, 16] is our
    # packed [N, K/2], *_scales [E, N, K/32] our E8M0 bytes (nibble order, bias 127)
    mxfp4 = pytest.importorskip("transformers.integrations.mxfp4")
    w = _weights()
    packed, s = rmx.quantize_mxfp4_weight(w, rule="ceil")
    n, k = w.shape
    blocks, scales = packed.reshape(1, n, k // 32, 16), s.reshape(1, n, k // 32)
    theirs = mxfp4._convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)
    assert torch.equal(theirs[0].t(), rmx.dequantize_mxfp4_weight(packed, s))


def test_scales_match_compressed_tensors():
    mxfp = pytest.importorskip("compressed_tensors.quantization.utils.mxfp_utils")
    helpers = pytest.importorskip("compressed_tensors.quantization.utils.helpers")
    w = _weights()
    _, s = rmx.mx_quantize(w, elem="e2m1", rule="even")
    amax = w.unflatten(-1, (-1, 32)).abs().amax(-1)
    assert torch.equal(mxfp.generate_mx_scales(amax, num_bits=4).to(torch.uint8), s)
    _, _, g = rmx.nvfp4_quantize(w, rule="six")
    gparam = helpers.generate_gparam(w.amin(), w.amax())  # their global scale is our 1 / g
    torch.testing.assert_close(gparam, 1 / g, rtol=1e-6, atol=0)


# --------------------------------------------------------------------------------------------
# Ops: eager = reference, opcheck
# --------------------------------------------------------------------------------------------


def _op_cases():
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 64, generator=g)
    b = torch.randn(24, generator=g)
    q8, s8 = rmx.mx_quantize(w, elem="e4m3", rule="ceil")
    p4, s4 = rmx.quantize_mxfp4_weight(w, rule="floor")
    pn, sn, gn = rmx.quantize_nvfp4_weight(w, rule="four_over_six")
    return [
        (
            fxq.mxfp8_linear,
            (q8, s8, b, "ceil"),
            lambda x: rmx.mxfp8_linear(x, q8, s8, b, scale_rule="ceil"),
        ),
        (
            fxq.mxfp4_linear,
            (p4, s4, None, True, "floor"),
            lambda x: rmx.mxfp4_linear(x, p4, s4, None, activation_rule="floor"),
        ),
        (
            fxq.mxfp4_linear,
            (p4, s4, b, False, "floor"),
            lambda x: x.float() @ rmx.dequantize_mxfp4_weight(p4, s4).t() + b,
        ),
        (
            fxq.nvfp4_linear,
            (pn, sn, gn, b, True, "four_over_six"),
            lambda x: rmx.nvfp4_linear(x, pn, sn, gn, b, activation_rule="four_over_six"),
        ),
        (
            fxq.nvfp4_linear,
            (pn, sn, gn, None, False, "six"),
            lambda x: x.float() @ rmx.dequantize_nvfp4_weight(pn, sn, gn).t(),
        ),
    ]


@pytest.mark.parametrize("case", range(5))
def test_ops_are_the_reference_and_pass_opcheck(case):
    op, consts, want = _op_cases()[case]
    x = torch.randn(2, 3, 64)
    y = op(x, *consts)
    assert y.shape == (2, 3, 24) and y.dtype == x.dtype
    torch.testing.assert_close(y, want(x).to(x.dtype), rtol=1e-5, atol=1e-5)
    # SchemaCheckMode compares tensors with allclose, which has no CPU float8 kernel (as in
    # test_ops.py): ops with an e4m3 constant run every other opcheck test
    fp8 = any(isinstance(c, torch.Tensor) and c.dtype == torch.float8_e4m3fn for c in consts)
    opcheck(op.default, (x, *consts), test_utils=NO_SCHEMA_TEST if fp8 else DEFAULT_TESTS)
    assert op(x.bfloat16(), *consts).dtype == torch.bfloat16


# --------------------------------------------------------------------------------------------
# End to end: quantize the tiny Llama, lower for CPU, compile
# --------------------------------------------------------------------------------------------

MIXED_CONFIG = QuantConfig(
    scheme=NVFP4(scale_rule="four_over_six"),
    overrides={
        r".*q_proj": MXFP8(),
        r".*k_proj": MXFP4(activations=True),
        r".*v_proj": MXFP4(scale_rule="ceil"),
        r".*up_proj": NVFP4(activations=False),
    },
)


@pytest.fixture(scope="module")
def mixed_program():
    from conftest import TinyLlama

    torch.manual_seed(0)
    model = TinyLlama().eval()
    ids = torch.randint(0, 96, (2, 8))
    with torch.no_grad():
        want = model(ids)
    return model, ids, want, fxquant.quantize(model, MIXED_CONFIG, example_inputs=(ids,))


def test_quantize_tiny_llama_with_every_mx_scheme(mixed_program):
    model, ids, want, ep = mixed_program
    rows = {r["name"]: r for r in fxquant.report(ep).rows}
    kinds = {
        "layers.0.q_proj": ("MXFP8", 8.25),
        "layers.0.k_proj": ("MXFP4", 4.25),
        "layers.0.up_proj": ("NVFP4", 4.5),
        "layers.1.down_proj": ("NVFP4", 4.5),
    }
    for name, (kind, bits) in kinds.items():
        row = rows[name]
        assert row["status"] == "quantized" and row["scheme"]["type"] == kind
        # bytes: codes + one scale byte per block (+ NVFP4's 4-byte tensor scale)
        n_weights = row["out_features"] * row["in_features"]
        extra = 4 if kind == "NVFP4" else 0
        assert row["bytes_after"] == n_weights * bits / 8 + extra
    assert rows["lm_head"]["status"] == "skipped"
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {"fxquant.mxfp8_linear.default", "fxquant.mxfp4_linear.default"} <= targets
    assert "fxquant.nvfp4_linear.default" in targets
    with torch.no_grad():
        y = ep.module()(ids)
    assert sqnr(want, y) > 25  # measured 28-30 dB for the single-scheme configs


@pytest.fixture(scope="module")
def small_program():
    """One linear per op (MXFP8, MXFP4 w4a4, NVFP4 Four Over Six), small enough to compile:
    the Llama's lowered graph takes minutes to compile on two busy cores."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 32), torch.nn.Linear(32, 32), torch.nn.Linear(32, 16)
    ).eval()
    x = torch.randn(3, 64)
    cfg = QuantConfig(
        scheme=NVFP4(scale_rule="four_over_six"),
        overrides={"0": MXFP8(), "1": MXFP4(activations=True)},
        modules_to_not_convert=(),
    )
    ep = fxquant.quantize(model, cfg, example_inputs=(x,))
    return x, ep, lower(ep)


def test_cpu_lowering_is_the_reference(small_program):
    x, ep, lowered = small_program
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert {f"fxquant.{k}_linear.default" for k in ("mxfp8", "mxfp4", "nvfp4")} <= targets
    targets = {str(n.target) for n in lowered.graph.nodes if n.op == "call_function"}
    assert not any(t.startswith("fxquant.") for t in targets), targets
    with torch.no_grad():
        assert torch.equal(lowered.module()(x), ep.module()(x))


@pytest.mark.slow
def test_cpu_lowering_compiles_with_inductor(small_program):
    # ~30 s uncached on 2 busy cores, nearly all of it Inductor's fixed cost (one layer less
    # saves ~2 s): the three ops share the one compile
    x, ep, lowered = small_program
    with torch.no_grad():
        want = ep.module()(x)
        got = torch.compile(lowered.module())(x)
    # Inductor fuses the reductions and may reorder the fp32 GEMM's sums
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_layers_whose_k_is_not_a_block_multiple_are_skipped_with_the_reason():
    model = torch.nn.Sequential(torch.nn.Linear(48, 32), torch.nn.Linear(32, 16)).eval()
    ep = fxquant.quantize(
        model,
        QuantConfig(scheme=MXFP4(), modules_to_not_convert=()),
        example_inputs=(torch.randn(2, 48),),
    )
    rows = fxquant.report(ep).rows
    assert rows[0]["status"] == "skipped"
    assert "in_features=48 is not a multiple of 32 (MXFP4 blocks along K)" in rows[0]["reason"]
    assert rows[1]["status"] == "quantized"
    assert NVFP4().unsupported_reason(out_features=8, in_features=48) is None


def test_all_zero_weights_and_inputs_give_the_bias_not_nan():
    model = torch.nn.Linear(32, 8).eval()
    with torch.no_grad():
        model.weight.zero_()
    x = torch.zeros(3, 32)
    for scheme in (MXFP8(), MXFP4(activations=True), NVFP4(scale_rule="four_over_six")):
        ep = fxquant.quantize(
            model, QuantConfig(scheme=scheme, modules_to_not_convert=()), example_inputs=(x,)
        )
        assert torch.equal(ep.module()(x), model.bias.detach().expand(3, 8)), scheme


# --------------------------------------------------------------------------------------------
# Configs
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: MXFP8(scale_rule="even"), r"MXFP8.scale_rule='even' is not supported; allowed"),
        (lambda: MXFP4(scale_rule="round"), r"MXFP4.scale_rule='round' .* 'floor', 'ceil', 'even'"),
        (lambda: MXFP4(activations="yes"), r"MXFP4.activations='yes'"),
        (lambda: NVFP4(scale_rule="mse"), r"NVFP4.scale_rule='mse' .* 'six', 'four_over_six'"),
    ],
)
def test_config_errors_name_the_field_and_the_choices(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_configs_round_trip_and_recipes():
    cfg = QuantConfig(
        scheme=NVFP4(activations=False, scale_rule="four_over_six"),
        overrides={"a": MXFP4(scale_rule="even"), "b": MXFP8(scale_rule="ceil")},
    )
    assert QuantConfig.from_json(cfg.to_json()) == cfg
    assert fxquant.RECIPES["nvfp4"] == NVFP4(activations=True, scale_rule="six")
    assert fxquant.RECIPES["mxfp4"].quantizes_activation is False
    assert isinstance(fxquant.RECIPES["mxfp8"], Scheme) and MXFP8.quantizes_activation


def test_an_mxfp8_training_recipe_exports_mxfp8_with_its_rounding():
    from fxquant.passes.float8_regions import inference_config

    model = torch.nn.Sequential(*(torch.nn.Linear(32, 32) for _ in range(3)))
    cfg = inference_config(model, QuantConfig(scheme=Float8Recipe(scaling="mxfp8")))
    assert dict(cfg.overrides)["1"] == MXFP8(scale_rule="ceil")  # first and last stay float


# --------------------------------------------------------------------------------------------
# Hugging Face configs
# --------------------------------------------------------------------------------------------


def _ct(groups):
    return {"quant_method": "compressed-tensors", "config_groups": groups}


@pytest.mark.parametrize(
    "config, scheme",
    [
        ({"quant_method": "fouroversix"}, NVFP4(scale_rule="four_over_six")),
        ({"quant_method": "fouroversix", "scale_rule": "static_6"}, NVFP4(scale_rule="six")),
        (
            {"quant_method": "fouroversix", "dtype": "mxfp4", "scale_rule": "static_6"},
            MXFP4(activations=True, scale_rule="ceil"),
        ),
        (
            {
                "quant_method": "fouroversix",
                "weight_scale_rule": "mse",
                "gradient_dtype": "mxfp4",
                "keep_master_weights": True,
                "matmul_backend": "pytorch",
                "output_dtype": "float16",
                "modules_to_not_convert": ["lm_head"],
            },
            NVFP4(scale_rule="four_over_six"),
        ),
        (_ct({"NVFP4A16": ["Linear"]}), NVFP4(activations=False)),
        (_ct({"MXFP4A16": ["Linear"]}), MXFP4(scale_rule="even")),
        (_ct({"MXFP4": ["Linear"]}), MXFP4(activations=True, scale_rule="even")),
        (
            _ct(
                {
                    "g": {
                        "targets": ["Linear"],
                        "weights": {
                            "num_bits": 4,
                            "type": "float",
                            "strategy": "group",
                            "group_size": 32,
                            "scale_dtype": "torch.uint8",
                        },
                    }
                }
            ),
            MXFP4(scale_rule="even"),
        ),
    ],
)
def test_hf_configs_map(config, scheme):
    assert from_hf(config).scheme == scheme


def test_hf_nvfp4_maps_with_a_warning_and_mxfp4_takes_only_the_experts():
    from fxquant.hf import ApproximationWarning

    with pytest.warns(ApproximationWarning, match="bf16 activations"):
        cfg = from_hf({"quant_method": "nvfp4", "modules_to_not_convert": ["lm_head", "router"]})
    assert cfg.scheme == NVFP4(activations=True, scale_rule="six")
    assert cfg.modules_to_not_convert == ("lm_head", "router")
    # transformers quantizes only gpt-oss's 3-D experts (tests/test_mxfp4_experts.py runs it)
    cfg = from_hf({"quant_method": "mxfp4"})
    assert cfg.scheme is None
    assert list(cfg.overrides.values()) == [MXFP4(activations=False, scale_rule="ceil")]


def test_hf_objects_and_skip_lists():
    transformers = pytest.importorskip("transformers")
    with pytest.warns(UserWarning):
        assert from_hf(transformers.NVFP4Config()).scheme == NVFP4()
    assert from_hf(transformers.FourOverSixConfig()).modules_to_not_convert == ("lm_head",)


@pytest.mark.parametrize(
    "config, match",
    [
        ({"quant_method": "fouroversix", "scale_rule": "mae"}, "allowed: 'mse', 'static_6'"),
        ({"quant_method": "fouroversix", "activation_dtype": "mxfp4"}, "one format and rule"),
        ({"quant_method": "fouroversix", "weight_scale_2d": True}, "16×16"),
        ({"quant_method": "fouroversix", "dtype": "nvint4"}, "allowed: 'nvfp4', 'mxfp4'"),
        ({"quant_method": "fouroversix", "module_config_overrides": {"a": {}}}, "overrides"),
        (_ct({"NVFP4": ["Linear"]}), "calibrated offline"),
        (
            _ct(
                {
                    "g": {
                        "weights": {
                            "num_bits": 4,
                            "type": "float",
                            "strategy": "group",
                            "group_size": 16,
                        }
                    }
                }
            ),
            "FP4 maps as NVFP4",
        ),
    ],
)
def test_hf_configs_that_do_not_map_say_why(config, match):
    with pytest.raises(NotImplementedError, match=match):
        from_hf(config)
