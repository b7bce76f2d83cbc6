"""Microscaling GEMM kernels (kernels/mxfp8.py, mxfp4.py, nvfp4.py) and their CUDA lowerings
against ``fxquant.core.reference_mx``, on CPU tensors under TRITON_INTERPRET=1.

The kernels dequantize the weight and multiply in fp32 like the reference, only summing K in
another order, so outputs match to fp32 rounding. Shapes include M = 1, primes, N not a multiple
of the tile, and (NVFP4) K that ends halfway through the kernel's 32-wide step.
"""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

triton = pytest.importorskip("triton")

from fxquant.core import reference_mx as rmx  # noqa: E402
from fxquant.kernels import mxfp4, mxfp8, nvfp4  # noqa: E402  (their ops and lowerings)

pytestmark = pytest.mark.interpreter

fxq = torch.ops.fxquant
# the interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1 without a GPU), else the GPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
SHAPES = [(1, 1, 32), (5, 17, 96), (33, 70, 64)]
INTERPRETED_OPCHECK = ("test_schema", "test_autograd_registration")


def _inputs(m, n, k, *, bias, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = torch.randn(n, k, generator=g) * torch.logspace(-2, 2, k)  # blocks of unlike ranges
    b = torch.randn(n, generator=g).to(DEVICE) if bias else None
    return x.to(DEVICE), w.to(DEVICE), b


def _close(y, want):
    assert y.dtype == torch.float32 and y.shape == want.shape and torch.isfinite(y).all()
    torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())


def _expected(x, w_dq, b):
    y = x.float() @ w_dq.t()
    return y if b is None else y + b


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_mxfp8_kernel(m, n, k, bias):
    x, w, b = _inputs(m, n, k, bias=bias)
    q, s = rmx.mx_quantize(w, elem="e4m3", rule="floor")
    xd = rmx.mx_fake_quantize(x, elem="e4m3", rule="floor")
    _close(
        fxq.triton_mxfp8_linear(xd, q, s, b), _expected(xd, rmx.mx_dequantize(q, s, elem="e4m3"), b)
    )


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("m", "n", "k"), SHAPES)
def test_mxfp4_kernel(m, n, k, bias):
    x, w, b = _inputs(m, n, k, bias=bias, dtype=torch.bfloat16)
    p, s = rmx.quantize_mxfp4_weight(w, rule="ceil")
    _close(fxq.triton_mxfp4_linear(x, p, s, b), _expected(x, rmx.dequantize_mxfp4_weight(p, s), b))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize(("m", "n", "k"), [*SHAPES, (7, 19, 48)])
def test_nvfp4_kernel(m, n, k, bias):
    x, w, b = _inputs(m, n, k, bias=bias)
    p, s, g = rmx.quantize_nvfp4_weight(w, rule="four_over_six")
    want = _expected(x, rmx.dequantize_nvfp4_weight(p, s, g), b)
    _close(fxq.triton_nvfp4_linear(x, p, s, g, b), want)


def test_all_zero_weight_gives_zeros():
    x, zero_w, zeros = torch.randn(3, 32, device=DEVICE), torch.zeros(5, 32, device=DEVICE), 0
    for rule in ("six", "four_over_six"):
        p, s, g = rmx.quantize_nvfp4_weight(zero_w, rule=rule)
        zeros += fxq.triton_nvfp4_linear(x, p, s, g, None).abs().sum()
    p, s = rmx.quantize_mxfp4_weight(zero_w, rule="floor")
    zeros += fxq.triton_mxfp4_linear(x, p, s, None).abs().sum()
    assert zeros == 0


def test_the_cuda_lowerings_compute_the_reference():
    # the CUDA lowerings next to the kernels (activation quantized in aten, then the kernel), run
    # here on CPU tensors through the interpreter; [..., K] inputs with two leading dims
    x, w, b = _inputs(6, 24, 64, bias=True)
    x = x.reshape(2, 3, 64).bfloat16()
    q8, s8 = rmx.mx_quantize(w, elem="e4m3", rule="ceil")
    p4, s4 = rmx.quantize_mxfp4_weight(w, rule="even")
    pn, sn, gn = rmx.quantize_nvfp4_weight(w, rule="six")
    cases = [
        (
            mxfp8.lower_mxfp8_linear(x, q8, s8, b, "ceil"),
            rmx.mxfp8_linear(x, q8, s8, b, scale_rule="ceil"),
        ),
        (
            mxfp4.lower_mxfp4_linear(x, p4, s4, b, True, "even"),
            rmx.mxfp4_linear(x, p4, s4, b, activation_rule="even"),
        ),
        (
            nvfp4.lower_nvfp4_linear(x, pn, sn, gn, None, True, "six"),
            rmx.nvfp4_linear(x, pn, sn, gn, None, activation_rule="six"),
        ),
        (
            nvfp4.lower_nvfp4_linear(x, pn, sn, gn, b, False, "six"),
            rmx.nvfp4_linear(x, pn, sn, gn, b, activation_rule=None),
        ),
    ]
    for got, want in cases:
        assert got.shape == (2, 3, 24) and got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want.float(), rtol=1.6e-2, atol=1e-2)


def _opcheck_cases():
    x, w, b = _inputs(4, 16, 64, bias=True)
    p, s = rmx.quantize_mxfp4_weight(w, rule="floor")
    q, s8 = rmx.mx_quantize(w, elem="e4m3", rule="floor")
    pn, sn, gn = rmx.quantize_nvfp4_weight(w, rule="six")
    return [
        (fxq.triton_mxfp4_linear.default, (x, p, s, b)),
        (fxq.triton_mxfp8_linear.default, (x, q, s8, None)),
        (fxq.triton_nvfp4_linear.default, (x, pn, sn, gn, b)),
    ]


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_opcheck_gpu():
    for op, args in _opcheck_cases():
        opcheck(op, args)


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU runs every opcheck test (test_opcheck_gpu)")
def test_triton_ops_pass_opcheck_and_reject_bad_layouts():
    # under the interpreter an op's fake kernel would launch the interpreter on fake tensors
    # (see test_kernels_activation.py): schema and autograd registration run here, and the
    # e4m3 tensors of MXFP8 / NVFP4 skip the schema test (allclose has no CPU float8 kernel)
    x, w, b = _inputs(4, 16, 64, bias=True)
    p, s = rmx.quantize_mxfp4_weight(w, rule="floor")
    q, s8 = rmx.mx_quantize(w, elem="e4m3", rule="floor")
    pn, sn, gn = rmx.quantize_nvfp4_weight(w, rule="six")
    opcheck(fxq.triton_mxfp4_linear.default, (x, p, s, b), test_utils=INTERPRETED_OPCHECK)
    fp8 = INTERPRETED_OPCHECK[1:]
    opcheck(fxq.triton_mxfp8_linear.default, (x, q, s8, None), test_utils=fp8)
    opcheck(fxq.triton_nvfp4_linear.default, (x, pn, sn, gn, b), test_utils=fp8)
    with pytest.raises(ValueError, match="packed uint8 weight"):
        fxq.triton_mxfp4_linear(x[:, :32], p, s, None)
    with pytest.raises(ValueError, match="uint8 E8M0 scales"):
        fxq.triton_mxfp8_linear(x, q, s8.float(), None)
