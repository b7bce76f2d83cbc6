"""Quantization configs: what the user asks for, as data.

This is the first stop of the data flow: a ``QuantConfig`` (or a single scheme, or a recipe name)
goes into ``fxquant.quantize``; the planning pass (``fxquant.passes.plan``) reads it to choose a
scheme per linear-like node, and its JSON form is stored in the quantized program so a ``.pt2``
says how it was made.

Every scheme is a frozen, keyword-only dataclass validated in ``__post_init__``: a bad value
raises ``ValueError`` naming the field, the value and what is allowed. Schemes register
themselves by class name so configs round-trip through dicts/JSON.
"""

from __future__ import annotations

import dataclasses
import json
import re
import warnings
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

__all__ = [
    "BitNetTernary",
    "Bnb4WeightOnly",
    "Float8Block",
    "Float8Dynamic",
    "Float8Recipe",
    "Float8Static",
    "Float8WeightOnly",
    "Int4WeightOnly",
    "Int8DynamicActivation",
    "Int8DynamicActivationInt4",
    "Int8WeightOnly",
    "IntxWeightOnly",
    "LLMInt8",
    "MXFP4",
    "MXFP8",
    "NVFP4",
    "QuantConfig",
    "RECIPES",
    "Scheme",
    "from_recipe_name",
    "name_matches",
    "scheme_from_dict",
]

_SCHEMES: dict[str, type[Scheme]] = {}


def _register(cls: type[Scheme]) -> type[Scheme]:
    _SCHEMES[cls.__name__] = cls
    return cls


def _check_choice(cls_name: str, field_name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(
            f"{cls_name}.{field_name}={value!r} is not supported; allowed: "
            + ", ".join(repr(a) for a in allowed)
        )


class Scheme:
    """Base of all schemes. ``name`` is the one name a scheme has in all three layers: the op
    ``fxquant::<name>_linear``, the rewrite handler in ``fxquant.passes`` and (for CUDA) the Triton
    kernel file ``kernels/<name>.py`` (installed as ``fxquant.kernels.<name>``)."""

    name: ClassVar[str]
    # True when the activation is quantized too (so the GEMM itself runs in low precision).
    quantizes_activation: ClassVar[bool] = False

    def unsupported_reason(self, *, out_features: int, in_features: int) -> str | None:
        """Why a weight of shape [out_features, in_features] cannot take this scheme, or None."""
        return None

    def padded_in_features(self, in_features: int) -> int:
        """K after the padding this scheme applies to the weight (zeros, which change nothing)."""
        return in_features

    def to_dict(self) -> dict[str, Any]:
        return {"type": type(self).__name__, **dataclasses.asdict(self)}

    def __str__(self) -> str:
        args = ", ".join(f"{f.name}={getattr(self, f.name)!r}" for f in dataclasses.fields(self))
        return f"{type(self).__name__}({args})"


@_register
@dataclass(frozen=True, kw_only=True)
class Int8WeightOnly(Scheme):
    """int8 symmetric weights, one scale per output channel; activations stay in float.

    Recipe ``int8wo``. Halves (bf16) or quarters (fp32) the weight bytes; decode is memory bound,
    so this is the safest speed-up with almost no accuracy cost.
    """

    name: ClassVar[str] = "int8_weight_only"


@_register
@dataclass(frozen=True, kw_only=True)
class Int4WeightOnly(Scheme):
    """int4 weights in groups of ``group_size`` along K; activations stay in float.

    Args:
        group_size: elements of K sharing one scale (and zero point): 32, 64, 128 or 256. K that
            is not a multiple is zero-padded up to one (the report says so); the zero columns
            quantize exactly to zero, so the result is unchanged.
        symmetric: ``False`` (default) stores a zero point per group, w = (q - z) * s with q, z in
            [0, 15]; ``True`` uses q in [-8, 7] and s = amax / 7 (z = 8 in the stored form).
    """

    name: ClassVar[str] = "int4_weight_only"
    group_size: int = 128
    symmetric: bool = False

    def __post_init__(self) -> None:
        _check_choice("Int4WeightOnly", "group_size", self.group_size, (32, 64, 128, 256))
        _check_choice("Int4WeightOnly", "symmetric", self.symmetric, (True, False))

    def padded_in_features(self, in_features: int) -> int:
        g = self.group_size
        return -(-in_features // g) * g


@_register
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
    """

    name: ClassVar[str] = "intx_weight_only"
    bits: int = 3
    group_size: int = 64
    symmetric: bool = False
    zero_point: str = "int"
    optimizer: str | None = None

    def __post_init__(self) -> None:
        n = "IntxWeightOnly"
        _check_choice(n, "bits", self.bits, (2, 3, 4, 6))
        _check_choice(n, "group_size", self.group_size, (16, 32, 64, 128, 256))
        if self.group_size == 16 and self.bits != 6:
            raise ValueError(
                f"IntxWeightOnly(bits={self.bits}, group_size=16) is not supported: int2/3/4 "
                "codes lower to the CPU int4 kernel, whose groups are 32 to 256 wide; allowed: "
                "group_size 32, 64, 128 or 256, or group_size=16 with bits=6"
            )
        _check_choice(n, "symmetric", self.symmetric, (True, False))
        _check_choice(n, "zero_point", self.zero_point, ("int", "float"))
        _check_choice(n, "optimizer", self.optimizer, (None, "hqq"))
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


@_register
@dataclass(frozen=True, kw_only=True)
class BitNetTernary(Scheme):
    """BitNet b1.58: ternary weights {-1, 0, 1} with one per-tensor scale (mean |W|) × int8
    activations quantized per token at run time (absmax / 127), as transformers' ``BitLinear``
    (``BitNetQuantConfig``). The weight is packed 4 values per byte in transformers' layout
    (along the output dim), so out_features must be a multiple of 4.
    """

    name: ClassVar[str] = "bitnet"
    quantizes_activation: ClassVar[bool] = True

    def unsupported_reason(self, *, out_features: int, in_features: int) -> str | None:
        if out_features % 4:
            return f"out_features={out_features} is not a multiple of 4 (4 ternary rows a byte)"
        return None


@_register
@dataclass(frozen=True, kw_only=True)
class Int8DynamicActivation(Scheme):
    """int8 weights per output channel × int8 activations per token, quantized at run time.

    Recipe ``w8a8``. The activation scale is amax(|x|) / 127 over each token's features.
    """

    name: ClassVar[str] = "int8_dynamic"
    quantizes_activation: ClassVar[bool] = True


@_register
@dataclass(frozen=True, kw_only=True)
class Int8DynamicActivationInt4(Scheme):
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
    group_size: int = 64
    symmetric: bool = False

    def __post_init__(self) -> None:
        n = "Int8DynamicActivationInt4"
        _check_choice(n, "group_size", self.group_size, (32, 64, 128, 256))
        _check_choice(n, "symmetric", self.symmetric, (True, False))

    def padded_in_features(self, in_features: int) -> int:
        g = self.group_size
        return -(-in_features // g) * g


@_register
@dataclass(frozen=True, kw_only=True)
class Float8WeightOnly(Scheme):
    """float8 e4m3 weights, one scale (amax / 448) per output channel; activations in float.

    Recipe ``fp8wo``.
    """

    name: ClassVar[str] = "float8_weight_only"


@_register
@dataclass(frozen=True, kw_only=True)
class Float8Dynamic(Scheme):
    """float8 e4m3 weights and activations, the activation scale computed at run time.

    Args:
        granularity: ``"row"``: weights per output channel, activations per token (recipe
            ``fp8-row``, FbgemmFp8Config's layout); ``"tensor"``: one scale for each
            (``fp8-tensor``).
        activation_scale_ub: upper bound on the activation amax before the scale is taken, so one
            outlier token cannot flatten the rest; FbgemmFp8Config uses 1200. ``None``: no bound.
    """

    name: ClassVar[str] = "float8_dynamic"
    quantizes_activation: ClassVar[bool] = True
    granularity: str = "row"
    activation_scale_ub: float | None = None

    def __post_init__(self) -> None:
        _check_choice("Float8Dynamic", "granularity", self.granularity, ("row", "tensor"))
        ub = self.activation_scale_ub
        if ub is not None and (
            isinstance(ub, bool) or not isinstance(ub, (int, float)) or not ub > 0
        ):
            raise ValueError(
                f"Float8Dynamic.activation_scale_ub={ub!r} is not supported; "
                "allowed: None or a positive number (FbgemmFp8Config uses 1200.0)"
            )
        if ub is not None:
            object.__setattr__(self, "activation_scale_ub", float(ub))

    @property
    def per_row(self) -> bool:
        return self.granularity == "row"


@_register
@dataclass(frozen=True, kw_only=True)
class Float8Static(Scheme):
    """float8 e4m3 weights (one per-tensor scale) × activations quantized with a fixed
    per-tensor scale: the inference form of an FP8-trained layer with delayed scaling, whose
    trained input scale is frozen in (``fxquant.quantize`` with a ``Float8Recipe`` makes one per
    layer). Values beyond ``448 · activation_scale`` saturate.

    Args:
        activation_scale: the activation's dequant multiplier (``1 / scale`` of Transformer
            Engine's input role), a positive finite number.
    """

    name: ClassVar[str] = "float8_static"
    quantizes_activation: ClassVar[bool] = True
    activation_scale: float

    def __post_init__(self) -> None:
        a = self.activation_scale
        if isinstance(a, bool) or not isinstance(a, (int, float)) or not 0 < a < float("inf"):
            raise ValueError(
                f"Float8Static.activation_scale={a!r} is not supported; allowed: a positive "
                "finite number (the activation's dequant multiplier)"
            )
        object.__setattr__(self, "activation_scale", float(a))


@_register
@dataclass(frozen=True, kw_only=True)
class Float8Block(Scheme):
    """float8 e4m3 with DeepSeek-V3-style block scales: weights in ``block_size``² tiles,
    activations in 1×``block_size`` groups per token, quantized at run time.

    Recipe ``fp8-block``. Shapes that are not a multiple of the block keep a smaller last block
    (its scale is taken over the elements that exist), so no padding is needed.
    """

    name: ClassVar[str] = "float8_block"
    quantizes_activation: ClassVar[bool] = True
    block_size: int = 128

    def __post_init__(self) -> None:
        _check_choice("Float8Block", "block_size", self.block_size, (32, 64, 128, 256))


@_register
@dataclass(frozen=True, kw_only=True)
class Bnb4WeightOnly(Scheme):
    """bitsandbytes 4-bit weights (``load_in_4bit``): NF4 or FP4 codes with one absmax per block
    of ``block_size``; activations stay in float (``fxquant.core.reference_bnb``).

    Recipes ``nf4`` and ``fp4``. Blocks run along the flattened weight W [N, K], exactly as
    bitsandbytes cuts them: with K a multiple of ``block_size`` (every real model) that is
    blocks along K inside each output row; otherwise a block may span two rows and the last
    one is short, as in bnb. Nothing is padded; a layer with an odd K is skipped (its rows
    would share a byte).

    Args:
        quant_type: ``"nf4"`` (QLoRA's NormalFloat levels) or ``"fp4"`` (bnb's E2M1 table).
        block_size: values per absmax: 64 (bnb's default), 128, 256, 512, 1024, 2048, 4096.
        double_quant: bnb's ``bnb_4bit_use_double_quant``: the fp32 absmax values, minus their
            mean, are quantized again to 8 bits (bnb's dynamic map) in blocks of 256.
    """

    name: ClassVar[str] = "bnb4_weight_only"
    quant_type: str = "nf4"
    block_size: int = 64
    double_quant: bool = False

    def __post_init__(self) -> None:
        n = "Bnb4WeightOnly"
        _check_choice(n, "quant_type", self.quant_type, ("nf4", "fp4"))
        _check_choice(n, "block_size", self.block_size, (64, 128, 256, 512, 1024, 2048, 4096))
        _check_choice(n, "double_quant", self.double_quant, (True, False))

    def unsupported_reason(self, *, out_features: int, in_features: int) -> str | None:
        if in_features % 2:
            return (
                f"in_features={in_features} is odd: two 4-bit values share a byte along K, "
                "and fxquant keeps each output row's bytes to itself"
            )
        return None


@_register
@dataclass(frozen=True, kw_only=True)
class LLMInt8(Scheme):
    """bitsandbytes LLM.int8 (``load_in_8bit``): int8 activations per token × int8 weights per
    output channel, with the activation's outlier feature columns (any |x| >= ``threshold`` in
    the current input) computed in float against the dequantized int8 weight, as bnb does
    (``fxquant.core.reference_bnb``). Activations and weights are put on the fp16 grid first, as
    bnb's fp16 kernels do.

    Args:
        threshold: bnb's ``llm_int8_threshold`` (default 6.0); 0 turns the outlier
            decomposition off (plain vector-wise int8).
    """

    name: ClassVar[str] = "llm_int8"
    quantizes_activation: ClassVar[bool] = True
    threshold: float = 6.0

    def __post_init__(self) -> None:
        t = self.threshold
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not 0 <= t < float("inf"):
            raise ValueError(
                f"LLMInt8.threshold={t!r} is not supported; allowed: a finite number >= 0 "
                "(0 turns the outlier decomposition off; bitsandbytes' default is 6.0)"
            )
        object.__setattr__(self, "threshold", float(t))


@_register
@dataclass(frozen=True, kw_only=True)
class Float8Recipe(Scheme):
    """FP8 *training*: the linears of an FP8 autocast region run their forward and backward GEMMs
    in float8, with the semantics of Transformer Engine's recipes and accelerate's
    ``TERecipeKwargs`` / ``AORecipeKwargs`` (../shared/FP8_RECIPES.md). Weights stay in high
    precision as the master copy; the optimizer sees ordinary parameters and gradients.

    Used through ``torch.compile(model, backend="fxquant", options={"config": cfg})``
    (``fxquant.passes.float8_regions`` rewrites the graph, ``fxquant.float8_training`` holds the
    casts and the autograd linear, ``fxquant.float8_state`` the delayed-scaling state). Given to
    ``fxquant.quantize``, the same recipe exports the fp8 inference graph.

    Args:
        scaling: ``"delayed"``: per-tensor scales from an amax history (TE ``DelayedScaling``);
            ``"current"``: scales from the tensor being cast (TE ``Float8CurrentScaling``, torchao
            tensorwise/rowwise); ``"mxfp8"``: one power-of-two (E8M0) scale per 32 values along
            each GEMM's reduction dim; ``"block"``: DeepSeek-V3 blocks (activations and gradients
            1×128, weights 128×128).
        fp8_format: ``"HYBRID"``: E4M3 forward, E5M2 gradients; ``"E4M3"``: E4M3 everywhere.
        granularity: current scaling only: ``"tensor"`` or ``"row"`` (each GEMM operand scaled
            per row along the GEMM's reduction dim, as torchao's rowwise recipe).
        margin: delayed scaling: scale = (fp8_max / amax) / 2**margin.
        amax_history_len: delayed scaling: rows of the amax history (TE default 1024).
        amax_compute_algo: delayed scaling: ``"max"`` over the history or ``"most_recent"``.
        interval: accepted for compatibility; TE never implemented it and removed it, so values
            other than 1 warn and are ignored (scales update every step).
        override_linear_precision: (fprop, dgrad, wgrad): run that GEMM in high precision. All
            three are honoured (TE only ever honoured wgrad; setting the others warns).
        use_autocast_during_eval: in ``model.eval()``, run FP8 with frozen scales instead of high
            precision.
        pad_inner_dim: when K or N is not a multiple of 16, pad it (with zeros, which change no
            result) instead of skipping the layer.
    """

    name: ClassVar[str] = "float8_training"
    quantizes_activation: ClassVar[bool] = True
    scaling: str = "delayed"
    fp8_format: str = "HYBRID"
    granularity: str = "tensor"
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"
    interval: int = 1
    override_linear_precision: tuple[bool, bool, bool] = (False, False, False)
    use_autocast_during_eval: bool = False
    pad_inner_dim: bool = True

    def __post_init__(self) -> None:
        name = "Float8Recipe"
        _check_choice(name, "scaling", self.scaling, ("delayed", "current", "mxfp8", "block"))
        if self.fp8_format == "E5M2":
            raise ValueError(
                "Float8Recipe.fp8_format='E5M2' is not supported: pure E5M2 training (E5M2 "
                "forward tensors) loses too much precision and Transformer Engine rejects it too; "
                "allowed: 'HYBRID' (E4M3 forward, E5M2 gradients) or 'E4M3'"
            )
        _check_choice(name, "fp8_format", self.fp8_format, ("HYBRID", "E4M3"))
        _check_choice(name, "granularity", self.granularity, ("tensor", "row"))
        if self.granularity == "row" and self.scaling != "current":
            raise ValueError(
                f"Float8Recipe.granularity='row' is not supported with scaling={self.scaling!r}; "
                "allowed: granularity='row' only with scaling='current'"
            )
        _check_int(name, "margin", self.margin, minimum=0)
        _check_int(name, "amax_history_len", self.amax_history_len, minimum=1)
        _check_int(name, "interval", self.interval, minimum=1)
        _check_choice(name, "amax_compute_algo", self.amax_compute_algo, ("max", "most_recent"))
        olp = tuple(self.override_linear_precision)
        if len(olp) != 3 or not all(isinstance(v, bool) for v in olp):
            raise ValueError(
                f"Float8Recipe.override_linear_precision={self.override_linear_precision!r} is "
                "not supported; allowed: three bools (fprop, dgrad, wgrad)"
            )
        object.__setattr__(self, "override_linear_precision", olp)
        _check_choice(
            name, "use_autocast_during_eval", self.use_autocast_during_eval, (True, False)
        )
        _check_choice(name, "pad_inner_dim", self.pad_inner_dim, (True, False))
        if self.interval != 1:
            warnings.warn(
                f"Float8Recipe.interval={self.interval} is ignored: scales update every step. "
                "Transformer Engine never implemented `interval` and removed it in 2.0, so no "
                "upstream recipe honoured it either.",
                stacklevel=3,
            )
        if olp[0] or olp[1]:
            warnings.warn(
                f"Float8Recipe.override_linear_precision={olp}: fxquant runs each flagged GEMM in "
                "high precision; Transformer Engine only ever honoured the wgrad flag and dropped "
                "the field in 2.0, so the same recipe there ran fprop/dgrad in FP8.",
                stacklevel=3,
            )

    @property
    def block_size(self) -> int | None:
        """Elements per scale along a GEMM's reduction dim (None: per tensor or per row)."""
        return {"mxfp8": 32, "block": 128}.get(self.scaling)

    def unsupported_reason(self, *, out_features: int, in_features: int) -> str | None:
        b = self.block_size
        if b is not None:
            bad = [
                f"{n}={v}"
                for n, v in (("in_features", in_features), ("out_features", out_features))
                if v % b
            ]
            if bad:
                return f"{' and '.join(bad)} not divisible by {b} ({self.scaling} blocks)"
            return None
        if not self.pad_inner_dim:
            bad = [
                f"{n}={v}"
                for n, v in (("in_features", in_features), ("out_features", out_features))
                if v % 16
            ]
            if bad:
                return (
                    f"{' and '.join(bad)} not divisible by 16 (FP8 GEMMs need it; "
                    "pad_inner_dim=True pads instead)"
                )
        return None

    def padded_in_features(self, in_features: int) -> int:
        if self.block_size is None and self.pad_inner_dim:
            return -(-in_features // 16) * 16
        return in_features


# --------------------------------------------------------------------------------------------
# Microscaling formats (reference math: fxquant.core.reference_mx). Blocks run along K, so K must be
# a multiple of the block; such a layer is skipped with the reason, never padded (a zero-padded
# activation block would still need a real scale, and the checkpoints these formats come from
# never pad).
# --------------------------------------------------------------------------------------------

_MX_RULES = ("floor", "ceil", "even")


def _block_reason(scheme: str, in_features: int, block: int) -> str | None:
    if in_features % block:
        return f"in_features={in_features} is not a multiple of {block} ({scheme} blocks along K)"
    return None


@_register
@dataclass(frozen=True, kw_only=True)
class MXFP8(Scheme):
    """OCP MXFP8: e4m3 weights and activations, one power-of-two (E8M0) scale per 32 values
    along K (weights per output row, activations per token, at run time).

    Recipe ``mxfp8``. ``fxquant.quantize`` with an MXFP8-trained ``Float8Recipe`` exports this
    scheme with ``scale_rule="ceil"``, the rule its training casts used.

    Args:
        scale_rule: the shared exponent: ``"floor"`` (default), floor(log2(amax)) - 8 as the
            OCP spec and torchao's default (the block's largest values may saturate at 448);
            ``"ceil"``, ceil(log2(amax / 448)) as Transformer Engine and torchao's RCEIL (nothing
            saturates).
    """

    name: ClassVar[str] = "mxfp8"
    quantizes_activation: ClassVar[bool] = True
    scale_rule: str = "floor"

    def __post_init__(self) -> None:
        _check_choice("MXFP8", "scale_rule", self.scale_rule, ("floor", "ceil"))

    def unsupported_reason(self, *, out_features: int, in_features: int) -> str | None:
        return _block_reason("MXFP8", in_features, 32)


@_register
@dataclass(frozen=True, kw_only=True)
class MXFP4(Scheme):
    """OCP MXFP4: e2m1 weights (two per byte), one E8M0 scale per 32 values along K; activations
    in float, or quantized to MXFP4 per token at run time.

    Recipe ``mxfp4`` (weight-only, the form gpt-oss ships). Sizes: 4.25 bits a weight.

    Args:
        activations: ``False`` (default): activations stay in float (w4a16); ``True``: they are
            MXFP4-quantized too (w4a4, compressed-tensors' ``MXFP4`` preset).
        scale_rule: the shared exponent: ``"floor"`` (default), floor(log2(amax)) - 2, the OCP
            spec's and torchao's default (values above 6 × scale saturate); ``"ceil"``,
            ceil(log2(amax / 6)), triton_kernels' ``downcast_to_mxfp`` (ROUND_UP, how
            transformers quantizes gpt-oss) and fouroversix; ``"even"``, amax rounded to one
            mantissa bit first, torchao's EVEN and compressed-tensors' rule.
    """

    name: ClassVar[str] = "mxfp4"
    activations: bool = False
    scale_rule: str = "floor"

    def __post_init__(self) -> None:
        _check_choice("MXFP4", "activations", self.activations, (True, False))
        _check_choice("MXFP4", "scale_rule", self.scale_rule, _MX_RULES)

    @property
    def quantizes_activation(self) -> bool:  # type: ignore[override]
        return self.activations

    def unsupported_reason(self, *, out_features: int, in_features: int) -> str | None:
        return _block_reason("MXFP4", in_features, 32)


@_register
@dataclass(frozen=True, kw_only=True)
class NVFP4(Scheme):
    """NVIDIA NVFP4: e2m1 values (two per byte), one e4m3 scale per 16 values along K and one
    fp32 scale per tensor (amax / (6 · 448)); activations quantized the same way at run time
    (their tensor scale from the whole activation's amax), or kept in float.

    Recipe ``nvfp4`` (w4a4). Sizes: 4.5 bits a weight.

    Args:
        activations: ``True`` (default): w4a4; ``False``: weights only, activations in float.
        scale_rule: ``"six"`` (default): every block's amax maps to 6 (standard NVFP4);
            ``"four_over_six"``: each block is quantized with its amax mapped to 6 and to 4 and
            keeps the lower squared error (Four Over Six, ``FourOverSixConfig``'s default
            ``"mse"``); the tensor scale is then amax / (6 · 256), as fouroversix does. Weights
            and activations use the same rule.
    """

    name: ClassVar[str] = "nvfp4"
    activations: bool = True
    scale_rule: str = "six"

    def __post_init__(self) -> None:
        _check_choice("NVFP4", "activations", self.activations, (True, False))
        _check_choice("NVFP4", "scale_rule", self.scale_rule, ("six", "four_over_six"))

    @property
    def quantizes_activation(self) -> bool:  # type: ignore[override]
        return self.activations

    def unsupported_reason(self, *, out_features: int, in_features: int) -> str | None:
        return _block_reason("NVFP4", in_features, 16)


def _check_int(cls_name: str, field_name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"{cls_name}.{field_name}={value!r} is not supported; allowed: an int >= {minimum}"
        )


def scheme_from_dict(d: Mapping[str, Any] | None) -> Scheme | None:
    """Inverse of ``Scheme.to_dict`` (``None`` stays ``None``: keep the layer in float)."""
    if d is None:
        return None
    if not isinstance(d, Mapping):
        hint = (
            " (a recipe name: use --recipe / QuantConfig.from_recipe)"
            if isinstance(d, str) and d in RECIPES
            else ""
        )
        raise ValueError(
            f'a scheme is a dict such as {{"type": "Int8WeightOnly"}} or null, not '
            f"{type(d).__name__} {d!r}{hint}"
        )
    d = dict(d)
    type_name = d.pop("type", None)
    if type_name not in _SCHEMES:
        raise ValueError(
            f"scheme type {type_name!r} is not known; allowed: {', '.join(sorted(_SCHEMES))}"
        )
    cls = _SCHEMES[type_name]
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ValueError(
            f"{type_name} has no field {', '.join(map(repr, unknown))}; its fields: "
            + (", ".join(fields) or "none")
        )
    return cls(**d)


# Named recipes, the short names users type (CLI --recipe, quantize(model, "int8wo")).
RECIPES: dict[str, Scheme] = {
    "int8wo": Int8WeightOnly(),
    "int4wo-32": Int4WeightOnly(group_size=32),
    "int4wo-64": Int4WeightOnly(group_size=64),
    "int4wo-128": Int4WeightOnly(group_size=128),
    "int4wo-256": Int4WeightOnly(group_size=256),
    "w8a8": Int8DynamicActivation(),
    "w4a8-32": Int8DynamicActivationInt4(group_size=32),
    "w4a8-64": Int8DynamicActivationInt4(group_size=64),
    "w4a8-128": Int8DynamicActivationInt4(group_size=128),
    "fp8wo": Float8WeightOnly(),
    "fp8-row": Float8Dynamic(granularity="row"),
    "fp8-tensor": Float8Dynamic(granularity="tensor"),
    "fp8-block": Float8Block(block_size=128),
    "mxfp8": MXFP8(),
    "mxfp4": MXFP4(),
    "nvfp4": NVFP4(),
    "nf4": Bnb4WeightOnly(quant_type="nf4"),
    "fp4": Bnb4WeightOnly(quant_type="fp4"),
    "llm-int8": LLMInt8(),
    "int3wo-64": IntxWeightOnly(bits=3, group_size=64),
    "int2wo-32": IntxWeightOnly(bits=2, group_size=32),
    "hqq-int4-64": IntxWeightOnly(bits=4, group_size=64, zero_point="float", optimizer="hqq"),
    "bitnet": BitNetTernary(),
}


LM_HEAD_SUFFIX = "+lm_head"  # "<recipe>+lm_head[=<recipe>]": QuantConfig.from_recipe


def from_recipe_name(name: str) -> Scheme:
    """The scheme behind a recipe name such as ``"int8wo"`` or ``"fp8-row"``."""
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}; known recipes: {', '.join(RECIPES)}") from None


def name_matches(pattern: str, module_name: str) -> bool:
    """Whether ``pattern`` (a regex) fully matches the module name or any run of its dotted parts.

    ``"lm_head"`` matches ``"lm_head"`` and ``"model.lm_head"``; ``r"layers\\.0\\.mlp\\..*"``
    matches ``"model.layers.0.mlp.up_proj"``; ``"model.layers.0"`` matches every module inside
    that block (like Hugging Face's ``modules_to_not_convert``), but ``"lm_head"`` never matches
    ``"lm_head_2"``.
    """
    parts = module_name.split(".")
    regex = re.compile(pattern)
    return any(
        regex.fullmatch(".".join(parts[i:j]))
        for i in range(len(parts))
        for j in range(i + 1, len(parts) + 1)
    )


NONFINITE = ("error", "skip")  # QuantConfig.nonfinite


@dataclass(frozen=True, kw_only=True)
class QuantConfig:
    """Which scheme each linear-like layer gets.

    Args:
        scheme: the default scheme for every linear-like node (``None``: none by default, only
            ``overrides`` apply).
        overrides: ``{pattern: scheme or None}``, tried in order, first match wins; ``None`` keeps
            the matched layers in float. Patterns are regexes matched against the module name
            (the weight's name without ``.weight``) as ``name_matches`` describes.
        modules_to_not_convert: patterns of layers that always stay in float, checked before
            ``overrides``. Defaults to ``("lm_head",)``, as in Hugging Face.
        fuse_norms: where a LayerNorm/RMSNorm feeds only linears that quantize their activation
            the same way (int8 per token, fp8 per token, fp8 1×b groups), replace the norm and
            their activation quantizers by one ``fxquant::norm_quant`` (``fxquant.passes.fuse``).
            The result is the same bit for bit in fp32; per-tensor fp8 is never fused (its
            scale needs the whole tensor first). ``False`` leaves the rewritten graph as it is.
        module_filter: ``callable(module, fqn) -> bool`` deciding which linears a
            ``Float8Recipe`` region takes (accelerate's ``AORecipeKwargs.module_filter_func``); it
            replaces the default rule (skip the first and the last linear). The other limits
            still apply. A config's JSON records the callable's name only: a config read back
            from JSON has no filter (the program it describes was already planned).
        nonfinite: what a weight with NaN or inf values gets. ``"error"`` (the default): the
            quantize call fails before anything is made, naming each such layer and its count
            (a quantized NaN poisons every output of a block-scaled layer, and an MX scale can
            hide it). ``"skip"``: those layers stay in float, reported with the count.
        strict: an ``overrides`` pattern or a ``modules_to_not_convert`` entry (other than the
            default ``lm_head``) that matches no layer of the exported program is an error;
            ``False`` (the default) warns, naming the patterns. A typo silently quantizing a
            layer the user meant to keep is the mistake this catches.
    """

    scheme: Scheme | None = None
    overrides: Mapping[str, Scheme | None] = field(default_factory=dict)
    modules_to_not_convert: tuple[str, ...] = ("lm_head",)
    fuse_norms: bool = True
    module_filter: Callable[[Any, str], bool] | None = None
    nonfinite: str = "error"
    strict: bool = False

    def __post_init__(self) -> None:
        if self.scheme is not None and not isinstance(self.scheme, Scheme):
            raise ValueError(
                f"QuantConfig.scheme={self.scheme!r} is not a scheme; allowed: None or one of "
                + ", ".join(sorted(_SCHEMES))
            )
        if not isinstance(self.overrides, Mapping):
            raise ValueError(
                f"QuantConfig.overrides={self.overrides!r} is not supported; "
                "allowed: a mapping {regex: scheme or None}"
            )
        for pattern, scheme in self.overrides.items():
            _check_pattern("overrides", pattern)
            if scheme is not None and not isinstance(scheme, Scheme):
                raise ValueError(
                    f"QuantConfig.overrides[{pattern!r}]={scheme!r} is not supported; "
                    "allowed: None or a scheme instance such as Int8WeightOnly()"
                )
        if not isinstance(self.modules_to_not_convert, (list, tuple)):
            raise ValueError(
                f"QuantConfig.modules_to_not_convert={self.modules_to_not_convert!r} is "
                + ("a string" if isinstance(self.modules_to_not_convert, str) else "not supported")
                + "; allowed: a list or tuple of patterns, e.g. ('lm_head',), or () for none"
            )
        for pattern in self.modules_to_not_convert:
            _check_pattern("modules_to_not_convert", pattern)
        if not isinstance(self.fuse_norms, bool):
            raise ValueError(
                f"QuantConfig.fuse_norms={self.fuse_norms!r} is not supported; "
                "allowed: True or False"
            )
        if self.module_filter is not None and not callable(self.module_filter):
            raise ValueError(
                f"QuantConfig.module_filter={self.module_filter!r} is not callable; allowed: None "
                "or a function (module, fqn) -> bool"
            )
        if self.module_filter is not None and not any(
            isinstance(s, Float8Recipe) for s in self.schemes
        ):
            raise ValueError(
                "QuantConfig.module_filter applies to Float8Recipe (FP8 training) regions only; "
                "for inference schemes use overrides / modules_to_not_convert"
            )
        if not isinstance(self.strict, bool):
            raise ValueError(
                f"QuantConfig.strict={self.strict!r} is not supported; allowed: True or False"
            )
        if self.nonfinite not in NONFINITE:
            raise ValueError(
                f"QuantConfig.nonfinite={self.nonfinite!r} is not supported; allowed: "
                + ", ".join(repr(v) for v in NONFINITE)
            )
        # Frozen and hashable: torch.compile options and caches want hashable configs.
        object.__setattr__(self, "overrides", _FrozenMapping(self.overrides))
        object.__setattr__(self, "modules_to_not_convert", tuple(self.modules_to_not_convert))

    @property
    def schemes(self) -> list[Scheme]:
        """Every scheme the config names (default first, then the overrides')."""
        found = [self.scheme, *self.overrides.values()]
        return [s for s in found if s is not None]

    def unmatched_patterns(self, module_names: Iterable[str]) -> list[str]:
        """The ``overrides`` patterns and ``modules_to_not_convert`` entries (but the default
        ``lm_head``) that match none of ``module_names``, each as ``'field: pattern'``."""
        names = list(module_names)
        out = [
            f"overrides: {p!r}"
            for p in self.overrides
            if not any(name_matches(p, n) for n in names)
        ]
        if self.modules_to_not_convert != ("lm_head",):
            out += [
                f"modules_to_not_convert: {p!r}"
                for p in self.modules_to_not_convert
                if not any(name_matches(p, n) for n in names)
            ]
        return out

    def scheme_for(self, module_name: str) -> tuple[Scheme | None, str]:
        """(scheme or None, why) for one module name."""
        for pattern in self.modules_to_not_convert:
            if name_matches(pattern, module_name):
                return None, f"modules_to_not_convert {pattern!r}"
        for pattern, scheme in self.overrides.items():
            if name_matches(pattern, module_name):
                return scheme, f"override {pattern!r}"
        if self.scheme is None:
            return None, "no default scheme and no override matches"
        return self.scheme, "default scheme"

    def to_dict(self) -> dict[str, Any]:
        return {
            "scheme": None if self.scheme is None else self.scheme.to_dict(),
            "overrides": [
                [p, None if s is None else s.to_dict()] for p, s in self.overrides.items()
            ],
            "modules_to_not_convert": list(self.modules_to_not_convert),
            "fuse_norms": self.fuse_norms,
            "module_filter": None
            if self.module_filter is None
            else getattr(self.module_filter, "__qualname__", repr(self.module_filter)),
            **({} if self.nonfinite == "error" else {"nonfinite": self.nonfinite}),
            **({"strict": True} if self.strict else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QuantConfig:
        allowed = {
            "scheme", "overrides", "modules_to_not_convert", "fuse_norms", "module_filter",
            "nonfinite", "strict",
        }  # fmt: skip
        unknown = set(d) - allowed
        if unknown:
            raise ValueError(
                f"QuantConfig dict has unknown keys {sorted(unknown)}; "
                f"allowed: {', '.join(sorted(allowed))}"
            )
        overrides = d.get("overrides", [])
        if isinstance(overrides, Mapping):
            overrides = list(overrides.items())
        if not isinstance(overrides, (list, tuple)) or any(
            not isinstance(o, (list, tuple)) or len(o) != 2 for o in overrides
        ):
            raise ValueError(
                f"QuantConfig overrides={overrides!r} is not supported; allowed: a mapping "
                '{pattern: scheme} or a list of [pattern, scheme] pairs, e.g. [["lm_head", null]]'
            )
        mtnc = d.get("modules_to_not_convert", ("lm_head",))
        return cls(
            scheme=scheme_from_dict(d.get("scheme")),
            overrides={p: scheme_from_dict(s) for p, s in overrides},
            modules_to_not_convert=tuple(mtnc) if isinstance(mtnc, list) else mtnc,
            # programs saved before fusion existed have no key: they load with the default
            fuse_norms=d.get("fuse_norms", True),
            nonfinite=d.get("nonfinite", "error"),
            strict=d.get("strict", False),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> QuantConfig:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_recipe(cls, name: str) -> QuantConfig:
        """A config from a recipe name, optionally with an ``lm_head`` suffix.

        ``"int8wo"`` quantizes every linear but ``lm_head`` (Hugging Face's default);
        ``"int8wo+lm_head"`` quantizes ``lm_head`` too, with the same scheme; and
        ``"int4wo-64+lm_head=int8wo"`` gives ``lm_head`` another recipe's scheme (as llama.cpp's
        4-bit files keep the output matrix in 8 bits). For a causal LM decoded one token at a
        time, ``lm_head`` is the largest single matrix read per token; a tied input embedding
        keeps its float table for the lookup (the report says ``float_weight_kept``).
        """
        base, plus, head = name.partition(LM_HEAD_SUFFIX)
        if not plus:
            return cls(scheme=from_recipe_name(name))
        if head and not head.startswith("="):
            raise ValueError(
                f"recipe {name!r}: after {LM_HEAD_SUFFIX!r} comes nothing (lm_head takes the "
                "same scheme) or '=<recipe>' (e.g. 'int4wo-64+lm_head=int8wo')"
            )
        scheme = from_recipe_name(base)
        head_scheme = from_recipe_name(head[1:]) if head else scheme
        return cls(
            scheme=scheme,
            overrides={} if head_scheme == scheme else {"lm_head": head_scheme},
            modules_to_not_convert=(),
        )

    @classmethod
    def coerce(cls, config: QuantConfig | Scheme | str) -> QuantConfig:
        """A QuantConfig from what ``quantize`` accepts: a config, a scheme or a recipe name."""
        if isinstance(config, QuantConfig):
            return config
        if isinstance(config, Scheme):
            return cls(scheme=config)
        if isinstance(config, str):
            return cls.from_recipe(config)
        raise ValueError(
            f"config={config!r} is not supported; allowed: a QuantConfig, a scheme instance "
            f"such as Int8WeightOnly(), or a recipe name ({', '.join(RECIPES)})"
        )


def _check_pattern(field_name: str, pattern: Any) -> None:
    if not isinstance(pattern, str):
        raise ValueError(f"QuantConfig.{field_name} pattern {pattern!r} is not a string regex")
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"QuantConfig.{field_name} pattern {pattern!r} is not a regex: {e}") from e


class _FrozenMapping(Mapping):
    """A read-only, hashable, ordered mapping (first match wins, so order matters)."""

    def __init__(self, items: Mapping) -> None:
        self._items = tuple(items.items())
        self._dict = dict(self._items)

    def __getitem__(self, key):
        return self._dict[key]

    def __iter__(self):
        return iter(self._dict)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and list(self.items()) == list(other.items())

    def __repr__(self) -> str:
        return repr(self._dict)
