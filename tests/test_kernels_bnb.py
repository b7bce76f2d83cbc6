"""The bitsandbytes kernels (kernels/bnb4_weight_only.py, kernels/llm_int8.py) against
``fxquant.core.reference_bnb``, on CPU tensors under TRITON_INTERPRET=1.

Shapes are awkward on purpose: M = 1 (decode) and 17 (prefill), K and N that are not multiples
of the tiles, and a K that is not a multiple of the 4-bit block (so blocks span two rows).
The GEMMs sum K in another order than the reference, so outputs are compared with the dtype's
tolerance and an SQNR floor; the LLM.int8 quantizer is compared exactly.
"""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

triton = pytest.importorskip("triton")

from fxquant.core import reference_bnb as rb  # noqa: E402
from fxquant.core.reference import sqnr  # noqa: E402
from fxquant.kernels import bnb4_weight_only as kb  # noqa: E402
from fxquant.kernels import llm_int8 as kl  # noqa: E402

pytestmark = pytest.mark.interpreter

fxq = torch.ops.fxquant
# (rtol, atol as a fraction of the output's largest magnitude, SQNR floor in dB)
TOL = {
    torch.bfloat16: (1.6e-2, 1e-3, 40.0),
    torch.float16: (2e-3, 1e-4, 55.0),
    torch.float32: (1e-5, 1e-6, 100.0),
}
# The 4-bit kernel rounds each decoded weight (code × absmax, not an integer) to x's dtype for
# the dot, as bnb computes in its compute dtype; the reference keeps it in fp32. That rounding
# is ~2**-9 (bf16) / 2**-12 (fp16) of each product, so a small output can be off by more than
# rtol alone allows: the absolute part is widened, the SQNR floors stay.
TOL_BNB4 = {
    torch.bfloat16: (1.6e-2, 8e-3, 40.0),
    torch.float16: (2e-3, 1e-3, 55.0),
    torch.float32: (1e-5, 1e-6, 100.0),
}


def _check(y, want, *, tol=None):
    assert y.shape == want.shape and y.dtype == want.dtype and torch.isfinite(y).all()
    rtol, atol, floor = tol or TOL[y.dtype]
    torch.testing.assert_close(y, want, rtol=rtol, atol=atol * want.abs().max().item())
    assert sqnr(want, y) >= floor


def _data(m, k, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    return x, torch.randn(n, k, generator=g), torch.randn(n, generator=g).to(dtype)


@pytest.mark.parametrize(
    ("m", "k", "n", "quant_type", "block_size", "double_quant", "dtype"),
    [
        (1, 70, 37, "nf4", 64, False, torch.float32),  # decode; blocks span rows (70 % 64)
        (17, 130, 33, "fp4", 128, True, torch.bfloat16),  # prefill, double quant
        (3, 64, 48, "nf4", 64, True, torch.float16),
    ],
)
def test_bnb4_matches_reference(m, k, n, quant_type, block_size, double_quant, dtype):
    x, w, b = _data(m, k, n, dtype)
    t = rb.quantize_4bit(w, quant_type=quant_type, block_size=block_size, double_quant=double_quant)
    args = [t.get(name) for name in ("qweight", "absmax", "quant_map")]
    args += [t.get(name) for name in ("nested_absmax", "nested_quant_map", "nested_offset")]
    want = rb.bnb4_weight_only_linear(x, *args, b, block_size=block_size)
    got = fxq.triton_bnb4_weight_only_linear(x, *args, b, block_size)
    _check(got, want, tol=TOL_BNB4[dtype])


@pytest.mark.parametrize(
    ("m", "k", "n", "threshold", "dtype"),
    [
        (1, 70, 37, 2.0, torch.float32),  # decode, one token with outliers
        (17, 130, 33, 2.5, torch.bfloat16),  # prefill, outlier columns across tokens
        (5, 64, 48, 0.0, torch.float16),  # no decomposition
    ],
)
def test_llm_int8_matches_reference(m, k, n, threshold, dtype):
    x, w, b = _data(m, k, n, dtype)
    q, scb = rb.quantize_llm_int8_weight(w)
    # the quantizer is exact: same codes, same scales, the float part is x in those columns
    cols = kl.outlier_columns(x, threshold) if threshold > 0 else None
    xq, xs, xo = kl.quantize(x, cols, threshold=threshold)
    want_q, want_absmax, want_cols = rb.quantize_llm_int8_activation(x, threshold=threshold)
    assert torch.equal(xq, want_q)
    torch.testing.assert_close(xs[:, 0], want_absmax / 127, rtol=1e-7, atol=0)
    if threshold > 0:
        assert torch.equal(cols, want_cols) and want_cols.any()
        assert torch.equal(xo, torch.where(want_cols, x.float(), 0.0))
    want = rb.llm_int8_linear(x, q, scb, b, threshold=threshold)
    _check(fxq.triton_llm_int8_linear(x, q, scb, b, threshold), want)


def test_zeros_and_errors():
    x, w, _ = _data(2, 64, 16, torch.float32)
    t = rb.quantize_4bit(torch.zeros(16, 64), quant_type="nf4", block_size=64, double_quant=True)
    args = [t[name] for name in ("qweight", "absmax", "quant_map")]
    nested = [t[name] for name in ("nested_absmax", "nested_quant_map", "nested_offset")]
    assert torch.equal(kb.bnb4_linear(x, *args, *nested, None, block_size=64), torch.zeros(2, 16))
    q, scb = rb.quantize_llm_int8_weight(w)
    y = kl.llm_int8_linear(torch.zeros(2, 64), q, scb, None, threshold=6.0)
    assert torch.equal(y, torch.zeros(2, 16))
    with pytest.raises(ValueError, match=r"absmax must be torch.uint8"):
        kb.bnb4_linear(x, args[0], args[1].float(), args[2], *nested, None, block_size=64)
    with pytest.raises(ValueError, match=r"uint8 \[N, K/2\]"):
        kb.bnb4_linear(x[:, :62], *args, None, None, None, None, block_size=64)
    with pytest.raises(ValueError, match="block_size=32"):
        kb.bnb4_linear(x, *args, *nested, None, block_size=32)


# Under the interpreter ``wrap_triton`` hands back the bare kernel, so the ops' fake kernels
# (their bodies) would launch the interpreter on fake tensors: test_faketensor and
# test_aot_dispatch_dynamic run on a GPU only (as in tests/test_kernels_weight_only.py).
INTERPRETED_OPCHECK = ("test_schema", "test_autograd_registration")


def _opcheck_cases(device):
    x, w, b = (t.to(device) for t in _data(3, 64, 16, torch.float32))
    t = rb.quantize_4bit(w.cpu(), quant_type="fp4", block_size=64, double_quant=True)
    t = {name: v.to(device) for name, v in t.items()}
    q, scb = (v.to(device) for v in rb.quantize_llm_int8_weight(w.cpu()))
    nested = (t["nested_absmax"], t["nested_quant_map"], t["nested_offset"])
    return [
        (
            fxq.triton_bnb4_weight_only_linear,
            (x, t["qweight"], t["absmax"], t["quant_map"], *nested, b, 64),
        ),
        (fxq.triton_llm_int8_linear, (x, q, scb, None, 1.5)),
    ]


def test_triton_ops_pass_opcheck():
    for op, args in _opcheck_cases("cpu"):
        opcheck(op, args, test_utils=INTERPRETED_OPCHECK)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_opcheck_gpu():
    for op, args in _opcheck_cases("cuda"):
        opcheck(op, args)
