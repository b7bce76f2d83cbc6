"""CPU lowering: every fxquant:: op becomes aten ops that compute the reference math."""

from __future__ import annotations

import pytest
import torch
from torch.export import Dim

import fxquant
from conftest import Mixed
from fxquant.core.reference import sqnr
from fxquant.passes.cpu import dispatch
from fxquant.passes.lower import (
    CPU_DECOMPOSITIONS,
    CPU_LOWERINGS,
    NATIVE_LOWERINGS,
    drop_no_ops,
    lower,
    lowerings,
)
from fxquant.passes.rewrite import counters

RECIPES = list(fxquant.RECIPES)
# recipes whose aten CPU lowering prepacks for a bf16 kernel (int2/int3/hqq take the int4 one)
_BF16_KERNELS = (
    *("int8wo", "int4wo", "w8a8", "w4a8", "int3wo", "int2wo"),
    *("hqq-int4", "mlx-int4", "sinq-int4"),
)
# recipes the native lowering repacks (the int4 nibble layout); int8 and fp8 read W as it is
_NATIVE_PREPACK = ("int4wo", "w4a8", "int3wo", "int2wo", "hqq-int4", "mlx-int4", "sinq-int4")


def _floor_db(recipe: str, dtype: torch.dtype, native: bool) -> float:
    """How close (SQNR, dB) the lowered program must be to the semantic one.

    The aten CPU int8/int4 kernels (int8wo, int4wo, w8a8) take bf16 activations (fp32 ones run a
    scalar path 10-30x slower) and return bf16, which costs ~50 dB per layer; the native kernels
    and the fp8 lowerings compute the reference math in fp32 and differ only by the order of
    fp32 roundings. A bf16 model rounds every layer's output as well (three layers deep here).
    """
    if dtype == torch.bfloat16:
        return 35.0
    if recipe.startswith(_BF16_KERNELS) and not native:
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
        names = [n for n in names if not n.startswith(("cpu_", "triton_", "native_"))]
    else:
        names = [n for n in names if n.startswith(prefix)]
    return {getattr(torch.ops.fxquant, n).default for n in names}


def test_every_op_has_a_cpu_lowering():
    # Checked against what is registered now (other test modules may have imported the Triton
    # ops, which are not CPU lowerings' business).
    ops = _ops() | _ops("cpu_")
    native_device_ops = {k for k in NATIVE_LOWERINGS if "native" in str(k)}
    assert ops and ops == set(CPU_LOWERINGS) | set(CPU_DECOMPOSITIONS) | native_device_ops
    # the native table covers semantic ops and its own device op, nothing unknown
    assert set(NATIVE_LOWERINGS) <= ops


def test_every_semantic_op_has_a_cuda_lowering():
    pytest.importorskip("triton")
    from fxquant.passes.lower_cuda import CUDA_LOWERINGS

    assert set(CUDA_LOWERINGS) == _ops()
    assert lowerings("cuda") == CUDA_LOWERINGS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("recipe", RECIPES)
def test_lowered_program_matches_semantic_program(recipe, dtype, cpu_kernels):
    native = cpu_kernels == "native"
    torch.manual_seed(0)
    model = Mixed().eval().to(dtype)
    x = torch.randn(2, 7, 64, dtype=dtype)
    qep = fxquant.quantize(
        model, recipe, example_inputs=(x,), dynamic_shapes=({0: Dim.DYNAMIC, 1: Dim.DYNAMIC},)
    )
    before = dict(counters)
    lowered = lower(qep)
    prepacked = sum(
        v - before.get(k, 0)
        for k, v in counters.items()
        if k.startswith("prepack.") and not k.endswith(("float32_linear", "bfloat16_linear"))
    )
    # (a linear a recipe skips keeps its float dtype and, native, gets the fp32 or bf16 kernel:
    # test_lower_float32)
    # the three linears of Mixed (nn.Linear, F.linear, Conv1D) all get the CPU kernel layout
    repacked = _NATIVE_PREPACK if native else _BF16_KERNELS
    # and on VNNI machines whose plan runs it at every M, w8a8's weight in its GEMM's panels
    vnni = native and recipe == "w8a8" and dispatch.packed("native_int8_scaled_linear")
    assert prepacked == (3 if recipe.startswith(repacked) or vnni else 0)
    targets = {str(n.target) for n in lowered.graph.nodes if n.op == "call_function"}
    # only the native kernels (C++, with C shims for AOTInductor) may stay fxquant ops
    left = {t for t in targets if t.startswith("fxquant.")}
    assert all(t.startswith("fxquant.native_") for t in left) and (native or not left), targets
    for shape in [(1, 1, 64), (3, 5, 64)]:
        x = torch.randn(shape, dtype=dtype)
        got, want = lowered.module()(x), qep.module()(x)
        assert got.dtype == want.dtype and got.shape == want.shape
        assert sqnr(want, got) >= _floor_db(recipe, dtype, native), (shape, sqnr(want, got))


@pytest.mark.parametrize("recipe", ["int8wo", "w8a8"])
def test_int8_lowerings_take_any_k(recipe, cpu_kernels):
    # aten's _weight_int8pack_mm reads K in steps of 16: before the prepack padded K it
    # segfaulted at K < 16 and summed past the row at K = 100 (torch 2.13, AVX2). w8a8 here
    # also runs the fused norm's int8 GEMM (int8_scaled_linear).
    for k in (1, 7, 8, 15, 17, 24, 36, 100, 127, 136, 200):
        torch.manual_seed(k)
        model = torch.nn.Sequential(
            torch.nn.LayerNorm(k), torch.nn.Linear(k, 40), torch.nn.ReLU(), torch.nn.Linear(40, k)
        ).eval()
        x = torch.randn(3, k)
        qep = fxquant.quantize(model, recipe, example_inputs=(x,))
        got, want = lower(qep).module()(x), qep.module()(x)
        assert sqnr(want, got) >= _floor_db(recipe, torch.float32, cpu_kernels == "native"), k


def test_fp8_block_with_a_ragged_last_group_compiles_to_the_program(cpu_kernels):
    # K = 200 in groups of 128: Inductor (torch 2.13) compiled the reference's padded groups,
    # flattened and sliced back, into loops over whole groups only, and the last 72 columns of
    # the fused norm's quantized x were never written (NaN in SmolLM2, K = 576)
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.RMSNorm(200), torch.nn.Linear(200, 130)).eval()
    x = torch.randn(3, 200)
    qep = fxquant.quantize(model, "fp8-block", example_inputs=(x,))
    lowered = lower(qep).module()
    with torch.no_grad():
        got, want = torch.compile(lowered)(x), qep.module()(x)
    assert sqnr(want, got) >= 80


def test_lower_rejects_unknown_device():
    with pytest.raises(ValueError, match="device='tpu'"):
        fxquant.passes.lower.lowerings("tpu")


class _Siblings(torch.nn.Module):
    """q/k/v-like linears on one normed input (one pair with biases), and one on another."""

    def __init__(self):
        super().__init__()
        self.norm = torch.nn.RMSNorm(64)
        self.q = torch.nn.Linear(64, 64, bias=False)
        self.k = torch.nn.Linear(64, 32, bias=False)
        self.v = torch.nn.Linear(64, 32, bias=False)
        self.gate = torch.nn.Linear(64, 96)
        self.up = torch.nn.Linear(64, 96)
        self.out = torch.nn.Linear(96, 64)

    def forward(self, x):
        h = self.norm(x)
        a = torch.cat([self.q(h), self.k(h), self.v(h)], dim=-1)[..., :64]
        m = self.out(torch.nn.functional.silu(self.gate(x)) * self.up(x))
        return a + m


@pytest.mark.parametrize(
    "recipe", ["int8wo", "w8a8", "int4wo-32", "w4a8-32", "fp8-row", "int3wo-64"]
)
def test_siblings_reading_one_input_become_one_gemm(recipe, cpu_kernels):
    if cpu_kernels != "native":
        pytest.skip("sibling fusion is part of the native lowering")
    torch.manual_seed(0)
    model = _Siblings().eval()
    x = torch.randn(2, 5, 64)
    cfg = fxquant.QuantConfig(scheme=fxquant.from_recipe_name(recipe), modules_to_not_convert=())
    qep = fxquant.quantize(
        model, cfg, example_inputs=(x,), dynamic_shapes=({0: Dim.DYNAMIC, 1: Dim.DYNAMIC},)
    )
    before = counters["fuse.siblings"]
    lowered = lower(qep)
    # q/k/v (bias-free) and gate/up (with biases) each stack into one GEMM; out stays alone
    assert counters["fuse.siblings"] - before == 2
    gemms = [
        n
        for n in lowered.graph.nodes
        if n.op == "call_function" and str(n.target).startswith("fxquant.native_")
    ]
    assert len(gemms) == 3
    for shape in [(1, 1, 64), (3, 7, 64)]:
        x = torch.randn(shape)
        assert sqnr(qep.module()(x), lowered.module()(x)) >= 80


class _Casts(torch.nn.Module):
    def forward(self, x):
        y = x.to(torch.float32) * 2  # a no-op cast, as a Hugging Face norm records for fp32
        z = y.to(torch.float16).to(torch.float32)  # real casts: kept
        return z + 1, x.to(torch.float32)  # an output cast stays a node of its own


def test_drop_no_ops_removes_same_dtype_casts_and_their_assertions():
    x = torch.randn(4, 8)
    ep = torch.export.export(_Casts(), (x,))
    aten = torch.ops.aten

    def count(graph, target):
        return sum(n.target is target for n in graph.nodes)

    assert count(ep.graph, aten._assert_tensor_metadata.default) > 0
    casts = count(ep.graph, aten.to.dtype)
    gm = ep.module()
    graph = gm.graph
    removed = drop_no_ops(graph)
    gm.recompile()
    assert count(graph, aten._assert_tensor_metadata.default) == 0
    # the first cast goes; the two real ones and the program's output stay
    assert count(graph, aten.to.dtype) == casts - 1 == 3
    assert removed >= 2
    for got, want in zip(gm(x), _Casts()(x), strict=True):
        torch.testing.assert_close(got, want, rtol=0, atol=0)
