"""HIGGS (``higgs``): a Hadamard rotation per block of weights, then vector quantization onto
Gaussian MSE-optimal grids (transformers' ``HiggsConfig``).

Declaration (``fxquant.core.scheme``); reference math in ``fxquant.core.higgs``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fxquant.core import higgs
from fxquant.core.scheme import QuantizedWeight, Scheme, check_choice, recipe, register_scheme


@register_scheme
@dataclass(frozen=True, kw_only=True)
class Higgs(Scheme):
    """HIGGS weight-only quantization: each block of ``hadamard_size`` weights along K is rotated
    by a Hadamard matrix and normalised, then every ``p`` consecutive values are replaced by the
    index of the nearest point of a grid of 2^(p·bits) points, MSE-optimal for the standard
    Gaussian; one fp32 scale per block. The activation is rotated the same way at run time and
    stays in float (``fxquant.core.higgs``).

    Recipes ``higgs-int4`` (transformers' ``HiggsConfig()`` default: 4 bits, p = 2, blocks of
    512, groups of 256) and ``higgs-int4-64`` (groups of 64, so that models whose K is not a
    multiple of 256 are quantized whole). Sizes: bits per weight + 32 / hadamard_size (codes
    stored one byte per p values: 4 bits a weight at p = 2, 8 at p = 1).

    Args:
        bits: 2, 3 or 4 bits a weight.
        p: 2 (default; pairs of values, the better grids) or 1 (scalar grids).
        hadamard_size: the rotation block, a power of two ≥ ``group_size``; K is padded to it.
        group_size: 64, 128 or 256, HiggsConfig's storage group (its GPU kernel's); K must be a
            multiple, as transformers requires (other layers are skipped). No numeric effect.
    """

    name: ClassVar[str] = "higgs"
    # codes uint8 [N, Kp/p] (rotated basis); block scales fp32 [N, Kp/h]; grid fp32 [2^(pb), p]
    constants = ("qweight", "scale", "grid")
    op_params = (("hadamard_size", "SymInt"),)
    reference = staticmethod(higgs.higgs_linear)
    bits: int = 4
    p: int = 2
    hadamard_size: int = 512
    group_size: int = 256

    def __post_init__(self) -> None:
        check_choice("Higgs", "bits", self.bits, higgs.HIGGS_BITS)
        check_choice("Higgs", "p", self.p, higgs.HIGGS_P)
        check_choice("Higgs", "group_size", self.group_size, higgs.HIGGS_GROUP_SIZES)
        h = self.hadamard_size
        if isinstance(h, bool) or not isinstance(h, int) or h < self.group_size or h & (h - 1):
            raise ValueError(
                f"Higgs.hadamard_size={h!r} is not supported; allowed: a power of two >= "
                f"group_size={self.group_size}"
            )

    def unsupported_reason(self, *, out_features: int, in_features: int) -> str | None:
        if in_features % self.group_size:
            return (
                f"in_features={in_features} is not a multiple of group_size={self.group_size} "
                "(HiggsConfig's layers need whole groups)"
            )
        return None

    def padded_in_features(self, in_features: int) -> int:
        h = self.hadamard_size
        return -(-in_features // h) * h

    def quantize(self, w):
        codes, s = higgs.quantize(w, bits=self.bits, p=self.p, hadamard_size=self.hadamard_size)
        g = higgs.grid(self.p, self.bits)
        dq = higgs.dequantize(codes, s, g, hadamard_size=self.hadamard_size)
        tensors = {"qweight": codes, "scale": s, "grid": g}
        return QuantizedWeight(tensors, higgs.unrotate(dq, self.hadamard_size, w.shape[1]))


recipe("higgs-int4", Higgs())
# groups of 64: every layer whose K is a multiple of 64 (SmolLM2's 576, MiniLM's 384) takes it
recipe("higgs-int4-64", Higgs(group_size=64))
