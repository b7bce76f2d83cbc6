"""The MXFP4 grouped (mixture-of-experts) GEMM kernel, kernels/mxfp4_grouped.py, and its CUDA
lowering against ``fxquant.core.reference_mx.mxfp4_grouped_mm``, on CPU tensors under
TRITON_INTERPRET=1.

The kernel decodes the weight and multiplies in fp32 like the reference, summing K in another
order, so fp32 outputs match to fp32 rounding and half-precision ones to one rounding of the
same sum. Weights are random bytes and scales, so every e2m1 code (±0 too) shows up in both
nibbles. Shapes include N and S not multiples of the 32×64 tile, K = 96 (half a 64-wide K
step), experts with no rows, rows past ``offs[-1]`` and an expert whose rows start mid-tile.
"""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

triton = pytest.importorskip("triton")

from fxquant.core import reference_mx as rmx  # noqa: E402
from fxquant.passes import lower_cuda  # noqa: E402  (registers every fxquant::triton_* op)

pytestmark = pytest.mark.interpreter

fxq = torch.ops.fxquant
# the interpreter on CPU tensors (conftest sets TRITON_INTERPRET=1 without a GPU), else the GPU
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
INTERPRETED_OPCHECK = ("test_schema", "test_autograd_registration")

# (E, N, K, S, offs): offs are the cumulative row ends, offs[-1] <= S
CASES = [
    (1, 1, 32, 1, [1]),
    (3, 17, 96, 29, [5, 5, 29]),  # expert 1 has no rows; K ends halfway through a K step
    (4, 48, 128, 40, [0, 33, 34, 37]),  # expert 0 empty, expert 1 spans two row tiles,
    # expert 2 starts mid-tile, rows 37..39 belong to no expert
    (2, 20, 64, 7, [3, 3]),  # rows 3..6 past offs[-1]: zeros
]
# (dtype, rtol, atol relative to the output's magnitude): half precision is one rounding of
# an fp32 sum that may differ from the reference's in its last bits, so one ulp apart at worst
TOLERANCES = [
    (torch.float32, 1e-5, 1e-5),
    (torch.bfloat16, 1.6e-2, 1e-4),
    (torch.float16, 2e-3, 1e-4),
]


def _inputs(e, n, k, s, offs, *, dtype=torch.float32, offs_dtype=torch.int64, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, k, generator=g).to(dtype)
    w = torch.randint(0, 256, (e, n, k // 2), generator=g, dtype=torch.uint8)
    # 2**-7 .. 2**4: an fp16 output stays finite, and no subnormal (E8M0 0) that a GPU
    # could flush
    sc = torch.randint(120, 132, (e, n, k // 32), generator=g, dtype=torch.uint8)
    o = torch.tensor(offs, dtype=offs_dtype)
    return tuple(t.to(DEVICE) for t in (x, w, sc, o))


def _close(y, want, rtol, atol):
    assert y.dtype == want.dtype and y.shape == want.shape and torch.isfinite(y).all()
    scale = want.float().abs().max().item()
    torch.testing.assert_close(y.float(), want.float(), rtol=rtol, atol=atol * scale)


@pytest.mark.parametrize(("dtype", "rtol", "atol"), TOLERANCES)
@pytest.mark.parametrize(("e", "n", "k", "s", "offs"), CASES)
def test_kernel_matches_reference(e, n, k, s, offs, dtype, rtol, atol):
    x, w, sc, o = _inputs(e, n, k, s, offs, dtype=dtype)
    y = fxq.triton_mxfp4_grouped_mm(x, w, sc, o)
    _close(y, rmx.mxfp4_grouped_mm(x, w, sc, o), rtol, atol)
    assert (y[offs[-1] :] == 0).all()


@pytest.mark.parametrize("offs_dtype", [torch.int32, torch.int64])
def test_offs_dtypes_and_offsets_past_s(offs_dtype):
    # offs[-1] > S (an expert's end past the last row): the reference slices to S, the kernel
    # clips to S and reads no row past it
    x, w, sc, o = _inputs(3, 24, 64, 11, [4, 9, 15], offs_dtype=offs_dtype)
    _close(fxq.triton_mxfp4_grouped_mm(x, w, sc, o), rmx.mxfp4_grouped_mm(x, w, sc, o), 1e-5, 1e-5)


def test_all_zero_codes_give_zeros_not_nan():
    # codes 0 and 8 (+0 and -0) under every finite scale, the largest (2**127) too
    x, w, sc, o = _inputs(2, 20, 64, 9, [4, 9])
    w = torch.where(torch.rand(w.shape, device=DEVICE) < 0.5, 0x00, 0x88).to(torch.uint8)
    sc = torch.randint(0, 255, sc.shape, dtype=torch.uint8).to(DEVICE)
    sc[0, 0, 0] = 254
    y = fxq.triton_mxfp4_grouped_mm(x * 1e30, w, sc, o)
    assert torch.isfinite(y).all() and (y == 0).all()


def test_the_cuda_lowering_computes_the_semantic_op():
    x, w, sc, o = _inputs(3, 17, 96, 29, [5, 5, 29], dtype=torch.bfloat16, offs_dtype=torch.int32)
    lowering = lower_cuda.CUDA_LOWERINGS[fxq.mxfp4_grouped_mm.default]
    _close(lowering(x, w, sc, o), fxq.mxfp4_grouped_mm(x, w, sc, o), 1.6e-2, 1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_opcheck_gpu():
    opcheck(fxq.triton_mxfp4_grouped_mm.default, _inputs(3, 17, 96, 29, [5, 5, 29]))


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU runs every opcheck test (test_opcheck_gpu)")
def test_triton_op_passes_opcheck():
    # under the interpreter an op's fake kernel would launch the interpreter on fake tensors
    # (see test_kernels_activation.py): schema and autograd registration run here
    args = _inputs(3, 17, 96, 29, [5, 5, 29])
    opcheck(fxq.triton_mxfp4_grouped_mm.default, args, test_utils=INTERPRETED_OPCHECK)


def _bad_inputs():
    x, w, sc, o = _inputs(2, 8, 64, 5, [2, 5])
    return [
        ((x[0], w, sc, o), "x must be 2-D"),
        ((x.double(), w, sc, o), "x must be 2-D .* float32/bfloat16/float16"),
        ((x, w.to(torch.int8), sc, o), "weight must be packed uint8"),
        ((x, w[0], sc, o), "weight must be packed uint8"),
        ((x, w, sc.float(), o), "scale must be uint8 E8M0"),
        ((x[:, :48], w[..., :24], sc, o), "K=48 .* must be a multiple of 32"),
        ((x, w[..., :16], sc, o), r"does not pack K=64; allowed: \[E, N, 32\]"),
        ((x, w, sc[..., :1], o), r"scale shape \(2, 8, 1\); allowed: \(2, 8, 2\)"),
        ((x, w, sc, o.float()), r"offs must be int32/int64 \[E\] = \[2\]"),
        ((x, w, sc, o[:1]), r"offs must be int32/int64 \[E\] = \[2\]; got torch.int64 \(1,\)"),
    ]


@pytest.mark.parametrize(("case", "match"), _bad_inputs())
def test_bad_inputs_raise(case, match):
    with pytest.raises(ValueError, match=match):
        fxq.triton_mxfp4_grouped_mm(*case)
