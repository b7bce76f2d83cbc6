"""The fp8 block-scaled grouped (mixture-of-experts) GEMM kernel, kernels/float8_block_grouped.py
(1×b activation groups, b×b weight tiles: ``fp8-block``, FineGrainedFP8Config's experts), and its
CUDA lowering against ``fxquant.core.reference.float8_block_grouped_mm``, on CPU tensors under
TRITON_INTERPRET=1. The per-row fp8 kernel is tests/test_kernels_scaled_grouped.py's.

Every e4m3 × e4m3 product is exact in fp32, and the kernel sums them in fp32 like the reference,
in another order and scaling each block's sum where the reference scales each element, so fp32
outputs match to fp32 rounding and bf16 ones to one rounding of the same sum. The Triton
quantizer the lowering calls is the reference's bit for bit (tests/test_kernels_activation.py),
so the lowering keeps those tolerances. On a GPU the sm90 tensor cores accumulate fp8 products
at their own reduced precision: there the bound is test_kernels_activation.py's for the dense
fp8 GEMMs. Shapes include N and K not multiples of the tile or the block (a ragged last block),
experts with no rows, rows past ``offs[-1]``, an expert whose rows start mid-tile, and all-zero
rows of x.
"""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

triton = pytest.importorskip("triton")

# the MXFP4 experts' kernel test's checks: the kernels take the same rows and offsets
# (kernels.grouped.expert_tile) and round one fp32 sum to the output dtype
from test_kernels_mxfp4_grouped import DEVICE, INTERPRETED_OPCHECK, _close  # noqa: E402

from fxquant.core import reference as ref  # noqa: E402
from fxquant.passes import lower_cuda  # noqa: E402  (registers every fxquant::triton_* op)

pytestmark = pytest.mark.interpreter

fxq = torch.ops.fxquant
FP8 = torch.float8_e4m3fn

# (E, N, K, S, offs, b): N and K not multiples of b (a ragged last tile and group), b above and
# below BLOCK_N = 64 (a column tile reading one or several tile-scale rows)
BLOCK_CASES = [
    (1, 16, 16, 1, [1], 32),  # K shorter than one block
    (3, 17, 96, 29, [5, 5, 29], 32),
    (4, 70, 200, 40, [0, 33, 34, 37], 32),
    (2, 150, 200, 36, [3, 36], 128),
    (2, 20, 40, 7, [3, 3], 32),
]
# (dtype, rtol, atol relative to the output's magnitude): bf16 is one rounding of an fp32 sum
# that may differ from the reference's in its last bits (the interpreter's bf16 store truncates)
TOLERANCES = [(torch.float32, 1e-5, 1e-5), (torch.bfloat16, 1.6e-2, 1e-4)]


def _tol(rtol, atol):
    """The interpreter's exact fp8 products and fp32 sums, or on a GPU the sm90 tensor cores'
    reduced-precision fp8 accumulation (test_kernels_activation.py's bound)."""
    return (max(rtol, 1.6e-2), max(atol, 1e-3)) if DEVICE == "cuda" else (rtol, atol)


def _x(s, k, dtype, g):
    """Gaussian activations with some tiny entries (e4m3 subnormals) and, where there is more
    than one row, an all-zero first row."""
    x = torch.randn(s, k, generator=g) * 3
    x[:, ::5] *= 1e-3
    if s > 1:
        x[0] = 0
    return x.to(dtype)


def _block_inputs(e, n, k, s, offs, b, *, dtype=torch.float32, offs_dtype=torch.int64, seed=0):
    """(x, xq, xs, weight, scale, offs): x and its 1×b e4m3 groups, each expert's b×b tiles."""
    g = torch.Generator().manual_seed(seed)
    x = _x(s, k, dtype, g)
    xq, xs = ref.quantize_fp8_groups(x, group_size=b)
    tiles = [ref.quantize_fp8_blocks(w, block_size=b) for w in torch.randn(e, n, k, generator=g)]
    wq, ws = (torch.stack(t) for t in zip(*tiles, strict=True))
    o = torch.tensor(offs, dtype=offs_dtype)
    return tuple(t.to(DEVICE) for t in (x, xq, xs, wq, ws, o))


# ---- the kernel and its lowering ------------------------------------------------------------


@pytest.mark.parametrize(("dtype", "rtol", "atol"), TOLERANCES)
@pytest.mark.parametrize(("e", "n", "k", "s", "offs", "b"), BLOCK_CASES)
def test_kernel_matches_reference(e, n, k, s, offs, b, dtype, rtol, atol):
    x, xq, xs, w, sc, o = _block_inputs(e, n, k, s, offs, b, dtype=dtype)
    y = fxq.triton_float8_block_scaled_grouped_mm(xq, xs, w, sc, o, b, dtype)
    _close(y, ref.float8_block_grouped_mm(x, w, sc, o, block_size=b), *_tol(rtol, atol))
    assert (y[offs[-1] :] == 0).all() and (s == 1 or (y[0] == 0).all())  # x's zero row


@pytest.mark.parametrize("offs_dtype", [torch.int32, torch.int64])
def test_offs_dtypes_and_offsets_past_s(offs_dtype):
    x, xq, xs, w, sc, o = _block_inputs(3, 24, 72, 11, [4, 9, 15], 32, offs_dtype=offs_dtype)
    y = fxq.triton_float8_block_scaled_grouped_mm(xq, xs, w, sc, o, 32, torch.float32)
    _close(y, ref.float8_block_grouped_mm(x, w, sc, o, block_size=32), *_tol(1e-5, 1e-5))


@pytest.mark.parametrize(("dtype", "rtol", "atol"), TOLERANCES)
def test_the_cuda_lowering_computes_the_semantic_op(dtype, rtol, atol):
    kw = dict(dtype=dtype, offs_dtype=torch.int32)
    x, _, _, w, sc, o = _block_inputs(3, 70, 200, 29, [5, 5, 29], 32, **kw)
    lowering = lower_cuda.CUDA_LOWERINGS[fxq.float8_block_grouped_mm.default]
    want = fxq.float8_block_grouped_mm(x, w, sc, o, 32)
    _close(lowering(x, w, sc, o, 32), want, *_tol(rtol, atol))


def test_all_zero_rows_give_zeros_not_nan():
    x, _, _, w, sc, o = _block_inputs(2, 20, 40, 9, [4, 9], 32)
    lowering = lower_cuda.CUDA_LOWERINGS[fxq.float8_block_grouped_mm.default]
    y = lowering(torch.zeros_like(x), w, sc, o, 32)
    assert torch.isfinite(y).all() and (y == 0).all()


# ---- the op's registration ------------------------------------------------------------------


def _opcheck_args():
    _, xq, xs, w, sc, o = _block_inputs(3, 17, 96, 29, [5, 5, 29], 32)
    return (xq, xs, w, sc, o, 32, torch.float32)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_opcheck_gpu():
    opcheck(fxq.triton_float8_block_scaled_grouped_mm.default, _opcheck_args())


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU runs every opcheck test (test_opcheck_gpu)")
def test_triton_op_passes_opcheck():
    # under the interpreter an op's fake kernel would launch the interpreter on fake tensors,
    # and test_schema's SchemaCheckMode compares the inputs with torch.allclose, which has no
    # CPU kernel for float8 (see test_kernels_activation.py): autograd registration runs here
    opcheck(
        fxq.triton_float8_block_scaled_grouped_mm.default,
        _opcheck_args(),
        test_utils=INTERPRETED_OPCHECK[1:],
    )


# ---- bad inputs -----------------------------------------------------------------------------


def _bad_inputs():
    _, xq, xs, w, sc, o = _block_inputs(2, 40, 96, 5, [2, 5], 32)
    bf16 = torch.bfloat16
    return [
        ((xq, xs, w, sc, o, 16, bf16), "block_size=16; allowed: powers of two >= 32"),
        ((xq, xs, w, sc, o, 48, bf16), "block_size=48; allowed: powers of two >= 32"),
        ((xq[0], xs, w, sc, o, 32, bf16), "xq must be 2-D"),
        ((xq.float(), xs, w, sc, o, 32, bf16), r"xq must be 2-D \[S, K\] float8_e4m3fn"),
        ((xq, xs, w.to(torch.float8_e5m2), sc, o, 32, bf16), "weight must be float8_e4m3fn"),
        ((xq, xs, w[0], sc, o, 32, bf16), r"weight must be float8_e4m3fn \[E, N, K\]"),
        ((xq[:, :64], xs, w, sc, o, 32, bf16), "xq has K=64 features, the weight .* K=96"),
        ((xq, xs.double(), w, sc, o, 32, bf16), r"xs must be fp32 \[S, ceil\(K/b\)\] = \[5, 3\]"),
        ((xq, xs[:, :2], w, sc, o, 32, bf16), r"= \[5, 3\] .*; got torch.float32 \(5, 2\)"),
        ((xq, xs, w, sc.double(), o, 32, bf16), r"scale must be fp32 \[E, ceil\(N/b\), ceil"),
        ((xq, xs, w, sc[:, :1], o, 32, bf16), r"= \[2, 2, 3\]; got torch.float32 \(2, 1, 3\)"),
        ((xq, xs, w, sc, o, 32, FP8), "out_dtype is torch.float8_e4m3fn; allowed: float32"),
        ((xq, xs, w, sc, o.float(), 32, bf16), r"offs must be int32/int64 \[E\] = \[2\]"),
        ((xq, xs, w, sc, o[:1], 32, bf16), r"offs must be int32/int64 \[E\] = \[2\]; got"),
    ]  # fmt: skip


@pytest.mark.parametrize(("case", "match"), _bad_inputs())
def test_bad_inputs_raise(case, match):
    with pytest.raises(ValueError, match=match):
        fxq.triton_float8_block_scaled_grouped_mm(*case)
