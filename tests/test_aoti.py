"""AOTInductor: a quantized program packages, loads and runs in a process that never imports
fxquant, with its batch and sequence dims still dynamic."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch
from torch.export import Dim

import fxquant
from conftest import TinyLlama
from fxquant.core.reference import sqnr

RUNNER = textwrap.dedent(
    """
    import json, sys
    import torch
    pkg = torch._inductor.aoti_load_package(sys.argv[1])
    outs = {}
    for b, t in [(1, 1), (2, 7), (3, 19)]:
        torch.manual_seed(b * 100 + t)
        ids = torch.randint(0, 96, (b, t))
        outs[f"{b}x{t}"] = pkg(ids).tolist()
    assert "fxquant" not in sys.modules, "the package pulled in fxquant"
    try:
        torch.ops.fxquant.int8_weight_only_linear
    except (AttributeError, RuntimeError):
        pass
    else:
        raise AssertionError("fxquant ops are registered in the runner")
    json.dump(outs, open(sys.argv[2], "w"))
    """
)


@pytest.mark.slow
def test_aot_package_runs_without_fxquant(tmp_path):
    torch.manual_seed(0)
    model = TinyLlama().eval()
    cfg = fxquant.QuantConfig(
        scheme=fxquant.Int8WeightOnly(),
        overrides={
            r"layers\.1\.(gate|up|down)_proj": fxquant.Int4WeightOnly(group_size=64),
            r"layers\.1\.[qkvo]_proj": fxquant.Int8DynamicActivation(),
        },
    )
    ids = torch.randint(0, 96, (2, 8))
    qep = fxquant.quantize(
        model, cfg, example_inputs=(ids,), dynamic_shapes=({0: Dim.DYNAMIC, 1: Dim.DYNAMIC},)
    )
    path = tmp_path / "model_aoti.pt2"
    pkg = fxquant.aot_compile(qep, path)
    # The CPU int kernels take bf16 activations (passes/lower.py): the package agrees with the
    # semantic program to ~45 dB, not bit for bit.
    assert sqnr(qep.module()(ids), pkg(ids)) > 35

    out = tmp_path / "out.json"
    subprocess.run([sys.executable, "-c", RUNNER, str(path), str(out)], check=True, timeout=300)
    for key, values in json.loads(out.read_text()).items():
        b, t = map(int, key.split("x"))
        torch.manual_seed(b * 100 + t)
        expected = qep.module()(torch.randint(0, 96, (b, t)))
        assert sqnr(expected, torch.tensor(values)) > 35, key


def test_aot_compile_rejects_bad_path(tmp_path):
    ep = torch.export.export(torch.nn.Linear(4, 4), (torch.randn(1, 4),))
    with pytest.raises(ValueError, match=r"must end in \.pt2"):
        fxquant.aot_compile(ep, tmp_path / "model.so")
    assert list(tmp_path.iterdir()) == []
