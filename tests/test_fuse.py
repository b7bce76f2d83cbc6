"""The norm → quantize fusion pass: what it matches and emits, what it leaves alone and why, and
that a fused program computes exactly what the unfused one does (fp32), reloaded and lowered."""

from __future__ import annotations

import expecttest
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

import fxquant
from conftest import RMSNorm, TinyLlama
from fxquant.core.reference import sqnr
from fxquant.passes.fuse import fuse_norms
from fxquant.passes.lower import lower
from fxquant.passes.rewrite import ProgramEditor, counters, rewrite

DYN = {0: Dim.DYNAMIC, 1: Dim.DYNAMIC}
FUSABLE = ["w8a8", "fp8-row", "fp8-block"]
SIZES = [(1, 1), (3, 5)]  # (batch, seq): both dims are dynamic in every program here


def _cfg(recipe: str, **kw) -> fxquant.QuantConfig:
    return fxquant.QuantConfig(scheme=fxquant.from_recipe_name(recipe), **kw)


def _ids(b: int, t: int, vocab: int = 96) -> torch.Tensor:
    return torch.randint(0, vocab, (b, t))


def _targets(ep) -> list[str]:
    return [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]


def _norms(ep) -> dict[str, dict]:
    return {n["name"]: n for n in fxquant.report(ep).norms}


@pytest.fixture(scope="module")
def llama_program():
    """The conftest TinyLlama (hand-written RMSNorm), 2 blocks, dynamic batch and sequence."""
    torch.manual_seed(0)
    return torch.export.export(TinyLlama().eval(), (_ids(2, 8),), dynamic_shapes=(DYN,))


@pytest.fixture(scope="module")
def hf_llama_program():
    """A tiny random Hugging Face LlamaForCausalLM (LlamaRMSNorm with its casts), 2 layers."""
    transformers = pytest.importorskip("transformers")
    from fxquant import evaluate

    cfg = transformers.LlamaConfig(
        vocab_size=96,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    with torch.no_grad():  # random norm weights, so that fusing them wrongly would show
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    return evaluate.export_causal_lm(model, vocab_size=96)


class NormHeads(nn.Module):
    """Each norm spelling feeding two linears: nn.LayerNorm, nn.RMSNorm (eps=None), F.layer_norm
    without affine parameters, and the hand-written RMSNorm."""

    def __init__(self, d: int = 64) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(d)
        self.rms = nn.RMSNorm(d)
        self.hand = RMSNorm(d)
        self.fc = nn.ModuleList(nn.Linear(d, d) for _ in range(8))
        with torch.no_grad():
            for norm in (self.ln, self.rms, self.hand):
                norm.weight.uniform_(0.5, 1.5)
            self.ln.bias.uniform_(-0.5, 0.5)

    def forward(self, x):
        ys = []
        for i, h in enumerate(
            [self.ln(x), self.rms(x), F.layer_norm(x, (x.shape[-1],)), self.hand(x)]
        ):
            ys += [self.fc[2 * i](h), self.fc[2 * i + 1](h)]
        return sum(ys)


def _norm_heads_program():
    torch.manual_seed(0)
    x = torch.randn(2, 5, 64) * 2
    return torch.export.export(NormHeads().eval(), (x,), dynamic_shapes=(DYN,))


class GoldenGraphs(expecttest.TestCase):
    def test_tiny_llama_w8a8(self):
        """q/k/v read one norm_quant, gate/up another; o/down quantize their own input; the final
        norm feeds lm_head, which stays in float, so it stays a norm."""
        torch.manual_seed(0)
        qep = fxquant.quantize(TinyLlama(layers=1).eval(), "w8a8", example_inputs=(_ids(2, 4),))
        self.assertExpectedInline(
            qep.graph_module.code.strip(),
            """\
def forward(self, p_embed_tokens_weight, p_layers_0_input_layernorm_weight, p_layers_0_post_attention_layernorm_weight, p_norm_weight, p_lm_head_weight, b_layers_0_q_proj_qweight, b_layers_0_q_proj_scale, b_layers_0_k_proj_qweight, b_layers_0_k_proj_scale, b_layers_0_v_proj_qweight, b_layers_0_v_proj_scale, b_layers_0_o_proj_qweight, b_layers_0_o_proj_scale, b_layers_0_gate_proj_qweight, b_layers_0_gate_proj_scale, b_layers_0_up_proj_qweight, b_layers_0_up_proj_scale, b_layers_0_down_proj_qweight, b_layers_0_down_proj_scale, ids):
    embedding = torch.ops.aten.embedding.default(p_lm_head_weight, ids);  ids = None
    norm_quant_default = torch.ops.fxquant.norm_quant.default(embedding, p_layers_0_input_layernorm_weight, None, 1e-06, True, torch.int8, -1, None);  p_layers_0_input_layernorm_weight = None
    getitem = norm_quant_default[0]
    getitem_1 = norm_quant_default[1];  norm_quant_default = None
    int8_scaled_linear_default = torch.ops.fxquant.int8_scaled_linear.default(getitem, getitem_1, b_layers_0_q_proj_qweight, b_layers_0_q_proj_scale, None, torch.float32);  b_layers_0_q_proj_qweight = b_layers_0_q_proj_scale = None
    int8_scaled_linear_default_1 = torch.ops.fxquant.int8_scaled_linear.default(getitem, getitem_1, b_layers_0_k_proj_qweight, b_layers_0_k_proj_scale, None, torch.float32);  b_layers_0_k_proj_qweight = b_layers_0_k_proj_scale = None
    int8_scaled_linear_default_2 = torch.ops.fxquant.int8_scaled_linear.default(getitem, getitem_1, b_layers_0_v_proj_qweight, b_layers_0_v_proj_scale, None, torch.float32);  getitem = getitem_1 = b_layers_0_v_proj_qweight = b_layers_0_v_proj_scale = None
    transpose = torch.ops.aten.transpose.int(int8_scaled_linear_default_1, -1, -2);  int8_scaled_linear_default_1 = None
    matmul = torch.ops.aten.matmul.default(int8_scaled_linear_default, transpose);  int8_scaled_linear_default = transpose = None
    div = torch.ops.aten.div.Tensor(matmul, 11.313708498984761);  matmul = None
    softmax = torch.ops.aten.softmax.int(div, -1);  div = None
    matmul_1 = torch.ops.aten.matmul.default(softmax, int8_scaled_linear_default_2);  softmax = int8_scaled_linear_default_2 = None
    int8_dynamic_linear_default_3 = torch.ops.fxquant.int8_dynamic_linear.default(matmul_1, b_layers_0_o_proj_qweight, b_layers_0_o_proj_scale, None);  matmul_1 = b_layers_0_o_proj_qweight = b_layers_0_o_proj_scale = None
    add_1 = torch.ops.aten.add.Tensor(embedding, int8_dynamic_linear_default_3);  embedding = int8_dynamic_linear_default_3 = None
    norm_quant_default_1 = torch.ops.fxquant.norm_quant.default(add_1, p_layers_0_post_attention_layernorm_weight, None, 1e-06, True, torch.int8, -1, None);  p_layers_0_post_attention_layernorm_weight = None
    getitem_2 = norm_quant_default_1[0]
    getitem_3 = norm_quant_default_1[1];  norm_quant_default_1 = None
    int8_scaled_linear_default_3 = torch.ops.fxquant.int8_scaled_linear.default(getitem_2, getitem_3, b_layers_0_gate_proj_qweight, b_layers_0_gate_proj_scale, None, torch.float32);  b_layers_0_gate_proj_qweight = b_layers_0_gate_proj_scale = None
    silu = torch.ops.aten.silu.default(int8_scaled_linear_default_3);  int8_scaled_linear_default_3 = None
    int8_scaled_linear_default_4 = torch.ops.fxquant.int8_scaled_linear.default(getitem_2, getitem_3, b_layers_0_up_proj_qweight, b_layers_0_up_proj_scale, None, torch.float32);  getitem_2 = getitem_3 = b_layers_0_up_proj_qweight = b_layers_0_up_proj_scale = None
    mul_4 = torch.ops.aten.mul.Tensor(silu, int8_scaled_linear_default_4);  silu = int8_scaled_linear_default_4 = None
    int8_dynamic_linear_default_6 = torch.ops.fxquant.int8_dynamic_linear.default(mul_4, b_layers_0_down_proj_qweight, b_layers_0_down_proj_scale, None);  mul_4 = b_layers_0_down_proj_qweight = b_layers_0_down_proj_scale = None
    add_3 = torch.ops.aten.add.Tensor(add_1, int8_dynamic_linear_default_6);  add_1 = int8_dynamic_linear_default_6 = None
    pow_3 = torch.ops.aten.pow.Tensor_Scalar(add_3, 2)
    mean_2 = torch.ops.aten.mean.dim(pow_3, [-1], True);  pow_3 = None
    add_4 = torch.ops.aten.add.Tensor(mean_2, 1e-06);  mean_2 = None
    rsqrt_2 = torch.ops.aten.rsqrt.default(add_4);  add_4 = None
    mul_5 = torch.ops.aten.mul.Tensor(add_3, rsqrt_2);  add_3 = rsqrt_2 = None
    mul_6 = torch.ops.aten.mul.Tensor(mul_5, p_norm_weight);  mul_5 = p_norm_weight = None
    linear_7 = torch.ops.aten.linear.default(mul_6, p_lm_head_weight);  mul_6 = p_lm_head_weight = None
    return (linear_7,)""",  # noqa: E501  (generated code, kept verbatim)
        )


@pytest.mark.parametrize("recipe", FUSABLE)
@pytest.mark.parametrize("program", ["llama_program", "hf_llama_program"])
def test_fused_program_equals_unfused_bit_for_bit(request, program, recipe):
    ep = request.getfixturevalue(program)
    code = ep.graph_module.code
    before = counters["fuse.norm_quant"]
    fused = fxquant.quantize(ep, recipe)
    unfused = fxquant.quantize(ep, _cfg(recipe, fuse_norms=False))
    assert counters["fuse.norm_quant"] - before == 4  # 2 blocks × (input, post-attention) norm
    assert ep.graph_module.code == code  # the caller's program is not touched
    targets = _targets(fused)
    assert targets.count("fxquant.norm_quant.default") == 4
    assert sum(t.endswith("_scaled_linear.default") for t in targets) == 10  # q k v gate up × 2
    assert targets.count("aten.rsqrt.default") == 1  # only the final norm, before lm_head
    norms = fxquant.report(fused).norms
    assert [n["status"] for n in norms] == ["fused"] * 4
    hf = program == "hf_llama_program"
    p, attn, mlp = ("model.model.", "self_attn.", "mlp.") if hf else ("", "", "")
    norm_of = {r["name"]: r.get("fused_norm") for r in fxquant.report(fused).rows}
    assert norm_of[f"{p}layers.1.{attn}k_proj"] == f"{p}layers.1.input_layernorm"
    assert norm_of[f"{p}layers.0.{mlp}up_proj"] == f"{p}layers.0.post_attention_layernorm"
    assert norm_of[f"{p}layers.0.{mlp}down_proj"] is None
    for b, t in SIZES:
        ids = _ids(b, t)
        assert torch.equal(fused.module()(ids), unfused.module()(ids)), (b, t)


@pytest.mark.parametrize("recipe", FUSABLE)
def test_every_norm_spelling_is_fused_exactly(recipe):
    ep = _norm_heads_program()
    fused = fxquant.quantize(ep, recipe)
    unfused = fxquant.quantize(ep, _cfg(recipe, fuse_norms=False))
    kinds = {n["name"]: (n["kind"], n["status"]) for n in fxquant.report(fused).norms}
    assert kinds == {
        "ln": ("layer_norm", "fused"),
        "rms": ("rms_norm", "fused"),
        "layer_norm_1": ("layer_norm", "fused"),  # F.layer_norm in forward: the node's name
        "hand": ("rms_norm", "fused"),
    }
    assert not any(t.startswith("aten.") and "norm" in t for t in _targets(fused))
    for b, t in SIZES:
        x = torch.randn(b, t, 64) * 2
        assert torch.equal(fused.module()(x), unfused.module()(x)), (b, t)


def test_bf16_fused_program_stays_close_to_unfused(llama_program):
    """In bf16 the hand-written norm rounds after every step and the fused op once, so the two
    differ by a few bf16 roundings of the normed activation, not by a quantization step."""
    torch.manual_seed(0)
    model = TinyLlama().eval().to(torch.bfloat16)
    ep = torch.export.export(model, (_ids(2, 8),), dynamic_shapes=(DYN,))
    fused = fxquant.quantize(ep, "w8a8")
    unfused = fxquant.quantize(ep, _cfg("w8a8", fuse_norms=False))
    assert len(fxquant.report(fused).fused_norms) == 4
    ids = _ids(3, 5)
    assert sqnr(unfused.module()(ids), fused.module()(ids)) > 30


def test_norm_with_a_float_consumer_is_not_fused_and_says_why(llama_program):
    cfg = _cfg("w8a8", modules_to_not_convert=("lm_head", r"layers\.0\.k_proj"))
    qep = fxquant.quantize(llama_program, cfg)
    norm = _norms(qep)["layers.0.input_layernorm"]
    assert norm["status"] == "not fused"
    assert norm["reason"] == (
        "its output is also read by layers.0.k_proj, kept in float "
        r"(modules_to_not_convert 'layers\\.0\\.k_proj')"
    )
    assert norm["linears"] == ["layers.0.q_proj", "layers.0.k_proj", "layers.0.v_proj"]
    assert _norms(qep)["layers.1.input_layernorm"]["status"] == "fused"
    text = str(fxquant.report(qep))
    assert "not fused: its output is also read by layers.0.k_proj" in text
    assert "3 of 4 norms feeding activation-quantizing linears fused" in text


def test_norm_with_a_residual_use_is_not_fused():
    class Residual(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.LayerNorm(32)
            self.fc = nn.Linear(32, 32)

        def forward(self, x):
            h = self.norm(x)
            return h + self.fc(h)

    x = torch.randn(2, 32)
    qep = fxquant.quantize(Residual(), "w8a8", example_inputs=(x,))
    (norm,) = fxquant.report(qep).norms
    assert norm["reason"] == "its output is also read by aten.add.Tensor"
    assert "fxquant.norm_quant.default" not in _targets(qep)


def test_per_tensor_fp8_is_not_fused(llama_program):
    qep = fxquant.quantize(llama_program, "fp8-tensor")
    norms = fxquant.report(qep).norms
    assert len(norms) == 4 and all(n["status"] == "not fused" for n in norms)
    assert norms[0]["reason"] == (
        "layers.0.q_proj quantizes its activation per tensor, whose scale needs the whole "
        "tensor's amax before any row is written"
    )
    assert "fxquant.norm_quant.default" not in _targets(qep)


@pytest.mark.parametrize(
    ("overrides", "reason"),
    [
        (
            {r".*\.k_proj": fxquant.Float8Dynamic()},
            "its linears quantize the activation differently: layers.0.q_proj int8 per token, "
            "layers.0.k_proj fp8 e4m3 per token, layers.0.v_proj int8 per token",
        ),
        (
            {
                r".*\.v_proj": fxquant.Float8Dynamic(activation_scale_ub=1200),
                r".*\.[qk]_proj": fxquant.Float8Dynamic(),
            },
            "its linears quantize the activation differently: layers.0.q_proj fp8 e4m3 per "
            "token, layers.0.k_proj fp8 e4m3 per token, layers.0.v_proj fp8 e4m3 per token, "
            "amax ≤ 1200",
        ),
        (
            {r".*\.v_proj": fxquant.Int8WeightOnly()},
            "its output is also read by layers.0.v_proj, a Int8WeightOnly linear "
            "(float activation)",
        ),
    ],
)
def test_mixed_activation_schemes_are_not_fused(llama_program, overrides, reason):
    qep = fxquant.quantize(llama_program, _cfg("w8a8", overrides=overrides))
    norms = _norms(qep)
    assert norms["layers.0.input_layernorm"]["reason"] == reason
    assert norms["layers.0.post_attention_layernorm"]["status"] == "fused"  # gate/up still agree


@pytest.mark.parametrize(
    ("forward", "reason"),
    [
        # the mean over the wrong dim: not an RMSNorm over K
        (
            lambda m, x: (x * m.r(x, dim=0) * m.w, 0),
            "the mean is over dims [0] (keepdim=True), not -1",
        ),
        # eps a tensor, not a number the fused op can take
        (
            lambda m, x: (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + m.eps) * m.w, 0),
            "eps is not a constant number",
        ),
        # an intermediate the model also uses elsewhere
        (
            lambda m, x: (lambda r: (x * r * m.w, r.sum()))(m.r(x)),
            "its intermediate rsqrt is also used by sum_1",
        ),
        # a weight computed in the graph (Gemma's 1 + w), or not [K]
        (
            lambda m, x: (x * m.r(x) * (1 + m.w), 0),
            "its weight is computed in the graph, not a constant",
        ),
        (
            lambda m, x: (x * m.r(x) * m.w2, 0),
            "its weight has shape (1, 32) and dtype torch.float32, not float [32]",
        ),
    ],
)
def test_norms_that_fail_a_check_are_left_alone(forward, reason):
    class Odd(nn.Module):
        def __init__(self):
            super().__init__()
            self.w = nn.Parameter(torch.rand(32) + 0.5)
            self.w2 = nn.Parameter(torch.rand(1, 32) + 0.5)
            self.register_buffer("eps", torch.tensor(1e-6))
            self.q = nn.Linear(32, 16)
            self.k = nn.Linear(32, 16)

        def r(self, x, dim=-1):
            return torch.rsqrt(x.pow(2).mean(dim, keepdim=True) + 1e-6)

        def forward(self, x):
            h, extra = forward(self, x)
            return self.q(h) + self.k(h) + extra

    model = Odd().eval()
    x = torch.randn(3, 32)
    qep = fxquant.quantize(model, "w8a8", example_inputs=(x,))
    assert "fxquant.norm_quant.default" not in _targets(qep)
    assert [n["reason"] for n in fxquant.report(qep).norms] == [reason]
    with torch.no_grad():
        assert sqnr(model(x), qep.module()(x)) > 30


def test_fuse_norms_false_leaves_the_rewritten_graph_as_it_was(llama_program):
    qep = fxquant.quantize(llama_program, _cfg("w8a8", fuse_norms=False))
    editor = ProgramEditor(llama_program)
    rewrite(editor, _cfg("w8a8"))
    assert qep.graph_module.code == editor.finish().graph_module.code
    assert fxquant.report(qep).norms == []
    assert fxquant.report(qep).config.fuse_norms is False


def test_fuse_norms_returns_the_records_it_stores(llama_program):
    editor = ProgramEditor(llama_program)
    rewrite(editor, _cfg("fp8-block"))
    records = fuse_norms(editor)
    assert records == fxquant.report(editor.finish()).norms
    assert records[0] == {
        "name": "layers.0.input_layernorm",
        "kind": "rms_norm",
        "status": "fused",
        "reason": None,
        "activation": "fp8 e4m3 in 1×128 groups",
        "linears": ["layers.0.q_proj", "layers.0.k_proj", "layers.0.v_proj"],
    }


def test_save_load_keeps_the_fusion_and_its_report(llama_program, tmp_path):
    cfg = _cfg("w8a8", modules_to_not_convert=("lm_head", r"layers\.1\.up_proj"))
    qep = fxquant.quantize(llama_program, cfg)
    path = tmp_path / "q.pt2"
    torch.export.save(qep, path)
    loaded = torch.export.load(path)
    for b, t in SIZES:
        ids = _ids(b, t)
        assert torch.equal(loaded.module()(ids), qep.module()(ids))
    rep, again = fxquant.report(qep), fxquant.report(loaded)
    assert again.rows == rep.rows and again.norms == rep.norms and again.config == cfg
    assert [n["status"] for n in again.norms] == ["fused", "fused", "fused", "not fused"]
    assert {r["name"]: r.get("fused_norm") for r in again.rows}["layers.0.q_proj"] == (
        "layers.0.input_layernorm"
    )
    assert again.to_dict()["norms"] == rep.norms
    assert "norm → quantize fusion:" in str(again)


@pytest.mark.parametrize("recipe", FUSABLE)
def test_lowered_fused_program_matches_the_semantic_one(recipe, cpu_kernels):
    """Same bounds as tests/test_lower.py: the aten int8 GEMM takes bf16 on this CPU (~45-50
    dB); the native kernels and the fp8 lowerings are the reference math in another order."""
    native = cpu_kernels == "native"
    qep = fxquant.quantize(_norm_heads_program(), recipe)
    before = counters["prepack.cpu_int8_scaled_linear"]
    lowered = lower(qep)
    prepacked = counters["prepack.cpu_int8_scaled_linear"] - before
    assert prepacked == (8 if recipe == "w8a8" and not native else 0)
    left = {t for t in _targets(lowered) if t.startswith("fxquant.")}
    assert all(t.startswith("fxquant.native_") for t in left) and (native or not left)
    for b, t in SIZES:
        x = torch.randn(b, t, 64) * 2
        floor = 40 if recipe == "w8a8" and not native else 80
        assert sqnr(qep.module()(x), lowered.module()(x)) >= floor


@pytest.mark.slow
def test_lowered_fused_program_compiles_with_inductor():
    class QKV(nn.Module):
        def __init__(self):
            super().__init__()
            self.norm = nn.RMSNorm(64)
            self.qkv = nn.ModuleList(nn.Linear(64, 32) for _ in range(3))

        def forward(self, x):
            h = self.norm(x)
            return torch.cat([fc(h) for fc in self.qkv], -1)

    torch.manual_seed(0)
    x = torch.randn(3, 5, 64) * 2
    qep = fxquant.quantize(QKV(), "w8a8", example_inputs=(x,), dynamic_shapes=(DYN,))
    assert len(fxquant.report(qep).fused_norms) == 1
    compiled = torch.compile(lower(qep).module())
    assert sqnr(qep.module()(x), compiled(x)) >= 40


@pytest.mark.slow
def test_backend_fuses_the_dynamo_graph():
    """torch.compile(backend="fxquant") sees torch-level spellings (F.layer_norm, tensor methods,
    operators) and fuses them the same way."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = NormHeads().eval()
    x = torch.randn(2, 5, 64) * 2
    before = counters["fuse.norm_quant"]
    y = torch.compile(model, backend="fxquant", options={"config": "w8a8"})(x)
    assert counters["fuse.norm_quant"] - before == 4
    rows = fxquant.backend.last_reports[-1]
    assert [r.get("fused_norm") for r in rows[:2]] == ["ln", "ln"]
    qep = fxquant.quantize(model, "w8a8", example_inputs=(x,))
    assert sqnr(qep.module()(x), y) > 30  # bf16 GEMM input on the CPU, as in test_backend.py


@pytest.mark.slow
def test_smollm2_fuses_two_norms_per_decoder_layer(smollm2, smollm2_program):
    model, _ = smollm2
    layers = model.config.num_hidden_layers
    before = counters["fuse.norm_quant"]
    fused = fxquant.quantize(smollm2_program, "w8a8")
    assert counters["fuse.norm_quant"] - before == 2 * layers
    norms = fxquant.report(fused).norms
    assert len(norms) == 2 * layers and all(n["status"] == "fused" for n in norms)
    assert norms[1]["linears"] == [
        "model.model.layers.0.mlp.gate_proj",
        "model.model.layers.0.mlp.up_proj",
    ]
    unfused = fxquant.quantize(smollm2_program, _cfg("w8a8", fuse_norms=False))
    ids = _ids(2, 12, vocab=model.config.vocab_size)
    assert torch.equal(fused.module()(ids), unfused.module()(ids))
