"""Activation quantization and the GEMMs on quantized activations against fxquant.core.reference.

kernels/quantize.py must agree with the reference bit for bit (same divisions, same rounding);
the GEMMs (kernels/int8_dynamic.py, float8_dynamic.py, float8_block.py) are compared with the
reference linears: int8 to fp32 rounding (its int32 accumulation is exact), fp8 by SQNR and the
output dtype's tolerance. M = 1, 3, 16 take the decode path and 17, 33 the prefill path; split-K
decode configs are forced by patching the autotuner's config list (the interpreter runs only the
first config of each list). N = 37, K = 70 and the block GEMM's N = 150, K = 200 are not
multiples of any tile.

Kernels run on CPU tensors under TRITON_INTERPRET=1 (conftest sets it without a GPU), and on the
GPU where there is one. Under the interpreter a kernel's fp32 → bf16 store truncates instead of
rounding to nearest, so bf16 outputs are compared with bf16 tolerance, not exactly.
"""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

triton = pytest.importorskip("triton")

from fxquant.core import reference as ref  # noqa: E402
from fxquant.kernels import configs  # noqa: E402

# Importing the GEMM modules (which import kernels.quantize) registers the ten ops tested here.
from fxquant.kernels import float8_block as f8b  # noqa: E402
from fxquant.kernels import float8_dynamic as f8d  # noqa: E402
from fxquant.kernels import int8_dynamic as i8d  # noqa: E402

pytestmark = pytest.mark.interpreter
assert f8d.triton_float8_scaled_mm  # imported for its op registrations

fxq = torch.ops.fxquant
# Interpreted on CPU tensors without a GPU; compiled, on the GPU, where there is one.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
TOL = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1.6e-2, 1e-5)}  # (rtol, atol)


def _x(shape, dtype=torch.float32, seed=0):
    """Gaussian activations with some tiny entries (fp8 subnormals, int8 zeros) and, where there
    is more than one row, an all-zero first row."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * 3
    x[..., ::5] *= 1e-3
    if x.numel() > x.shape[-1]:
        x.view(-1, x.shape[-1])[0] = 0
    return x.to(DEVICE, dtype)


def _assert_same_q(q, expected_q):
    assert q.dtype == expected_q.dtype and q.shape == expected_q.shape
    if q.dtype == FP8:
        q, expected_q = q.view(torch.uint8), expected_q.view(torch.uint8)
    assert torch.equal(q, expected_q)


def _assert_same(got, expected):
    """(q, scale, ...) from an op == the reference's, bit for bit."""
    _assert_same_q(got[0], expected[0])
    for g, e in zip(got[1:], expected[1:], strict=True):
        assert g.shape == e.shape and g.dtype == e.dtype
        torch.testing.assert_close(g, e, rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# Activation quantization: bit for bit
# --------------------------------------------------------------------------------------------

SHAPES = [
    pytest.param(s, id="x".join(map(str, s)))
    for s in [(1, 1), (3, 37), (5, 130), (17, 256), (2, 3, 70)]
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_int8_per_token(shape, dtype):
    x = _x(shape, dtype)
    _assert_same(fxq.triton_quantize_int8_per_token(x), ref.quantize_int8_per_token(x))


@pytest.mark.parametrize("scale_ub", [None, 1.0])  # 1.0 binds on rows of N(0, 9)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_fp8_per_token(shape, dtype, scale_ub):
    x = _x(shape, dtype)
    _assert_same(
        fxq.triton_quantize_fp8_per_token(x, scale_ub),
        ref.quantize_fp8_per_token(x, scale_ub=scale_ub),
    )


@pytest.mark.parametrize("scale_ub", [None, 1.0])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_fp8_per_tensor(shape, dtype, scale_ub):
    x = _x(shape, dtype)
    q, scale, amax = fxq.triton_quantize_fp8_per_tensor(x, scale_ub)
    _assert_same((q, scale), ref.quantize_fp8_per_tensor(x, scale_ub=scale_ub))
    torch.testing.assert_close(amax, x.float().abs().amax().reshape(1), rtol=0, atol=0)


@pytest.mark.parametrize("group_size", [128, 32])  # K = 37, 70, 130 end in a short group
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", SHAPES)
def test_quantize_fp8_groups(shape, dtype, group_size):
    x = _x(shape, dtype)
    _assert_same(
        fxq.triton_quantize_fp8_groups(x, group_size),
        ref.quantize_fp8_groups(x, group_size=group_size),
    )


def test_quantize_rows_longer_than_one_tile():
    # K = 2100 is three 1024-wide chunks per pass; 17 groups of 128 are three tiles of 8 groups.
    x = _x((2, 2100))
    _assert_same(fxq.triton_quantize_int8_per_token(x), ref.quantize_int8_per_token(x))
    _assert_same(fxq.triton_quantize_fp8_per_token(x, None), ref.quantize_fp8_per_token(x))
    _assert_same(fxq.triton_quantize_fp8_per_tensor(x, None)[:2], ref.quantize_fp8_per_tensor(x))
    _assert_same(fxq.triton_quantize_fp8_groups(x, 128), ref.quantize_fp8_groups(x, group_size=128))


def test_quantize_rounds_ties_to_even():
    # amax 127 (int8) and 448 (fp8) make the scale exactly 1, so x itself is rounded.
    x8 = torch.tensor([[127.0, 0.5, 1.5, 2.5, -0.5, -2.5, 126.5]], device=DEVICE)
    q8, _ = fxq.triton_quantize_int8_per_token(x8)
    assert q8.tolist() == [[127, 0, 2, 2, 0, -2, 126]]
    _assert_same((q8,), ref.quantize_int8_per_token(x8)[:1])
    # e4m3 midpoints: 1.0625 (1 | 1.125), 17 (16 | 18), 232 (224 | 240), 124.8 (rounds up into
    # the next binade), 3 * 2**-10 (subnormals 2**-9 | 2**-8)
    xf = torch.tensor([[448.0, 1.0625, 17.0, 232.0, 124.8, 3 * 2.0**-10]], device=DEVICE)
    qf, _ = fxq.triton_quantize_fp8_per_token(xf, None)
    assert qf.float().tolist() == [[448.0, 1.0, 16.0, 224.0, 128.0, 2.0**-8]]
    _assert_same((qf,), ref.quantize_fp8_per_token(xf)[:1])


def test_quantize_all_zero_rows_give_zeros_and_finite_scales():
    x = torch.zeros(3, 70, device=DEVICE)
    x[1] = torch.linspace(-2, 2, 70)
    zeros = x[[0, 2]]
    for got, expected in [
        (fxq.triton_quantize_int8_per_token(x), ref.quantize_int8_per_token(x)),
        (fxq.triton_quantize_fp8_per_token(x, 1.0), ref.quantize_fp8_per_token(x, scale_ub=1.0)),
        (fxq.triton_quantize_fp8_groups(x, 32), ref.quantize_fp8_groups(x, group_size=32)),
        (fxq.triton_quantize_fp8_per_tensor(zeros, None)[:2], ref.quantize_fp8_per_tensor(zeros)),
    ]:
        _assert_same(got, expected)
        assert torch.isfinite(got[1]).all() and (got[1] > 0).all()
    q, _ = fxq.triton_quantize_int8_per_token(x)
    assert not q[[0, 2]].any()


def test_quantize_scale_ub_saturates_and_amax_is_unclamped():
    x = torch.tensor([[100.0, -50.0, 0.5, -0.25]], device=DEVICE)
    q, scale = fxq.triton_quantize_fp8_per_token(x, 1.0)
    _assert_same((q, scale), ref.quantize_fp8_per_token(x, scale_ub=1.0))
    assert q.float().tolist() == [[448.0, -448.0, 224.0, -112.0]]
    q, scale, amax = fxq.triton_quantize_fp8_per_tensor(x, 1.0)
    _assert_same((q, scale), ref.quantize_fp8_per_tensor(x, scale_ub=1.0))
    assert amax.item() == 100.0 and scale.item() == pytest.approx(1.0 / 448)


def test_quantize_groups_rejects_bad_group_size():
    with pytest.raises(ValueError, match="group_size=0"):
        fxq.triton_quantize_fp8_groups(torch.randn(2, 8, device=DEVICE), 0)


# --------------------------------------------------------------------------------------------
# GEMMs on quantized activations
# --------------------------------------------------------------------------------------------

# (M, bias, out_dtype): M = 1, 3, 16 decode, 17, 33 prefill; each path sees both dtypes and both
# bias cases.
MM_CASES = [
    pytest.param(m, bias, dtype, id=f"m{m}-{'bias' if bias else 'nobias'}-{str(dtype)[6:]}")
    for m, bias, dtype in [
        (1, True, torch.bfloat16),
        (3, False, torch.float32),
        (16, True, torch.float32),
        (16, False, torch.bfloat16),
        (17, False, torch.bfloat16),
        (33, True, torch.float32),
        (33, False, torch.bfloat16),
    ]
]


def _weight(n, k, seed=1):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, k, generator=g) * 0.1).to(DEVICE), torch.randn(n, generator=g).to(DEVICE)


def _check_exact_ish(y, expected):
    """int8: the same sum of integers, so fp32 agrees to rounding (FMA on the GPU)."""
    assert y.shape == expected.shape and y.dtype == expected.dtype
    rtol, atol = TOL[y.dtype]
    torch.testing.assert_close(y, expected, rtol=rtol, atol=atol)


def _check_fp8(y, expected):
    """fp8: fp32 accumulation in another order (and on sm90, the tensor cores' own)."""
    assert y.shape == expected.shape and y.dtype == expected.dtype
    assert ref.sqnr(expected, y) >= 40
    torch.testing.assert_close(y.float(), expected.float(), rtol=1.6e-2, atol=1e-3)


@pytest.mark.parametrize(("m", "bias", "out_dtype"), MM_CASES)
def test_int8_scaled_mm(m, bias, out_dtype):
    w, b = _weight(37, 70)
    qw, sw = ref.quantize_int8_per_channel(w)
    xq, xs = ref.quantize_int8_per_token(_x((m, 70)))
    b = b if bias else None
    y = fxq.triton_int8_scaled_mm(xq, xs, qw, sw, b, out_dtype)
    _check_exact_ish(y, ref.int8_scaled_linear(xq, xs, qw, sw, b, out_dtype=out_dtype))


# Activation and weight scales: per row ([M, 1] and [N]) or per tensor ([1]), in every mix.
SCALINGS = [("row", "row"), ("tensor", "tensor"), ("tensor", "row"), ("row", "tensor")]
X_FP8 = {"row": ref.quantize_fp8_per_token, "tensor": ref.quantize_fp8_per_tensor}
W_FP8 = {"row": ref.quantize_fp8_per_channel, "tensor": ref.quantize_fp8_per_tensor}


@pytest.mark.parametrize("scaling", SCALINGS, ids=lambda s: "x-{}-w-{}".format(*s))
@pytest.mark.parametrize(("m", "bias", "out_dtype"), MM_CASES)
def test_float8_scaled_mm(m, bias, out_dtype, scaling):
    w, b = _weight(37, 70)
    xq, xs = X_FP8[scaling[0]](_x((m, 70)))
    qw, sw = W_FP8[scaling[1]](w)
    b = b if bias else None
    y = fxq.triton_float8_scaled_mm(xq, xs, qw, sw, b, out_dtype)
    _check_fp8(y, ref.float8_scaled_linear(xq, xs, qw, sw, b, out_dtype=out_dtype))


# (N, K, block size): ragged last blocks in N and K; BLOCK_N (32) spans two 16-wide blocks.
BLOCK_SHAPES = [
    pytest.param(n, k, b, id=f"n{n}-k{k}-b{b}")
    for n, k, b in [(150, 200, 128), (37, 70, 32), (48, 40, 16)]
]


@pytest.mark.parametrize(("n", "k", "block_size"), BLOCK_SHAPES)
@pytest.mark.parametrize(("m", "bias", "out_dtype"), MM_CASES)
def test_float8_block_scaled_mm(m, bias, out_dtype, n, k, block_size):
    w, b = _weight(n, k)
    qw, sw = ref.quantize_fp8_blocks(w, block_size=block_size)
    xq, xs = ref.quantize_fp8_groups(_x((m, k)), group_size=block_size)
    b = b if bias else None
    y = fxq.triton_float8_block_scaled_mm(xq, xs, qw, sw, b, block_size, out_dtype)
    expected = ref.float8_block_scaled_linear(
        xq, xs, qw, sw, b, block_size=block_size, out_dtype=out_dtype
    )
    _check_fp8(y, expected)


@pytest.mark.parametrize("split_k", [2, 4])
def test_split_k_decode(split_k, monkeypatch):
    # K = 70 in 32-wide steps is 3 steps and K = 200 in 32-wide blocks is 7: SPLIT_K = 4 leaves a
    # program without work in the first, and only split 0 may add the bias.
    meta = {"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 32, "SPLIT_K": split_k}
    cfg = [triton.Config(meta, num_warps=4, num_stages=2)]
    monkeypatch.setattr(i8d._decode_kernel, "configs", cfg)  # int8 and fp8 share it
    monkeypatch.setattr(f8b._kernels(32)[0], "configs", cfg)
    w, b = _weight(37, 70)
    x = _x((5, 70), torch.bfloat16)
    q8, s8 = ref.quantize_int8_per_channel(w)
    y = fxq.triton_int8_dynamic_linear(x, q8, s8, b)
    _check_exact_ish(y, ref.int8_dynamic_linear(x, q8, s8, b))
    qf, sf = ref.quantize_fp8_per_channel(w)
    y = fxq.triton_float8_dynamic_linear(x, qf, sf, b, True, None)
    _check_fp8(y, ref.float8_dynamic_linear(x, qf, sf, b, per_row=True))
    w, b = _weight(37, 200)
    x = _x((5, 200), torch.bfloat16)
    qb, sb = ref.quantize_fp8_blocks(w, block_size=32)
    y = fxq.triton_float8_block_linear(x, qb, sb, b, 32)
    _check_fp8(y, ref.float8_block_linear(x, qb, sb, b, block_size=32))


def test_decode_path_is_chosen_without_a_shape_guard():
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic, ShapeEnv

    assert configs.is_decode(configs.DECODE_MAX_M)
    assert not configs.is_decode(configs.DECODE_MAX_M + 1)
    # A dynamic M (one exported artifact for every batch) takes the prefill path and adds no
    # guard: `m <= 16` would, and torch.export rejects it for a Dim spanning both sides.
    env = ShapeEnv()
    sym = env.create_symbol(4, source=ConstantSource("m"), dynamic_dim=DimDynamic.DYNAMIC)
    assert not configs.is_decode(env.create_symintnode(sym, hint=4))
    assert not env.guards


def test_block_size_must_be_a_power_of_two_of_at_least_16():
    w, _ = _weight(37, 96)
    for block_size in (8, 48):
        qb, sb = ref.quantize_fp8_blocks(w, block_size=block_size)
        x = _x((2, 96))
        with pytest.raises(ValueError, match=f"block_size={block_size}"):
            fxq.triton_float8_block_linear(x, qb, sb, None, block_size)
        xq, xs = ref.quantize_fp8_groups(x, group_size=block_size)
        with pytest.raises(ValueError, match=f"block_size={block_size}"):
            fxq.triton_float8_block_scaled_mm(xq, xs, qb, sb, None, block_size, torch.float32)


def test_scaled_mm_rejects_wrong_operands():
    w, _ = _weight(37, 70)
    q8, s8 = ref.quantize_int8_per_channel(w)
    qf, sf = ref.quantize_fp8_per_channel(w)
    xq, xs = ref.quantize_fp8_per_token(_x((2, 70)))
    with pytest.raises(ValueError, match="int8 scaled mm needs int8 xq"):
        fxq.triton_int8_scaled_mm(xq, xs, q8, s8, None, torch.float32)
    with pytest.raises(ValueError, match="fp8 scaled mm needs float8_e4m3fn"):
        fxq.triton_float8_scaled_mm(xq[:, :64], xs, qf, sf, None, torch.float32)
    with pytest.raises(ValueError, match="fp8 block scaled mm needs float8_e4m3fn"):
        fxq.triton_float8_block_scaled_mm(xq, xs, q8, s8, None, 32, torch.float32)


# --------------------------------------------------------------------------------------------
# The *_linear ops: quantize + GEMM, any leading dims, x's dtype out
# --------------------------------------------------------------------------------------------

# Leading dims of x: [1, K] and [2, 3, K] decode, [2, 17, K] prefill.
LINEAR_CASES = [
    pytest.param((1,), torch.float32, id="1xK-fp32"),
    pytest.param((2, 3), torch.bfloat16, id="2x3xK-bf16"),
    pytest.param((2, 17), torch.float32, id="2x17xK-fp32"),
]


@pytest.mark.parametrize(("lead", "dtype"), LINEAR_CASES)
def test_int8_dynamic_linear(lead, dtype):
    w, b = _weight(37, 70)
    q8, s8 = ref.quantize_int8_per_channel(w)
    x = _x((*lead, 70), dtype)
    _check_exact_ish(
        fxq.triton_int8_dynamic_linear(x, q8, s8, b), ref.int8_dynamic_linear(x, q8, s8, b)
    )


@pytest.mark.parametrize(("per_row", "scale_ub"), [(True, None), (True, 1.0), (False, None)])
@pytest.mark.parametrize(("lead", "dtype"), LINEAR_CASES)
def test_float8_dynamic_linear(lead, dtype, per_row, scale_ub):
    w, b = _weight(37, 70)
    qw, sw = ref.quantize_fp8_per_channel(w) if per_row else ref.quantize_fp8_per_tensor(w)
    x = _x((*lead, 70), dtype)
    y = fxq.triton_float8_dynamic_linear(x, qw, sw, b, per_row, scale_ub)
    expected = ref.float8_dynamic_linear(
        x, qw, sw, b, per_row=per_row, activation_scale_ub=scale_ub
    )
    _check_fp8(y, expected)


@pytest.mark.parametrize("block_size", [32, 128])
@pytest.mark.parametrize(("lead", "dtype"), LINEAR_CASES)
def test_float8_block_linear(lead, dtype, block_size):
    w, b = _weight(150, 200)
    qb, sb = ref.quantize_fp8_blocks(w, block_size=block_size)
    x = _x((*lead, 200), dtype)
    y = fxq.triton_float8_block_linear(x, qb, sb, b, block_size)
    _check_fp8(y, ref.float8_block_linear(x, qb, sb, b, block_size=block_size))


# --------------------------------------------------------------------------------------------
# opcheck
# --------------------------------------------------------------------------------------------

# Under the interpreter ``wrap_triton`` hands back the bare kernel (an interpreted kernel has no
# JIT metadata to trace), so an op's fake kernel, which is its own body, would launch the
# interpreter on fake tensors: test_faketensor and test_aot_dispatch_dynamic need a GPU
# (test_opcheck_gpu). SchemaCheckMode compares tensors with torch.allclose, which has no CPU
# kernel for float8, so ops that take or return fp8 run test_autograd_registration alone here.
INTERPRETED_OPCHECK = ("test_schema", "test_autograd_registration")


def _opcheck_cases():
    w, b = _weight(37, 70)
    x = _x((2, 3, 70), torch.bfloat16)
    x2 = x.reshape(-1, 70).float()
    q8, s8 = ref.quantize_int8_per_channel(w)
    qf, sf = ref.quantize_fp8_per_channel(w)
    qt, st = ref.quantize_fp8_per_tensor(w)
    qb, sb = ref.quantize_fp8_blocks(w, block_size=32)
    xq8, xs8 = ref.quantize_int8_per_token(x2)
    xqf, xsf = ref.quantize_fp8_per_token(x2)
    xqg, xsg = ref.quantize_fp8_groups(x2, group_size=32)
    return [
        (fxq.triton_quantize_int8_per_token, (x,)),
        (fxq.triton_quantize_fp8_per_token, (x, 1.0)),
        (fxq.triton_quantize_fp8_per_tensor, (x, None)),
        (fxq.triton_quantize_fp8_groups, (x, 32)),
        (fxq.triton_int8_scaled_mm, (xq8, xs8, q8, s8, b, torch.bfloat16)),
        (fxq.triton_float8_scaled_mm, (xqf, xsf, qt, st, None, torch.float32)),
        (fxq.triton_float8_block_scaled_mm, (xqg, xsg, qb, sb, b, 32, torch.bfloat16)),
        (fxq.triton_int8_dynamic_linear, (x, q8, s8, b)),
        (fxq.triton_float8_dynamic_linear, (x, qf, sf, None, True, None)),
        (fxq.triton_float8_block_linear, (x, qb, sb, b, 32)),
    ]


def _touches_fp8(op):
    return "float8" in op._qualified_op_name or "fp8" in op._qualified_op_name


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU runs every opcheck test (test_opcheck_gpu)")
def test_opcheck_interpreted():
    for op, args in _opcheck_cases():
        utils = INTERPRETED_OPCHECK[1:] if _touches_fp8(op) else INTERPRETED_OPCHECK
        opcheck(op, args, test_utils=utils)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
def test_opcheck_gpu():
    for op, args in _opcheck_cases():
        opcheck(op, args)
