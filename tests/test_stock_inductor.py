"""``torch.compile(model)`` with the default backend on a model holding fxquant ops (a bridged
model, a quantized program's module) runs the CPU lowering's kernels, not the ops' reference
math (``fxquant.passes.stock``).

Oracles: the compiled output against the same module's eager call (which runs the lowering's
kernels: passes/eager.py) and against the reference math, by SQNR floors; the
compiled code calls a native or ``stock_*`` op and no semantic op.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn
from torch._inductor.utils import run_and_get_code

import fxquant
from fxquant.core.reference import sqnr
from fxquant.hf.bridge import quantize_linears
from fxquant.passes import cpu
from fxquant.passes.lower import CPU_LOWERINGS, lower
from fxquant.passes.stock import held_bytes, stock_op

pytestmark = pytest.mark.skipif(not cpu.available(), reason="the native CPU kernels do not build")

# compiled vs eager on the same kernels: Inductor's fused GELU can differ from eager's in the last
# bit, and where the dispatch table rounds activations to bf16 (int4's bf16 dot products) that
# flips a rounding now and then: 70 dB and more here, far above any scheme's error against the
# reference
SAME_KERNELS_DB = 45.0
SEMANTIC = re.compile(r"torch\.ops\.fxquant\.(\w+)\.default\(")


def _mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 64)).eval()


def _called_ops(code: list[str]) -> set[str]:
    return {m for c in code for m in SEMANTIC.findall(c)}


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize(
    ("recipe", "floor"),
    [
        *[("int8wo", 40), ("w8a8", 30), ("fp8-row", 25), ("int4wo-64", 18), ("w4a8-64", 18)],
        *[("int3wo-64", 12), ("sinq-int4-64", 18)],
    ],
)
def test_a_bridged_model_compiles_onto_the_lowerings_kernels(recipe, floor):
    model = _mlp()
    quantize_linears(model, recipe)
    compiled = torch.compile(model, dynamic=True)
    with torch.no_grad():
        for m in (1, 20):
            x = torch.randn(2, m, 128)
            got, code = run_and_get_code(compiled, x)
            want = model(x)  # eager: the lowering's kernels
            with fxquant.reference_math():
                ref = model(x)
            assert sqnr(want, got) >= SAME_KERNELS_DB
            assert sqnr(ref, got) >= floor
    called = _called_ops(code)
    assert called, code
    assert called.isdisjoint(op._opname for op in CPU_LOWERINGS), called  # no reference math


def test_a_quantized_programs_module_compiles_onto_the_kernels():
    x = torch.randn(5, 128)
    ep = torch.export.export(_mlp(), (x,))
    qep = fxquant.quantize(ep, "int4wo-64")
    module = qep.module()
    with torch.no_grad():
        got, code = run_and_get_code(torch.compile(module), x)
        want = lower(qep).module()(x)
    assert sqnr(want, got) >= SAME_KERNELS_DB
    assert "stock_int4_weight_only_linear" in _called_ops(code)


def test_the_prepacked_weights_follow_an_in_place_update():
    model = _mlp()
    quantize_linears(model, "int4wo-64")
    compiled = torch.compile(model)
    x = torch.randn(3, 128)
    with torch.no_grad():
        before = compiled(x)
        layer = model[0]
        layer.qweight.copy_(layer.qweight.flip(0))  # a new weight, same tensor
        after = compiled(x)
        assert sqnr(model(x), after) >= SAME_KERNELS_DB
    assert sqnr(before, after) < 20  # the flipped weight's output, not the old one's
    # the layers' int4 weights in the kernel's layout, held once each: nibbles, scales, offsets
    packed = sum(mod.qweight.numel() + 2 * 4 * mod.scale.numel() for mod in (model[0], model[2]))
    assert held_bytes(model.buffers()) == packed


@pytest.mark.parametrize("recipe", ["int4wo-64", "w4a8-64", "int3wo-64", "sinq-int4-64"])
def test_the_stock_ops_pass_opcheck(recipe):
    model = _mlp()
    quantize_linears(model, recipe)
    layer = model[0]
    consts = {n: getattr(layer, n) for n in layer._constants}
    op, args = layer.scheme.op_args(torch.randn(4, 128), consts, layer.bias)
    torch.library.opcheck(stock_op(op), args)


def test_export_keeps_the_semantic_op():
    model = _mlp()
    quantize_linears(model, "int4wo-64")
    ep = torch.export.export(model, (torch.randn(2, 128),))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert "fxquant.int4_weight_only_linear.default" in targets


def test_a_package_build_takes_the_lowerings_own_entries_and_gives_them_back():
    from torch._inductor.decomposition import select_decomp_table

    from fxquant.passes.lower import inductor_decompositions, lowerings
    from fxquant.passes.stock import is_stock

    op = torch.ops.fxquant.int4_weight_only_linear.default
    table = select_decomp_table()
    assert is_stock(table[op])
    with inductor_decompositions(lowerings("cpu")):
        # what an AOTInductor package traces: pure aten, no Python op a package cannot run
        assert table[op] is lowerings("cpu")[op]
    assert is_stock(table[op])


CHILD = """
import sys, torch
import fxquant
path, build = sys.argv[1], sys.argv[2] == "build"
x = torch.randn(3, 128, generator=torch.Generator().manual_seed(1))
if build:  # fxquant.api imported: the decompositions are registered
    torch.manual_seed(0)
    nn = torch.nn
    model = nn.Sequential(nn.Linear(128, 256), nn.GELU(), nn.Linear(256, 64)).eval()
    # int8 calls a native op straight from the graph, int4 its stock_* twin
    int4, int8 = (fxquant.QuantConfig.from_recipe(r).scheme for r in ("int4wo-64", "int8wo"))
    config = fxquant.QuantConfig(scheme=int4, overrides={"2": int8})
    ep = fxquant.quantize(torch.export.export(model, (x,)), config)
    torch.export.save(ep, path)
else:
    if sys.argv[2] == "api":  # the decompositions registered: the graph from the disk cache
        import fxquant.api
    ep = torch.export.load(path)
with torch.no_grad():
    out = torch.compile(ep.module())(x)
print(repr(out.norm().item()), "fxquant.passes.stock" in sys.modules)
"""


def test_a_graph_from_inductors_disk_cache_runs_where_it_was_built_for(tmp_path):
    """A process with the decompositions registered gets the cached graph (its native and
    stock_* ops loaded at their first call); one with only the ops compiles its own (the
    reference math), never a graph calling ops it has not loaded."""
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(tmp_path / "inductor"))
    path = str(tmp_path / "q.pt2")
    runs = {
        what: subprocess.run(
            [sys.executable, "-c", CHILD, path, what],
            env=env,
            capture_output=True,
            text=True,
            timeout=600,
        )
        for what in ("build", "api", "bare")
    }
    for what, run in runs.items():
        assert run.returncode == 0, (what, run.stderr[-3000:])
    out = {what: run.stdout.split() for what, run in runs.items()}
    assert out["api"] == out["build"]  # the same compiled graph, the same bits
    bare, imported = out["bare"]
    assert imported == "False"  # no stock_* op ran: the reference program, compiled here
    assert float(bare) == pytest.approx(float(out["build"][0]), rel=1e-2)
