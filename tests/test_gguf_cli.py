"""``fxquant quantize model.gguf``: the file's own blocks where the recipe asks for what they
are, re-quantization (said so) where it does not, and ``--recipe gguf`` for "as stored".

The file is a tiny Llama written with gguf-py (``conftest.write_tiny_llama_gguf``): Q4_1
linears as SmolLM2's file has them, and Q8_0 value projections whose scale changes per block
of 32 (no exact fxquant form).
"""

from __future__ import annotations

import json

import pytest
import torch

import fxquant
from fxquant.checkpoints.gguf import read_gguf
from fxquant.cli import main
from fxquant.core.config import scheme_from_dict

pytestmark = pytest.mark.slow  # transformers' GGUF loader and an export per test (~5 s each)

Q4_1 = {"type": "IntxWeightOnly", "bits": 4, "group_size": 32, "zero_point": "float"}


def _quantize(tmp_path, capsys, gguf, *flags):
    out = tmp_path / "q.pt2"
    assert main(["quantize", str(gguf), *flags, "--out", str(out)]) == 0
    err = capsys.readouterr().err
    ep = fxquant.load_program(out)
    rows = {r["name"]: r for r in fxquant.report(ep).rows}
    return ep, rows, err


def _float_model(gguf):
    import transformers

    return transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, dtype=torch.float32
    ).eval()


def test_a_recipe_that_is_the_files_type_carries_its_blocks_exactly(
    tiny_llama_gguf, tmp_path, capsys
):
    ep, rows, err = _quantize(tmp_path, capsys, tiny_llama_gguf, "--scheme", json.dumps(Q4_1))
    assert "12 of its 14 quantized linears carry the file's own blocks, exactly" in err
    assert "2 quantized from the dequantized file: no exact form (2 × Q8_0" in err
    given = sorted(n for n, r in rows.items() if r.get("weights") == "given")
    assert len(given) == 12 and not any("v_proj" in n for n in given)
    assert rows["model.model.layers.0.self_attn.v_proj"]["status"] == "quantized"  # from float
    assert "weights given" in str(fxquant.report(ep))

    # the program's constants are the reader's, bit for bit (rotary rows of q/k undone)
    ckpt = read_gguf(tiny_llama_gguf, refused={}).with_prefix("model.")
    for name, weight in ckpt.weights.items():
        module = name.removesuffix(".weight")
        for part, t in weight.tensors.items():
            assert torch.equal(ep.state_dict[f"{module}.{part}"], t), (module, part)


def test_the_files_blocks_compute_what_the_dequantized_model_does(
    tiny_llama_gguf, tmp_path, capsys
):
    # v_proj (Q8_0 with a scale per block: no exact form) kept in float: nothing is
    # re-quantized, so the program is transformers' dequantized model up to fp32 rounding
    config = tmp_path / "cfg.json"
    config.write_text(
        fxquant.QuantConfig(
            scheme=scheme_from_dict(Q4_1), modules_to_not_convert=("v_proj", "lm_head")
        ).to_json()
    )
    ep, rows, err = _quantize(tmp_path, capsys, tiny_llama_gguf, "--config", str(config))
    assert "12 of its 14 quantized linears carry the file's own blocks, exactly" in err
    assert "2 kept in float: no exact form" in err
    ids = torch.randint(0, 256, (2, 7))
    want = _float_model(tiny_llama_gguf)(ids).logits
    torch.testing.assert_close(ep.module()(ids), want, rtol=1e-4, atol=1e-4)


def test_another_recipe_is_said_to_requantize(tiny_llama_gguf, tmp_path, capsys):
    _, rows, err = _quantize(tmp_path, capsys, tiny_llama_gguf, "--recipe", "int8wo")
    assert "0 of its 14 quantized linears carry the file's own blocks" in err
    assert "12 re-quantized from the dequantized file: the config asks for another scheme" in err
    assert not any(r.get("weights") == "given" for r in rows.values())


def test_recipe_gguf_keeps_the_files_types(tiny_llama_gguf, tmp_path, capsys):
    _, rows, err = _quantize(tmp_path, capsys, tiny_llama_gguf, "--recipe", "gguf")
    assert "12 of its 14 quantized linears carry the file's own blocks, exactly" in err
    assert "2 kept in float: no exact form" in err
    quantized = [n for n, r in rows.items() if r["status"] == "quantized"]
    assert len(quantized) == 12
    assert all(rows[n].get("weights") == "given" for n in quantized)
    assert rows["model.model.layers.1.self_attn.v_proj"]["status"] == "skipped"
    assert rows["model.lm_head"]["status"] == "skipped"  # tied to the float embedding


def test_recipe_gguf_needs_a_gguf_source(tmp_path):
    with pytest.raises(SystemExit, match="--recipe gguf keeps a GGUF file's own types"):
        main(["quantize", "mod:fn", "--recipe", "gguf", "--out", str(tmp_path / "q.pt2")])
