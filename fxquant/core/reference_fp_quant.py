"""Reference math of FP-Quant (transformers' ``FPQuantConfig``, IST-DASLab's ``fp_quant`` and
its QuTLASS kernels): a block rotation of weights and activations, then MXFP4 or NVFP4 with
FP-Quant's own scale rules.

Where it sits: beside ``fxquant.core.reference_mx``, whose e2m1 / E8M0 helpers it uses. The
scheme ``FPQuant`` (``fxquant/core/schemes/fp_quant.py``) quantizes weights with it; the
``fxquant::fp_quant_linear`` op runs :func:`fp_quant_linear` as its eager kernel; the CPU
lowering compiles it with Inductor, and the Triton kernel (``fxquant.kernels.fp_quant``) and the
checkpoint reader (``fxquant.checkpoints.fp_quant``) are tested against it.

**Rotation.** K is cut into groups of g (``hadamard_group_size``: 16, 32, 64 or 128) and each
group of x and of every weight row is multiplied by one g×g orthogonal matrix R (x ↦ x·R). As
(x·R)·(w·R)ᵀ = x·wᵀ, the GEMM runs on the rotated operands and needs no inverse; the rotation
spreads an outlier over its group, so the 4-bit grid fits better. R is ``"hadamard"`` (the
Sylvester Hadamard matrix / √g, scipy's ``hadamard``), ``"gsr"`` (its columns sorted by
sequency, the number of sign changes down each column) or ``"identity"``. FP-Quant builds R in
the model's dtype, bf16 (transformers loads FP-Quant models in bf16 only), and casts x and W to
bf16 before rotating: both roundings are kept here, so an fp32 model sees what a bf16 one does.

**Scale rules** (QuTLASS ``fusedQuantizeMx`` / ``fusedQuantizeNv``, on the rotated values):

- MXFP4 ``"quest"``: per 32 values, σ = √(mean(v²) − mean(v)²) (the population deviation; a
  negative rounding gives σ := 1), scale 2**floor(log2(σ · 2.92247856 / 6 + 1e-8)) (the
  Gaussian MSE-optimal clip for e2m1 at QuEST's factor), codes e2m1(v / scale): the tails clip
  at ±6 · scale. The tensor ("global") scale is 1.
- MXFP4 ``"abs_max"``: scale 2**floor(log2(amax + 1e-8)), codes e2m1(3 · v / scale): the block's
  largest value lands in [3, 6), and the tensor scale 3 divides it back out.
- NVFP4 ``"abs_max"``: per 16 values, s = e4m3(G · amax / 6) (saturating at 448), codes
  e2m1(v / (s / G)), G the tensor scale (FP-Quant sets 3 for weights and activations alike).

Every element is e2m1 rounded to nearest, ties to even, saturating at ±6 (``cvt.rn.satfinite``
in QuTLASS). FP-Quant's Triton pseudo-quantizer (``pseudoquantization=True``) rounds ties toward
zero instead; the two differ only where a value falls exactly halfway between grid points.
A value dequantizes as ``e2m1 · block scale / G``; the GEMM is y = x̂·ŵᵀ in fp32, where
QuTLASS multiplies the block-scaled product by α = 1 / (G_w · G_x).

Layouts are ``reference_mx``'s: codes two a byte along K, the even column in the low nibble;
E8M0 scales as uint8 [N, K/32], NVFP4 block scales float8_e4m3fn [N, K/16]; the global scales
fp32 [1] each.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fxquant.core import reference_mx as ref_mx
from fxquant.core.reference import FP8_E4M3_MAX, _finish, sylvester_hadamard

FP_QUANT_DTYPES = ("mxfp4", "nvfp4")
FP_QUANT_METHODS = {"mxfp4": ("abs_max", "quest"), "nvfp4": ("abs_max",)}
FP_QUANT_ROTATIONS = ("hadamard", "gsr", "identity")
FP_QUANT_ROTATION_SIZES = {"mxfp4": (32, 64, 128), "nvfp4": (16, 32, 64, 128)}
BLOCK = {"mxfp4": ref_mx.MX_BLOCK, "nvfp4": ref_mx.NVFP4_BLOCK}
QUEST_CLIP = 2.92247856 / 6.0  # QuEST: σ · 2.92 is the MSE-optimal e2m1 clip of a Gaussian
SCALE_EPS = 1e-8  # QuTLASS adds it to σ · QUEST_CLIP and to amax before taking the exponent
ABS_MAX_GAIN = 3.0  # MXFP4 abs_max: v / 2**floor(log2 amax) ∈ [1, 2) is multiplied into [3, 6)


def global_scale(dtype: str, method: str) -> float:
    """The tensor scale FP-Quant gives weights and activations (``FPQuantLinear.pre_forward``):
    1 for MXFP4 QuEST, 3 for abs_max (MXFP4's fixed gain; NVFP4 gets the same 3, as the branch
    order there makes it)."""
    return 1.0 if (dtype, method) == ("mxfp4", "quest") else ABS_MAX_GAIN


# --------------------------------------------------------------------------------------------
# Rotations
# --------------------------------------------------------------------------------------------


def hadamard_matrix(size: int) -> Tensor:
    """The Sylvester Hadamard matrix of order ``size`` (a power of two) over √size, fp32 holding
    bf16 values (FP-Quant's ``get_hadamard_matrix`` in a bf16 model)."""
    return (sylvester_hadamard(size) * size**-0.5).to(torch.bfloat16).float()


def sequency(h: Tensor) -> Tensor:
    """The number of sign changes down each column of ``h`` (a Walsh function's sequency)."""
    return torch.diff(h, dim=0).ne(0).sum(dim=0)


def rotation_matrix(kind: str, size: int) -> Tensor:
    """R [size, size] fp32 for ``kind`` in ``FP_QUANT_ROTATIONS`` (module docstring)."""
    if kind == "identity":
        sylvester_hadamard(size)  # the same check: a power of two
        return torch.eye(size)
    h = hadamard_matrix(size)
    if kind == "hadamard":
        return h
    if kind == "gsr":  # the sequencies are 0 … size-1, each once: the order is unique
        return h[:, torch.argsort(sequency(h))].contiguous()
    raise ValueError(f"rotation {kind!r} is not supported; allowed: {FP_QUANT_ROTATIONS}")


def rotate(t: Tensor, rotation: Tensor) -> Tensor:
    """t [..., K] → t·R in each group of g = R.shape[0] along K (fp32), t rounded to bf16
    first as FP-Quant's quantizer takes it."""
    g, k = rotation.shape[0], t.shape[-1]
    if k % g:
        raise ValueError(
            f"FP-Quant rotation: K={k} is not a multiple of the rotation size {g}; allowed: K "
            f"divisible by {g}"
        )
    groups = round_to_bf16(t).unflatten(-1, (k // g, g))
    return (groups @ rotation.float()).flatten(-2)


def round_to_bf16(t: Tensor) -> Tensor:
    """t → fp32 holding t rounded to bf16 (ties to even), on the bit pattern: what
    ``t.to(torch.bfloat16).float()`` gives, in a form Inductor cannot drop (it elides a
    down-and-up cast pair, so the compiled program would rotate the unrounded fp32 value)."""
    bits = t.float().view(torch.int32)
    bits = (bits + 0x7FFF + (bits >> 16 & 1)) & -0x10000
    return bits.view(torch.float32)


# --------------------------------------------------------------------------------------------
# Quantizers (on rotated values)
# --------------------------------------------------------------------------------------------


def _floor_pow2_exponent(s: Tensor) -> Tensor:
    """floor(log2(s)) for s > 0 (int32), exactly: QuTLASS masks the fp32 exponent bits."""
    _, e = torch.frexp(s)
    return (e - 1).clamp(ref_mx.E8M0_MIN_EXP, ref_mx.E8M0_MAX_EXP).to(torch.int32)


def quantize(v: Tensor, *, dtype: str, method: str, global_scale: Tensor) -> tuple[Tensor, Tensor]:
    """Rotated values v [..., K] → (e2m1 codes uint8 [..., K], block scales): E8M0 uint8
    [..., K/32] for MXFP4, float8_e4m3fn [..., K/16] for NVFP4. ``global_scale`` (fp32 [1]) is
    read by NVFP4 only: MXFP4's kernels apply their fixed gain (module docstring)."""
    if method not in FP_QUANT_METHODS.get(dtype, ()):
        raise ValueError(
            f"FP-Quant dtype={dtype!r} method={method!r} is not supported; allowed: "
            f"{FP_QUANT_METHODS}"
        )
    b = ref_mx._blocks(v, BLOCK[dtype], "FP-Quant quantization")
    if dtype == "mxfp4":
        if method == "quest":
            mean = b.sum(-1) / b.shape[-1]
            var = (b * b).sum(-1) / b.shape[-1] - mean * mean
            s = torch.where(var >= 0, var.clamp(min=0).sqrt() * QUEST_CLIP + SCALE_EPS, 1.0)
            gain = 1.0
        else:
            s, gain = b.abs().amax(-1) + SCALE_EPS, ABS_MAX_GAIN
        exp = _floor_pow2_exponent(s)
        scale = (exp + ref_mx.E8M0_BIAS).to(torch.uint8)
        scaled = b / ref_mx.e8m0_to_float(scale)[..., None] * gain
    else:
        g = global_scale.float().reshape(())
        sf = (g * (b.abs().amax(-1) * (1.0 / ref_mx.E2M1_MAX))).clamp(max=FP8_E4M3_MAX)
        scale = sf.to(torch.float8_e4m3fn)
        s = scale.float()
        inv = torch.where(s == 0, torch.zeros_like(s), 1.0 / (s * (1.0 / g)))
        scaled = b * inv[..., None]
    codes = ref_mx.encode_e2m1(ref_mx.round_to_e2m1(scaled))
    return codes.flatten(-2), scale


def dequantize(codes: Tensor, scale: Tensor, global_scale: Tensor, *, dtype: str) -> Tensor:
    """(codes [..., K], block scales, fp32 [1] tensor scale) → rotated values, fp32."""
    block = ref_mx.e8m0_to_float(scale) if dtype == "mxfp4" else scale.float()
    v = ref_mx.decode_e2m1(codes).unflatten(-1, (-1, BLOCK[dtype])) * block[..., None]
    return v.flatten(-2) / global_scale.float().reshape(())


def fake_quantize(
    t: Tensor, rotation: Tensor, global_scale: Tensor, *, dtype: str, method: str
) -> Tensor:
    """t [..., K] → its FP-Quant-quantized values in the rotated basis (fp32): what a run-time
    activation feeds the GEMM."""
    codes, scale = quantize(
        rotate(t, rotation), dtype=dtype, method=method, global_scale=global_scale
    )
    return dequantize(codes, scale, global_scale, dtype=dtype)


def quantize_weight(
    w: Tensor, *, dtype: str, method: str, rotation: Tensor
) -> tuple[Tensor, Tensor, Tensor]:
    """W [N, K] → (packed e2m1 uint8 [N, K/2], block scales, fp32 [1] global scale), in the
    rotated basis, as ``FPQuantLinear.pre_forward`` stores ``qweight`` / ``scales`` /
    ``weight_global_scale``."""
    g = torch.tensor([global_scale(dtype, method)])
    codes, scale = quantize(rotate(w, rotation), dtype=dtype, method=method, global_scale=g)
    return ref_mx.pack_fp4(codes), scale, g


def dequantize_weight(packed: Tensor, scale: Tensor, global_scale: Tensor, *, dtype: str) -> Tensor:
    """The stored weight → ŵ in the rotated basis, fp32 [N, K]."""
    return dequantize(ref_mx.unpack_fp4(packed), scale, global_scale, dtype=dtype)


def unrotate(t: Tensor, rotation: Tensor) -> Tensor:
    """t·Rᵀ per group: rotated values back in the original basis (R's bf16 rounding makes this
    an inverse to ~1e-3; only the report uses it, for the SQNR against the float weight)."""
    g, k = rotation.shape[0], t.shape[-1]
    return (t.float().unflatten(-1, (k // g, g)) @ rotation.float().t()).flatten(-2)


def fp_quant_linear(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    rotation: Tensor,
    weight_global_scale: Tensor,
    act_global_scale: Tensor,
    bias: Tensor | None = None,
    *,
    dtype: str,
    method: str,
) -> Tensor:
    """x [..., K] rotated and quantized at run time with FP-Quant's rule · the stored rotated
    weight (packed e2m1 [N, K/2], block scales, global scale), fp32 accumulation, + bias."""
    x_dq = fake_quantize(x, rotation, act_global_scale, dtype=dtype, method=method)
    w_dq = dequantize_weight(weight, scale, weight_global_scale, dtype=dtype)
    return _finish(x_dq @ w_dq.t(), bias, x.dtype)
