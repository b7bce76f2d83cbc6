"""torch.compile(model, backend="fxquant"): quantized at compile time, compiled by Inductor."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import torch

import fxquant
from conftest import Mixed
from fxquant.kernels import cpu as native
from fxquant.passes.rewrite import counters


def test_backend_is_found_through_the_entry_point_without_importing_fxquant():
    code = (
        "import sys, torch._dynamo\n"
        "assert 'fxquant' in torch._dynamo.list_backends(exclude_tags=())\n"
        "assert 'fxquant' not in sys.modules\n"
        "from torch._dynamo.backends.registry import lookup_backend\n"
        "print(lookup_backend('fxquant').__module__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120
    )
    assert out.stdout.strip() == "fxquant.backend"


def test_backend_rejects_unknown_options():
    from fxquant.backend import fxquant_backend

    with pytest.raises(ValueError, match=r"options \['mode'\] are not known"):
        fxquant_backend(None, [], options={"mode": "x"})


@pytest.mark.slow
def test_backend_quantizes_and_matches_the_exported_program():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Mixed().eval()
    cfg = fxquant.QuantConfig(
        scheme=fxquant.Int8DynamicActivation(),
        overrides={"proj": fxquant.Float8Dynamic(granularity="row")},
    )
    x = torch.randn(2, 5, 64)
    before = dict(counters)
    compiled = torch.compile(model, backend="fxquant", options={"config": cfg})
    y = compiled(x)  # grad mode on: inference semantics all the same
    assert not y.requires_grad
    assert counters["int8_dynamic"] - before.get("int8_dynamic", 0) == 2
    assert counters["float8_dynamic"] - before.get("float8_dynamic", 0) == 1
    qep = fxquant.quantize(model, cfg, example_inputs=(x,))
    with torch.no_grad():
        # The CPU int8 kernel returns bf16 (passes/lower.py), and a per-token activation
        # quantizer downstream turns that rounding into an occasional flipped step: close to the
        # semantic program, not bit-equal.
        assert fxquant.core.reference.sqnr(qep.module()(x), y) > 30
        assert fxquant.core.reference.sqnr(model(x), y) > 25
    rows = fxquant.backend.last_reports[-1]
    assert [r["name"] for r in rows] == ["fc", "proj", "c_fc"]
    assert all(r["status"] == "quantized" for r in rows)


def test_two_models_of_one_class_each_run_their_own_weights():
    """Dynamo guards parameter inputs by metadata only: without the backend's identity guards a
    second instance of the class ran the first one's quantized weights (relative error 1.2)."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    first, second = Mixed().eval(), Mixed().eval()
    x = torch.randn(3, 64)
    with torch.no_grad():
        outs = [torch.compile(m, backend="fxquant")(x) for m in (first, second)]
        for m, y in zip((first, second), outs, strict=True):
            assert fxquant.core.reference.sqnr(m(x), y) > 25
    torch._dynamo.reset()


def test_weights_changed_after_compiling_are_refused_not_run_stale():
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Mixed().eval()
    compiled = torch.compile(model, backend="fxquant")
    x = torch.randn(3, 64)
    with torch.no_grad():
        compiled(x)
        model.fc.weight.mul_(2)  # in place, as load_state_dict copies
        with pytest.raises(RuntimeError, match=r"fc.weight was changed in place after the compile"):
            compiled(x)
        torch._dynamo.reset()  # the documented way out: compiled anew, quantized anew
        y = compiled(x)
        assert fxquant.core.reference.sqnr(model(x), y) > 25
    torch._dynamo.reset()


def test_a_weight_kept_in_float_stays_an_input_changes_reach_the_graph():
    """Only the weights a compile baked in are frozen: one the config keeps in float is read at
    run time, so changing it in place is no error and the next call uses it."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Mixed().eval()
    cfg = fxquant.QuantConfig(scheme=fxquant.Int8WeightOnly(), modules_to_not_convert=("fc",))
    compiled = torch.compile(model, backend="fxquant", options={"config": cfg})
    x = torch.randn(3, 64)
    before = dict(counters)
    with torch.no_grad():
        compiled(x)
        assert [r["status"] for r in fxquant.backend.last_reports[-1]][0] == "skipped"
        if native.available():  # the fp32 kernel, on the weight as it is
            fp32 = "prepack.cpu_native_float32_linear"
            assert counters[fp32] - before.get(fp32, 0) == 1
        model.fc.weight.mul_(-3)
        model.fc.bias.add_(1)
        y = compiled(x)
        assert fxquant.core.reference.sqnr(model(x), y) > 25
        model.c_fc.weight.mul_(2)  # quantized: frozen
        with pytest.raises(RuntimeError, match=r"c_fc.weight was changed in place"):
            compiled(x)
    torch._dynamo.reset()


def test_skipped_module_guards_cannot_run_another_models_weights():
    """With Dynamo's module guards filtered out, two models sharing one forward's code share its
    graphs too: the second call is refused, not run on the first model's weights."""
    torch._dynamo.reset()
    first, second = Mixed().eval(), Mixed().eval()
    options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    x = torch.randn(3, 64)
    with torch.no_grad():
        torch.compile(first, backend="fxquant", options=dict(options))(x)
        with pytest.raises(RuntimeError, match="weights of another model"):
            torch.compile(second, backend="fxquant", options=dict(options))(x)
    torch._dynamo.reset()


def test_recompile_limit_is_reported_and_watch_says_the_call_ran_in_float():
    import fxquant.backend as backend

    torch._dynamo.reset()
    model = torch.nn.Sequential(torch.nn.Linear(64, 64)).eval()
    compiled = torch.compile(model, backend="fxquant", dynamic=False)
    with torch._dynamo.config.patch(recompile_limit=2), torch.no_grad():
        with backend.watch() as first:
            compiled(torch.randn(2, 64))
        compiled(torch.randn(3, 64))  # a recompile for the new static shape: the limit
        x = torch.randn(4, 64)
        limit = pytest.warns(RuntimeWarning, match=r"recompile_limit \(2\).*NOT quantized")
        with limit, backend.watch() as past_limit:
            y = compiled(x)
    torch._dynamo.reset()
    assert first.quantized and first.calls == 1
    assert not past_limit.quantized
    assert torch.equal(y, model(x))  # the float model's output exactly: it ran eagerly
    assert backend.recompile_limit_hit[0] == "recompile_limit"


def test_a_graph_of_unbacked_batch_runs_its_small_kernels_serial():
    # fxquant.passes.cpu.parallel in the backend: traced at an unknown batch (hint 8192), its
    # OpenMP regions open only from MIN_PARALLEL_WORK iterations, so M = 1 wakes no thread
    from torch._inductor.utils import run_and_get_code

    from fxquant.passes.cpu.parallel import MIN_PARALLEL_WORK

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = Mixed().eval()
    options = {"config": "w8a8", "inductor_config": {"cpp.threads": 2, "fx_graph_cache": False}}
    compiled = torch.compile(model, backend="fxquant", options=options)
    x = torch.randn(3, 64)
    torch._dynamo.decorators.mark_unbacked(x, 0)
    _, code = run_and_get_code(compiled, x)
    code = "".join(code)
    guards = re.findall(rf">= {MIN_PARALLEL_WORK}\)+\s*\{{\s*#pragma omp parallel", code)
    assert len(guards) == code.count("#pragma omp parallel") > 0
    for m in (1, 300):  # the serial copies, then the parallel ones, in the same graph
        x = torch.randn(m, 64)
        with torch.no_grad():
            want = fxquant.quantize(model, "w8a8", example_inputs=(x,)).module()(x)
        assert fxquant.core.reference.sqnr(want, compiled(x)) > 30


def test_the_wrapper_skips_size_checks_dynamo_made_and_keeps_the_bounds():
    # every call of a compiled decode step re-checked each weight's size and stride (~0.5 ms of
    # SmolLM2's 7.5 ms step): Dynamo's guards have checked the inputs already, the weights are
    # frozen; a caller's inductor_config turns the checks back on
    from torch._inductor.utils import run_and_get_code

    torch.manual_seed(0)
    model = Mixed().eval()
    x = torch.randn(3, 64)
    for extra, checked in (({}, False), ({"size_asserts": True}, True)):
        torch._dynamo.reset()
        options = {"config": "int8wo", "inductor_config": {"fx_graph_cache": False, **extra}}
        compiled = torch.compile(model, backend="fxquant", options=options)
        _, code = run_and_get_code(compiled, x)
        assert ("assert_size_stride(" in "".join(code)) == checked
    with torch.no_grad():
        want = fxquant.quantize(model, "int8wo", example_inputs=(x,)).module()(x)
        assert fxquant.core.reference.sqnr(want, compiled(x)) > 30
    # a new shape or new strides are Dynamo's to catch (a recompile), not the wrapper's
    torch._dynamo.reset()
    compiled = torch.compile(model, backend="fxquant", options={"config": "int8wo"})
    for x in (torch.randn(3, 64), torch.randn(5, 64), torch.randn(64, 5).t()):
        with torch.no_grad():
            want = fxquant.quantize(model, "int8wo", example_inputs=(x,)).module()(x)
        assert fxquant.core.reference.sqnr(want, compiled(x)) > 30
