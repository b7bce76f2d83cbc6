"""``fxquant.packages.converted``: a GGUF file's model and tokenizer read once, then served from
a Hugging Face folder in the cache (transformers' GGUF reader takes 20+ s on SmolLM2).

The conversion must be invisible: the same weights bit for bit, the same tokens, the same
special ids, and nothing half-written when the file cannot be read.
"""

from __future__ import annotations

import pytest
import torch

tf = pytest.importorskip("transformers")
pytest.importorskip("gguf")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("FXQUANT_CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path / "cache"


def test_the_converted_model_and_tokenizer_equal_the_gguf_readers(tiny_llama_gguf, cache):
    from fxquant.packages import converted, load_causal_lm, load_tokenizer

    path = tiny_llama_gguf
    direct = tf.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
    model = load_causal_lm(path)
    assert (converted(path, "model") / "config.json").is_file()
    again = load_causal_lm(path)  # from the folder this time
    want = direct.state_dict()
    for got in (model.state_dict(), again.state_dict()):
        assert got.keys() == want.keys()
        for name, t in want.items():
            assert torch.equal(got[name], t), name
    assert again.lm_head.weight.data_ptr() == again.model.embed_tokens.weight.data_ptr()  # tied
    # plain weights, a plain model: no GGUF quantizer attached, in any dtype
    cfg = (converted(path, "model") / "config.json").read_text()
    assert "quantization_config" not in cfg
    bf16 = load_causal_lm(path, dtype=torch.bfloat16)
    assert getattr(again, "hf_quantizer", None) is None is getattr(bf16, "hf_quantizer", None)
    assert bf16.lm_head.weight.dtype == torch.bfloat16
    ids = torch.tensor([[0, 5, 17, 200]])
    torch.testing.assert_close(again(ids).logits, direct(ids).logits, rtol=0, atol=0)

    want_tok = tf.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    tok = load_tokenizer(path)
    assert converted(path, "tokenizer").is_dir()
    text = "t3t4 t17t200t9"
    assert tok(text).input_ids == want_tok(text).input_ids
    assert (tok.bos_token_id, tok.eos_token_id, len(tok)) == (
        want_tok.bos_token_id,
        want_tok.eos_token_id,
        len(want_tok),
    )


def test_a_changed_file_converts_anew_and_a_broken_one_leaves_nothing(
    tiny_llama_gguf, cache, tmp_path
):
    import os
    import shutil

    from fxquant.checkpoints import CheckpointError
    from fxquant.packages import converted

    path = tmp_path / "copy.gguf"
    shutil.copy(tiny_llama_gguf, path)
    first = converted(path, "tokenizer")
    os.utime(path, (1, 1))  # another modification time: another key
    assert converted(path, "tokenizer") != first

    broken = tmp_path / "broken.gguf"
    broken.write_bytes(tiny_llama_gguf.read_bytes()[:4000])
    before = sorted((cache / "models").iterdir())
    with pytest.raises(CheckpointError, match="broken.gguf: not a readable GGUF file"):
        converted(broken, "model")
    assert sorted((cache / "models").iterdir()) == before  # no empty or partial folder
    with pytest.raises(FileNotFoundError, match="no GGUF file"):
        converted(tmp_path / "absent.gguf", "model")
    with pytest.raises(ValueError, match="allowed: 'model', 'tokenizer'"):
        converted(path, "weights")
