"""Reference math: every format's quantize, dequantize and linear, written once in plain torch.

This is the truth the rest of fxquant is tested against. The rewrite pass calls the weight
quantizers here (once, at quantize time); the ``fxquant::`` ops use the linears here as their
eager implementation; CPU lowerings, Triton kernels and checkpoint loaders are all compared with
these functions in the tests.

Conventions (see ../shared/DESIGN.md "Numerics"):
- W is [N, K] (out_features, in_features); x is [..., K]. Scales are fp32 dequant multipliers.
- amax is clamped to ``EPS`` before any division, so all-zero rows, groups and blocks give zero
  scales' worth of zeros, never NaN.
- Linears accumulate in fp32 and return the activation dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

EPS = 1e-12
FP8_E4M3_MAX = torch.finfo(torch.float8_e4m3fn).max  # 448
FP8_E5M2_MAX = torch.finfo(torch.float8_e5m2).max  # 57344
INT8_MAX = 127

# --------------------------------------------------------------------------------------------
# int8 symmetric: q = round(w / s), s = amax / 127
# --------------------------------------------------------------------------------------------


def quantize_int8_per_channel(
    w: torch.Tensor, *, grid: str = "fxquant"
) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] float → (q int8 [N, K], scale fp32 [N]); experts' [E, N, K] → [E, N, K], [E, N].
    ``grid``: fxquant's amax / 127, or a library's (``library_grid``)."""
    if grid != "fxquant":
        u, scale, _ = library_grid(w, bits=8, symmetric=True, grid=grid)
        return (u.to(torch.int16) - 128).to(torch.int8), scale
    w = w.float()
    scale = w.abs().amax(dim=-1).clamp(min=EPS) / INT8_MAX
    q = torch.round(w / scale[..., None]).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def quantize_int8_per_token(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] float → (q int8 [..., K], scale fp32 [..., 1]), one scale per token."""
    x = x.float()
    scale = x.abs().amax(dim=-1, keepdim=True).clamp(min=EPS) / INT8_MAX
    q = torch.round(x / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q, scale


def dequantize_int8_per_channel(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return q.float() * scale[..., None]


# --------------------------------------------------------------------------------------------
# int4 grouped along K, stored as unsigned nibbles u in [0, 15] with w = (u - z) * s;
# two nibbles per byte along K (low nibble = even column), so the weight is [N, K/2] uint8.
# --------------------------------------------------------------------------------------------


def quantize_int4_grouped(
    w: torch.Tensor, *, group_size: int, symmetric: bool, grid: str = "fxquant"
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """W [N, K] → (packed uint8 [N, Kp/2], scale fp32 [N, Kp/g], zero uint8 [N, Kp/g]).

    K is zero-padded to Kp, a multiple of ``group_size``; padded columns dequantize to exactly
    zero (asymmetric ranges always include 0, and z is an integer), so the result is unchanged.
    Symmetric: u = q + 8 with q in [-8, 7], s = amax / 7, z = 8.
    Asymmetric: range [min(w, 0), max(w, 0)] mapped to [0, 15], integer zero point z.
    """
    n, k = w.shape
    kp = -(-k // group_size) * group_size
    if grid != "fxquant":  # another library's grid, in the weight's dtype as it computes
        groups = F.pad(w, (0, kp - k)).reshape(n, kp // group_size, group_size)
        u, scale, zero = library_grid(groups, bits=4, symmetric=symmetric, grid=grid)
        return pack_int4(u.reshape(n, kp)), scale, zero
    w = F.pad(w.float(), (0, kp - k)).reshape(n, kp // group_size, group_size)
    u, scale, zero = integer_grid(w, bits=4, symmetric=symmetric)
    return pack_int4(u.reshape(n, kp)), scale, zero


def integer_grid(
    groups: torch.Tensor, *, bits: int, symmetric: bool
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups [..., g] → (codes u uint8 [..., g], scale fp32 [...], integer zero uint8 [...])
    with w ≈ (u - z)·s, for codes of ``bits`` bits (qmax = 2**b - 1): the int4 rule above, and
    ``reference_lowbit``'s int2/int3. Symmetric: s = amax / (2**(b-1) - 1), z = 2**(b-1),
    u = clamp(round(w / s), -z, z - 1) + z. Asymmetric: the range [min(w, 0), max(w, 0)] onto
    [0, qmax] with an integer z (a group of zeros gives u = z, never NaN)."""
    qmax = 2**bits - 1
    if symmetric:
        half = 2 ** (bits - 1)
        scale = groups.abs().amax(dim=-1).clamp(min=EPS) / (half - 1)
        zero = torch.full_like(scale, half)
        u = torch.round(groups / scale[..., None]).clamp(-half, half - 1) + half
    else:
        lo = groups.amin(dim=-1).clamp(max=0)
        hi = groups.amax(dim=-1).clamp(min=0)
        scale = ((hi - lo) / qmax).clamp(min=EPS)
        zero = torch.round(-lo / scale).clamp(0, qmax)
        u = (torch.round(groups / scale[..., None]) + zero[..., None]).clamp(0, qmax)
    return u.to(torch.uint8), scale, zero.to(torch.uint8)


# --------------------------------------------------------------------------------------------
# Other libraries' integer grids (``grid=`` of Int8WeightOnly / Int4WeightOnly), each bit for bit
# that library's quantizer, computed in the weight's own dtype as they do:
#
# - "torchao" (``choose_qparams_affine`` + ``quantize_affine``, MappingType.SYMMETRIC): s =
#   amax / ((qmax - qmin) / 2) = amax / 127.5 (int8) or / 7.5 (int4); q = clamp(round(w · (1 / s)),
#   -2^(b-1), 2^(b-1) - 1) (the reciprocal first, as quantize_affine multiplies by it). int8 is
#   Int8WeightOnlyConfig's (s at least fp32's eps, stored and applied in fp32), int4
#   IntxWeightOnlyConfig's (s at least the dtype's smallest normal, all in the weight's dtype).
# - "compressed-tensors" (``calculate_qparams`` + ``_quantize``): symmetric s = amax / (range / 2)
#   = amax / 127.5 (int8) or / 7.5 (int4), a zero s replaced by the dtype's eps; q = clamp(round(w
#   / s), -2^(b-1), 2^(b-1) - 1); asymmetric s = (max(w, 0) - min(w, 0)) / (2^b - 1), zero point
#   zp = round(-2^(b-1) - min / s) (clamped), q = clamp(round(w / s + zp), ...).
#
# Both reach the code -2^(b-1) (-128, -8), which fxquant's own grid (amax / 127, / 7) never uses;
# stored as every int grid is: u = q + 2^(b-1), z = 2^(b-1) (symmetric) or zp + 2^(b-1).
# --------------------------------------------------------------------------------------------

INT_GRIDS = ("fxquant", "torchao", "compressed-tensors")


def library_grid(
    groups: torch.Tensor, *, bits: int, symmetric: bool, grid: str
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Groups [..., g] (in the weight's dtype) → (codes u uint8, scale fp32, zero uint8) on
    ``grid`` ("torchao" or "compressed-tensors"; the comment above)."""
    half = 2 ** (bits - 1)
    dt = groups.dtype
    lo = groups.amin(dim=-1).clamp(max=0)
    hi = groups.amax(dim=-1).clamp(min=0)
    if grid == "torchao":
        if not symmetric:
            raise ValueError("torchao's grid here is symmetric (MappingType.SYMMETRIC)")
        scale = torch.maximum(-lo, hi) / ((2 * half - 1) / 2)
        if bits == 8:  # Int8WeightOnlyConfig (Int8Tensor): fp32's eps, an fp32 scale and product
            scale = scale.clamp(min=torch.finfo(torch.float32).eps).float()
            groups = groups.float()
        else:  # IntxWeightOnlyConfig: the dtype's smallest normal, all in the weight's dtype
            scale = scale.clamp(min=torch.finfo(dt).smallest_normal)
        q = torch.round(groups * (1.0 / scale[..., None])).clamp(-half, half - 1)
        zero = torch.full_like(scale, half)
    elif grid == "compressed-tensors":
        eps = torch.finfo(dt).eps
        if symmetric:
            scale = torch.maximum(-lo, hi) / ((2 * half - 1) / 2)
            scale = torch.where(scale == 0, torch.tensor(eps, dtype=dt), scale)
            q = torch.round(groups / scale[..., None]).clamp(-half, half - 1)
            zero = torch.full_like(scale, half)
        else:
            scale = (hi - lo) / (2 * half - 1)
            # the zero point comes from the scale before the eps goes in: an all-zero group's
            # is 0/0, which compressed-tensors' int8 cast turns into 0
            flat = scale == 0
            zp = torch.round((-half - lo / torch.where(flat, 1.0, scale)).clamp(-half, half - 1))
            zp = torch.where(flat, torch.zeros_like(zp), zp)
            scale = torch.where(flat, torch.tensor(eps, dtype=dt), scale)
            q = torch.round(groups / scale[..., None] + zp[..., None]).clamp(-half, half - 1)
            zero = zp + half
    else:
        raise ValueError(f"integer grid {grid!r} is not supported; allowed: {INT_GRIDS}")
    return (q + half).to(torch.uint8), scale.float(), zero.to(torch.uint8)


def pack_int4(u: torch.Tensor) -> torch.Tensor:
    """[..., N, K] uint8 values in [0, 15] → [..., N, K/2] uint8, low nibble first."""
    return u[..., 0::2] | (u[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """[..., N, K/2] uint8 → [..., N, K] uint8 values in [0, 15]."""
    low = packed & 0x0F
    high = packed >> 4
    return torch.stack([low, high], dim=-1).flatten(-2)


def dequantize_int4_grouped(
    packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor, *, group_size: int
) -> torch.Tensor:
    """→ W fp32 [N, Kp] (still padded; slice [:, :K])."""
    u = unpack_int4(packed).float()
    n, kp = u.shape
    u = u.reshape(n, kp // group_size, group_size)
    w = (u - zero.float()[..., None]) * scale[..., None]
    return w.reshape(n, kp)


# --------------------------------------------------------------------------------------------
# float8 e4m3: scale = amax / 448 (a dequant multiplier); values saturate at ±448
# --------------------------------------------------------------------------------------------


def _to_fp8(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return (t / scale).clamp(-FP8_E4M3_MAX, FP8_E4M3_MAX).to(torch.float8_e4m3fn)


def fp8_scale(amax: torch.Tensor, ub: float | None = None) -> torch.Tensor:
    """An e4m3 dequant scale from an absolute max: amax (capped at ``ub``) / 448, never 0."""
    if ub is not None:
        amax = amax.clamp(max=ub)
    return amax.clamp(min=EPS) / FP8_E4M3_MAX


def quantize_fp8_per_channel(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] → (q e4m3 [N, K], scale fp32 [N]); experts' [E, N, K] → scale [E, N]."""
    w = w.float()
    scale = fp8_scale(w.abs().amax(dim=-1), None)
    return _to_fp8(w, scale[..., None]), scale


def quantize_fp8_per_tensor(
    t: torch.Tensor, *, scale_ub: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Any tensor → (q e4m3, scale fp32 of shape [1])."""
    t = t.float()
    scale = fp8_scale(t.abs().amax().reshape(1), scale_ub)
    return _to_fp8(t, scale), scale


def quantize_fp8_per_token(
    x: torch.Tensor, *, scale_ub: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] → (q e4m3 [..., K], scale fp32 [..., 1])."""
    x = x.float()
    scale = fp8_scale(x.abs().amax(dim=-1, keepdim=True), scale_ub)
    return _to_fp8(x, scale), scale


def quantize_fp8_groups(x: torch.Tensor, *, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., K] → (q e4m3 [..., K], scale fp32 [..., ceil(K/g)]): 1×g groups along K.

    A last group shorter than g takes its scale from the elements it has.
    """
    x = x.float()
    k = x.shape[-1]
    kp = -(-k // group_size) * group_size
    xg = F.pad(x, (0, kp - k)).unflatten(-1, (kp // group_size, group_size))
    scale = fp8_scale(xg.abs().amax(dim=-1), None)
    # x over its group's scale expanded along K, not the padded groups flattened and sliced
    # back: Inductor (torch 2.13, CPU) compiled that slice's loop over whole groups only and
    # left a ragged last group's values unwritten (see expand_group_scale)
    q = _to_fp8(x, expand_group_scale(scale, cols=k, group_size=group_size))
    return q, scale


def quantize_fp8_blocks(w: torch.Tensor, *, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """W [N, K] → (q e4m3 [N, K], scale fp32 [ceil(N/b), ceil(K/b)]): b×b tiles."""
    w = w.float()
    n, k = w.shape
    b = block_size
    np_, kp = -(-n // b) * b, -(-k // b) * b
    tiles = F.pad(w, (0, kp - k, 0, np_ - n)).reshape(np_ // b, b, kp // b, b)
    scale = fp8_scale(tiles.abs().amax(dim=(1, 3)), None)
    # contiguous: a strided constant would be copied on every call of a compiled program
    q = _to_fp8(tiles, scale[:, None, :, None]).reshape(np_, kp)[:n, :k].contiguous()
    return q, scale


# A ragged last block's scales are concatenated after the whole blocks' (repeated), not
# repeated with the rest and sliced back, nor gathered by k // b: Inductor (torch 2.13, CPU)
# compiled both of those, fused into their consumers, into loops that never wrote the ragged
# block's elements (garbage; NaN in an LLM with K = 576 and groups of 128).


def _repeat_blocks(scale: torch.Tensor, dim: int, size: int, block: int) -> torch.Tensor:
    """``scale`` (one value per block along ``dim``) repeated over each block's ``block``
    elements, the last block over what is left of ``size``."""
    whole = size // block
    out = scale.narrow(dim, 0, whole).repeat_interleave(block, dim)
    if size % block:
        tail = scale.narrow(dim, whole, 1)
        sizes = list(tail.shape)
        sizes[dim] = size % block
        out = torch.cat([out, tail.expand(sizes)], dim)
    return out


def expand_block_scale(scale: torch.Tensor, *, rows: int, cols: int, block_size: int):
    """[..., ceil(R/b), ceil(C/b)] → [..., R, C] (each scale repeated over its tile)."""
    d = scale.dim()
    return _repeat_blocks(_repeat_blocks(scale, d - 2, rows, block_size), d - 1, cols, block_size)


def expand_group_scale(scale: torch.Tensor, *, cols: int, group_size: int) -> torch.Tensor:
    """[..., ceil(C/g)] → [..., C]."""
    return _repeat_blocks(scale, scale.dim() - 1, cols, group_size)


# --------------------------------------------------------------------------------------------
# The linears: the eager implementation of every fxquant:: op, and the oracle for every test.
# --------------------------------------------------------------------------------------------


def _finish(y: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    if bias is not None:
        y = y + bias.float()
    return y.to(dtype)


def int8_weight_only_linear(x, weight, scale, bias=None):
    y = (x.float() @ weight.float().t()) * scale
    return _finish(y, bias, x.dtype)


def expert_of_rows(offs: torch.Tensor, rows: int) -> torch.Tensor:
    """Each row's expert index from cumulative row ends ``offs`` [E]; E for rows past the end."""
    positions = torch.arange(rows, device=offs.device, dtype=offs.dtype)
    return torch.searchsorted(offs, positions, right=True)


def grouped_linear(
    x: torch.Tensor, expert_linear, offs: torch.Tensor, *per_row: torch.Tensor
) -> torch.Tensor:
    """Mixture-of-experts GEMM: the rows of x [S, K] are sorted by expert and ``offs`` [E] (int)
    holds each expert's cumulative row end, so row s uses expert e where ``offs[e-1] <= s <
    offs[e]``; ``expert_linear(rows, e, *row_values)`` is expert e's product (fp32 [rows, N]),
    ``row_values`` the same rows of each ``per_row`` tensor (an activation's scales). Rows at or
    past ``offs[-1]`` give zeros, as transformers' grouped_mm fallback (the op the experts ops
    replace in an exported graph). → fp32 [S, N]."""
    out = None
    start = 0
    for e, end in enumerate(offs.tolist()):
        y = expert_linear(x[start:end], e, *(t[start:end] for t in per_row))
        if out is None:
            out = x.new_zeros((x.shape[0], y.shape[-1]), dtype=torch.float32)
        out[start:end] = y
        start = max(start, end)
    return out


def int8_weight_only_grouped_mm(x, weight, scale, offs):
    """Experts with int8 weights [E, N, K] and per-channel scales [E, N]: each row of x [S, K]
    times its expert's weight (``grouped_linear``): ``int8_weight_only_linear`` on fp32 rows,
    the fp32 product of the integer codes, then the scale. → [S, N] in x's dtype."""

    def expert(rows, e):
        return int8_weight_only_linear(rows.float(), weight[e], scale[e])

    return grouped_linear(x, expert, offs).to(x.dtype)


def float8_weight_only_grouped_mm(x, weight, scale, offs):
    """Experts with e4m3 weights [E, N, K] and per-channel scales [E, N]: each row of x [S, K]
    times its expert's weight (``grouped_linear``): ``float8_weight_only_linear`` on fp32 rows.
    → [S, N] in x's dtype."""

    def expert(rows, e):
        return float8_weight_only_linear(rows.float(), weight[e], scale[e])

    return grouped_linear(x, expert, offs).to(x.dtype)


def int4_weight_only_grouped_mm(x, weight, scale, zero, offs, *, group_size: int):
    """Experts with int4 weights [E, N, Kp/2] and scales / zero points [E, N, Kp/g]: each row of
    x [S, K] times its expert's weight (``grouped_linear``): ``int4_weight_only_linear`` on fp32
    rows, W dequantized in fp32 (its first K columns), an fp32 product. → [S, N] in x's dtype."""

    def expert(rows, e):
        return int4_weight_only_linear(
            rows.float(), weight[e], scale[e], zero[e], group_size=group_size
        )

    return grouped_linear(x, expert, offs).to(x.dtype)


def int8_dynamic_int4_grouped_mm(x, weight, scale, zero, offs, *, group_size: int):
    """W4A8 experts: x quantized per token to int8 (a row's grid does not depend on its expert),
    then each row times its expert's int4 weight as ``int4_weight_only_grouped_mm``, then the
    token's scale: ``int8_dynamic_int4_linear`` per expert. → [S, N] in x's dtype."""
    xq, xs = quantize_int8_per_token(x)
    y = int4_weight_only_grouped_mm(xq.float(), weight, scale, zero, offs, group_size=group_size)
    return (y * xs).to(x.dtype)


def int8_dynamic_grouped_mm(x, weight, scale, offs):
    """W8A8 experts: x quantized per token to int8 (a row's grid does not depend on its
    expert), then each row times its expert's int8 W [E, N, K] with per-channel scales [E, N]
    (``grouped_linear``): ``int8_dynamic_linear`` per expert, per row. → [S, N] in x's dtype."""
    xq, xs = quantize_int8_per_token(x)

    def expert(rows, e, row_scale):
        return int8_scaled_linear(rows, row_scale, weight[e], scale[e], out_dtype=torch.float32)

    return grouped_linear(xq, expert, offs, xs).to(x.dtype)


def float8_dynamic_grouped_mm(x, weight, scale, offs, *, activation_scale_ub=None):
    """fp8 experts as FbgemmFp8Config's (Llama 4): x quantized per token to e4m3 (a row's grid
    does not depend on its expert; its amax capped at ``activation_scale_ub``), then each row
    times its expert's e4m3 W [E, N, K] with per-channel scales [E, N]
    (``grouped_linear``): ``float8_dynamic_linear`` per expert, per row. → [S, N] in x's dtype."""
    xq, xs = quantize_fp8_per_token(x, scale_ub=activation_scale_ub)

    def expert(rows, e, row_scale):
        return float8_scaled_linear(
            rows, row_scale, weight[e], scale[e], out_dtype=torch.float32
        )  # fmt: skip

    return grouped_linear(xq, expert, offs, xs).to(x.dtype)


def float8_block_grouped_mm(x, weight, scale, offs, *, block_size: int):
    """fp8 experts as FineGrainedFP8Config's (DeepSeek-V3 style): x quantized in 1×b groups per
    token (a row's groups do not depend on its expert), then each row times its expert's e4m3 W
    [E, N, K] with b×b tile scales [E, ceil(N/b), ceil(K/b)]: ``float8_block_linear`` per
    expert, per row. → [S, N] in x's dtype."""
    xq, xs = quantize_fp8_groups(x, group_size=block_size)

    def expert(rows, e, row_scales):
        return float8_block_scaled_linear(
            rows, row_scales, weight[e], scale[e], block_size=block_size, out_dtype=torch.float32
        )

    return grouped_linear(xq, expert, offs, xs).to(x.dtype)


def int4_weight_only_linear(x, weight, scale, zero, bias=None, *, group_size: int):
    w = dequantize_int4_grouped(weight, scale, zero, group_size=group_size)
    y = x.float() @ w[:, : x.shape[-1]].t()
    return _finish(y, bias, x.dtype)


def int8_dynamic_linear(x, weight, scale, bias=None):
    xq, xs = quantize_int8_per_token(x)
    return int8_scaled_linear(xq, xs, weight, scale, bias, out_dtype=x.dtype)


def int8_dynamic_int4_linear(x, weight, scale, zero, bias=None, *, group_size: int):
    """W4A8: x quantized per token to int8 (as ``int8_dynamic_linear``) · int4 W (as
    ``int4_weight_only_linear``). Both dequantized products are exact in fp32 before the sum."""
    xq, xs = quantize_int8_per_token(x)
    w = dequantize_int4_grouped(weight, scale, zero, group_size=group_size)
    y = (xq.float() @ w[:, : x.shape[-1]].t()) * xs
    return _finish(y, bias, x.dtype)


def float8_weight_only_linear(x, weight, scale, bias=None):
    y = (x.float() @ weight.float().t()) * scale
    return _finish(y, bias, x.dtype)


def float8_dynamic_linear(x, weight, scale, bias=None, *, per_row: bool, activation_scale_ub=None):
    if per_row:
        xq, xs = quantize_fp8_per_token(x, scale_ub=activation_scale_ub)
    else:
        xq, xs = quantize_fp8_per_tensor(x, scale_ub=activation_scale_ub)
    return float8_scaled_linear(xq, xs, weight, scale, bias, out_dtype=x.dtype)


def quantize_fp8_static(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x → e4m3 with a given per-tensor dequant scale [1]; values beyond ±448·scale saturate."""
    return _to_fp8(x.float(), scale)


def float8_static_linear(x, weight, scale, activation_scale, bias=None):
    xq = quantize_fp8_static(x, activation_scale)
    return float8_scaled_linear(xq, activation_scale, weight, scale, bias, out_dtype=x.dtype)


def float8_block_linear(x, weight, scale, bias=None, *, block_size: int):
    xq, xs = quantize_fp8_groups(x, group_size=block_size)
    return float8_block_scaled_linear(
        xq, xs, weight, scale, bias, block_size=block_size, out_dtype=x.dtype
    )


# --------------------------------------------------------------------------------------------
# Linears on an already-quantized activation: what a dynamic-activation linear becomes when a
# fused norm_quant (below) has quantized its input. xs is the activation's dequant scale:
# [..., 1] per token, [1] per tensor, [..., ceil(K/b)] for 1×b groups.
# --------------------------------------------------------------------------------------------


def int8_scaled_linear(xq, xs, weight, scale, bias=None, *, out_dtype: torch.dtype):
    y = (xq.float() @ weight.float().t()) * xs * scale
    return _finish(y, bias, out_dtype)


# The same math on e4m3 operands: both formats upcast exactly to fp32.
float8_scaled_linear = int8_scaled_linear


def float8_block_scaled_linear(
    xq, xs, weight, scale, bias=None, *, block_size: int, out_dtype: torch.dtype
):
    n, k = weight.shape
    x_dq = xq.float() * expand_group_scale(xs, cols=k, group_size=block_size)
    w_dq = weight.float() * expand_block_scale(scale, rows=n, cols=k, block_size=block_size)
    return _finish(x_dq @ w_dq.t(), bias, out_dtype)


# --------------------------------------------------------------------------------------------
# Norms and norm → activation quantization (the fused op's definition). The norm is computed in
# fp32 (weight and bias included) and rounded once to x's dtype, then quantized exactly as the
# linear would have quantized that tensor, so on a model whose norm matches this definition the
# fused and unfused programs agree bit for bit.
# --------------------------------------------------------------------------------------------


def rms_norm(x, weight=None, *, eps: float):
    xf = x.float()
    y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    if weight is not None:
        y = y * weight.float()
    return y.to(x.dtype)


def layer_norm(x, weight=None, bias=None, *, eps: float):
    w = None if weight is None else weight.float()
    b = None if bias is None else bias.float()
    return F.layer_norm(x.float(), (x.shape[-1],), w, b, eps).to(x.dtype)


def quantize_activation(
    x, *, quant_dtype: torch.dtype, group_size: int, scale_ub: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The activation quantizations a norm can be fused with.

    group_size: -1 per token, > 0 groups of 1×group_size along K (fp8 only). int8 is per token
    and symmetric; fp8 is e4m3. Per-tensor scales need the whole tensor's amax before any row is
    written, so they are not fused (the pass says so in the report).
    """
    if quant_dtype == torch.int8:
        if group_size != -1 or scale_ub is not None:
            raise ValueError(
                f"int8 activations are per token without a scale bound; got group_size="
                f"{group_size}, scale_ub={scale_ub}"
            )
        return quantize_int8_per_token(x)
    if quant_dtype != torch.float8_e4m3fn:
        raise ValueError(
            f"quant_dtype={quant_dtype} is not supported; allowed: torch.int8, torch.float8_e4m3fn"
        )
    if group_size == -1:
        return quantize_fp8_per_token(x, scale_ub=scale_ub)
    if group_size > 0 and scale_ub is None:
        return quantize_fp8_groups(x, group_size=group_size)
    raise ValueError(
        f"fp8 activations: group_size={group_size}, scale_ub={scale_ub} is not supported; "
        "allowed: group_size=-1 (per token, optional scale_ub) or > 0 (groups, no scale_ub)"
    )


def norm_quant(
    x,
    weight=None,
    bias=None,
    *,
    eps: float,
    rms: bool,
    quant_dtype: torch.dtype,
    group_size: int,
    scale_ub: float | None = None,
):
    """RMSNorm (``rms``, bias must be None) or LayerNorm of x, then ``quantize_activation``.

    Returns (q, scale, normed): normed is the norm's output in x's dtype, for a consumer that is
    not a quantized linear.
    """
    if rms:
        if bias is not None:
            raise ValueError("RMSNorm has no bias")
        normed = rms_norm(x, weight, eps=eps)
    else:
        normed = layer_norm(x, weight, bias, eps=eps)
    q, scale = quantize_activation(
        normed, quant_dtype=quant_dtype, group_size=group_size, scale_ub=scale_ub
    )
    return q, scale, normed


def sylvester_hadamard(size: int) -> torch.Tensor:
    """The Sylvester Hadamard matrix of order ``size`` (a power of two), entries ±1, fp32:
    H_1 = [1], H_2n = [[H, H], [H, -H]] (scipy's ``hadamard``; the fast Walsh-Hadamard
    transform multiplies by it). Symmetric; H·Hᵀ = size·I."""
    if size < 1 or size & (size - 1):
        raise ValueError(f"Hadamard size {size} is not supported; allowed: a power of two")
    h = torch.ones(1, 1)
    while h.shape[0] < size:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def sqnr(ref: torch.Tensor, approx: torch.Tensor) -> float:
    """Signal-to-quantization-noise ratio in dB (inf when exact)."""
    ref, approx = ref.detach().double(), approx.detach().double()
    noise = (ref - approx).pow(2).sum()
    if noise == 0:
        return float("inf")
    return float(10 * torch.log10(ref.pow(2).sum().clamp(min=1e-30) / noise))
