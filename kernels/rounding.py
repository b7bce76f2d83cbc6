"""Rounding helpers shared by every kernel that quantizes (activation quantization, norm_quant).

The reference math rounds half to even (``torch.round``, and torch's fp32 → float8_e4m3fn
cast). Triton's ``.to(tl.float8e4nv)`` does too on the GPU, but the Triton interpreter (which
runs the CPU tests) gets two cases wrong: a mantissa that rounds up into the next binade comes
out one binade low (124.8 → 64 instead of 128), and e4m3 subnormals (|x| < 2**-6) are
truncated. So values are rounded onto the e4m3 grid in fp32 first, where it is plain
arithmetic; the cast that follows is then exact everywhere, and the GPU pays a few integer ops
per element in kernels that are memory-bound anyway.
"""

from __future__ import annotations

import triton
import triton.language as tl

# Adding and subtracting 1.5 * 2**23 rounds an fp32 |v| < 2**22 to an integer, half to even
# (the fp32 add itself rounds that way): torch.round's rule, without libdevice. A global read
# inside @triton.jit must be a tl.constexpr (the interpreter accepts a plain float; the compiler
# does not).
_RNE_MAGIC = tl.constexpr(12582912.0)
# Plain floats for Python code; kernels wrap them as tl.constexpr (never runtime float args:
# Inductor passes Python floats to Triton as fp64, which breaks fp8 casts).
FP8_E4M3_MAX = 448.0
INT8_MAX = 127.0
EPS = 1e-12  # fxquant.core.reference.EPS: amax is clamped to it, so all-zero rows give zeros


@triton.jit
def round_half_even(v):
    """fp32 → the nearest integer (as fp32), ties to even; |v| < 2**22."""
    return (v + _RNE_MAGIC) - _RNE_MAGIC


@triton.jit
def round_to_e4m3(v):
    """fp32, already clamped to ±448 → the nearest e4m3 value (as fp32), ties to even, keeping
    the sign of zero (torch's cast turns -1e-5 into -0, code 0x80).

    The magnitude is rounded and the sign bit put back. Normal range: round the fp32 mantissa
    to 3 bits on the bit pattern (a carry moves into the exponent, which is what the
    interpreter's cast misses). Subnormal range (|v| < 2**-6): the grid is multiples of 2**-9.
    """
    sign = v.to(tl.int32, bitcast=True) & -2147483648
    mag = tl.abs(v)
    bits = mag.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -0x100000
    normal = bits.to(tl.float32, bitcast=True)
    sub = round_half_even(mag * 512.0) * 0.001953125
    r = tl.where(mag >= 0.015625, normal, sub)
    return (r.to(tl.int32, bitcast=True) | sign).to(tl.float32, bitcast=True)


@triton.jit
def round_to_bf16(v):
    """fp32 → the nearest bf16 value (as fp32), ties to even, on the bit pattern: the
    interpreter's ``.to(tl.bfloat16)`` truncates (the GPU's rounds to nearest even). Finite
    inputs only."""
    bits = v.to(tl.int32, bitcast=True)
    bits = (bits + 0x7FFF + ((bits >> 16) & 1)) & -0x10000
    return bits.to(tl.float32, bitcast=True)
