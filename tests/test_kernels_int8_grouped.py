"""The int8 weight-only grouped (mixture-of-experts) GEMM kernel,
kernels/int8_weight_only_grouped.py, on int8 weights and on e4m3 ones (fp8wo's experts), and its
CUDA lowerings against ``fxquant.core.reference.int8_weight_only_grouped_mm`` /
``float8_weight_only_grouped_mm``, on CPU tensors under TRITON_INTERPRET=1.

The kernel multiplies the integer codes exactly in x's dtype and sums in fp32 like the reference,
in another order, so fp32 outputs match to fp32 rounding and half-precision ones to one rounding
of the same sum. Shapes (tests/test_kernels_mxfp4_grouped.py's) include N and S not multiples of
the 32×64 tile, K = 96 (half a 64-wide K step), experts with no rows, rows past ``offs[-1]`` and
an expert whose rows start mid-tile.
"""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

triton = pytest.importorskip("triton")

# the MXFP4 experts' kernel test's cases and checks: both kernels take the same rows and offsets
# (kernels.grouped.expert_tile) and round one fp32 sum to x's dtype
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


# per weight format: (quantizer, kernel op, semantic op, reference); fp8wo's experts run the same
# kernel on e4m3 weights
FORMATS = {
    "int8": (ref.quantize_int8_per_channel, fxq.triton_int8_weight_only_grouped_mm,
             fxq.int8_weight_only_grouped_mm, ref.int8_weight_only_grouped_mm),
    "fp8": (ref.quantize_fp8_per_channel, fxq.triton_float8_weight_only_grouped_mm,
            fxq.float8_weight_only_grouped_mm, ref.float8_weight_only_grouped_mm),
}  # fmt: skip


def _inputs(e, n, k, s, offs, *, dtype=torch.float32, offs_dtype=torch.int64, seed=0,
            weight="int8"):  # fmt: skip
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, k, generator=g).to(dtype)
    q, scale = FORMATS[weight][0](torch.randn(e, n, k, generator=g))
    if weight == "int8":
        q[0, 0, : min(k, 2)] = torch.tensor([-127, 127][: min(k, 2)], dtype=torch.int8)
    o = torch.tensor(offs, dtype=offs_dtype)
    return tuple(t.to(DEVICE) for t in (x, q, scale, o))


@pytest.mark.parametrize("weight", list(FORMATS))
@pytest.mark.parametrize(("dtype", "rtol", "atol"), TOLERANCES)
@pytest.mark.parametrize(("e", "n", "k", "s", "offs"), CASES)
def test_kernel_matches_reference(e, n, k, s, offs, dtype, rtol, atol, weight):
    _, kernel, op, reference = FORMATS[weight]
    x, w, sc, o = _inputs(e, n, k, s, offs, dtype=dtype, weight=weight)
    y = kernel(x, w, sc, o)
    _close(y, reference(x, w, sc, o), rtol, atol)
    assert (y[offs[-1] :] == 0).all()
    # the CUDA lowering is the kernel on the op's arguments as they are
    _close(lower_cuda.CUDA_LOWERINGS[op.default](x, w, sc, o), y, 0, 0)


@pytest.mark.parametrize("offs_dtype", [torch.int32, torch.int64])
def test_offs_dtypes_and_offsets_past_s(offs_dtype):
    x, w, sc, o = _inputs(3, 24, 64, 11, [4, 9, 15], offs_dtype=offs_dtype)
    want = ref.int8_weight_only_grouped_mm(x, w, sc, o)
    _close(fxq.triton_int8_weight_only_grouped_mm(x, w, sc, o), want, 1e-5, 1e-5)


def test_all_zero_weights_give_zeros_not_nan():
    x, _, _, o = _inputs(2, 20, 64, 9, [4, 9])
    zq, zs = ref.quantize_int8_per_channel(torch.zeros(2, 20, 64))
    y = fxq.triton_int8_weight_only_grouped_mm(x * 1e30, zq.to(DEVICE), zs.to(DEVICE), o)
    assert torch.isfinite(y).all() and (y == 0).all()


def test_the_cuda_lowering_computes_the_semantic_op():
    x, w, sc, o = _inputs(3, 17, 96, 29, [5, 5, 29], dtype=torch.bfloat16, offs_dtype=torch.int32)
    lowering = lower_cuda.CUDA_LOWERINGS[fxq.int8_weight_only_grouped_mm.default]
    _close(lowering(x, w, sc, o), fxq.int8_weight_only_grouped_mm(x, w, sc, o), 1.6e-2, 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_opcheck_gpu():
    opcheck(fxq.triton_int8_weight_only_grouped_mm.default, _inputs(3, 17, 96, 29, [5, 5, 29]))


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU runs every opcheck test (test_opcheck_gpu)")
def test_triton_op_passes_opcheck():
    # under the interpreter an op's fake kernel would launch the interpreter on fake tensors
    # (see test_kernels_activation.py): schema and autograd registration run here
    args = _inputs(3, 17, 96, 29, [5, 5, 29])
    opcheck(fxq.triton_int8_weight_only_grouped_mm.default, args, test_utils=INTERPRETED_OPCHECK)


def _bad_inputs():
    x, w, sc, o = _inputs(2, 8, 64, 5, [2, 5])
    return [
        ((x[0], w, sc, o), "x must be 2-D"),
        ((x.double(), w, sc, o), "x must be 2-D .* float32/bfloat16/float16"),
        ((x, w.to(torch.uint8), sc, o), "weight must be int8"),
        ((x, w[0], sc, o), "weight must be int8"),
        ((x[:, :48], w, sc, o), "x has K=48 features, the weight .* K=64"),
        ((x, w, sc.double(), o), r"scale must be fp32 \[E, N\] = \[2, 8\]"),
        ((x, w, sc[:, :1], o), r"scale must be fp32 \[E, N\] = \[2, 8\]; got .* \(2, 1\)"),
        ((x, w, sc, o.float()), r"offs must be int32/int64 \[E\] = \[2\]"),
        ((x, w, sc, o[:1]), r"offs must be int32/int64 \[E\] = \[2\]; got torch.int64 \(1,\)"),
    ]


@pytest.mark.parametrize(("case", "match"), _bad_inputs())
def test_bad_inputs_raise(case, match):
    with pytest.raises(ValueError, match=match):
        fxq.triton_int8_weight_only_grouped_mm(*case)


def test_the_fp8_weight_kernel_refuses_int8_weights():
    x, w, sc, o = _inputs(2, 8, 64, 5, [2, 5])
    with pytest.raises(
        ValueError, match="fp8 weight-only grouped mm: weight must be float8_e4m3fn"
    ):
        fxq.triton_float8_weight_only_grouped_mm(x, w, sc, o)
