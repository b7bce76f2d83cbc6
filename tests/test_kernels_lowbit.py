"""Low-bit Triton kernels (kernels/intx_weight_only.py, kernels/bitnet.py) against
``fxquant.core.reference_lowbit``, on CPU tensors under TRITON_INTERPRET=1.

Awkward shapes: M = 1, 5 (decode), 17, 33 (prefill), N not a multiple of the tile, K = 100 (not
a group multiple: the padded int-zero case) and 70. The int-zero and float-zero storages, all
four packings, bias or not, bf16 / fp16 / fp32 activations. Outputs are compared with the
dtype's tolerance (the kernels sum K in another order); BitNet's activation quantizer must be
bit for bit the reference's.
"""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from fxquant.core import reference_lowbit as ref  # noqa: E402
from fxquant.kernels import bitnet  # noqa: E402
from fxquant.kernels import intx_weight_only as intx  # noqa: E402

pytestmark = pytest.mark.interpreter

fxq = torch.ops.fxquant
TOL = {  # rtol, atol as a fraction of the output's largest magnitude
    torch.bfloat16: (1.6e-2, 1e-3),
    torch.float16: (2e-3, 1e-4),
    torch.float32: (1e-5, 1e-6),
}


def _close(got, want, shape):
    assert got.shape == shape and got.dtype == want.dtype and torch.isfinite(got).all()
    rtol, atol = TOL[got.dtype]
    torch.testing.assert_close(got, want, rtol=rtol, atol=atol * want.abs().max().item())


def _inputs(x_shape, n, k_weight, dtype, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(x_shape, generator=g).to(dtype)
    w = torch.randn(n, k_weight, generator=g)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def _one_config(bm, bn, bk, **extra):
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, **extra}, num_warps=4)]


# --------------------------------------------------------------------------------------------
# int2 / int3 / float-zero int4
# --------------------------------------------------------------------------------------------

INTX_CASES = [  # x shape, N, scheme kwargs, dtype, bias
    ((1, 100), 37, {"bits": 2, "group_size": 32}, torch.bfloat16, True),
    ((5, 100), 37, {"bits": 3, "group_size": 64, "symmetric": True}, torch.float32, False),
    ((17, 96), 40, {"bits": 3, "group_size": 32, "zero_point": "float"}, torch.float32, True),
    ((33, 64), 37, {"bits": 2, "group_size": 64, "zero_point": "float"}, torch.float16, False),
    ((2, 3, 128), 16, {"bits": 4, "group_size": 128, "zero_point": "float"}, torch.bfloat16, True),
    # 6 bits (GGUF Q6_K's grid): 16-wide K steps, K = 100 padded to 112; a prefill float-zero
    ((5, 100), 37, {"bits": 6, "group_size": 16}, torch.bfloat16, True),
    ((17, 64), 24, {"bits": 6, "group_size": 32, "zero_point": "float"}, torch.float32, False),
]


@pytest.mark.parametrize(("x_shape", "n", "kwargs", "dtype", "bias"), INTX_CASES)
def test_intx_matches_reference(x_shape, n, kwargs, dtype, bias):
    x, w, b = _inputs(x_shape, n, x_shape[-1], dtype, bias)
    p, s, z = ref.quantize_intx_grouped(w, **kwargs)
    bits, g = kwargs["bits"], kwargs["group_size"]
    want = ref.intx_weight_only_linear(x, p, s, z, b, bits=bits, group_size=g)
    _close(fxq.triton_intx_weight_only_linear(x, p, s, z, b, bits, g), want, want.shape)


def test_intx_split_k_and_k_steps_inside_groups(monkeypatch):
    # BLOCK_K 64 over groups of 32: each K step shrinks to one group; SPLIT_K 2 splits them
    monkeypatch.setattr(intx._decode_kernel, "configs", _one_config(16, 32, 64, SPLIT_K=2))
    x, w, b = _inputs((3, 96), 37, 96, torch.float32, True)
    p, s, z = ref.quantize_intx_grouped(w, bits=3, group_size=32, zero_point="float")
    want = ref.intx_weight_only_linear(x, p, s, z, b, bits=3, group_size=32)
    _close(intx.intx_linear(x, p, s, z, b, bits=3, group_size=32, decode=True), want, (3, 37))


def test_intx_6_bit_signed_and_zero_scales():
    # GGUF Q6_K's scales d·sc are signed int8 multiples: negative and zero scales must pass
    # through the s · (x·u - z · Σx) epilogue as they are
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 64, generator=g)
    u = torch.randint(0, 64, (20, 64), generator=g, dtype=torch.uint8)
    s = torch.randint(-128, 128, (20, 4), generator=g).float() * 1e-3
    s[:, 1] = 0.0
    z = torch.full((20, 4), 32, dtype=torch.uint8)
    p = ref.pack_intx(u, 6)
    want = ref.intx_weight_only_linear(x, p, s, z, None, bits=6, group_size=16)
    _close(intx.intx_linear(x, p, s, z, None, bits=6, group_size=16), want, (3, 20))


def test_intx_launcher_errors():
    x, w, _ = _inputs((2, 64), 8, 64, torch.float32, False)
    p, s, z = ref.quantize_intx_grouped(w, bits=3, group_size=32)
    with pytest.raises(ValueError, match="bits=5"):
        intx.intx_linear(x, p, s, z, None, bits=5, group_size=32)
    with pytest.raises(ValueError, match="scale, zero"):
        intx.intx_linear(x, p, s, z, None, bits=2, group_size=32)
    with pytest.raises(ValueError, match="zero uint8 or fp32"):
        intx.intx_linear(x, p, s, z.half(), None, bits=3, group_size=32)
    with pytest.raises(ValueError, match="holds Kp=64"):
        intx.intx_linear(torch.randn(2, 65), p, s, z, None, bits=3, group_size=32)


# --------------------------------------------------------------------------------------------
# BitNet
# --------------------------------------------------------------------------------------------

BITNET_CASES = [  # x shape, N, dtype, bias
    ((1, 100), 36, torch.bfloat16, True),
    ((5, 70), 40, torch.float32, False),
    ((17, 64), 48, torch.float16, True),
    ((2, 17, 50), 8, torch.float32, True),
]


@pytest.mark.parametrize(("x_shape", "n", "dtype", "bias"), BITNET_CASES)
def test_bitnet_matches_reference(x_shape, n, dtype, bias):
    x, w, b = _inputs(x_shape, n, x_shape[-1], dtype, bias)
    p, ws = ref.quantize_bitnet_weight(w)
    want = ref.bitnet_linear(x, p, ws, b)
    _close(fxq.triton_bitnet_linear(x, p, ws, b), want, want.shape)


def test_bitnet_activation_quantizer_is_bit_exact():
    x = torch.randn(64, 70, generator=torch.Generator().manual_seed(3)) * 3
    x[0] = 0  # an all-zero token: eps, not NaN
    q, inv = bitnet.quantize_activation(x)
    rq, rinv = ref.quantize_bitnet_activation(x)
    assert torch.equal(q, rq) and torch.equal(inv, rinv)


def test_bitnet_split_k_and_zeros(monkeypatch):
    monkeypatch.setattr(bitnet._decode_kernel, "configs", _one_config(16, 32, 32, SPLIT_K=2))
    x, w, b = _inputs((3, 70), 12, 70, torch.float32, True)
    p, ws = ref.quantize_bitnet_weight(w)
    _close(bitnet.bitnet_linear(x, p, ws, b, decode=True), ref.bitnet_linear(x, p, ws, b), (3, 12))
    zp, zws = ref.quantize_bitnet_weight(torch.zeros(12, 70))
    y = bitnet.bitnet_linear(torch.zeros(3, 70), zp, zws, None)
    assert torch.equal(y, torch.zeros(3, 12))


def test_bitnet_launcher_errors():
    p, ws = ref.quantize_bitnet_weight(torch.randn(8, 64))
    with pytest.raises(ValueError, match="uint8 \\[N/4, K=65\\]"):
        bitnet.bitnet_linear(torch.randn(2, 65), p, ws, None)
    with pytest.raises(ValueError, match="weight_scale must be fp32"):
        bitnet.bitnet_linear(torch.randn(2, 64), p, ws.double(), None)


@pytest.mark.parametrize(("m", "dtype"), [(1, torch.float32), (17, torch.bfloat16)])
def test_sinq_lowering_is_the_intx_kernel_on_scaled_x(m, dtype):
    # kernels/sinq_weight_only.py: x ⊙ col_scale in x's dtype (one rounding of the activation,
    # as the kernel's own bf16 operand has), then the intx kernel on SINQ's codes
    from fxquant import SinqWeightOnly
    from fxquant.kernels.sinq_weight_only import lower_sinq_weight_only_linear

    x, w, b = _inputs((m, 128), 64, 128, dtype, True)
    t = SinqWeightOnly(bits=4, group_size=64).quantize(w).tensors
    p, s, z, col = t["qweight"], t["scale"], t["zero"], t["col_scale"]
    want = ref.intx_weight_only_linear(x * col.to(dtype), p, s, z, b, bits=4, group_size=64)
    _close(lower_sinq_weight_only_linear(x, p, s, z, col, b, 4, 64), want, want.shape)
    if dtype == torch.float32:  # and the op's own reference, up to fp32 summation order
        want = ref.sinq_weight_only_linear(x, p, s, z, col, b, bits=4, group_size=64)
        _close(lower_sinq_weight_only_linear(x, p, s, z, col, b, 4, 64), want, want.shape)
