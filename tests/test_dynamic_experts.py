"""Mixture-of-experts weights of the schemes that quantize the activation at run time: ``w8a8``
(int8 per channel, x per token), ``fp8-row`` (FbgemmFp8Config's Llama 4 experts) and
``fp8-block`` (FineGrainedFP8Config's ``FP8Experts``), and of ``fp8wo`` (e4m3 per channel, x in
float, int8wo's kernels on e4m3 bytes): reference, ops, the CPU lowering (the
native kernel and the aten gather), the rewrite of grouped_mm (Qwen2-MoE) and bmm (Llama 4)
experts, from_hf, the FP8 checkpoint loaders, and the AOT package.

The reference's oracle is the linear's own reference, row by row with the row's expert weight:
x is quantized per token (or in 1×b groups of a token), so a row's values do not depend on the
rows beside it. The model-level oracle is the quantized program run by those references. The
Triton kernels: tests/test_kernels_scaled_grouped.py, tests/test_kernels_float8_block_grouped.py.
"""

from __future__ import annotations

import dataclasses
import importlib
import warnings

import pytest
import torch
from torch.library import opcheck

transformers = pytest.importorskip("transformers")
importlib.import_module("transformers.integrations.moe")  # registers grouped_mm_fallback

from test_bmm_experts import llama4  # noqa: E402
from test_int8_experts import IDS, VOCAB, check_moe_package, logits, qwen2_moe  # noqa: E402

import fxquant  # noqa: E402
import fxquant.kernels.cpu as native  # noqa: E402
from conftest import assert_sums_close  # noqa: E402
from fxquant.checkpoints import CheckpointError, read_quantized  # noqa: E402
from fxquant.core import reference as ref  # noqa: E402
from fxquant.core.config import EXPERT_WEIGHTS  # noqa: E402
from fxquant.core.reference import sqnr  # noqa: E402
from fxquant.core.registry import lowering_table  # noqa: E402
from fxquant.passes.cpu.experts import EXPERT_KERNELS, fp8_bf16_experts  # noqa: E402
from fxquant.passes.lower import lower, lowerings  # noqa: E402

fxq = torch.ops.fxquant
UB = 1200.0  # FbgemmFp8Config's activation_scale_ub
# SchemaCheckMode compares tensors with allclose, which has no CPU float8 kernel: the fp8 ops run
# every other opcheck test (as in tests/test_ops.py)
NO_SCHEMA_TEST = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
DEFAULT_UTILS = torch.library._OPCHECK_DEFAULT_UTILS
ROW = fxquant.Float8Dynamic(granularity="row", activation_scale_ub=UB)
# (rows, each expert's cumulative row end): an empty expert, rows past the last end (zeros)
LAYOUTS = [(1, [0, 1, 1, 1]), (9, [2, 2, 7, 8]), (70, [10, 40, 40, 60])]


def _weights(e=4, n=72, k=200, seed=0):
    return torch.randn(e, n, k, generator=torch.Generator().manual_seed(seed))


def _x(s, k=200, seed=1, zero_rows=(1, 2)):
    x = torch.randn(s, k, generator=torch.Generator().manual_seed(seed)) * 3
    x[[r for r in zero_rows if r < s]] = 0  # Llama 4's unchosen experts: rows of zeros
    return x


def _quantized(scheme, w):
    q = scheme.quantize(w).tensors
    return q["qweight"], q["scale"]


def _op(scheme):
    """(the scheme's experts op, its last arguments)."""
    if isinstance(scheme, fxquant.Float8Block):
        return fxq.float8_block_grouped_mm.default, (scheme.block_size,)
    if isinstance(scheme, fxquant.Int8DynamicActivation):
        return fxq.int8_dynamic_grouped_mm.default, ()
    if isinstance(scheme, fxquant.Float8WeightOnly):
        return fxq.float8_weight_only_grouped_mm.default, ()
    return fxq.float8_dynamic_grouped_mm.default, (UB,)


def _run(scheme, x, q, s, offs):
    op, params = _op(scheme)
    return op(x, q, s, offs, *params)


def _row_by_row(scheme, x, q, s, offs):
    """Each row through the linear's reference with its expert's weight; zeros past the end."""
    out = torch.zeros(x.shape[0], q.shape[1])
    start = 0
    for e, end in enumerate(offs.tolist()):
        for r in range(start, end):
            if isinstance(scheme, fxquant.Float8Block):
                y = ref.float8_block_linear(x[r : r + 1], q[e], s[e], block_size=scheme.block_size)
            elif isinstance(scheme, fxquant.Int8DynamicActivation):
                y = ref.int8_dynamic_linear(x[r : r + 1], q[e], s[e])
            elif isinstance(scheme, fxquant.Float8WeightOnly):
                y = ref.float8_weight_only_linear(x[r : r + 1], q[e], s[e])
            else:
                y = ref.float8_dynamic_linear(
                    x[r : r + 1], q[e], s[e], per_row=True, activation_scale_ub=UB
                )  # fmt: skip
            out[r] = y[0]
        start = max(start, end)
    return out


W8A8 = fxquant.Int8DynamicActivation()
FP8WO = fxquant.Float8WeightOnly()
SCHEMES = [
    W8A8,
    FP8WO,
    ROW,
    fxquant.Float8Block(block_size=32),
    fxquant.Float8Block(block_size=128),
]
SCHEME_IDS = ["w8a8", "fp8wo", "fp8-row", "fp8-block32", "fp8-block128"]


@pytest.mark.parametrize("scheme", SCHEMES, ids=SCHEME_IDS)
def test_the_ops_are_the_linears_reference_row_by_row(scheme):
    w = _weights()
    q, s = _quantized(scheme, w)
    assert q.dtype in (torch.int8, torch.float8_e4m3fn) and q.shape == w.shape
    for rows, ends in LAYOUTS:
        x, offs = _x(rows), torch.tensor(ends)
        got = _run(scheme, x, q, s, offs)
        assert_sums_close(got, _row_by_row(scheme, x, q, s, offs))
        assert (got[ends[-1] :] == 0).all() and not got.isnan().any()
    zero_w = _quantized(scheme, torch.zeros(4, 72, 200))
    zeros = _run(scheme, torch.zeros(5, 200), *zero_w, torch.tensor([1, 2, 3, 5]))
    assert (zeros == 0).all()  # all-zero weights and activations: zeros, never NaN
    op, params = _op(scheme)
    utils = DEFAULT_UTILS if q.dtype == torch.int8 else NO_SCHEMA_TEST
    opcheck(op, (_x(9), q, s, torch.tensor([2, 2, 7, 8]), *params), test_utils=utils)


def test_experts_quantize_as_each_expert_would_as_a_linear():
    w = _weights()
    q, s = _quantized(ROW, w)
    q1, s1 = ref.quantize_fp8_per_channel(w[2])
    assert torch.equal(q[2].view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s[2], s1)
    block = fxquant.Float8Block(block_size=64)
    q, s = _quantized(block, w)
    q1, s1 = ref.quantize_fp8_blocks(w[3], block_size=64)
    assert s.shape == (4, 2, 4)  # ceil(72 / 64), ceil(200 / 64)
    assert torch.equal(q[3].view(torch.uint8), q1.view(torch.uint8)) and torch.equal(s[3], s1)


@pytest.mark.parametrize("scheme", SCHEMES, ids=SCHEME_IDS)
def test_the_cpu_lowerings_match_the_reference(scheme):
    """The native kernel (where it builds; int32 sums for w8a8, bf16 dot products for fp8 where
    this CPU class's table runs the fp8 linear on them: exact for e4m3 activations, x rounded to
    bf16 for fp8wo's) and the aten gather, on the same rows."""
    w = _weights()
    q, s = _quantized(scheme, w)
    op, params = _op(scheme)
    rounds_x = native.available() and fp8_bf16_experts()
    for rows, ends in LAYOUTS:
        x, offs = _x(rows), torch.tensor(ends)
        want = _run(scheme, x, q, s, offs)
        for lowering in (lowerings("cpu")[op], lowering_table("cpu")[op]):  # native, aten
            got = lowering(x, q, s, offs.int(), *params)
            if scheme == FP8WO and lowering is not lowering_table("cpu")[op] and rounds_x:
                # x rounded to bf16 from 2 rows an expert, as the fp8wo linear's bf16-dot path
                assert_sums_close(got, want, rel=1e-2)
            else:
                assert_sums_close(got, want)
        xb = x.bfloat16()  # quantized from its bf16 values; one rounding of the result to bf16
        for lowering in (lowerings("cpu")[op], lowering_table("cpu")[op]):
            got = lowering(xb, q, s, offs, *params)
            assert got.dtype == torch.bfloat16
            torch.testing.assert_close(got, _run(scheme, xb, q, s, offs), rtol=1e-2, atol=1e-2)


@pytest.mark.skipif(not native.available(), reason="fxquant's native kernels")
def test_the_native_ops_pass_opcheck_and_skip_rows_of_zeros():
    # experts 0 and 1 hold rows of zeros between live ones (gathered), expert 3 live rows only
    w = _weights()
    q, s = _quantized(ROW, w)
    x, offs = _x(70, zero_rows=range(12, 38)), torch.tensor([10, 40, 40, 60])
    for bf16_x in (0, 1):
        args = (x, q, s, offs, UB, bf16_x)
        opcheck(fxq.native_float8_dynamic_grouped_mm.default, args, test_utils=NO_SCHEMA_TEST)
        got = fxq.native_float8_dynamic_grouped_mm(*args)
        assert_sums_close(got, _run(ROW, x, q, s, offs))
    block = fxquant.Float8Block(block_size=64)
    qb, sb = _quantized(block, w)
    args = (x, qb, sb, offs, 64)
    opcheck(fxq.native_float8_block_grouped_mm.default, args, test_utils=NO_SCHEMA_TEST)
    got = fxq.native_float8_block_grouped_mm(x, qb, sb, offs, 64)
    assert_sums_close(got, _run(block, x, qb, sb, offs))
    with pytest.raises(RuntimeError, match="native_float8_block_grouped_mm"):
        fxq.native_float8_block_grouped_mm(x, qb, sb[:, :1], offs, 64)  # the wrong scale shape
    for bf16_x in (0, 1):  # fp8wo: int8wo's kernel on e4m3 bytes
        args = (x, q, s, offs, bf16_x)
        opcheck(fxq.native_float8_weight_only_grouped_mm.default, args, test_utils=NO_SCHEMA_TEST)
        got = fxq.native_float8_weight_only_grouped_mm(*args)
        # bf16_x: every expert here has 2 or more live rows, all rounded to bf16 (exact products)
        assert_sums_close(got, _run(FP8WO, x.bfloat16().float() if bf16_x else x, q, s, offs))
    q8, s8 = _quantized(W8A8, w)
    opcheck(fxq.native_int8_dynamic_grouped_mm.default, (x, q8, s8, offs))
    got = fxq.native_int8_dynamic_grouped_mm(x, q8, s8, offs)  # int32 sums: the reference's
    torch.testing.assert_close(got, _run(W8A8, x, q8, s8, offs), rtol=1e-6, atol=1e-5)


# --------------------------------------------------------------------------------------------
# The rewrite: Qwen2-MoE's grouped_mm experts, Llama 4's bmm experts
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def moe():
    model = qwen2_moe()
    return model, torch.export.export(model, (IDS,), kwargs={"use_cache": False})


@pytest.mark.parametrize(
    ("recipe", "name"),
    [
        ("w8a8", "int8_dynamic"),
        ("fp8wo", "float8_weight_only"),
        ("fp8-row", "float8_dynamic"),
        ("fp8-block", "float8_block"),
    ],
)
def test_dynamic_recipes_quantize_the_experts(moe, recipe, name):
    model, ep = moe
    qep = fxquant.quantize(ep, recipe)
    rep = fxquant.report(qep)
    rows = {r["name"]: r for r in rep.rows}
    for layer in range(2):
        for p in ("gate_up_proj", "down_proj"):
            row = rows[f"model.layers.{layer}.mlp.experts.{p}"]
            assert row["status"] == "quantized" and row["kind"] == "grouped_mm", row
            assert row["experts"] == 4 and row["sqnr_db"] > 25
    targets = {str(n.target) for n in qep.graph.nodes if n.op == "call_function"}
    assert f"fxquant.{name}_grouped_mm.default" in targets
    assert "transformers.grouped_mm_fallback.default" not in targets
    (experts,) = [k for k in rep.cpu_kernels() if k["scheme"].endswith(" experts")]
    assert len(experts["layers"]) == 4
    if native.available():
        assert experts["kernel"] == EXPERT_KERNELS[name][1]
    got = logits(qep.module())
    assert sqnr(logits(model), got) > 20
    assert sqnr(got, logits(lower(qep).module())) > 40


def test_llama4_bmm_experts_take_fbgemm_fp8_as_transformers_quantizes_them():
    """FbgemmFp8Config quantizes Llama 4's experts (FbgemmFp8Llama4TextExperts: per-channel
    e4m3, x per token with its amax capped): from_hf maps them to fp8-row experts."""
    model = llama4()
    ep = torch.export.export(model, (IDS,), kwargs={"use_cache": False})
    config = fxquant.from_hf({"quant_method": "fbgemm_fp8", "activation_scale_ub": UB})
    qep = fxquant.quantize(ep, config)
    rows = {r.name: r for r in fxquant.report(qep).quantized}
    experts = [n for n in rows if ".experts." in n]
    assert len(experts) == 4 and all(rows[n].kind == "bmm" for n in experts)
    assert all(rows[n].scheme == ROW.to_dict() for n in experts)
    targets = {str(n.target) for n in qep.graph.nodes if n.op == "call_function"}
    assert "fxquant.float8_dynamic_grouped_mm.default" in targets
    assert "aten.bmm.default" not in targets
    got = logits(qep.module())
    assert sqnr(logits(model), got) > 20
    assert sqnr(got, logits(lower(qep).module())) > 40


def test_hugging_face_fp8_configs_take_the_experts_transformers_takes(moe):
    """FineGrainedFP8Config quantizes every model's experts (FP8Experts); FbgemmFp8Config only
    Llama 4's, so Qwen2-MoE's stay float under it, as in transformers."""
    _, ep = moe
    expert = "model.layers.0.mlp.experts.gate_up_proj"
    fine = fxquant.from_hf({"quant_method": "fp8", "weight_block_size": [32, 32]})
    rows = {r["name"]: r for r in fxquant.report(fxquant.quantize(ep, fine)).rows}
    assert rows[expert]["status"] == "quantized"
    assert rows[expert]["scheme"] == fxquant.Float8Block(block_size=32).to_dict()
    fbgemm = fxquant.from_hf({"quant_method": "fbgemm_fp8"})
    rows = {r["name"]: r for r in fxquant.report(fxquant.quantize(ep, fbgemm)).rows}
    assert rows[expert]["status"] == "skipped"
    assert rows["model.layers.0.mlp.shared_expert.up_proj"]["status"] == "quantized"
    assert EXPERT_WEIGHTS in fbgemm.overrides and fbgemm.overrides[EXPERT_WEIGHTS] is None


INT8_HF = {"quant_method": "torchao", "quant_type": "int8_weight_only"}


@pytest.mark.parametrize("hf", [{"quant_method": "fbgemm_fp8"}, INT8_HF])
def test_hugging_face_configs_warn_of_no_expert_pattern_on_a_dense_model(hf):
    """The expert patterns a mapping adds for every model (FAMILY_PATTERNS) name layers a dense
    model does not have: not a typo, so not warned of (a user's own unmatched pattern is)."""
    config = transformers.LlamaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
        num_attention_heads=2, num_key_value_heads=1,
    )  # fmt: skip
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    ep = torch.export.export(model, (IDS,), kwargs={"use_cache": False})
    mapped = fxquant.from_hf(hf)
    assert EXPERT_WEIGHTS in mapped.overrides
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fxquant.quantize(ep, mapped)
    typo = dataclasses.replace(mapped, overrides={**mapped.overrides, "mlp.up_prj": None})
    with pytest.warns(UserWarning, match="match no layer of this model: overrides: 'mlp.up_prj'"):
        fxquant.quantize(ep, typo)


def test_per_tensor_fp8_still_skips_the_experts_and_says_which_take_them(moe):
    _, ep = moe
    qep = fxquant.quantize(ep, "fp8-tensor")
    row = {r["name"]: r for r in fxquant.report(qep).rows}["model.layers.0.mlp.experts.down_proj"]
    assert row["status"] == "skipped"
    assert "Float8WeightOnly, Float8Dynamic(granularity='row'), Float8Block" in row["reason"]


@pytest.mark.slow
@pytest.mark.skipif(not native.available(), reason="the package's native grouped shims")
def test_the_aot_package_runs_the_dynamic_experts(tmp_path):
    """One package, the three experts shims (prefill and decode steps of a cached program)."""
    config = fxquant.QuantConfig(scheme=ROW, overrides={
        r"layers\.0\.mlp\.experts\.down_proj": W8A8,
        r"layers\.1\.mlp\.experts\.\w+": fxquant.Float8Block(block_size=32),
    })  # fmt: skip
    ops = ("int8_dynamic", "float8_dynamic", "float8_block")
    check_moe_package(config, ops, tmp_path, (slice(0, 6), slice(6, 7)))  # prefill, a decode step


# --------------------------------------------------------------------------------------------
# Pre-quantized FineGrainedFP8 checkpoints: each expert stored as linears, stacked as loaded
# --------------------------------------------------------------------------------------------

FP8_QCFG = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [32, 32]}


def _fp8_checkpoint(model, b=32):
    """``model``'s tensors as a FineGrainedFP8 checkpoint of a transformers 4 layout (Qwen3-FP8,
    DeepSeek-V3): every linear but the routers in b×b tiles, each expert as three linears."""
    tensors = {}
    for name, t in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if module.endswith("mlp.experts"):  # [E, 2I, H] / [E, H, I] → per expert
            half = t.shape[1] // 2
            for i, w in enumerate(t):
                parts = {"gate_proj": w[:half], "up_proj": w[half:]} if leaf == "gate_up_proj" \
                    else {"down_proj": w}  # fmt: skip
                for proj, pw in parts.items():
                    q, s = ref.quantize_fp8_blocks(pw, block_size=b)
                    tensors[f"{module}.{i}.{proj}.weight"] = q
                    tensors[f"{module}.{i}.{proj}.weight_scale_inv"] = s
        elif leaf == "weight" and t.dim() == 2 and "proj" in module and "embed" not in module:
            q, s = ref.quantize_fp8_blocks(t, block_size=b)
            tensors[name], tensors[f"{module}.weight_scale_inv"] = q, s
        else:
            tensors[name] = t
    return tensors


def test_a_fine_grained_fp8_checkpoint_loads_its_experts_stacked(moe):
    """Loaded into the float skeleton, the checkpoint's program equals the float model quantized
    by from_hf of the same config (the same tiles), experts included."""
    model, ep = moe
    tensors = _fp8_checkpoint(model)
    assert "model.layers.0.mlp.experts.3.up_proj.weight_scale_inv" in tensors
    loaded = fxquant.load_quantized(ep, tensors, quantization_config=FP8_QCFG)
    rows = {r["name"]: r for r in fxquant.report(loaded).rows}
    row = rows["model.layers.1.mlp.experts.gate_up_proj"]
    assert row["status"] == "quantized" and row["experts"] == 4 and row["weights"] == "given"
    config = fxquant.QuantConfig(
        scheme=fxquant.Float8Block(block_size=32),
        modules_to_not_convert=("lm_head", "gate", "shared_expert_gate"),
    )
    want = logits(fxquant.quantize(ep, config).module())
    torch.testing.assert_close(logits(loaded.module()), want, rtol=0, atol=0)


def test_fp8_experts_that_cannot_stack_are_refused_by_name(moe):
    model, ep = moe
    tensors = _fp8_checkpoint(model)
    gone = {k: v for k, v in tensors.items() if ".experts.2.down_proj." not in k}
    read_quantized(gone, quantization_config=FP8_QCFG)  # linears: the model decides
    with pytest.raises(CheckpointError, match=r"experts\.2: no quantized down_proj"):
        fxquant.load_quantized(ep, gone, quantization_config=FP8_QCFG)
    # moe_intermediate_size 32 is one tile of 32, half a tile of 64
    wide = _fp8_checkpoint(model, b=64)
    with pytest.raises(CheckpointError, match="intermediate size 32 is not a multiple of the 64"):
        qcfg = {**FP8_QCFG, "weight_block_size": [64, 64]}
        fxquant.load_quantized(ep, wide, quantization_config=qcfg)


def _fbgemm_checkpoint(model):
    """``model``'s tensors as transformers' FbgemmFp8Quantize writes them (Llama-4-Maverick-FP8's
    layout): per-channel e4m3 linears with ``weight_scale`` [N, 1], and Llama 4's experts in the
    model's [E, K, N] with a scale per output channel of each expert."""
    tensors = {}
    for name, t in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        if module.endswith("feed_forward.experts"):
            q, s = ref.quantize_fp8_per_channel(t.transpose(1, 2))  # [E, N, K] rows
            tensors[name] = q.transpose(1, 2)
            # gate_up's scale [E, 1, N], down's [E, N, 1]
            tensors[f"{name}_scale"] = s[:, None] if leaf == "gate_up_proj" else s[..., None]
        elif leaf == "weight" and t.dim() == 2 and module.rsplit(".", 1)[-1].endswith("_proj"):
            q, s = ref.quantize_fp8_per_channel(t)
            tensors[name], tensors[f"{module}.weight_scale"] = q, s[:, None]
        else:
            tensors[name] = t
    return tensors


def test_an_fbgemm_fp8_checkpoint_loads_llama4_experts_as_its_bmm_reads_them():
    """Meta's FP8 Llama 4 layout, loaded into the float skeleton: the program equals the float
    model quantized with from_hf(FbgemmFp8Config) (the same per-channel values), experts
    included."""
    model = llama4()
    ep = torch.export.export(model, (IDS,), kwargs={"use_cache": False})
    tensors = _fbgemm_checkpoint(model)
    qcfg = {"quant_method": "fbgemm_fp8", "activation_scale_ub": UB}
    loaded = fxquant.load_quantized(ep, tensors, quantization_config=qcfg)
    rows = {r["name"]: r for r in fxquant.report(loaded).rows}
    row = rows["model.layers.1.feed_forward.experts.down_proj"]
    assert row["status"] == "quantized" and row["kind"] == "bmm" and row["weights"] == "given"
    config = fxquant.QuantConfig(
        scheme=ROW,
        overrides={r"feed_forward\.router": None},
        modules_to_not_convert=("lm_head",),
    )
    want = logits(fxquant.quantize(ep, config).module())
    torch.testing.assert_close(logits(loaded.module()), want, rtol=0, atol=0)
    bad = {**tensors, "model.layers.0.feed_forward.experts.down_proj_scale": torch.ones(4, 1, 1)}
    with pytest.raises(CheckpointError, match=r"down_proj_scale' has shape \[4, 1, 1\]"):
        read_quantized(bad, quantization_config=qcfg)
