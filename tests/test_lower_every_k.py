"""Every recipe's CPU and CUDA lowerings take every K in 1..200 without crashing, and stay the math.

The kernels a lowering calls have shape preconditions (aten's ``_weight_int8pack_mm`` read K in
steps of 16 and segfaulted at K = 8, 24, 100, ...; int4 kernels want whole groups; a Triton
kernel's masks must cover a K that is not a multiple of its block); a lowering must pad, fall
back or skip, never pass a shape that can crash. One model holds a Linear for each K from 1 to
200, quantized by each recipe; each lowering runs in a subprocess (a native crash fails the
test with its signal instead of killing pytest): the CPU one on the native kernels and on the
aten compositions, the CUDA one with its Triton kernels run by the interpreter on CPU tensors,
at M = 1 (decode kernels) and M = 17 (prefill kernels). The lowered compositions are called
eagerly (an ``fx.Interpreter`` over the prepacked program on CPU, over the quantized program on
CUDA, which takes no prepack), which is what ``lower()``'s retrace records, without its 17-40 s
per recipe; the AOTInductor and Inductor paths are tested elsewhere on fewer shapes. Both CPU
lowerings run in the same children, on the same quantized programs: the export, the quantizing
and the report are half the work, and were done twice when each lowering had its own.
"""

from __future__ import annotations

import json
import os
import textwrap
from pathlib import Path

import pytest

import fxquant
from conftest import run_in_shards

pytestmark = pytest.mark.slow

K_MAX = 200
# The interpreter runs a Triton kernel ~1000× slower than a GPU: every K up to 33 (each residue
# of the 16- and 32-wide blocks and of int4's 32-groups, and one past), then the edges of the
# 64- and 128-wide groups and fp8 blocks and a few odd ones up to 200, the K that crashed aten's
# int8 kernel among them (8 min for all 200, ~1 min for these 42 on two cores; the GPU script
# sweeps 1..200 on a real device).
CUDA_KS = [*range(1, 34), 63, 64, 65, 100, 127, 128, 129, 199, 200]
ROOT = Path(__file__).resolve().parent.parent

CHILD = textwrap.dedent(
    """
    import json, sys, time
    import torch
    import fxquant
    from fxquant.kernels.interpreter import allow_interpreted_kernels

    allow_interpreted_kernels()  # under torch 2.11: before the lowering imports the kernels
    from fxquant.passes.lower import lowerings, prepacked
    from fxquant.core.reference import sqnr

    recipes, device = sys.argv[1].split(","), sys.argv[3]
    ks = [int(k) for k in sys.argv[2].split(",")]
    k_max = max(ks)
    ms = [int(m) for m in sys.argv[4].split(",")]
    # on CPU, "native" and "aten": the CPU lowering on the native kernels and on the aten
    # compositions (the native kernels switched off as conftest's cpu_kernels fixture does)
    kernel_sets = sys.argv[5].split(",")

    # N = 24 (not a whole 16-column panel) for every K, and N = 32 for whole 64-groups: SINQ
    # takes a layer only when N·K/64 is a multiple of 32, which no N = 24 layer is
    shapes = [(k, 24) for k in ks] + [(k, 32) for k in ks if k % 64 == 0]

    class EveryK(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.ModuleList(torch.nn.Linear(k, n) for k, n in shapes)

        def forward(self, x):
            return tuple(fc(x[..., : fc.in_features]) for fc in self.fc)

    class Lowered(torch.fx.Interpreter):
        def __init__(self, gm):
            super().__init__(gm)
            self.table = lowerings(device)

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
    from fxquant.passes import cpu

    native = cpu.available
    # the parent saw the native kernels load: a child that cannot must not pass on the aten path
    assert "native" not in kernel_sets or native(), "the native CPU kernels did not load here"
    out = {kernels: {} for kernels in kernel_sets}
    for recipe in recipes:
        qep = fxquant.quantize(ep, recipe)
        # ExportedProgram.module() unlifts every constant again (~1.5 s for these 200 layers):
        # once per program, not per M
        ref = qep.module()
        rows = fxquant.report(qep).rows
        xs = [torch.randn(m, k_max) for m in ms]
        with torch.no_grad():
            wants = [ref(xi) for xi in xs]
        for kernels in kernel_sets:
            t0 = time.perf_counter()
            cpu.available = native if kernels != "aten" else (lambda: False)
            gm = prepacked(qep).module() if device == "cpu" else ref
            worst, at = float("inf"), None
            for xi, want in zip(xs, wants):
                with torch.no_grad():
                    got = Lowered(gm).run(xi)
                for i, (k, n) in enumerate(shapes):
                    s = sqnr(want[i], got[i])
                    if s < worst:
                        worst, at = s, f"{k}x{n}"
            cpu.available = native
            out[kernels][recipe] = {
                "worst_db": worst,
                "at_k": at,
                "quantized": sum(r["status"] == "quantized" for r in rows),
                "s": round(time.perf_counter() - t0, 1),
            }
            print(kernels, recipe, out[kernels][recipe], file=sys.stderr, flush=True)
    print(json.dumps(out))
    """
)

# lowered vs semantic program, SQNR floor (dB): the aten int8/int4 kernels take bf16
# activations (~50 dB a layer); everything else is the reference math in fp32
_BF16 = (
    *("int8wo", "int4wo", "w8a8", "w4a8", "int3wo", "int2wo"),
    *("hqq-int4", "mlx-int4", "sinq-int4"),
)


def test_every_recipe_lowers_every_k_from_1_to_200():
    from fxquant.passes import cpu

    kernel_sets = ["native", "aten"] if cpu.available() else ["aten"]
    # the native kernels themselves at every M: a class's plan may hand a few rows to a
    # candidate with other activation numerics (bf16_dot rounds x to bf16, ~50 dB a layer),
    # whose kernels sweep every K in tests/test_kernels_cpu.py
    env = dict(os.environ, FXQUANT_CPU_DISPATCH="native")
    recipes = list(fxquant.RECIPES)
    result = _lower_every_k(recipes, "cpu", range(1, K_MAX + 1), "1,3", env, kernel_sets)
    for kernels in kernel_sets:
        for recipe, r in result[kernels].items():
            floor = 40.0 if (kernels == "aten" and recipe.startswith(_BF16)) else 80.0
            assert r["worst_db"] >= floor, (kernels, recipe, r)
            assert r["quantized"] > 0 or not _takes_any(recipe, range(1, K_MAX + 1)), (
                kernels, recipe, r,
            )  # fmt: skip
    if "native" not in kernel_sets:
        pytest.skip("the aten lowering passed; the native CPU kernels are unavailable")


def _takes_any(recipe: str, ks) -> bool:
    """Whether the recipe's scheme takes any of these K (higgs-int4's groups of 256 take none
    up to 200): a recipe that does must not skip every layer."""
    scheme = fxquant.RECIPES[recipe]
    return any(scheme.unsupported_reason(out_features=32, in_features=k) is None for k in ks)


def _lower_every_k(
    recipes: list[str], device: str, ks, rows: str, env: dict, kernel_sets: list[str]
) -> dict:
    """The child over ``recipes``, one shard of them per core (each single-threaded):
    {kernel set: {recipe: result}}."""
    ks = ",".join(map(str, ks))
    env = dict(env, OMP_NUM_THREADS="1")
    result: dict = {kernels: {} for kernels in kernel_sets}
    for rc, stdout, stderr in run_in_shards(
        lambda i, n: [
            "-c", CHILD, ",".join(recipes[i::n]), ks, device, rows, ",".join(kernel_sets)
        ],
        most=len(recipes), cwd=ROOT, env=env, timeout=1500,
    ):  # fmt: skip
        assert rc == 0, (
            f"the {device} lowering crashed or failed (exit {rc}); after the recipes on the "
            f"last lines it finished:\n{stderr[-3000:]}"
        )
        for kernels, done in json.loads(stdout.strip().splitlines()[-1]).items():
            result[kernels].update(done)
    assert all(set(done) == set(recipes) for done in result.values())
    return result


@pytest.mark.interpreter
def test_every_recipe_lowers_every_k_for_cuda_under_the_interpreter():
    pytest.importorskip("triton")
    from fxquant.kernels.configs import DECODE_MAX_M

    env = dict(os.environ, TRITON_INTERPRET="1")
    recipes = list(fxquant.RECIPES)
    result = _lower_every_k(recipes, "cuda", CUDA_KS, f"1,{DECODE_MAX_M + 1}", env, ["triton"])
    for recipe, r in result["triton"].items():
        # fp32 accumulation like the reference; activation codes on a rounding boundary may
        # round the other way (as in test_lower_cuda)
        assert r["worst_db"] >= 60.0, (recipe, r)
        assert r["quantized"] > 0 or not _takes_any(recipe, CUDA_KS), (recipe, r)
