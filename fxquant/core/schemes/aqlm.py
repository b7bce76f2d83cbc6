"""AQLM (``aqlm``): additive codebook quantization, for loading AQLM checkpoints
(transformers' ``AqlmConfig``).

Declaration (``fxquant.core.scheme``); reference math in ``fxquant.core.aqlm``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import torch

from fxquant.core import aqlm
from fxquant.core.scheme import Scheme, check_choice, check_int, register_scheme


@register_scheme
@dataclass(frozen=True, kw_only=True)
class Aqlm(Scheme):
    """AQLM weights: each ``out_group_size`` × ``in_group_size`` group of W is the sum of one
    codeword from each of ``num_codebooks`` learned codebooks of 2^``nbits_per_codebook``
    entries, times a scale per output group (``fxquant.core.aqlm``); activations in float.

    Loaded from checkpoints only (``fxquant.load_quantized``): learning the codebooks takes
    hours of calibration, which fxquant does not do. Sizes: num_codebooks · nbits /
    (in_group_size · out_group_size) bits a weight plus the codebooks (1x16: 2 bits a weight and
    1 MiB of fp16 codebook a layer).

    Args: the ``AqlmConfig`` fields of the same names; ``out_group_size`` 1 (the 1x16 and 2x8
    formats AQLM publishes), since the codes then index W's rows directly.
    """

    name: ClassVar[str] = "aqlm"
    # codes int32 [N, K/ig, C]; codebooks fp32 [C, 2^b, 1, ig]; scales fp32 [N]
    constants = ("qweight", "codebooks", "scale")
    reference = staticmethod(aqlm.aqlm_linear)
    in_group_size: int = 8
    out_group_size: int = 1
    num_codebooks: int = 1
    nbits_per_codebook: int = 16

    def __post_init__(self) -> None:
        for f in ("in_group_size", "num_codebooks"):
            check_int("Aqlm", f, getattr(self, f), minimum=1)
        # one output row a group, as AQLM's 1x16 and 2x8 checkpoints (codes [N, K/ig, C])
        check_choice("Aqlm", "out_group_size", self.out_group_size, (1,))
        check_choice("Aqlm", "nbits_per_codebook", self.nbits_per_codebook, tuple(range(1, 17)))

    def unsupported_reason(self, *, out_features: int, in_features: int) -> str | None:
        if in_features % self.in_group_size or out_features % self.out_group_size:
            return (
                f"[{out_features}, {in_features}] is not a whole number of "
                f"{self.out_group_size}×{self.in_group_size} AQLM groups"
            )
        return None

    def layout(self, shape):
        n, k = shape
        c, ig = self.num_codebooks, self.in_group_size
        return {
            "qweight": ((n, k // ig, c), torch.int32),
            "codebooks": ((c, 2**self.nbits_per_codebook, 1, ig), torch.float32),
            "scale": ((n,), torch.float32),
        }

    def quantize(self, w):
        raise NotImplementedError(
            "AQLM cannot quantize a float weight here: its codebooks are learned over hours of "
            "calibration (the aqlm package); load an AQLM checkpoint with fxquant.load_quantized"
        )
