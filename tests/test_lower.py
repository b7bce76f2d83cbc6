"""CPU lowering: every fxquant:: op becomes aten ops that compute the reference math."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import fxquant
from conftest import Mixed
from fxquant.passes.lower import CPU_DECOMPOSITIONS, CPU_LOWERINGS, lower, lowerings
from fxquant.passes.rewrite import counters
from fxquant.reference import sqnr

RECIPES = list(fxquant.RECIPES)
# recipes whose CPU lowering prepacks for a bf16 kernel (int2/int3/hqq take the int4 kernel)
_BF16_KERNELS = ("int8wo", "int4wo", "w8a8", "int3wo", "int2wo", "hqq-int4")


def _floor_db(recipe: str, dtype: torch.dtype) -> float:
    """How close (SQNR, dB) the lowered program must be to the semantic one.

    The CPU int8/int4 kernels (int8wo, int4wo, w8a8) take bf16 activations (fp32 ones run a
    scalar path 10-30x slower) and return bf16, which costs ~50 dB per layer; the fp8 lowerings
    compute the reference math in fp32 and differ only by the order of fp32 roundings.
    A bf16 model rounds every layer's output as well (three layers deep here).
    """
    if dtype == torch.bfloat16:
        return 35.0
    if recipe.startswith(_BF16_KERNELS):
        return 40.0
    return 80.0


def _ops(prefix: str | None = None) -> set:
    """fxquant's linear, grouped (experts) and norm_quant ops: semantic ones (no prefix) or a
    device's own."""
    names = [
        n
        for n in dir(torch.ops.fxquant)
        if n.endswith(("_linear", "_grouped_mm")) or n == "norm_quant"
    ]
    if prefix is None:
        names = [n for n in names if not n.startswith(("cpu_", "triton_"))]
    else:
        names = [n for n in names if n.startswith(prefix)]
    return {getattr(torch.ops.fxquant, n).default for n in names}


def test_every_op_has_a_cpu_lowering():
    # Checked against what is registered now (other test modules may have imported the Triton
    # ops, which are not CPU lowerings' business).
    ops = _ops() | _ops("cpu_")
    assert ops and ops == set(CPU_LOWERINGS) | set(CPU_DECOMPOSITIONS)


def test_every_semantic_op_has_a_cuda_lowering():
    pytest.importorskip("triton")
    from fxquant.passes.lower_cuda import CUDA_LOWERINGS

    assert set(CUDA_LOWERINGS) == _ops()
    assert lowerings("cuda") == CUDA_LOWERINGS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", RECIPES)
def test_lowered_program_matches_semantic_program(recipe, dtype):
    torch.manual_seed(0)
    model = Mixed().eval().to(dtype)
    x = torch.randn(2, 7, 64, dtype=dtype)
    qep = fxquant.quantize(
        model, recipe, example_inputs=(x,), dynamic_shapes=({0: Dim.DYNAMIC, 1: Dim.DYNAMIC},)
    )
    before = dict(counters)
    lowered = lower(qep)
    prepacked = sum(v - before.get(k, 0) for k, v in counters.items() if k.startswith("prepack."))
    # the three linears of Mixed (nn.Linear, F.linear, Conv1D) all get the CPU kernel layout
    assert prepacked == (3 if recipe.startswith(_BF16_KERNELS) else 0)
    targets = {str(n.target) for n in lowered.graph.nodes if n.op == "call_function"}
    assert not any(t.startswith("fxquant.") for t in targets), targets
    for shape in [(1, 1, 64), (3, 5, 64)]:
        x = torch.randn(shape, dtype=dtype)
        got, want = lowered.module()(x), qep.module()(x)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert sqnr(want, got) >= _floor_db(recipe, dtype), (shape, sqnr(want, got))


def test_lower_rejects_unknown_device():
    with pytest.raises(ValueError, match="device='tpu'"):
        fxquant.passes.lower.lowerings("tpu")
