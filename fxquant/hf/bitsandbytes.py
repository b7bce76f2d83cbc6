"""``BitsAndBytesConfig`` (``quant_method="bitsandbytes"``) → ``LLMInt8`` (8-bit) or
``Bnb4WeightOnly`` (NF4 / FP4): its ``HF_CONFIGS`` entry beside its mapper; ``from_hf``
dispatches on quant_method."""

from __future__ import annotations

from typing import Any

from fxquant.core.config import Bnb4WeightOnly, LLMInt8, QuantConfig
from fxquant.hf.base import maps, not_converted, refuse

BITSANDBYTES = {
    "class": "BitsAndBytesConfig",
    "status": "mapped",
    # config.json carries the flags twice, as the object's private attributes too
    "private_fields": ("_load_in_4bit", "_load_in_8bit"),
    "fields": {
        "load_in_8bit": "True → LLMInt8 (int8 per token × int8 per output channel, outlier "
        "columns in float against the dequantized int8 weight, inputs on the fp16 grid: "
        "bnb's own rule)",
        "load_in_4bit": "True → Bnb4WeightOnly (bnb's NF4/FP4 tables, absmax per block of "
        "64 over the flattened weight: bnb's default block, which transformers does not "
        "change); neither flag set is refused (nothing to quantize)",
        "llm_int8_threshold": "LLMInt8(threshold=...); 0 or less → no outlier "
        "decomposition, as in bnb",
        "llm_int8_skip_modules": "QuantConfig.modules_to_not_convert (names, for 8-bit and "
        "4-bit alike; None keeps fxquant's default, lm_head)",
        "llm_int8_enable_fp32_cpu_offload": "accepted, no effect: it only lets a device_map "
        "keep modules on the CPU in fp32; fxquant has no device_map (list such modules in "
        "llm_int8_skip_modules)",
        "llm_int8_has_fp16_weight": "accepted: bnb keeps an fp16 master weight for "
        "fine-tuning but re-quantizes it with the same rule every forward and computes the "
        "outlier columns with the dequantized int8 weight either way, so inference "
        "numerics are the same; fxquant keeps no fp16 copy (no training)",
        "bnb_4bit_compute_dtype": "float32 (the default) honoured exactly; bfloat16 / "
        "float16 accepted: the weights quantize to the same codes, and fxquant decodes and "
        "accumulates in fp32 and returns the activation's dtype instead of rounding the "
        "decoded weight to the compute dtype first (at least as precise)",
        "bnb_4bit_quant_type": "'nf4' / 'fp4' → Bnb4WeightOnly(quant_type=...)",
        "bnb_4bit_use_double_quant": "Bnb4WeightOnly(double_quant=True): the absmax "
        "values minus their mean quantized to 8 bits with bnb's dynamic map in blocks of "
        "256, as bnb",
        "bnb_4bit_quant_storage": "accepted: bnb only reinterprets the packed bytes as "
        "that dtype (for FSDP); fxquant stores uint8, the same bytes",
    },
}

_BNB_COMPUTE_DTYPES = ("float32", "bfloat16", "float16")
_BNB_STORAGE_DTYPES = ("uint8", "int8", "float16", "bfloat16", "float32", "float64")


def _dtype_name(value: Any, default: str) -> str:
    """torch.bfloat16, 'bfloat16' or 'torch.bfloat16' → 'bfloat16' (None → default)."""
    if value is None:
        return default
    return str(value).removeprefix("torch.")


def _bnb_flag(f: dict[str, Any], name: str) -> bool:
    value = f.get(name, f.get(f"_{name}", False))
    private = f.get(f"_{name}")
    if private is not None and bool(private) != bool(value):
        raise refuse(
            "BitsAndBytesConfig", name, value, f"it disagrees with _{name}={private!r} in the dict"
        )
    return bool(value)


@maps("bitsandbytes", BITSANDBYTES)
def _bitsandbytes(f: dict[str, Any]) -> QuantConfig:
    cls = "BitsAndBytesConfig"
    in4, in8 = _bnb_flag(f, "load_in_4bit"), _bnb_flag(f, "load_in_8bit")
    if in4 and in8:
        raise ValueError(
            f"{cls}: load_in_4bit and load_in_8bit are both True; allowed: one of them "
            "(transformers rejects this too)"
        )
    if not (in4 or in8):
        raise ValueError(
            f"{cls}: neither load_in_4bit nor load_in_8bit is True, so the config quantizes "
            "nothing; set one of them"
        )
    skip = not_converted(f, "llm_int8_skip_modules")
    if in8:
        threshold = f.get("llm_int8_threshold", 6.0)
        # bnb decomposes only when threshold > 0: a negative one means no outliers, like 0
        return QuantConfig(scheme=LLMInt8(threshold=max(float(threshold), 0.0)), **skip)
    quant_type = f.get("bnb_4bit_quant_type", "fp4")
    if quant_type not in ("nf4", "fp4"):
        raise refuse(cls, "bnb_4bit_quant_type", quant_type, "bitsandbytes defines 'nf4', 'fp4'")
    compute = _dtype_name(f.get("bnb_4bit_compute_dtype"), "float32")
    if compute not in _BNB_COMPUTE_DTYPES:
        raise refuse(
            cls, "bnb_4bit_compute_dtype", compute, f"allowed: {', '.join(_BNB_COMPUTE_DTYPES)}"
        )
    storage = _dtype_name(f.get("bnb_4bit_quant_storage"), "uint8")
    if storage not in _BNB_STORAGE_DTYPES:
        raise refuse(
            cls, "bnb_4bit_quant_storage", storage, f"allowed: {', '.join(_BNB_STORAGE_DTYPES)}"
        )
    double_quant = f.get("bnb_4bit_use_double_quant", False)
    if not isinstance(double_quant, bool):
        raise refuse(cls, "bnb_4bit_use_double_quant", double_quant, "allowed: True, False")
    scheme = Bnb4WeightOnly(quant_type=quant_type, block_size=64, double_quant=double_quant)
    return QuantConfig(scheme=scheme, **skip)
