"""CPU lowering: every fxquant:: op becomes aten ops that compute the reference math."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import fxquant
from conftest import Mixed
from fxquant.passes.lower import CPU_LOWERINGS, lower

RECIPES = list(fxquant.RECIPES)
# The lowered compositions order fp32 operations differently from the reference (dequantize
# first vs scale in the epilogue), so they agree to fp32 rounding, not bit for bit.
TOL = {torch.float32: dict(rtol=1e-4, atol=1e-4), torch.bfloat16: dict(rtol=2e-2, atol=2e-2)}


def test_every_op_has_a_cpu_lowering():
    ops = {
        getattr(torch.ops.fxquant, name).default
        for name in dir(torch.ops.fxquant)
        if name.endswith("_linear")
    }
    assert ops and ops == set(CPU_LOWERINGS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", RECIPES)
def test_lowered_program_matches_semantic_program(recipe, dtype):
    torch.manual_seed(0)
    model = Mixed().eval().to(dtype)
    x = torch.randn(2, 7, 64, dtype=dtype)
    qep = fxquant.quantize(
        model, recipe, example_inputs=(x,), dynamic_shapes=({0: Dim.DYNAMIC, 1: Dim.DYNAMIC},)
    )
    lowered = lower(qep)
    targets = {str(n.target) for n in lowered.graph.nodes if n.op == "call_function"}
    assert not any(t.startswith("fxquant.") for t in targets), targets
    for shape in [(1, 1, 64), (3, 5, 64)]:
        x = torch.randn(shape, dtype=dtype)
        torch.testing.assert_close(lowered.module()(x), qep.module()(x), **TOL[dtype])


def test_lower_rejects_unknown_device():
    with pytest.raises(ValueError, match="device='tpu'"):
        fxquant.passes.lower.lowerings("tpu")
