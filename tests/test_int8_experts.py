"""int8 weight-only mixture-of-experts weights: reference, op, rewrite, CPU lowering (the native
kernel and the aten gather), calibration, the checkpoint writer, from_hf, the lowering of experts
kept in float, and the cached LLM program of a MoE model (Qwen2-MoE, Mixtral) and its package.

The oracles are transformers' own: its ``grouped_mm`` fallback op (what the experts run in an
exported graph) on the dequantized weights, and the float model with each expert weight replaced
by its dequantized int8 values. The Triton kernel: tests/test_kernels_int8_grouped.py.
"""

from __future__ import annotations

import importlib
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.library import opcheck

transformers = pytest.importorskip("transformers")
# registers transformers::grouped_mm_fallback
importlib.import_module("transformers.integrations.moe")

import fxquant  # noqa: E402
import fxquant.kernels.cpu as native  # noqa: E402
from conftest import assert_sums_close  # noqa: E402
from fxquant.core import reference as ref  # noqa: E402
from fxquant.core.reference import sqnr  # noqa: E402
from fxquant.core.registry import lowering_table  # noqa: E402
from fxquant.llm import export_llm  # noqa: E402
from fxquant.passes.eager import reference_math  # noqa: E402
from fxquant.passes.lower import CPU_LOWERINGS, lower, lowerings  # noqa: E402

fxq = torch.ops.fxquant
NATIVE_LOWERING = lowerings("cpu")[fxq.int8_weight_only_grouped_mm.default]
VOCAB = 96
IDS = torch.randint(0, VOCAB, (1, 12), generator=torch.Generator().manual_seed(3))
EXPERT_PARAMS = ("gate_up_proj", "down_proj")
EXPERTS_ONLY = fxquant.QuantConfig(
    overrides={r"experts\.(gate_up_proj|down_proj)": fxquant.Int8WeightOnly()}
)


def qwen2_moe(seed: int = 0):
    """Routed experts stored [E, N, K] (read through their transpose) and a shared expert."""
    config = transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
        moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
        num_experts_per_tok=2,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def fake_quantized(model):
    """The float model with each expert weight replaced by its dequantized int8 values."""
    for layer in model.model.layers:
        experts = layer.mlp.experts
        for name in EXPERT_PARAMS:
            p = getattr(experts, name)
            w = p.data.transpose(-2, -1) if experts.is_transposed else p.data  # as [E, N, K]
            dq = ref.dequantize_int8_per_channel(*ref.quantize_int8_per_channel(w))
            p.data = (dq.transpose(-2, -1) if experts.is_transposed else dq).contiguous()
    return model


def logits(fn, ids=IDS) -> torch.Tensor:
    # a bridged model's ops on their reference math, as an exported program runs them (its
    # eager kernels are tests/test_bridge_eager.py's)
    with torch.no_grad(), reference_math():
        out = fn(ids, use_cache=False)
    return out.logits if hasattr(out, "logits") else out


def _experts(e=4, n=24, k=96, seed=1):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(e, n, k, generator=g)
    return ref.quantize_int8_per_channel(w)


# --------------------------------------------------------------------------------------------
# Reference, op and CPU lowering
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("offs", [[3, 3, 7, 10], [0, 5, 5, 8], [10, 10, 10, 10], [4, 9, 15, 15]])
def test_reference_and_cpu_lowering_are_transformers_grouped_mm_on_the_dequantized_weight(
    offs, dtype
):
    q, scale = _experts()
    x = torch.randn(10, 96).to(dtype)
    offs_t = torch.tensor(offs, dtype=torch.int32)
    w_ekn = ref.dequantize_int8_per_channel(q, scale).transpose(-2, -1).contiguous()
    want = torch.ops.transformers.grouped_mm_fallback(x.float(), w_ekn, offs_t).to(dtype)
    got = ref.int8_weight_only_grouped_mm(x, q, scale, offs_t)
    tol = 1e-5 if dtype == torch.float32 else 1.6e-2  # bf16: one rounding of the same fp32 sum
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert got.dtype == dtype and (got[min(offs[-1], 10) :] == 0).all()  # rows past offs[-1]
    # the aten lowering (each row gathers its expert) is the same function, compiled too
    lowered = CPU_LOWERINGS[fxq.int8_weight_only_grouped_mm.default]
    torch.testing.assert_close(lowered(x, q, scale, offs_t), got, rtol=tol, atol=tol)


def test_the_compiled_cpu_lowering_takes_any_number_of_rows():
    q, scale = _experts(e=6, n=40, k=64)
    lowered = torch.compile(CPU_LOWERINGS[fxq.int8_weight_only_grouped_mm.default], dynamic=True)
    for s in (1, 3, 37):
        ids = torch.randint(0, 6, (s,)).sort().values
        offs = torch.bincount(ids, minlength=6).cumsum(0)
        x = torch.randn(s, 64)
        want = ref.int8_weight_only_grouped_mm(x, q, scale, offs)
        torch.testing.assert_close(lowered(x, q, scale, offs), want, rtol=1e-5, atol=1e-5)


def test_op_passes_opcheck_and_zero_weights_give_zeros():
    q, scale = _experts(e=3, n=8, k=64)
    offs = torch.tensor([2, 5, 7], dtype=torch.int64)
    x = torch.randn(7, 64)
    opcheck(fxq.int8_weight_only_grouped_mm.default, (x, q, scale, offs))
    zq, zs = ref.quantize_int8_per_channel(torch.zeros(3, 8, 64))
    assert torch.isfinite(zs).all() and (zq == 0).all()
    y = fxq.int8_weight_only_grouped_mm(x, zq, zs, offs)
    assert not y.isnan().any() and y.abs().max() == 0


def test_experts_quantize_per_channel_of_each_expert():
    w = torch.randn(3, 8, 64)
    q, scale = ref.quantize_int8_per_channel(w)
    assert q.shape == (3, 8, 64) and scale.shape == (3, 8)
    for e in range(3):  # each expert exactly as a linear's [N, K] weight
        qe, se = ref.quantize_int8_per_channel(w[e])
        assert torch.equal(qe, q[e]) and torch.equal(se, scale[e])


# row counts per expert around the native kernel's GEMV / chunked-GEMM threshold, an empty
# expert, rows past offs[-1] and an end past S
NEEDS_NATIVE = pytest.mark.skipif(
    not native.available(), reason=f"no native kernels: {native.unavailable_reason()}"
)
NATIVE_ROWS = [[0, 1, 5, 16], [17, 33, 0, 65], [3, 3, 3, 3]]


def _native(x, q, scale, offs, bf16_x):
    return fxq.native_int8_weight_only_grouped_mm(x, q, scale, offs.long(), bf16_x)


def _bf16_rows(x):
    """x as the bf16-dot GEMM reads it: each of an expert's rows rounded to bf16."""
    return x.bfloat16().float()


@NEEDS_NATIVE
@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("counts", NATIVE_ROWS)
def test_the_native_kernel_runs_each_experts_rows_on_the_linears_paths(counts):
    q, scale = _experts(e=4, n=40, k=200)
    ends = torch.tensor(counts).cumsum(0)
    s = int(ends[-1]) + 2  # two rows no expert owns
    x = torch.randn(s, 200)
    want = ref.int8_weight_only_grouped_mm(x, q, scale, ends)
    got = _native(x, q, scale, ends, False)  # fp32 x: the reference's products
    assert_sums_close(got, want)
    assert (got[int(ends[-1]) :] == 0).all()
    past = ends.clone()
    past[-1] = s + 5  # an end past S: the reference slices to S, the kernel clips to it
    assert_sums_close(
        _native(x, q, scale, past, False), ref.int8_weight_only_grouped_mm(x, q, scale, past)
    )
    # bf16_x: an expert's rows from 2 on are rounded to bf16 (on the bf16-dot GEMM where the CPU
    # has AVX-512 BF16, else on the fp32 paths), a single row stays fp32
    bf16 = _native(x, q, scale, ends, True)
    starts = torch.cat([torch.zeros(1, dtype=ends.dtype), ends[:-1]])
    rows = torch.repeat_interleave(ends - starts, ends - starts)  # each row's expert's row count
    xr = torch.where((rows >= 2)[:, None], _bf16_rows(x[: len(rows)]), x[: len(rows)])
    xr = torch.cat([xr, x[len(rows) :]])
    assert_sums_close(bf16, ref.int8_weight_only_grouped_mm(xr, q, scale, ends))


# Rows of zeros among the experts' rows, as Llama 4's experts see them (every token through every
# expert, 0 where the token did not choose it; tests/test_bmm_experts.py): expert 0 keeps one of
# its 3 rows, expert 1 has none, expert 2 keeps rows 4, 6 and 8 of 6 (gathered), expert 3
# keeps rows 10 and 11 of 4 (one run), expert 4 none of its 2
ZERO_ROWS_ENDS = torch.tensor([3, 3, 9, 13, 15])
ZERO_ROWS = [1, 2, 3, 5, 7, 9, 12, 13, 14]
LIVE_ROWS_BF16 = [4, 6, 8, 10, 11]  # the rows of experts that keep 2 or more: bf16 x there


def rows_with_zeros(k: int) -> torch.Tensor:
    x = torch.randn(int(ZERO_ROWS_ENDS[-1]), k, generator=torch.Generator().manual_seed(5))
    x[ZERO_ROWS] = 0.0
    x[3, ::2] = -0.0  # -0 is a zero too
    return x


@NEEDS_NATIVE
@pytest.mark.usefixtures("two_threads")
def test_the_native_kernel_skips_rows_of_zeros_and_runs_the_rest_by_their_count():
    """A row of zeros gives zeros (its product with the finite int8 weight) without running, and
    an expert's other rows take the path of their own count: expert 0's one row the fp32 GEMV
    (its 3 rows would take the bf16-dot GEMM), the others the bf16-dot GEMM."""
    q, scale = _experts(e=5, n=40, k=200)
    x = rows_with_zeros(200)
    got = _native(x, q, scale, ZERO_ROWS_ENDS, True)
    xr = x.clone()
    xr[LIVE_ROWS_BF16] = _bf16_rows(x[LIVE_ROWS_BF16])
    assert_sums_close(got, ref.int8_weight_only_grouped_mm(xr, q, scale, ZERO_ROWS_ENDS))
    assert (got[ZERO_ROWS] == 0).all()
    assert_sums_close(  # fp32 x: the reference's products
        _native(x, q, scale, ZERO_ROWS_ENDS, False),
        ref.int8_weight_only_grouped_mm(x, q, scale, ZERO_ROWS_ENDS),
    )
    x[2, 7] = float("nan")  # not a row of zeros: it runs, NaN as the reference
    assert _native(x, q, scale, ZERO_ROWS_ENDS, False)[2].isnan().all()


@NEEDS_NATIVE
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_lowering_takes_the_int8_linears_kernels_of_this_machine(dtype):
    """The native lowering rounds x to bf16 where the dispatch table runs the int8 linear's large
    rows on its bf16-dot GEMM (bf16_experts), as that linear does; it computes the op."""
    from fxquant.passes.cpu.experts import bf16_experts

    q, scale = _experts(e=4, n=40, k=200)
    ends = torch.tensor([0, 1, 5, 16]).cumsum(0)
    x = torch.randn(int(ends[-1]), 200).to(dtype)
    got = NATIVE_LOWERING(x, q, scale, ends.int())
    assert got.dtype == dtype
    want = _native(x.float(), q, scale, ends, bf16_experts()).to(dtype)
    torch.testing.assert_close(got, want)
    assert sqnr(ref.int8_weight_only_grouped_mm(x, q, scale, ends).float(), got.float()) > 40


@NEEDS_NATIVE
def test_the_native_op_passes_opcheck_and_refuses_what_it_cannot_read():
    q, scale = _experts(e=3, n=8, k=64)
    offs = torch.tensor([2, 5, 7])
    x = torch.randn(7, 64)
    for bf16_x in (0, 1):
        opcheck(fxq.native_int8_weight_only_grouped_mm.default, (x, q, scale, offs, bf16_x))
    with pytest.raises(RuntimeError, match="outside the kernel's contract"):
        fxq.native_int8_weight_only_grouped_mm(x, q, scale, offs.int(), 0)  # int64 offsets only
    with pytest.raises(RuntimeError, match="outside the kernel's contract"):
        fxq.native_int8_weight_only_grouped_mm(x[:, :32], q, scale, offs, 0)


@pytest.mark.usefixtures("two_threads")
@pytest.mark.parametrize("kn", [False, True])
@pytest.mark.parametrize("counts", [[0, 1, 8, 9], [40, 0, 2, 3]])
def test_float_experts_run_in_fxquant_compositions(counts, kn):
    """Experts a config leaves in float: ``fxquant::cpu_float_grouped_mm`` (native fp32 kernel,
    else the gather) computes transformers' fallback, in either stored layout."""
    e, n, k = 4, 24, 40
    w = torch.randn(e, k, n) if kn else torch.randn(e, n, k)  # kn: gpt-oss' [E, K, N]
    ends = torch.tensor(counts).cumsum(0)
    x = torch.randn(int(ends[-1]) + 1, k)
    want = torch.ops.transformers.grouped_mm_fallback(x, w if kn else w.mT.contiguous(), ends)
    op = fxq.cpu_float_grouped_mm.default
    for lowering in (lowerings("cpu")[op], lowering_table("cpu")[op]):  # native (or aten), aten
        assert_sums_close(lowering(x, w, ends, kn), want)
    if native.available():
        for skip in (0, 1):
            opcheck(fxq.native_float32_grouped_mm.default, (x, w, ends, int(kn), skip))


@NEEDS_NATIVE
@pytest.mark.usefixtures("two_threads")
def test_float_experts_skip_rows_of_zeros_only_when_asked():
    """skip_zero_rows (the rewrite asks where the weight is finite: Llama 4's experts): rows of
    zeros stay zeros without running, the rest by their count; without it every row runs, and a
    NaN weight gives the zero rows NaN, as transformers' own product does."""
    w = torch.randn(5, 40, 200)
    x = rows_with_zeros(200)
    want = torch.ops.transformers.grouped_mm_fallback(x, w.mT.contiguous(), ZERO_ROWS_ENDS)
    for skip in (0, 1):
        got = fxq.native_float32_grouped_mm(x, w, ZERO_ROWS_ENDS, 0, skip)
        assert_sums_close(got, want)
        assert (got[ZERO_ROWS] == 0).all()
    w[0, 3, 5] = float("nan")  # expert 0: rows 1 and 2 are zeros
    assert fxq.native_float32_grouped_mm(x, w, ZERO_ROWS_ENDS, 0, 0)[1:3, 3].isnan().all()
    assert (fxq.native_float32_grouped_mm(x, w, ZERO_ROWS_ENDS, 0, 1)[1:3] == 0).all()


def test_lowering_takes_float_experts_out_of_transformers_op(moe):
    """A program whose experts stay float (fp8-tensor skips them) lowers them to fxquant's ops:
    its package runs without transformers' Python op registered (the runtime never imports
    it)."""
    _, ep = moe
    qep = fxquant.quantize(ep, "fp8-tensor")
    lowered = lower(qep)
    targets = {str(n.target) for n in lowered.graph.nodes if n.op == "call_function"}
    assert not any(t.startswith("transformers.") for t in targets), targets
    assert sqnr(logits(qep.module()), logits(lowered.module())) > 40


# --------------------------------------------------------------------------------------------
# The rewrite on exported MoE models
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe():
    model = qwen2_moe()
    return model, torch.export.export(model, (IDS,), kwargs={"use_cache": False})


def test_int8wo_quantizes_the_experts(moe):
    model, ep = moe
    before = {k: v.clone() for k, v in ep.state_dict.items()}
    qep = fxquant.quantize(ep, "int8wo")
    rows = {r["name"]: r for r in fxquant.report(qep).rows}
    for layer in range(2):
        for name in EXPERT_PARAMS:
            row = rows[f"model.layers.{layer}.mlp.experts.{name}"]
            assert row["status"] == "quantized" and row["kind"] == "grouped_mm", row
            assert row["experts"] == 4 and row["sqnr_db"] > 40
            assert row["bytes_after"] < row["bytes_before"] / 3.5
    assert "4×64×32" in str(fxquant.report(qep))  # E×N×K of down_proj
    kernels = {k["scheme"]: k for k in fxquant.report(qep).cpu_kernels()}
    assert len(kernels["Int8WeightOnly() experts"]["layers"]) == 4
    if native.available():
        assert "native int8 grouped kernel" in kernels["Int8WeightOnly() experts"]["kernel"]
    targets = {str(n.target) for n in qep.graph.nodes if n.op == "call_function"}
    assert "fxquant.int8_weight_only_grouped_mm.default" in targets
    assert "transformers.grouped_mm_fallback.default" not in targets
    assert not any(k.endswith("experts.gate_up_proj") for k in qep.state_dict)  # float released
    got = logits(qep.module())
    # the lowered linears round x to bf16 (passes/cpu/int8.py); the experts' lowering is fp32
    assert sqnr(got, logits(lower(qep).module())) > 40
    assert sqnr(logits(model), got) > 30
    assert all(torch.equal(before[k], v) for k, v in ep.state_dict.items())  # caller untouched


def test_experts_only_config_matches_the_fake_quantized_model(moe):
    model, ep = moe
    config = EXPERTS_ONLY
    qep = fxquant.quantize(ep, config)
    quantized = [r["name"] for r in fxquant.report(qep).rows if r["status"] == "quantized"]
    assert len(quantized) == 4 and all(".experts." in n for n in quantized)
    want = logits(fake_quantized(qwen2_moe()))
    torch.testing.assert_close(logits(qep.module()), want, rtol=1e-5, atol=1e-5)


def test_hugging_face_configs_keep_the_experts_float_as_transformers_does(moe):
    """transformers' int8 quantizers (torchao, compressed-tensors W8A16 …) take nn.Linear only:
    from_hf of them computes what transformers would, the experts float."""
    _, ep = moe
    config = fxquant.from_hf({"quant_method": "torchao", "quant_type": "int8_weight_only"})
    rows = {r["name"]: r for r in fxquant.report(fxquant.quantize(ep, config)).rows}
    assert rows["model.layers.0.mlp.experts.gate_up_proj"]["status"] == "skipped"
    assert rows["model.layers.0.mlp.shared_expert.up_proj"]["status"] == "quantized"


def test_other_schemes_still_skip_the_experts_and_say_which_take_them(moe):
    _, ep = moe
    qep = fxquant.quantize(ep, "fp8-tensor")
    row = {r["name"]: r for r in fxquant.report(qep).rows}["model.layers.0.mlp.experts.down_proj"]
    assert row["status"] == "skipped"
    assert (
        "take only Int8WeightOnly, Int8DynamicActivation, Int4WeightOnly, "
        "Int8DynamicActivationInt4, Float8WeightOnly, Float8Dynamic(granularity='row'), "
        "Float8Block or MXFP4(activations=False), not Float8Dynamic" in row["reason"]
    )


def test_the_torch_compile_backend_quantizes_the_experts():
    model = qwen2_moe()
    config = EXPERTS_ONLY
    compiled = torch.compile(model, backend="fxquant", options={"config": config})
    want = logits(fake_quantized(qwen2_moe()))
    # the native lowering rounds x to bf16 from 2 rows an expert where the machine's table runs
    # the int8 linear that way (bf16_experts); fp32 elsewhere, to the sums' rounding
    from fxquant.passes.cpu.experts import bf16_experts

    tol = 1e-2 if native.available() and bf16_experts() else 1e-5
    torch.testing.assert_close(logits(compiled), want, rtol=tol, atol=tol)
    assert sqnr(want, logits(compiled)) > 40
    assert not torch.equal(logits(compiled), logits(model))  # the caller's model stays float


def test_calibration_quantizes_the_experts_to_nearest_and_says_so(moe):
    from fxquant.evaluate import export_causal_lm

    samples = [torch.randint(0, VOCAB, (1, 12)) for _ in range(2)]
    ep = export_causal_lm(moe[0])
    qep = fxquant.calibrate(ep, "int8wo", samples, method=fxquant.GPTQ(), progress=False)
    rows = {r["name"]: r for r in fxquant.report(qep).rows}
    row = rows["model.model.layers.0.mlp.experts.gate_up_proj"]  # export_causal_lm's names
    assert row["status"] == "quantized"
    assert "not calibrated; quantized by round-to-nearest" in row["calibration"]["reason"]
    assert rows["model.model.layers.0.self_attn.q_proj"]["calibration"]["status"] == "calibrated"


# --------------------------------------------------------------------------------------------
# The cached LLM program (export_llm) of MoE models
# --------------------------------------------------------------------------------------------


def mixtral(seed: int = 0):
    config = transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
        num_experts_per_tok=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(seed)
    return transformers.MixtralForCausalLM(config).eval()


@pytest.mark.parametrize("build", [qwen2_moe, mixtral])
def test_cached_int8wo_program_equals_the_uncached_fake_quantized_model(build):
    config = EXPERTS_ONLY
    qep = fxquant.quantize(export_llm(build(), max_cache_len=32, logits="all"), config)
    ids = torch.randint(0, VOCAB, (1, 12))
    m = qep.module()
    got = torch.cat(
        [m(ids[:, :5], torch.arange(5))]
        + [m(ids[:, i : i + 1], torch.tensor([i])) for i in range(5, 12)],
        dim=1,
    )
    want = logits(fake_quantized(build()), ids)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert sqnr(logits(build(), ids), got) > 30  # and close to the float model


@pytest.mark.slow
def test_a_float_moe_package_runs_where_transformers_is_not_imported(tmp_path):
    ep = export_llm(qwen2_moe(), max_cache_len=32)
    path = tmp_path / "moe_fp32.pt2"
    assert fxquant.aot_compile(ep, path, load=False) is None
    ids = torch.randint(0, VOCAB, (1, 6))
    want = ep.module()(ids, torch.arange(6))
    torch.save({"ids": ids, "want": want}, tmp_path / "io.pt")
    script = textwrap.dedent(
        f"""
        import sys, torch
        pkg = torch._inductor.aoti_load_package({str(path)!r})
        io = torch.load({str(tmp_path / "io.pt")!r})
        got = pkg(io["ids"], torch.arange(6))
        torch.testing.assert_close(got, io["want"], rtol=1e-4, atol=1e-4)
        loaded = [m for m in sys.modules if m.split(".")[0] in ("fxquant", "transformers")]
        assert not loaded, loaded
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]


@pytest.mark.slow
def test_the_aot_package_of_a_moe_model_runs_its_int8_and_int4_experts(tmp_path):
    # one package, each native grouped shim: int8 weight-only experts, int4 weight-only and W4A8
    # (tests/test_int4_experts.py), the linears int8 weight-only
    config = fxquant.QuantConfig(scheme=fxquant.Int8WeightOnly(), overrides={
        r"layers\.0\.mlp\.experts\.down_proj": fxquant.Int8DynamicActivationInt4(group_size=32),
        r"layers\.1\.mlp\.experts\.\w+": fxquant.Int4WeightOnly(group_size=32),
    })  # fmt: skip
    # the package's linears, and from 2 rows the int4 experts, round x to bf16 where this
    # machine's table runs them so (passes/cpu/int8.py, experts.py)
    ops = ("int8_weight_only", "int4_weight_only", "int8_dynamic_int4")
    check_moe_package(config, ops, tmp_path, (slice(0, 6), slice(6, 7), slice(7, 8)))


def check_moe_package(config, ops, tmp_path, steps) -> None:
    """A cached Qwen2-MoE program quantized by ``config``, with each of ``ops``' grouped op in
    it, packaged: the package's logits over each step (a prefill, then decode steps: slices of
    9 token ids) within 40 dB of the program's."""
    qep = fxquant.quantize(export_llm(qwen2_moe(), max_cache_len=32, logits="all"), config)
    targets = {str(n.target) for n in qep.graph.nodes if n.op == "call_function"}
    for op in ops:
        assert f"fxquant.{op}_grouped_mm.default" in targets
    package = fxquant.aot_compile(qep, tmp_path / "moe.pt2")
    ids = torch.randint(0, VOCAB, (1, 9))
    m = qep.module()
    for t in steps:
        pos = torch.arange(t.start, t.stop)
        assert sqnr(m(ids[:, t], pos), package(ids[:, t], pos)) > 40
