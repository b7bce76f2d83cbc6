"""Weight-only GEMM kernels (kernels/int8_weight_only.py, float8_weight_only.py,
int4_weight_only.py) against ``fxquant.core.reference``, on CPU tensors under TRITON_INTERPRET=1.

The kernels sum K in another order than the reference and the interpreter's fp32 → bf16 store
truncates (the GPU rounds to nearest), so outputs are compared with the dtype's tolerance, never
bit for bit; an SQNR floor against the reference bounds the error as a whole. Every case runs on
the same input as the reference, so quantization error itself cancels out.

The launcher's path follows M: decode at M ≤ 16 (here with the interpreter's one decode config,
SPLIT_K = 1), prefill above. Split-K and the int4 K-step rule are forced with explicit configs,
the int4 dense path (a GPU's prefill) in tests/test_kernels_library_prefill.py.

One comparison is bit for bit: the int4 GEMM against the outputs its dedicated kernel gave
before int4 became the intx kernel at 4 bits (``tests/fixtures/int4_kernel_outputs.pt``).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.library import opcheck

triton = pytest.importorskip("triton")

from fxquant.core import reference as ref  # noqa: E402
from fxquant.kernels import configs  # noqa: E402
from fxquant.kernels import float8_weight_only as f8wo  # noqa: E402, F401  (registers the op)
from fxquant.kernels import int4_weight_only as i4wo  # noqa: E402, F401  (registers the op)
from fxquant.kernels import int8_weight_only as i8wo  # noqa: E402
from fxquant.kernels import intx_weight_only as intx  # noqa: E402  (int4's GEMM kernel)

pytestmark = pytest.mark.interpreter

fxq = torch.ops.fxquant
FP8 = torch.float8_e4m3fn
# (dtype, rtol, atol as a fraction of the output's largest magnitude, SQNR floor in dB)
TOL = {
    torch.bfloat16: (1.6e-2, 1e-3, 40.0),
    torch.float16: (2e-3, 1e-4, 55.0),
    torch.float32: (1e-5, 1e-6, 100.0),
}


def _check(y, expected, x_shape, n, *, tol=None):
    assert y.shape == (*x_shape[:-1], n) and y.dtype == expected.dtype
    assert torch.isfinite(y).all()
    rtol, atol, floor = tol or TOL[y.dtype]
    atol *= expected.abs().max().item()
    torch.testing.assert_close(y, expected, rtol=rtol, atol=atol)
    assert ref.sqnr(expected, y) >= floor


def _inputs(x_shape, n, dtype, *, bias, k_weight=None, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(x_shape, generator=g).to(dtype)
    w = torch.randn(n, k_weight or x_shape[-1], generator=g)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    return x, w, b


def _one_config(bm, bn, bk, **extra):
    return [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, **extra}, num_warps=4)]


# --------------------------------------------------------------------------------------------
# int8 and float8 weight-only (one kernel, two weight dtypes)
# --------------------------------------------------------------------------------------------

CHANNEL_SCHEMES = {  # op, weight quantizer, reference linear
    "int8": (
        fxq.triton_int8_weight_only_linear,
        ref.quantize_int8_per_channel,
        ref.int8_weight_only_linear,
    ),
    "float8": (
        fxq.triton_float8_weight_only_linear,
        ref.quantize_fp8_per_channel,
        ref.float8_weight_only_linear,
    ),
}
CHANNEL_CASES = [  # (x shape, N, dtype, bias): M = 1, 3, 16 decode; 17, 33 prefill
    ((1, 70), 37, torch.bfloat16, True),
    ((3, 64), 48, torch.float32, False),
    ((16, 70), 37, torch.float16, True),
    ((17, 64), 48, torch.bfloat16, False),
    ((33, 70), 37, torch.float32, True),
    ((2, 3, 70), 37, torch.bfloat16, True),
    ((2, 17, 64), 48, torch.bfloat16, True),
]


@pytest.mark.parametrize("scheme", CHANNEL_SCHEMES)
@pytest.mark.parametrize(("x_shape", "n", "dtype", "bias"), CHANNEL_CASES)
def test_channel_scaled_matches_reference(scheme, x_shape, n, dtype, bias):
    op, quantize, reference = CHANNEL_SCHEMES[scheme]
    x, w, b = _inputs(x_shape, n, dtype, bias=bias)
    q, s = quantize(w)
    _check(op(x, q, s, b), reference(x, q, s, b), x_shape, n)


@pytest.mark.parametrize("scheme", CHANNEL_SCHEMES)
@pytest.mark.parametrize("split_k", [2, 4])
def test_channel_scaled_split_k(scheme, split_k, monkeypatch):
    # K = 70 in 32-wide slices is 3 slices: SPLIT_K = 4 leaves one program without work, and
    # only the first slice may add the bias.
    config = _one_config(16, 32, 32, SPLIT_K=split_k)
    monkeypatch.setattr(i8wo._decode_kernel, "configs", config)
    op, quantize, reference = CHANNEL_SCHEMES[scheme]
    x, w, b = _inputs((5, 70), 37, torch.bfloat16, bias=True)
    q, s = quantize(w)
    _check(op(x, q, s, b), reference(x, q, s, b), x.shape, 37)


def test_decode_threshold():
    assert configs.is_decode(configs.DECODE_MAX_M)
    assert not configs.is_decode(configs.DECODE_MAX_M + 1)


# --------------------------------------------------------------------------------------------
# int4 grouped weight-only
# --------------------------------------------------------------------------------------------

INT4_CASES = [  # (x shape, N, group size, symmetric, dtype, bias); K = 100 is not a group multiple
    ((1, 100), 37, 32, True, torch.bfloat16, True),
    ((3, 100), 37, 64, False, torch.float32, False),
    ((16, 64), 48, 64, False, torch.float16, True),
    ((17, 100), 37, 32, False, torch.bfloat16, False),
    ((33, 100), 48, 64, True, torch.float32, True),
    ((5, 100), 37, 128, False, torch.bfloat16, True),
    ((1, 70), 16, 256, True, torch.float32, False),
    ((2, 3, 100), 37, 32, False, torch.bfloat16, True),
    ((2, 17, 100), 37, 64, True, torch.bfloat16, False),
]


def _int4(x_shape, n, group_size, symmetric, dtype, bias):
    x, w, b = _inputs(x_shape, n, dtype, bias=bias)
    p, s, z = ref.quantize_int4_grouped(w, group_size=group_size, symmetric=symmetric)
    expected = ref.int4_weight_only_linear(x, p, s, z, b, group_size=group_size)
    return (x, p, s, z, b, group_size), expected


@pytest.mark.parametrize(("x_shape", "n", "group_size", "symmetric", "dtype", "bias"), INT4_CASES)
def test_int4_matches_reference(x_shape, n, group_size, symmetric, dtype, bias):
    args, expected = _int4(x_shape, n, group_size, symmetric, dtype, bias)
    _check(fxq.triton_int4_weight_only_linear(*args), expected, x_shape, n)


@pytest.mark.parametrize(
    ("kernel", "config", "m", "group_size"),
    [
        # BLOCK_K 64 over groups of 32: the K step shrinks to one group.
        ("_prefill_kernel", _one_config(32, 32, 64), 17, 32),
        # K = 100 in steps of 64 (BLOCK_K 128 clipped to the group): two slices, one each.
        ("_decode_kernel", _one_config(16, 32, 128, SPLIT_K=2), 3, 64),
        # two 64-wide slices over four programs: two add nothing (and no bias).
        ("_decode_kernel", _one_config(16, 32, 64, SPLIT_K=4), 1, 64),
        # steps of 32 inside groups of 64: a group's scale serves two steps.
        ("_prefill_kernel", _one_config(32, 32, 32), 33, 64),
    ],
)
def test_int4_k_steps_and_split_k(kernel, config, m, group_size, monkeypatch):
    monkeypatch.setattr(getattr(intx, kernel), "configs", config)
    args, expected = _int4((m, 100), 37, group_size, False, torch.bfloat16, True)
    _check(fxq.triton_int4_weight_only_linear(*args), expected, (m, 100), 37)


@pytest.mark.parametrize(
    ("dtype", "group_size", "symmetric"),
    [
        (torch.float32, 32, False),
        (torch.bfloat16, 64, True),
    ],
)
def test_int4_dequantize(dtype, group_size, symmetric):
    w = torch.randn(37, 100, generator=torch.Generator().manual_seed(0))
    p, s, z = ref.quantize_int4_grouped(w, group_size=group_size, symmetric=symmetric)
    expected = ref.dequantize_int4_grouped(p, s, z, group_size=group_size)[:, :100].to(dtype)
    out = fxq.triton_int4_dequantize(p, s, z, group_size, 100, dtype)
    assert out.shape == (37, 100) and out.dtype == dtype
    # fp32: the same (u - z) * s as the reference, bit for bit; bf16: one ulp (the interpreter's
    # store truncates).
    rtol = 0 if dtype == torch.float32 else 2**-7
    torch.testing.assert_close(out, expected, rtol=rtol, atol=0)


# --------------------------------------------------------------------------------------------
# The int4 GEMM's outputs, bit for bit, as the dedicated int4 kernel computed them
# --------------------------------------------------------------------------------------------

# tests/fixtures/int4_kernel_outputs.pt holds what fxq.triton_int4_weight_only_linear (and the
# dequantizer) returned at commit 1313f41, when int4 had its own Triton kernel, interpreted on
# these inputs. int4 now runs the intx kernel at 4 bits; its outputs must not move by one bit.
# Inputs are rebuilt from their seeds (the fixture keeps their sums, to catch a drift there).
INT4_FIXTURE = Path(__file__).parent / "fixtures" / "int4_kernel_outputs.pt"
INT4_BITWISE_CASES = {  # name: (x shape, N, group size, symmetric, dtype, bias, forced path)
    "m1 g32 sym bf16 bias": ((1, 100), 37, 32, True, torch.bfloat16, True, None),
    "m3 g64 asym fp32": ((3, 100), 37, 64, False, torch.float32, False, None),
    "m16 g64 asym fp16 bias": ((16, 64), 48, 64, False, torch.float16, True, None),
    "m17 g32 asym bf16": ((17, 100), 37, 32, False, torch.bfloat16, False, None),
    "m33 g64 sym fp32 bias": ((33, 100), 48, 64, True, torch.float32, True, None),
    "m5 g128 asym bf16 bias": ((5, 100), 37, 128, False, torch.bfloat16, True, None),
    "m1 g256 sym fp32": ((1, 70), 16, 256, True, torch.float32, False, None),
    "2x3 g32 asym bf16 bias": ((2, 3, 100), 37, 32, False, torch.bfloat16, True, None),
    "2x17 g64 sym bf16": ((2, 17, 100), 37, 64, True, torch.bfloat16, False, None),
    "m40 g128 asym fp16 bias": ((40, 300), 70, 128, False, torch.float16, True, None),
    "prefill BLOCK_K 64 over g32": (
        (17, 100), 37, 32, False, torch.bfloat16, True, ("prefill", (32, 32, 64), 1),
    ),
    "decode split-K 2, BLOCK_K 128 over g64": (
        (3, 100), 37, 64, False, torch.bfloat16, True, ("decode", (16, 32, 128), 2),
    ),
    "decode split-K 4, idle programs": (
        (1, 100), 37, 64, False, torch.bfloat16, True, ("decode", (16, 32, 64), 4),
    ),
    "prefill steps of 32 in g64": (
        (33, 100), 37, 64, False, torch.bfloat16, True, ("prefill", (32, 32, 32), 1),
    ),
    "decode split-K 8 fp32": (
        (2, 300), 50, 32, True, torch.float32, True, ("decode", (16, 64, 128), 8),
    ),
    "prefill 64x64x128 fp16": (
        (70, 300), 50, 128, False, torch.float16, False, ("prefill", (64, 64, 128), 1),
    ),
}  # fmt: skip


def _fingerprint(*tensors):
    sums = [0.0 if t is None else t.double().sum().item() for t in tensors]
    return torch.tensor(sums, dtype=torch.float64)


@pytest.mark.parametrize("name", INT4_BITWISE_CASES)
def test_int4_gemm_outputs_are_the_dedicated_kernels_bit_for_bit(name, monkeypatch):
    shape, n, group_size, symmetric, dtype, bias, path = INT4_BITWISE_CASES[name]
    g = torch.Generator().manual_seed(list(INT4_BITWISE_CASES).index(name))
    x = torch.randn(shape, generator=g).to(dtype)
    w = torch.randn(n, shape[-1], generator=g)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    p, s, z = ref.quantize_int4_grouped(w, group_size=group_size, symmetric=symmetric)
    if path is not None:
        kernel, (bm, bn, bk), split_k = path
        extra = {"SPLIT_K": split_k} if kernel == "decode" else {}
        monkeypatch.setattr(
            getattr(intx, f"_{kernel}_kernel"), "configs", _one_config(bm, bn, bk, **extra)
        )
    want = torch.load(INT4_FIXTURE, weights_only=True)[name]
    assert torch.equal(_fingerprint(x, p, s, z, b), want["inputs"])
    y = fxq.triton_int4_weight_only_linear(x, p, s, z, b, group_size)
    assert y.dtype == want["y"].dtype
    if dtype == torch.float32:
        # the interpreter's fp32 tl.dot is numpy's BLAS, whose summation order depends on the
        # CPU's kernels: bit for bit on the class that recorded the fixture (AVX-512), one or
        # a few fp32 roundings apart on an AVX2 CPU (4 of the 16 cases, all fp32: at most
        # 7e-6 on outputs of magnitude ~10, where a wrong code or scale moves them by ~0.1)
        atol = 1e-5 * float(want["y"].abs().max())
        torch.testing.assert_close(y, want["y"], rtol=1e-5, atol=atol)
    else:  # the rounding to bf16 / fp16 is where the kernel's own decisions show
        assert torch.equal(y, want["y"])


def test_int4_dequantize_output_is_the_dedicated_kernels_bit_for_bit():
    w = torch.randn(37, 100, generator=torch.Generator().manual_seed(100))
    p, s, z = ref.quantize_int4_grouped(w, group_size=64, symmetric=False)
    want = torch.load(INT4_FIXTURE, weights_only=True)["dequantize bf16 g64 asym"]
    assert torch.equal(_fingerprint(p, s, z), want["inputs"])
    assert torch.equal(fxq.triton_int4_dequantize(p, s, z, 64, 100, torch.bfloat16), want["y"])


# --------------------------------------------------------------------------------------------
# Zeros, errors, opcheck
# --------------------------------------------------------------------------------------------


def _quantized(scheme, w):
    """(op, weight args after x, extra args after bias) for one scheme."""
    if scheme == "int4":
        return (
            fxq.triton_int4_weight_only_linear,
            ref.quantize_int4_grouped(w, group_size=32, symmetric=False),
            (32,),
        )
    op, quantize, _ = CHANNEL_SCHEMES[scheme]
    return op, quantize(w), ()


@pytest.mark.parametrize("scheme", ["int8", "float8", "int4"])
@pytest.mark.parametrize("m", [1, 17])
def test_zero_weight_or_input_gives_zeros(scheme, m):
    x, w, _ = _inputs((m, 70), 37, torch.bfloat16, bias=False)
    for xx, ww in ((x, torch.zeros_like(w)), (torch.zeros_like(x), w)):
        op, wargs, extra = _quantized(scheme, ww)
        y = op(xx, *wargs, None, *extra)
        assert torch.equal(y, torch.zeros(m, 37, dtype=torch.bfloat16))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda x, q, s: fxq.triton_int8_weight_only_linear(x[:, :60], q, s, None), "features"),
        (
            lambda x, q, s: fxq.triton_float8_weight_only_linear(x, q, s, None),
            "float8_e4m3fn",
        ),
        (lambda x, q, s: fxq.triton_int8_weight_only_linear(x.int(), q, s, None), "x dtype"),
        (lambda x, q, s: fxq.triton_int8_weight_only_linear(x, q, s[:5], None), "scale"),
    ],
)
def test_channel_scaled_errors(call, message):
    x, w, _ = _inputs((1, 70), 37, torch.bfloat16, bias=False)
    q, s = ref.quantize_int8_per_channel(w)
    with pytest.raises(ValueError, match=message):
        call(x, q, s)


@pytest.mark.parametrize(
    ("k", "group_size", "message"),
    [(100, 48, "group_size=48"), (140, 32, "Kp=128"), (100, 64, "Kp a multiple")],
)
def test_int4_errors(k, group_size, message):
    w = torch.randn(37, 100)
    p, s, z = ref.quantize_int4_grouped(w, group_size=32, symmetric=True)
    with pytest.raises(ValueError, match=message):
        fxq.triton_int4_weight_only_linear(torch.randn(1, k), p, s, z, None, group_size)


# Under the interpreter ``wrap_triton`` hands back the bare kernel (torch/_library/triton.py:
# an interpreted kernel has no JIT metadata to trace), so the op's fake kernel, which is its
# body, would launch the interpreter on fake tensors: test_faketensor and test_aot_dispatch_dynamic
# need a GPU (test_opcheck_gpu). SchemaCheckMode compares tensors with torch.allclose, which has
# no CPU kernel for float8, so the fp8 op runs test_autograd_registration alone here.
INTERPRETED_OPCHECK = ("test_schema", "test_autograd_registration")


def _opcheck_cases(device):
    x, w, b = _inputs((2, 3, 70), 37, torch.bfloat16, bias=True)
    x, w, b = x.to(device), w.to(device), b.to(device)
    q8, s8 = ref.quantize_int8_per_channel(w)
    qf, sf = ref.quantize_fp8_per_channel(w)
    p, s, z = ref.quantize_int4_grouped(w, group_size=32, symmetric=False)
    return [
        (fxq.triton_int8_weight_only_linear, (x, q8, s8, b)),
        (fxq.triton_int8_weight_only_linear, (x.reshape(-1, 70).repeat(4, 1), q8, s8, None)),
        (fxq.triton_float8_weight_only_linear, (x, qf, sf, None)),
        (fxq.triton_int4_weight_only_linear, (x, p, s, z, b, 32)),
        (fxq.triton_int4_dequantize, (p, s, z, 32, 70, torch.bfloat16)),
    ]


def test_opcheck_interpreted():
    for op, args in _opcheck_cases("cpu"):
        fp8 = op is fxq.triton_float8_weight_only_linear
        opcheck(op, args, test_utils=INTERPRETED_OPCHECK[1:] if fp8 else INTERPRETED_OPCHECK)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_opcheck_gpu():
    for op, args in _opcheck_cases("cuda"):
        opcheck(op, args)
