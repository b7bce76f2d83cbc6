"""Reference math: SQNR floors on Gaussian weights, layouts, padding, and no NaN on zeros."""

from __future__ import annotations

import pytest
import torch

from fxquant.core import reference as ref


@pytest.fixture
def w():
    torch.manual_seed(0)
    return torch.randn(256, 512)


def test_int8_per_channel(w):
    q, s = ref.quantize_int8_per_channel(w)
    assert q.dtype == torch.int8 and s.shape == (256,)
    assert ref.sqnr(w, ref.dequantize_int8_per_channel(q, s)) >= 38


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize(("group_size", "floor"), [(32, 20), (64, 19), (128, 18), (256, 17)])
def test_int4_grouped(w, group_size, floor, symmetric):
    packed, s, z = ref.quantize_int4_grouped(w, group_size=group_size, symmetric=symmetric)
    assert packed.dtype == torch.uint8 and packed.shape == (256, 256)
    assert s.shape == z.shape == (256, 512 // group_size)
    dq = ref.dequantize_int4_grouped(packed, s, z, group_size=group_size)
    assert ref.sqnr(w, dq) >= floor
    if symmetric:
        assert (z == 8).all()


def test_int4_pack_round_trip():
    u = torch.randint(0, 16, (7, 10), dtype=torch.uint8)
    assert torch.equal(ref.unpack_int4(ref.pack_int4(u)), u)


def test_int4_padding_keeps_values_exact():
    torch.manual_seed(1)
    w = torch.randn(5, 70)  # K = 70 pads to 128 with g=64
    packed, s, z = ref.quantize_int4_grouped(w, group_size=64, symmetric=False)
    dq = ref.dequantize_int4_grouped(packed, s, z, group_size=64)
    assert dq.shape == (5, 128)
    assert (dq[:, 70:] == 0).all()
    x = torch.randn(3, 70)
    y = ref.int4_weight_only_linear(x, packed, s, z, None, group_size=64)
    torch.testing.assert_close(y, x @ dq[:, :70].t())


def test_fp8_per_channel_and_tensor(w):
    q, s = ref.quantize_fp8_per_channel(w)
    assert q.dtype == torch.float8_e4m3fn
    assert ref.sqnr(w, q.float() * s[:, None]) >= 28
    q, s = ref.quantize_fp8_per_tensor(w)
    assert s.shape == (1,) and ref.sqnr(w, q.float() * s) >= 28


def test_fp8_blocks_ragged_shapes():
    torch.manual_seed(0)
    w = torch.randn(200, 300)
    q, s = ref.quantize_fp8_blocks(w, block_size=128)
    assert q.shape == (200, 300) and s.shape == (2, 3)
    dq = q.float() * ref.expand_block_scale(s, rows=200, cols=300, block_size=128)
    assert ref.sqnr(w, dq) >= 28
    # the last, partial tile takes its scale from the elements it has
    torch.testing.assert_close(s[1, 2], w[128:, 256:].abs().amax() / 448)


def test_fp8_groups_and_scale_ub():
    torch.manual_seed(0)
    x = torch.randn(3, 4, 200)
    q, s = ref.quantize_fp8_groups(x, group_size=128)
    assert q.shape == x.shape and s.shape == (3, 4, 2)
    x[0, 0, 0] = 1e4  # an outlier token
    _, s = ref.quantize_fp8_per_token(x, scale_ub=1200.0)
    assert s.max() == pytest.approx(1200.0 / 448)


def test_all_zero_tensors_give_zeros_not_nan():
    z = torch.zeros(16, 256)
    x = torch.zeros(2, 256)
    for q, s in (
        ref.quantize_int8_per_channel(z),
        ref.quantize_fp8_per_channel(z),
        ref.quantize_fp8_per_tensor(z),
        ref.quantize_fp8_blocks(z, block_size=128),
    ):
        assert not torch.isnan(s).any() and (q.float() == 0).all()
    for sym in (False, True):
        p, s, zp = ref.quantize_int4_grouped(z, group_size=64, symmetric=sym)
        assert (ref.dequantize_int4_grouped(p, s, zp, group_size=64) == 0).all()
    q8, s8 = ref.quantize_int8_per_channel(torch.randn(16, 256))
    for y in (
        ref.int8_dynamic_linear(x, q8, s8),
        ref.float8_dynamic_linear(x, *ref.quantize_fp8_per_channel(z), per_row=True),
        ref.float8_dynamic_linear(x, *ref.quantize_fp8_per_tensor(z), per_row=False),
        ref.float8_block_linear(x, *ref.quantize_fp8_blocks(z, block_size=128), block_size=128),
    ):
        assert torch.isfinite(y).all() and (y == 0).all()


def test_sqnr():
    a = torch.randn(100)
    assert ref.sqnr(a, a) == float("inf")
    assert ref.sqnr(a, a * 1.1) == pytest.approx(20.0, abs=1e-4)
