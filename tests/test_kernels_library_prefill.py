"""The GPU's prefill path (``kernels/gemm.py``, ``library_prefill``), on CPU tensors.

On CUDA a prefill GEMM (M > ``configs.DECODE_MAX_M``) dequantizes weight-only W for the dense
GEMM and sends fp8 × fp8 to ``torch._scaled_mm``; decode keeps the fused Triton kernels. CPU
tensors normally take the fused kernels (that is what the interpreter's tests check), so here the
device gate is patched open: torch 2.13's CPU ``_scaled_mm`` keeps the CUDA contract (column-major
second operand, [M, 1] × [1, N] row scales, a bf16 output for them), so argument layouts that
are wrong there are wrong on the GPU too. Each case checks the path it took and the result
against the semantic op's reference.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from fxquant.core import reference as ref  # noqa: E402
from fxquant.kernels import (  # noqa: E402
    float8_dynamic,
    float8_weight_only,
    gemm,
    int4_weight_only,
    int8_weight_only,
)
from fxquant.training.numerics import cpu_scaled_mm_takes_row_scales  # noqa: E402

# imported for their ops
assert float8_dynamic and float8_weight_only and int4_weight_only and int8_weight_only

pytestmark = pytest.mark.interpreter

fxq = torch.ops.fxquant
BF16 = torch.bfloat16


@pytest.fixture
def library(monkeypatch):
    """Open the device gate; returns the names of the library calls made."""
    calls: list[str] = []
    monkeypatch.setattr(gemm, "_library_device", lambda t: True)
    scaled_mm, linear = torch._scaled_mm, F.linear

    def record_scaled_mm(a, b, *, scale_a, scale_b, bias=None, out_dtype=None):
        calls.append("_scaled_mm")
        if (scale_a.dim() or scale_b.dim()) and not cpu_scaled_mm_takes_row_scales():
            # torch 2.11's CPU _scaled_mm takes no row-wise scales (its CUDA one, which this
            # path serves, does): its CPU fallback's math, the scaled fp8 values in fp32
            y = (a.float() * scale_a) @ (b.float() * scale_b)
            return (y if bias is None else y + bias.float()).to(out_dtype or a.dtype)
        return scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, bias=bias, out_dtype=out_dtype)

    def record_linear(*args, **kwargs):
        calls.append("linear")
        return linear(*args, **kwargs)

    monkeypatch.setattr(torch, "_scaled_mm", record_scaled_mm)
    monkeypatch.setattr(gemm.F, "linear", record_linear)
    return calls


def _data(m, n, k, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(BF16)
    w = torch.randn(n, k, generator=g) * 0.05
    b = torch.randn(n, generator=g).to(BF16)
    return x, w, b


SCALINGS = {
    "row-row": (ref.quantize_fp8_per_token, ref.quantize_fp8_per_channel),
    "tensor-tensor": (ref.quantize_fp8_per_tensor, ref.quantize_fp8_per_tensor),
    "tensor-row": (ref.quantize_fp8_per_tensor, ref.quantize_fp8_per_channel),
    "row-tensor": (ref.quantize_fp8_per_token, ref.quantize_fp8_per_tensor),
}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("scaling", SCALINGS)
def test_fp8_prefill_calls_scaled_mm(library, scaling, bias):
    x, w, b = _data(40, 48, 64)
    qx, qw = SCALINGS[scaling]
    xq, xs = qx(x)
    wq, ws = qw(w)
    b = b if bias else None
    y = fxq.triton_float8_scaled_mm(xq, xs, wq, ws, b, BF16)
    assert library == ["_scaled_mm"]
    expected = ref.float8_scaled_linear(xq, xs, wq, ws, b, out_dtype=BF16)
    assert y.dtype == BF16 and y.shape == (40, 48)
    assert ref.sqnr(expected, y) >= 40


def test_fp8_dynamic_linear_prefill_calls_scaled_mm(library):
    x, w, b = _data(33, 32, 48)
    wq, ws = ref.quantize_fp8_per_channel(w)
    y = fxq.triton_float8_dynamic_linear(x.reshape(3, 11, 48), wq, ws, b, True, None)
    assert library == ["_scaled_mm"]
    expected = ref.float8_dynamic_linear(x.reshape(3, 11, 48), wq, ws, b, per_row=True)
    assert ref.sqnr(expected, y) >= 40


@pytest.mark.parametrize(
    ("m", "n", "k", "out_dtype", "why"),
    [
        (8, 48, 64, BF16, "decode"),
        (40, 48, 70, BF16, "K not a multiple of 16"),
        (40, 37, 64, BF16, "N not a multiple of 16"),
        (40, 48, 64, torch.float32, "fp32 output"),
    ],
)
def test_fp8_keeps_the_fused_kernel_where_scaled_mm_cannot(library, m, n, k, out_dtype, why):
    x, w, _ = _data(m, n, k)
    xq, xs = ref.quantize_fp8_per_token(x)
    wq, ws = ref.quantize_fp8_per_channel(w)
    y = fxq.triton_float8_scaled_mm(xq, xs, wq, ws, None, out_dtype)
    assert library == [], why
    expected = ref.float8_scaled_linear(xq, xs, wq, ws, None, out_dtype=out_dtype)
    assert ref.sqnr(expected, y) >= 40


CHANNEL = {
    "int8": (fxq.triton_int8_weight_only_linear, ref.quantize_int8_per_channel,
             ref.int8_weight_only_linear),
    "fp8": (fxq.triton_float8_weight_only_linear, ref.quantize_fp8_per_channel,
            ref.float8_weight_only_linear),
}  # fmt: skip


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
@pytest.mark.parametrize("scheme", CHANNEL)
def test_weight_only_prefill_dequantizes_for_the_dense_gemm(library, scheme, dtype):
    op, quantize, reference = CHANNEL[scheme]
    x, w, b = _data(24, 40, 56)
    x, b = x.to(dtype), b.to(dtype)
    wq, ws = quantize(w)
    y = op(x, wq, ws, b)
    assert library == ["linear"]
    # W rounded to x's dtype before the GEMM: ~47 dB in bf16 (the fused kernel keeps it fp32)
    assert ref.sqnr(reference(x, wq, ws, b), y) >= (40 if dtype == BF16 else 100)
    library.clear()
    op(x[:4], wq, ws, b)  # decode: the fused kernel
    assert library == []


@pytest.mark.parametrize("dtype", [BF16, torch.float32])
def test_int4_prefill_dequantizes_for_the_dense_gemm(library, dtype):
    from test_kernels_weight_only import _check, _int4

    args, expected = _int4((2, 10, 100), 37, 32, False, dtype, True)  # M = 20 > DECODE_MAX_M
    y = fxq.triton_int4_weight_only_linear(*args)
    assert library == ["linear"], "the prefill did not dequantize W for the dense GEMM"
    # The dense path rounds W (and the bias sum) to x's dtype: in bf16 that costs ~0.5% of the
    # output's magnitude (~47 dB), where the fused kernel keeps W in fp32.
    tol = (1.6e-2, 1e-2, 40.0) if dtype == BF16 else None
    _check(y, expected, (2, 10, 100), 37, tol=tol)
    library.clear()
    fxq.triton_int4_weight_only_linear(args[0][:1, :3], *args[1:])  # M = 3: the fused kernel
    assert library == []


def test_library_prefill_off_runs_the_fused_kernels(library, monkeypatch):
    monkeypatch.setattr(gemm, "LIBRARY_PREFILL", False)
    x, w, b = _data(40, 48, 64)
    xq, xs = ref.quantize_fp8_per_token(x)
    wq, ws = ref.quantize_fp8_per_channel(w)
    fxq.triton_float8_scaled_mm(xq, xs, wq, ws, b, BF16)
    iq, iscale = ref.quantize_int8_per_channel(w)
    fxq.triton_int8_weight_only_linear(x, iq, iscale, b)
    assert library == []


def test_inductor_compiles_the_library_paths(monkeypatch):
    """Inductor traces the op bodies (as it does on the GPU) into its own code: the library
    calls, no Triton kernel on this path."""
    from torch._inductor.utils import run_and_get_code

    monkeypatch.setattr(gemm, "_library_device", lambda t: True)
    x, w, _ = _data(40, 48, 64)
    # row-wise where this torch's CPU _scaled_mm takes it (2.13), else per tensor (2.11)
    rows = cpu_scaled_mm_takes_row_scales()
    wq, ws = (ref.quantize_fp8_per_channel if rows else ref.quantize_fp8_per_tensor)(w)
    iq, iscale = ref.quantize_int8_per_channel(w)

    def fp8(x):
        xq, xs = (ref.quantize_fp8_per_token if rows else ref.quantize_fp8_per_tensor)(x)
        return fxq.triton_float8_scaled_mm(xq, xs, wq, ws, None, BF16, False)

    def int8wo(x):
        return fxq.triton_int8_weight_only_linear(x, iq, iscale, None, False)

    for fn, call in ((fp8, "_scaled_mm"), (int8wo, "mm")):
        torch._dynamo.reset()
        y, code = run_and_get_code(torch.compile(fn, fullgraph=True), x)
        assert call in code[0]
        torch.testing.assert_close(y, fn(x), rtol=1.6e-2, atol=1e-2)
