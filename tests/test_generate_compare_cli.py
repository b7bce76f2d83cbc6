"""``fxquant generate <model> --recipe R --dtype bf16 --compare fp32``: builds both packages (R
quantized from the model loaded in bf16, the float model in fp32) into the package cache, prints
them side by side, and serves them from the cache the second time.

Its own file (the tiny model from test_generate_cli.py): the suite runs one file per worker, and
this test's two package builds would otherwise queue behind the other serving tests.
"""

from __future__ import annotations

import json

import pytest
from test_generate_cli import _fxquant
from test_generate_cli import tiny_model_dir as tiny_model_dir  # the module fixture

pytest.importorskip("transformers")
pytestmark = pytest.mark.slow


def test_generate_from_a_model_builds_caches_and_compares(tiny_model_dir, tmp_path):
    model_dir, gguf = tiny_model_dir
    args = (
        "generate", str(model_dir), "--tokenizer", str(gguf), "--recipe", "int8wo",
        "--dtype", "bf16", "--compare", "fp32", "--max-new-tokens", "6", "--max-cache-len", "64",
    )  # fmt: skip
    first = _fxquant(*args, cache=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    assert "built in" in first.stderr
    table = first.stdout
    assert "decode tok/s" in table and "int8wo (bf16)" in table and "fp32" in table
    # each package holds the dtype it was asked for: the bf16 one's float tensors are bf16
    infos = {
        json.loads(p.read_text())["dtype"]: p.with_suffix(".pt2").stat().st_size
        for p in (tmp_path / "packages").glob("*.json")
    }
    assert sorted(infos) == ["bf16", "fp32"]
    # the tiny model's weights are mostly its embedding (49152 x 64, tied to lm_head, which
    # int8wo keeps in float): 2 bytes a value fewer in bf16, beside the same compiled code
    assert infos["fp32"] - infos["bf16"] > 0.8 * 49152 * 64 * 2
    again = _fxquant(*args, cache=tmp_path)
    assert again.returncode == 0, again.stderr[-3000:]
    assert again.stderr.count("from the cache") == 2 and "built in" not in again.stderr
    assert len(list((tmp_path / "packages").glob("*.pt2"))) == 2
    typo = _fxquant("generate", str(model_dir), "--recipe", "int9wo", cache=tmp_path)
    assert typo.returncode != 0 and "unknown recipe 'int9wo'" in typo.stderr
