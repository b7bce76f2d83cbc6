"""fxquant.fp8_autocast regions and accelerate's four FP8 functions (fxquant.accelerate): which
linears train in FP8, that a region compiles whole, and a real accelerate.Accelerator loop."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import fxquant
import fxquant.training.autocast as autocast_mod
from fxquant import Float8Recipe, QuantConfig
from fxquant.accelerate import (
    apply_fp8_autowrap,
    contextual_fp8_autocast,
    convert_model,
    has_transformer_engine_layers,
)
from fxquant.backend import last_reports
from fxquant.training.layers import Float8LayerNorm, Float8Linear
from fxquant.training.state import fp8_state_dict

CURRENT = Float8Recipe(scaling="current")
DELAYED = Float8Recipe(amax_history_len=4)


class Regions(nn.Module):
    """a outside, b in a current-scaling region, c in a nested enabled=False region."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.c = nn.Linear(32, 32), nn.Linear(32, 32), nn.Linear(32, 32)

    def forward(self, x):
        x = self.a(x)
        with fxquant.fp8_autocast(recipe=CURRENT):
            x = torch.relu(self.b(x))
            with fxquant.fp8_autocast(enabled=False):
                x = self.c(x)
        return x


class MLP(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(32)
        self.up, self.mid, self.down = nn.Linear(32, 64), nn.Linear(64, 64), nn.Linear(64, 32)

    def forward(self, x):
        return self.down(torch.relu(self.mid(torch.relu(self.up(self.norm(x))))))


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    # Each test's MLP shares MLP.forward's code with the others', and a frame compiled inside
    # a region entered outside the graph is one more guarded entry of it: without a reset the
    # file would pass Dynamo's recompile limit, and a frame past it runs eagerly, uncompiled
    torch._dynamo.reset()


def _decisions() -> dict[str, str | None]:
    """{layer: scaling of its recipe, or None} of the latest compile."""
    return {r["name"]: (r["scheme"] or {}).get("scaling") for r in last_reports[-1]}


def _new_reports():
    """A function giving the backend's reports added since this call (``last_reports`` keeps
    the last 16 of the process: its length says nothing once it is full)."""
    before = {id(rows) for rows in last_reports}
    return lambda: [rows for rows in last_reports if id(rows) not in before]


def _run(model, x):
    y = model(x)
    y.square().mean().backward()
    return y


def test_regions_choose_the_linears_and_their_recipe():
    torch.manual_seed(0)
    model, x = Regions(), torch.randn(8, 32)
    y = _run(torch.compile(model, backend="fxquant"), x)
    assert _decisions() == {"a": None, "b": "current", "c": None}
    reasons = {r["name"]: r["reason"] for r in last_reports[-1]}
    assert "outside every" in reasons["a"] and "enabled=False" in reasons["c"]
    grads = [p.grad.clone() for p in model.parameters()]

    # the same numbers as a config that puts b alone in FP8
    model.zero_grad()
    config = QuantConfig(scheme=None, overrides={"b": CURRENT}, modules_to_not_convert=())
    want = _run(torch.compile(model, backend="fxquant", options={"config": config}), x)
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    for g, p in zip(grads, model.parameters(), strict=True):
        torch.testing.assert_close(g, p.grad, rtol=0, atol=0)


def test_a_region_compiles_into_one_graph():
    explained = torch._dynamo.explain(Regions())(torch.randn(4, 32))
    assert explained.graph_break_count == 0
    assert explained.graph_count == 1


def test_recipe_none_takes_the_compile_config_and_delayed_state_is_per_region():
    class Half(MLP):
        def forward(self, x):
            x = torch.relu(self.up(self.norm(x)))
            with fxquant.fp8_autocast():
                x = torch.relu(self.mid(x))
            return self.down(x)

    model = Half()
    config = QuantConfig(scheme=DELAYED, modules_to_not_convert=())
    compiled = torch.compile(model, backend="fxquant", options={"config": config})
    for _ in range(2):
        _run(compiled, torch.randn(4, 32))
    assert _decisions() == {"up": None, "mid": "delayed", "down": None}
    layers = {k.split(".")[0] for k in fp8_state_dict(model)}
    assert layers == {"mid"}  # no state for the linears outside the region
    assert fp8_state_dict(model)["mid.input.scale"] != 1.0  # updated after step 1


def test_no_config_means_te_defaults_for_every_linear_in_a_region():
    class All(MLP):
        def forward(self, x):
            with fxquant.fp8_autocast(enabled=True):
                return super().forward(x)

    _run(torch.compile(All(), backend="fxquant"), torch.randn(4, 32))
    # Float8Recipe() is TE's DelayedScaling; no first/last rule under regions (TE has none)
    assert _decisions() == {"up": "delayed", "mid": "delayed", "down": "delayed"}


def test_an_inference_config_with_regions_is_refused():
    compiled = torch.compile(Regions(), backend="fxquant", options={"config": "int8wo"})
    with pytest.raises(Exception, match="fp8_autocast regions .* inference schemes"):
        compiled(torch.randn(4, 32))


def test_eager_use_warns_once_and_changes_nothing(monkeypatch):
    monkeypatch.setattr(autocast_mod, "_warned_eager", False)
    model, x = Regions(), torch.randn(4, 32)
    with pytest.warns(UserWarning, match="has no effect here"):
        y = model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        model(x)
    torch.testing.assert_close(y, model.c(torch.relu(model.b(model.a(x)))), rtol=0, atol=0)


def test_bad_arguments():
    with (
        pytest.raises(ValueError, match="not both"),
        fxquant.fp8_autocast(recipe=CURRENT, fp8_recipe=CURRENT),
    ):
        pass
    with (
        pytest.raises(TypeError, match="takes a fxquant.Float8Recipe"),
        fxquant.fp8_autocast(recipe="tensorwise"),
    ):
        pass


def test_te_spelling_fp8_recipe_is_accepted():
    class TE(MLP):
        def forward(self, x):
            with fxquant.fp8_autocast(enabled=True, fp8_recipe=CURRENT):
                return super().forward(x)

    _run(torch.compile(TE(), backend="fxquant"), torch.randn(4, 32))
    assert set(_decisions().values()) == {"current"}


# --------------------------------------------------------------------------------------------
# accelerate's four functions
# --------------------------------------------------------------------------------------------


def test_convert_model_is_lossless_both_ways():
    torch.manual_seed(0)
    model = nn.Sequential(MLP(), nn.Linear(32, 10))  # 10 is not a multiple of 16
    params = {n: p for n, p in model.named_parameters()}
    x = torch.randn(4, 32)
    before = model(x)
    done = convert_model(model)
    assert type(model[0].up) is Float8Linear and type(model[0].norm) is Float8LayerNorm
    assert type(model[1]) is nn.Linear and done["1"].startswith("skipped: dims 10x32")
    assert done["0.up"] == "Linear -> Float8Linear"
    assert {n: p for n, p in model.named_parameters()} == params  # the same Parameter objects
    torch.testing.assert_close(model(x), before, rtol=0, atol=0)
    assert has_transformer_engine_layers(model)

    convert_model(model, to_transformer_engine=False)
    assert type(model[0].up) is nn.Linear and type(model[0].norm) is nn.LayerNorm
    assert not has_transformer_engine_layers(model)
    assert {n: p for n, p in model.named_parameters()} == params


def test_convert_model_flags_and_subclasses():
    class MyLinear(nn.Linear):
        pass

    model = nn.Sequential(nn.Linear(16, 16), nn.LayerNorm(16), MyLinear(16, 16))
    done = convert_model(model, _convert_ln=False)
    assert type(model[0]) is Float8Linear and type(model[1]) is nn.LayerNorm
    assert type(model[2]) is MyLinear and "subclasses Linear" in done["2"]
    convert_model(model, _convert_linear=False)
    assert type(model[0]) is Float8Linear and type(model[1]) is Float8LayerNorm


def test_only_converted_layers_train_in_fp8_when_some_are():
    model = MLP()
    convert_model(model.mid)  # named_modules of mid: "" → the layer itself
    apply_fp8_autowrap(model, None)
    _run(torch.compile(model, backend="fxquant"), torch.randn(4, 32))
    assert _decisions() == {"up": None, "mid": "delayed", "down": None}
    reasons = {r["name"]: r["reason"] for r in last_reports[-1]}
    assert "not converted by convert_model" in reasons["up"]


def test_contextual_fp8_autocast_trains_in_fp8_and_evaluates_in_high_precision():
    torch.manual_seed(0)
    model = MLP()
    assert not has_transformer_engine_layers(model)
    forward = model.forward
    model.forward = contextual_fp8_autocast(forward, CURRENT).__get__(model)
    assert model.forward.__wrapped__ is forward
    assert has_transformer_engine_layers(model)
    compiled = torch.compile(model, backend="fxquant")
    x = torch.randn(4, 32)
    y_train = _run(compiled, x)
    assert set(_decisions().values()) == {"current"}

    model.eval()
    with torch.no_grad():
        y_eval = compiled(x)
        float_y = forward(x)
    torch.testing.assert_close(y_eval, float_y, rtol=1e-5, atol=1e-5)
    assert (y_train - float_y).abs().max() > 1e-4  # the training forward was FP8


def test_use_during_eval_keeps_fp8_in_eval():
    torch.manual_seed(0)
    model = MLP()
    forward = model.forward
    model.forward = contextual_fp8_autocast(forward, CURRENT, use_during_eval=True).__get__(model)
    model.eval()
    x = torch.randn(4, 32)
    with torch.no_grad():
        y = torch.compile(model, backend="fxquant")(x)
        assert (y - forward(x)).abs().max() > 1e-4
    assert set(_decisions().values()) == {"current"}


def test_apply_fp8_autowrap_reads_te_and_ao_handlers():
    te = {"fp8_format": "E4M3", "amax_history_len": 8, "amax_compute_algo": "max"}
    model = apply_fp8_autowrap(MLP(), te)
    # accelerate's TE conversion: every Linear (dims multiples of 16), marked as it swaps them
    assert {type(m).__name__ for m in (model.up, model.mid, model.down)} == {"Float8Linear"}
    _run(torch.compile(model, backend="fxquant"), torch.randn(4, 32))
    rows = last_reports[-1]
    assert {r["scheme"]["fp8_format"] for r in rows} == {"E4M3"}
    assert {r["scheme"]["amax_history_len"] for r in rows} == {8}

    # AO: current scaling, accelerate's default filter (not the first and last Linear)
    model = apply_fp8_autowrap(MLP(), {"config": None, "pad_inner_dim": True})
    assert [type(m).__name__ for m in (model.up, model.mid, model.down)] == [
        "Linear",
        "Float8Linear",
        "Linear",
    ]
    _run(torch.compile(model, backend="fxquant"), torch.randn(4, 32))
    assert _decisions() == {"up": None, "mid": "current", "down": None}


class Broken(nn.Module):
    """Two blocks with a graph break between them, as FSDP2 breaks at each sharded module."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = MLP(), MLP()

    def forward(self, x):
        x = self.a(x)
        torch._dynamo.graph_break()
        return self.b(x)


def test_a_region_reaches_marked_layers_across_graph_breaks(monkeypatch):
    # The wrapped forward breaks the graph, so Dynamo runs it (and the region) eagerly and
    # compiles each block as its own frame: the marked layers there still train in FP8, the
    # frames' guards hold the region (eval, with the region disabled, recompiles in high
    # precision; training again reuses the FP8 frames), and nothing warns
    monkeypatch.setattr(autocast_mod, "_warned_eager", False)
    model = apply_fp8_autowrap(Broken(), {"config": None, "module_filter_func": None})
    run = torch.compile(model, backend="fxquant")
    x = torch.randn(4, 32)
    new = _new_reports()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", message=".*has no effect here")
        _run(run, x)
    trained = [{r["name"]: r["status"] for r in rows} for rows in new()]
    # accelerate's default filter over the whole model: not its first Linear nor its last
    assert trained == [
        {"a.up": "skipped", "a.mid": "quantized", "a.down": "quantized"},
        {"b.up": "quantized", "b.mid": "quantized", "b.down": "skipped"},
    ]
    model.eval()
    new = _new_reports()
    with torch.no_grad():
        y = run(x)
    evaluated = new()
    assert len(evaluated) == 2  # both frames recompiled
    assert all(r["status"] == "skipped" for rows in evaluated for r in rows)
    torch.testing.assert_close(y, model.b(model.a(x)), rtol=1e-6, atol=1e-6)
    model.train()
    new = _new_reports()
    _run(run, x)
    assert new() == []  # the FP8 frames again, not compiled anew


def test_a_region_around_a_compiled_call_reaches_marked_layers():
    # as a TE region around a call does; outside it the frame recompiles in high precision
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 32)
    convert_model(model)
    run = torch.compile(model, backend="fxquant")
    with fxquant.fp8_autocast(recipe=CURRENT):
        _run(run, x)
    assert _decisions() == {"up": "current", "mid": "current", "down": "current"}
    _run(run, x)
    assert _decisions() == {"up": None, "mid": None, "down": None}


AO_ALL_GATHER = {"config": None, "enable_fsdp_float8_all_gather": True}


def test_ao_fp8_all_gather_wraps_the_fp8_layers_before_sharding(monkeypatch):
    from fxquant.training.fsdp import ALL_GATHER_ATTR, Float8AllGatherWeight

    # no process group: nothing to all-gather, said once
    with pytest.warns(UserWarning, match="no process group of two or more ranks"):
        model = apply_fp8_autowrap(MLP(), AO_ALL_GATHER)
    assert not any(isinstance(p, Float8AllGatherWeight) for p in model.parameters())
    # two ranks (the two-process FSDP2 runs themselves: tests/test_float8_fsdp.py): only the
    # layer that trains in FP8 gathers in FP8, the first and last keep their weights' precision
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda group=None: 2)
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 32)
    want = model(x)
    apply_fp8_autowrap(model, AO_ALL_GATHER)
    kinds = {n: type(m.weight).__name__ for n, m in model.named_modules() if hasattr(m, "bias")}
    assert kinds == {
        "norm": "Parameter",
        "up": "Parameter",
        "mid": "Float8AllGatherWeight",
        "down": "Parameter",
    }
    assert getattr(model.up, ALL_GATHER_ATTR)["reason"] == "filtered out"
    with torch.no_grad():
        torch.testing.assert_close(model.forward.__wrapped__(x), want, rtol=0, atol=0)


def test_ao_fp8_all_gather_refuses_a_sharded_model_and_skips_ddp(tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    dist = torch.distributed
    dist.init_process_group(
        "gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1
    )
    try:
        sharded = MLP()
        fully_shard(sharded, mesh=init_device_mesh("cpu", (1,)))
        with pytest.raises(ValueError, match="sharded already.*before fully_shard"):
            apply_fp8_autowrap(sharded, AO_ALL_GATHER)
        ddp = nn.parallel.DistributedDataParallel(MLP())
        with pytest.warns(UserWarning, match="no effect under DDP"):
            apply_fp8_autowrap(ddp, AO_ALL_GATHER)
    finally:
        dist.destroy_process_group()


def test_a_real_accelerate_loop_trains_with_fxquant_fp8():
    accelerate = pytest.importorskip("accelerate")
    torch.manual_seed(0)
    accelerator = accelerate.Accelerator(cpu=True)
    model = MLP()
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    x = torch.randn(64, 32)
    data = torch.utils.data.TensorDataset(x, x @ torch.randn(32, 32) / 8)  # a learnable target
    loader = torch.utils.data.DataLoader(data, batch_size=16)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    # the two lines: fxquant as the FP8 engine of the loop
    recipe = {"fp8_format": "HYBRID", "amax_history_len": 16, "amax_compute_algo": "max"}
    model = apply_fp8_autowrap(model, recipe)
    model = torch.compile(model, backend="fxquant")

    losses = []
    for _ in range(4):
        for x, target in loader:
            loss = nn.functional.mse_loss(model(x), target)
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    assert set(_decisions().values()) == {"delayed"}
    assert sum(losses[-4:]) < 0.9 * sum(losses[:4])  # the last epoch against the first
    state = fp8_state_dict(model)
    assert state["up.input.scale"] != 1.0 and state["up.grad_output.scale"] != 1.0
    unwrapped = accelerator.unwrap_model(model)
    assert has_transformer_engine_layers(unwrapped)


def test_converted_layers_without_a_region_train_in_high_precision():
    # te.Linear outside te.fp8_autocast runs in high precision; with no config given, a model
    # with FP8 layers is not taken for an inference model (the default int8wo) either
    torch.manual_seed(0)
    model, x = MLP(), torch.randn(4, 32)
    convert_model(model)
    y = _run(torch.compile(model, backend="fxquant"), x)
    assert _decisions() == {"up": None, "mid": None, "down": None}
    assert model.up.weight.grad is not None  # trained, not an inference graph
    torch.testing.assert_close(y, model(x), rtol=1e-5, atol=1e-6)


def test_apply_fp8_autowrap_over_an_instance_forward():
    model = MLP()
    model.forward = lambda x: MLP.forward(model, x)  # a wrapper set on the instance
    apply_fp8_autowrap(model, CURRENT)
    assert has_transformer_engine_layers(model)
    _run(torch.compile(model, backend="fxquant"), torch.randn(4, 32))
    assert set(_decisions().values()) == {"current"}
