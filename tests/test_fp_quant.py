"""FP-Quant (``FPQuant``, transformers' ``FPQuantConfig``): the rotations and quantizers against
what the ``fp_quant`` package itself computes (tests/fixtures/fp_quant_0.3.2.pt, written by
tests/fixtures/make_fp_quant_fixture.py), the scale rules by hand, the op, its CPU lowering and
Triton kernel against the reference math, from_hf, checkpoints in FP-Quant's layout, and a
package in a fresh process."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn
from torch.export import Dim
from torch.library import opcheck

import fxquant
from conftest import Two, check_package_without_fxquant
from fxquant import FPQuant
from fxquant.checkpoints import CheckpointError, read_quantized
from fxquant.core import reference_fp_quant as ref
from fxquant.core import reference_mx as ref_mx
from fxquant.core.reference import sqnr
from fxquant.passes.lower import lower

FIXTURE = torch.load(Path(__file__).parent / "fixtures" / "fp_quant_0.3.2.pt")
# the op's opcheck: SchemaCheckMode compares with allclose, which has no CPU float8 kernel
NO_SCHEMA_TEST = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
DEFAULT_TESTS = ("test_schema", *NO_SCHEMA_TEST)
SCHEMES = [
    FPQuant(),
    FPQuant(method="abs_max", rotation_size=64),
    FPQuant(rotation="gsr", rotation_size=128),
    FPQuant(dtype="nvfp4", method="abs_max", rotation_size=16),
    FPQuant(dtype="nvfp4", method="abs_max", rotation="identity", rotation_size=32),
]


def _id(s: FPQuant) -> str:
    return f"{s.dtype}-{s.method}-{s.rotation}{s.rotation_size}"


def _case_id(c) -> str:
    return f"{c['dtype']}-{c['method']}-{c['rotation']}{c['size']}"


# --------------------------------------------------------------------------------------------
# Reference math against fp_quant itself
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=_case_id)
def test_the_rotations_are_fp_quants(case):
    r = ref.rotation_matrix(case["rotation"], case["size"])
    assert torch.equal(r, case["matrix"].float())
    eye = torch.eye(case["size"])
    torch.testing.assert_close(r @ r.t(), eye, rtol=0, atol=5e-3)  # bf16 entries: ~orthogonal
    if case["rotation"] == "gsr":  # columns in sequency order, each sequency once
        assert torch.equal(ref.sequency(r), torch.arange(case["size"]))


@pytest.mark.parametrize("case", FIXTURE["cases"], ids=_case_id)
def test_the_quantizer_is_fp_quants_up_to_its_ties(case):
    """The dequantized rotated weight equals fp_quant's Triton quantizer's, except (MXFP4)
    where a value falls exactly halfway between two e2m1 points: fp_quant's Triton kernel rounds
    those toward zero, QuTLASS (the path real checkpoints come from) and fxquant to even; and
    (NVFP4) in blocks whose e4m3 scale the Triton interpreter itself casts wrongly (it truncates
    subnormals and loses a carry into the next binade: kernels/rounding.py)."""
    r = ref.rotation_matrix(case["rotation"], case["size"])
    g = torch.tensor([case["global_scale"]])
    dtype, method = case["dtype"], case["method"]
    got = ref.fake_quantize(case["weight"], r, g, dtype=dtype, method=method)
    want = case["dequantized"]
    differ = got != want
    if dtype == "mxfp4":
        v = ref.rotate(case["weight"], r)
        # a tie: v halfway between the two neighbours, and fp_quant took the smaller magnitude
        tie = torch.isclose(v, (got + want) / 2, rtol=1e-6, atol=0) & (want.abs() < got.abs())
        assert not (differ & ~tie).any()
        assert differ.sum() <= 16  # ties are rare; a wrong rule would differ everywhere
    else:
        v = ref.rotate(case["weight"], r).unflatten(-1, (-1, 16))
        hp = g * (v.abs().amax(-1) * (1.0 / 6.0))
        _, e_hp = torch.frexp(hp)
        _, e_s = torch.frexp(hp.to(torch.float8_e4m3fn).float())
        interpreter_cast = (e_s > e_hp) | (hp < 2**-6)
        assert not (differ.unflatten(-1, (-1, 16)).any(-1) & ~interpreter_cast).any()
        assert (~interpreter_cast).float().mean() > 0.8


def test_the_scale_rules_by_hand():
    ones = torch.tensor([1.0, -1.0] * 16).repeat(1, 4)  # [1, 128], mean 0, σ 1, amax 1
    eye = torch.eye(32)

    def dq(dtype, method, g):
        codes, s = ref.quantize(ones, dtype=dtype, method=method, global_scale=torch.tensor([g]))
        return codes, s, ref.dequantize(codes, s, torch.tensor([g]), dtype=dtype)

    # QuEST: scale 2**floor(log2(σ · 2.92 / 6)) = 1/4, so ±1 is the e2m1 code 4
    codes, s, v = dq("mxfp4", "quest", 1.0)
    assert (ref_mx.decode_e2m1(codes).abs() == 4).all() and (s == 127 - 2).all()
    assert torch.equal(v, ones)
    # MXFP4 abs_max: scale 2**0, the gain 3 puts ±1 on the code 3; the global scale 3 divides
    codes, s, v = dq("mxfp4", "abs_max", 3.0)
    assert (ref_mx.decode_e2m1(codes).abs() == 3).all() and (s == 127).all()
    assert torch.equal(v, ones)
    # NVFP4 abs_max: e4m3(3 · 1 / 6) = 0.5 per 16, ±1 → the code 6
    codes, s, v = dq("nvfp4", "abs_max", 3.0)
    assert (ref_mx.decode_e2m1(codes).abs() == 6).all() and (s.float() == 0.5).all()
    assert torch.equal(v, ones)
    # the identity rotation changes nothing; all-zero input gives zeros, never NaN
    assert torch.equal(ref.rotate(ones, eye), ones)
    for dtype, method in (("mxfp4", "quest"), ("mxfp4", "abs_max"), ("nvfp4", "abs_max")):
        z = ref.fake_quantize(
            torch.zeros(2, 64), eye, torch.tensor([3.0]), dtype=dtype, method=method
        )
        assert torch.equal(z, torch.zeros(2, 64))


@pytest.mark.parametrize("scheme", SCHEMES, ids=_id)
def test_the_op_is_the_reference_and_passes_opcheck(scheme):
    torch.manual_seed(0)
    w = torch.randn(24, 128) * 0.05
    q = scheme.quantize(w)
    assert sqnr(w, q.dequantized) > 14  # the report's SQNR, back in the original basis
    t = q.tensors
    args = (
        t["qweight"],
        t["scale"],
        t["rotation"],
        t["weight_global_scale"],
        t["act_global_scale"],
    )
    x, b = torch.randn(2, 3, 128), torch.randn(24)
    op = torch.ops.fxquant.fp_quant_linear
    y = op(x, *args, b, scheme.dtype, scheme.method)
    want = ref.fp_quant_linear(x, *args, b, dtype=scheme.dtype, method=scheme.method)
    assert torch.equal(y, want) and y.shape == (2, 3, 24)
    assert sqnr(x @ w.t() + b, y) > 10  # W4A4
    fp8 = t["scale"].dtype == torch.float8_e4m3fn
    tests = NO_SCHEMA_TEST if fp8 else DEFAULT_TESTS
    opcheck(op.default, (x, *args, b, scheme.dtype, scheme.method), test_utils=tests)
    assert op(x.bfloat16(), *args, None, scheme.dtype, scheme.method).dtype == torch.bfloat16


def test_the_rotation_helps_where_outliers_are():
    # FP-Quant's point: a rotated MXFP4 weight with outlier columns keeps more signal than
    # MXFP4 alone (OCP's floor rule)
    torch.manual_seed(1)
    w = torch.randn(64, 256) * 0.02
    w[:, ::37] *= 40
    plain = fxquant.MXFP4().quantize(w).dequantized
    rotated = FPQuant(method="abs_max").quantize(w).dequantized
    assert sqnr(w, rotated) > sqnr(w, plain) + 3


# --------------------------------------------------------------------------------------------
# Graph: quantize, lower for CPU, skip what cannot take it
# --------------------------------------------------------------------------------------------


def _quantized(recipe, dtype=torch.float32):
    torch.manual_seed(0)
    model = Two().eval().to(dtype)
    x = torch.randn(5, 128, dtype=dtype)
    qep = fxquant.quantize(model, recipe, example_inputs=(x,), dynamic_shapes=({0: Dim.DYNAMIC},))
    return model, qep


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", ["fp-quant-nvfp4", "fp-quant-mxfp4"])
def test_the_cpu_lowering_computes_the_reference(recipe, dtype):
    model, qep = _quantized(recipe, dtype)
    assert [r["status"] for r in fxquant.report(qep).rows] == ["quantized", "quantized"]
    lowered = lower(qep)
    targets = {str(n.target) for n in lowered.graph.nodes if n.op == "call_function"}
    assert not any(t.startswith("fxquant.") for t in targets), targets
    for m in (1, 7):
        x = torch.randn(m, 128, dtype=dtype)
        got, want = lowered.module()(x), qep.module()(x)
        # fp32: the same codes (the bf16 roundings are bit operations Inductor keeps); a bf16
        # model rounds each layer's output too
        floor = 80.0 if dtype == torch.float32 else 35.0
        assert got.dtype == want.dtype and sqnr(want.float(), got.float()) >= floor, m
        # and it is still the model: over six inputs, 13.9-16.0 dB for nvfp4 and 7.3-9.3 dB for
        # mxfp4 (power-of-two scales per 32) on this random two-layer model, ~0 dB if broken
        model_floor = 12.0 if recipe == "fp-quant-nvfp4" else 6.0
        assert sqnr(model(x).float(), got.float()) > model_floor


def test_layers_fp_quant_cannot_take_are_skipped_and_reported():
    model = nn.Sequential(nn.Linear(80, 64), nn.Linear(64, 8)).eval()
    qep = fxquant.quantize(model, "fp-quant-mxfp4", example_inputs=(torch.randn(2, 80),))
    rows = fxquant.report(qep).rows
    assert [r["status"] for r in rows] == ["skipped", "quantized"]
    assert "multiple of rotation_size=32" in rows[0]["reason"]


# --------------------------------------------------------------------------------------------
# Triton: the fused rotate-and-quantize kernel (interpreter on CPU tensors)
# --------------------------------------------------------------------------------------------


@pytest.mark.interpreter
@pytest.mark.parametrize("scheme", SCHEMES, ids=_id)
@pytest.mark.parametrize(("m", "dtype"), [(1, torch.float32), (19, torch.bfloat16)])
def test_the_activation_kernel_is_the_reference_bit_for_bit(scheme, m, dtype):
    pytest.importorskip("triton")
    from fxquant.kernels.fp_quant import lower_fp_quant_linear

    torch.manual_seed(m)
    w = torch.randn(40, 128) * 0.05
    t = scheme.quantize(w).tensors
    x = (torch.randn(m, 128) * 3).to(dtype)
    x[0, :32] = 0  # an all-zero block
    x[:, 7] *= 30
    r, ags = t["rotation"], t["act_global_scale"]
    got = torch.ops.fxquant.triton_fp_quant_quantize(x, r, ags, scheme.dtype, scheme.method)
    want = ref.fake_quantize(x, r, ags, dtype=scheme.dtype, method=scheme.method)
    assert torch.equal(got, want)
    args = (t["qweight"], t["scale"], r, t["weight_global_scale"], ags, torch.randn(40))
    y = lower_fp_quant_linear(x, *args, scheme.dtype, scheme.method)
    y_ref = ref.fp_quant_linear(x, *args, dtype=scheme.dtype, method=scheme.method)
    assert y.dtype == dtype and y.shape == (m, 40)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # fp32 sums in another order
    torch.testing.assert_close(y, y_ref, rtol=tol, atol=tol * y_ref.abs().max().item())


# --------------------------------------------------------------------------------------------
# from_hf
# --------------------------------------------------------------------------------------------


def test_from_hf_maps_fp_quant_config():
    from transformers import FPQuantConfig

    cfg = fxquant.from_hf(FPQuantConfig())  # transformers' default: NVFP4, abs_max, 16
    assert cfg.scheme == FPQuant(dtype="nvfp4", method="abs_max", rotation_size=16)
    assert cfg.scheme == fxquant.RECIPES["fp-quant-nvfp4"]
    cfg = fxquant.from_hf(
        FPQuantConfig(
            forward_dtype="mxfp4",
            forward_method="quest",
            backward_dtype="mxfp8",
            transform_init="gsr",
            hadamard_group_size=64,
            pseudoquantization=True,
            store_master_weights=True,
            modules_to_not_convert=["lm_head", "gate"],
        )
    )
    assert cfg.scheme == FPQuant(dtype="mxfp4", method="quest", rotation="gsr", rotation_size=64)
    assert cfg.modules_to_not_convert == ("lm_head", "gate")


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"forward_dtype": "mxfp8"}, "allowed: 'nvfp4', 'mxfp4'"),
        ({"forward_dtype": "nvfp4", "forward_method": "quest"}, "allowed with nvfp4: 'abs_max'"),
        ({"forward_dtype": "mxfp4", "hadamard_group_size": 16}, "allowed with mxfp4: 32, 64"),
        ({"transform_init": "random"}, "allowed: 'hadamard', 'gsr'"),
    ],
)
def test_from_hf_refuses_values_outside_fp_quants_own(fields, match):
    with pytest.raises(NotImplementedError, match=match):
        fxquant.from_hf({"quant_method": "fp_quant", **fields})


def test_the_scheme_checks_its_fields():
    with pytest.raises(ValueError, match="FPQuant.method='quest' is not supported; allowed: "):
        FPQuant(dtype="nvfp4", method="quest")
    with pytest.raises(ValueError, match="FPQuant.rotation_size=16"):
        FPQuant(dtype="mxfp4", rotation_size=16)


# --------------------------------------------------------------------------------------------
# Checkpoints in FP-Quant's layout
# --------------------------------------------------------------------------------------------

QCFG = {
    "quant_method": "fp_quant",
    "forward_dtype": "mxfp4",
    "forward_method": "quest",
    "hadamard_group_size": 32,
}


def _checkpoint(scheme: FPQuant, *, padded: bool):
    """Two's tensors as FPQuantLinear saves them (bf16 model): qweight, scales (QuTLASS's
    padded buffer when ``padded``), bf16 global scales and rotation matrices, the bias."""
    torch.manual_seed(3)
    model = Two().eval()
    tensors = {"a.bias": model.a.bias.data.bfloat16()}
    for name, lin in (("a", model.a), ("b", model.b)):
        t = scheme.quantize(lin.weight.data.bfloat16()).tensors
        s = t["scale"].view(torch.uint8)
        if padded:  # QuTLASS's buffer: [⌈N/128⌉·128, ⌈K/B/4⌉·4], the blocks from its start
            n, blocks = s.shape
            buf = torch.full((-(-n // 128) * 128, -(-blocks // 4) * 4), 255, dtype=torch.uint8)
            buf.view(-1)[: n * blocks] = s.reshape(-1)
            s = buf
        r = t["rotation"].bfloat16()
        tensors |= {
            f"{name}.qweight": t["qweight"],
            f"{name}.scales": s,
            f"{name}.weight_global_scale": t["weight_global_scale"].bfloat16(),
            f"{name}.act_global_scale": t["act_global_scale"].bfloat16(),
            f"{name}.forward_hadamard_matrix": r,
            f"{name}.backward_hadamard_matrix": r,
        }
    return model, tensors


@pytest.mark.parametrize("padded", [False, True])
@pytest.mark.parametrize(
    "qcfg",
    [
        QCFG,
        {**QCFG, "forward_dtype": "nvfp4", "forward_method": "abs_max", "hadamard_group_size": 16},
    ],
    ids=["mxfp4", "nvfp4"],
)
def test_fp_quant_checkpoints_load_as_the_layers_compute(qcfg, padded):
    scheme = fxquant.from_hf(qcfg).scheme
    model, tensors = _checkpoint(scheme, padded=padded)
    ckpt = read_quantized(tensors, quantization_config=qcfg)
    assert ckpt.schemes == {"a": scheme, "b": scheme}
    assert ckpt.tensors.keys() == {"a.bias"}
    x = torch.randn(4, 128)
    ep = fxquant.load_quantized(Two().eval(), ckpt, example_inputs=(x,))
    assert [r["weights"] for r in fxquant.report(ep).rows] == ["given", "given"]
    # the same layers quantized from the (bf16-rounded) float weights
    model.a.bias.data = model.a.bias.data.bfloat16().float()
    qep = fxquant.quantize(model.bfloat16().float(), scheme, example_inputs=(x,))
    assert torch.equal(ep.module()(x), qep.module()(x))


def test_bad_fp_quant_checkpoints_say_what_is_wrong():
    _, tensors = _checkpoint(fxquant.from_hf(QCFG).scheme, padded=False)
    short = {**tensors, "a.scales": tensors["a.scales"][:, :2]}
    with pytest.raises(
        CheckpointError, match=r"'a.scales' has shape \[64, 2\], expected \[64, 4\]"
    ):
        read_quantized(short, quantization_config=QCFG)
    missing = {k: v for k, v in tensors.items() if k != "b.act_global_scale"}
    with pytest.raises(CheckpointError, match="'b.act_global_scale' is missing"):
        read_quantized(missing, quantization_config=QCFG)
    wrong_size = {**QCFG, "hadamard_group_size": 64}
    with pytest.raises(CheckpointError, match="forward_hadamard_matrix' has shape"):
        read_quantized(tensors, quantization_config=wrong_size)
    pseudo = {"a.dqweight": torch.zeros(64, 128), "a.bias": torch.zeros(64)}
    with pytest.raises(CheckpointError, match="pseudo-quantized"):
        read_quantized(pseudo, quantization_config=QCFG)
    master = {"a.weight": torch.zeros(64, 128)}
    with pytest.raises(CheckpointError, match="store_master_weights"):
        read_quantized(master, quantization_config=QCFG)
    with pytest.raises(NotImplementedError, match="forward_method"):
        read_quantized(tensors, quantization_config={**QCFG, "forward_method": "rtn"})


@pytest.mark.slow
def test_an_fp_quant_program_saves_reports_and_packages(tmp_path):
    _, qep = _quantized("fp-quant-mxfp4")
    path = tmp_path / "fpq.pt2"
    torch.export.save(qep, path)
    loaded = torch.export.load(path)
    x = torch.randn(4, 128)
    assert torch.equal(loaded.module()(x), qep.module()(x))
    rep = fxquant.report(loaded)
    assert rep.rows[0]["status"] == "quantized" and "FPQuant" in str(rep.config)
    check_package_without_fxquant(qep, tmp_path, [torch.randn(m, 128) for m in (1, 6)])
