"""The CPU lowering's choice of kernel by machine class and M (``passes/cpu/dispatch.py``).

Every candidate is checked against the semantic program (the reference math) at an M on each
side of a plan's boundaries, with the machine class forced and its plans pinned (``PLANS``, not
the measured table, which changes with each measurement), so these run on any CPU: a class's
*speed* is only what a machine of that class measures (benchmarks/cpu_kernels.py).
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn
from torch.export import Dim

import fxquant
from fxquant.core.reference import sqnr
from fxquant.passes import cpu
from fxquant.passes.cpu import dispatch
from fxquant.passes.lower import lower

CLASS = "avx512_vnni_bf16"  # a class whose table has large-M candidates
DISPATCHED = ("int8wo", "w8a8", "fp8wo", "fp8-row", "int4wo-64", "w4a8-64")
# lowered vs semantic program, dB: the native kernels and _int_mm compute the reference's
# products (fp32 / exact int32 sums); the bf16 GEMMs round x (or W) and the sums to bf16, the
# bf16 dot-product kernels x only (and int4's dequantized weight; their sums are fp32)
FLOOR = {"native": 80.0, "int_mm": 80.0, "bf16": 40.0, "bf16_dot": 45.0}
# Plans for the forced class: every candidate in some range (int4 weight-only's native kernel:
# where bf16_dot runs it, at one row, and in the int8_act test below), and int8, fp8 and int4
# weight-only with three ranges (two boundaries: a cond nested in the first one's large branch)
PLANS = {
    "native_int8_weight_only_linear": [[4, "native"], [16, "bf16_dot"], [None, "bf16"]],
    "native_int8_scaled_linear": [[4, "native"], [None, "int_mm"]],
    "native_float8_weight_only_linear": [[4, "native"], [16, "bf16_dot"], [None, "bf16"]],
    "native_int4_weight_only_linear": [[8, "bf16_dot"], [32, "int8_act"], [None, "bf16"]],
    "native_int8_int4_linear": [[32, "native"], [None, "bf16"]],
}


def _floor(recipe: str, candidate: str) -> float:
    # fp8-row re-rounds each layer's input to e4m3 (steps of 1/8): the bf16 rounding of the
    # layer before moves some of those roundings by a whole step, so it drifts a little more.
    # int4 weight-only on int8 activations computes the W4A8 program, not the semantic one (see
    # test_int4_weight_only_on_int8_activations_is_the_w4a8_program)
    if candidate == "int8_act":
        return 30.0
    return 35.0 if (recipe, candidate) == ("fp8-row", "bf16") else FLOOR[candidate]


@pytest.fixture
def forced(monkeypatch):
    if not cpu.available():
        pytest.skip("the dispatch chooses among the native kernels, which did not build here")
    monkeypatch.setenv("FXQUANT_CPU_CLASS", CLASS)
    monkeypatch.delenv("FXQUANT_CPU_DISPATCH", raising=False)
    monkeypatch.setattr(dispatch, "table", lambda: {CLASS: PLANS})


class _Block(nn.Module):
    """A norm feeding two linears (fused for w8a8: int8_scaled_linear), then a third."""

    def __init__(self, d: int = 128) -> None:
        super().__init__()
        self.norm = nn.RMSNorm(d, eps=1e-6)
        self.q, self.k = nn.Linear(d, 2 * d), nn.Linear(d, 2 * d)
        self.out = nn.Linear(2 * d, d)

    def forward(self, x):
        n = self.norm(x)
        return self.out(torch.relu(self.q(n)) * self.k(n))


def _quantized(recipe: str, *, dynamic: bool = True):
    torch.manual_seed(0)
    model = _Block().eval()
    x = torch.randn(4, 128)
    shapes = ({0: Dim.DYNAMIC},) if dynamic else None
    return model, fxquant.quantize(model, recipe, example_inputs=(x,), dynamic_shapes=shapes)


def _op_name(recipe: str) -> str:
    return {
        "int8wo": "native_int8_weight_only_linear",
        "w8a8": "native_int8_scaled_linear",
        "fp8wo": "native_float8_weight_only_linear",
        "fp8-row": "native_float8_weight_only_linear",
        "int4wo-64": "native_int4_weight_only_linear",
        "w4a8-64": "native_int8_int4_linear",
    }[recipe]


def test_machine_class_is_known_and_can_be_forced(monkeypatch):
    monkeypatch.delenv("FXQUANT_CPU_CLASS", raising=False)
    assert dispatch.machine_class() in dispatch.CLASSES
    monkeypatch.setenv("FXQUANT_CPU_CLASS", "avx2")
    assert dispatch.machine_class() == "avx2"
    assert dispatch.plan_for("native_int8_scaled_linear") == [(None, "native")]
    monkeypatch.setenv("FXQUANT_CPU_CLASS", "sse")
    with pytest.raises(ValueError, match="FXQUANT_CPU_CLASS='sse'.*allowed: default, avx2"):
        dispatch.machine_class()


def test_the_table_is_well_formed():
    data = json.loads(dispatch.TABLE_PATH.read_text())
    assert set(data["classes"]) <= set(dispatch.CLASSES)
    for ops in [*data["classes"].values(), PLANS]:
        for op, plan in ops.items():
            assert hasattr(torch.ops.fxquant, op), op
            bounds = [m for m, _ in plan]
            assert bounds[-1] is None and all(isinstance(m, int) for m in bounds[:-1]), plan
            assert bounds[:-1] == sorted(bounds[:-1]), plan


def test_native_dispatch_pins_the_native_kernels(monkeypatch):
    monkeypatch.setenv("FXQUANT_CPU_CLASS", CLASS)
    monkeypatch.setenv("FXQUANT_CPU_DISPATCH", "native")
    assert dispatch.plan_for("native_int8_scaled_linear") == [(None, "native")]


@pytest.mark.parametrize("recipe", DISPATCHED)
def test_each_candidate_computes_the_reference(recipe, forced):
    model, qep = _quantized(recipe)
    lowered = lower(qep)
    conds = [n for n in lowered.graph.nodes if n.target is torch.ops.higher_order.cond]
    # the fused q/k GEMM (siblings) and out, dynamic M: one cond each (a second boundary nests)
    assert len(conds) == 2
    plan = dispatch.plan_for(_op_name(recipe))
    lo, checks = 1, []
    for max_m, name in plan:  # each range's first and last M (the last range: 40 rows of it)
        checks += [(lo, name), (max_m if max_m is not None else lo + 40, name)]
        lo = (max_m or 0) + 1
    for m, name in checks:
        x = torch.randn(m, 128)
        want, got = qep.module()(x), lowered.module()(x)
        assert sqnr(want, got) >= _floor(recipe, name), (m, name, sqnr(want, got))
        # and still the float model's, up to the scheme's own error (three GEMMs deep)
        assert sqnr(model(x), got) >= (15.0 if "4" in recipe or recipe == "fp8-row" else 25.0)


def test_a_static_m_takes_one_candidate_without_a_cond(forced):
    _, qep = _quantized("w8a8", dynamic=False)  # M = 4: the native GEMV only
    lowered = lower(qep)
    targets = {str(n.target) for n in lowered.graph.nodes}
    assert "cond" not in " ".join(targets) and "aten._int_mm.default" not in targets
    assert any(t.startswith("fxquant.native_") for t in targets)


def test_w8a8_on_int_mm_is_the_integer_product(forced):
    from fxquant.core import reference as ref
    from fxquant.passes.cpu import int8

    torch.manual_seed(0)
    xq = torch.randint(-127, 128, (40, 96), dtype=torch.int8)
    xs = torch.rand(40, 1) + 0.5
    wq, s = ref.quantize_int8_per_channel(torch.randn(72, 96))
    got = int8._int8_scaled_rows_int_mm(xq, xs, wq, s)
    exact = (xq.double() @ wq.double().t()) * xs.double() * s.double()  # int32 sums are exact
    torch.testing.assert_close(got.double(), exact, rtol=1e-6, atol=0)
    want = ref.int8_scaled_linear(xq, xs, wq, s, None, out_dtype=torch.float32)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_int4_weight_only_on_int8_activations_is_the_w4a8_program(forced, monkeypatch):
    # AVX2's large-M choice for int4 weight-only (int8_act): x rounded to int8 per token into
    # the W4A8 kernel. It computes the W4A8 scheme's program on the same weight, and stays near
    # the weight-only one: the activation rounding is small beside the int4 weight's error.
    plan = {"native_int4_weight_only_linear": [[8, "native"], [None, "int8_act"]]}
    monkeypatch.setattr(dispatch, "table", lambda: {CLASS: plan})
    model, qep = _quantized("int4wo-64")
    _, w4a8 = _quantized("w4a8-64")
    lowered = lower(qep)
    for m in (1, 8, 9, 48):
        x = torch.randn(m, 128)
        got = lowered.module()(x)
        if m <= 8:
            assert sqnr(qep.module()(x), got) >= FLOOR["native"], m
        else:
            assert sqnr(w4a8.module()(x), got) >= 80.0, m
            assert sqnr(qep.module()(x), got) >= 30.0, m
        assert sqnr(model(x), got) >= 15.0, m
    assert dispatch.kernel_plan("int4_weight_only_linear", None, CLASS) == (
        "fxquant native kernel up to M = 8, then W4A8 kernel (x rounded to int8 per token)"
    )


def test_int8_activations_leave_groups_the_w4a8_kernel_lacks_weight_only(forced):
    # groups of 512 (int4 weight-only's kernel takes any multiple of 32; W4A8's 32 to 256)
    import fxquant.kernels.cpu as native
    from fxquant.core import reference as ref
    from fxquant.passes.cpu import int4

    torch.manual_seed(0)
    layout = native.prepack_int4(
        *ref.quantize_int4_grouped(torch.randn(40, 1024), group_size=512, symmetric=False),
        group_size=512,
    )
    x = torch.randn(24, 1024)
    got = int4._int4_rows_int8_act(x, *layout, 512)
    assert torch.equal(got, int4._int4_rows_native(x, *layout, 512))


@pytest.mark.slow
def test_one_package_serves_decode_and_prefill(forced, tmp_path):
    # int4 weight-only's three ranges: two nested conds in the package
    _, qep = _quantized("int4wo-64")
    pkg = fxquant.aot_compile(qep, tmp_path / "int4wo.pt2")
    for m, name in ((1, "native"), (4, "bf16_dot"), (20, "int8_act"), (96, "bf16")):
        x = torch.randn(m, 128)
        assert sqnr(qep.module()(x), pkg(x)) >= _floor("int4wo-64", name), (m, name)


def test_the_backend_dispatches_an_unbacked_m(forced):
    # torch.compile(backend="fxquant") with M unbacked, one graph for every M: int4's three
    # ranges nest a cond in the first one's large branch, whose boundary reads M off the
    # branch's own operand (the outer trace's unbacked M cannot enter it)
    if torch.__version__ < "2.13":
        pytest.skip("torch 2.11's Dynamo cannot trace a torch.cond over an unbacked size")
    model, qep = _quantized("int4wo-64")
    torch._dynamo.reset()
    run = torch.compile(model, backend="fxquant", options={"config": "int4wo-64"})
    for m, name in ((1, "native"), (4, "bf16_dot"), (20, "int8_act"), (96, "bf16")):
        x = torch.randn(m, 128)
        torch._dynamo.decorators.mark_unbacked(x, 0)
        with torch.no_grad():
            got = run(x)
        assert sqnr(qep.module()(x), got) >= _floor("int4wo-64", name), (m, name)


def test_the_report_says_which_kernel_each_layer_gets(monkeypatch):
    if not cpu.available():
        pytest.skip("the dispatch chooses among the native kernels, which did not build here")
    monkeypatch.delenv("FXQUANT_CPU_DISPATCH", raising=False)
    monkeypatch.setattr(dispatch, "table", lambda: {CLASS: PLANS})
    rep = fxquant.report(_quantized("w8a8", dynamic=False)[1])
    (record,) = rep.cpu_kernels(CLASS)
    assert record["layers"] == ["q", "k", "out"]  # q and k fused: the same GEMM
    plan = dispatch.plan_for("native_int8_scaled_linear", CLASS)
    assert record["kernel"] == (
        f"fxquant native kernel up to M = {plan[0][0]}, then torch._int_mm (int8, exact int32 sums)"
    )
    assert rep.cpu_kernels("avx2")[0]["kernel"] == "fxquant native kernel at every M"
    assert f"CPU class {CLASS}:\n  Int8DynamicActivation() (3 layers)" in rep.cpu_kernels_table(
        CLASS
    )
    # a scheme without a per-M dispatch, and intx codes wider than the int4 kernel takes
    for recipe, kernel in (("nf4", "no per-M dispatch"), ("int8wo", "bf16 GEMM")):
        assert kernel in fxquant.report(_quantized(recipe)[1]).cpu_kernels(CLASS)[0]["kernel"]
    narrow = dispatch.kernel_plan("intx_weight_only_linear", {"bits": 4, "group_size": 64}, CLASS)
    assert narrow == dispatch.kernel_plan("int4_weight_only_linear", None, CLASS)
    wide = dispatch.kernel_plan("intx_weight_only_linear", {"bits": 6, "group_size": 64}, CLASS)
    assert wide == "one lowering at every M (no per-M dispatch)"
    monkeypatch.setenv("FXQUANT_CPU_DISPATCH", "native")
    assert rep.cpu_kernels("avx2")[0]["kernel"] == "fxquant native kernel at every M"
    # one kernel at every M on a VNNI class: w8a8's weight in that kernel's own layout
    assert rep.cpu_kernels(CLASS)[0]["kernel"] == (
        "fxquant native kernel at every M, on a weight prepacked in AVX-512 VNNI panels "
        "(16 columns x 4 k per 64 bytes; AMX B tiles, read by AMX int8 tiles from 8 rows "
        "where the CPU has them)"
    )


@pytest.mark.parametrize("plan", [[[None, "native"]], [[4, "native"], [None, "int_mm"]]])
def test_w8a8_weight_is_packed_where_one_vnni_kernel_serves_every_m(plan, monkeypatch):
    if not cpu.available():
        pytest.skip("the dispatch chooses among the native kernels, which did not build here")
    monkeypatch.delenv("FXQUANT_CPU_DISPATCH", raising=False)
    monkeypatch.setattr(dispatch, "table", lambda: {CLASS: {"native_int8_scaled_linear": plan}})
    _, qep = _quantized("w8a8")
    for machine, packs in ((CLASS, plan == [[None, "native"]]), ("avx2", False)):
        monkeypatch.setenv("FXQUANT_CPU_CLASS", machine)
        lowered = lower(qep)
        targets = {str(n.target) for n in lowered.graph.nodes}
        # the fused norm's q/k GEMM and out, each on its packed weight, no cond
        vnni = {"fxquant.native_int8_scaled_vnni_linear.default"}
        assert (vnni <= targets) == packs, (machine, plan, targets)
        # a cond only where the plan has a boundary (avx2's plan here: the native kernel)
        assert any("cond" in t for t in targets) == (machine == CLASS and not packs)
        for m in (1, 40):
            x = torch.randn(m, 128)
            assert sqnr(qep.module()(x), lowered.module()(x)) >= FLOOR["native"], (machine, m)


def test_each_dispatched_gemm_declares_its_candidates_once():
    # the lowerings dispatch over dispatch.GEMMS and benchmarks/cpu_kernels.py measures them
    import fxquant.passes.cpu.float8  # noqa: F401
    import fxquant.passes.cpu.int4  # noqa: F401
    import fxquant.passes.cpu.int8  # noqa: F401

    for plans in [*dispatch.table().values(), PLANS]:
        for gemm, plan in plans.items():
            assert {name for _, name in plan} <= set(dispatch.GEMMS[gemm]), gemm
    with pytest.raises(ValueError, match=r"unknown candidates \['fp16'\]; allowed"):
        dispatch.candidates("native_int8_weight_only_linear", fp16=lambda *a: None)


def test_the_plan_takes_the_packed_layout_where_it_wins(monkeypatch):
    # benchmarks/cpu_kernels.py's planner: the packed native kernel is one more one-candidate
    # plan, written as [[None, "native"]] (the lowering then packs); it never enters a boundary
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    monkeypatch.delitem(sys.modules, "cpu_kernels", raising=False)
    from cpu_kernels import plan

    op = "native_int8_scaled_linear"

    def timings(native, int_mm, packed):
        rows = {}
        for m, a, b, c in zip((1, 16, 128), native, int_mm, packed, strict=True):
            rows[m] = {f"{op}:native": a, f"{op}:int_mm": b, f"{op}:native_packed": c}
        return rows

    assert plan(timings((1, 4, 20), (9, 3, 10), (0.5, 2, 9)), op) == [[None, "native"]]
    # packed slower than int_mm at large M by more than a boundary buys: the stored layout
    stored = plan(timings((1, 4, 20), (9, 3, 10), (1, 4, 19)), op)
    assert stored == [[1, "native"], [None, "int_mm"]]


def test_the_plan_times_a_candidate_as_native_where_it_runs_the_native_kernel(monkeypatch):
    # the bf16 dot-product kernels run the fp32 GEMV for one row: at M = 1 they are the native
    # kernel, so noise between two timings of that code must not keep them out of decode
    import sys
    from pathlib import Path

    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    monkeypatch.delitem(sys.modules, "cpu_kernels", raising=False)
    from cpu_kernels import plan

    op = "native_int8_weight_only_linear"
    times = {  # bf16_dot 10 % "slower" than native at M = 1, twice as fast at 16
        1: {f"{op}:native": 1.0, f"{op}:bf16": 5.0, f"{op}:bf16_dot": 1.1},
        16: {f"{op}:native": 4.0, f"{op}:bf16": 3.0, f"{op}:bf16_dot": 2.0},
        128: {f"{op}:native": 30.0, f"{op}:bf16": 10.0, f"{op}:bf16_dot": 15.0},
    }
    assert plan(times, op) == [[16, "bf16_dot"], [None, "bf16"]]
