"""Linears whose weight is stored [N, K] and read through a transpose (``x @ self.weight.T``):
Falcon's ``FalconLinear`` and hand-written linears. Each is found, quantized, calibrated, trained
in FP8 and lowered as the same weights in an ``nn.Linear`` are (``passes/plan.py``)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import fxquant
from fxquant import (
    AWQ,
    GPTQ,
    AutoRound,
    Float8Recipe,
    Int4WeightOnly,
    Int8DynamicActivation,
    QuantConfig,
    SmoothQuant,
)
from fxquant.core.reference import sqnr
from fxquant.passes.lower import prepacked
from fxquant.passes.plan import find_sites
from fxquant.passes.rewrite import DynamoEditor

D = 64


class TLinear(nn.Linear):
    """``nn.Linear``'s parameters (``weight`` [N, K], ``bias``) and a forward that multiplies by
    the transposed weight, one spelling per instance (Falcon's ``FalconLinear`` is ``"T"``)."""

    def __init__(self, k: int, n: int, how: str, bias: bool = True) -> None:
        super().__init__(k, n, bias=bias)
        self.how = how

    def forward(self, x):
        w, b = self.weight, self.bias
        if self.how == "T":
            y = x @ w.T
        elif self.how == "t":
            y = torch.matmul(x, w.t())
        elif self.how == "mT":
            y = x @ w.mT
        elif self.how == "transpose":
            y = torch.mm(x.flatten(0, -2), w.transpose(0, 1)).unflatten(0, x.shape[:-1])
        else:  # "permute": the bias inside the product
            y = torch.addmm(b, x.flatten(0, -2), w.permute(1, 0))
            return y.unflatten(0, x.shape[:-1])
        return y if b is None else y + b


class Net(nn.Module):
    """LayerNorm → up → GELU → down (+ residual) → LayerNorm → a → b → GELU → c: AWQ and
    SmoothQuant fold up's and a's scales into the norms, AWQ b's into a (a has no bias, so b reads
    its output). ``spelled=False``: ``nn.Linear``'s own forward everywhere, the twin with the
    same weights."""

    SPELLINGS = {"up": "T", "down": "transpose", "a": "mT", "b": "t", "c": "permute"}
    SIZES = {"up": (D, 2 * D), "down": (2 * D, D), "a": (D, D), "b": (D, D), "c": (D, D)}
    KINDS = {"up": "matmul", "down": "mm", "a": "matmul", "b": "matmul", "c": "addmm"}

    def __init__(self, spelled: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.norm, self.norm2 = nn.LayerNorm(D), nn.LayerNorm(D)
        for name, (k, n) in self.SIZES.items():
            bias = name != "a"
            linear = TLinear(k, n, self.SPELLINGS[name], bias) if spelled else nn.Linear(k, n, bias)
            setattr(self, name, linear)

    def forward(self, x):
        h = x + self.down(F.gelu(self.up(self.norm(x))))
        return self.c(F.gelu(self.b(self.a(self.norm2(h)))))


class Blocks(nn.Module):
    """Net as the numbered block ``layers.0`` (AutoRound tunes block by block)."""

    def __init__(self, spelled: bool) -> None:
        super().__init__()
        self.layers = nn.ModuleList([Net(spelled)])

    def forward(self, x):
        return self.layers[0](x)


def _x(seed: int = 1) -> torch.Tensor:
    return torch.randn(2, 5, D, generator=torch.Generator().manual_seed(seed))


def _quantized_constants(qep) -> dict[str, torch.Tensor]:
    return {k: v for k, v in qep.state_dict.items() if not k.endswith(".weight")}


@pytest.mark.parametrize("recipe", ["int8wo", "int4wo-32", "w8a8"])
def test_each_spelling_is_quantized_as_its_linear_twin(recipe):
    x = _x()
    twin = fxquant.quantize(Net(spelled=False).eval(), recipe, example_inputs=(x,))
    qep = fxquant.quantize(Net(spelled=True).eval(), recipe, example_inputs=(x,))
    rows = {r["name"]: r for r in fxquant.report(qep).rows}
    assert sorted(rows) == sorted(Net.SPELLINGS)
    assert {r["status"] for r in rows.values()} == {"quantized"}
    assert {n: r["kind"] for n, r in rows.items()} == Net.KINDS
    assert all(r["read_transposed"] for r in rows.values())
    assert not any("read_transposed" in r for r in fxquant.report(twin).rows)
    assert {n: (r["in_features"], r["out_features"]) for n, r in rows.items()} == Net.SIZES
    # the same constants from the same weights, and the float weights gone from the program
    want = _quantized_constants(twin)
    got = _quantized_constants(qep)
    assert sorted(got) == sorted(want)
    for k in want:
        torch.testing.assert_close(got[k], want[k], rtol=0, atol=0)
    assert [k for k in qep.state_dict if k.endswith(".weight")] == ["norm.weight", "norm2.weight"]
    aten = torch.ops.aten
    views = (aten.numpy_T.default, aten.t.default, aten.mT.default, aten.transpose.int,
             aten.permute.default)  # fmt: skip
    assert not [n for n in qep.graph.nodes if n.target in views]  # the weights' views went too
    with torch.no_grad():
        torch.testing.assert_close(qep.module()(x), twin.module()(x), rtol=1e-4, atol=1e-5)


def test_dynamo_graphs_spell_them_with_methods_and_getattr():
    found = []

    def capture(gm, example_inputs):  # while Dynamo's metadata is on the graph
        found.append(find_sites(gm.graph, DynamoEditor(gm, example_inputs).weight_of))
        return gm

    torch._dynamo.reset()
    torch.compile(Net(spelled=True).eval(), backend=capture)(_x())
    (sites,) = found
    assert sorted(s.module_name for s in sites) == sorted(Net.SPELLINGS)
    assert all(s.stored_nk and not s.transposed and s.weight.shape == s.weight_nk().shape
               for s in sites)  # fmt: skip


def test_what_is_not_a_transposed_weight():
    class NotWeights(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc = nn.Linear(D, D)
            self.register_buffer("rot", torch.randn(2, D, D))

        def forward(self, x):
            q = self.fc(x)
            att = q @ q.transpose(-2, -1)  # activations, not a constant
            return att @ x + x @ self.rot.permute(0, 2, 1)  # 3-D: a batched product

    x = torch.randn(2, 5, D)
    rows = fxquant.report(fxquant.quantize(NotWeights().eval(), "int8wo", example_inputs=(x,))).rows
    assert [r["name"] for r in rows] == ["fc"]


@pytest.mark.parametrize(
    "method",
    [GPTQ(), AWQ(n_grid=5), SmoothQuant(), AutoRound(iters=4)],
    ids=lambda m: type(m).__name__,
)
def test_calibration_treats_them_as_linears(method):
    data = [_x(seed) for seed in range(4)]
    scheme = (
        Int8DynamicActivation()
        if isinstance(method, SmoothQuant)
        else Int4WeightOnly(group_size=32)
    )
    got = fxquant.calibrate(Blocks(spelled=True).eval(), scheme, data, method=method,
                            progress=False)  # fmt: skip
    want = fxquant.calibrate(Blocks(spelled=False).eval(), scheme, data, method=method,
                             progress=False)  # fmt: skip

    def calibration(qep) -> dict:
        return {r["name"]: r["calibration"] for r in fxquant.report(qep).rows}

    # what calibration did and saw (a's statistics depend on up's output after its fold)
    got_rows, want_rows = calibration(got), calibration(want)
    assert list(got_rows) == list(want_rows)
    for name, row in got_rows.items():
        numbers = {k: v for k, v in row.items() if isinstance(v, float)}
        assert numbers == pytest.approx({k: want_rows[name][k] for k in numbers}, rel=1e-3), name
        for k in ("status", "folded_into"):
            assert row.get(k) == want_rows[name].get(k), (name, k)
    folded = {name: row.get("folded_into") for name, row in got_rows.items()}
    if isinstance(method, (AWQ, SmoothQuant)):
        assert folded["layers.0.up"].startswith("norm ")
        assert folded["layers.0.a"].startswith("norm ")
    if isinstance(method, AWQ):
        assert folded["layers.0.b"] == "linear layers.0.a.weight"
    x = _x(9)
    with torch.no_grad():
        assert sqnr(want.module()(x), got.module()(x)) > 60


@pytest.mark.slow
def test_fp8_training_reaches_them_as_it_does_linears():
    x, target = _x(), _x(2)
    grads = []
    for spelled in (True, False):
        torch._dynamo.reset()
        model = Net(spelled=spelled).train()
        config = QuantConfig(scheme=Float8Recipe(scaling="current"))
        run = torch.compile(model, backend="fxquant", options={"config": config})
        F.mse_loss(run(x), target).backward()
        grads.append({n: p.grad for n, p in model.named_parameters()})
        rows = fxquant.backend.last_reports[-1]
        # not the first and last Linear: accelerate's default filter, as for the twin
        assert [r["name"] for r in rows if r["status"] == "quantized"] == ["down", "a", "b"]
    for name, g in grads[1].items():
        torch.testing.assert_close(grads[0][name], g, rtol=1e-4, atol=1e-6, msg=name)


def test_the_cpu_lowering_runs_a_float_one_on_the_native_kernel():
    x = _x()
    ep = torch.export.export(Net(spelled=True).eval(), (x,))
    lowered = prepacked(ep)
    targets = [str(n.target) for n in lowered.graph.nodes if n.op == "call_function"]
    assert targets.count("fxquant.cpu_native_float32_linear.default") == len(Net.SPELLINGS)
    assert "aten.numpy_T.default" not in targets and "aten.permute.default" not in targets
    with torch.no_grad():
        torch.testing.assert_close(lowered.module()(x), ep.module()(x), rtol=1e-5, atol=1e-5)
    # and the report says so of a layer a config keeps in float
    config = QuantConfig(scheme=Int8DynamicActivation(), overrides={"c": None})
    kernels = fxquant.report(fxquant.quantize(ep, config)).cpu_kernels()
    assert {k["scheme"]: k["layers"] for k in kernels}["float32 (kept in float)"] == ["c"]
