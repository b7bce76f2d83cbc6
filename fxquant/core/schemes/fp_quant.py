"""FP-Quant (``fp_quant``): a block rotation of weights and activations, then MXFP4 or NVFP4
with FP-Quant's QuEST / abs_max scale rules (transformers' ``FPQuantConfig``).

Declaration (``fxquant.core.scheme``); reference math in ``fxquant.core.reference_fp_quant``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fxquant.core import reference_fp_quant as ref_fpq
from fxquant.core.scheme import QuantizedWeight, Scheme, check_choice, recipe, register_scheme


@register_scheme
@dataclass(frozen=True, kw_only=True)
class FPQuant(Scheme):
    """FP-Quant W4A4: each group of ``rotation_size`` values along K of the weight (offline) and
    of the activation (at run time) is multiplied by an orthogonal matrix, then quantized to
    MXFP4 or NVFP4 with FP-Quant's rule; the GEMM runs in the rotated basis, which gives the
    same product. Codes, scales and global scales as FP-Quant's ``qweight`` / ``scales`` /
    ``weight_global_scale`` (``fxquant.core.reference_fp_quant``).

    Recipes ``fp-quant-nvfp4`` (transformers' ``FPQuantConfig()`` default: NVFP4, abs_max,
    Hadamard of 16) and ``fp-quant-mxfp4`` (MXFP4, QuEST, Hadamard of 32: FP-Quant's own
    default, for QAT checkpoints). Sizes: 4.25 (MXFP4) / 4.5 (NVFP4) bits a weight.

    Args:
        dtype: ``"mxfp4"`` (default; E8M0 scales per 32) or ``"nvfp4"`` (e4m3 scales per 16).
        method: ``"quest"`` (default; MXFP4 only: the scale from the block's standard
            deviation, tails clipped) or ``"abs_max"`` (the scale from the block's amax).
        rotation: ``"hadamard"`` (default), ``"gsr"`` (Hadamard columns in sequency order) or
            ``"identity"`` (no rotation: FP-Quant's scale rules alone).
        rotation_size: the group the rotation acts on: 32, 64, 128 for MXFP4; 16, 32, 64, 128
            for NVFP4. K must be a multiple (other layers are skipped).
    """

    name: ClassVar[str] = "fp_quant"
    quantizes_activation: ClassVar[bool] = True
    # e2m1 packed [N, K/2] (rotated basis); block scales E8M0 uint8 [N, K/32] or e4m3 [N, K/16];
    # the rotation fp32 [g, g]; FP-Quant's weight and activation global scales fp32 [1]
    constants = ("qweight", "scale", "rotation", "weight_global_scale", "act_global_scale")
    op_params = (("dtype", "str"), ("method", "str"))
    reference = staticmethod(ref_fpq.fp_quant_linear)
    dtype: str = "mxfp4"
    method: str = "quest"
    rotation: str = "hadamard"
    rotation_size: int = 32

    def __post_init__(self) -> None:
        check_choice("FPQuant", "dtype", self.dtype, ref_fpq.FP_QUANT_DTYPES)
        check_choice("FPQuant", "method", self.method, ref_fpq.FP_QUANT_METHODS[self.dtype])
        check_choice("FPQuant", "rotation", self.rotation, ref_fpq.FP_QUANT_ROTATIONS)
        sizes = ref_fpq.FP_QUANT_ROTATION_SIZES[self.dtype]
        check_choice("FPQuant", "rotation_size", self.rotation_size, sizes)

    def unsupported_reason(self, *, out_features: int, in_features: int) -> str | None:
        if in_features % self.rotation_size:
            return (
                f"in_features={in_features} is not a multiple of rotation_size="
                f"{self.rotation_size} (FP-Quant rotates and quantizes whole groups along K)"
            )
        return None

    def quantize(self, w):
        r = ref_fpq.rotation_matrix(self.rotation, self.rotation_size)
        packed, s, g = ref_fpq.quantize_weight(w, dtype=self.dtype, method=self.method, rotation=r)
        dq = ref_fpq.dequantize_weight(packed, s, g, dtype=self.dtype)
        tensors = {
            "qweight": packed,
            "scale": s,
            "rotation": r,
            "weight_global_scale": g,
            "act_global_scale": g.clone(),
        }
        return QuantizedWeight(tensors, ref_fpq.unrotate(dq, r))


recipe("fp-quant-nvfp4", FPQuant(dtype="nvfp4", method="abs_max", rotation_size=16))
recipe("fp-quant-mxfp4", FPQuant())
