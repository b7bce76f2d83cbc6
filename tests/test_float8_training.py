"""FP8 training math (fxquant.training.numerics) against independent implementations: the
delayed-scaling update rule, every cast, and the linear's forward and backward GEMMs."""

from __future__ import annotations

import math

import pytest
import torch
from functorch.compile import make_boxed_func
from torch._functorch.aot_autograd import aot_function

from fxquant.core import reference as ref
from fxquant.core.config import Float8Recipe
from fxquant.training.numerics import (
    E4M3,
    E5M2,
    cast_blocks,
    cast_current,
    cast_delayed,
    cast_mx,
    cast_tiles,
    delayed_scaling_update,
    float8_training_linear,
)

# --------------------------------------------------------------------------------------------
# The delayed-scaling update, step by step, against a sliding-window implementation of the rule
# --------------------------------------------------------------------------------------------


def _window_rule(amaxes: list[float], *, history_len, margin, algo, fp8_max):
    """Scales after each step, written from the rule's words: amax over the last L recorded
    amaxes (or the latest); scale = fp8_max / amax / 2**margin unless amax is 0/inf/NaN."""
    scale, scales = 1.0, []
    for t in range(len(amaxes)):
        window = amaxes[max(0, t - history_len + 1) : t + 1]
        if algo == "max":
            amax = math.nan if any(math.isnan(a) for a in window) else max(window)
        else:
            amax = window[-1]
        if amax > 0 and math.isfinite(amax):
            scale = fp8_max / amax / 2**margin
        scales.append(scale)
    return scales


@pytest.mark.parametrize("margin", [0, 2])
@pytest.mark.parametrize("algo", ["max", "most_recent"])
@pytest.mark.parametrize("history_len", [1, 4])
def test_delayed_scaling_update_follows_the_rule(margin, algo, history_len):
    amaxes = [
        0.0,
        3.0,
        1.5,
        7.0,
        0.5,
        0.25,
        math.inf,
        2.0,
        math.nan,
        1.0,
        0.0,
        0.75,
        0.5,
        0.1,
        0.2,
        0.3,
    ]
    history = torch.zeros(history_len, 1)
    scale = torch.ones(1)
    got = []
    for a in amaxes:
        history[0, 0] = a  # what the step's cast wrote
        delayed_scaling_update(
            history, scale, fp8_maxes=(448.0,), margin=margin, amax_compute_algo=algo
        )
        got.append(scale.item())
        assert history[0, 0] == 0  # row 0 is zeroed for the next step
    want = _window_rule(amaxes, history_len=history_len, margin=margin, algo=algo, fp8_max=448.0)
    # fp32 state vs float64 rule
    assert got == pytest.approx(want, rel=1e-6)
    assert got[0] == 1.0  # amax 0 at step 0: scale 1 stays


def test_delayed_scaling_update_rolls_the_history_like_transformer_engine():
    history = torch.zeros(3, 2)
    scale = torch.ones(2)
    for step, a in enumerate([1.0, 2.0, 3.0, 4.0]):
        history[0] = torch.tensor([a, 10 * a])
        delayed_scaling_update(
            history, scale, fp8_maxes=(448.0, 57344.0), margin=0, amax_compute_algo="max"
        )
        if step == 3:
            # row i takes row i+1, the last takes row 0, then row 0 is zeroed
            assert history[:, 0].tolist() == [0.0, 3.0, 4.0]
            assert scale.tolist() == pytest.approx([448 / 4, 57344 / 40])


# --------------------------------------------------------------------------------------------
# Casts
# --------------------------------------------------------------------------------------------


def _deq(q, scale):
    return q.float() * scale


def test_current_casts_match_the_inference_reference():
    torch.manual_seed(0)
    x = torch.randn(37, 300) * 3
    q, s = ref.quantize_fp8_per_tensor(x)
    torch.testing.assert_close(cast_current(x, E4M3, dim=None), _deq(q, s), rtol=0, atol=0)
    q, s = ref.quantize_fp8_per_token(x)
    torch.testing.assert_close(cast_current(x, E4M3, dim=1), _deq(q, s), rtol=0, atol=0)
    q, s = ref.quantize_fp8_per_token(x.t())
    torch.testing.assert_close(cast_current(x, E4M3, dim=0), _deq(q, s).t(), rtol=0, atol=0)
    q, s = ref.quantize_fp8_groups(x, group_size=128)
    want = _deq(q, ref.expand_group_scale(s, cols=300, group_size=128))
    torch.testing.assert_close(cast_blocks(x, E4M3, dim=1, block=128), want, rtol=0, atol=0)
    q, s = ref.quantize_fp8_blocks(x, block_size=128)
    want = _deq(q, ref.expand_block_scale(s, rows=37, cols=300, block_size=128))
    torch.testing.assert_close(cast_tiles(x, E4M3, block=128), want, rtol=0, atol=0)


def test_mx_cast_uses_power_of_two_scales_rounded_up():
    torch.manual_seed(0)
    x = torch.randn(5, 96) * torch.logspace(-3, 3, 96)
    x[0, :32] = 448.0 * 8  # amax exactly fp8_max · 2**3: the scale is 8, not 16
    x[1, 32:64] = 0.0  # an all-zero block
    got = cast_mx(x, E4M3, dim=1)
    blocks = x.reshape(5, 3, 32).double()
    for r in range(5):
        for b in range(3):
            amax = blocks[r, b].abs().max().item()
            e = 0 if amax == 0 else math.ceil(math.log2(amax / 448.0))
            scale = 2.0**e
            q = (blocks[r, b] / scale).float().to(E4M3).float()  # never beyond ±448
            assert q.abs().max() <= 448
            torch.testing.assert_close(got[r, 32 * b : 32 * b + 32], q * scale, rtol=0, atol=0)
    assert got[0, :32].eq(448.0 * 8).all()
    # along dim 0 = the transposed tensor's rows
    torch.testing.assert_close(cast_mx(x.t().contiguous(), E4M3, dim=0), got.t(), rtol=0, atol=0)


def test_delayed_cast_saturates_and_keeps_e5m2_range():
    x = torch.tensor([1.0, -2.0, 1000.0, 1e6])
    got = cast_delayed(x, torch.tensor(1.0), E4M3)
    assert got.tolist() == [1.0, -2.0, 448.0, 448.0]
    got = cast_delayed(x, torch.tensor(1.0), E5M2)
    assert got.tolist() == [1.0, -2.0, 1024.0, 57344.0]


@pytest.mark.parametrize(
    "cast",
    [
        lambda t: cast_current(t, E4M3, dim=None),
        lambda t: cast_current(t, E5M2, dim=1),
        lambda t: cast_mx(t, E5M2, dim=0),
        lambda t: cast_blocks(t, E4M3, dim=1, block=128),
        lambda t: cast_tiles(t, E4M3, block=128),
        lambda t: cast_delayed(t, torch.tensor(1.0), E4M3),
    ],
)
def test_all_zero_tensors_cast_to_zeros(cast):
    got = cast(torch.zeros(4, 64))
    assert not got.isnan().any() and got.eq(0).all()


# --------------------------------------------------------------------------------------------
# The linear: forward and both backward GEMMs, against per-role references
# --------------------------------------------------------------------------------------------


def _run(recipe, x, w, b, *, fwd_scale=None, bwd_scale=None):
    x = x.clone().requires_grad_()
    w = w.clone().requires_grad_()
    b = b.clone().requires_grad_()
    sink = None if fwd_scale is None else torch.zeros(2, requires_grad=True)
    y, amax = float8_training_linear(x, w, b, fwd_scale, bwd_scale, sink, recipe=recipe)
    g = torch.randn_like(y)
    y.backward(g)
    return y, x.grad, w.grad, b.grad, g, amax, sink


def _data():
    torch.manual_seed(0)
    return torch.randn(2, 48, 256), torch.randn(128, 256) * 0.05, torch.randn(128)


def test_row_scaling_casts_each_operand_along_its_reduction_dim():
    x, w, b = _data()
    recipe = Float8Recipe(scaling="current", granularity="row", fp8_format="E4M3")
    y, gx, gw, gb, g, _, _ = _run(recipe, x, w, b)
    x2, g2 = x.reshape(-1, 256), g.reshape(-1, 128)

    def per_row(t):  # the inference reference: one scale per row, along the last dim
        q, s = ref.quantize_fp8_per_token(t)
        return q.float() * s

    torch.testing.assert_close(y.reshape(-1, 128), per_row(x2) @ per_row(w).t() + b)
    torch.testing.assert_close(gx.reshape(-1, 256), per_row(g2) @ per_row(w.t()).t())
    torch.testing.assert_close(gw, per_row(g2.t()) @ per_row(x2.t()).t())
    torch.testing.assert_close(gb, g2.sum(0))


@pytest.mark.parametrize("fmt", ["HYBRID", "E4M3"])
def test_delayed_scaling_linear_uses_the_given_scales_and_reports_amaxes(fmt):
    x, w, b = _data()
    recipe = Float8Recipe(scaling="delayed", fp8_format=fmt)
    fs, bs = torch.tensor([64.0, 2048.0, 1.0]), torch.tensor([2.0**20, 1.0])
    y, gx, gw, _, g, amax, sink = _run(recipe, x, w, b, fwd_scale=fs, bwd_scale=bs)
    x2, g2 = x.reshape(-1, 256), g.reshape(-1, 128)
    gdt = E5M2 if fmt == "HYBRID" else E4M3
    xq, wq = cast_delayed(x2, fs[0], E4M3), cast_delayed(w, fs[1], E4M3)
    gq = cast_delayed(g2, bs[0], gdt)
    torch.testing.assert_close(y.reshape(-1, 128), xq @ wq.t() + b)
    torch.testing.assert_close(gx.reshape(-1, 256), gq @ wq)
    torch.testing.assert_close(gw, gq.t() @ xq)
    assert amax.tolist() == pytest.approx([x.abs().max().item(), w.abs().max().item(), 0.0])
    assert sink.grad.tolist() == pytest.approx([g.abs().max().item(), 0.0])


@pytest.mark.parametrize("scaling", ["mxfp8", "block"])
def test_block_recipes_cast_along_each_reduction_dim(scaling):
    x, w, b = _data()
    recipe = Float8Recipe(scaling=scaling)
    y, gx, gw, _, g, _, _ = _run(recipe, x, w, b)
    x2, g2 = x.reshape(-1, 256), g.reshape(-1, 128)
    if scaling == "mxfp8":

        def act(t, dt, dim):
            return cast_mx(t, dt, dim=dim)

        w_fwd, w_bwd = cast_mx(w, E4M3, dim=1), cast_mx(w, E4M3, dim=0)
    else:

        def act(t, dt, dim):
            return cast_blocks(t, dt, dim=dim, block=128)

        w_fwd = w_bwd = cast_tiles(w, E4M3, block=128)
    torch.testing.assert_close(y.reshape(-1, 128), act(x2, E4M3, 1) @ w_fwd.t() + b)
    torch.testing.assert_close(gx.reshape(-1, 256), act(g2, E5M2, 1) @ w_bwd)
    torch.testing.assert_close(gw, act(g2, E5M2, 0).t() @ act(x2, E4M3, 0))


def test_override_linear_precision_runs_the_flagged_gemms_in_high_precision():
    x, w, b = _data()
    with pytest.warns(UserWarning, match="only ever honoured the wgrad"):
        recipe = Float8Recipe(scaling="current", override_linear_precision=(True, False, True))
    y, gx, gw, _, g, _, _ = _run(recipe, x, w, b)
    torch.testing.assert_close(y, torch.nn.functional.linear(x, w, b))
    x2, g2 = x.reshape(-1, 256), g.reshape(-1, 128)
    torch.testing.assert_close(gw, g2.t() @ x2)
    gq = cast_current(g2, E5M2, dim=None)
    torch.testing.assert_close(gx.reshape(-1, 256), gq @ cast_current(w, E4M3, dim=None))


def _graph_dtypes(recipe):
    """The fp8 dtypes the traced forward and backward graphs convert to."""
    graphs = {}

    def keep(name):
        def compiler(gm, _):
            graphs[name] = str(gm.graph)
            return make_boxed_func(gm)

        return compiler

    x, w, b = _data()
    f = aot_function(
        lambda x, w, b: float8_training_linear(x, w, b, None, None, None, recipe=recipe)[0],
        fw_compiler=keep("fw"),
        bw_compiler=keep("bw"),
    )
    f(x.requires_grad_(), w.requires_grad_(), b.requires_grad_()).sum().backward()
    return {k: {d for d in ("float8_e4m3fn", "float8_e5m2") if d in v} for k, v in graphs.items()}


def test_hybrid_backward_gemms_consume_e5m2_gradients():
    assert _graph_dtypes(Float8Recipe(scaling="current")) == {
        "fw": {"float8_e4m3fn"},
        "bw": {"float8_e4m3fn", "float8_e5m2"},
    }
    assert _graph_dtypes(Float8Recipe(scaling="current", fp8_format="E4M3")) == {
        "fw": {"float8_e4m3fn"},
        "bw": {"float8_e4m3fn"},
    }


def test_recipe_rejects_bad_values_with_reasons():
    with pytest.raises(ValueError, match="E5M2.*Transformer Engine rejects"):
        Float8Recipe(fp8_format="E5M2")
    with pytest.raises(ValueError, match="granularity='row' only with scaling='current'"):
        Float8Recipe(granularity="row")
    with pytest.raises(ValueError, match=r"amax_history_len=0.*>= 1"):
        Float8Recipe(amax_history_len=0)
    with pytest.raises(ValueError, match="three bools"):
        Float8Recipe(override_linear_precision=(True, False))
    with pytest.warns(UserWarning, match="interval=4 is ignored"):
        Float8Recipe(interval=4)
    r = Float8Recipe(scaling="mxfp8")
    assert r.unsupported_reason(out_features=64, in_features=48) == (
        "in_features=48 not divisible by 32 (mxfp8 blocks)"
    )
    r = Float8Recipe(pad_inner_dim=False)
    assert "not divisible by 16" in r.unsupported_reason(out_features=20, in_features=64)
    assert Float8Recipe().unsupported_reason(out_features=20, in_features=100) is None
    assert Float8Recipe().padded_in_features(100) == 112


def test_recipe_and_static_scheme_round_trip_through_config_json():
    from fxquant.core.config import Float8Static, QuantConfig

    cfg = QuantConfig(
        scheme=Float8Recipe(scaling="current", granularity="row", margin=1),
        overrides={"x": Float8Recipe(override_linear_precision=(False, False, True))},
    )
    assert QuantConfig.from_json(cfg.to_json()) == cfg
    cfg = QuantConfig(scheme=Float8Static(activation_scale=0.25))
    assert QuantConfig.from_json(cfg.to_json()) == cfg
    with pytest.raises(ValueError, match="module_filter applies to Float8Recipe"):
        QuantConfig(scheme=Float8Static(activation_scale=1.0), module_filter=lambda m, n: True)
    with pytest.raises(ValueError, match="activation_scale=0"):
        Float8Static(activation_scale=0)


# --------------------------------------------------------------------------------------------
# The real FP8 GEMMs (torch._scaled_mm) against the emulated ones
# --------------------------------------------------------------------------------------------

_SCALED = [
    Float8Recipe(scaling="delayed", fp8_format="HYBRID"),
    Float8Recipe(scaling="current", granularity="tensor", fp8_format="HYBRID"),
    Float8Recipe(scaling="current", granularity="row", fp8_format="E4M3"),
]


@pytest.mark.parametrize("recipe", _SCALED, ids=lambda r: f"{r.scaling}-{r.granularity}")
def test_scaled_mm_gemms_equal_the_emulated_ones_up_to_summation_order(recipe, monkeypatch):
    # One step's output and gradients: the same fp8 values and scales go into both paths; the
    # emulated GEMM multiplies dequantized values (two fp32 roundings per product) and sums in
    # another order, so they differ by fp32 rounding only: bound 2e-6 of the largest magnitude.
    from fxquant.training import numerics

    assert numerics.gemm_kind(recipe) == "_scaled_mm"
    x, w, b = _data()
    delayed = recipe.scaling == "delayed"
    scales = dict(fwd_scale=torch.tensor([2.0, 40.0, 1.0]), bwd_scale=torch.tensor([8.0, 1.0]))
    torch.manual_seed(1)  # the same upstream gradient for both
    got = _run(recipe, x, w, b, **(scales if delayed else {}))
    monkeypatch.setattr(numerics, "gemm_kind", lambda r: "emulated")
    torch.manual_seed(1)
    want = _run(recipe, x, w, b, **(scales if delayed else {}))
    for name, a, e in zip(("y", "grad_x", "grad_w", "grad_b"), got[:4], want[:4], strict=True):
        bound = 2e-6 * e.abs().max().item()
        assert (a - e).abs().max().item() <= bound, name


@pytest.mark.parametrize("rowwise", [False, True], ids=["tensorwise", "rowwise"])
@pytest.mark.parametrize("b_dtype", [E4M3, torch.float8_e5m2], ids=["e4m3", "e5m2"])
def test_scaled_gemm_without_onednn_equals_scaled_mm(rowwise, b_dtype, monkeypatch):
    # Where torch would send the GEMM to oneDNN's reference fp8 matmul (AMX CPUs), scaled_gemm
    # computes torch's own CPU fallback: the same product as torch._scaled_mm up to fp32
    # summation order (bound 2e-6 of the largest magnitude, as above).
    from fxquant.training import numerics

    if rowwise and not numerics.cpu_scaled_mm_takes_row_scales():
        pytest.skip(f"torch {torch.__version__}'s CPU _scaled_mm takes no row-wise scales")
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(40, 96, generator=g) * 30).to(E4M3)
    b = (torch.randn(48, 96, generator=g) * 30).to(b_dtype)
    sa = torch.rand(40, 1, generator=g) + 0.5 if rowwise else torch.tensor(0.75)
    sb = torch.rand(48, 1, generator=g) + 0.5 if rowwise else torch.tensor(1.25)
    want = torch._scaled_mm(
        a, b.t(), scale_a=sa, scale_b=sb.t() if rowwise else sb, out_dtype=torch.float32
    )
    monkeypatch.setattr(numerics, "onednn_fp8_is_reference", lambda *dtypes: True)
    got = numerics.scaled_gemm(a, sa, b, sb)
    assert (got - want).abs().max().item() <= 2e-6 * want.abs().max().item()


def test_onednn_fp8_is_reference_follows_torchs_routing(monkeypatch):
    from fxquant.training import numerics

    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: True)
    monkeypatch.setattr(torch.cpu, "_is_amx_fp16_supported", lambda: False)
    available = torch.backends.mkldnn.is_available()
    assert numerics.onednn_fp8_is_reference(E4M3, E4M3) == available
    assert not numerics.onednn_fp8_is_reference(torch.float8_e5m2, E4M3)  # no AMX-fp16
    monkeypatch.setattr(torch.backends.mkldnn, "is_available", lambda: False)
    assert not numerics.onednn_fp8_is_reference(E4M3, E4M3)


@pytest.mark.parametrize("recipe", _SCALED, ids=lambda r: f"{r.scaling}-{r.granularity}")
def test_scaled_mm_saves_x_for_the_backward_in_fp8(recipe):
    x, w, b = _data()
    x, w = x.requires_grad_(), w.requires_grad_()
    delayed = recipe.scaling == "delayed"
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y, _ = float8_training_linear(
            x,
            w,
            b,
            torch.tensor([2.0, 40.0, 1.0]) if delayed else None,
            torch.tensor([8.0, 1.0]) if delayed else None,
            torch.zeros(2, requires_grad=True) if delayed else None,
            recipe=recipe,
        )
    big = [t for t in saved if t.numel() == x.numel()]
    assert [t.dtype for t in big] == [E4M3]  # x's copy: one byte a value, no fp32 copy of x
    y.sum().backward()
    assert x.grad is not None and w.grad is not None


def test_without_cpu_row_scales_scaled_gemm_computes_the_fallback_and_says_so(monkeypatch):
    # torch 2.11's CPU _scaled_mm refuses row-wise scales: scaled_gemm computes torch's CPU
    # fallback there (never calling _scaled_mm), and the report row says so
    from fxquant.training import numerics

    monkeypatch.setattr(numerics, "cpu_scaled_mm_takes_row_scales", lambda: False)
    monkeypatch.setattr(numerics, "onednn_fp8_is_reference", lambda *dtypes: False)
    refused = []
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: refused.append(1))
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(8, 32, generator=g) * 30).to(E4M3)
    b = (torch.randn(16, 32, generator=g) * 30).to(E4M3)
    sa, sb = torch.rand(8, 1, generator=g) + 0.5, torch.rand(16, 1, generator=g) + 0.5
    got = numerics.scaled_gemm(a, sa, b, sb)
    assert not refused
    torch.testing.assert_close(got, (a.float() * sa) @ (b.float() * sb).t())
    note = numerics.scaled_gemm_note(
        Float8Recipe(scaling="current", granularity="row"), torch.device("cpu")
    )
    assert "takes no row-wise scales" in note
    assert numerics.scaled_gemm_note(Float8Recipe(scaling="current"), torch.device("cpu")) is None
