"""The native CPU kernels (fxquant.kernels.cpu) against the reference math.

Every op at awkward sizes (K of 1 to 200, not multiples of the vector width; N not a multiple
of the row block; M on both sides of each GEMV / chunked-mm threshold; empty inputs), opcheck,
and an AOTInductor package that calls the C shims, run in a process that never imports fxquant.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
import torch.nn.functional as F

import fxquant
import fxquant.kernels.cpu as native
from conftest import ROOT, assert_sums_close
from fxquant.core import reference as ref
from fxquant.core import reference_lowbit as ref_lowbit
from fxquant.passes.cpu import int8 as _int8  # noqa: F401  (registers the VNNI device ops)
from fxquant.passes.cpu.float8 import e4m3_values
from fxquant.passes.cpu.int4 import (  # (registers fxquant::cpu_native_int4_linear)
    dequantize_native_int4,
    prepack_codes,
)

pytestmark = [
    pytest.mark.skipif(
        not native.available(),
        reason=f"native CPU kernels unavailable: {native.unavailable_reason()}",
    ),
    # the kernels split N (and the GEMV's rows) across OpenMP threads (conftest's fixture)
    pytest.mark.usefixtures("two_threads"),
]

fxq = torch.ops.fxquant
DEFAULT_UTILS = torch.library._OPCHECK_DEFAULT_UTILS
# M around the kernels' thresholds (GEMV up to 16/32/64 rows by format, chunked mm above) and
# the GEMV's blocks of four activation rows
MS = (0, 1, 2, 5, 8, 16, 17, 32, 33, 64, 65, 100)

_close = assert_sums_close  # fp32 sums in another order: relative to the output's scale


def test_int8_scaled_extremes_do_not_saturate():
    # every product at +-127 * 127 over a long K, on every path (VNNI's x + 128 included)
    k = 4160  # 65 blocks of 64
    w = torch.full((3, k), 127, dtype=torch.int8)
    w[1] = -127
    w[2, ::2] = -127
    xq = torch.full((13, k), -127, dtype=torch.int8)  # 13 rows: the GEMV's limit and past it
    xq[1] = 127
    xq[3, 1::3] = 0
    xq[9] = 127
    xs, s = torch.rand(13) + 0.5, torch.rand(3) + 0.5
    got = fxq.native_int8_scaled_linear(xq, xs, w, s)
    # (sums up to 6.7e7, past fp32's exact integers: the reference's fp32 matmul would round)
    want = (xq.long() @ w.long().t()).float() * xs.reshape(-1, 1) * s
    assert torch.equal(got, want)


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("k", [1, 31, 32, 33, 100, 1024])
def test_bf16_dot_kernels_are_the_reference_on_x_rounded_to_bf16(fmt, k):
    # int8 and e4m3 weights are exact in bf16, so the products are the reference's on x
    # rounded to bf16 (round to nearest even; one row, decode, is not rounded: the fp32 GEMV)
    # and the sums fp32 (another order): every M around the row kernel's 16-row blocks and
    # their 8/4/2/1 tails and past the packed-panel GEMM's start (32 rows: its 6-row tiles and
    # their tails, 37 columns = two full 16-column panels and a short one), K around the
    # 32-column steps (and K = 1024, whose rows the kernel spaces apart so they do not share an
    # L1 set)
    g = torch.Generator().manual_seed(k)
    w = torch.randn(37, k, generator=g)
    if fmt == "int8":
        q, s = ref.quantize_int8_per_channel(w)
        op = fxq.native_int8_bf16dot_linear
    else:
        q, s = ref.quantize_fp8_per_channel(w)
        op = fxq.native_float8_bf16dot_linear
    for m in (0, 1, 2, 3, 15, 16, 17, 31, 32, 33, 40, 71):
        x = torch.randn(m, k, generator=g)
        xr = x if m == 1 else x.bfloat16().float()  # decode (one row) keeps fp32 x
        want = (xr @ q.float().t()) * s.float().reshape(-1)
        _close(op(x, q, s.float().reshape(-1)), want)
    # all-zero activations give zeros, not NaN
    assert torch.equal(op(torch.zeros(5, k), q, s.float().reshape(-1)), torch.zeros(5, 37))


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_bf16_dot_kernels_take_every_k(fmt):
    # every K of 1..200 (each residue of the 32-column steps and their masked tails, odd K's
    # half-empty last pair in the panels), a few rows and enough for the packed-panel GEMM
    g = torch.Generator().manual_seed(0)
    for k in range(1, 201):
        w = torch.randn(19, k, generator=g)
        q, s = (ref.quantize_int8_per_channel if fmt == "int8" else ref.quantize_fp8_per_channel)(w)
        op = fxq.native_int8_bf16dot_linear if fmt == "int8" else fxq.native_float8_bf16dot_linear
        for m in (3, 34):
            x = torch.randn(m, k, generator=g)
            want = (x.bfloat16().float() @ q.float().t()) * s.float().reshape(-1)
            _close(op(x, q, s.float().reshape(-1)), want)


@pytest.mark.parametrize(("k", "group"), [(32, 32), (64, 64), (256, 128), (576, 64)])
def test_int4_bf16_dot_kernel_is_the_bf16_rounded_product(k, group):
    # x rounded to bf16 (not one row: decode is the weight-only op's fp32 GEMV) times the
    # dequantized weight rounded to bf16 (the decoder's, itself tested against the layout's
    # reading in aten above), fp32 sums: every M around the row kernel's blocks and past the
    # packed-panel GEMM's start (32), 37 columns (two full 16-column panels and a short one)
    g = torch.Generator().manual_seed(k + group)
    w = torch.randn(37, k, generator=g)
    p, s, z = ref.quantize_int4_grouped(w, group_size=group, symmetric=False)
    kw, ks, ko = native.prepack_int4(p, s, z, group_size=group)
    w_bf16 = fxq.native_int4_to_bfloat16(kw, ks, ko, group).float()
    for m in (0, 1, 2, 3, 15, 16, 17, 31, 32, 33, 40, 71):
        x = torch.randn(m, k, generator=g)
        got = fxq.native_int4_bf16dot_linear(x, kw, ks, ko, group)
        want = ref.int4_weight_only_linear(x, p, s, z, group_size=group)
        if m == 1:
            _close(got, fxq.native_int4_weight_only_linear(x, kw, ks, ko, group))
        elif m:
            _close(got, x.bfloat16().float() @ w_bf16.t())
            # and the scheme's fp32 reference: the two bf16 roundings, ~2e-3 relative each
            assert ((got - want).norm() / want.norm()).item() < 1.5e-2
    # all-zero activations and weights give zeros, not NaN
    zero = native.prepack_int4(
        *ref.quantize_int4_grouped(torch.zeros(5, k), group_size=group, symmetric=False),
        group_size=group,
    )
    for m in (3, 40):
        assert torch.equal(
            fxq.native_int4_bf16dot_linear(torch.zeros(m, k), *zero, group), torch.zeros(m, 5)
        )
        assert torch.equal(
            fxq.native_int4_bf16dot_linear(torch.randn(m, k), *zero, group), torch.zeros(m, 5)
        )


@pytest.mark.parametrize("k", [1, 7, 8, 9, 31, 33, 100, 127, 136, 200])
def test_int8_weight_only_every_k(k):
    g = torch.Generator().manual_seed(k)
    w, x = torch.randn(37, k, generator=g), torch.randn(3, k, generator=g)
    q, s = ref.quantize_int8_per_channel(w)
    _close(fxq.native_int8_weight_only_linear(x, q, s), ref.int8_weight_only_linear(x, q, s))


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize(("n", "k"), [(1, 1), (5, 64), (37, 100), (130, 576)])
def test_int8_weight_only(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    q, s = ref.quantize_int8_per_channel(w)
    _close(fxq.native_int8_weight_only_linear(x, q, s), ref.int8_weight_only_linear(x, q, s))


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize(("n", "k"), [(1, 1), (5, 64), (37, 100), (130, 576)])
def test_int8_scaled_is_exact_in_the_gemv(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + 1)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    q, s = ref.quantize_int8_per_channel(w)
    xq, xs = ref.quantize_int8_per_token(x)
    got = fxq.native_int8_scaled_linear(xq, xs.reshape(-1), q, s)
    want = ref.int8_scaled_linear(xq, xs, q, s, out_dtype=torch.float32)
    # int32 sums of int8 products: exact, then the same two fp32 multiplies, in the GEMV and in
    # the panel GEMMs (AVX2, AVX-512 VNNI); a build without AVX2 takes the GEMV at every M
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    ("m", "n", "k"), [(9, 3, 33), (130, 5, 4160), (70, 301, 576), (10, 200, 130), (17, 48, 64)]
)
def test_int8_scaled_gemm_tiles_and_blocks_are_exact(m, n, k):
    # The panel GEMMs. AVX2's: row tails of its 3-row tiles, panels of fewer than 8 columns and
    # blocks ending in 1 or 2 panels, K not a multiple of 4 (padded quads) or of 32 (the
    # transposing pack's tail), and several panel blocks per thread (K = 4160: one panel a
    # block). AVX-512 VNNI's (from 3 rows): row tails of its 6-row tiles, 16-column panels cut
    # short (301, 200, 3 and 5 columns), groups of fewer than 4 panels, blocks rounded up to the
    # threads (70 x 301) and rows split per thread instead (130 x 5: one block)
    g = torch.Generator().manual_seed(m + n + k)
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    xs, s = torch.rand(m, generator=g) + 0.5, torch.rand(n, generator=g) + 0.5
    got = fxq.native_int8_scaled_linear(xq, xs, w, s)
    want = (xq.long() @ w.long().t()).float() * xs.reshape(-1, 1) * s
    if torch.cpu._is_avx2_supported():
        assert torch.equal(got, want)
    else:
        _close(got, want)


@pytest.mark.parametrize(
    ("m", "n", "k"),
    [(0, 5, 8), (1, 1, 1), (1, 200, 130), (2, 48, 64), (3, 17, 33), (7, 301, 576), (130, 5, 4160)]
    + [(70, 301, 576), (16, 64, 1024)],
)
def test_int8_scaled_on_the_vnni_panels_is_exact(m, n, k):
    # w8a8's weight prepacked once (prepack_int8_vnni): every M, one row included, is the
    # exact integer product, bit for bit the unpacked op's; panels cut short, K not a multiple
    # of 4, row tails, one panel a block (K = 4160). Without VNNI the shim reads the layout
    # byte by byte: the same integers.
    g = torch.Generator().manual_seed(m + n + k + 7)
    xq = torch.randint(-127, 128, (m, k), dtype=torch.int8, generator=g)
    w = torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g)
    xs, s = torch.rand(m, generator=g) + 0.5, torch.rand(n, generator=g) + 0.5
    panels, comp = native.prepack_int8_vnni(w)
    got = fxq.native_int8_scaled_vnni_linear(xq, xs, panels, comp, s)
    want = (xq.long() @ w.long().t()).float() * xs.reshape(-1, 1) * s
    assert torch.equal(got, want)
    if torch.cpu._is_avx2_supported() or m <= 3:
        assert torch.equal(got, fxq.native_int8_scaled_linear(xq, xs, w, s))


@pytest.mark.parametrize(("k", "group"), [(64, 64), (640, 64), (512, 128), (768, 256), (96, 32)])
def test_w4a8_around_the_amx_tile_blocks(k, group):
    # W4A8 on AMX tiles (groups of 64 or more; groups of 32 keep the AVX-512 kernel): each
    # group's sums leave the tiles for its scale and offset; M around the row blocks, panel
    # counts even and odd, a short last panel
    for n in (16, 40, 67):
        for m in (7, 8, 9, 16, 17, 31, 32, 33, 48, 65):
            _check_w4a8(m, n, k, group, symmetric=False, seed=m * n + k)


def _activations(m: int, k: int, g: torch.Generator) -> torch.Tensor:
    # per-token scales from 1e-30 to 1e4, an all-zero row, and a row whose x / scale lands on
    # exact halves (amax 127: scale 1), where round-half-to-even decides
    x = torch.randn(m, k, generator=g) * 10.0 ** torch.randint(-30, 5, (m, 1), generator=g)
    if m > 1:
        x[1] = 0
    if m > 2 and k >= 8:
        x[2, :8] = torch.tensor([127.0, 0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 126.5])
    return x


@pytest.mark.parametrize(("m", "k"), [(0, 8), (1, 1), (3, 7), (5, 64), (17, 100), (130, 600)])
def test_dynamic_ops_quantize_as_the_reference(m, k):
    # the fp32-activation ops quantize per token inside the kernel: the reference's bytes, so
    # their output is bit for bit the int8-activation op's on the reference's xq and xs
    g = torch.Generator().manual_seed(m * 1000 + k)
    x = _activations(m, k, g)
    xq, xs = ref.quantize_int8_per_token(x)
    xs = xs.reshape(-1)
    w = torch.randint(-127, 128, (37, k), dtype=torch.int8, generator=g)
    s = torch.rand(37, generator=g) + 0.5
    vnni = native.prepack_int8_vnni(w)
    got = fxq.native_int8_dynamic_vnni_linear(x, *vnni, s)
    assert torch.equal(got, fxq.native_int8_scaled_vnni_linear(xq, xs, *vnni, s))
    assert torch.equal(
        fxq.native_int8_dynamic_linear(x, w, s), fxq.native_int8_scaled_linear(xq, xs, w, s)
    )
    # W4A8: K padded to whole 32-column blocks with zeros, as the lowering pads (the amax holds)
    pad = -k % 32
    w4 = torch.randn(37, k + pad, generator=g)
    p4 = ref.quantize_int4_grouped(w4, group_size=32, symmetric=False)
    kw, ks, ko = native.prepack_int4(*p4, group_size=32)
    got = fxq.native_int8_dynamic_int4_linear(F.pad(x, (0, pad)), kw, ks, ko, 32)
    assert torch.equal(got, fxq.native_int8_int4_linear(F.pad(xq, (0, pad)), xs, kw, ks, ko, 32))
    assert not got.isnan().any()


@pytest.mark.parametrize(("m", "k"), [(0, 8), (1, 1), (2, 7), (5, 64), (17, 100), (130, 600)])
@pytest.mark.parametrize("ub", [float("inf"), 0.5])
def test_float8_dynamic_ops_quantize_as_the_reference(m, k, ub):
    # fp8 per-row activations quantized inside the op: the reference's e4m3 values and scales
    # (a scale cap included), then the e4m3 GEMM and each row times its scale, bit for bit the
    # weight-only op's on the reference's quantized x; subnormal e4m3 values from the 1e-30 rows
    g = torch.Generator().manual_seed(m * 1000 + k + 5)
    x = _activations(m, k, g)
    xq, xs = ref.quantize_fp8_per_token(x, scale_ub=None if ub == float("inf") else ub)
    wq, ws = ref.quantize_fp8_per_channel(torch.randn(37, k, generator=g))
    xq = xq.float()
    got = fxq.native_float8_dynamic_linear(x, wq, ws, ub)
    assert torch.equal(got, fxq.native_float8_weight_only_linear(xq, wq, ws) * xs)
    got = fxq.native_float8_dynamic_bf16dot_linear(x, wq, ws, ub)
    assert torch.equal(got, fxq.native_float8_bf16dot_linear(xq, wq, ws) * xs)
    assert not got.isnan().any()


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize(
    ("n", "k", "block"), [(1, 3, 32), (37, 100, 32), (130, 576, 128), (300, 257, 64)]
)
def test_float8_block(m, n, k, block):
    # DeepSeek-V3 blocks, the tiles and groups ragged at N's and K's ends: the GEMV applies a
    # span's two scales once (fp32 rounding away from the reference), the large-M path the
    # reference's dequantized operands; x quantized in the op to the reference's groups, so the
    # scaled op on those is the same result bit for bit
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w, x = torch.randn(n, k, generator=g), _activations(m, k, g)
    q, s = ref.quantize_fp8_blocks(w, block_size=block)
    q = q.contiguous()
    got = fxq.native_float8_block_linear(x, q, s, block)
    _close(got, ref.float8_block_linear(x, q, s, block_size=block))
    xq, xs = ref.quantize_fp8_groups(x, group_size=block)
    assert torch.equal(fxq.native_float8_block_scaled_linear(xq.float(), xs, q, s, block), got)
    assert not got.isnan().any()


# the experts' rows by expert: each on both sides of the GEMV threshold, rows of zeros among
# them (skipped), an empty expert, rows past the last end (zeros)
EXPERT_ENDS = [[0, 1, 1, 1], [2, 2, 7, 8], [33, 40, 40, 110]]


@pytest.mark.parametrize("ends", EXPERT_ENDS)
@pytest.mark.parametrize("bf16_x", [0, 1])
def test_grouped_experts_run_each_experts_rows_on_the_linears_paths(ends, bf16_x):
    """int8 and fp8 weight-only, W8A8, fp8 per-row and block experts (int8_fp8.cpp's grouped
    shims) against their references: the linear's own kernels on each expert's rows, where the
    arithmetic is this build's."""
    g = torch.Generator().manual_seed(sum(ends))
    e, n, k = 4, 37, 200
    w = torch.randn(e, n, k, generator=g)
    x = _activations(ends[-1] + 3, k, g)
    x[1:3] = 0
    offs = torch.tensor(ends)
    q8, s8 = ref.quantize_int8_per_channel(w)
    got = fxq.native_int8_weight_only_grouped_mm(x, q8, s8, offs, 0)
    _close(got, ref.int8_weight_only_grouped_mm(x, q8, s8, offs))
    got = fxq.native_int8_dynamic_grouped_mm(x, q8, s8, offs)  # W8A8: int32 sums
    _close(got, ref.int8_dynamic_grouped_mm(x, q8, s8, offs))
    q, s = ref.quantize_fp8_per_channel(w)
    got = fxq.native_float8_weight_only_grouped_mm(x, q, s, offs, 0)
    _close(got, ref.float8_weight_only_grouped_mm(x, q, s, offs))
    got = fxq.native_float8_dynamic_grouped_mm(x, q, s, offs, 1200.0, bf16_x)
    _close(got, ref.float8_dynamic_grouped_mm(x, q, s, offs, activation_scale_ub=1200.0))
    for b in (32, 128):
        stored = fxquant.Float8Block(block_size=b).quantize(w).tensors  # each expert's tiles
        qb, sb = stored["qweight"], stored["scale"]
        got = fxq.native_float8_block_grouped_mm(x, qb, sb, offs, b)
        _close(got, ref.float8_block_grouped_mm(x, qb, sb, offs, block_size=b))
        assert (got[ends[-1] :] == 0).all() and not got.isnan().any()


def test_prepack_int8_vnni_layout():
    w = torch.arange(-60, 60, dtype=torch.int8).reshape(20, 6)  # 2 panels (one of 4 rows), K4 2
    panels, comp = native.prepack_int8_vnni(w)
    assert panels.shape == (2, 2 * 64) and comp.shape == (32,) and comp.dtype == torch.int32
    padded = torch.zeros(32, 8, dtype=torch.int8)
    padded[:20, :6] = w
    for p, g, c, t in ((0, 0, 0, 0), (0, 1, 15, 3), (1, 0, 3, 1), (1, 1, 3, 1), (1, 1, 9, 2)):
        assert panels[p, g * 64 + 4 * c + t] == padded[16 * p + c, 4 * g + t]
    assert torch.equal(comp, padded.int().sum(1) * 128)
    with pytest.raises(ValueError, match="2-D int8 tensor, got torch.float32"):
        native.prepack_int8_vnni(w.float())


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize(("n", "k"), [(1, 3), (5, 64), (37, 100), (130, 576)])
def test_float8_weight_only(m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + 2)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    q, s = ref.quantize_fp8_per_channel(w)
    _close(fxq.native_float8_weight_only_linear(x, q, s), ref.float8_weight_only_linear(x, q, s))


def test_float8_decode_is_exact_for_every_code():
    # all 254 finite e4m3 codes (subnormals included) times 1.0: the decoder in both the GEMV
    # and the chunked path is exact
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]
    w = finite.view(torch.float8_e4m3fn).reshape(-1, 1)
    ones = torch.ones(w.shape[0])
    for m in (1, 40):
        got = fxq.native_float8_weight_only_linear(torch.ones(m, 1), w, ones)
        assert torch.equal(got, w.float().t().expand(m, -1))


def test_float8_decode_is_exact_for_every_code_at_every_lane():
    # K = 64: the AVX-512 VBMI table lookup decodes a whole row in one step (native.h); row n
    # holds code n in every column, x is ones, so y = 64 * value exactly (4 significant bits times
    # at most 64), in the GEMV (1 and 4 rows) and the bf16-dot row kernel and panels (8, 40)
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]
    w = finite.view(torch.float8_e4m3fn).reshape(-1, 1).expand(-1, 64).contiguous()
    ones = torch.ones(w.shape[0])
    want = 64 * w.float()[:, 0]
    for m in (1, 4, 8, 40):
        x = torch.ones(m, 64)
        for op in (fxq.native_float8_weight_only_linear, fxq.native_float8_bf16dot_linear):
            assert torch.equal(op(x, w, ones), want.expand(m, -1)), (op, m)


def test_float8_to_bfloat16_is_exact_for_every_code():
    # the large-M bf16 GEMM's decoder (decode.cpp): every finite code, at every offset of the
    # vector loop and its tail
    codes = torch.arange(256, dtype=torch.uint8)
    finite = codes[(codes & 0x7F) != 0x7F]
    for n, k in ((1, 254), (2, 127), (254, 1), (3, 13)):
        w = finite.repeat(3)[: n * k].reshape(n, k).view(torch.float8_e4m3fn)
        got = fxq.native_float8_to_bfloat16(w)
        assert got.dtype == torch.bfloat16 and torch.equal(got, w.to(torch.bfloat16))
    assert fxq.native_float8_to_bfloat16(torch.empty(0, 8, dtype=torch.float8_e4m3fn)).shape == (
        0,
        8,
    )


@pytest.mark.parametrize("group", [32, 64, 128])
def test_int4_to_bfloat16_rounds_the_dequantized_weight(group):
    # the layout read in aten (dequantize_native_int4) in fp32, then rounded to bf16: the
    # decoder's fused multiply-add may round the fp32 value once less, so at most one bf16 step
    g = torch.Generator().manual_seed(group)
    w = torch.randn(37, 256, generator=g)
    p, s, z = ref.quantize_int4_grouped(w, group_size=group, symmetric=False)
    kw, ks, ko = native.prepack_int4(p, s, z, group_size=group)
    got = fxq.native_int4_to_bfloat16(kw, ks, ko, group)
    exact = dequantize_native_int4(kw, ks, ko, group, torch.float32)
    assert got.dtype == torch.bfloat16 and got.shape == (37, 256)
    # (where u = z the exact weight is 0 and both sides are fp32 rounding residue of -z * s)
    residue = ko.abs().max().item() * 2**-22
    torch.testing.assert_close(got.float(), exact, rtol=2**-8, atol=residue)
    assert torch.equal(
        fxq.native_int4_to_bfloat16(
            *native.prepack_int4(
                *ref.quantize_int4_grouped(torch.zeros(4, 64), group_size=32, symmetric=False),
                group_size=32,
            ),
            32,
        ),
        torch.zeros(4, 64, dtype=torch.bfloat16),
    )  # no NaN from zeros


def test_e4m3_values_round_as_the_fp8_conversion_does():
    # every e4m3 value, the midpoints between neighbours (ties: half to even), a hair either
    # side of each, random values over the whole range, signed zeros and NaN; eager and compiled
    codes = torch.arange(256, dtype=torch.uint8)
    grid = codes[(codes & 0x7F) != 0x7F].view(torch.float8_e4m3fn).float().unique()
    mid = (grid[1:] + grid[:-1]) / 2
    g = torch.Generator().manual_seed(0)
    v = torch.cat([
        grid, mid, mid.nextafter(mid + 1), mid.nextafter(mid - 1),
        (torch.rand(4096, generator=g) * 2 - 1) * 448 * torch.logspace(-12, 0, 4096),
        torch.tensor([0.0, -0.0, 448.0, -448.0, float("nan")]),
    ])  # fmt: skip
    want = v.to(torch.float8_e4m3fn).float()
    for fn in (e4m3_values, torch.compile(e4m3_values)):
        got = fn(v)
        assert torch.equal(got.isnan(), want.isnan())
        ok = ~want.isnan()
        assert torch.equal(got[ok], want[ok])
        assert torch.equal(got[ok].signbit(), want[ok].signbit())


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize(
    ("n", "k", "group"), [(1, 32, 32), (5, 64, 64), (37, 256, 128), (130, 576, 64)]
)
@pytest.mark.parametrize("symmetric", [False, True])
def test_int4_weight_only(m, n, k, group, symmetric):
    g = torch.Generator().manual_seed(m * 1000 + n + 3)
    w, x = torch.randn(n, k, generator=g), torch.randn(m, k, generator=g)
    p, s, z = ref.quantize_int4_grouped(w, group_size=group, symmetric=symmetric)
    kw, ks, ko = native.prepack_int4(p, s, z, group_size=group)
    got = fxq.native_int4_weight_only_linear(x, kw, ks, ko, group)
    _close(got, ref.int4_weight_only_linear(x, p, s, z, group_size=group))


@pytest.mark.parametrize("m", MS)
@pytest.mark.parametrize(
    ("n", "k", "group"), [(1, 32, 32), (5, 64, 64), (37, 256, 256), (130, 576, 64)]
)
@pytest.mark.parametrize("symmetric", [False, True])
def test_int8_int4_w4a8(m, n, k, group, symmetric):
    _check_w4a8(m, n, k, group, symmetric=symmetric, seed=m * 1000 + n + 4)


def _check_w4a8(m: int, n: int, k: int, group: int, *, symmetric: bool, seed: int) -> None:
    # the W4A8 kernel on random weights and activations against the scheme's reference
    g = torch.Generator().manual_seed(seed)
    w, x = torch.randn(n, k, generator=g), 4 * torch.randn(m, k, generator=g)
    p, s, z = ref.quantize_int4_grouped(w, group_size=group, symmetric=symmetric)
    kw, ks, ko = native.prepack_int4(p, s, z, group_size=group)
    xq, xs = ref.quantize_int8_per_token(x)
    got = fxq.native_int8_int4_linear(xq, xs.reshape(-1), kw, ks, ko, group)
    _close(got, ref.int8_dynamic_int4_linear(x, p, s, z, group_size=group))


def test_int8_int4_groups_of_256_at_the_extremes_do_not_saturate():
    # every code 15 against every activation +-127: each int16 lane of a 256-column group holds
    # 8 maddubs pairs of 2 * 15 * 127, the most the kernel's group sums can reach
    n, k = 3, 512
    u = torch.full((n, k), 15, dtype=torch.uint8)
    s, z = torch.full((n, k // 256), 0.5), torch.zeros(n, k // 256, dtype=torch.uint8)
    kw, ks, ko = native.prepack_int4(ref.pack_int4(u), s, z, group_size=256)
    for sign in (1, -1):
        for m in (2, 131):  # the GEMV, and AVX2's panel GEMM past its rows
            xq = torch.full((m, k), 127 * sign, dtype=torch.int8)
            got = fxq.native_int8_int4_linear(xq, torch.ones(m), kw, ks, ko, 256)
            assert torch.equal(got, torch.full((m, n), sign * 127 * 15 * 0.5 * k))


@pytest.mark.parametrize(
    ("m", "n", "k", "group"),
    [
        (129, 13, 64, 32),
        (130, 40, 576, 64),
        (200, 17, 2048, 128),
        (131, 24, 256, 256),
        (41, 200, 128, 32),
        (97, 301, 512, 128),
    ],
)
def test_int8_int4_gemm_panels_and_blocks(m, n, k, group):
    # past the GEMV's rows, the packed-panel GEMMs. AVX2's: row tails of its 3-row tiles, panels
    # of fewer than 8 columns, blocks ending in one panel, every group size, and (K = 2048) one
    # panel pair a block. AVX-512 VNNI's: row tails of its 4-row tiles, 16-column panels cut
    # short, tiles of fewer than 3 panels, blocks rounded up to the threads and cut at single
    # panels (41 x 200: 13 panels) and rows split per thread (97 x 301, 200 x 17)
    _check_w4a8(m, n, k, group, symmetric=False, seed=m + n + k)


@pytest.mark.parametrize("bits", [2, 3])
def test_low_bit_codes_and_float_zero_points_take_the_int4_kernel(bits):
    g = torch.Generator().manual_seed(bits)
    w, x = torch.randn(24, 128, generator=g), torch.randn(3, 128, generator=g)
    p, s, z = ref_lowbit.quantize_intx_grouped(w, bits=bits, group_size=64, symmetric=False)
    z = z.float() + 0.37  # a float zero point (HQQ's) goes into the offset as well
    kw, ks, ko = prepack_codes(ref_lowbit.unpack_intx(p, bits), s, z, group_size=64)
    want = ref_lowbit.intx_weight_only_linear(x, p, s, z, bits=bits, group_size=64)
    _close(fxq.native_int4_weight_only_linear(x, kw, ks, ko, 64), want)


def test_all_zero_weights_and_inputs_give_zeros_not_nan():
    q, s = ref.quantize_int8_per_channel(torch.zeros(8, 64))
    for m in (1, 40):
        x = torch.zeros(m, 64)
        y = fxq.native_int8_weight_only_linear(x, q, s)
        assert torch.equal(y, torch.zeros(m, 8))
        p, s4, z4 = ref.quantize_int4_grouped(torch.zeros(8, 64), group_size=32, symmetric=False)
        y4 = fxq.native_int4_weight_only_linear(
            x, *native.prepack_int4(p, s4, z4, group_size=32), 32
        )
        assert torch.equal(y4, torch.zeros(m, 8))
        xq, xs = ref.quantize_int8_per_token(x)
        y48 = fxq.native_int8_int4_linear(
            xq, xs.reshape(-1), *native.prepack_int4(p, s4, z4, group_size=32), 32
        )
        assert torch.equal(y48, torch.zeros(m, 8))
        q8, s8 = ref.quantize_fp8_blocks(torch.zeros(8, 64), block_size=32)
        assert torch.equal(fxq.native_float8_block_linear(x, q8, s8, 32), torch.zeros(m, 8))


def test_inputs_outside_the_contract_raise_not_crash():
    q, s = ref.quantize_int8_per_channel(torch.randn(8, 64))
    with pytest.raises(RuntimeError, match="outside the kernel's contract"):
        fxq.native_int8_weight_only_linear(torch.randn(2, 63), q, s)  # K mismatch
    with pytest.raises(RuntimeError, match="outside the kernel's contract"):
        fxq.native_int8_weight_only_linear(torch.randn(64, 2).t(), q, s)  # not contiguous
    with pytest.raises(RuntimeError, match="outside the kernel's contract"):
        fxq.native_int8_weight_only_linear(torch.randn(2, 64).double(), q, s)
    kw, ks, ko = native.prepack_int4(
        *ref.quantize_int4_grouped(torch.randn(4, 64), group_size=32, symmetric=False),
        group_size=32,
    )
    with pytest.raises(RuntimeError, match="native_int4_to_bfloat16: inputs outside"):
        fxq.native_int4_to_bfloat16(kw, ks, ko, 64)  # scales are per 32 columns
    q8, s8 = ref.quantize_fp8_blocks(torch.randn(8, 64), block_size=32)
    with pytest.raises(RuntimeError, match="native_float8_block_linear: inputs outside"):
        fxq.native_float8_block_linear(torch.randn(2, 64), q8, s8, 64)  # scales are per 32
    with pytest.raises(RuntimeError, match="native_float8_block_scaled_linear: inputs outside"):
        fxq.native_float8_block_scaled_linear(torch.randn(2, 64), torch.ones(2, 1), q8, s8, 32)
    with pytest.raises(RuntimeError, match="native_float8_to_bfloat16: inputs outside"):
        fxq.native_float8_to_bfloat16(torch.zeros(4, 8, dtype=torch.uint8))


def test_prepack_int4_needs_whole_blocks():
    p, s, z = ref.quantize_int4_grouped(torch.randn(4, 64), group_size=32, symmetric=False)
    with pytest.raises(ValueError, match="multiple of 32"):
        native.prepack_int4(p, s, z, group_size=16)


def _attention_reference(q, k, v, mask, scale):
    """transformers' eager attention on packed rows; a row with no visible position → zeros"""
    scores = (q @ k.transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v


@pytest.mark.parametrize(
    ("b", "h", "r", "length", "d"),
    [
        (1, 3, 3, 200, 64),
        (2, 2, 6, 37, 40),
        (1, 1, 1, 1, 8),
        (1, 3, 5, 700, 128),
        (2, 1, 4, 9, 17),
        (1, 3, 17, 40, 64),  # past the loops' 16 rows: MKL's bmm
        (2, 2, 96, 70, 24),
    ],
)
def test_gqa_attention_matches_the_reference(b, h, r, length, d):
    """Packed grouped-query attention (kernels/cpu/attention.cpp) on cache slices read in place:
    strided key/value rows, masks shared or per batch row, rows with no visible position, split
    keys (long caches), head dims off the vector width, query rows past one block of four, and
    prompts (more than 16 rows a head: the bmm path)."""
    g = torch.Generator().manual_seed(length)
    q = torch.randn(b, h, r, d, generator=g)
    cache_k, cache_v = (torch.randn(b, h, length + 5, d, generator=g) for _ in range(2))
    k, v = cache_k[:, :, :length], cache_v[:, :, :length]  # the first positions, not contiguous
    for rows in (1, b):
        mask = torch.rand(rows, 1, r, length, generator=g) > 0.4
        mask[..., 0] = True
        if r > 1:
            mask[-1, 0, 1] = False  # nothing visible: zeros, not NaN
            mask[0, 0, 0, : length // 2] = False  # a split with nothing visible for one row
        got = fxq.native_gqa_attention(q, k, v, mask, d**-0.5)
        want = _attention_reference(q, k, v, mask, d**-0.5)
        assert got.shape == (b, h, r, d) and got.is_contiguous()
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize(
    ("b", "r", "rows"), [(1, 3, 1), (2, 6, 2), (2, 96, 32), (1, 51, 17), (1, 192, 64)]
)
def test_gqa_attention_repeats_a_mask_of_fewer_rows(b, r, rows):
    """A mask of T rows for G x T packed query rows (the model's one causal mask, handed to
    every layer as it is): row i reads mask row i % T, the same result as the mask repeated
    G times, at decode (the loops) and for a prompt (flash attention; 192 rows x 120
    positions: its additive mask built by both threads), masks per batch row."""
    g = torch.Generator().manual_seed(r)
    length, d = 120, 32
    q = torch.randn(b, 2, r, d, generator=g)
    k, v = (torch.randn(b, 2, length, d, generator=g) for _ in range(2))
    mask = torch.rand(b, 1, rows, length, generator=g) > 0.5
    mask[..., 0] = True
    mask[-1, 0, -1] = False  # a row with nothing visible, in every repeat
    repeated = mask.repeat(1, 1, r // rows, 1)
    got = fxq.native_gqa_attention(q, k, v, mask, d**-0.5)
    torch.testing.assert_close(got, fxq.native_gqa_attention(q, k, v, repeated, d**-0.5))
    torch.testing.assert_close(
        got, _attention_reference(q, k, v, repeated, d**-0.5), atol=2e-6, rtol=1e-5
    )
    from fxquant.core import ops

    torch.testing.assert_close(ops.gqa_attention_reference(q, k, v, mask, d**-0.5), got)


@pytest.mark.parametrize(("r", "b"), [(3, 1), (6, 2), (24, 2)])
def test_gqa_attention_reads_only_the_positions_a_row_attends_to(r, b):
    """Hugging Face's static cache hands attention the whole cache, masked past the positions
    written so far: the kernel stops at the last position any row attends to (decode loops and
    the prompt's bmm alike), so what lies past it is never read: NaN there changes nothing."""
    g = torch.Generator().manual_seed(r)
    length, d = 300, 64
    q = torch.randn(b, 3, r, d, generator=g)
    k, v = (torch.randn(b, 3, length, d, generator=g) for _ in range(2))
    visible = [41, 97][:b]  # per batch row: a static cache's causal mask, then its tail
    mask = torch.zeros(b, 1, r, length, dtype=torch.bool)
    for i, n in enumerate(visible):
        for row in range(r):
            mask[i, 0, row, : n - (row % 4)] = True
    want = _attention_reference(q, k, v, mask, d**-0.5)
    k[:, :, max(visible) :], v[:, :, max(visible) :] = float("nan"), float("nan")
    got = fxq.native_gqa_attention(q, k, v, mask, d**-0.5)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("r", "d"), [(3, 64), (6, 20), (24, 64)])
def test_gqa_attention_of_a_half_precision_cache_is_fp32_math_on_its_values(dtype, r, d):
    """A bf16 / fp16 cache (a model in its checkpoint's dtype) is widened as it is read: the
    result is the fp32 attention of the same values, in fp32, at decode (the loops, split
    keys: 300 positions on two threads) and for a prompt (24 rows: flash attention; a bf16
    prompt on AMX runs in bf16: the next test); head dims off the conversion's 8 lanes; NaN past
    the visible positions is never read."""
    if dtype == torch.bfloat16 and r > 16 and _bf16_prompts():
        pytest.skip("a bf16 prompt on AMX runs ATen's bf16 flash attention (tested below)")
    g = torch.Generator().manual_seed(r + d)
    b, length, visible = 2, 300, 211
    q = torch.randn(b, 3, r, d, generator=g).to(dtype)
    cache = torch.randn(2, b, 3, length + 4, d, generator=g).to(dtype)
    k, v = cache[0, :, :, :length], cache[1, :, :, :length]  # strided slices of the cache
    mask = torch.rand(1, 1, r, length, generator=g) > 0.3
    mask[..., 0], mask[..., visible:] = True, False
    want = _attention_reference(q.float(), k.float(), v.float(), mask, d**-0.5)
    k[:, :, visible:], v[:, :, visible:] = float("nan"), float("nan")
    got = fxq.native_gqa_attention(q, k, v, mask, d**-0.5)
    assert got.dtype == torch.float32 and got.shape == (b, 3, r, d)
    torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)


def _bf16_prompts() -> bool:
    """Whether the kernel runs a bf16 prompt in bf16 (attention.cpp's prompt_in_bf16: a CPU with
    AMX tiles, which the native build then has)."""
    return torch.cpu._is_amx_tile_supported()


@pytest.mark.parametrize(("b", "t", "d"), [(2, 8, 64), (1, 40, 20)])
def test_a_bf16_prompt_runs_in_bf16_on_amx_and_in_fp32_elsewhere(b, t, d):
    """A bf16 prompt (more than 16 packed rows a head) on a CPU with AMX tiles: ATen's bf16 flash
    attention on q and the cache as they lie, bit for bit, within bf16 rounding of the fp32
    math (its probabilities are rounded to bf16 for the product with v, as transformers' sdpa
    on a bf16 model does); elsewhere the fp32 math on the widened values. Strided cache
    slices, masks per batch row, a row with nothing visible (zeros), NaN past the visible
    positions never read."""
    g = torch.Generator().manual_seed(t + d)
    h, groups, length, visible = 3, 3, 90, 61
    q = torch.randn(b, h, groups * t, d, generator=g).bfloat16()
    cache = torch.randn(2, b, h, length + 4, d, generator=g).bfloat16()
    k, v = cache[0, :, :, :length], cache[1, :, :, :length]
    mask = torch.rand(b, 1, t, length, generator=g) > 0.3
    mask[..., 0], mask[..., visible:] = True, False
    mask[-1, 0, -1] = False  # a row with nothing visible, in every group
    repeated = mask.repeat(1, 1, groups, 1)
    want = _attention_reference(q.float(), k.float(), v.float(), repeated, d**-0.5)
    k[:, :, visible:], v[:, :, visible:] = float("nan"), float("nan")
    got = fxq.native_gqa_attention(q, k, v, mask, d**-0.5)
    assert got.dtype == torch.float32 and got.shape == (b, h, groups * t, d)
    if not _bf16_prompts():
        torch.testing.assert_close(got, want, atol=2e-6, rtol=1e-5)
        return
    flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
    additive = torch.zeros(repeated.shape).masked_fill(~repeated, float("-inf"))
    aten = torch.cat([
        flash(q[i : i + 1], k[i : i + 1, :, :visible], v[i : i + 1, :, :visible], 0.0, False,
              attn_mask=additive[i : i + 1, :, :, :visible], scale=d**-0.5)[0]
        for i in range(b)
    ]).float()  # fmt: skip
    torch.testing.assert_close(got, aten, atol=0, rtol=0)
    seen = repeated.any(-1, keepdim=True)
    assert (got[~seen.expand_as(got)] == 0).all()  # a row with nothing visible: zeros, not NaN
    torch.testing.assert_close(got, want, atol=2e-2, rtol=2e-2)
    assert (got - want).norm() / want.norm() < 1e-2


def test_gqa_attention_without_the_library_is_the_same_math():
    """The op's kernel before the library registers its CPU one (a saved program run where
    fxquant has not loaded it), and off CPU."""
    from fxquant.core import ops

    g = torch.Generator().manual_seed(1)
    q, k, v = (torch.randn(1, 2, 3, 16, generator=g), *torch.randn(2, 1, 2, 9, 16, generator=g))
    mask = torch.rand(1, 1, 3, 9, generator=g) > 0.5
    mask[0, 0, 0] = False
    got = ops.gqa_attention_reference(q, k, v, mask, 0.25)
    torch.testing.assert_close(got, _attention_reference(q, k, v, mask, 0.25))
    assert not got[0, :, 0].any()  # nothing visible: zeros, as the kernel
    torch.testing.assert_close(fxq.native_gqa_attention(q, k, v, mask, 0.25), got)


def test_gqa_attention_refuses_inputs_outside_its_contract():
    q, k = torch.randn(1, 2, 3, 16), torch.randn(1, 2, 10, 16)
    mask = torch.ones(1, 1, 3, 10, dtype=torch.bool)
    bad = [
        (q, k, k, mask.float()),  # an additive mask: the loops in fxquant.llm take those
        (q.double(), k.double(), k.double(), mask),
        (q.bfloat16(), k, k, mask),  # one dtype for all three
        (q, k.half(), k.half(), mask),
        (q, k, k[:, :, :9], mask),
        (q, k, k, mask[..., :9]),
        (q, k, k, mask[:, :, :2]),  # mask rows that do not divide the query's
    ]
    for args in bad:
        with pytest.raises(RuntimeError, match="native_gqa_attention"):
            fxq.native_gqa_attention(*args, 0.25)


def test_gqa_attention_reads_inputs_in_any_layout():
    """Inductor may hand the op (flexible_layout) a query that is not packed, key rows or mask
    rows that are not contiguous: the kernel copies what it cannot read as it lies."""
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 2, 6, 16, generator=g)
    k, v = torch.randn(2, 1, 2, 10, 16, generator=g)
    mask = torch.rand(1, 1, 6, 10, generator=g) > 0.4
    mask[..., 0] = True
    want = fxq.native_gqa_attention(q, k, v, mask, 0.25)
    odd = (
        q.transpose(2, 3).contiguous().transpose(2, 3),  # q not packed
        k.transpose(2, 3).contiguous().transpose(2, 3),  # key rows not contiguous
        v.transpose(2, 3).contiguous().transpose(2, 3),
        mask.transpose(2, 3).contiguous().transpose(2, 3),  # mask rows not contiguous
    )
    for i in range(4):
        args = [q, k, v, mask]
        args[i] = odd[i]
        torch.testing.assert_close(fxq.native_gqa_attention(*args, 0.25), want)
    prompt = torch.randn(1, 2, 40, 16, generator=g)  # the flash-attention path too
    pmask = torch.ones(1, 1, 40, 10, dtype=torch.bool)
    torch.testing.assert_close(
        fxq.native_gqa_attention(prompt, odd[1], odd[2], pmask, 0.25),
        fxq.native_gqa_attention(prompt, k, v, pmask, 0.25),
    )


def test_a_mask_every_layer_shares_is_computed_once_under_inductor():
    """Three calls that share one mask computed in the graph (as the 30 layers of an exported
    LLM share the model's causal mask): Inductor builds it once, not once per call (the op's
    flexible_layout tag; the exact-strides default copied it for each)."""
    from torch._inductor import config
    from torch._inductor.utils import run_and_get_code

    def f(q, k, v, pos):
        mask = (torch.arange(64)[None, :] <= pos[:, None])[None, None]
        return sum(fxq.native_gqa_attention(q * (i + 1), k, v, mask, 0.125) for i in range(3))

    g = torch.Generator().manual_seed(4)
    q = torch.randn(1, 2, 60, 32, generator=g)
    k, v = torch.randn(2, 1, 2, 64, 32, generator=g)
    pos = torch.arange(20)
    with config.patch(fx_graph_cache=False):
        got, (code, *_) = run_and_get_code(torch.compile(f, fullgraph=True), q, k, v, pos)
    torch.testing.assert_close(got, f(q, k, v, pos))
    assert code.count("torch.bool)") == 1, code


def test_opcheck():
    g = torch.Generator().manual_seed(0)
    w, x = torch.randn(20, 64, generator=g), torch.randn(3, 64, generator=g)
    q, s = ref.quantize_int8_per_channel(w)
    xq, xs = ref.quantize_int8_per_token(x)
    f8, fs = ref.quantize_fp8_per_channel(w)
    p, s4, z4 = ref.quantize_int4_grouped(w, group_size=32, symmetric=False)
    cases = [
        (fxq.native_int8_weight_only_linear, (x, q, s)),
        (fxq.native_int8_scaled_linear, (xq, xs.reshape(-1), q, s)),
        (fxq.native_float8_weight_only_linear, (x, f8, fs)),
        (
            fxq.native_int4_weight_only_linear,
            (x, *native.prepack_int4(p, s4, z4, group_size=32), 32),
        ),
    ]
    kw, ks, ko = native.prepack_int4(p, s4, z4, group_size=32)
    vnni = native.prepack_int8_vnni(q)
    cases.append((fxq.native_int8_int4_linear, (xq, xs.reshape(-1), kw, ks, ko, 32)))
    cases.append((fxq.native_int4_to_bfloat16, (kw, ks, ko, 32)))
    cases.append((fxq.native_int8_scaled_vnni_linear, (xq, xs.reshape(-1), *vnni, s)))
    cases.append((fxq.native_int8_dynamic_vnni_linear, (x, *vnni, s)))
    cases.append((fxq.native_int8_dynamic_int4_linear, (x, kw, ks, ko, 32)))
    cases.append((fxq.native_int8_dynamic_linear, (x, q, s)))
    cases.append((fxq.native_float8_dynamic_linear, (x, f8, fs, 2.0)))
    cases.append((fxq.native_float8_dynamic_bf16dot_linear, (x, f8, fs, float("inf"))))
    cases.append((fxq.native_float8_to_bfloat16, (f8,)))
    b8, bs = ref.quantize_fp8_blocks(w, block_size=32)
    cases.append((fxq.native_float8_block_linear, (x, b8, bs, 32)))
    xg, xgs = ref.quantize_fp8_groups(x, group_size=32)
    cases.append((fxq.native_float8_block_scaled_linear, (xg.float(), xgs, b8, bs, 32)))
    cases.append((fxq.native_int8_bf16dot_linear, (x, q, s)))
    cases.append((fxq.native_float8_bf16dot_linear, (x, f8, fs)))
    cases.append((fxq.native_int4_bf16dot_linear, (x, kw, ks, ko, 32)))
    mask = torch.rand(1, 1, 3, 12, generator=g) > 0.3
    kv = torch.randn(2, 2, 14, 32, generator=g)[:, :, :12]
    cases.append((fxq.native_gqa_attention, (torch.randn(2, 2, 3, 32), kv, kv, mask, 0.2)))
    prompt = torch.rand(1, 1, 20, 12, generator=g) > 0.3  # 20 rows a head: the bmm path
    cases.append((fxq.native_gqa_attention, (torch.randn(2, 2, 20, 32), kv, kv, prompt, 0.2)))
    for half in (torch.bfloat16, torch.float16):
        args = (torch.randn(2, 2, 3, 32).to(half), kv.to(half), kv.to(half), mask, 0.2)
        cases.append((fxq.native_gqa_attention, args))
    x3 = torch.randn(2, 3, 64, generator=g)
    cases.append((fxq.cpu_native_int4_linear, (x3, kw, ks, ko, torch.randn(20), 32, 20)))
    cases.append((fxq.cpu_native_int8_int4_linear, (x3, kw, ks, ko, torch.randn(20), 32, 20)))
    cases.append((fxq.cpu_native_int8_dynamic_vnni_linear, (x3, *vnni, s, torch.randn(20))))
    xq3, xs3 = ref.quantize_int8_per_token(x3)
    args = (xq3, xs3, *vnni, s, None, torch.bfloat16)
    cases.append((fxq.cpu_native_int8_scaled_vnni_linear, args))
    # SchemaCheckMode compares tensors with allclose, which has no CPU float8 kernel: the fp8 op
    # runs every other opcheck test (as in tests/test_ops.py)
    no_schema = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")
    for op, args in cases:
        fp8 = any(a.dtype == torch.float8_e4m3fn for a in args if isinstance(a, torch.Tensor))
        torch.library.opcheck(op, args, test_utils=no_schema if fp8 else DEFAULT_UTILS)


def test_backward_through_a_native_kernel_raises_and_a_compiled_program_still_runs():
    # the kernels are inference-only: backward says so (torch's fallback warned and left the
    # input without a gradient), while a program compiled under grad mode, whose backward
    # AOTAutograd traces, compiles and runs forward
    from fxquant.passes.lower import lower

    g = torch.Generator().manual_seed(0)
    w = torch.randn(20, 64, generator=g)
    q, s = ref.quantize_int8_per_channel(w)
    x = torch.randn(3, 64, generator=g, requires_grad=True)
    y = fxq.native_int8_weight_only_linear(x, q, s)
    with pytest.raises(RuntimeError, match=r"native_int8_weight_only_linear is an inference"):
        y.sum().backward()
    assert x.grad is None
    with torch.no_grad():
        assert not fxq.native_int8_weight_only_linear(x, q, s).requires_grad

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.RMSNorm(64), torch.nn.Linear(64, 32)).eval()
    x = torch.randn(4, 64)
    qep = fxquant.quantize(model, "int8wo", example_inputs=(x,))
    out = torch.compile(lower(qep).module())(x)  # the RMSNorm weight requires grad
    assert out.requires_grad and torch.allclose(out, qep.module()(x), rtol=1e-2, atol=1e-2)
    with pytest.raises(RuntimeError, match="is an inference kernel"):
        out.sum().backward()


@pytest.mark.slow
def test_aoti_package_calls_the_shims_without_fxquant(tmp_path, monkeypatch):
    """A program with every native op (int8, w8a8, fp8, int4, W4A8, fp32), packaged by
    fxquant.aot_compile, then run in a fresh process where importing fxquant would fail. The
    native kernels at every M (the large-M candidates of the dispatch table are
    tests/test_cpu_dispatch.py's)."""
    import fxquant

    monkeypatch.setenv("FXQUANT_CPU_DISPATCH", "native")

    class Four(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = torch.nn.Linear(64, 48), torch.nn.Linear(48, 40)
            self.c, self.d = torch.nn.Linear(40, 64, bias=False), torch.nn.Linear(64, 33)
            self.e = torch.nn.Linear(33, 20)  # left in fp32: the native fp32 kernel

        def forward(self, x):
            x = self.c(torch.relu(self.b(torch.relu(self.a(x)))))
            return self.e(torch.relu(self.d(torch.relu(x))))

    torch.manual_seed(0)
    model = Four().eval()
    cfg = fxquant.QuantConfig(
        scheme=fxquant.Int8WeightOnly(),
        overrides={
            "b": fxquant.Int8DynamicActivation(),
            "c": fxquant.Float8Dynamic(granularity="row"),
            "d": fxquant.Int4WeightOnly(group_size=32),
            "a": fxquant.Int8DynamicActivationInt4(group_size=32),
        },
        modules_to_not_convert=("e",),
    )
    x = torch.randn(5, 64)
    qep = fxquant.quantize(
        model, cfg, example_inputs=(x,), dynamic_shapes=({0: torch.export.Dim.DYNAMIC},)
    )
    pkg_path = tmp_path / "four.pt2"
    fxquant.aot_compile(qep, pkg_path)
    inputs = [torch.randn(m, 64) for m in (1, 5, 40)]
    torch.save([(i, qep.module()(i)) for i in inputs], tmp_path / "io.pt")
    script = textwrap.dedent(
        f"""
        import sys, torch
        class NoFxquant:
            def find_spec(self, name, path=None, target=None):
                if name == "fxquant" or name.startswith("fxquant."):
                    raise ImportError("fxquant must not be imported here")
        sys.meta_path.insert(0, NoFxquant())
        pkg = torch._inductor.aoti_load_package({str(pkg_path)!r})
        for x, want in torch.load({str(tmp_path / "io.pt")!r}):
            got = pkg(x)
            err = float((got - want).abs().max() / want.abs().max())
            assert got.shape == want.shape and err < 1e-5, err
        print("ok")
        """
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]


# The kernels' code for the CPU classes below this machine's compiles only where -march=native
# lacks their features: on an AVX-512 machine a change could break the AVX2 paths (a compile
# error, or sums that only the AVX-512 paths get right) unseen until a session or a user lands on
# an AVX2 CPU. Each lower class's build (FXQUANT_NATIVE_MARCH, a library of its own in the cache)
# runs this file's arithmetic checks in a child, on a CPU that has its instructions; left out
# there: the tests of packaging, autograd, opcheck and Inductor, whose subject is not the
# kernels' arithmetic. Per -march: what it builds, and the /proc/cpuinfo flags it needs; of
# those, the ones the kernels branch on (native.h) say which paths its build has.
KERNEL_FEATURES = ("avx512bw", "avx512_vnni", "avx512vbmi", "avx512_bf16")
AVX512 = {"avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512cd"}
LOWER_CLASSES = {
    "x86-64-v3": ("AVX2 and FMA (the avx2 class)", {"avx2", "fma"}),
    "x86-64-v4": ("AVX-512 without VNNI, VBMI or BF16 (the avx512 class: Skylake-SP)", AVX512),
    "icelake-server": (
        "AVX-512 VNNI and VBMI without BF16 (Ice Lake)",
        AVX512
        | {"avx512_vnni", "avx512vbmi", "avx512_vbmi2", "avx512_bitalg", "avx512_vpopcntdq"}
        | {"avx512ifma", "gfni", "vaes", "vpclmulqdq"},
    ),
    "cooperlake": (
        "AVX-512 VNNI and BF16 without VBMI (Cooper Lake)",
        AVX512 | {"avx512_vnni", "avx512_bf16"},
    ),
}
NOT_ARITHMETIC = (
    "aoti_package",
    "backward_through",
    "opcheck",
    "mask_every_layer",
    "e4m3_values_round",
    "built_for_a_lower_cpu_class",
)


@pytest.mark.slow  # per -march: a build of the library (~8 s on 2 cores), ~250 checks
@pytest.mark.parametrize("march", list(LOWER_CLASSES))
def test_the_kernels_built_for_a_lower_cpu_class_pass_these_checks(march):
    if "FXQUANT_NATIVE_MARCH" in os.environ:
        pytest.skip("a build for another -march already")
    what, needs = LOWER_CLASSES[march]
    flags = set(native.cpu_signature().split())
    if not needs <= flags:
        pytest.skip(f"this CPU cannot run {march} code: no {sorted(needs - flags)}")
    paths = [f for f in KERNEL_FEATURES if f in needs]
    if paths == [f for f in KERNEL_FEATURES if f in flags] and "amx_tile" not in flags:
        pytest.skip(f"this CPU's own build has the kernel paths of {march}'s")
    env = {**os.environ, "FXQUANT_NATIVE_MARCH": march}
    out = subprocess.run(
        [sys.executable, "-m", "pytest", __file__, "-q", "-n", "0", "-p", "no:cacheprovider",
         "-k", " and ".join(f"not {name}" for name in NOT_ARITHMETIC)],
        capture_output=True, text=True, env=env, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert out.returncode == 0, f"{march}, {what}:\n{out.stdout[-4000:]}"
    assert " passed" in out.stdout and " failed" not in out.stdout
