"""int4 mixture-of-experts weights (``int4wo-<g>``, ``w4a8-<g>``): quantization of [E, N, K]
experts, the reference ops, the CPU lowerings (the native kernel with its three row paths, the
aten gather), the rewrite of exported MoE models and the AOTInductor package.

The oracles are transformers' ``grouped_mm`` fallback op on the dequantized weights (weight-only),
the int4 linears' references per expert (W4A8), and the float model with each expert weight
replaced by its dequantized int4 values. The Triton kernel: tests/test_kernels_int4_grouped.py;
what int8 experts share (calibration, the checkpoint writer, from_hf, float experts):
tests/test_int8_experts.py.
"""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

transformers = pytest.importorskip("transformers")

from test_int8_experts import (  # noqa: E402
    EXPERT_PARAMS,
    IDS,
    LIVE_ROWS_BF16,
    NEEDS_NATIVE,
    ZERO_ROWS,
    ZERO_ROWS_ENDS,
    logits,
    qwen2_moe,
    rows_with_zeros,
)

import fxquant  # noqa: E402
import fxquant.kernels.cpu as native  # noqa: E402
from conftest import assert_sums_close  # noqa: E402
from fxquant.core import reference as ref  # noqa: E402
from fxquant.core.reference import sqnr  # noqa: E402
from fxquant.passes.lower import CPU_LOWERINGS, lower, lowerings  # noqa: E402

fxq = torch.ops.fxquant
OPS = {"int4wo": fxq.int4_weight_only_grouped_mm, "w4a8": fxq.int8_dynamic_int4_grouped_mm}
LINEARS = {"int4wo": ref.int4_weight_only_linear, "w4a8": ref.int8_dynamic_int4_linear}


def _experts(e=4, n=24, k=100, g=32, seed=1):
    """Packed int4 experts [E, N, Kp/2] with scales and zeros [E, N, Kp/g] (K = 100 pads to 128)."""
    w = torch.randn(e, n, k, generator=torch.Generator().manual_seed(seed))
    return fxquant.Int4WeightOnly(group_size=g).quantize(w)


def _args(q):
    return q.tensors["qweight"], q.tensors["scale"], q.tensors["zero"]


def _per_expert(kind, x, q, offs, g=32):
    """Each expert's rows through the int4 linear's reference on that expert's weight."""
    w, s, z = _args(q)
    out, start = torch.zeros(x.shape[0], w.shape[1], dtype=x.dtype), 0
    for e, end in enumerate(offs.tolist()):
        out[start:end] = LINEARS[kind](x[start:end], w[e], s[e], z[e], group_size=g)
        start = max(start, end)
    return out


# --------------------------------------------------------------------------------------------
# Quantization, reference, ops, aten lowering
# --------------------------------------------------------------------------------------------


def test_experts_quantize_as_each_experts_linear_weight():
    w = torch.randn(3, 8, 100)
    scheme = fxquant.Int4WeightOnly(group_size=32)
    q = scheme.quantize(w)
    assert q.tensors["qweight"].shape == (3, 8, 64) and q.tensors["scale"].shape == (3, 8, 4)
    assert q.dequantized.shape == (3, 8, 100)
    for e in range(3):  # each expert exactly as a linear's [N, K] weight, K padded the same way
        qe = scheme.quantize(w[e])
        assert all(torch.equal(qe.tensors[k], q.tensors[k][e]) for k in qe.tensors)
        assert torch.equal(qe.dequantized, q.dequantized[e])


@pytest.mark.parametrize("kind", ["int4wo", "w4a8"])
@pytest.mark.parametrize("offs", [[3, 3, 7, 10], [0, 5, 5, 8], [4, 9, 15, 15]])
def test_reference_and_aten_lowering_are_the_int4_linear_per_expert(offs, kind):
    q = _experts()
    x = torch.randn(10, 100)
    offs_t = torch.tensor(offs, dtype=torch.int32)
    got = OPS[kind](x, *_args(q), offs_t, 32)
    torch.testing.assert_close(got, _per_expert(kind, x, q, offs_t), rtol=1e-5, atol=1e-5)
    assert (got[min(offs[-1], 10) :] == 0).all()  # rows past offs[-1]
    if kind == "int4wo":  # transformers' fallback on the dequantized weight [E, K, N]
        w_ekn = q.dequantized.transpose(-2, -1).contiguous()
        want = torch.ops.transformers.grouped_mm_fallback(x, w_ekn, offs_t)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    lowered = CPU_LOWERINGS[OPS[kind].default]  # each row gathers its expert
    assert_sums_close(lowered(x, *_args(q), offs_t, 32), got)


@pytest.mark.parametrize("kind", ["int4wo", "w4a8"])
def test_ops_pass_opcheck_and_zero_weights_give_zeros(kind):
    q = _experts(e=3, n=8, k=64)
    offs = torch.tensor([2, 5, 7])
    x = torch.randn(7, 64)
    opcheck(OPS[kind].default, (x, *_args(q), offs, 32))
    zero = fxquant.Int4WeightOnly(group_size=32).quantize(torch.zeros(3, 8, 64))
    y = OPS[kind](x, *_args(zero), offs, 32)
    assert torch.isfinite(y).all() and y.abs().max() == 0


# --------------------------------------------------------------------------------------------
# The native kernel
# --------------------------------------------------------------------------------------------

# row counts per expert around the GEMV / GEMM thresholds, an empty expert, rows past offs[-1]
NATIVE_ROWS = [[0, 1, 5, 16], [17, 33, 0, 65]]


def _prepacked(q, g=32):
    from fxquant.passes.cpu.experts import _native_prepack_int4_experts

    node = type("Node", (), {"target": fxq.int4_weight_only_grouped_mm.default})()
    w, s, z = _args(q)
    consts = {"weight": w, "scale": s, "zero": z}
    args = {"x": None, "offs": None, "group_size": g}
    _, (_, (_, wp), (_, sp), (_, op), *_rest) = _native_prepack_int4_experts(node, args, consts)
    return wp, sp, op


def _rows_of_experts_with(ends, at_least):
    starts = torch.cat([torch.zeros(1, dtype=ends.dtype), ends[:-1]])
    counts = torch.repeat_interleave(ends - starts, ends - starts)  # each row's expert's count
    return counts >= at_least


@NEEDS_NATIVE
@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("counts", NATIVE_ROWS)
def test_the_native_kernel_runs_each_experts_rows_on_the_int4_linears_paths(counts):
    q = _experts(e=4, n=40, k=256, g=64)
    wp, sp, op = _prepacked(q, 64)
    ends = torch.tensor(counts).cumsum(0)
    s = int(ends[-1]) + 2  # two rows no expert owns
    x = torch.randn(s, 256)

    def run(bf16_from, int8_from):
        return fxq.native_int4_grouped_mm(x, wp, sp, op, ends, 64, bf16_from, int8_from)

    fp32 = ref.int4_weight_only_grouped_mm(x, *_args(q), ends, group_size=64)
    w4a8 = ref.int8_dynamic_int4_grouped_mm(x, *_args(q), ends, group_size=64)
    assert_sums_close(run(0, 0), fp32)
    assert (run(0, 0)[int(ends[-1]) :] == 0).all()
    assert_sums_close(run(0, 1), w4a8)  # W4A8 experts: every row quantized per token
    # int8 from 6 rows an expert: those experts' rows are W4A8's, the others fp32's
    mixed = torch.where(_rows_of_experts_with(ends, 6)[:, None], w4a8[: s - 2], fp32[: s - 2])
    assert_sums_close(run(0, 6)[: s - 2], mixed)
    # bf16 from 2 rows: those rows' x rounded to bf16 (the bf16-dot path), one row fp32 x
    xr = torch.where(
        _rows_of_experts_with(ends, 2)[:, None], x[: s - 2].bfloat16().float(), x[: s - 2]
    )
    want = ref.int4_weight_only_grouped_mm(xr, *_args(q), ends, group_size=64)
    assert sqnr(want, run(2, 0)[: s - 2]) > 45  # the dequantized weight is rounded to bf16 too


@NEEDS_NATIVE
@pytest.mark.usefixtures("two_threads")
def test_the_native_kernel_skips_rows_of_zeros_and_runs_the_rest_by_their_count():
    """As the int8 experts' kernel (tests/test_int8_experts.py): rows of zeros give zeros without
    running, the other rows take the paths of their own count (W4A8's per-token int8 from 2 rows
    here, fp32 for expert 0's one remaining row)."""
    q = _experts(e=5, n=40, k=256, g=64)
    wp, sp, op = _prepacked(q, 64)
    x = rows_with_zeros(256)
    ends = ZERO_ROWS_ENDS

    def run(bf16_from, int8_from):
        return fxq.native_int4_grouped_mm(x, wp, sp, op, ends, 64, bf16_from, int8_from)

    fp32 = ref.int4_weight_only_grouped_mm(x, *_args(q), ends, group_size=64)
    w4a8 = ref.int8_dynamic_int4_grouped_mm(x, *_args(q), ends, group_size=64)
    assert_sums_close(run(0, 0), fp32)
    assert_sums_close(run(0, 1), w4a8)
    mixed = fp32.clone()
    mixed[LIVE_ROWS_BF16] = w4a8[LIVE_ROWS_BF16]
    assert_sums_close(run(0, 2), mixed)
    assert (run(0, 2)[ZERO_ROWS] == 0).all()


@NEEDS_NATIVE
def test_the_native_op_passes_opcheck_and_refuses_what_it_cannot_read():
    q = _experts(e=3, n=8, k=64)
    wp, sp, op = _prepacked(q)
    offs = torch.tensor([2, 5, 7])
    x = torch.randn(7, 64)
    for paths in ((0, 0), (2, 0), (0, 1)):
        opcheck(fxq.native_int4_grouped_mm.default, (x, wp, sp, op, offs, 32, *paths))
    bad = [
        (x, wp, sp, op, offs.int(), 32, 0, 0),  # int64 offsets only
        (x[:, :32], wp, sp, op, offs, 32, 0, 0),  # K the weight does not pack
        (x, wp, sp, op[:, :, :1], offs, 32, 0, 0),  # offsets of another group count
        (x, wp, sp, op, offs, 48, 0, 0),  # not a multiple of 32
    ]
    for args in bad:
        with pytest.raises(RuntimeError, match="outside the kernel's contract"):
            fxq.native_int4_grouped_mm(*args)


@NEEDS_NATIVE
@pytest.mark.parametrize("kind", ["int4wo", "w4a8"])
def test_the_lowering_takes_the_int4_linears_paths_of_this_machine(kind):
    from fxquant.passes.cpu.experts import int4_row_paths

    q = _experts(e=4, n=40, k=100)
    wp, sp, op = _prepacked(q)
    ends = torch.tensor([0, 1, 5, 16]).cumsum(0)
    x = torch.randn(int(ends[-1]), 100)
    device_op = {
        "int4wo": fxq.cpu_native_int4_grouped_mm,
        "w4a8": fxq.cpu_native_int8_int4_grouped_mm,
    }
    got = lowerings("cpu")[device_op[kind].default](x, wp, sp, op, ends, 32)
    paths = int4_row_paths() if kind == "int4wo" else (0, 1)
    xp = torch.nn.functional.pad(x, (0, 28))  # K padded to the stored 128 columns
    torch.testing.assert_close(got, fxq.native_int4_grouped_mm(xp, wp, sp, op, ends, 32, *paths))
    assert sqnr(OPS[kind](x, *_args(q), ends, 32), got) > 30


# --------------------------------------------------------------------------------------------
# Exported MoE models
# --------------------------------------------------------------------------------------------


def fake_quantized(model, g):
    """The float model with each expert weight replaced by its dequantized int4 values."""
    scheme = fxquant.Int4WeightOnly(group_size=g)
    for layer in model.model.layers:
        experts = layer.mlp.experts
        for name in EXPERT_PARAMS:
            p = getattr(experts, name)
            w = p.data.transpose(-2, -1) if experts.is_transposed else p.data  # as [E, N, K]
            dq = scheme.quantize(w).dequantized
            p.data = (dq.transpose(-2, -1) if experts.is_transposed else dq).contiguous()
    return model


@pytest.fixture(scope="module")
def moe():
    model = qwen2_moe()
    return model, torch.export.export(model, (IDS,), kwargs={"use_cache": False})


@pytest.mark.parametrize("recipe", ["int4wo-32", "w4a8-32"])
def test_int4_recipes_quantize_the_experts(moe, recipe):
    model, ep = moe
    qep = fxquant.quantize(ep, recipe)
    rows = {r["name"]: r for r in fxquant.report(qep).rows}
    for layer in range(2):
        for name in EXPERT_PARAMS:
            row = rows[f"model.layers.{layer}.mlp.experts.{name}"]
            assert row["status"] == "quantized" and row["experts"] == 4, row
            assert row["bytes_after"] < row["bytes_before"] / 6
    kernels = {k["scheme"]: k for k in fxquant.report(qep).cpu_kernels()}
    (experts,) = [k for name, k in kernels.items() if name.endswith(" experts")]
    assert len(experts["layers"]) == 4
    if native.available():
        assert "native int4 grouped kernel" in experts["kernel"]
    op = {"int4wo-32": "int4_weight_only", "w4a8-32": "int8_dynamic_int4"}[recipe]
    targets = {str(n.target) for n in qep.graph.nodes if n.op == "call_function"}
    assert f"fxquant.{op}_grouped_mm.default" in targets
    got = logits(qep.module())
    assert sqnr(got, logits(lower(qep).module())) > 30
    assert sqnr(logits(model), got) > 15


def test_experts_only_config_matches_the_fake_quantized_model(moe):
    _, ep = moe
    config = fxquant.QuantConfig(
        overrides={r"experts\.(gate_up_proj|down_proj)": fxquant.Int4WeightOnly(group_size=32)}
    )
    qep = fxquant.quantize(ep, config)
    want = logits(fake_quantized(qwen2_moe(), 32))
    torch.testing.assert_close(logits(qep.module()), want, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "hf",
    [
        {"quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": False, "sym": True},
        {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm", "zero_point": True},
    ],
)
def test_hugging_face_int4_configs_keep_the_experts_float_as_transformers_does(moe, hf):
    _, ep = moe
    config, _ = fxquant.calibration_from_hf(hf)  # the int4 QuantConfig of GPTQ / AWQ
    rows = {r["name"]: r for r in fxquant.report(fxquant.quantize(ep, config)).rows}
    assert rows["model.layers.0.mlp.experts.gate_up_proj"]["status"] == "skipped"
    assert rows["model.layers.0.mlp.shared_expert.up_proj"]["status"] == "quantized"


def test_calibration_quantizes_int4_experts_to_nearest_and_says_so(moe):
    from fxquant.evaluate import export_causal_lm

    samples = [torch.randint(0, 96, (1, 12)) for _ in range(2)]
    qep = fxquant.calibrate(export_causal_lm(moe[0]), "int4wo-32", samples, method=fxquant.GPTQ(),
                            progress=False)  # fmt: skip
    row = {r["name"]: r for r in fxquant.report(qep).rows}[
        "model.model.layers.0.mlp.experts.down_proj"
    ]
    assert row["status"] == "quantized"
    assert "not calibrated; quantized by round-to-nearest" in row["calibration"]["reason"]
