"""The from_pretrained bridge's eager calls on the CPU lowering's kernels (fxquant.passes.eager).

Oracles: a bridged model called eagerly gives the logits of its own export lowered for the CPU
(``fxquant.passes.lower.lower``: the same prepacked constants and compositions, run as a
program) to fp32 rounding (sibling fusion concatenates q/k/v there), and the reference math's
(``reference_math()``, what the ops' eager kernels compute, tested bit for bit against the
export path elsewhere) within an SQNR floor; traces still see the ``fxquant::`` ops.
"""

from __future__ import annotations

import copy
import pickle

import pytest
import torch

transformers = pytest.importorskip("transformers")

from test_bmm_experts import llama4  # noqa: E402
from test_int8_experts import qwen2_moe  # noqa: E402

import fxquant  # noqa: E402
from fxquant.core.reference import sqnr  # noqa: E402
from fxquant.hf.bridge import FxquantHfConfig, QuantizedLinear, quantize_linears  # noqa: E402
from fxquant.hf.bridge_experts import ExpertWeights  # noqa: E402
from fxquant.passes.eager import EagerKernels, reference_math  # noqa: E402
from fxquant.passes.lower import lower  # noqa: E402

KW = {"use_cache": False}
# decode (M = 2: a batch of two one-token rows) and prefill (M = 22) rows: the native kernels
# pick their path by M, the dispatch table by machine class
IDS = {
    "decode": torch.randint(0, 96, (2, 1), generator=torch.Generator().manual_seed(1)),
    "prefill": torch.randint(0, 96, (2, 11), generator=torch.Generator().manual_seed(2)),
}  # ids below both models' vocabularies
# reference math vs the kernels (whose activations are bf16 or int8 where the table says)
FLOORS = {"int4wo-64": 30, "w4a8-64": 30, "hqq-int4-64": 30}


def _save(path, model) -> str:
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    cfg = transformers.LlamaConfig(
        vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return _save(tmp_path_factory.mktemp("llama"), transformers.LlamaForCausalLM(cfg).eval())


def _bridged(path, config):
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=FxquantHfConfig(config), dtype=torch.float32
    ).eval()


def _logits(model, ids) -> torch.Tensor:
    with torch.no_grad():
        return model(ids, **KW).logits


def _check(model, floor: float) -> None:
    """Eager logits vs the lowered export (close) and the reference math (SQNR floor), at both
    lengths."""
    for ids in IDS.values():
        lowered = lower(torch.export.export(model, (ids,), kwargs=KW)).module()
        got = _logits(model, ids)
        torch.testing.assert_close(got, _logits(lowered, ids), rtol=1e-5, atol=1e-5)
        with reference_math():
            want = _logits(model, ids)
        assert sqnr(want, got) > floor


# a scheme per native kernel family (int8, VNNI w8a8, int4 and its W4A8 path, fp8 rows and
# blocks, HQQ's affine codes), and nf4, which has none (its composition is its reference's)
@pytest.mark.parametrize(
    "recipe",
    ["int8wo", "w8a8", "int4wo-64", "w4a8-64", "fp8-row", "fp8-block", "hqq-int4-64", "nf4"],
)
def test_eager_calls_run_the_lowered_kernels(llama, recipe):
    model = _bridged(llama, recipe)
    linears = [m for m in model.modules() if isinstance(m, QuantizedLinear)]
    assert len(linears) == 14 and not any(m._kernels.built for m in linears)
    _check(model, FLOORS.get(recipe, 40))
    assert all(m._kernels.built for m in linears)


@pytest.mark.parametrize(
    "arch, recipe",
    [("qwen2_moe", "int8wo"), ("qwen2_moe", "w8a8"), ("qwen2_moe", "int4wo-32"),
     ("qwen2_moe", "fp8-row"), ("llama4", "int8wo")],
)  # fmt: skip
def test_eager_experts_run_the_lowered_grouped_kernels(tmp_path, arch, recipe):
    """Grouped experts (Qwen2-MoE) and Llama 4's every-token experts (E groups of T rows)."""
    config = fxquant.QuantConfig(
        scheme=fxquant.QuantConfig.from_recipe(recipe).scheme,
        modules_to_not_convert=("lm_head", "gate", "shared_expert_gate", "router"),
    )
    float_model = qwen2_moe() if arch == "qwen2_moe" else llama4()
    model = _bridged(_save(tmp_path, float_model), config)
    experts = [m for m in model.modules() if isinstance(m, ExpertWeights)]
    assert len(experts) == 4
    _check(model, FLOORS.get(recipe, 40) - 10)  # a routing flip moves a whole row
    assert all(m._kernels.built for m in experts)


def _linear(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(256, 96))
    quantize_linears(model, "int4wo-64")
    return model


def test_a_changed_constant_rebuilds_and_traces_see_the_op():
    """The built graph follows the module's constants (an in-place load, a new tensor); a copy,
    a pickle and a trace of a module whose kernels are built see the module, not the graph."""
    model, other = _linear(0), _linear(1)
    x = torch.randn(5, 256)
    first = model(x)
    # the int4 weight in the kernel's layout, beside the module's own (no more than as much again)
    own = sum(t.numel() * t.element_size() for t in model.buffers())
    assert 0 < model[0]._kernels.extra_bytes <= own
    with reference_math():
        assert sqnr(model(x), first) > 30
    model.load_state_dict(other.state_dict())  # copies into the same buffers
    torch.testing.assert_close(model(x), other(x), rtol=0, atol=0)
    layer = model[0]
    layer.qweight = other[0].qweight.clone()  # a new tensor
    torch.testing.assert_close(model(x), other(x), rtol=0, atol=0)

    clone = copy.deepcopy(model)
    assert not clone[0]._kernels.built
    torch.testing.assert_close(clone(x), other(x), rtol=0, atol=0)
    again = pickle.loads(pickle.dumps(model))
    assert not again[0]._kernels.built
    torch.testing.assert_close(again(x), other(x), rtol=0, atol=0)

    ep = torch.export.export(model, (x,))
    targets = {str(n.target) for n in ep.graph.nodes if n.op == "call_function"}
    assert targets == {"fxquant.int4_weight_only_linear.default"}
    traced = torch.fx.symbolic_trace(model)
    assert [str(n.target) for n in traced.graph.nodes if n.op == "call_function"] == [
        "fxquant.int4_weight_only_linear.default"
    ]
    with reference_math():
        torch.testing.assert_close(ep.module()(x), model(x), rtol=0, atol=0)


def test_the_op_runs_as_it_is_outside_eager_cpu_calls():
    """Meta tensors (and any other device, fake or subclass tensor) call the op itself."""
    kernels, op = EagerKernels(), torch.ops.aten.add.Tensor
    a = torch.ones(2, device="meta")
    assert kernels(op, (a, a), (a,)).device.type == "meta" and not kernels.built


def test_a_call_that_records_autograd_still_refuses_backward():
    """Grad mode with an input that needs a gradient: the call is recorded and a backward raises
    at the native kernel (as the op's own would), never silently dropping x's gradient."""
    model = _linear(0)
    x = torch.randn(3, 256, requires_grad=True)
    y = model(x)
    assert y.requires_grad and model[0]._kernels.built
    # the native kernel's refusal, or (FXQUANT_NATIVE=0) the aten kernel's
    with pytest.raises(RuntimeError, match="inference kernel|derivative .* not implemented"):
        y.sum().backward()
    with torch.no_grad():
        assert not model(x).requires_grad
