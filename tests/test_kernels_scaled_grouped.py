"""The grouped (mixture-of-experts) GEMM kernel with per-row activation and per-channel weight
scales, kernels/int8_dynamic_grouped.py, on int8 (W8A8's experts) and on e4m3 (``fp8-row``'s,
kernels/float8_dynamic_grouped.py), and both CUDA lowerings against
``fxquant.core.reference.int8_dynamic_grouped_mm`` / ``float8_dynamic_grouped_mm``, on CPU
tensors under TRITON_INTERPRET=1.

int8: the kernel sums the products in int32 and the reference in fp32, both exact while the sum
stays under 2**24 (every case here), so the two differ only in the epilogue, (xq · Wᵀ) · xs ·
scale in fp32 in the same order: fp32 outputs match to fp32 rounding and bf16 ones to one
rounding of the same value. Past 2**24 the int32 sum stays exact where an fp32 one would not
(test_int32_sums_are_exact_past_fp32s_integers). fp8: every e4m3 × e4m3 product is exact in
fp32 and both sum them in fp32 in different orders; on a GPU the sm90 tensor cores accumulate
fp8 products at their own reduced precision, where the bound is test_kernels_activation.py's
for the dense fp8 GEMMs. The Triton quantizers the lowerings call are the reference's bit for
bit (tests/test_kernels_activation.py), so the lowerings keep those tolerances. Shapes include N
and K not multiples of the 32×64×128 tile, experts with no rows, rows past ``offs[-1]``, an
expert whose rows start mid-tile, and all-zero rows of x.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
from torch.library import opcheck

triton = pytest.importorskip("triton")

# the MXFP4 experts' kernel test's checks: the kernels take the same rows and offsets
# (kernels.grouped.expert_tile) and round one fp32 value to the output dtype
from test_kernels_mxfp4_grouped import DEVICE, INTERPRETED_OPCHECK, _close  # noqa: E402

from fxquant.core import reference as ref  # noqa: E402
from fxquant.passes import lower_cuda  # noqa: E402  (registers every fxquant::triton_* op)

pytestmark = pytest.mark.interpreter

fxq = torch.ops.fxquant
FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class Format:
    """One operand format: its kernel op, semantic op and reference, quantizers, the fp32
    tolerance, and the extra arguments its semantic op takes after offs."""

    name: str
    dtype: torch.dtype
    kernel: object
    op: object
    reference: object
    quantize_x: object
    quantize_w: object
    fp32_tol: tuple[float, float]
    op_args: tuple = ()

    def tolerances(self, dtype):
        """(rtol, atol relative to the output's magnitude) for outputs in ``dtype``: bf16 is one
        rounding of the fp32 value, which may differ from torch's in its last bit (the
        interpreter's bf16 store truncates); on a GPU, fp8 sums at the tensor cores' precision."""
        rtol, atol = self.fp32_tol if dtype == torch.float32 else (1.6e-2, 1e-4)
        if DEVICE == "cuda" and self.dtype == FP8:
            return max(rtol, 1.6e-2), max(atol, 1e-3)
        return rtol, atol


INT8 = Format(
    "int8", torch.int8, fxq.triton_int8_scaled_grouped_mm, fxq.int8_dynamic_grouped_mm,
    ref.int8_dynamic_grouped_mm, ref.quantize_int8_per_token, ref.quantize_int8_per_channel,
    fp32_tol=(1.2e-7, 0.0),  # the same two fp32 multiplies of the same exact sum
)  # fmt: skip
FLOAT8 = Format(
    "fp8", FP8, fxq.triton_float8_scaled_grouped_mm, fxq.float8_dynamic_grouped_mm,
    ref.float8_dynamic_grouped_mm, ref.quantize_fp8_per_token, ref.quantize_fp8_per_channel,
    fp32_tol=(1e-5, 1e-5), op_args=(None,),  # activation_scale_ub
)  # fmt: skip
FORMATS = pytest.mark.parametrize("fmt", [INT8, FLOAT8], ids=["int8", "fp8"])
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])

# (E, N, K, S, offs): offs are the cumulative row ends, offs[-1] <= S
CASES = [
    (1, 1, 16, 1, [1]),
    (3, 17, 96, 29, [5, 5, 29]),  # expert 1 has no rows; K short of one 128-wide K step
    (4, 70, 200, 40, [0, 33, 34, 37]),  # two N tiles, the last ragged; K = 128 + 72; expert 0
    # empty, expert 1 spans two row tiles, expert 2 starts mid-tile, rows 37..39 past offs[-1]
    (2, 20, 64, 7, [3, 3]),  # rows 3..6 past offs[-1]: zeros
]


def _inputs(fmt, e, n, k, s, offs, *, dtype=torch.float32, offs_dtype=torch.int64, seed=0):
    """(x, xq, xs, weight, scale, offs): Gaussian x with some tiny entries (e4m3 subnormals)
    and, where there is more than one row, an all-zero first row, and its per-token
    quantization; each expert's per-channel weight (int8's reaching ±127)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(s, k, generator=g) * 3
    x[:, ::5] *= 1e-3
    if s > 1:
        x[0] = 0
    x = x.to(dtype)
    xq, xs = fmt.quantize_x(x)
    wq, ws = fmt.quantize_w(torch.randn(e, n, k, generator=g))
    if fmt.dtype == torch.int8:
        wq[0, 0, : min(k, 2)] = torch.tensor([-127, 127][: min(k, 2)], dtype=torch.int8)
    o = torch.tensor(offs, dtype=offs_dtype)
    return tuple(t.to(DEVICE) for t in (x, xq, xs, wq, ws, o))


# ---- the kernel -----------------------------------------------------------------------------


@FORMATS
@DTYPES
@pytest.mark.parametrize(("e", "n", "k", "s", "offs"), CASES)
def test_kernel_matches_reference(fmt, e, n, k, s, offs, dtype):
    x, xq, xs, w, sc, o = _inputs(fmt, e, n, k, s, offs, dtype=dtype)
    y = fmt.kernel(xq, xs, w, sc, o, dtype)
    _close(y, fmt.reference(x, w, sc, o), *fmt.tolerances(dtype))
    assert (y[offs[-1] :] == 0).all() and (s == 1 or (y[0] == 0).all())  # x's zero row


@FORMATS
@pytest.mark.parametrize("offs_dtype", [torch.int32, torch.int64])
def test_offs_dtypes_and_offsets_past_s(fmt, offs_dtype):
    # offs[-1] > S: the reference slices to S, the kernel clips to S and reads no row past it
    x, xq, xs, w, sc, o = _inputs(fmt, 3, 24, 64, 11, [4, 9, 15], offs_dtype=offs_dtype)
    y = fmt.kernel(xq, xs, w, sc, o, torch.float32)
    _close(y, fmt.reference(x, w, sc, o), *fmt.tolerances(torch.float32))


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


# ---- the CUDA lowerings ---------------------------------------------------------------------


@FORMATS
@DTYPES
def test_the_cuda_lowering_computes_the_semantic_op(fmt, dtype):
    kw = dict(dtype=dtype, offs_dtype=torch.int32)
    x, _, _, w, sc, o = _inputs(fmt, 4, 70, 200, 40, [0, 33, 34, 37], **kw)
    lowering = lower_cuda.CUDA_LOWERINGS[fmt.op.default]
    want = fmt.op(x, w, sc, o, *fmt.op_args)
    _close(lowering(x, w, sc, o, *fmt.op_args), want, *fmt.tolerances(dtype))


def test_the_fp8_lowering_takes_the_activation_scale_bound():
    # FbgemmFp8Config's activation_scale_ub: rows whose amax passes it quantize on the bound's
    # grid, in the lowering's quantizer as in the reference's
    x, _, _, w, sc, o = _inputs(FLOAT8, 4, 70, 200, 40, [0, 33, 34, 37])
    lowering = lower_cuda.CUDA_LOWERINGS[fxq.float8_dynamic_grouped_mm.default]
    want = fxq.float8_dynamic_grouped_mm(x, w, sc, o, 1.0)
    assert not torch.equal(want, fxq.float8_dynamic_grouped_mm(x, w, sc, o, None))
    _close(lowering(x, w, sc, o, 1.0), want, *FLOAT8.tolerances(torch.float32))


@FORMATS
def test_all_zero_rows_give_zeros_not_nan(fmt):
    x, _, _, w, sc, o = _inputs(fmt, 2, 20, 64, 9, [4, 9])
    lowering = lower_cuda.CUDA_LOWERINGS[fmt.op.default]
    y = lowering(torch.zeros_like(x), w, sc, o, *fmt.op_args)
    assert torch.isfinite(y).all() and (y == 0).all()


# ---- the ops' registrations -----------------------------------------------------------------


def _opcheck_args(fmt):
    _, xq, xs, w, sc, o = _inputs(fmt, 3, 17, 96, 29, [5, 5, 29])
    return (xq, xs, w, sc, o, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
@FORMATS
def test_opcheck_gpu(fmt):
    opcheck(fmt.kernel.default, _opcheck_args(fmt))


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU runs every opcheck test (test_opcheck_gpu)")
@FORMATS
def test_triton_ops_pass_opcheck(fmt):
    # under the interpreter an op's fake kernel would launch the interpreter on fake tensors
    # (see test_kernels_activation.py): schema and autograd registration run here, but fp8's
    # test_schema compares the inputs with torch.allclose, which has no CPU kernel for float8
    utils = INTERPRETED_OPCHECK if fmt.dtype == torch.int8 else INTERPRETED_OPCHECK[1:]
    opcheck(fmt.kernel.default, _opcheck_args(fmt), test_utils=utils)


# ---- bad inputs -----------------------------------------------------------------------------


def _bad_inputs():
    cases = []
    for fmt, other in ((INT8, torch.uint8), (FLOAT8, torch.float8_e5m2)):
        _, xq, xs, w, sc, o = _inputs(fmt, 2, 8, 64, 5, [2, 5])
        name, bf16 = str(fmt.dtype).removeprefix("torch."), torch.bfloat16
        cases += [(fmt, *c) for c in [
            ((xq[0], xs, w, sc, o, bf16), "xq must be 2-D"),
            ((xq.float(), xs, w, sc, o, bf16), rf"xq must be 2-D \[S, K\] {name}; got .*float32"),
            ((xq, xs, w.to(other), sc, o, bf16), rf"weight must be {name} \[E, N, K\]; got .*"),
            ((xq, xs, w[0], sc, o, bf16), rf"weight must be {name} \[E, N, K\]; got .* \(8, 64\)"),
            ((xq[:, :48], xs, w, sc, o, bf16), "xq has K=48 features, the weight .* K=64"),
            ((xq, xs.double(), w, sc, o, bf16), r"xs must be fp32 \[S, 1\] = \[5, 1\]"),
            ((xq, xs[:, 0], w, sc, o, bf16), r"xs must be fp32 \[S, 1\] = \[5, 1\].*got .* \(5,\)"),
            ((xq, xs, w, sc.double(), o, bf16), r"scale must be fp32 \[E, N\] = \[2, 8\]"),
            ((xq, xs, w, sc[:, :1], o, bf16), r"scale must .* = \[2, 8\]; got .* \(2, 1"),
            ((xq, xs, w, sc, o, fmt.dtype), rf"out_dtype is torch.{name}; allowed: float32, bf"),
            ((xq, xs, w, sc, o.float(), bf16), r"offs must be int32/int64 \[E\] = \[2\]"),
            ((xq, xs, w, sc, o[:1], bf16), r"offs must .* = \[2\]; got .* \(1,\)"),
        ]]  # fmt: skip
    return cases


@pytest.mark.parametrize(("fmt", "case", "match"), _bad_inputs())
def test_bad_inputs_raise(fmt, case, match):
    with pytest.raises(ValueError, match=match):
        fmt.kernel(*case)
