"""Calibration: GPTQ against round-to-nearest and its storage, AWQ/SmoothQuant folding, and
``fxquant.calibrate`` end to end on the conftest TinyLlama."""

from __future__ import annotations

import pytest
import torch

import fxquant
from fxquant.calibration.api import calibrate, calibration_pass
from fxquant.calibration.gptq import gptq_quantize, output_error
from fxquant.calibration.interpreter import input_moments
from fxquant.calibration.methods import AWQ, GPTQ, SmoothQuant
from fxquant.core import reference as ref
from fxquant.core.config import Int4WeightOnly, Int8DynamicActivation, Int8WeightOnly

INT4_ASYM = Int4WeightOnly(group_size=32)
AWQ_FAST = AWQ(n_grid=10)
INT4_SYM = Int4WeightOnly(group_size=32, symmetric=True)


def _dequantize(scheme, tensors: dict) -> torch.Tensor:
    if isinstance(scheme, Int4WeightOnly):
        return ref.dequantize_int4_grouped(
            tensors["qweight"], tensors["scale"], tensors["zero"], group_size=scheme.group_size
        )
    return ref.dequantize_int8_per_channel(tensors["qweight"], tensors["scale"])


def _correlated_inputs(k: int, n: int = 2048) -> torch.Tensor:
    g = torch.Generator().manual_seed(1)
    mix = torch.randn(k, k, generator=g) * 0.3 + torch.eye(k)
    x = torch.randn(n, k, generator=g) @ mix
    x[:, 3] = 0.0  # a dead input channel: H[3, 3] == 0
    return x


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    # Calibration runs many small ops; on the shared 2-core CI machine a second thread costs
    # more in wake-ups than it saves (measured: 8 ms vs 8 µs per small op under load).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


# --------------------------------------------------------------------------- GPTQ, one layer


@pytest.mark.parametrize(
    "scheme, act_order, group_aware, mse",
    [
        (INT4_ASYM, False, False, 0.0),
        (INT4_SYM, False, False, 0.0),
        (INT4_SYM, True, False, 0.0),
        (INT4_ASYM, False, True, 0.0),
        (Int8WeightOnly(), True, False, 0.0),
        (INT4_ASYM, False, False, 2.4),
        (INT4_SYM, True, False, 2.4),
    ],
    ids=[
        "int4-asym", "int4-sym", "int4-sym-act-order-static", "int4-asym-gar", "int8-act-order",
        "int4-asym-mse", "int4-sym-act-order-static-mse",
    ],
)  # fmt: skip
def test_gptq_beats_rtn_and_stores_exactly_what_it_computed(scheme, act_order, group_aware, mse):
    torch.manual_seed(0)
    k = 80  # not a multiple of the group: K is padded to 96 and the padding is dead too
    w = torch.randn(24, k)
    x = _correlated_inputs(k)
    x[:, 40:48] *= 4  # strong channels in the second group: GAR visits that group first
    h = 2 * x.t() @ x / x.shape[0]
    res = gptq_quantize(
        w, h, scheme, act_order=act_order, static_groups=act_order, blocksize=32,
        group_aware=group_aware, mse=mse,
    )  # fmt: skip
    rtn = scheme.quantize(w)
    # the program will store res.weight: same constants (names, shapes, dtypes) as the RTN path
    assert {n: (t.shape, t.dtype) for n, t in res.weight.tensors.items()} == {
        n: (t.shape, t.dtype) for n, t in rtn.tensors.items()
    }
    # ...and they dequantize bit for bit to the weights the error feedback worked with
    stored = _dequantize(scheme, res.weight.tensors)[:, :k]
    assert torch.equal(stored, res.quantized)
    assert torch.equal(res.dequantized, res.quantized)
    y = x @ w.t()
    err_gptq = (x @ res.dequantized.t() - y).pow(2).mean()
    err_rtn = (x @ rtn.dequantized.t() - y).pow(2).mean()
    assert err_gptq < 0.8 * err_rtn, (err_gptq, err_rtn)
    # output_error is the same quantity computed from H alone
    assert output_error(w, res.dequantized, h) == pytest.approx(float(err_gptq), rel=1e-3)
    assert torch.isfinite(res.dequantized).all()


@pytest.mark.parametrize("scheme", [INT4_ASYM, INT4_SYM, Int8WeightOnly()], ids=str)
def test_gptq_with_identity_hessian_is_round_to_nearest(scheme):
    # Uncorrelated unit inputs: no error to feed forward, so GPTQ rounds each weight to nearest
    torch.manual_seed(0)
    w = torch.randn(16, 64)
    res = gptq_quantize(w, 2 * torch.eye(64), scheme)
    rtn = scheme.quantize(w)
    for name, t in rtn.tensors.items():
        assert torch.equal(res.weight.tensors[name], t), name


@pytest.mark.parametrize("scheme", [INT4_ASYM, INT4_SYM, Int8WeightOnly()], ids=str)
def test_gptq_mse_range_search_never_rounds_worse_than_min_max(scheme):
    # With an identity Hessian GPTQ rounds to nearest on its grid; the mse search picks each
    # group's range among shrunk ones including the full one, so no group's p-norm error grows,
    # and on int4's coarse grid, with one outlier per group, shrinking must help somewhere (int8's
    # steps are fine enough that clipping an outlier never pays).
    torch.manual_seed(0)
    w = torch.randn(16, 64)
    w[:, ::32] *= 6
    plain = gptq_quantize(w, 2 * torch.eye(64), scheme).dequantized
    searched = gptq_quantize(w, 2 * torch.eye(64), scheme, mse=2.4).dequantized
    group = scheme.group_size if isinstance(scheme, Int4WeightOnly) else 64

    def err(q):
        return (q - w).abs().pow(2.4).reshape(16, -1, group).sum(-1)

    assert (err(searched) <= err(plain) * (1 + 1e-6)).all()
    if isinstance(scheme, Int4WeightOnly):
        assert (err(searched) < err(plain)).any()


def test_first_token_weight_counts_the_first_position_as_if_repeated():
    torch.manual_seed(0)
    samples = [torch.randn(2, 7, 12), torch.randn(2, 5, 12)]
    heavy = input_moments(samples, 12, first_token_weight=4.0)
    # the same statistics as the first position of every sequence written out 4 times
    repeated = [torch.cat([v[:, :1]] * 3 + [v], dim=1) for v in samples]
    plain = input_moments(repeated, 12)
    torch.testing.assert_close(heavy["sigma"], plain["sigma"])
    torch.testing.assert_close(heavy["absmean"], plain["absmean"])
    assert torch.equal(heavy["absmax"], input_moments(samples, 12)["absmax"])
    assert heavy["tokens"] == 24  # the real count, for the report
    # 2-D inputs have no sequence dimension: the weight does not apply
    flat = [v.reshape(-1, 12) for v in samples]
    torch.testing.assert_close(
        input_moments(flat, 12, first_token_weight=4.0)["sigma"], input_moments(flat, 12)["sigma"]
    )


def test_group_aware_order_keeps_groups_whole_strongest_first():
    from fxquant.calibration.gptq import _group_aware_order

    diag = torch.tensor([1.0, 5.0, 2.0, 0.5, 9.0, 3.0, 0.1, 4.0])
    # groups of 4: maxima 5 and 9 → group 1 first; inside each, decreasing diag
    assert _group_aware_order(diag, 4).tolist() == [4, 7, 5, 6, 1, 2, 0, 3]


def test_gptq_act_order_with_dynamic_int4_groups_is_refused():
    with pytest.raises(ValueError, match="static_groups=True"):
        gptq_quantize(torch.randn(4, 32), torch.eye(32), INT4_SYM, act_order=True)


# --------------------------------------------------------------------------- on TinyLlama


def _error(fn, model, evals) -> float:
    with torch.no_grad():
        return sum(float((fn(x) - model(x)).pow(2).mean()) for x in evals)


def test_calibrate_module_gptq_end_to_end_beats_rtn_and_leaves_the_model_alone(llama):
    model, ep, data, evals = llama
    before = {k: v.clone() for k, v in model.state_dict().items()}
    qep = calibrate(model, INT4_ASYM, data, method=GPTQ(), progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    rows = fxquant.report(qep).quantized
    assert len(rows) == 14  # 7 linears × 2 blocks; lm_head stays float
    assert all(r["weights"] == "given" and r["calibration"]["status"] == "calibrated" for r in rows)
    assert all(r["calibration"]["output_mse"] < r["calibration"]["output_mse_rtn"] for r in rows)
    rtn = fxquant.quantize(ep, INT4_ASYM)
    assert _error(qep.module(), model, evals) < 0.8 * _error(rtn.module(), model, evals)


def test_calibrate_gptq_stores_gptq_constants_and_reports_what_it_left(llama):
    # The program's constants are GPTQ's: identical to what the calibration pass made.
    _, ep, data, _ = llama
    config = fxquant.QuantConfig(
        scheme=Int8WeightOnly(), overrides={r"layers\.1\.o_proj": fxquant.Float8WeightOnly()}
    )
    res = calibration_pass(ep, config, [(d,) for d in data[:2]], method=GPTQ())
    rec = res.records["layers.1.o_proj.weight"]
    assert rec["status"] == "skipped" and "Float8WeightOnly" in rec["reason"]
    assert "layers.1.o_proj.weight" not in res.weights
    qep = fxquant.quantize(res.program, config, weights=res.weights)
    q = res.weights["layers.1.down_proj.weight"].tensors
    assert torch.equal(qep.state_dict["layers.1.down_proj.qweight"], q["qweight"])
    assert torch.equal(qep.state_dict["layers.1.down_proj.scale"], q["scale"])
    scheme = Int8WeightOnly()
    rtn = scheme.quantize(ep.state_dict["layers.1.down_proj.weight"])
    assert not torch.equal(q["qweight"], rtn.tensors["qweight"])


@pytest.mark.parametrize(
    "scheme, method",
    # clipping changes the weights on purpose: the scales alone must leave the model as it was
    [(INT4_ASYM, AWQ(n_grid=10, clip=False)), (Int8DynamicActivation(), SmoothQuant(alpha=0.5))],
    ids=["awq", "smoothquant"],
)
def test_folding_keeps_the_float_model(llama, scheme, method):
    model, ep, data, evals = llama
    res = calibration_pass(ep, scheme, [(d,) for d in data], method=method)
    assert res.weights == {}  # scales only: the rounding is left to quantize()
    changed = [
        k for k in ep.state_dict if not torch.equal(ep.state_dict[k], res.program.state_dict[k])
    ]
    assert "layers.0.input_layernorm.weight" in changed
    assert "layers.0.q_proj.weight" in changed
    folded, original = res.program.module(), ep.module()
    for x in evals[:2]:
        torch.testing.assert_close(folded(x), original(x), rtol=1e-4, atol=1e-4)
    if isinstance(method, AWQ):
        # up → down and v → o (here o reads softmax @ v) fold into the preceding linear
        assert res.records["layers.0.down_proj.weight"]["folded_into"] == (
            "linear layers.0.up_proj.weight"
        )
        assert res.records["layers.0.o_proj.weight"]["folded_into"] == (
            "linear layers.0.v_proj.weight"
        )
    else:
        # SmoothQuant folds into norms only: o_proj's input comes from attention
        rec = res.records["layers.0.o_proj.weight"]
        assert rec["status"] == "skipped" and "not a norm" in rec["reason"]


@pytest.mark.parametrize(
    "scheme, method",
    [
        (INT4_ASYM, AWQ_FAST),
        (Int8DynamicActivation(), SmoothQuant(alpha=0.5)),
        (INT4_ASYM, AWQ(n_grid=10, first_token_weight=8.0)),
        (INT4_ASYM, GPTQ(desc_act=True, static_groups=True, mse=2.4, first_token_weight=8.0)),
    ],
    ids=["awq", "smoothquant", "awq-first8", "gptq-actorder-mse-first8"],
)
def test_calibrate_program_beats_rtn(llama, scheme, method):
    model, ep, data, evals = llama
    qep = calibrate(ep, scheme, data, method=method, progress=False)
    rtn = fxquant.quantize(ep, scheme)
    assert _error(qep.module(), model, evals) < _error(rtn.module(), model, evals)
    assert ep.state_dict["layers.0.q_proj.weight"] is model.layers[0].q_proj.weight


def test_awq_then_gptq_stores_gptq_constants_of_the_scaled_weights(llama):
    # AWQ's scales folded first (no clipping), then GPTQ on the folded program: the program
    # holds GPTQ's constants, each report row says both what GPTQ did and what AWQ did before
    model, ep, data, evals = llama
    qep = calibrate(ep, INT4_ASYM, data, method=(AWQ(n_grid=10, clip=False), GPTQ()),
                    progress=False)  # fmt: skip
    rows = {r["name"]: r for r in fxquant.report(qep).quantized}
    q = rows["layers.0.q_proj"]
    assert q["weights"] == "given" and q["calibration"]["method"] == "gptq"
    assert q["calibration"]["after"]["method"] == "awq"
    norm = "layers.0.input_layernorm.weight"  # the scales were folded into the norm
    assert not torch.equal(ep.state_dict[norm], qep.state_dict[norm])
    rtn = fxquant.quantize(ep, INT4_ASYM)
    assert _error(qep.module(), model, evals) < 0.8 * _error(rtn.module(), model, evals)
    with pytest.raises(ValueError, match="GPTQ and AutoRound must come last"):
        calibrate(ep, INT4_ASYM, data, method=(GPTQ(), AWQ()), progress=False)


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda: GPTQ(damp_percent=0.0), "GPTQ.damp_percent=0.0"),
        (lambda: GPTQ(blocksize=0), "GPTQ.blocksize=0"),
        (lambda: GPTQ(mse=-1.0), "GPTQ.mse=-1.0"),
        (lambda: GPTQ(first_token_weight=0), "GPTQ.first_token_weight=0"),
        (lambda: AWQ(first_token_weight=-2.0), "AWQ.first_token_weight=-2.0"),
        (lambda: GPTQ(desc_act="yes"), "GPTQ.desc_act='yes'"),
        (lambda: AWQ(n_grid=1), "AWQ.n_grid=1"),
        (lambda: AWQ(no_clip="q_proj"), "AWQ.no_clip='q_proj'"),
        (lambda: SmoothQuant(alpha=1.5), "SmoothQuant.alpha=1.5"),
    ],
)
def test_bad_method_configs_raise(make, match):
    with pytest.raises(ValueError, match=match.replace("(", r"\(")):
        make()


def test_bad_calibrate_calls_raise(llama):
    model, ep, data, _ = llama
    with pytest.raises(ValueError, match="static_groups=True"):
        calibrate(ep, INT4_SYM, data, method=GPTQ(desc_act=True), progress=False)
    with pytest.raises(ValueError, match="method="):
        calibrate(ep, INT4_SYM, data, method="gptq", progress=False)
    with pytest.raises(ValueError, match="data is empty"):
        calibrate(ep, INT4_SYM, [], method=GPTQ(), progress=False)
    with pytest.raises(ValueError, match=r"data\[0\] is a list"):
        calibrate(ep, INT4_SYM, [[data[0]]], method=GPTQ(), progress=False)
    with pytest.raises(ValueError, match="does not match the program's inputs"):
        calibrate(ep, INT4_SYM, [(data[0], data[0])], method=GPTQ(), progress=False)
