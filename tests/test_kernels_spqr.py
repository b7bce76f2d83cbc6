"""SpQR's Triton GEMM (kernels/spqr.py) against ``fxquant.core.spqr.spqr_linear``, on CPU
tensors under TRITON_INTERPRET=1.

The layers are packed here in the layout ``fxquant.core.spqr`` documents (tests/test_spqr.py
checks that layout against the package's own): random 3-bit codes, row scale and zero codes,
per-tile second-level fp16 statistics, fp16 outliers (CSR, or PTCSR's 16-row interleaving with
its zero padding) and a column permutation. Shapes: N and K whole tiles but not multiples of
the interpreter's 32-wide blocks, M = 1, 5 (decode, also split-K) and 33 (prefill), bias or
not, no outliers or some (a few on one row, so a tile's rows walk lists of different lengths).
"""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

triton = pytest.importorskip("triton")

from fxquant.core import spqr as ref  # noqa: E402
from fxquant.core.reference import sqnr  # noqa: E402
from fxquant.kernels import spqr  # noqa: E402

pytestmark = pytest.mark.interpreter

fxq = torch.ops.fxquant
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _u16(h: torch.Tensor) -> torch.Tensor:
    return h.view(torch.int16).to(torch.int64) & 0xFFFF


def _layer(n: int, k: int, nnz: int, *, ptcsr: bool = False, seed: int = 0):
    """(weight, row_offsets, col_vals, perm) of a random SpQR layer W [n, k]."""
    g = torch.Generator().manual_seed(seed)
    ti, tj = n // 16, k // 16
    q = torch.randint(0, 8, (ti, 16, tj, 16), generator=g)  # [tile row, r, tile col, j]
    ws, wz = (torch.randint(0, 8, (ti, 16, tj), generator=g) for _ in range(2))
    s_s, z_s = ((torch.rand(ti, tj, generator=g) * 0.02 + 0.01).half() for _ in range(2))
    s_z, z_z = (torch.randint(0, 8, (ti, tj), generator=g).half() for _ in range(2))
    v = _u16(s_s) | _u16(z_s) << 16 | _u16(s_z) << 32 | _u16(z_z) << 48  # [TI, TJ]
    byte = (v[:, None, :] >> (8 * (torch.arange(16) // 2))[None, :, None]) & 0xFF  # [TI, r, TJ]
    codes = (q << (6 + 3 * torch.arange(16))).sum(-1)  # disjoint bits: the sum is the OR
    words = ws | wz << 3 | codes | byte << 54  # [TI, r, TJ]
    weight = words.permute(0, 2, 1).reshape(-1).contiguous()  # word (ti·TJ + tj)·16 + r
    # outliers: nnz distinct positions, a third of them on row 1
    on_1 = 1 * k + torch.randperm(k, generator=g)[: nnz // 3]
    flat = torch.randperm(n * k, generator=g)
    flat = torch.cat([on_1, flat[flat // k != 1][: nnz - on_1.numel()]])
    rows, cols = flat // k, flat % k
    order = torch.argsort(rows * k + cols)
    rows, cols = rows[order], cols[order]
    vals = torch.randn(nnz, generator=g).half()
    col_vals = (_u16(vals) << 16 | cols).to(torch.int32)
    if ptcsr:  # a block of 16 rows: 16 × its rows' most outliers, row r's i-th at 16·i + r % 16
        lanes = []
        for b in range(n // 16):
            mine = (rows // 16) == b
            most = int(torch.bincount(rows[mine] % 16, minlength=16).max()) if mine.any() else 0
            lane, seen = torch.zeros(16 * most, dtype=torch.int32), [0] * 16
            for r, cv in zip(rows[mine].tolist(), col_vals[mine].tolist(), strict=True):
                lane[16 * seen[r % 16] + r % 16] = cv
                seen[r % 16] += 1
            lanes.append(lane)
        col_vals = torch.cat(lanes)
        counts = torch.tensor([len(lane) for lane in lanes])
    else:
        counts = torch.bincount(rows, minlength=n)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)]).to(torch.int32)
    return weight, offsets, col_vals, torch.randperm(k, generator=g)


def _check(y, want, dtype):
    assert y.dtype == want.dtype == dtype and y.shape == want.shape and torch.isfinite(y).all()
    if dtype == torch.float32:
        torch.testing.assert_close(y, want, rtol=1e-5, atol=1e-5 * want.abs().max().item())
    else:  # the reference's fp32 result rounded to x's dtype; the kernel's sums differ slightly
        assert sqnr(want.float(), y.float()) >= 40


CASES = [  # x shape, N, K, outliers, PTCSR, dtype, bias
    ((1, 16), 16, 16, 0, False, torch.float32, False),
    ((1, 80), 48, 80, 9, False, torch.bfloat16, True),
    ((5, 48), 80, 48, 12, False, torch.float32, True),
    ((5, 48), 80, 48, 0, False, torch.float16, False),
    ((33, 80), 48, 80, 9, True, torch.float32, False),
    ((33, 48), 80, 48, 12, False, torch.bfloat16, False),
    ((2, 3, 48), 32, 48, 6, True, torch.bfloat16, True),
]


@pytest.mark.parametrize(("x_shape", "n", "k", "nnz", "ptcsr", "dtype", "bias"), CASES)
def test_the_kernel_computes_the_reference(x_shape, n, k, nnz, ptcsr, dtype, bias):
    layer = _layer(n, k, nnz, ptcsr=ptcsr)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(x_shape, generator=g).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    want = ref.spqr_linear(x, *layer, b)
    _check(spqr.lower_spqr_linear(x, *layer, b), want, dtype)


def test_outliers_change_the_result_as_the_reference_does():
    # the same layer without its outliers: the kernel must follow the reference in both
    layer = _layer(48, 80, 12)
    bare = (layer[0], torch.zeros(49, dtype=torch.int32), layer[2][:0], layer[3])
    x = torch.randn(5, 80)
    y, y_bare = fxq.triton_spqr_linear(x, *layer), fxq.triton_spqr_linear(x, *bare)
    assert not torch.allclose(y, y_bare)
    _check(y, ref.spqr_linear(x, *layer), torch.float32)
    _check(y_bare, ref.spqr_linear(x, *bare), torch.float32)


def test_split_k_adds_the_outliers_and_bias_once(monkeypatch):
    cfg = triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": 2}, num_warps=4)
    monkeypatch.setattr(spqr._decode_kernel, "configs", [cfg])
    layer = _layer(48, 80, 12, seed=2)
    x, b = torch.randn(3, 80), torch.randn(48)
    _check(fxq.triton_spqr_linear(x, *layer, b, True), ref.spqr_linear(x, *layer, b), x.dtype)


def test_zero_input_gives_zeros():
    layer = _layer(32, 48, 6)
    for m in (1, 33):
        y = fxq.triton_spqr_linear(torch.zeros(m, 48, dtype=torch.bfloat16), *layer)
        assert torch.equal(y, torch.zeros(m, 32, dtype=torch.bfloat16))


def test_bad_layouts_say_what_is_wrong():
    weight, offsets, col_vals, perm = _layer(32, 48, 3)
    with pytest.raises(ValueError, match="x has 40 features, perm 48"):
        fxq.triton_spqr_linear(torch.randn(2, 40), weight, offsets, col_vals, perm)
    with pytest.raises(ValueError, match="6 row offsets"):
        fxq.triton_spqr_linear(torch.randn(2, 48), weight, offsets[:6], col_vals, perm)
    with pytest.raises(ValueError, match="x dtype is torch.float64"):
        fxq.triton_spqr_linear(torch.randn(2, 48).double(), weight, offsets, col_vals, perm)


def _opcheck_args():
    weight, offsets, col_vals, perm = _layer(32, 48, 6, ptcsr=True)
    return (torch.randn(5, 48, dtype=torch.bfloat16), weight, offsets, col_vals, perm,
            torch.randn(32, dtype=torch.bfloat16))  # fmt: skip


# Under the interpreter ``wrap_triton`` hands back the bare kernel, so the op's fake kernel (its
# own body) would launch the interpreter on fake tensors: the fake-tensor and AOT tests need a
# GPU (tests/test_kernels_activation.py, INTERPRETED_OPCHECK).
@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU runs every opcheck test")
def test_opcheck_interpreted():
    opcheck(
        fxq.triton_spqr_linear.default,
        _opcheck_args(),
        test_utils=("test_schema", "test_autograd_registration"),
    )


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_opcheck_gpu():
    args = tuple(a.to(DEVICE) for a in _opcheck_args())
    opcheck(fxq.triton_spqr_linear.default, args)
