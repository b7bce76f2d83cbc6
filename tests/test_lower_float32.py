"""The linears a config leaves in float, on CPU: the native fp32 and bf16 kernels
(kernels/cpu/float32.cpp, bfloat16.cpp) against F.linear, and the lowering that routes them to
them (passes/cpu/float32.py) in exported programs, AOTInductor packages and the torch.compile
backend; what it must leave alone (fp16, Conv1D's [K, N] weight, activations as weights)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch.export import Dim

import fxquant
import fxquant.kernels.cpu as native
from conftest import Mixed, assert_sums_close
from fxquant.passes.lower import lower, prepacked
from fxquant.passes.rewrite import counters

pytestmark = pytest.mark.skipif(
    not native.available(), reason=f"native CPU kernels unavailable: {native.unavailable_reason()}"
)

fxq = torch.ops.fxquant
NATIVE_OP = "fxquant.native_float32_linear.default"


@pytest.fixture(autouse=True)
def _native_dispatch(monkeypatch, two_threads):
    # the quantized body on its native kernel at every M (the fp32 reference's numerics; the
    # table's bf16 candidates are tests/test_cpu_dispatch.py's)
    monkeypatch.setenv("FXQUANT_CPU_DISPATCH", "native")


def _close(got: torch.Tensor, want: torch.Tensor) -> None:
    assert_sums_close(got, want, rel=2e-6)  # fp32 sums in another order than MKL's


# M around the GEMV's blocks of 4 and 2 rows and its limit of 8 (ATen's mm above); K off the
# vector widths (16 and 32 floats); N of one row and past the threads' split
@pytest.mark.parametrize("m", [0, 1, 2, 3, 4, 5, 7, 8, 9, 33])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (5, 17), (37, 100), (130, 576)])
def test_kernel_is_f_linear(m, n, k):
    g = torch.Generator().manual_seed(m * 100 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g)
    _close(fxq.native_float32_linear(x, w), F.linear(x, w))


def test_zeros_give_zeros_and_outside_the_contract_raises():
    for m in (1, 20):
        assert torch.equal(
            fxq.native_float32_linear(torch.zeros(m, 40), torch.zeros(9, 40)), torch.zeros(m, 9)
        )
    w = torch.randn(8, 64)
    bad = [
        (torch.randn(2, 63), w),  # K mismatch
        (torch.randn(64, 2).t(), w),  # x not contiguous
        (torch.randn(2, 64), torch.randn(64, 8).t()),  # w not contiguous
        (torch.randn(2, 64).double(), w),
        (torch.randn(2, 64), w.bfloat16()),
    ]
    for args in bad:
        with pytest.raises(RuntimeError, match="native_float32_linear: inputs outside"):
            fxq.native_float32_linear(*args)


# M around the row kernel's blocks (16, 8, 4, 2, 1) and its limit (15: the packed panels above),
# the widening GEMV's blocks of 4 and limit of 32 (MKL on the widened weight above); K off the
# 32-value steps and the 16-value ones; N past one panel
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("m", [0, 1, 3, 8, 15, 16, 33])
@pytest.mark.parametrize(("n", "k"), [(1, 1), (5, 17), (37, 100), (130, 576)])
def test_16_bit_kernels_are_the_16_bit_linear_in_fp32(dtype, m, n, k):
    """y = x @ w^T with fp32 sums of the products of the 16-bit values, exact in fp32 (the bf16
    kernel rounds x to bf16 first, as its dot products need; a bf16 model's x is bf16)."""
    g = torch.Generator().manual_seed(m * 100 + n + k)
    x, w = torch.randn(m, k, generator=g), torch.randn(n, k, generator=g).to(dtype)
    op = fxq.native_bfloat16_linear if dtype == torch.bfloat16 else fxq.native_float16_linear
    x_used = x.bfloat16().float() if dtype == torch.bfloat16 else x
    _close(op(x, w), F.linear(x_used, w.float()))


def test_fp16_weights_widen_exactly():
    """Every fp16 value (subnormals, the largest, signed zeros) widens to itself, in the vector
    loop and in the scalar tail (K = 8 * 4096 + 7 values: each is a column, x one-hot)."""
    bits = torch.arange(0, 1 << 16, dtype=torch.int32)
    finite = bits[(bits & 0x7C00) != 0x7C00].to(torch.int16).view(torch.float16)
    w = torch.cat([finite, finite[:7]])[: 8 * 4096 + 7]
    w = w[: (w.numel() // 7) * 7].reshape(7, -1).contiguous()  # 7 rows: the vector loop and a tail
    for col in (0, 1, 5, w.shape[1] - 1):
        x = torch.zeros(1, w.shape[1])
        x[0, col] = 1.0
        got = fxq.native_float16_linear(x, w)
        assert torch.equal(got[0], w[:, col].float()), col


def test_16_bit_zeros_give_zeros_and_outside_the_contract_raises():
    for name, dtype in (("bfloat16", torch.bfloat16), ("float16", torch.float16)):
        op = getattr(fxq, f"native_{name}_linear")
        for m in (1, 20, 40):
            zeros = torch.zeros(9, 40, dtype=dtype)
            assert torch.equal(op(torch.zeros(m, 40), zeros), torch.zeros(m, 9))
        w = torch.randn(8, 64).to(dtype)
        other = torch.float16 if dtype == torch.bfloat16 else torch.bfloat16
        bad = [
            (torch.randn(2, 63), w),  # K mismatch
            (torch.randn(2, 64), torch.randn(64, 8).to(dtype).t()),  # w not contiguous
            (torch.randn(2, 64).to(dtype), w),  # x is fp32 rows
            (torch.randn(2, 64), w.to(other)),
        ]
        for args in bad:
            with pytest.raises(RuntimeError, match=f"native_{name}_linear: inputs outside"):
                op(*args)


def test_opcheck():
    g = torch.Generator().manual_seed(0)
    w, b = torch.randn(20, 64, generator=g), torch.randn(20, generator=g)
    for m in (3, 12):
        torch.library.opcheck(fxq.native_float32_linear, (torch.randn(m, 64, generator=g), w))
    x3 = torch.randn(2, 3, 64, generator=g)
    torch.library.opcheck(fxq.cpu_native_float32_linear, (x3, w, b))
    torch.library.opcheck(fxq.cpu_native_float32_linear, (x3, w, None))
    for m in (3, 20, 40):
        x = torch.randn(m, 64, generator=g)
        torch.library.opcheck(fxq.native_bfloat16_linear, (x, w.bfloat16()))
        torch.library.opcheck(fxq.native_float16_linear, (x, w.half()))
    torch.library.opcheck(fxq.cpu_native_float16_linear, (x3.half(), w.half(), b.half()))
    torch.library.opcheck(
        fxq.cpu_native_bfloat16_linear, (x3.bfloat16(), w.bfloat16(), b.bfloat16())
    )


class _Head(torch.nn.Module):
    """A quantized body and an fp32 head the config skips, tied to an embedding as an LLM's
    lm_head is."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = torch.nn.Embedding(50, 32)
        self.body = torch.nn.Linear(32, 32)
        self.lm_head = torch.nn.Linear(32, 50, bias=False)
        self.lm_head.weight = self.embed.weight

    def forward(self, ids):
        return self.lm_head(torch.relu(self.body(self.embed(ids))))


def _skip_head() -> fxquant.QuantConfig:
    return fxquant.QuantConfig(scheme=fxquant.Int8WeightOnly(), modules_to_not_convert=("lm_head",))


def _targets(ep) -> list[str]:
    return [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]


def test_a_skipped_layer_runs_the_native_kernel_at_every_m():
    torch.manual_seed(0)
    model = _Head().eval()
    ids = torch.randint(0, 50, (1, 5))
    qep = fxquant.quantize(
        model, _skip_head(), example_inputs=(ids,), dynamic_shapes=({1: Dim.DYNAMIC},)
    )
    lowered = lower(qep)
    assert _targets(lowered).count(NATIVE_OP) == 1
    for length in (1, 4, 9, 40):  # the GEMV and, past 8 rows, ATen's mm inside the op
        ids = torch.randint(0, 50, (1, length))
        torch.testing.assert_close(lowered.module()(ids), qep.module()(ids))
    # the caller's program is not changed
    assert NATIVE_OP not in _targets(qep)


def test_what_it_leaves_alone():
    # Mixed: nn.Linear and F.linear on a parameter take the kernel (the bf16 / fp16 one in a
    # bf16 / fp16 model); Conv1D's [K, N] weight (addmm) keeps ATen's GEMM, as does fp64
    torch.manual_seed(0)
    x = torch.randn(2, 3, 64)
    ep = torch.export.export(Mixed().eval(), (x,))
    assert _targets(prepacked(ep)).count("fxquant.cpu_native_float32_linear.default") == 2
    ep16 = torch.export.export(Mixed().eval().bfloat16(), (x.bfloat16(),))
    targets = _targets(prepacked(ep16))
    assert targets.count("fxquant.cpu_native_bfloat16_linear.default") == 2
    assert not any("float32_linear" in t for t in targets)
    half = torch.export.export(Mixed().eval().half(), (x.half(),))
    assert _targets(prepacked(half)).count("fxquant.cpu_native_float16_linear.default") == 2
    double = torch.export.export(Mixed().eval().double(), (x.double(),))
    assert not any("native" in t for t in _targets(prepacked(double)))

    class ActAsWeight(torch.nn.Module):  # F.linear on two activations: no stored weight
        def forward(self, x, y):
            return F.linear(x, y)

    ep2 = torch.export.export(ActAsWeight(), (torch.randn(2, 8), torch.randn(4, 8)))
    assert not any("float32_linear" in t for t in _targets(prepacked(ep2)))


def test_float_program_packaged_and_through_the_backend(tmp_path):
    torch.manual_seed(0)
    model = _Head().eval()
    ids = torch.randint(0, 50, (1, 6))
    qep = fxquant.quantize(model, _skip_head(), example_inputs=(ids,))
    pkg = fxquant.aot_compile(qep, tmp_path / "head.pt2")
    torch.testing.assert_close(pkg(ids), qep.module()(ids))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxquant", options={"config": _skip_head()})
    before = counters["prepack.cpu_native_float32_linear"]
    with torch.no_grad():
        want = qep.module()(ids)
        torch.testing.assert_close(compiled(ids), want)
    assert counters["prepack.cpu_native_float32_linear"] == before + 1  # the lm_head


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_16_bit_model_keeps_its_skipped_layer_on_its_16_bit_kernel(dtype, tmp_path):
    """A model in bf16 or fp16: the layer the config skips runs the native kernel of its dtype
    in the lowered program, its package and the backend, with the 16-bit linear's numbers (one
    rounding)."""
    name = str(dtype).removeprefix("torch.")
    torch.manual_seed(0)
    model = _Head().eval().to(dtype)
    ids = torch.randint(0, 50, (1, 6))
    qep = fxquant.quantize(
        model, _skip_head(), example_inputs=(ids,), dynamic_shapes=({1: Dim.DYNAMIC},)
    )
    lowered = lower(qep)
    assert _targets(lowered).count(f"fxquant.native_{name}_linear.default") == 1
    for length in (1, 6, 20, 40):  # each kernel's paths by M
        ids = torch.randint(0, 50, (1, length))
        got, want = lowered.module()(ids), qep.module()(ids)
        assert got.dtype == dtype
        torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    pkg = fxquant.aot_compile(qep, tmp_path / "head.pt2")
    # (Inductor's fused elementwise rounds to the dtype in other places than eager's)
    torch.testing.assert_close(pkg(ids), lowered.module()(ids), atol=1e-2, rtol=1e-2)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxquant", options={"config": _skip_head()})
    before = counters[f"prepack.cpu_native_{name}_linear"]
    with torch.no_grad():
        torch.testing.assert_close(compiled(ids), lowered.module()(ids), atol=1e-2, rtol=1e-2)
    assert counters[f"prepack.cpu_native_{name}_linear"] == before + 1  # the lm_head
    rows = fxquant.report(qep).cpu_kernels()
    assert rows[-1]["scheme"] == f"{name} (kept in float)" and rows[-1]["layers"] == ["lm_head"]


def test_the_report_names_the_kernel_of_the_layers_kept_in_float():
    from fxquant.passes.cpu.float32 import KERNEL

    model = _Head().eval()
    qep = fxquant.quantize(model, _skip_head(), example_inputs=(torch.randint(0, 50, (1, 4)),))
    records = fxquant.report(qep).cpu_kernels()
    assert records[-1] == {
        "scheme": "float32 (kept in float)",
        "layers": ["lm_head"],
        "kernel": KERNEL,
    }
    assert [r["layers"] for r in records[:-1]] == [["body"]]
