"""The old path of the Hugging Face ``from_pretrained`` bridge, kept because the README showed
it: the bridge is ``fxquant.hf.bridge`` (``fxquant/hf/bridge.py``). Importing either registers
``quant_method="fxquant"`` with transformers."""

from fxquant.hf.bridge import (
    QUANT_METHOD,
    ROWS_KEY,
    FxquantHfConfig,
    FxquantHfQuantizer,
    QuantizedLinear,
    quantize_linears,
)

__all__ = [
    "QUANT_METHOD",
    "ROWS_KEY",
    "FxquantHfConfig",
    "FxquantHfQuantizer",
    "QuantizedLinear",
    "quantize_linears",
]
