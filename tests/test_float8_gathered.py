"""FSDP's FP8-gathered weight (``fxquant.training.gathered.Float8GatheredWeight``), one process:
every op but the FP8 linear sees the dequantized weight, FSDP's views keep it gathered, and the
FP8 linear (eager and compiled by the fxquant backend) feeds its fp8 values and scale to the GEMM
as they are, with the results of casting the dequantized weight. The two-process FSDP2 runs are
in tests/test_float8_fsdp.py."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from fxquant import Float8Recipe, QuantConfig
from fxquant.training.gathered import Float8GatheredWeight
from fxquant.training.numerics import E4M3, float8_training_linear, quantize_rows, weight_rows

CURRENT = Float8Recipe(scaling="current")


def gathered(n: int = 48, k: int = 64, dtype=torch.float32, seed: int = 0) -> Float8GatheredWeight:
    """What fsdp_post_all_gather builds: the weight cast per tensor, as fsdp_pre_all_gather does."""
    w = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)).to(dtype)
    q, scale = quantize_rows(w, CURRENT, E4M3, scale=None)
    return Float8GatheredWeight(q, scale.reshape(1), dtype)


def test_every_other_op_sees_the_dequantized_weight():
    w = gathered(dtype=torch.bfloat16)
    plain = w.dequantize()
    assert type(plain) is torch.Tensor and plain.dtype == torch.bfloat16
    torch.testing.assert_close(plain, (w.fp8_data.float() * w.fp8_scale).bfloat16())
    x = torch.randn(5, 64, dtype=torch.bfloat16)
    y = F.linear(x, w)
    assert type(y) is torch.Tensor
    assert torch.equal(y, F.linear(x, plain))
    assert torch.equal(w.abs().amax(), plain.abs().amax())


def test_fsdps_views_keep_it_gathered():
    # FSDP2 builds its unsharded parameter as nn.Parameter(torch.as_strided(...)): a detach
    w = gathered()
    for view in (w.detach(), torch.as_strided(w, w.shape, w.stride(), 0), w.view(48, 64)):
        assert isinstance(view, Float8GatheredWeight)
        assert view.fp8_data.data_ptr() == w.fp8_data.data_ptr()
        assert view.fp8_scale is w.fp8_scale
    p = nn.Parameter(w)
    assert isinstance(p, Float8GatheredWeight) and p.requires_grad


def test_bad_parts_are_refused():
    q = torch.zeros(4, 16, dtype=E4M3)
    with pytest.raises(ValueError, match="float8_e4m3fn data and a one-element fp32 scale"):
        Float8GatheredWeight(q.float(), torch.ones(1), torch.float32)
    with pytest.raises(ValueError, match=r"scale of shape \(4, 1\)"):
        Float8GatheredWeight(q, torch.ones(4, 1), torch.float32)


def test_the_gemm_reads_the_gathered_values_as_the_cast_would_make_them():
    w = gathered()
    q, s = weight_rows(w, CURRENT, scale=None, transpose=False)
    assert q is w.fp8_data  # no cast
    # what casting the dequantized weight gives: the same e4m3 values, the same scale (to an ulp)
    q_ref, s_ref = quantize_rows(w.dequantize(), CURRENT, E4M3, scale=None)
    assert torch.equal(q.view(torch.uint8), q_ref.view(torch.uint8))
    torch.testing.assert_close(s, s_ref, rtol=2e-7, atol=0)
    qt, st = weight_rows(w, CURRENT, scale=None, transpose=True)  # dgrad: Wᵀ, N last
    qt_ref, _ = quantize_rows(w.dequantize().t(), CURRENT, E4M3, scale=None)
    assert torch.equal(qt.view(torch.uint8), qt_ref.view(torch.uint8)) and torch.equal(st, s)
    # a row-wise recipe casts the dequantized weight, rows of its own
    q_row, s_row = weight_rows(
        w, Float8Recipe(scaling="current", granularity="row"), scale=None, transpose=False
    )
    assert s_row.shape == (48, 1)


def _step(weight: torch.Tensor, x: torch.Tensor):
    x = x.clone().requires_grad_()
    weight.grad = None
    y, _ = float8_training_linear(x, weight, None, None, None, None, recipe=CURRENT)
    y.square().sum().backward()
    return y, x.grad, weight.grad


def test_the_fp8_linear_trains_on_the_gathered_weight_as_on_its_dequantized_values():
    w = gathered()
    x = torch.randn(8, 64)
    gathered_param = nn.Parameter(w)
    plain_param = nn.Parameter(w.dequantize())
    for got, want in zip(_step(gathered_param, x), _step(plain_param, x), strict=True):
        assert type(got) is torch.Tensor
        # the same fp8 operands; the scales may differ by an fp32 ulp (see the test above)
        torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


class _Net(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.fc0 = nn.Linear(64, 64)
        self.fc = nn.Linear(64, 48)
        self.fc.weight = nn.Parameter(weight)
        self.fc2 = nn.Linear(48, 32)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc(torch.relu(self.fc0(x)))))


def test_compiled_training_feeds_the_gathered_weight_to_the_gemm():
    # Dynamo and AOTAutograd take the subclass apart and rebuild it around the FP8 linear: the
    # compiled step matches the eager one on the same gathered weight, and the plain-weight model
    from fxquant.backend import last_reports

    torch.manual_seed(0)
    w = gathered()
    config = QuantConfig(scheme=CURRENT, module_filter=lambda module, fqn: True)
    x = torch.randn(16, 64)
    grads = []
    for weight in (w, w.dequantize()):
        torch.manual_seed(1)
        net = _Net(weight)
        torch._dynamo.reset()
        run = torch.compile(net, backend="fxquant", options={"config": config})
        loss = run(x).square().mean()
        loss.backward()
        grads.append((loss.detach(), net.fc.weight.grad, net.fc0.weight.grad))
        rows = {r["name"]: r for r in last_reports[-1]}
        assert rows["fc"]["status"] == "quantized"
        gathered_row = isinstance(weight, Float8GatheredWeight)
        assert ("fp8_weight" in rows["fc"]) == gathered_row
        assert "fp8_weight" not in rows["fc0"]
    torch._dynamo.reset()
    for got, want in zip(*grads, strict=True):
        assert type(got) is torch.Tensor
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
