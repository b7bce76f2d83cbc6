"""int4 weights in groups along K: weight-only (``int4wo-<g>``) and × int8 activations quantized
per token at run time (W4A8, ``w4a8-<g>``). Both store the same weight; only the op differs.

Declarations (``fxquant.core.scheme``); reference math in ``fxquant.core.reference``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

import torch

from fxquant.core import reference as ref
from fxquant.core.scheme import QuantizedWeight, Scheme, check_choice, recipe, register_scheme


class _Int4Grouped(Scheme):
    # packed uint4 [N, Kp/2] (two codes a byte along K), scale fp32 and zero uint8 [N, Kp/g]
    constants = ("qweight", "scale", "zero")
    op_params = (("group_size", "SymInt"),)
    group_size: int
    symmetric: bool

    grid: str = "fxquant"

    def __post_init__(self) -> None:
        n = type(self).__name__
        check_choice(n, "group_size", self.group_size, (32, 64, 128, 256))
        check_choice(n, "symmetric", self.symmetric, (True, False))
        check_choice(n, "grid", self.grid, self._grids)
        if self.grid == "torchao" and not self.symmetric:
            raise ValueError(
                f"{n}(grid='torchao', symmetric=False) is not supported: torchao's integer "
                "grid here is its symmetric one; allowed: symmetric=True"
            )

    # the weight grids a scheme takes: W4A8's activation is fxquant's, so its weight is too
    _grids: ClassVar[tuple[str, ...]] = ("fxquant",)

    def padded_in_features(self, in_features: int) -> int:
        g = self.group_size
        return -(-in_features // g) * g

    def quantize(self, w):
        # W [N, K], or experts' [E, N, K]: each expert's rows quantize as a linear's
        lead, (n, k) = w.shape[:-2], w.shape[-2:]
        packed, s, z = ref.quantize_int4_grouped(
            w.reshape(-1, k), group_size=self.group_size, symmetric=self.symmetric, grid=self.grid
        )
        dq = ref.dequantize_int4_grouped(packed, s, z, group_size=self.group_size)[:, :k]
        stored = {"qweight": packed, "scale": s, "zero": z}
        stored = {name: t.reshape(*lead, n, t.shape[-1]) for name, t in stored.items()}
        return QuantizedWeight(stored, dq.reshape(w.shape))

    @property
    def takes_experts(self) -> bool:  # type: ignore[override]
        return True

    def grouped_op_args(self, x, constants, offs):
        # experts [E, N, K]: groups along K within each expert's rows, as a linear's [N, K]
        op = getattr(torch.ops.fxquant, f"{self.name}_grouped_mm").default
        c = constants
        return op, (x, c["qweight"], c["scale"], c["zero"], offs, self.group_size)


@register_scheme
@dataclass(frozen=True, kw_only=True)
class Int4WeightOnly(_Int4Grouped):
    """int4 weights in groups of ``group_size`` along K; activations stay in float. Takes a
    mixture-of-experts model's expert weights too ([E, N, K], run by grouped_mm: each expert as
    a linear's weight), as ``Int8DynamicActivationInt4`` does.

    Args:
        group_size: elements of K sharing one scale (and zero point): 32, 64, 128 or 256. K that
            is not a multiple is zero-padded up to one (the report says so); the zero columns
            quantize exactly to zero, so the result is unchanged.
        symmetric: ``False`` (default) stores a zero point per group, w = (q - z) * s with q, z in
            [0, 15]; ``True`` uses q in [-8, 7] and s = amax / 7 (z = 8 in the stored form).
        grid: ``"fxquant"`` (default; the rules above), or another library's, bit for bit
            (``fxquant.core.reference.library_grid``): ``"compressed-tensors"`` (W4A16:
            symmetric s = amax / 7.5, codes -8..7; asymmetric in the weight's dtype) or
            ``"torchao"`` (symmetric, amax / 7.5). Same storage, ops and kernels.
    """

    name: ClassVar[str] = "int4_weight_only"
    reference = staticmethod(ref.int4_weight_only_linear)
    group_size: int = 128
    symmetric: bool = False
    grid: str = field(default="fxquant", metadata={"omit_default": True})
    _grids: ClassVar[tuple[str, ...]] = ref.INT_GRIDS


@register_scheme
@dataclass(frozen=True, kw_only=True)
class Int8DynamicActivationInt4(_Int4Grouped):
    """int4 weights in groups of ``group_size`` along K × int8 activations per token, quantized
    at run time: W4A8, the scheme of torchao's ``Int8DynamicActivationInt4WeightConfig`` and
    ExecuTorch's "8da4w" (with symmetric activations, as ``w8a8``'s).

    Recipes ``w4a8-32``, ``w4a8-64``, ``w4a8-128``. The weight is stored exactly as
    ``Int4WeightOnly``'s (same grid, zero points, padding); the activation as ``w8a8``'s
    (amax(|x|) / 127 per token). What it buys: the CPU kernel multiplies int4 codes by int8
    activations in integer SIMD (``maddubs``, as llama.cpp's Q4 × Q8 dot products do), about
    twice the throughput of decoding int4 to fp32, which is what bounds int4 weight-only decode
    on AVX2. What it costs: the activation's rounding (about 1/254 of each token's amax).

    Args:
        group_size: elements of K sharing one scale and zero point: 32, 64, 128 or 256.
        symmetric: as ``Int4WeightOnly``'s.
    """

    name: ClassVar[str] = "int8_dynamic_int4"
    quantizes_activation: ClassVar[bool] = True
    reference = staticmethod(ref.int8_dynamic_int4_linear)
    group_size: int = 64
    symmetric: bool = False


for _g in (32, 64, 128, 256):
    recipe(f"int4wo-{_g}", Int4WeightOnly(group_size=_g))
for _g in (32, 64, 128):
    recipe(f"w4a8-{_g}", Int8DynamicActivationInt4(group_size=_g))
