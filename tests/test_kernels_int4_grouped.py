"""The int4 grouped (mixture-of-experts) GEMM kernel, kernels/int4_weight_only_grouped.py, and
its two CUDA lowerings (weight-only, W4A8) against ``fxquant.core.reference``'s
``int4_weight_only_grouped_mm`` / ``int8_dynamic_int4_grouped_mm``, on CPU tensors under
TRITON_INTERPRET=1.

The kernel multiplies ``u - z`` exactly in x's dtype and applies each group's scale to an fp32
dot, as the int4 linear's kernel does: the reference dequantizes first, so fp32 outputs match to
fp32 rounding and half-precision ones to one rounding of the same sum. Shapes are the MXFP4
experts' kernel test's (N and S not multiples of the tile, experts without rows, rows past
``offs[-1]``, an expert starting mid-tile), with K padded up to the group where it is not a
multiple (K = 96 in groups of 64).
"""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

triton = pytest.importorskip("triton")

from test_kernels_mxfp4_grouped import (  # noqa: E402
    CASES,
    DEVICE,
    INTERPRETED_OPCHECK,
    TOLERANCES,
    _close,
)

from fxquant.core import reference as ref  # noqa: E402
from fxquant.passes import lower_cuda  # noqa: E402  (registers every fxquant::triton_* op)

pytestmark = pytest.mark.interpreter

fxq = torch.ops.fxquant


def _inputs(e, n, k, s, offs, *, g=32, dtype=torch.float32, offs_dtype=torch.int64, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(s, k, generator=gen).to(dtype)
    w = torch.randn(e * n, k, generator=gen)
    packed, scale, zero = ref.quantize_int4_grouped(w, group_size=g, symmetric=False)
    q = (t.unflatten(0, (e, n)) for t in (packed, scale, zero))
    o = torch.tensor(offs, dtype=offs_dtype)
    return (*(t.to(DEVICE) for t in (x, *q, o)), g)


@pytest.mark.parametrize(("dtype", "rtol", "atol"), TOLERANCES)
@pytest.mark.parametrize(("e", "n", "k", "s", "offs"), CASES)
def test_kernel_matches_reference(e, n, k, s, offs, dtype, rtol, atol):
    args = _inputs(e, n, k, s, offs, dtype=dtype)
    y = fxq.triton_int4_weight_only_grouped_mm(*args)
    _close(y, ref.int4_weight_only_grouped_mm(*args[:-1], group_size=32), rtol, atol)
    assert (y[offs[-1] :] == 0).all()


@pytest.mark.parametrize("g", [64, 128])
def test_k_padded_to_the_group_and_larger_groups(g):
    # K = 96 in groups of 64 (stored Kp = 128) and of 128: the padded columns read x as 0
    args = _inputs(3, 17, 96, 29, [5, 5, 29], g=g, offs_dtype=torch.int32)
    want = ref.int4_weight_only_grouped_mm(*args[:-1], group_size=g)
    _close(fxq.triton_int4_weight_only_grouped_mm(*args), want, 1e-5, 1e-5)


def test_all_zero_weights_give_zeros_not_nan():
    x, *_, o, g = _inputs(2, 20, 64, 9, [4, 9])
    packed, scale, zero = ref.quantize_int4_grouped(
        torch.zeros(40, 64), group_size=g, symmetric=True
    )
    q = [t.unflatten(0, (2, 20)).to(DEVICE) for t in (packed, scale, zero)]
    y = fxq.triton_int4_weight_only_grouped_mm(x * 1e30, *q, o, g)
    assert torch.isfinite(y).all() and (y == 0).all()


@pytest.mark.parametrize("op", ["int4_weight_only_grouped_mm", "int8_dynamic_int4_grouped_mm"])
def test_the_cuda_lowerings_compute_the_semantic_ops(op):
    args = _inputs(3, 17, 96, 29, [5, 5, 29], dtype=torch.bfloat16, offs_dtype=torch.int32)
    semantic = getattr(fxq, op).default
    _close(lower_cuda.CUDA_LOWERINGS[semantic](*args), semantic(*args), 1.6e-2, 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_opcheck_gpu():
    opcheck(fxq.triton_int4_weight_only_grouped_mm.default, _inputs(3, 17, 96, 29, [5, 5, 29]))


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU runs every opcheck test (test_opcheck_gpu)")
def test_triton_op_passes_opcheck():
    args = _inputs(3, 17, 96, 29, [5, 5, 29])
    opcheck(fxq.triton_int4_weight_only_grouped_mm.default, args, test_utils=INTERPRETED_OPCHECK)


def _bad_inputs():
    x, w, sc, z, o, g = _inputs(2, 8, 64, 5, [2, 5])
    return [
        ((x[0], w, sc, z, o, g), "x must be 2-D"),
        ((x.double(), w, sc, z, o, g), "x must be 2-D .* float32/bfloat16/float16"),
        ((x, w, sc, z, o, 48), r"group_size=48 is not supported; allowed: \(32, 64, 128, 256\)"),
        ((x, w.to(torch.int8), sc, z, o, g), "weight must be packed uint8"),
        ((x[:, :16], w, sc, z, o, g), r"does not pack K=16 in groups of 32; allowed: \[E, N, 16\]"),
        ((x, w, sc.double(), z, o, g), r"scale must be torch.float32 \[2, 8, 2\]"),
        ((x, w, sc, z.float(), o, g), r"zero must be torch.uint8 \[2, 8, 2\]"),
        ((x, w, sc, z[:, :, :1], o, g), r"zero must be .* got torch.uint8 \(2, 8, 1\)"),
        ((x, w, sc, z, o.float(), g), r"offs must be int32/int64 \[E\] = \[2\]"),
    ]


@pytest.mark.parametrize(("case", "match"), _bad_inputs())
def test_bad_inputs_raise(case, match):
    with pytest.raises(ValueError, match=match):
        fxq.triton_int4_weight_only_grouped_mm(*case)
