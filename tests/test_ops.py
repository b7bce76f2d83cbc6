"""Every fxquant:: op: opcheck (schema, fake kernel, dynamic shapes) and equality to reference."""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import fxquant  # noqa: F401  (registers the ops)
from fxquant.core import reference as ref

fxq = torch.ops.fxquant
SHAPES = [((1, 64), 32), ((3, 5, 64), 17), ((7, 130), 1), ((2, 256), 96)]  # (x shape, N)
DTYPES = [torch.float32, torch.bfloat16]


def _cases(x_shape, n, dtype):
    torch.manual_seed(0)
    k = x_shape[-1]
    x = torch.randn(x_shape, dtype=dtype)
    w = torch.randn(n, k)
    b = torch.randn(n)
    q8, s8 = ref.quantize_int8_per_channel(w)
    p4, s4, z4 = ref.quantize_int4_grouped(w, group_size=32, symmetric=False)
    qf, sf = ref.quantize_fp8_per_channel(w)
    qt, st = ref.quantize_fp8_per_tensor(w)
    qb, sb = ref.quantize_fp8_blocks(w, block_size=64)
    xs = torch.tensor([2.5 / 448])
    return [
        (fxq.int8_weight_only_linear, (x, q8, s8, b), ref.int8_weight_only_linear, {}),
        (fxq.int8_dynamic_linear, (x, q8, s8, None), ref.int8_dynamic_linear, {}),
        (fxq.int4_weight_only_linear, (x, p4, s4, z4, b, 32), ref.int4_weight_only_linear, {}),
        (fxq.int8_dynamic_int4_linear, (x, p4, s4, z4, b, 32), ref.int8_dynamic_int4_linear, {}),
        (fxq.float8_weight_only_linear, (x, qf, sf, None), ref.float8_weight_only_linear, {}),
        (fxq.float8_dynamic_linear, (x, qf, sf, b, True, None), ref.float8_dynamic_linear, {}),
        (fxq.float8_dynamic_linear, (x, qt, st, b, False, 1.0), ref.float8_dynamic_linear, {}),
        (fxq.float8_block_linear, (x, qb, sb, b, 64), ref.float8_block_linear, {}),
        # a fixed activation scale small enough that the tails of x saturate
        (fxq.float8_static_linear, (x, qt, st, xs, b), ref.float8_static_linear, {}),
    ]


# SchemaCheckMode compares every tensor an op touches with torch.allclose, which has no CPU
# kernel for float8 ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'); the fp8 ops
# run every other opcheck test (they are declared functional, mutates_args=()).
NO_SCHEMA_TEST = ("test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("x_shape", "n"), SHAPES)
def test_opcheck(x_shape, n, dtype):
    for op, args, _, _ in _cases(x_shape, n, dtype):
        fp8 = any(
            isinstance(a, torch.Tensor) and a.dtype.itemsize == 1 and a.is_floating_point()
            for a in args
        )
        if fp8:
            opcheck(op, args, test_utils=NO_SCHEMA_TEST)
        else:
            opcheck(op, args)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("x_shape", "n"), SHAPES)
def test_ops_equal_reference_and_keep_dtype(x_shape, n, dtype):
    for op, args, reference, _ in _cases(x_shape, n, dtype):
        y = op(*args)
        assert y.shape == (*x_shape[:-1], n) and y.dtype == dtype
        if op is fxq.float8_dynamic_linear:
            expected = reference(*args[:4], per_row=args[4], activation_scale_ub=args[5])
        elif op in (fxq.int4_weight_only_linear, fxq.int8_dynamic_int4_linear):
            expected = reference(*args[:-1], group_size=args[-1])
        elif op is fxq.float8_block_linear:
            expected = reference(*args[:-1], block_size=args[-1])
        else:
            expected = reference(*args)
        torch.testing.assert_close(y, expected, rtol=0, atol=0)


def _fused_cases(x_shape, n, dtype):
    """(op, args, expected): the norm → quantize op and the linears on quantized activations."""
    torch.manual_seed(0)
    k = x_shape[-1]
    x = torch.randn(x_shape, dtype=dtype) * 3
    gamma, beta = torch.randn(k, dtype=dtype), torch.randn(k, dtype=dtype)
    w, b = torch.randn(n, k), torch.randn(n)
    q8, s8 = ref.quantize_int8_per_channel(w)
    qf, sf = ref.quantize_fp8_per_channel(w)
    qb, sb = ref.quantize_fp8_blocks(w, block_size=64)
    x8, xs8 = ref.quantize_int8_per_token(x)
    xf, xsf = ref.quantize_fp8_per_token(x, scale_ub=2.0)
    xg, xsg = ref.quantize_fp8_groups(x, group_size=64)
    e4m3 = torch.float8_e4m3fn

    def norm_quant(*args):
        x, weight, bias, eps, rms, quant_dtype, group_size, scale_ub = args
        kw = {"quant_dtype": quant_dtype, "group_size": group_size, "scale_ub": scale_ub}
        return ref.norm_quant(x, weight, bias, eps=eps, rms=rms, **kw)[:2]

    cases = [
        (fxq.norm_quant, (x, gamma, None, 1e-6, True, torch.int8, -1, None)),
        (fxq.norm_quant, (x, None, None, 1e-5, True, e4m3, 64, None)),
        (fxq.norm_quant, (x, gamma, beta, 1e-5, False, e4m3, -1, 1.5)),
        (fxq.norm_quant, (x, None, None, 1e-5, False, torch.int8, -1, None)),
    ]
    cases = [(op, args, norm_quant(*args)) for op, args in cases]
    return cases + [
        (
            fxq.int8_scaled_linear,
            (x8, xs8, q8, s8, b, dtype),
            ref.int8_scaled_linear(x8, xs8, q8, s8, b, out_dtype=dtype),
        ),
        (
            fxq.float8_scaled_linear,
            (xf, xsf, qf, sf, None, dtype),
            ref.float8_scaled_linear(xf, xsf, qf, sf, None, out_dtype=dtype),
        ),
        (
            fxq.float8_block_scaled_linear,
            (xg, xsg, qb, sb, b, 64, dtype),
            ref.float8_block_scaled_linear(xg, xsg, qb, sb, b, block_size=64, out_dtype=dtype),
        ),
    ]


def _has_fp8(values) -> bool:
    return any(
        isinstance(t, torch.Tensor) and t.dtype.itemsize == 1 and t.is_floating_point()
        for t in values
    )


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("x_shape", "n"), SHAPES)
def test_fused_ops_opcheck_and_equal_reference(x_shape, n, dtype):
    for op, args, expected in _fused_cases(x_shape, n, dtype):
        out = op(*args)
        # an fp8 input or output: see NO_SCHEMA_TEST
        fp8 = _has_fp8(args) or _has_fp8(out if isinstance(out, tuple) else (out,))
        if fp8:
            opcheck(op, args, test_utils=NO_SCHEMA_TEST)
        else:
            opcheck(op, args)
        if isinstance(out, tuple):
            (q, scale), (q_ref, scale_ref) = out, expected
            assert q.shape == x_shape and scale.dtype == torch.float32
            torch.testing.assert_close(q.float(), q_ref.float(), rtol=0, atol=0)
            torch.testing.assert_close(scale, scale_ref, rtol=0, atol=0)
        else:
            assert out.shape == (*x_shape[:-1], n) and out.dtype == dtype
            torch.testing.assert_close(out, expected, rtol=0, atol=0)
