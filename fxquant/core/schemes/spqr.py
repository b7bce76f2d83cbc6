"""SpQR (``spqr``): bilevel 3-bit 16×16 tiles with sparse fp16 outliers, for loading SpQR
checkpoints (transformers' ``SpQRConfig``).

Declaration (``fxquant.core.scheme``); reference math in ``fxquant.core.spqr``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from fxquant.core import spqr
from fxquant.core.scheme import Scheme, check_choice, register_scheme


@register_scheme
@dataclass(frozen=True, kw_only=True)
class Spqr(Scheme):
    """SpQR weights: 3-bit codes in 16×16 tiles whose row scales and zeros are 3-bit codes of a
    per-tile second-level fp16 grid, plus sparse fp16 outliers added on top, in a permuted input
    order (``fxquant.core.spqr``); activations in float. Loaded from checkpoints only
    (``fxquant.load_quantized``): SpQR's outlier search and rounding need its calibration, which
    fxquant does not run. Sizes: 4 bits a weight plus 32 per outlier.

    Args: the ``SpQRConfig`` fields, fixed as transformers and the package fix them (3, 16, 16).
    """

    name: ClassVar[str] = "spqr"
    # dense_weights int64 [m·n/16]; row_offsets int32 [m + 1] or [m/16 + 1]; col_vals int32
    # [nnz]; perm int64 [n]
    constants = ("qweight", "row_offsets", "col_vals", "perm")
    reference = staticmethod(spqr.spqr_linear)
    bits: int = 3
    beta1: int = 16
    beta2: int = 16

    def __post_init__(self) -> None:
        check_choice("Spqr", "bits", self.bits, (3,))
        check_choice("Spqr", "beta1", self.beta1, (16,))
        check_choice("Spqr", "beta2", self.beta2, (16,))

    @classmethod
    def out_features_of(cls, weight, *rest) -> int:
        return weight.shape[0] * spqr.TILE // rest[2].shape[0]  # m·n/16 words over n

    def unsupported_reason(self, *, out_features: int, in_features: int) -> str | None:
        if out_features % spqr.TILE or in_features % spqr.TILE:
            return f"[{out_features}, {in_features}] is not a whole number of 16×16 SpQR tiles"
        return None

    def layout(self, shape):
        m, n = shape
        return {
            "qweight": ((m * n // spqr.TILE,), torch.int64),
            "row_offsets": ((None,), torch.int32),  # m + 1 (CSR) or m/16 + 1 (PTCSR)
            "col_vals": ((None,), torch.int32),  # one per outlier
            "perm": ((n,), torch.int64),
        }

    def quantize(self, w):
        raise NotImplementedError(
            "SpQR cannot quantize a float weight here: its outliers and rounding come from its "
            "own calibration (the SpQR repository); load a SpQR checkpoint with "
            "fxquant.load_quantized"
        )
