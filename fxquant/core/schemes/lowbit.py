"""int2 / int3 / int6 (and float-zero int4) weights in groups along K (``IntxWeightOnly``:
``int3wo-64``, ``int2wo-32``, ``hqq-int4-64``, ``mlx-int4-64``), the same codes with SINQ's
extra per-input-column scale (``SinqWeightOnly``: ``sinq-int4-64``) and BitNet's ternary weights
× int8 per-token activations (``BitNetTernary``: ``bitnet``).

Declarations (``fxquant.core.scheme``); reference math in ``fxquant.core.reference_lowbit``,
``fxquant.core.hqq`` and ``fxquant.core.sinq``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fxquant.core import reference_lowbit as ref_lowbit
from fxquant.core import sinq
from fxquant.core.scheme import QuantizedWeight, Scheme, check_choice, recipe, register_scheme


@register_scheme
@dataclass(frozen=True, kw_only=True)
class IntxWeightOnly(Scheme):
    """int2 / int3 / int6 weights (and int4 with a float zero point) in groups of ``group_size``
    along K; activations stay in float. Storage w = (u - z) * s, codes u packed along K
    (``fxquant.core.reference_lowbit``: 4 per byte, 8 per 3 bytes, 2 per byte, 4 per 3 bytes).

    Args:
        bits: 2, 3 or 6; 4 only with ``zero_point="float"`` (an integer-zero int4 is
            ``Int4WeightOnly``, which has the fast CPU kernel). 2, 3 and 4 run on the CPU int4
            kernel; 6 (GGUF ``Q6_K``) has no CPU kernel: its CPU lowering dequantizes the
            weight to fp32 per call (correct, slower than fp32).
        group_size: elements of K sharing one scale and zero point: 32, 64, 128 or 256; 16
            only with ``bits=6`` (``Q6_K``'s sub-blocks; the CPU int4 kernel that the other
            widths run on takes groups of 32 to 256).
        symmetric: ``True``: s = amax / (2**(bits-1) - 1), codes centred on z = 2**(bits-1)
            (integer zero points only); ``False`` (default): the group's range onto
            [0, 2**bits - 1] with a zero point.
        zero_point: ``"int"`` (default): uint8 z, range widened to include 0, K zero-padded
            to a group multiple (as ``Int4WeightOnly``); ``"float"``: fp32 z on the group's own
            [min, max] range (HQQ's and quanto's grid); K must be a multiple of the group.
        optimizer: ``None`` (round to nearest) or ``"hqq"``: HQQ's calibration-free
            half-quadratic refinement of the zero points (``fxquant.core.hqq``; needs
            ``zero_point="float"``).
        grid: how a float zero point's grid is computed: ``"hqq"`` (default; HQQ's and
            quanto's: inverse scale capped at 2e4) or ``"mlx"`` (Apple MLX's affine mode,
            transformers' ``MetalConfig``: scale (max - min) / (2**bits - 1) floored at 1e-8,
            bias = min, round to nearest; ``zero_point="float"``, no optimizer).
    """

    name: ClassVar[str] = "intx_weight_only"
    # codes packed along K, uint8 [N, Kp*bits/8]; scale fp32 and zero (uint8 or fp32) [N, Kp/g]
    constants = ("qweight", "scale", "zero")
    op_params = (("bits", "SymInt"), ("group_size", "SymInt"))
    reference = staticmethod(ref_lowbit.intx_weight_only_linear)
    bits: int = 3
    group_size: int = 64
    symmetric: bool = False
    zero_point: str = "int"
    optimizer: str | None = None
    grid: str = "hqq"

    def __post_init__(self) -> None:
        n = "IntxWeightOnly"
        check_choice(n, "bits", self.bits, (2, 3, 4, 6))
        check_choice(n, "group_size", self.group_size, (16, 32, 64, 128, 256))
        if self.group_size == 16 and self.bits != 6:
            raise ValueError(
                f"IntxWeightOnly(bits={self.bits}, group_size=16) is not supported: int2/3/4 "
                "codes lower to the CPU int4 kernel, whose groups are 32 to 256 wide; allowed: "
                "group_size 32, 64, 128 or 256, or group_size=16 with bits=6"
            )
        check_choice(n, "symmetric", self.symmetric, (True, False))
        check_choice(n, "zero_point", self.zero_point, ("int", "float"))
        check_choice(n, "optimizer", self.optimizer, (None, "hqq"))
        if self.zero_point == "float" and self.symmetric:
            raise ValueError(
                "IntxWeightOnly(symmetric=True, zero_point='float') is not supported: a "
                "symmetric grid has the fixed zero point 2**(bits-1); allowed: symmetric with "
                "zero_point='int', or zero_point='float' with symmetric=False"
            )
        if self.optimizer == "hqq" and self.zero_point != "float":
            raise ValueError(
                f"IntxWeightOnly(optimizer='hqq', zero_point={self.zero_point!r}) is not "
                "supported: HQQ's zero points are floats; allowed: zero_point='float'"
            )
        check_choice(n, "grid", self.grid, ref_lowbit.INTX_GRIDS)
        if self.grid == "mlx" and (self.zero_point != "float" or self.optimizer is not None):
            raise ValueError(
                f"IntxWeightOnly(grid='mlx', zero_point={self.zero_point!r}, "
                f"optimizer={self.optimizer!r}) is not supported: MLX's affine grid has a float "
                "zero point (its bias) and rounds to nearest; allowed: zero_point='float' with "
                "optimizer=None"
            )
        if self.bits == 4 and self.zero_point == "int":
            raise ValueError(
                "IntxWeightOnly(bits=4, zero_point='int') is not supported: that is "
                "Int4WeightOnly(group_size=..., symmetric=...); allowed: bits 2, 3 or 6, or "
                "bits=4 with zero_point='float'"
            )

    def unsupported_reason(self, *, out_features: int, in_features: int) -> str | None:
        if self.zero_point == "float" and in_features % self.group_size:
            return (
                f"in_features={in_features} is not a multiple of group_size={self.group_size} "
                "(float zero points use the group's own range, so zero padding would change it)"
            )
        return None

    def padded_in_features(self, in_features: int) -> int:
        g = self.group_size
        return -(-in_features // g) * g

    def quantize(self, w):
        packed, s, z = ref_lowbit.quantize_intx_grouped(
            w,
            bits=self.bits,
            group_size=self.group_size,
            symmetric=self.symmetric,
            zero_point=self.zero_point,
            optimizer=self.optimizer,
            grid=self.grid,
        )
        dq = ref_lowbit.dequantize_intx_grouped(
            packed, s, z, bits=self.bits, group_size=self.group_size
        )
        return QuantizedWeight({"qweight": packed, "scale": s, "zero": z}, dq[:, : w.shape[1]])


@register_scheme
@dataclass(frozen=True, kw_only=True)
class SinqWeightOnly(Scheme):
    """SINQ (transformers' ``SinqConfig(method="sinq")``): calibration-free Sinkhorn-normalised
    dual scaling (``fxquant.core.sinq``). Codes in groups of ``group_size`` along K with a
    per-group scale and float zero point, as ``IntxWeightOnly(zero_point="float")`` stores them,
    plus one scale per input column that multiplies x before the GEMM. Bit-exact with the
    ``sinq`` package's quantizer (codes, 8-bit-rounded scales and zeros, column scales).

    Args:
        bits: 2, 3 or 4 (codes packed as ``IntxWeightOnly``'s; all run on the CPU int4 kernel).
        group_size: 32, 64, 128 or 256; K must be a multiple, and N · K / group_size a
            multiple of 32 (SINQ rounds the row scales to 8 bits in a 32-row view).
    """

    name: ClassVar[str] = "sinq_weight_only"
    # codes packed along K as IntxWeightOnly's; scale, zero fp32 [N, K/g]; col_scale fp32 [K]
    constants = ("qweight", "scale", "zero", "col_scale")
    op_params = (("bits", "SymInt"), ("group_size", "SymInt"))
    reference = staticmethod(ref_lowbit.sinq_weight_only_linear)
    bits: int = 4
    group_size: int = 64

    def __post_init__(self) -> None:
        check_choice("SinqWeightOnly", "bits", self.bits, (2, 3, 4))
        check_choice("SinqWeightOnly", "group_size", self.group_size, (32, 64, 128, 256))

    def unsupported_reason(self, *, out_features: int, in_features: int) -> str | None:
        g = self.group_size
        if in_features % g:
            return f"in_features={in_features} is not a multiple of group_size={g}"
        if (out_features * in_features // g) % 32:
            return (
                f"out_features × in_features / group_size = {out_features * in_features // g} "
                "is not a multiple of 32 (SINQ rounds the row scales to 8 bits in a 32-row view)"
            )
        return None

    def quantize(self, w):
        q = sinq.sinq_quantize(w, bits=self.bits, group_size=self.group_size)
        packed = ref_lowbit.pack_intx(q.codes, self.bits)
        tensors = {"qweight": packed, "scale": q.scale, "zero": q.zero, "col_scale": q.col_scale}
        return QuantizedWeight(tensors, q.dequantize())


@register_scheme
@dataclass(frozen=True, kw_only=True)
class BitNetTernary(Scheme):
    """BitNet b1.58: ternary weights {-1, 0, 1} with one per-tensor scale (mean |W|) × int8
    activations quantized per token at run time (absmax / 127), as transformers' ``BitLinear``
    (``BitNetQuantConfig``). The weight is packed 4 values per byte in transformers' layout
    (along the output dim), so out_features must be a multiple of 4.
    """

    name: ClassVar[str] = "bitnet"
    quantizes_activation: ClassVar[bool] = True
    # ternary W packed 4 a byte along N, uint8 [N/4, K]; "weight_scale": transformers'
    # BitLinear buffer name, and its meaning (1 / mean|W|), fp32 [1]
    constants = ("qweight", "weight_scale")
    reference = staticmethod(ref_lowbit.bitnet_linear)

    @classmethod
    def out_features(cls, weight):
        return 4 * weight.shape[0]

    def quantize(self, w):
        packed, ws = ref_lowbit.quantize_bitnet_weight(w)
        dq = ref_lowbit.unpack_bitnet(packed).float() / ws
        return QuantizedWeight({"qweight": packed, "weight_scale": ws}, dq)

    def unsupported_reason(self, *, out_features: int, in_features: int) -> str | None:
        if out_features % 4:
            return f"out_features={out_features} is not a multiple of 4 (4 ternary rows a byte)"
        return None


recipe("int3wo-64", IntxWeightOnly(bits=3, group_size=64))
recipe("int2wo-32", IntxWeightOnly(bits=2, group_size=32))
recipe("hqq-int4-64", IntxWeightOnly(bits=4, group_size=64, zero_point="float", optimizer="hqq"))
recipe("mlx-int4-64", IntxWeightOnly(bits=4, group_size=64, zero_point="float", grid="mlx"))
recipe("sinq-int4-64", SinqWeightOnly(bits=4, group_size=64))
recipe("bitnet", BitNetTernary())
