"""The int8 W8A8 grouped (mixture-of-experts) GEMM kernel, kernels/int8_dynamic_grouped.py (per-row
activation and per-channel weight scales), and its CUDA lowering against
``fxquant.core.reference.int8_dynamic_grouped_mm``, on CPU tensors under TRITON_INTERPRET=1.

The kernel sums the int8 products in int32 and the reference in fp32: both exact while the sum
stays under 2**24 (every case here), so the two differ only in the epilogue, (xq · Wᵀ) · xs ·
scale in fp32 in the same order: fp32 outputs match to fp32 rounding and bf16 ones to one
rounding of the same value. Past 2**24 the int32 sum stays exact where an fp32 one would not
(test_int32_sums_are_exact_past_fp32s_integers). The Triton quantizer the lowering calls is the
reference's bit for bit (tests/test_kernels_activation.py), so the lowering keeps those
tolerances. Shapes include N and K not multiples of the 32×64×128 tile, experts with no rows,
rows past ``offs[-1]``, an expert whose rows start mid-tile, and all-zero rows of x.
"""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

triton = pytest.importorskip("triton")

# the MXFP4 experts' kernel test's checks: the kernels take the same rows and offsets
# (kernels.mxfp4_grouped.expert_tile) and round one fp32 value to the output dtype
from test_kernels_mxfp4_grouped import DEVICE, INTERPRETED_OPCHECK, _close  # noqa: E402

from fxquant.core import reference as ref  # noqa: E402
from fxquant.passes import lower_cuda  # noqa: E402  (registers every fxquant::triton_* op)

pytestmark = pytest.mark.interpreter

fxq = torch.ops.fxquant

# (E, N, K, S, offs): offs are the cumulative row ends, offs[-1] <= S
CASES = [
    (1, 1, 16, 1, [1]),
    (3, 17, 96, 29, [5, 5, 29]),  # expert 1 has no rows; K short of one 128-wide K step
    (4, 70, 200, 40, [0, 33, 34, 37]),  # two N tiles, the last ragged; K = 128 + 72; expert 0
    # empty, expert 1 spans two row tiles, expert 2 starts mid-tile, rows 37..39 past offs[-1]
    (2, 20, 64, 7, [3, 3]),  # rows 3..6 past offs[-1]: zeros
]
# (dtype, rtol, atol relative to the output's magnitude): fp32 is the same two fp32 multiplies
# of the same exact sum (one ulp of slack); bf16 is one rounding of that value, which may
# differ from torch's in its last bit (the interpreter's bf16 store truncates)
TOLERANCES = [(torch.float32, 1.2e-7, 0.0), (torch.bfloat16, 1.6e-2, 1e-4)]


def _inputs(e, n, k, s, offs, *, dtype=torch.float32, offs_dtype=torch.int64, seed=0):
    """(x, xq, xs, weight, scale, offs): x (an all-zero first row where there is more than one)
    and its per-token int8 quantization; each expert's per-channel int8 weight, with ±127."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, k, generator=g) * 3
    if s > 1:
        x[0] = 0
    x = x.to(dtype)
    xq, xs = ref.quantize_int8_per_token(x)
    wq, ws = ref.quantize_int8_per_channel(torch.randn(e, n, k, generator=g))
    wq[0, 0, : min(k, 2)] = torch.tensor([-127, 127][: min(k, 2)], dtype=torch.int8)
    o = torch.tensor(offs, dtype=offs_dtype)
    return tuple(t.to(DEVICE) for t in (x, xq, xs, wq, ws, o))


# ---- the kernel -----------------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "rtol", "atol"), TOLERANCES)
@pytest.mark.parametrize(("e", "n", "k", "s", "offs"), CASES)
def test_kernel_matches_reference(e, n, k, s, offs, dtype, rtol, atol):
    x, xq, xs, w, sc, o = _inputs(e, n, k, s, offs, dtype=dtype)
    y = fxq.triton_int8_scaled_grouped_mm(xq, xs, w, sc, o, dtype)
    _close(y, ref.int8_dynamic_grouped_mm(x, w, sc, o), rtol, atol)
    assert (y[offs[-1] :] == 0).all() and (s == 1 or (y[0] == 0).all())  # x's zero row


@pytest.mark.parametrize("offs_dtype", [torch.int32, torch.int64])
def test_offs_dtypes_and_offsets_past_s(offs_dtype):
    # offs[-1] > S: the reference slices to S, the kernel clips to S and reads no row past it
    x, xq, xs, w, sc, o = _inputs(3, 24, 64, 11, [4, 9, 15], offs_dtype=offs_dtype)
    y = fxq.triton_int8_scaled_grouped_mm(xq, xs, w, sc, o, torch.float32)
    _close(y, ref.int8_dynamic_grouped_mm(x, w, sc, o), *TOLERANCES[0][1:])


def test_int32_sums_are_exact_past_fp32s_integers():
    # every 128-wide K step of row 0 sums to +-(127 · 127 · 127 + 127 · 2), odd: nine steps up
    # take an fp32 sum past 2**24, where it must round, and nine down return it to 0 - the
    # rounding error. The int32 sum is exact (0, and row 1's 36,875,466 rounded once by the
    # epilogue's conversion, as float64 → fp32 does); scales of 1 leave the sums as they are.
    k = 18 * 128
    xq = torch.full((2, k), 127, dtype=torch.int8)
    xq[0, k // 2 :] = -127
    w = torch.full((1, 3, k), 127, dtype=torch.int8)
    w[0, 0, ::128] = 2
    w[0, 2] = -w[0, 0]
    args = (xq, torch.ones(2, 1), w, torch.ones(1, 3), torch.tensor([2]))
    y = fxq.triton_int8_scaled_grouped_mm(*(t.to(DEVICE) for t in args), torch.float32)
    want = (xq.double() @ w[0].double().t()).float()
    assert want[0, 0] == 0 and want[1, 0] == 36_875_466
    torch.testing.assert_close(y.cpu(), want, rtol=0, atol=0)


# ---- the CUDA lowering ----------------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "rtol", "atol"), TOLERANCES)
def test_the_cuda_lowering_computes_the_semantic_op(dtype, rtol, atol):
    kw = dict(dtype=dtype, offs_dtype=torch.int32)
    x, _, _, w, sc, o = _inputs(4, 70, 200, 40, [0, 33, 34, 37], **kw)
    lowering = lower_cuda.CUDA_LOWERINGS[fxq.int8_dynamic_grouped_mm.default]
    want = fxq.int8_dynamic_grouped_mm(x, w, sc, o)
    _close(lowering(x, w, sc, o), want, rtol, atol)


def test_all_zero_rows_give_zeros_not_nan():
    x, _, _, w, sc, o = _inputs(2, 20, 64, 9, [4, 9])
    lowering = lower_cuda.CUDA_LOWERINGS[fxq.int8_dynamic_grouped_mm.default]
    y = lowering(torch.zeros_like(x), w, sc, o)
    assert torch.isfinite(y).all() and (y == 0).all()


# ---- the op's registration ------------------------------------------------------------------


def _opcheck_args():
    _, xq, xs, w, sc, o = _inputs(3, 17, 96, 29, [5, 5, 29])
    return (xq, xs, w, sc, o, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_opcheck_gpu():
    opcheck(fxq.triton_int8_scaled_grouped_mm.default, _opcheck_args())


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU runs every opcheck test (test_opcheck_gpu)")
def test_triton_op_passes_opcheck():
    # under the interpreter an op's fake kernel would launch the interpreter on fake tensors
    # (see test_kernels_activation.py): schema and autograd registration run here
    opcheck(
        fxq.triton_int8_scaled_grouped_mm.default, _opcheck_args(), test_utils=INTERPRETED_OPCHECK
    )


# ---- bad inputs -----------------------------------------------------------------------------


def _bad_inputs():
    _, xq, xs, w, sc, o = _inputs(2, 8, 64, 5, [2, 5])
    bf16 = torch.bfloat16
    return [
        ((xq[0], xs, w, sc, o, bf16), "xq must be 2-D"),
        ((xq.float(), xs, w, sc, o, bf16), r"xq must be 2-D \[S, K\] int8; got torch.float32"),
        ((xq, xs, w.to(torch.uint8), sc, o, bf16), r"weight must be int8 \[E, N, K\]; got .*uint8"),
        ((xq, xs, w[0], sc, o, bf16), r"weight must be int8 \[E, N, K\]; got torch.int8 \(8, 64\)"),
        ((xq[:, :48], xs, w, sc, o, bf16), "xq has K=48 features, the weight .* K=64"),
        ((xq, xs.double(), w, sc, o, bf16), r"xs must be fp32 \[S, 1\] = \[5, 1\]"),
        ((xq, xs[:, 0], w, sc, o, bf16), r"xs must be fp32 \[S, 1\] = \[5, 1\].*got .* \(5,\)"),
        ((xq, xs, w, sc.double(), o, bf16), r"scale must be fp32 \[E, N\] = \[2, 8\]"),
        ((xq, xs, w, sc[:, :1], o, bf16), r"scale must be fp32 \[E, N\] = \[2, 8\]; got .* \(2, 1"),
        ((xq, xs, w, sc, o, torch.int8), "out_dtype is torch.int8; allowed: float32, bfloat16"),
        ((xq, xs, w, sc, o.float(), bf16), r"offs must be int32/int64 \[E\] = \[2\]"),
        ((xq, xs, w, sc, o[:1], bf16), r"offs must be int32/int64 \[E\] = \[2\]; got .* \(1,\)"),
    ]  # fmt: skip


@pytest.mark.parametrize(("case", "match"), _bad_inputs())
def test_bad_inputs_raise(case, match):
    with pytest.raises(ValueError, match=match):
        fxq.triton_int8_scaled_grouped_mm(*case)
