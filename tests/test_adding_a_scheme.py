"""``docs/adding_a_scheme.md`` is true: its three code blocks, dropped into a copy of the source
tree (and nothing else edited), make a scheme that quantizes, reports, passes ``opcheck``,
lowers for the CPU and runs its Triton kernel (under the interpreter) as the CUDA lowering.

The copy runs in a subprocess: a scheme registered in this process would join every other
test's recipe list.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "adding_a_scheme.md"
# where each top folder of the repo lands in an installed tree
INSTALLED = {"fxquant": "fxquant", "passes": "fxquant/passes", "kernels": "fxquant/kernels"}

CHECK = textwrap.dedent(
    """
    import torch
    from torch import nn
    from torch.library import opcheck

    import fxquant
    from fxquant.core.reference import sqnr
    from fxquant.core.schemes.q8_0 import q8_0_linear, quantize_q8_0
    from fxquant.passes.lower import lower, lowerings

    assert fxquant.RECIPES["q8_0"] == fxquant.Q8_0WeightOnly()
    assert "Q8_0WeightOnly" in fxquant.__all__
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 96), nn.GELU(), nn.Linear(96, 40), nn.Linear(40, 8))
    x = torch.randn(3, 64)
    ep = fxquant.quantize(model, "q8_0", example_inputs=(x,))
    rep = fxquant.report(ep)
    print(rep)
    assert [r.status for r in rep.rows] == ["quantized", "quantized", "skipped"], rep.rows
    assert "not a multiple of 32" in rep.rows[2].reason
    y = ep.module()(x)
    assert sqnr(model(x), y) > 35, sqnr(model(x), y)

    op = torch.ops.fxquant.q8_0_linear.default
    w = torch.randn(40, 96)
    q, s = quantize_q8_0(w)
    opcheck(op, (torch.randn(2, 5, 96), q, s, torch.randn(40)))
    assert sqnr(w, fxquant.Q8_0WeightOnly().quantize(w).dequantized) > 38

    assert op in lowerings("cpu")
    torch.testing.assert_close(lower(ep, device="cpu").module()(x), y)

    cuda = lowerings("cuda")[op]  # the Triton kernel, run by the interpreter on CPU tensors
    for m, dtype in ((1, torch.float32), (37, torch.float32), (5, torch.bfloat16)):
        xm = torch.randn(m, 96, dtype=dtype)
        want = q8_0_linear(xm, q, s, None)
        got = cuda(xm, q, s, None)
        assert got.dtype == dtype and sqnr(want.float(), got.float()) > 40, (m, dtype)
    print("ok")
    """
)


def _blocks() -> dict[str, str]:
    """The doc's python blocks by the path their first line names."""
    found = {}
    for block in re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S):
        first, _, body = block.partition("\n")
        found[first.removeprefix("# ").strip()] = body
    return found


def test_the_doc_names_three_files_one_per_layer():
    assert sorted(_blocks()) == [
        "fxquant/core/schemes/q8_0.py",
        "kernels/q8_0.py",
        "passes/cpu/q8_0.py",
    ]


def test_the_docs_three_files_make_a_working_scheme(tmp_path):
    pytest.importorskip("triton")
    tree = tmp_path / "tree"
    for src, dst in INSTALLED.items():
        shutil.copytree(ROOT / src, tree / dst, ignore=shutil.ignore_patterns("__pycache__"))
    for path, body in _blocks().items():
        top, _, rest = path.partition("/")
        target = tree / INSTALLED[top] / rest
        assert not target.exists(), f"{path} is a real file now: pick another example"
        target.write_text(body)
    env = {**os.environ, "PYTHONPATH": str(tree), "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-c", CHECK], env=env, cwd=tmp_path, capture_output=True, text=True
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr
    assert "Q8_0WeightOnly()" in run.stdout  # the report names the new scheme
