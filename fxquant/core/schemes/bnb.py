"""bitsandbytes formats: 4-bit NF4 / FP4 weights (``Bnb4WeightOnly``: ``nf4``, ``fp4``) and
LLM.int8 (``LLMInt8``: ``llm-int8``).

Declarations (``fxquant.core.scheme``); reference math in ``fxquant.core.reference_bnb``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from fxquant.core import reference_bnb as ref_bnb
from fxquant.core.scheme import (
    QuantizedWeight,
    Scheme,
    check_choice,
    check_number,
    recipe,
    register_scheme,
)


@register_scheme
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
    # ``fxquant.core.reference_bnb.quantize_4bit`` says each one's layout; the nested three are
    # stored with double quant only
    constants = ("qweight", "absmax", "quant_map")
    optional_constants = ("nested_absmax", "nested_quant_map", "nested_offset")
    op_params = (("block_size", "SymInt"),)
    reference = staticmethod(ref_bnb.bnb4_weight_only_linear)
    quant_type: str = "nf4"
    block_size: int = 64
    double_quant: bool = False

    def __post_init__(self) -> None:
        n = "Bnb4WeightOnly"
        check_choice(n, "quant_type", self.quant_type, ("nf4", "fp4"))
        check_choice(n, "block_size", self.block_size, (64, 128, 256, 512, 1024, 2048, 4096))
        check_choice(n, "double_quant", self.double_quant, (True, False))

    def unsupported_reason(self, *, out_features: int, in_features: int) -> str | None:
        if in_features % 2:
            return (
                f"in_features={in_features} is odd: two 4-bit values share a byte along K, "
                "and fxquant keeps each output row's bytes to itself"
            )
        return None

    def quantize(self, w):
        t = ref_bnb.quantize_4bit(
            w,
            quant_type=self.quant_type,
            block_size=self.block_size,
            double_quant=self.double_quant,
        )
        names = (*self.constants, *self.optional_constants)
        dq = ref_bnb.dequantize_4bit(*(t.get(n) for n in names), block_size=self.block_size)
        return QuantizedWeight(t, dq)


@register_scheme
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
    # int8 [N, K]; "absmax": bnb's SCB, the row's absmax fp32 [N] (dequant multiplier / 127)
    constants = ("qweight", "absmax")
    op_params = (("threshold", "float"),)
    reference = staticmethod(ref_bnb.llm_int8_linear)
    threshold: float = 6.0

    def __post_init__(self) -> None:
        t = check_number(
            "LLMInt8",
            "threshold",
            self.threshold,
            ok=lambda v: 0 <= v < float("inf"),
            allowed="a finite number >= 0 (0 turns the outlier decomposition off; "
            "bitsandbytes' default is 6.0)",
        )
        object.__setattr__(self, "threshold", t)

    def quantize(self, w):
        q, scb = ref_bnb.quantize_llm_int8_weight(w)
        return QuantizedWeight({"qweight": q, "absmax": scb}, q.float() * (scb[:, None] / 127))


recipe("nf4", Bnb4WeightOnly(quant_type="nf4"))
recipe("fp4", Bnb4WeightOnly(quant_type="fp4"))
recipe("llm-int8", LLMInt8())
