"""Reference math of the low-bit weight formats: int2/int3/int6 grouped weights (and a
float-zero int4), and BitNet b1.58's ternary weights with int8 per-token activations.

Where it sits: beside ``fxquant.core.reference`` (same conventions: W is [N, K], x is [..., K],
linears accumulate in fp32 and return x's dtype). The schemes that store these formats quantize
weights with these functions (``fxquant/core/schemes/lowbit.py``); the
``fxquant::intx_weight_only_linear`` and ``fxquant::bitnet_linear`` ops use the linears here as
their eager kernels; the CPU lowerings and the Triton kernels (``kernels/intx_weight_only.py``,
``kernels/bitnet.py``) are tested against them.

Storage of ``IntxWeightOnly`` (bits b in 2, 3, 4, 6): unsigned codes u in [0, 2**b - 1], groups
of g along K, w = (u - z) * s with one fp32 ``scale`` s and one ``zero`` z per group ([N, Kp/g]).
z is uint8 (an integer zero point, like ``Int4WeightOnly``) or fp32 (HQQ's and quanto's float
zero point). Codes are packed along K, little-endian within a row:

- b = 2: four codes per byte, column 4i + j in bits 2j..2j+1 of byte i (low bits first);
- b = 3: eight codes in three bytes: columns 8i..8i+7 form the 24-bit little-endian word
  ``byte[3i] | byte[3i+1] << 8 | byte[3i+2] << 16`` with column 8i + j in bits 3j..3j+2. Exact,
  dense (3 bits a code) and unpacked with shifts and masks only;
- b = 4: two codes per byte, low nibble first (``fxquant.core.reference.pack_int4``'s layout);
- b = 6: four codes in three bytes, the 3-bit scheme with 6-bit fields: columns 4i..4i+3 form
  the 24-bit word ``byte[3i] | byte[3i+1] << 8 | byte[3i+2] << 16`` with column 4i + j in bits
  6j..6j+5. GGUF's ``Q6_K`` (w = d·sc·(q - 32) per 16) loads into it with z = 32, s = d·sc.

So the packed weight is uint8 [N, Kp * b / 8]; Kp (K padded to the group) is a multiple of 16
(32 except for 6-bit codes), so every packing comes out whole.

Two grids give float zero points. HQQ's (``grid="hqq"``): inverse scale i = min(qmax / (max -
min), 2e4), z = -min·i, u = round(w·i + z). MLX's affine mode (``grid="mlx"``, Apple's MLX and
transformers' ``MetalConfig``, ``integrations/metal_quantization.py``): s = max((max - min) /
qmax, 1e-8), bias = min, u = round((w - bias) / s), and w = u·s + bias, stored here as
z = -bias / s (exact up to fp32 rounding of that quotient). MLX's files pack the codes into
uint32 words along K, lowest bits first (``pack_mlx`` / ``unpack_mlx``, 2, 4 and 8 bits).

BitNet (transformers' ``integrations/bitnet.py``, BitNet b1.58): the weight scale is the mean of
|W| over the whole tensor, w_q = clamp(round(W / mean|W|), -1, 1); transformers stores the
multiplier ``weight_scale = 1 / mean|W|.clamp(min=1e-5)`` and packs four ternary rows per byte
along the *output* dim (see ``pack_bitnet``). Activations are quantized per token with
``s_x = 127 / amax.clamp(min=1e-5)``, x_q = clamp(round(x * s_x), -128, 127), and the output is
(x_q · w_qᵀ) / (s_x · weight_scale). Both eps and both multipliers are transformers', so a
checkpoint's ``weight`` / ``weight_scale`` pair can be used as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from fxquant.core import hqq
from fxquant.core.reference import integer_grid

INTX_BITS = (2, 3, 4, 6)
# bits → codes per 24-bit little-endian word, for the codes that do not divide a byte
_WORD_CODES = {3: 8, 6: 4}
# HQQ clamps its inverse scale (qmax / range) to 2e4 "to avoid half-precision problems"; kept so
# that a group's grid is HQQ's, and it is what keeps a constant (or all-zero) group finite.
HQQ_MAX_INV_SCALE = 2e4
# MLX's affine grid (transformers' MetalConfig) floors its scale at 1e-8: a constant group
MLX_MIN_SCALE = 1e-8
INTX_GRIDS = ("hqq", "mlx")
# transformers' BitNet clamps |W| means and token amaxes to 1e-5, not to fxquant's EPS.
BITNET_EPS = 1e-5
BITNET_ACT_MAX = 127


# --------------------------------------------------------------------------------------------
# Packing
# --------------------------------------------------------------------------------------------


def packed_cols(kp: int, bits: int) -> int:
    """Bytes per row of a packed [N, Kp] weight of ``bits``-bit codes."""
    return kp * bits // 8


def pack_intx(u: torch.Tensor, bits: int) -> torch.Tensor:
    """[N, K] uint8 codes in [0, 2**bits) → [N, K * bits / 8] uint8 (layout: module docstring)."""
    n, k = u.shape
    u = u.to(torch.uint8)
    if bits == 4:
        return u[:, 0::2] | (u[:, 1::2] << 4)
    if bits == 2:
        u = u.reshape(n, k // 4, 4)
        return (u[..., 0] | (u[..., 1] << 2) | (u[..., 2] << 4) | (u[..., 3] << 6)).contiguous()
    if bits in _WORD_CODES:
        per = _WORD_CODES[bits]
        u = u.reshape(n, k // per, per).to(torch.int32)
        word = torch.zeros(n, k // per, dtype=torch.int32)
        for j in range(per):
            word |= u[..., j] << (bits * j)
        out = torch.stack([word & 0xFF, (word >> 8) & 0xFF, (word >> 16) & 0xFF], dim=-1)
        return out.reshape(n, k // per * 3).to(torch.uint8)
    raise ValueError(f"bits={bits} is not supported; allowed: {INTX_BITS}")


def unpack_intx(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """Inverse of ``pack_intx``: [N, K * bits / 8] uint8 → [N, K] uint8 codes."""
    n = packed.shape[0]
    if bits == 4:
        return torch.stack([packed & 0x0F, packed >> 4], dim=-1).reshape(n, -1)
    if bits == 2:
        return torch.stack([(packed >> s) & 0x3 for s in (0, 2, 4, 6)], dim=-1).reshape(n, -1)
    if bits in _WORD_CODES:
        b = packed.reshape(n, -1, 3).to(torch.int32)
        word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
        mask = (1 << bits) - 1
        codes = [(word >> (bits * j)) & mask for j in range(_WORD_CODES[bits])]
        return torch.stack(codes, dim=-1).reshape(n, -1).to(torch.uint8)
    raise ValueError(f"bits={bits} is not supported; allowed: {INTX_BITS}")


# --------------------------------------------------------------------------------------------
# int2 / int3 / int4 / int6 grouped weights
# --------------------------------------------------------------------------------------------


def pack_mlx(u: torch.Tensor, bits: int) -> torch.Tensor:
    """Codes u [N, K] in [0, 2**bits) → MLX's uint32 words [N, K * bits / 32]: word j holds
    columns j·(32/bits) … along K, the first in the lowest bits (bits 2, 4 or 8)."""
    if bits not in (2, 4, 8):
        raise ValueError(f"pack_mlx: bits={bits}; allowed: 2, 4, 8 (codes that divide a word)")
    per = 32 // bits
    n, k = u.shape
    if k % per:
        raise ValueError(f"pack_mlx: K={k} is not a multiple of {per} ({bits}-bit codes a word)")
    fields = u.to(torch.int64).reshape(n, k // per, per) << (torch.arange(per) * bits)
    words = fields.sum(-1)  # disjoint bit fields: the sum is their OR
    return (words - (words >= 2**31).long() * 2**32).to(torch.int32).view(torch.uint32)


def unpack_mlx(words: torch.Tensor, bits: int) -> torch.Tensor:
    """MLX's uint32 (or int32) words [N, W] → codes uint8 [N, W * 32 / bits]."""
    per = 32 // bits
    w = words.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    fields = (w[..., None] >> (torch.arange(per) * bits)) & ((1 << bits) - 1)
    return fields.reshape(*words.shape[:-1], -1).to(torch.uint8)


def quantize_intx_grouped(
    w: torch.Tensor,
    *,
    bits: int,
    group_size: int,
    symmetric: bool = False,
    zero_point: str = "int",
    optimizer: str | None = None,
    grid: str = "hqq",
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] → (packed uint8 [N, Kp*b/8], scale fp32 [N, Kp/g], zero [N, Kp/g]).

    ``zero_point="int"`` (zero uint8), as ``quantize_int4_grouped`` with qmax = 2**b - 1:
    symmetric: s = amax / (2**(b-1) - 1), u = clamp(round(w / s), -2**(b-1), 2**(b-1) - 1) + z
    with z = 2**(b-1); asymmetric: the range [min(w, 0), max(w, 0)] onto [0, qmax] with an
    integer z. K is zero-padded to a group multiple (padded columns dequantize to exactly 0).

    ``zero_point="float"`` (zero fp32, asymmetric): HQQ's grid. Per group, the inverse scale
    i = min(qmax / (max - min), 2e4) and z = -min * i (a float), u = clamp(round(w * i + z)),
    s = 1 / i. With ``optimizer="hqq"`` z is then refined by HQQ's half-quadratic solver
    (``fxquant.core.hqq.optimize_zero``; for b = 4 the initial z is rounded first, as HQQ's 4-bit
    config does). K must be a multiple of g (HQQ's groups have no padding). ``grid="mlx"``
    (no optimizer): MLX's affine grid instead (the module docstring), z = -min / s.
    """
    n, k = w.shape
    qmax = 2**bits - 1
    kp = -(-k // group_size) * group_size
    w = w.float()
    if zero_point == "float":
        if kp != k:
            raise ValueError(
                f"float zero points need K={k} to be a multiple of group_size={group_size}"
            )
        groups = w.reshape(-1, group_size)  # HQQ axis=1: groups of g consecutive columns
        lo = groups.amin(dim=-1, keepdim=True)
        hi = groups.amax(dim=-1, keepdim=True)
        if grid == "mlx":
            if optimizer is not None:
                raise ValueError(f"grid='mlx' rounds to nearest; optimizer={optimizer!r} given")
            scale = ((hi - lo) / qmax).clamp(min=MLX_MIN_SCALE)
            u = torch.round((groups - lo) / scale).clamp(0, qmax).reshape(n, kp)
            zero = (-lo / scale).reshape(n, kp // group_size)
            return pack_intx(u.to(torch.uint8), bits), scale.reshape(zero.shape), zero
        if grid != "hqq":
            raise ValueError(f"grid={grid!r} is not supported; allowed: {', '.join(INTX_GRIDS)}")
        inv = (qmax / (hi - lo)).clamp(max=HQQ_MAX_INV_SCALE)
        zero = -lo * inv
        if optimizer == "hqq":
            if bits == 4:
                zero = torch.round(zero)
            zero = hqq.optimize_zero(groups, inv, zero, qmax=qmax).zero
        elif optimizer is not None:
            raise ValueError(f"optimizer={optimizer!r} is not supported; allowed: None, 'hqq'")
        u = torch.round(groups * inv + zero).clamp(0, qmax).reshape(n, kp)
        scale = (1.0 / inv).reshape(n, kp // group_size)
        zero = zero.reshape(n, kp // group_size)
        return pack_intx(u.to(torch.uint8), bits), scale, zero
    if zero_point != "int" or optimizer is not None or grid != "hqq":
        raise ValueError(
            f"zero_point={zero_point!r}, optimizer={optimizer!r}, grid={grid!r} is not "
            "supported; allowed: zero_point 'int' (no optimizer, grid 'hqq') or 'float' "
            "(optimizer None or 'hqq'; grid 'hqq', or 'mlx' without an optimizer)"
        )
    w = F.pad(w, (0, kp - k)).reshape(n, kp // group_size, group_size)
    u, scale, zero = integer_grid(w, bits=bits, symmetric=symmetric)
    return pack_intx(u.reshape(n, kp), bits), scale, zero


def dequantize_intx_grouped(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, *, bits: int, group_size: int
) -> torch.Tensor:
    """→ W fp32 [N, Kp] (still padded; slice [:, :K]). w = (u - z) * s, z int or float."""
    u = unpack_intx(packed, bits).float()
    n, kp = u.shape
    u = u.reshape(n, kp // group_size, group_size)
    return ((u - zero.float()[..., None]) * scale[..., None]).reshape(n, kp)


def intx_weight_only_linear(x, weight, scale, zero, bias=None, *, bits: int, group_size: int):
    w = dequantize_intx_grouped(weight, scale, zero, bits=bits, group_size=group_size)
    y = x.float() @ w[:, : x.shape[-1]].t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


def sinq_weight_only_linear(
    x, weight, scale, zero, col_scale, bias=None, *, bits: int, group_size: int
):
    """SINQ's dual-scaled weight (``fxquant.core.sinq``): the grouped int-N weight of
    ``IntxWeightOnly`` on x scaled per input column, y = (x ⊙ col_scale) · ((u - z) ⊙ s)ᵀ."""
    w = dequantize_intx_grouped(weight, scale, zero, bits=bits, group_size=group_size)
    k = x.shape[-1]
    y = (x.float() * col_scale[:k].float()) @ w[:, :k].t()
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)


# --------------------------------------------------------------------------------------------
# BitNet b1.58: ternary weights (transformers' packing) × int8 per-token activations
# --------------------------------------------------------------------------------------------


def pack_bitnet(wq: torch.Tensor) -> torch.Tensor:
    """Ternary W [N, K] (values -1, 0, 1; N a multiple of 4) → uint8 [N/4, K], transformers'
    ``pack_weights`` layout: with R = N/4, byte [r, k] holds rows r, R + r, 2R + r, 3R + r of
    column k in its bit pairs 0-1, 2-3, 4-5, 6-7, each stored as w + 1 in {0, 1, 2}."""
    n, k = wq.shape
    if n % 4:
        raise ValueError(f"BitNet packs 4 rows per byte: out_features={n} is not a multiple of 4")
    u = (wq.to(torch.int16) + 1).to(torch.uint8).reshape(4, n // 4, k)
    return u[0] | (u[1] << 2) | (u[2] << 4) | (u[3] << 6)


def unpack_bitnet(packed: torch.Tensor) -> torch.Tensor:
    """uint8 [N/4, K] → int8 [N, K] in {-1, 0, 1} (transformers' ``unpack_weights``)."""
    rows = [((packed >> (2 * i)) & 0x3) for i in range(4)]
    return (torch.cat(rows, dim=0).to(torch.int8) - 1).contiguous()


def quantize_bitnet_weight(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] → (packed uint8 [N/4, K], weight_scale fp32 [1] = 1 / mean|W|): transformers'
    ``WeightQuant`` rule (its eps 1e-5), so an all-zero W gives zeros, not NaN."""
    w = w.float()
    weight_scale = (1.0 / w.abs().mean().clamp(min=BITNET_EPS)).reshape(1)
    wq = torch.round(w * weight_scale).clamp(-1, 1)
    return pack_bitnet(wq), weight_scale


def quantize_bitnet_activation(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] → (int8 [..., K], the multiplier s_x fp32 [..., 1] = 127 / amax)."""
    x = x.float()
    # a Python scalar over a tensor, as transformers writes it: torch computes
    # reciprocal(amax) * 127 (not always the correctly rounded quotient); kernels do the same
    inv = BITNET_ACT_MAX / x.abs().amax(dim=-1, keepdim=True).clamp(min=BITNET_EPS)
    return torch.round(x * inv).clamp(-128, 127).to(torch.int8), inv


def bitnet_linear(x, weight, weight_scale, bias=None):
    """transformers' ``BitLinear.forward`` in fp32: (x_q · w_qᵀ) / (s_x · weight_scale) + bias."""
    xq, inv = quantize_bitnet_activation(x)
    y = (xq.float() @ unpack_bitnet(weight).float().t()) / (inv * weight_scale)
    if bias is not None:
        y = y + bias.float()
    return y.to(x.dtype)
