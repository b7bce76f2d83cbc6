"""Reference math of the microscaling formats: MXFP8, MXFP4 and NVFP4 (with Four Over Six).

Where it sits: beside ``fxquant.core.reference`` (the oracle of every test). The scheme declarations
(``fxquant/core/schemes/mx.py``) quantize weights with it; the ``fxquant::mxfp8_linear``,
``mxfp4_linear`` and ``nvfp4_linear`` ops run its linears as their eager implementation; the CPU
lowering compiles those same functions with Inductor, and the Triton kernels
(``fxquant.kernels.mxfp8`` / ``mxfp4`` / ``nvfp4``) are tested against them. The FP8 training
cast ``fxquant.training.numerics.cast_mx`` takes its E8M0 exponent from ``e8m0_exponent`` here, so
an MXFP8-trained layer and its exported inference op round the same way.

Formats (blocks run along K, the GEMM's reduction dim; W is [N, K], x is [..., K]):

- **MX** (OCP Microscaling spec v1.0): 32 elements share one E8M0 scale, a power of two
  2**(s - 127) stored as the biased exponent s in a uint8 (255, NaN, is never produced).
  Elements are e4m3 (MXFP8, max 448) or e2m1 (MXFP4, max 6). The shared exponent follows one of
  the rules producers use (``MX_SCALE_RULES``):

  - ``"floor"``: ``floor(log2(amax)) - emax_elem`` (emax_elem = 8 for e4m3, 2 for e2m1): the OCP
    spec's rule (section 6.3) and torchao's default ``ScaleCalculationMode.FLOOR``. The largest
    values of a block may exceed the element max and saturate to it.
  - ``"ceil"``: ``ceil(log2(amax / elem_max))``, so nothing saturates: Transformer Engine's and
    torchao's RCEIL MXFP8 cast, triton_kernels' ``downcast_to_mxfp`` (``ROUND_UP``, which
    transformers uses for gpt-oss MXFP4), fouroversix's MXFP4, and fxquant's MXFP8 training.
  - ``"even"``: amax first rounded to the element's mantissa width (half up, e2m1: 1 bit), then
    the floor rule: torchao's ``ScaleCalculationMode.EVEN`` and compressed-tensors'
    ``generate_mx_scales`` for MXFP4.

  An all-zero block gets s = 127 (scale 1) under every rule; exponents clamp to [-127, 127].
- **NVFP4** (NVIDIA): 16 e2m1 elements share an e4m3 block scale, and the tensor one fp32 scale.
  With A the tensor's amax, the tensor (dequant) scale is ``g = A / (6 * 448)``, each block's
  scale ``s = e4m3(block_amax / 6 / g)`` (at most 448), and the elements
  ``e2m1(x / (s * g))``; x ≈ q * s * g. This is torchao's ``NVFP4Tensor`` (per_tensor_scale =
  amax / (448 * 6)) and compressed-tensors' ``generate_gparam`` (its ``global_scale`` = 448 * 6
  / amax is our 1 / g). Block scales are clamped below at 2**-6, e4m3's smallest normal, as
  torchao does (bit-exact with its ``nvfp4_quantize``, tests/test_mx.py); compressed-tensors
  differs only for blocks whose scale would fall below that (amax < 2**-6 · 6 · g: it rounds to
  e4m3 and replaces a zero by 0.125).
- **Four Over Six** (arXiv 2512.02010, mit-han-lab/fouroversix, transformers'
  ``FourOverSixConfig(scale_rule="mse")``): NVFP4 where each block is quantized twice, with its
  largest magnitude mapped to 6 (``s6 = e4m3(block_amax / 6 / g)``) and to 4
  (``s4 = e4m3(1.5 * block_amax / 6 / g)``), and keeps the one whose dequantized block has the
  lower squared error (ties keep 6). So that 1.5 × the block scale still fits e4m3, the tensor
  scale is ``g = A / (6 * 256)``, as fouroversix does for its adaptive rules; as there, block
  scales are not clamped below, and a block whose e4m3 scale is zero (all zeros, or below 2**-10
  of the tensor's range) dequantizes to zeros, never NaN.

e2m1 rounding is round-to-nearest-even on the grid {0, 0.5, 1, 1.5, 2, 3, 4, 6}, saturating at
±6. Codes are sign << 3 | magnitude index; two codes per byte along K, the even column in the low
nibble (as gpt-oss' ``*_blocks``, compressed-tensors' and torchao's packing).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fxquant.core.reference import (
    EPS,
    FP8_E4M3_MAX,
    _finish,
    grouped_linear,
    pack_int4,
    unpack_int4,
)

MX_BLOCK = 32
NVFP4_BLOCK = 16
E2M1_MAX = 6.0
E2M1_MBITS = 1
E4M3_MBITS = 3
E8M0_BIAS = 127
E8M0_MIN_EXP, E8M0_MAX_EXP = -127, 127
E4M3_MIN_NORMAL = 2.0**-6  # torchao's floor for NVFP4 block scales
MX_SCALE_RULES = ("floor", "ceil", "even")
NVFP4_SCALE_RULES = ("six", "four_over_six")
# Largest e4m3 block scale of each NVFP4 rule (Four Over Six leaves room for 1.5 × the scale).
_NV_SCALE_MAX = {"six": FP8_E4M3_MAX, "four_over_six": 256.0}

# --------------------------------------------------------------------------------------------
# E8M0: the MX shared exponent
# --------------------------------------------------------------------------------------------


def e8m0_exponent(amax: Tensor, *, elem_max: float, rule: str, mbits: int = 1) -> Tensor:
    """The unbiased shared exponent (int32, in [-127, 127]) of blocks with largest magnitude
    ``amax`` for elements whose largest value is ``elem_max``; 0 where amax is 0. ``mbits``
    (the element's mantissa bits) is read by the ``"even"`` rule only.

    Computed with ``frexp`` (amax = m · 2**e, m in [0.5, 1)), exact where ``log2`` in floating
    point is not.
    """
    if rule not in MX_SCALE_RULES:
        raise ValueError(f"MX scale rule {rule!r} is not supported; allowed: {MX_SCALE_RULES}")
    amax = amax.float()
    if rule == "ceil":
        ratio = amax / elem_max
        m, e = torch.frexp(ratio)
        # ceil(log2(ratio)) is e, or e - 1 when ratio is exactly a power of two (m == 0.5)
        exp = torch.where(m == 0.5, e - 1, e)
    else:
        emax = math.floor(math.log2(elem_max))
        m, e = torch.frexp(amax)
        exp = e - 1 - emax  # floor(log2(amax)) - emax
        if rule == "even":
            # rounding the significand 2m in [1, 2) to ``mbits`` bits, half up, carries into
            # the exponent when 2m >= 2 - 2**-(mbits + 1)
            exp = exp + (2 * m >= 2 - 2.0 ** -(mbits + 1)).to(exp.dtype)
    exp = torch.where(amax > 0, exp, torch.zeros_like(exp))
    return exp.clamp(E8M0_MIN_EXP, E8M0_MAX_EXP).to(torch.int32)


def e8m0_to_float(s: Tensor) -> Tensor:
    """Biased E8M0 (uint8) → fp32 2**(s - 127), exactly: the exponent bits of an fp32 (s = 0,
    2**-127, is an fp32 subnormal and is written out)."""
    bits = torch.bitwise_left_shift(s.to(torch.int32), 23).view(torch.float32)
    return torch.where(s == 0, torch.full_like(bits, 2.0**-127), bits)


def _blocks(t: Tensor, block: int, what: str) -> Tensor:
    k = t.shape[-1]
    if k % block:
        raise ValueError(
            f"{what}: the last dim K={k} is not a multiple of the block size {block}; "
            f"allowed: K divisible by {block}"
        )
    return t.float().unflatten(-1, (k // block, block))


# --------------------------------------------------------------------------------------------
# e2m1 (FP4) elements
# --------------------------------------------------------------------------------------------


def round_to_e2m1(v: Tensor) -> Tensor:
    """fp32 → the nearest e2m1 value (ties to even, ±6 saturates), still as fp32."""
    a = v.abs().clamp(max=E2M1_MAX)
    # spacing 0.5 below 2, 1 in [2, 4), 2 in [4, 6]; torch.round ties to even, which on each
    # segment's grid is e2m1's even mantissa
    r = torch.where(
        a < 2, torch.round(a * 2) / 2, torch.where(a < 4, torch.round(a), torch.round(a / 2) * 2)
    )
    return torch.copysign(r, v)


def encode_e2m1(r: Tensor) -> Tensor:
    """e2m1 values (fp32, on the grid) → uint8 codes 0..15 (sign bit 8). The sign comes from
    the sign bit, so a negative value that rounds to zero is -0 (code 8), as torchao and
    fouroversix write it."""
    a = r.abs()
    idx = torch.where(a < 2, a * 2, torch.where(a < 4, a + 2, a / 2 + 4))
    sign = torch.where(torch.signbit(r), 8, 0).to(torch.uint8)
    return (idx.to(torch.uint8) | sign).to(torch.uint8)


def decode_e2m1(code: Tensor) -> Tensor:
    """uint8 codes → fp32 values (arithmetically, so Inductor and Triton compile it alike)."""
    c = code.to(torch.int32)
    e = torch.bitwise_and(torch.bitwise_right_shift(c, 1), 3)
    m = torch.bitwise_and(c, 1).float()
    pow2 = torch.where(e == 1, 1.0, torch.where(e == 2, 2.0, 4.0))
    mag = torch.where(e == 0, m * 0.5, (1 + m * 0.5) * pow2)
    return torch.where(torch.bitwise_and(c, 8) != 0, -mag, mag)


def pack_fp4(codes: Tensor) -> Tensor:
    """[N, K] codes → [N, K/2] bytes, even column in the low nibble."""
    return pack_int4(codes)


def unpack_fp4(packed: Tensor) -> Tensor:
    return unpack_int4(packed)


# --------------------------------------------------------------------------------------------
# MX (MXFP8, MXFP4)
# --------------------------------------------------------------------------------------------


def mx_quantize(t: Tensor, *, elem: str, rule: str) -> tuple[Tensor, Tensor]:
    """t [..., K] (K % 32 == 0) → (elements [..., K], E8M0 scales uint8 [..., K/32]).

    ``elem="e4m3"``: elements are float8_e4m3fn (saturated at ±448); ``"e2m1"``: uint8 codes
    (unpacked; ``pack_fp4`` packs a weight).
    """
    if elem not in ("e4m3", "e2m1"):
        raise ValueError(f"MX element {elem!r} is not supported; allowed: 'e4m3', 'e2m1'")
    b = _blocks(t, MX_BLOCK, "MX quantization")
    elem_max, mbits = (FP8_E4M3_MAX, E4M3_MBITS) if elem == "e4m3" else (E2M1_MAX, E2M1_MBITS)
    exp = e8m0_exponent(b.abs().amax(dim=-1), elem_max=elem_max, rule=rule, mbits=mbits)
    s = (exp + E8M0_BIAS).to(torch.uint8)
    scaled = b / e8m0_to_float(s)[..., None]
    if elem == "e4m3":
        q = scaled.clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    else:
        q = encode_e2m1(round_to_e2m1(scaled))
    return q.flatten(-2), s


def mx_dequantize(q: Tensor, s: Tensor, *, elem: str) -> Tensor:
    """(elements [..., K], E8M0 scales [..., K/32]) → fp32 [..., K]."""
    v = q.float() if elem == "e4m3" else decode_e2m1(q)
    return (v.unflatten(-1, (-1, MX_BLOCK)) * e8m0_to_float(s)[..., None]).flatten(-2)


def mx_fake_quantize(t: Tensor, *, elem: str, rule: str) -> Tensor:
    """t → its MX-quantized values in fp32 (what a dynamic MX activation feeds the GEMM)."""
    q, s = mx_quantize(t, elem=elem, rule=rule)
    return mx_dequantize(q, s, elem=elem)


def quantize_mxfp4_weight(w: Tensor, *, rule: str) -> tuple[Tensor, Tensor]:
    """W [N, K] → (packed uint8 [N, K/2], E8M0 scales uint8 [N, K/32])."""
    codes, s = mx_quantize(w, elem="e2m1", rule=rule)
    return pack_fp4(codes), s


def dequantize_mxfp4_weight(packed: Tensor, s: Tensor) -> Tensor:
    return mx_dequantize(unpack_fp4(packed), s, elem="e2m1")


# --------------------------------------------------------------------------------------------
# NVFP4 (and Four Over Six)
# --------------------------------------------------------------------------------------------


def _nv_elements(b: Tensor, s: Tensor, g: Tensor) -> Tensor:
    """Blocks b [..., B, 16] over their scales s (e4m3 [..., B]) × g → e2m1 values (fp32);
    a zero scale gives a zero block."""
    denom = s.float()[..., None] * g
    safe = torch.where(denom == 0, torch.ones_like(denom), denom)
    return torch.where(denom == 0, torch.zeros_like(b), round_to_e2m1(b / safe))


def nvfp4_quantize(t: Tensor, *, rule: str) -> tuple[Tensor, Tensor, Tensor]:
    """t [..., K] (K % 16 == 0) → (codes uint8 [..., K], e4m3 block scales [..., K/16],
    fp32 tensor scale [1]), the tensor scale from t's own amax."""
    if rule not in NVFP4_SCALE_RULES:
        raise ValueError(
            f"NVFP4 scale rule {rule!r} is not supported; allowed: {NVFP4_SCALE_RULES}"
        )
    b = _blocks(t, NVFP4_BLOCK, "NVFP4 quantization")
    g = (b.abs().amax().clamp(min=EPS) / (E2M1_MAX * _NV_SCALE_MAX[rule])).reshape(1)
    hp = b.abs().amax(dim=-1) / E2M1_MAX / g  # each block's amax mapped to 6
    if rule == "six":
        s6 = hp.clamp(min=E4M3_MIN_NORMAL, max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
        return encode_e2m1(_nv_elements(b, s6, g)).flatten(-2), s6, g
    s6 = hp.clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)
    r6 = _nv_elements(b, s6, g)
    s4 = (hp * 1.5).clamp(max=FP8_E4M3_MAX).to(torch.float8_e4m3fn)  # amax mapped to 4
    r4 = _nv_elements(b, s4, g)
    err6 = (r6 * s6.float()[..., None] * g - b).pow(2).sum(-1)
    err4 = (r4 * s4.float()[..., None] * g - b).pow(2).sum(-1)
    four = err4 < err6
    r = torch.where(four[..., None], r4, r6)
    s = torch.where(four, s4.float(), s6.float()).to(torch.float8_e4m3fn)  # exact: both e4m3
    return encode_e2m1(r).flatten(-2), s, g


def nvfp4_dequantize(codes: Tensor, s: Tensor, g: Tensor) -> Tensor:
    """(codes [..., K], e4m3 block scales [..., K/16], tensor scale [1]) → fp32 [..., K]."""
    v = decode_e2m1(codes).unflatten(-1, (-1, NVFP4_BLOCK))
    return (v * (s.float() * g)[..., None]).flatten(-2)


def nvfp4_fake_quantize(t: Tensor, *, rule: str) -> Tensor:
    codes, s, g = nvfp4_quantize(t, rule=rule)
    return nvfp4_dequantize(codes, s, g)


def quantize_nvfp4_weight(w: Tensor, *, rule: str) -> tuple[Tensor, Tensor, Tensor]:
    """W [N, K] → (packed uint8 [N, K/2], e4m3 block scales [N, K/16], fp32 tensor scale [1])."""
    codes, s, g = nvfp4_quantize(w, rule=rule)
    return pack_fp4(codes), s, g


def dequantize_nvfp4_weight(packed: Tensor, s: Tensor, g: Tensor) -> Tensor:
    return nvfp4_dequantize(unpack_fp4(packed), s, g)


# --------------------------------------------------------------------------------------------
# The linears (eager implementation of the ops, and the oracle of lowerings and kernels).
# Both operands are dequantized exactly to fp32 and multiplied with fp32 accumulation: what a
# block-scaled tensor core computes, up to summation order.
# --------------------------------------------------------------------------------------------


def _matmul(x_dq: Tensor, w_dq: Tensor, bias: Tensor | None, dtype: torch.dtype) -> Tensor:
    return _finish(x_dq @ w_dq.t(), bias, dtype)


def mxfp8_linear(x, weight, scale, bias=None, *, scale_rule: str):
    """x quantized to MXFP8 at run time (1×32 blocks along K per token, ``scale_rule``) ·
    MXFP8 W (e4m3 [N, K], E8M0 scales [N, K/32])."""
    x_dq = mx_fake_quantize(x, elem="e4m3", rule=scale_rule)
    w_dq = mx_dequantize(weight, scale, elem="e4m3")
    return _matmul(x_dq, w_dq, bias, x.dtype)


def mxfp4_linear(x, weight, scale, bias=None, *, activation_rule: str | None):
    """MXFP4 W (packed [N, K/2], E8M0 scales [N, K/32]) · x in float (``activation_rule``
    None) or x quantized to MXFP4 at run time with that scale rule."""
    x_dq = (
        x.float()
        if activation_rule is None
        else mx_fake_quantize(x, elem="e2m1", rule=activation_rule)
    )
    return _matmul(x_dq, dequantize_mxfp4_weight(weight, scale), bias, x.dtype)


def mxfp4_grouped_mm(x: Tensor, weight: Tensor, scale: Tensor, offs: Tensor) -> Tensor:
    """Mixture-of-experts GEMM with MXFP4 expert weights (gpt-oss' experts): each row of x [S, K]
    times its expert's weight (``reference.grouped_linear``: rows sorted by expert, ``offs`` [E]
    their cumulative ends), packed [E, N, K/2] with E8M0 scales [E, N, K/32]. → [S, N] in x's
    dtype."""
    w = dequantize_mxfp4_weight(weight, scale)
    return grouped_linear(x, lambda rows, e: rows.float() @ w[e].t(), offs).to(x.dtype)


def nvfp4_linear(x, weight, scale, tensor_scale, bias=None, *, activation_rule: str | None):
    """NVFP4 W (packed [N, K/2], e4m3 block scales [N, K/16], fp32 tensor scale [1]) · x in
    float (``activation_rule`` None) or x quantized to NVFP4 at run time (its tensor scale from
    the whole activation's amax) with that scale rule."""
    x_dq = x.float() if activation_rule is None else nvfp4_fake_quantize(x, rule=activation_rule)
    return _matmul(x_dq, dequantize_nvfp4_weight(weight, scale, tensor_scale), bias, x.dtype)
