"""export_llm (one program with its KV cache) and the runtime that serves its package."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch

import fxquant
from fxquant import runtime
from fxquant.core.reference import sqnr
from fxquant.llm import LLMExportError, export_llm, llm_info
from fxquant.passes.cpu import dispatch
from fxquant.runtime import (
    GenerationStats,
    LLMPackage,
    PackageError,
    _sample,
    generate,
    read_package_metadata,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
tf = pytest.importorskip("transformers")

VOCAB = 96
_COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=128,
)


def _config(arch: str):
    if arch == "llama":
        return tf.LlamaConfig(**_COMMON, tie_word_embeddings=True)
    if arch == "qwen2":
        return tf.Qwen2Config(**_COMMON)
    if arch == "qwen3":
        return tf.Qwen3Config(**_COMMON, head_dim=16)
    if arch == "mistral":
        return tf.MistralConfig(**_COMMON, sliding_window=64)
    if arch == "gpt2":
        return tf.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, n_positions=128)
    if arch == "gemma3":  # sliding-window and global layers, q/k norms, scaled embeddings
        return tf.Gemma3TextConfig(**_COMMON, head_dim=16, sliding_window=64)
    if arch == "phi3":  # fused qkv_proj and gate_up_proj
        return tf.Phi3Config(**_COMMON, pad_token_id=0)
    if arch == "qwen2_moe":  # routed experts and a shared one
        return tf.Qwen2MoeConfig(
            **_COMMON, moe_intermediate_size=32, shared_expert_intermediate_size=64,
            num_experts=4, num_experts_per_tok=2,
        )  # fmt: skip
    if arch == "deepseek_v3":  # latent attention: keys 8 + 8 wide, values 24, config.head_dim 8
        return tf.DeepseekV3Config(
            **{**_COMMON, "num_key_value_heads": 4}, moe_intermediate_size=32,
            n_routed_experts=4, num_experts_per_tok=2, first_k_dense_replace=1, q_lora_rank=None,
            kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=24, n_group=1,
            topk_group=1,
        )  # fmt: skip
    if arch == "falcon":  # FalconLinear: x @ self.weight.T, no aten.linear (Falcon-40B's layout)
        return tf.FalconConfig(
            vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_kv_heads=2, new_decoder_architecture=True, max_position_embeddings=128,
        )  # fmt: skip
    if arch == "llama4":  # chunked-attention layers (chunks of 48 here), routed experts
        return tf.Llama4TextConfig(
            **_COMMON, head_dim=16, intermediate_size_mlp=128, num_local_experts=4,
            attention_chunk_size=48,
        )  # fmt: skip
    raise AssertionError(arch)


def _model(arch: str = "llama", seed: int = 0):
    torch.manual_seed(seed)
    return tf.AutoModelForCausalLM.from_config(_config(arch)).eval()


class CharTokenizer:
    """Printable ASCII, one id per character (id = code - 32): enough to stream real text."""

    def __len__(self) -> int:
        return VOCAB

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [min(max(ord(c) - 32, 0), VOCAB - 1) for c in text]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        return "".join(chr(i + 32) for i in ids)


def _cached_logits(fn, ids: torch.Tensor, split: int) -> torch.Tensor:
    """Prefill ids[:, :split] in one call, then one call per remaining token."""
    outs = [fn(ids[:, :split], torch.arange(split))]
    outs += [fn(ids[:, i : i + 1], torch.tensor([i])) for i in range(split, ids.shape[1])]
    return torch.cat(outs, dim=1)


@pytest.mark.parametrize(
    "arch",
    [
        "llama", "gpt2", "qwen2", "qwen3", "mistral", "falcon", "gemma3", "phi3", "qwen2_moe",
        "deepseek_v3", "llama4",
    ],
)  # fmt: skip
def test_cached_program_equals_the_uncached_model(arch):
    model = _model(arch)
    ep = export_llm(model, max_cache_len=32, logits="all")
    ids = torch.randint(0, VOCAB, (1, 14))
    want = model(ids, use_cache=False).logits
    m = ep.module()
    got = _cached_logits(m, ids, split=9)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # a new prompt at position 0 starts over: no reset, the stale cache is never attended to
    torch.testing.assert_close(m(ids[:, :5], torch.arange(5)), want[:, :5], atol=1e-5, rtol=1e-5)
    info = llm_info(ep)
    assert info["max_cache_len"] == 32 and info["max_batch"] == 1 and info["vocab_size"] == VOCAB
    assert info["logits"] == "all"


@pytest.mark.slow
def test_llama4_chunked_layers_package_as_the_program_within_one_chunk(tmp_path):
    """Llama 4's chunked-attention layers attend within chunks of attention_chunk_size: a cache
    no longer than one chunk runs them on the causal mask (the same attention there), and its
    package gives the program's logits (the chunked mask, packaged, gave under 5 dB and no
    error); a longer cache is refused, and the command line's default stops at the chunk. Its
    experts, a bmm of every expert over every row, run as int8 grouped experts (T rows each, the
    offsets computed in the program: T is the call's token count)."""
    from fxquant.llm import cache_len_limit

    model = _model("llama4")
    chunked = ["chunked_attention"] * 2
    assert model.config.layer_types == chunked and cache_len_limit(model.config) == 48
    with pytest.raises(ValueError, match=r"max_cache_len=64 is above .* attention chunk \(48"):
        export_llm(model, max_cache_len=64)
    ep = export_llm(model, max_cache_len=32, logits="all")
    assert model.config.layer_types == chunked  # the caller's model is kept
    ep = fxquant.quantize(ep, "int8wo")
    rep = fxquant.report(ep)
    experts = {r.name: r for r in rep.quantized if r.kind == "bmm"}
    assert sorted(experts) == sorted(
        f"model.model.layers.{i}.feed_forward.experts.{w}"
        for i in range(2)
        for w in ("gate_up_proj", "down_proj")
    )
    assert all(r.experts == 4 for r in experts.values())
    assert len(rep.quantized) == 2 * 10  # attention, router, shared expert, experts
    pkg = fxquant.aot_compile(ep, tmp_path / "llama4.pt2")
    ids = torch.randint(0, VOCAB, (1, 12))
    want = _cached_logits(ep.module(), ids, split=8)
    db = sqnr(want, _cached_logits(pkg, ids, split=8))
    print(f"llama4 int8wo package vs program: {db:.1f} dB")
    assert db >= 40.0  # the native kernels' bf16 dot products from 2 rows


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_by_default_the_program_returns_the_last_positions_logits(arch):
    """What generation reads: a prompt's prefill runs the LM head on its last token only."""
    model = _model(arch)
    ep = export_llm(model, max_cache_len=32)
    assert llm_info(ep)["logits"] == "last"
    heads = [
        n.meta["val"].shape
        for n in ep.graph.nodes
        if n.op == "call_function"
        and n.target == torch.ops.aten.linear.default
        and n.meta["val"].shape[-1] == VOCAB
    ]
    assert heads and all(shape[1] == 1 for shape in heads), heads  # one row, whatever T is
    ids = torch.randint(0, VOCAB, (1, 11))
    want = model(ids, use_cache=False).logits
    m = ep.module()
    got = m(ids[:, :8], torch.arange(8))
    assert got.shape == (1, 1, VOCAB)
    torch.testing.assert_close(got, want[:, 7:8], atol=1e-5, rtol=1e-5)
    for i in range(8, 11):  # decode steps: one token in, its logits out
        torch.testing.assert_close(
            m(ids[:, i : i + 1], torch.tensor([i])), want[:, i : i + 1], atol=1e-5, rtol=1e-5
        )


def test_the_model_is_not_changed():
    model = _model()
    ids = torch.randint(0, VOCAB, (1, 6))
    before = model(ids, use_cache=False).logits
    state = {k: v.clone() for k, v in model.state_dict().items()}
    export_llm(model, max_cache_len=16)
    assert model.config._attn_implementation == "sdpa"  # the traced attention was temporary
    assert all(torch.equal(state[k], v) for k, v in model.state_dict().items())
    torch.testing.assert_close(model(ids, use_cache=False).logits, before, rtol=0, atol=0)


def test_grouped_query_heads_read_the_cache_without_repeating_it():
    # 4 query heads on 2 key/value heads: transformers' sdpa under export expands each cached
    # K and V to [B, 2, 2, L, D] (a copy per layer and step); the packed attention never does
    ep = export_llm(_model(), max_cache_len=16)
    head_dim = _COMMON["hidden_size"] // _COMMON["num_attention_heads"]
    repeats = [
        n
        for n in ep.graph.nodes
        if n.op == "call_function"
        and n.target == torch.ops.aten.expand.default
        and n.meta["val"].dim() == 5
        and isinstance(n.meta["val"].shape[-1], int)  # K/V's head dim; the mask's is a length
        and n.meta["val"].shape[-1] == head_dim
    ]
    assert not repeats, repeats


@pytest.mark.parametrize("native", [True, False])
def test_native_attention_equals_the_uncached_model(native, monkeypatch):
    """Where the native kernels are built the program's attention is one op per layer
    (fxquant::native_gqa_attention: its own loops at decode, MKL's bmm for a prompt); else two
    matmuls and a softmax. Both give the uncached model's logits, prompt and decode steps."""
    import fxquant.kernels.cpu as native_kernels
    import fxquant.llm as llm

    if native and not native_kernels.available():
        pytest.skip(f"native kernels unavailable: {native_kernels.unavailable_reason()}")
    if not native:
        monkeypatch.setattr(llm, "_native_attention", lambda *args: False)
    model = _model()
    ep = export_llm(model, max_cache_len=32, logits="all")
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    kernel = torch.ops.fxquant.native_gqa_attention.default
    products = (torch.ops.aten.matmul.default, torch.ops.aten.bmm.default)
    layers = _COMMON["num_hidden_layers"]
    assert targets.count(kernel) == (layers if native else 0)
    # in attention (transformers 5.17's rotary embedding is one more matmul)
    in_attention = [
        n.target
        for n in ep.graph.nodes
        if n.op == "call_function" and "self_attn" in str(n.meta.get("nn_module_stack"))
    ]
    assert sum(t in products for t in in_attention) == (0 if native else 2 * layers)
    ids = torch.randint(0, VOCAB, (1, 14))
    want = model(ids, use_cache=False).logits
    m = ep.module()
    torch.testing.assert_close(_cached_logits(m, ids, split=9), want, atol=1e-5, rtol=1e-5)
    # a prompt long enough for the op's bmm path (more than 16 query rows a head)
    torch.testing.assert_close(m(ids[:, :12], torch.arange(12)), want[:, :12], atol=1e-5, rtol=1e-5)


def test_a_bf16_program_runs_the_native_attention_on_its_bf16_cache():
    """A model in bf16 (from_pretrained's default for a bf16 checkpoint) keeps a bf16 cache; its
    attention is the native op all the same (the cache widened as it is read), with the uncached
    bf16 model's logits up to bf16 rounding, prompt and decode steps."""
    import fxquant.kernels.cpu as native_kernels

    if not native_kernels.available():
        pytest.skip(f"native kernels unavailable: {native_kernels.unavailable_reason()}")
    model = _model(seed=2).to(torch.bfloat16)
    ep = export_llm(model, max_cache_len=32, logits="all")
    targets = [n.target for n in ep.graph.nodes if n.op == "call_function"]
    kernel = torch.ops.fxquant.native_gqa_attention.default
    assert targets.count(kernel) == _COMMON["num_hidden_layers"]
    ids = torch.randint(0, VOCAB, (1, 20))
    want = model(ids, use_cache=False).logits.float()
    got = _cached_logits(ep.module(), ids, split=18).float()  # an 18-token prompt: the bmm path
    torch.testing.assert_close(got, want, atol=0.02, rtol=0.02)


def test_the_compiled_wrapper_packs_its_attention_in_one_graph():
    """``torch.compile(CachedCausalLM(model))`` traces the packed attention too (Dynamo's graph,
    one a phase, no break): one native op a layer where the kernels are built, never sdpa over a
    repeated cache; the logits are the eager wrapper's and the uncached model's."""
    import fxquant.kernels.cpu as native_kernels
    from fxquant.llm import CachedCausalLM

    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    model = _model(seed=4)
    ids = torch.randint(0, VOCAB, (1, 7))
    want = model(ids, use_cache=False).logits
    eager = CachedCausalLM(model, max_cache_len=16, logits="all")
    compiled = torch.compile(CachedCausalLM(model, max_cache_len=16, logits="all"), backend=record)
    # the attended length is data (.item()): in the graph, not a break
    with torch.no_grad(), torch._dynamo.config.patch(capture_scalar_outputs=True):
        for run in (eager, compiled):
            got = torch.cat([run(ids[:, :5], torch.arange(5))] + [
                run(ids[:, i : i + 1], torch.tensor([i])) for i in (5, 6)
            ], 1)  # fmt: skip
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert model.config._attn_implementation == "sdpa"  # the caller's model is kept
    assert len(graphs) in (2, 3)  # the prompt, the decode steps (Dynamo may respecialize once)
    native = native_kernels.available()
    layers = _COMMON["num_hidden_layers"]
    for gm in graphs:
        targets = [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
        assert not any("scaled_dot_product" in t for t in targets), targets
        assert sum("native_gqa_attention" in t for t in targets) == (layers if native else 0)
    torch._dynamo.reset()


def test_the_wrapper_compiles_under_inductor_with_the_attended_length_captured():
    """``torch.compile(CachedCausalLM(model))`` with Inductor itself (how torchao's rows in
    benchmarks/llm_decode.py run): the mask reaches the native op as a computation, not a view;
    a view failed to compile (GuardOnDataDependentSymNode)."""
    from fxquant.llm import CachedCausalLM

    model = _model(seed=5)
    ids = torch.randint(0, VOCAB, (1, 7))
    want = model(ids, use_cache=False).logits
    torch._dynamo.reset()
    compiled = torch.compile(CachedCausalLM(model, max_cache_len=16, logits="all"))
    with torch.no_grad(), torch._dynamo.config.patch(capture_scalar_outputs=True):
        got = torch.cat([compiled(ids[:, :5], torch.arange(5))] + [
            compiled(ids[:, i : i + 1], torch.tensor([i])) for i in (5, 6)
        ], 1)  # fmt: skip
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch._dynamo.reset()


def test_the_program_compiles_with_the_attended_length_captured():
    """docs/llm.md's setting for a generation loop under torch.compile: the attended length is a
    data-dependent size in the graph. Every layer reads one computed copy of the causal mask
    (share_attention_masks, in export_llm), which Inductor hands to the native op as it is;
    views of it made Inductor fail (GuardOnDataDependentSymNode)."""
    from torch._inductor import config

    ep = export_llm(_model(), max_cache_len=40)
    ids = torch.randint(0, VOCAB, (1, 20), generator=torch.Generator().manual_seed(0))
    want = ep.module()(ids, torch.arange(20))
    torch._dynamo.reset()
    captured = torch._dynamo.config.patch(capture_scalar_outputs=True)
    with captured, config.patch(fx_graph_cache=False), torch.no_grad():
        got = torch.compile(ep.module())(ids, torch.arange(20))
    torch.testing.assert_close(got, want)


def test_a_saved_program_runs_in_a_fresh_process(tmp_path):
    """`import fxquant` declares the attention op for torch.export.load; without the native
    library loaded it runs the reference math."""
    model = _model()
    torch.export.save(export_llm(model, max_cache_len=16, logits="all"), tmp_path / "p.pt2")
    ids = torch.randint(0, VOCAB, (1, 6))
    torch.save({"ids": ids, "want": model(ids, use_cache=False).logits}, tmp_path / "io.pt")
    code = textwrap.dedent(
        """
        import sys, torch, fxquant
        ep = torch.export.load(sys.argv[1] + "/p.pt2")
        io = torch.load(sys.argv[1] + "/io.pt")
        m, ids = ep.module(), io["ids"]
        outs = [m(ids[:, :4], torch.arange(4))]
        outs += [m(ids[:, i : i + 1], torch.tensor([i])) for i in (4, 5)]
        torch.testing.assert_close(torch.cat(outs, 1), io["want"], atol=1e-5, rtol=1e-5)
        """
    )
    proc = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gpt2"])
def test_cache_shapes_without_get_head_shapes(arch, monkeypatch):
    # transformers releases before get_head_shapes (the lent H200's image) size the cache from
    # the config's attributes; the same shapes as the helper where it exists
    from transformers import configuration_utils

    from fxquant.llm import _head_shapes

    config = _config(arch)
    expected = _head_shapes(config)
    if hasattr(configuration_utils, "get_head_shapes"):
        assert expected == configuration_utils.get_head_shapes(config)
        monkeypatch.delattr(configuration_utils, "get_head_shapes")
    assert _head_shapes(config) == expected


def test_the_cache_is_sized_from_the_config_where_a_token_caches_nothing(monkeypatch):
    # the static cache's layers take their shapes from one token's key and value states; where
    # that says nothing, from the config's head shapes, as before
    import fxquant.llm as llm

    monkeypatch.setattr(llm, "_one_token_states", lambda *a, **k: None)
    model = _model()
    ids = torch.randint(0, VOCAB, (1, 10))
    got = _cached_logits(export_llm(model, max_cache_len=16, logits="all").module(), ids, 6)
    torch.testing.assert_close(got, model(ids, use_cache=False).logits, atol=1e-5, rtol=1e-5)


def test_a_cached_program_that_disagrees_with_the_model_is_not_exported(monkeypatch):
    # export_llm runs the cached wrapper on its example tokens first: where the packed attention
    # disagrees with the model (Falcon under transformers 5.17), the model's own attention runs;
    # where that disagrees too, the export is refused instead of saved wrong
    import fxquant.llm as llm

    model = _model()
    wrong = lambda q, k, v, *a, **kw: torch.zeros_like(q).transpose(1, 2)  # noqa: E731
    monkeypatch.setattr(llm, "packed_gqa_attention", wrong)
    ep = export_llm(model, max_cache_len=16, logits="all")
    assert "fxquant.native_gqa_attention" not in {str(n.target) for n in ep.graph.nodes}
    ids = torch.randint(0, VOCAB, (1, 10))
    got = _cached_logits(ep.module(), ids, 6)
    torch.testing.assert_close(got, model(ids, use_cache=False).logits, atol=1e-5, rtol=1e-5)

    def noisy(self, input_ids, cache_position):
        return forward(self, input_ids, cache_position) + 0.1

    forward = llm.CachedCausalLM.forward
    monkeypatch.setattr(llm.CachedCausalLM, "forward", noisy)
    with pytest.raises(LLMExportError, match=r"disagrees with the model itself on 8 example"):
        export_llm(model, max_cache_len=16)


def test_batch_rows_are_independent():
    model = _model()
    ep = export_llm(model, max_cache_len=16, max_batch=2, logits="all")
    ids = torch.randint(0, VOCAB, (2, 7))
    got = _cached_logits(ep.module(), ids, split=4)
    torch.testing.assert_close(got, model(ids, use_cache=False).logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("recipe", ["int8wo", "int4wo-32", "w8a8"])
def test_quantized_cached_program_equals_the_quantized_uncached_one(recipe):
    """Same weights, same math: caching changes nothing but the work per token."""
    from fxquant.evaluate import export_causal_lm

    model = _model()
    cfg = fxquant.QuantConfig(scheme=fxquant.from_recipe_name(recipe))
    cached = fxquant.quantize(export_llm(model, max_cache_len=32, logits="all"), cfg)
    uncached = fxquant.quantize(export_causal_lm(model), cfg)
    rep = fxquant.report(cached)
    assert len(rep.quantized) == 14 and llm_info(cached) is not None
    ids = torch.randint(0, VOCAB, (1, 12))
    got = _cached_logits(cached.module(), ids, split=5)
    torch.testing.assert_close(got, uncached.module()(ids), atol=1e-4, rtol=1e-4)


def test_falcon_linears_are_quantized_through_their_transposed_weights():
    model = _model("falcon")
    qep = fxquant.quantize(export_llm(model, max_cache_len=32, logits="all"), "int8wo")
    rows = fxquant.report(qep).rows
    quantized = [r["name"] for r in rows if r["status"] == "quantized"]
    assert {r["kind"] for r in rows if r["status"] == "quantized"} == {"matmul"}
    assert len(quantized) == 8  # query_key_value, dense, dense_h_to_4h, dense_4h_to_h × 2
    assert quantized[0] == "model.transformer.h.0.self_attention.query_key_value"
    ids = torch.randint(0, VOCAB, (1, 12))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    assert sqnr(want, _cached_logits(qep.module(), ids, split=5)) > 30


def test_the_cache_length_limit_is_the_positional_limit():
    from fxquant.llm import cache_len_limit

    assert cache_len_limit(_config("llama")) == 128  # max_position_embeddings
    assert cache_len_limit(_config("gpt2")) == 128  # n_positions
    assert cache_len_limit(_config("mistral")) == 128  # its sliding window (64) is no limit
    assert cache_len_limit(tf.PretrainedConfig()) is None


@pytest.mark.parametrize("arch", ["mistral", "gemma3", "gpt_oss"])
def test_sliding_window_layers_attend_over_their_window_past_it(arch):
    """A cache longer than the window: every position is kept, the mask attends over the
    window (Mistral: every layer slides; Gemma 3, gpt-oss: some do, gpt-oss with sinks)."""
    if arch == "gpt_oss":
        config = tf.GptOssConfig(
            **{**_COMMON, "intermediate_size": 64}, head_dim=16, num_local_experts=4,
            num_experts_per_tok=2, layer_types=["sliding_attention", "full_attention"],
        )  # fmt: skip
    else:
        config = _config(arch)
    config.sliding_window = 8
    torch.manual_seed(0)
    model = tf.AutoModelForCausalLM.from_config(config).eval()
    ep = export_llm(model, max_cache_len=48, logits="all")
    ids = torch.randint(0, VOCAB, (1, 30))
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
    got = _cached_logits(ep.module(), ids, split=20)  # a prompt of 20, then 10 decode steps
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    # and the window matters: the same weights attending over everything differ past it
    model.config.sliding_window = 10**6
    with torch.no_grad():
        everything = model(ids, use_cache=False).logits
    assert (everything[:, 9:] - want[:, 9:]).abs().max() > 1e-2


def test_llm_info_survives_save_and_load(tmp_path):
    ep = fxquant.quantize(export_llm(_model(), max_cache_len=24), "int8wo")
    torch.export.save(ep, tmp_path / "q.pt2")
    assert llm_info(torch.export.load(tmp_path / "q.pt2")) == llm_info(ep)


def test_bad_sizes_are_refused_before_export():
    model = _model()
    with pytest.raises(ValueError, match="positional limit"):
        export_llm(model, max_cache_len=129)
    with pytest.raises(ValueError, match="max_batch=0"):
        export_llm(model, max_cache_len=16, max_batch=0)
    with pytest.raises(ValueError, match="max_cache_len=1"):
        export_llm(model, max_cache_len=1)
    with pytest.raises(ValueError, match="logits='first'; allowed: 'last', 'all'"):
        export_llm(model, max_cache_len=16, logits="first")


def test_a_model_that_does_not_trace_names_the_architecture():
    class Opaque(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner, self.config = inner, inner.config

        def parameters(self, recurse=True):
            return self.inner.parameters(recurse)

        def forward(self, input_ids, **kwargs):
            if input_ids.sum() > 0:  # data-dependent control flow: export cannot trace it
                return self.inner(input_ids=input_ids, **kwargs)
            return self.inner(input_ids=input_ids + 1, **kwargs)

    with pytest.raises(LLMExportError, match=r"Opaque could not be exported.*test_llm.*uncached"):
        export_llm(Opaque(_model()), max_cache_len=16)
    with pytest.raises(LLMExportError, match="has no .config"):
        export_llm(torch.nn.Linear(2, 2), max_cache_len=16)


def test_sampling_rules():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([0.0, 3.0, 1.0, 2.0])
    assert _sample(logits, temperature=0.0, top_k=0, top_p=1.0, gen=g) == 1
    assert {_sample(logits, temperature=1.0, top_k=1, top_p=1.0, gen=g) for _ in range(20)} == {1}
    # top_p: the smallest set of tokens whose probability reaches p (here {1, 3})
    picks = {_sample(logits, temperature=1.0, top_k=0, top_p=0.85, gen=g) for _ in range(200)}
    assert picks == {1, 3}
    stats = GenerationStats(prompt_tokens=10, new_tokens=3, prefill_s=0.5, decode_s=[0.1, 0.3, 0.2])
    assert stats.prefill_tokens_per_s == 20 and stats.decode_tokens_per_s == 5
    assert "prefill 10 tok" in stats.summary()


# --------------------------------------------------------------------------------------------
# The package and its runtime (AOTInductor builds: slow)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def llm_package(tmp_path_factory):
    """A tiny Llama, int8wo with lm_head, packaged; plus the exported program's greedy ids."""
    model = _model(seed=1)
    model.generation_config.eos_token_id = None  # random weights: do not stop on a stray EOS
    model.config.eos_token_id = None
    cfg = fxquant.QuantConfig(scheme=fxquant.Int8WeightOnly(), modules_to_not_convert=())
    ep = fxquant.quantize(export_llm(model, max_cache_len=40), cfg)
    path = tmp_path_factory.mktemp("pkg") / "tiny.pt2"
    # two threads as on a user's machine (a test worker has one, and Inductor writes no OpenMP
    # region for one): test_the_package_kernels_run_serial_at_decode_sizes reads them
    configs = {"cpp.threads": 2}
    assert fxquant.aot_compile(ep, path, load=False, inductor_configs=configs) is None
    prompt = CharTokenizer().encode("The capital of")
    ids, m = list(prompt), ep.module()
    logits = m(torch.tensor([ids]), torch.arange(len(ids)))
    greedy = []
    for _ in range(12):
        greedy.append(int(logits[0, -1].argmax()))
        logits = m(torch.tensor([[greedy[-1]]]), torch.tensor([len(ids) + len(greedy) - 1]))
    return path, prompt, greedy


@pytest.mark.slow
def test_package_greedy_tokens_equal_the_program_and_rerun_from_position_0(llm_package):
    path, prompt, greedy = llm_package
    pkg = LLMPackage(path)
    assert pkg.max_cache_len == 40 and pkg.vocab_size == VOCAB
    assert pkg.info["config"]["modules_to_not_convert"] == [] and pkg.info["torch"]
    # which kernel the package's layers run, by M, on the CPU class that built it
    assert pkg.info["cpu_class"] in dispatch.CLASSES
    assert pkg.info["cpu_kernels"].keys() == {"Int8WeightOnly()"}
    for _ in range(2):  # the second prompt starts at position 0 again, without a rebuild
        stream = generate(pkg, CharTokenizer(), prompt, max_new_tokens=12)
        text = stream.text()
        assert stream.token_ids == greedy and text == CharTokenizer().decode(greedy)
        assert stream.stats.new_tokens == 12 and stream.stats.stop_reason == "max_new_tokens"
        assert len(stream.stats.decode_s) == 11 and stream.stats.prefill_s > 0


@pytest.mark.slow
def test_the_package_kernels_run_serial_at_decode_sizes(llm_package):
    # fxquant.passes.cpu.parallel: each OpenMP region of Inductor's kernels (all of dynamic size
    # in T here) is guarded by its work, so a decode step's small kernels wake no thread
    from fxquant.passes.cpu.parallel import MIN_PARALLEL_WORK

    path, _, _ = llm_package
    with zipfile.ZipFile(path) as z:
        source = "".join(z.read(n).decode() for n in z.namelist() if n.endswith(".kernel.cpp"))
    regions = source.count("#pragma omp parallel")
    guards = re.findall(rf">= {MIN_PARALLEL_WORK}\)\s*\{{\s*#pragma omp parallel", source)
    assert regions > 0 and len(guards) == regions


@pytest.mark.slow
def test_the_package_computes_the_causal_mask_once_for_all_layers(llm_package):
    # every layer's attention reads the model's one causal mask: one kernel call writes it (the
    # op's flexible layout and fxquant.passes.cpu.attention.share_attention_masks; before, each
    # layer's call got a copy of its own, computed again)
    path, _, _ = llm_package
    with zipfile.ZipFile(path) as z:
        wrapper = "".join(z.read(n).decode() for n in z.namelist() if n.endswith("wrapper.cpp"))
    calls = wrapper.count("aoti_torch_cpu_native_gqa_attention(") - 1  # less its declaration
    assert calls == _COMMON["num_hidden_layers"] > 1
    assert wrapper.count("(bool*)(") == 1


@pytest.mark.slow
def test_sampling_with_a_seed_is_reproducible(llm_package):
    path, prompt, _ = llm_package
    pkg = LLMPackage(path)

    def sample() -> list[int]:
        s = generate(pkg, CharTokenizer(), prompt, max_new_tokens=8, temperature=0.9, top_k=20,
                     top_p=0.9, seed=7)  # fmt: skip
        s.text()
        return s.token_ids

    runs = [sample(), sample()]
    assert runs[0] == runs[1] and len(runs[0]) == 8


@pytest.mark.slow
def test_requests_the_package_cannot_hold_fail_before_running(llm_package):
    path, prompt, _ = llm_package
    pkg = LLMPackage(path)
    with pytest.raises(PackageError, match="max_cache_len=40"):
        generate(pkg, CharTokenizer(), "x" * 35, max_new_tokens=6)
    with pytest.raises(PackageError, match="max_batch=1"):
        pkg(torch.zeros(2, 3, dtype=torch.long), torch.arange(3))

    class BigTokenizer(CharTokenizer):
        def __len__(self):
            return 50000

    with pytest.raises(PackageError, match="vocabulary of 96"):
        generate(pkg, BigTokenizer(), prompt, max_new_tokens=2)


@pytest.mark.slow
def test_packages_from_elsewhere_are_refused(llm_package, tmp_path, monkeypatch):
    path, _, _ = llm_package

    def patched(change) -> str:
        out = tmp_path / f"p{len(list(tmp_path.iterdir()))}.pt2"
        with zipfile.ZipFile(path) as src, zipfile.ZipFile(out, "w") as dst:
            for item in src.infolist():
                data = src.read(item)
                if item.filename.endswith("wrapper_metadata.json"):
                    meta = json.loads(data)
                    info = change(json.loads(meta.pop("fxquant_llm")))
                    if info is not None:
                        meta["fxquant_llm"] = json.dumps(info)
                    data = json.dumps(meta).encode()
                dst.writestr(item, data)
        return out

    with pytest.raises(PackageError, match="built with torch 1.0"):
        LLMPackage(patched(lambda info: {**info, "torch": "1.0"}))
    with pytest.raises(PackageError, match="avx9000, which this CPU lacks"):
        LLMPackage(patched(lambda info: {**info, "isa_flags": ["avx9000"]}))
    # served on a lesser CPU (forced: this CPU's flags without its AVX-512, or without AVX2)
    needed = set(json.loads(read_package_metadata(path)["fxquant_llm"])["isa_flags"])
    lacking = {f for f in needed if f.startswith("avx512")} or {"avx2"}
    with monkeypatch.context() as m:
        m.setattr(runtime, "_cpu_flags", lambda: (needed | {"fpu"}) - lacking)
        with pytest.raises(PackageError, match=f"built on a CPU with {min(lacking)}.*rebuild"):
            LLMPackage(path)
    with pytest.raises(PackageError, match="not an LLM one"):
        LLMPackage(patched(lambda info: None))
    (tmp_path / "junk.pt2").write_bytes(b"not a zip")
    with pytest.raises(PackageError, match="not a zip"):
        LLMPackage(tmp_path / "junk.pt2")


@pytest.mark.slow
def test_the_runtime_serves_without_fxquant_passes_or_transformers(llm_package, tmp_path):
    path, prompt, greedy = llm_package
    runtime = os.path.join(os.path.dirname(fxquant.__file__), "runtime.py")
    script = textwrap.dedent(
        f"""
        import importlib.util, sys
        spec = importlib.util.spec_from_file_location("fxq_runtime", {runtime!r})
        rt = sys.modules["fxq_runtime"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(rt)
        class Tok:
            def __len__(self): return {VOCAB}
            def decode(self, ids, skip_special_tokens=True):
                return "".join(chr(i + 32) for i in ids)
        s = rt.generate({str(path)!r}, Tok(), {prompt!r}, max_new_tokens=12)
        s.text()
        assert s.token_ids == {greedy!r}, s.token_ids
        loaded = [m for m in sys.modules if m.split(".")[0] in ("fxquant", "transformers")]
        assert not loaded, loaded
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
    shutil.rmtree(tmp_path, ignore_errors=True)


def _assert_packed_layers(packed: int, native: bool) -> None:
    """Every layer of the decode graph packed where the native kernels are built: 2, or 4 under
    transformers 5.17 (the lent GPU's), whose prefill graph attends over the static cache too."""
    layers = _COMMON["num_hidden_layers"]
    assert packed in (layers, 2 * layers) if native else packed == 0, packed


@pytest.mark.slow
def test_hf_generate_under_the_backend_matches_the_program_and_quantizes_once():
    """Hugging Face's own generate with a static cache, the forward compiled by the fxquant
    backend: the exported program's greedy tokens, each weight quantized once however many
    graphs Dynamo compiles (prefill, decode, a second cache length), the decode steps'
    attention on the packed kernel (passes/cpu/attention.py)."""
    import copy

    import fxquant.kernels.cpu as native_kernels
    from fxquant.passes.rewrite import counters

    model = _model(seed=2)
    model.generation_config.eos_token_id = None
    prompt = torch.randint(0, VOCAB, (1, 6))
    ep = fxquant.quantize(export_llm(model, max_cache_len=32), "int8wo")
    m, ids, want = ep.module(), prompt[0].tolist(), []
    logits = m(prompt, torch.arange(6))
    for i in range(8):
        want.append(int(logits[0, -1].argmax()))
        logits = m(torch.tensor([[want[-1]]]), torch.tensor([6 + i]))

    served = copy.deepcopy(model)
    served.forward = torch.compile(served.forward, backend="fxquant", options={"config": "int8wo"})
    counters.clear()
    kwargs = dict(do_sample=False, cache_implementation="static", pad_token_id=0)
    out = served.generate(prompt, max_new_tokens=8, **kwargs)
    assert out[0, 6:].tolist() == want and ids == out[0, :6].tolist()
    assert counters["quantize.computed"] == 14  # 2 layers × 7 linears, once
    # the decode graph's attention over the repeated static cache: the packed native kernel
    _assert_packed_layers(counters["attention.packed"], native_kernels.available())
    compiles = counters["quantize.reused"]
    served.generate(prompt, max_new_tokens=12, **kwargs)  # a longer cache: Dynamo recompiles
    assert counters["quantize.computed"] == 14 and counters["quantize.reused"] > compiles


@pytest.mark.slow
def test_hf_generate_of_a_bf16_model_under_the_backend_packs_its_attention():
    """A model in bf16 (from_pretrained's default dtype for bf16 checkpoints): the decode
    graph's attention over the repeated cache is packed (the native kernel on the bf16 cache),
    with the logits of bf16 eager up to bf16 rounding."""
    import copy

    import fxquant.kernels.cpu as native_kernels
    from fxquant.passes.rewrite import counters

    torch._dynamo.reset()
    model = _model(seed=4).to(torch.bfloat16)
    model.generation_config.eos_token_id = None
    prompt = torch.randint(0, VOCAB, (1, 6))
    kwargs = dict(
        do_sample=False, cache_implementation="static", pad_token_id=0, max_new_tokens=3,
        return_dict_in_generate=True, output_logits=True,
    )  # fmt: skip
    want = model.generate(prompt, **kwargs)
    served = copy.deepcopy(model)
    served.forward = torch.compile(
        served.forward, backend="fxquant", options={"config": fxquant.QuantConfig()}
    )
    counters.clear()
    got = served.generate(prompt, **kwargs)
    _assert_packed_layers(counters["attention.packed"], native_kernels.available())
    # step i's logits are comparable while the tokens before it agree
    for i, (a, b) in enumerate(zip(got.logits, want.logits, strict=True)):
        torch.testing.assert_close(a.float(), b.float(), atol=0.02, rtol=0.02)  # seen: 3e-3
        if got.sequences[0, 6 + i] != want.sequences[0, 6 + i]:
            break
    torch._dynamo.reset()


def test_each_weight_is_quantized_once_per_scheme_while_it_lives():
    from fxquant.passes.rewrite import counters

    model = _model(seed=3)
    ep = export_llm(model, max_cache_len=16)
    counters.clear()
    a = fxquant.quantize(ep, "int8wo")
    fxquant.quantize(ep, "int4wo-32")
    b = fxquant.quantize(ep, "int8wo")  # the same weights and scheme: taken from the cache
    assert counters["quantize.computed"] == 28 and counters["quantize.reused"] == 14
    ids = torch.randint(0, VOCAB, (1, 5))
    torch.testing.assert_close(a.module()(ids, torch.arange(5)), b.module()(ids, torch.arange(5)))
    with torch.no_grad():  # an in-place update is a new version: quantized anew
        model.model.layers[0].mlp.up_proj.weight.mul_(2)
    fxquant.quantize(ep, "int8wo")
    assert counters["quantize.computed"] == 29


@pytest.mark.slow
def test_calls_the_compiled_code_cannot_bound_check_are_refused(llm_package):
    path, _, _ = llm_package
    pkg = LLMPackage(path)
    ids = torch.tensor([[1, 2, 3]])
    with pytest.raises(PackageError, match=r"token ids must be in \[0, 96\)"):
        pkg(torch.tensor([[1, 96]]), torch.arange(2))
    with pytest.raises(PackageError, match="consecutive positions"):
        pkg(ids, torch.tensor([0, 2, 3]))
    with pytest.raises(PackageError, match="consecutive positions"):
        pkg(ids, torch.tensor([-1, 0, 1]))
    with pytest.raises(PackageError, match="T >= 1"):
        pkg(torch.zeros(1, 0, dtype=torch.long), torch.arange(0))
    assert pkg(ids, torch.arange(3)).shape == (1, 1, VOCAB)  # the last position's logits


def test_perplexity_refuses_a_program_that_returns_the_last_logits_only():
    from fxquant.evaluate import perplexity

    m = export_llm(_model(), max_cache_len=16).module()
    with pytest.raises(ValueError, match='8 tokens in, logits for 1 positions.*logits="all"'):
        perplexity(
            lambda ids: m(ids, torch.arange(ids.shape[1])),
            torch.randint(0, VOCAB, (8,)),
            window=8,
            progress=False,
        )
