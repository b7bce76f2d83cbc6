"""Every recipe's CPU lowering takes every K in 1..200 without crashing, and stays the math.

The kernels a lowering calls have shape preconditions (aten's ``_weight_int8pack_mm`` read K in
steps of 16 and segfaulted at K = 8, 24, 100, ...; int4 kernels want whole groups); a lowering
must pad, fall back or skip, never pass a shape that can crash. One model holds a Linear for
each K from 1 to 200, quantized by each recipe; each recipe's lowering runs in a subprocess (a
native crash fails the test with its signal instead of killing pytest), on the native kernels
and on the aten compositions. The lowered compositions are called eagerly on the prepacked
program (an ``fx.Interpreter``), which is what ``lower()``'s retrace records, without its
17-40 s per recipe; the AOTInductor and Inductor paths are tested elsewhere on fewer shapes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

import fxquant

pytestmark = pytest.mark.slow

K_MAX = 200

CHILD = textwrap.dedent(
    """
    import json, sys
    import torch
    import fxquant
    from fxquant.passes.lower import lowerings, prepacked
    from fxquant.reference import sqnr

    recipes, k_max = sys.argv[1].split(","), int(sys.argv[2])

    class EveryK(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.ModuleList(torch.nn.Linear(k, 24) for k in range(1, k_max + 1))

        def forward(self, x):
            return torch.stack([fc(x[..., : fc.in_features]) for fc in self.fc])

    class Lowered(torch.fx.Interpreter):
        table = lowerings("cpu")

        def call_function(self, target, args, kwargs):
            fn = self.table.get(target)
            if fn is None:
                return super().call_function(target, args, kwargs)
            return fn(*args, **kwargs)

    torch.manual_seed(0)
    x = torch.randn(3, k_max)
    ep = torch.export.export(
        EveryK().eval(), (x,), dynamic_shapes=({0: torch.export.Dim.DYNAMIC},)
    )
    out = {}
    for recipe in recipes:
        qep = fxquant.quantize(ep, recipe)
        gm = prepacked(qep).module()
        worst, at = float("inf"), None
        for m in (1, 3):
            xi = torch.randn(m, k_max)
            with torch.no_grad():
                got, want = Lowered(gm).run(xi), qep.module()(xi)
            for k in range(k_max):
                s = sqnr(want[k], got[k])
                if s < worst:
                    worst, at = s, k + 1
        rows = fxquant.report(qep).rows
        out[recipe] = {
            "worst_db": worst,
            "at_k": at,
            "quantized": sum(r["status"] == "quantized" for r in rows),
        }
        print(recipe, out[recipe], file=sys.stderr, flush=True)
    print(json.dumps(out))
    """
)

# lowered vs semantic program, SQNR floor (dB): the aten int8/int4 kernels take bf16
# activations (~50 dB a layer); everything else is the reference math in fp32
_BF16 = ("int8wo", "int4wo", "w8a8", "w4a8", "int3wo", "int2wo", "hqq-int4")


@pytest.mark.parametrize("kernels", ["native", "aten"])
def test_every_recipe_lowers_every_k_from_1_to_200(kernels, tmp_path):
    from fxquant.passes import lower_native

    if kernels == "native" and not lower_native.available():
        pytest.skip("native CPU kernels unavailable")
    env = dict(os.environ, FXQUANT_NATIVE="1" if kernels == "native" else "0")
    recipes = list(fxquant.RECIPES)
    out = subprocess.run(
        [sys.executable, "-c", CHILD, ",".join(recipes), str(K_MAX)],
        capture_output=True, text=True, timeout=1200, env=env,
    )  # fmt: skip
    assert out.returncode == 0, (
        f"the lowering crashed or failed (exit {out.returncode}); after the recipes on the "
        f"last lines it finished:\n{out.stderr[-3000:]}"
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert set(result) == set(recipes)
    for recipe, r in result.items():
        floor = 40.0 if (kernels == "aten" and recipe.startswith(_BF16)) else 80.0
        assert r["worst_db"] >= floor, (recipe, r)
        assert r["quantized"] > 0, (recipe, r)  # not all skipped
