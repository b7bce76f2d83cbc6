"""AutoRound (``fxquant.calibrate(method=AutoRound(...))``): the quantizer against auto-round's
formulas, the block-wise tuning on the conftest TinyLlama (it beats round-to-nearest, stores
exactly what it tuned, reports each layer), and what it refuses."""

from __future__ import annotations

import pytest
import torch

import fxquant
from fxquant.calibration.api import calibrate, calibration_pass
from fxquant.calibration.autoround import RoundingParams, block_of, qdq
from fxquant.calibration.methods import GPTQ, AutoRound
from fxquant.core import reference as ref
from fxquant.core.config import Int4WeightOnly, QuantConfig

INT4 = Int4WeightOnly(group_size=32, symmetric=False)
FAST = AutoRound(iters=20, batch_size=4)


def test_block_of_reads_the_numbered_block():
    assert block_of("model.layers.3.self_attn.q_proj") == "model.layers.3"
    assert block_of("layers.0.mlp.down_proj") == "layers.0"
    assert block_of("transformer.h.11.attn.c_attn") == "transformer.h.11"
    assert block_of("lm_head") is None


def test_at_its_start_the_asymmetric_grid_is_round_to_nearest():
    torch.manual_seed(0)
    w = torch.randn(16, 128)
    p = RoundingParams.init(16, 128, 32)
    dq, u, s, z = qdq(w, p, symmetric=False)
    packed, s_ref, z_ref = ref.quantize_int4_grouped(w, group_size=32, symmetric=False)
    assert torch.equal(ref.pack_int4(u.reshape(16, -1).to(torch.uint8)), packed)
    assert torch.equal(s, s_ref) and torch.equal(z.to(torch.uint8), z_ref)


def test_the_symmetric_grid_is_auto_rounds_full_signed_range():
    w = torch.tensor([[1.0, -0.5] * 16, [-1.0, 0.5] * 16])  # hi larger, then lo larger
    dq, u, s, z = qdq(w, RoundingParams.init(2, 32, 32), symmetric=True)
    # the larger extreme maps to -8: s = -1/8 when it is the maximum, +1/8 when the minimum
    assert s.flatten().tolist() == [-0.125, 0.125] and (z == 8).all()
    assert u[0, 0, 0] == 0 and u[1, 0, 0] == 0  # q = -8 for both extremes
    assert torch.equal(dq, w)


def test_the_offsets_move_the_rounding_and_the_factors_clip_the_range():
    w = torch.linspace(-1, 1, 32).reshape(1, 32)
    p = RoundingParams.init(1, 32, 32)
    base = qdq(w, p, symmetric=False)[1]
    p.v[0, 0, 3] = 0.49  # less than half a step: rounding may go either way; one step: always
    p.v[0, 0, 5] = 1.0
    moved = qdq(w, p, symmetric=False)[1]
    assert moved[0, 0, 5] == base[0, 0, 5] + 1
    p.hi.fill_(0.5)
    _, _, s, _ = qdq(w, p, symmetric=False)
    assert torch.allclose(s, torch.tensor([[1.5 / 15]]))


def _error(fn, model, evals) -> float:
    with torch.no_grad():
        return sum(float((fn(x) - model(x)).pow(2).mean()) for x in evals)


@pytest.mark.parametrize("symmetric", [False, True])
def test_autoround_beats_rtn_and_leaves_the_model_alone(llama, symmetric):
    model, ep, data, evals = llama
    scheme = Int4WeightOnly(group_size=32, symmetric=symmetric)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    qep = calibrate(model, scheme, data, method=FAST, progress=False)
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    rows = fxquant.report(qep).quantized
    assert len(rows) == 14  # 7 linears × 2 blocks; the tied lm_head stays float
    for r in rows:
        cal = r["calibration"]
        assert r["weights"] == "given" and cal["status"] == "calibrated", r
        assert cal["block"] == ".".join(r["name"].split(".")[:2])  # layers.<i>
        assert cal["block_mse"] <= cal["block_mse_rtn"]
    assert {r["calibration"]["block"] for r in rows} == {"layers.0", "layers.1"}
    rtn = fxquant.quantize(ep, scheme)
    assert _error(qep.module(), model, evals) < 0.9 * _error(rtn.module(), model, evals)


def test_autoround_stores_exactly_what_it_tuned(llama):
    _, ep, data, _ = llama
    result = calibration_pass(ep, INT4, [(d,) for d in data], method=FAST)
    assert len(result.weights) == 14
    for fqn, qw in result.weights.items():
        t = qw.tensors
        dq = ref.dequantize_int4_grouped(t["qweight"], t["scale"], t["zero"], group_size=32)
        assert torch.equal(dq[:, : qw.dequantized.shape[1]], qw.dequantized), fqn
    rec = next(iter(result.records.values()))
    assert rec["iters"] == 20 and rec["samples"] == 8 and rec["best_iter"] >= 0


def test_what_autoround_leaves_to_round_to_nearest_is_reported(llama):
    _, ep, data, _ = llama
    config = QuantConfig(
        scheme=INT4, overrides={r"layers\.1\.(gate|up|down)_proj": fxquant.Int8WeightOnly()}
    )
    result = calibration_pass(ep, config, [(d,) for d in data], method=FAST)
    skipped = {k for k, r in result.records.items() if r["status"] == "skipped"}
    assert skipped == {f"layers.1.{p}.weight" for p in ("gate_proj", "up_proj", "down_proj")}
    assert "Int8WeightOnly" in result.records["layers.1.up_proj.weight"]["reason"]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: AutoRound(iters=0), "AutoRound.iters=0"),
        (lambda: AutoRound(lr=-1.0), "AutoRound.lr=-1.0"),
        (lambda: AutoRound(enable_quanted_input="yes"), "enable_quanted_input"),
    ],
)
def test_bad_autoround_configs_raise(make, match):
    with pytest.raises(ValueError, match=match):
        make()


def test_autoround_must_come_last(llama):
    model, _, data, _ = llama
    with pytest.raises(ValueError, match="GPTQ and AutoRound must come last"):
        calibrate(model, INT4, data, method=(FAST, GPTQ()), progress=False)
