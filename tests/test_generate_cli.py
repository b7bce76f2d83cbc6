"""``fxquant generate`` and ``fxquant quantize --llm``: the command line of LLM serving.

A tiny random Llama with SmolLM2's vocabulary (so SmolLM2's tokenizer serves it), saved as a
Hugging Face folder; packages built into a temporary package cache.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from fxquant import assets

tf = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_model_dir(tmp_path_factory):
    try:
        gguf = assets.smollm2_gguf()
    except assets.AssetMissingError as e:
        pytest.skip(str(e))
    cfg = tf.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        eos_token_id=None,
    )
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(cfg).eval()
    model.generation_config.eos_token_id = None
    path = tmp_path_factory.mktemp("tiny") / "model"
    model.save_pretrained(path)
    return path, gguf


def _fxquant(*args, cache, timeout=900):
    env = {**os.environ, "FXQUANT_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1"}
    return subprocess.run(
        [sys.executable, "-m", "fxquant.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )


@pytest.fixture(scope="module")
def int8_package(tiny_model_dir, tmp_path_factory):
    """``fxquant quantize --llm --aoti``: one package for the serving tests (an AOTInductor build
    is ~45 s of this file's time on two cores); returns (package, quantize's stdout, cache)."""
    model_dir, _ = tiny_model_dir
    cache = tmp_path_factory.mktemp("cache")
    pkg = cache / "q.pt2"
    out = _fxquant(
        "quantize", str(model_dir), "--recipe", "int8wo+lm_head", "--llm",
        "--max-cache-len", "64", "--aoti", str(pkg), cache=cache,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    return pkg, out.stdout, cache


def test_quantize_llm_then_generate_from_the_package(tiny_model_dir, int8_package):
    _, gguf = tiny_model_dir
    pkg, stdout, cache = int8_package
    assert "15 of 15 linear layers quantized" in stdout  # lm_head included
    gen = _fxquant(
        "generate", str(pkg), "--tokenizer", str(gguf), "--prompt", "Once upon a time",
        "--max-new-tokens", "8", cache=cache,
    )  # fmt: skip
    assert gen.returncode == 0, gen.stderr[-3000:]
    lines = gen.stdout.strip().splitlines()
    assert lines[0].startswith("Once upon a time")
    assert "prefill" in lines[-1] and "decode 8 tok at" in lines[-1]
    # too long for the package's cache: a clear error, nothing run
    long = _fxquant(
        "generate", str(pkg), "--tokenizer", str(gguf), "--prompt", "word " * 70,
        "--max-new-tokens", "8", cache=cache,
    )  # fmt: skip
    assert long.returncode != 0 and "max_cache_len=64" in long.stderr
    assert "Traceback" not in long.stderr
    # a package's dtype was fixed when it was built
    from fxquant.cli import main

    with pytest.raises(SystemExit, match="--recipe/--compare/--dtype build packages from a model"):
        main(["generate", str(pkg), "--dtype", "bf16"])


def test_serving_a_package_imports_no_passes(tiny_model_dir, int8_package, tmp_path):
    _, gguf = tiny_model_dir
    pkg, _, _ = int8_package
    script = textwrap.dedent(
        f"""
        import sys
        from fxquant.cli import main
        main(["generate", {str(pkg)!r}, "--tokenizer", {str(gguf)!r}, "--max-new-tokens", "4"])
        loaded = [m for m in sys.modules if m.startswith(("fxquant.passes", "fxquant.kernels"))]
        assert not loaded, loaded
        """
    )
    # an empty cache: the tokenizer is converted from the GGUF file in the serving process too
    env = {**os.environ, "FXQUANT_CACHE_DIR": str(tmp_path / "serving-cache")}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert run.returncode == 0, run.stderr[-3000:]
    assert (tmp_path / "serving-cache" / "models").is_dir()


def test_package_key_follows_the_inputs_and_fxquant_source(tmp_path, monkeypatch):
    from fxquant import packages
    from fxquant.core.config import QuantConfig

    f = tmp_path / "m.gguf"
    f.write_bytes(b"weights")
    key = packages.package_key(f, None, max_cache_len=64, max_batch=1)
    assert key == packages.package_key(f, None, max_cache_len=64, max_batch=1)
    int8 = QuantConfig.from_recipe("int8wo")
    assert key != packages.package_key(f, int8, max_cache_len=64, max_batch=1)
    assert key != packages.package_key(f, None, max_cache_len=128, max_batch=1)
    # the model's dtype is part of what the package computes
    bf16 = packages.package_key(f, None, max_cache_len=64, max_batch=1, dtype=torch.bfloat16)
    assert key != bf16
    assert key == packages.package_key(f, None, max_cache_len=64, max_batch=1, dtype=torch.float32)
    with pytest.raises(ValueError, match="float64"):
        packages.package_key(f, None, max_cache_len=64, max_batch=1, dtype=torch.float64)
    # a changed lowering (any Python file of fxquant) is a new package, version bump or not
    monkeypatch.setattr(packages, "_source_digest", lambda: "edited")
    assert key != packages.package_key(f, None, max_cache_len=64, max_batch=1)
