"""Real assets (fxquant.assets) and the evaluation harness (fxquant.evaluate).

Fast tests check that the files are found, the text is clean and the harness does its
arithmetic; ``slow`` ones load SmolLM2 / MiniLM and check export and perplexity on real weights.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.nn.functional as F

from conftest import SMOLLM2_PPL_1024  # noqa: E402
from fxquant import assets, evaluate

# ---------------------------------------------------------------------------------------------
# Files
# ---------------------------------------------------------------------------------------------


def test_asset_files_found():
    assert assets.smollm2_gguf().stat().st_size > 50_000_000
    assert (assets.minilm_dir() / "model.safetensors").is_file()
    assert (assets.minilm_dir() / "tokenizer.json").is_file()
    assert assets.wiki_dump_path().suffix == ".bz2"
    # One article per line: 300 background articles, 50 held-out ones.
    assert len(assets.lee_text("background").splitlines()) == 300
    assert len(assets.lee_text("test").splitlines()) == 50
    assert "£3,000" in assets.lee_text("test")  # the one non-ASCII byte, in Latin-1


def test_lee_rejects_unknown_corpus():
    with pytest.raises(ValueError, match="which='train'"):
        assets.lee_text("train")


def test_missing_package_says_what_to_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "gensim" else real(name, *a)
    )
    with pytest.raises(assets.AssetMissingError, match=r"pip install --no-deps gensim==4\.4\.0"):
        assets.lee_text()


def test_wiki_text_is_plain_prose():
    text = assets.wiki_text(max_chars=50_000)
    assert 45_000 < len(text) <= 50_000
    assert text.startswith("Anarchism\n\nAnarchism is a political philosophy")
    for markup in ("[[", "]]", "{{", "<ref", "'''", "&quot;", "thumb|"):
        assert markup not in text, markup


def test_clean_wikitext_resolves_nested_links():
    raw = (
        "'''Albedo''' is [[reflectance|reflecting power]].<ref>Src</ref>{{cite|x={{y}}}}\n"
        "[[File:A.svg|thumb|Caption with [[a link]]]]\n== History ==\n* See [[Moon]]."
    )
    assert assets.clean_wikitext(raw) == "Albedo is reflecting power.\n\nHistory\nSee Moon."


# ---------------------------------------------------------------------------------------------
# Harness arithmetic, with stand-in "models"
# ---------------------------------------------------------------------------------------------


def test_perplexity_of_uniform_logits_is_vocab_size():
    vocab, calls = 37, []

    def uniform(ids):
        calls.append(tuple(ids.shape))
        return torch.zeros(*ids.shape, vocab)

    ppl = evaluate.perplexity(uniform, torch.arange(1100) % vocab, window=512, progress=False)
    assert ppl == pytest.approx(vocab, rel=1e-5)
    # Non-overlapping windows over the first max_tokens; the 76-token tail is its own window.
    assert calls == [(1, 512), (1, 512), (1, 76)]


def test_perplexity_is_mean_over_tokens_not_windows():
    # Logits depend only on the current token, so each prediction's NLL is known in isolation.
    # 20 tokens in windows of 6 predict 5 + 5 + 5 + 1 = 16 tokens; a mean of window means (or
    # context carried across windows) would give a different number.
    torch.manual_seed(0)
    vocab = 8
    table = torch.randn(vocab, vocab)
    ids = torch.randint(0, vocab, (20,))
    nll = [
        F.cross_entropy(table[ids[t - 1]].unsqueeze(0), ids[t].unsqueeze(0)).item()
        for t in range(1, 20)
        if t % 6 != 0  # the first token of each window is context only
    ]
    assert len(nll) == 16
    ppl = evaluate.perplexity(lambda x: table[x], ids, window=6, progress=False)
    assert ppl == pytest.approx(math.exp(sum(nll) / len(nll)), rel=1e-6)


def test_greedy_decode_and_rate():
    vocab = 11

    def next_is_plus_one(x):
        return F.one_hot((x + 1) % vocab, vocab).float()

    out = evaluate.greedy_decode(next_is_plus_one, torch.tensor([[3, 4]]), new_tokens=5)
    assert out.tolist() == [5, 6, 7, 8, 9]
    rate = evaluate.decode_tokens_per_s(next_is_plus_one, [3, 4], new_tokens=4)
    assert rate > 0
    with pytest.raises(ValueError, match="new_tokens=1"):
        evaluate.decode_tokens_per_s(next_is_plus_one, [3], new_tokens=1)


def test_export_rejects_size_one_examples():
    # torch.export would specialize a dim whose example size is 1 and then refuse Dim.DYNAMIC.
    with pytest.raises(ValueError, match="0/1"):
        evaluate.export_causal_lm(torch.nn.Identity(), example_batch=1, vocab_size=10)


# ---------------------------------------------------------------------------------------------
# Real models
# ---------------------------------------------------------------------------------------------


def _embed(model, tokenizer, sentences):
    batch = tokenizer(sentences, padding=True, return_tensors="pt")
    with torch.no_grad():
        hidden = model(**batch).last_hidden_state
    mask = batch["attention_mask"].unsqueeze(-1).float()
    return F.normalize((hidden * mask).sum(1) / mask.sum(1), dim=-1)


@pytest.mark.slow
def test_minilm_embeddings_are_sane():
    model, tokenizer = assets.load_minilm()
    assert model.config.hidden_size == 384 and model.config.num_hidden_layers == 6
    emb = _embed(
        model,
        tokenizer,
        [
            "Bushfires forced hundreds of residents to leave their homes.",
            "Hundreds of people fled their houses as a wildfire approached.",
            "The central bank left interest rates unchanged this month.",
        ],
    )
    assert emb.shape == (3, 384)
    torch.testing.assert_close(emb.norm(dim=-1), torch.ones(3))
    paraphrase, unrelated = (emb[0] @ emb[1]).item(), (emb[0] @ emb[2]).item()
    assert paraphrase > 0.6 and unrelated < 0.3, (paraphrase, unrelated)


@pytest.mark.slow
def test_smollm2_export_reproduces_eager_at_two_dynamic_sizes(smollm2, smollm2_program, lee_ids):
    model, _ = smollm2
    assert sum(p.numel() for p in model.parameters()) == 134_515_008
    ep = smollm2_program
    wrapper = evaluate.CausalLMWrapper(model)
    # Neither size is the (2, 16) example; batch 1 is below the [2, inf) range export reports.
    for batch, seq in [(1, 7), (3, 33)]:
        ids = lee_ids[: batch * seq].view(batch, seq)
        with torch.no_grad():
            want, got = wrapper(ids), ep.module()(ids)
        assert got.shape == (batch, seq, model.config.vocab_size)
        torch.testing.assert_close(got, want, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_smollm2_fp32_perplexity(smollm2, lee_ids):
    model, _ = smollm2
    ppl = evaluate.perplexity(
        evaluate.CausalLMWrapper(model), lee_ids, max_tokens=1024, progress=False
    )
    assert 10 < ppl < 60
    assert ppl == pytest.approx(SMOLLM2_PPL_1024, abs=0.02)
