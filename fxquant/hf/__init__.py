"""``from_hf``: a Hugging Face quantization config (a transformers ``*Config`` object, or the
``quantization_config`` dict of a model's ``config.json``) → a ``QuantConfig`` with the same
numerics, or ``NotImplementedError`` saying exactly what fxquant lacks for it.

Where it sits: before everything else, beside ``fxquant.core.config``; it only builds a config.
transformers is not imported: objects are read by attribute, so plain dicts work without it.

A config maps only where an fxquant scheme computes what the original does: the same grid, the
same scale rule, the same activation handling. Where one detail differs (torchao and
compressed-tensors scale symmetric int8 by amax / 127.5, fxquant by amax / 127) the config is
refused, not approximated. The exceptions are NVFP4Config's scope (its Hub kernel
takes bias-free linears and decodes with bf16 activations) and AwqConfig's asymmetric grid:
their rows say "Approximated" and how, and mapping them warns (``ApproximationWarning``).
GPTQConfig and AwqConfig choose their weights from data: ``calibration_from_hf`` returns the
config *and* the calibration method for ``fxquant.calibrate``; ``from_hf`` refuses them,
pointing there. ``HF_CONFIGS`` says, per config and per field, how it is honoured;
docs/hf_configs.md is generated from it (``python -m fxquant.hf > docs/hf_configs.md``) and a
test checks it covers every field transformers defines.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping
from typing import Any

from fxquant.core.config import (
    MXFP4,
    NVFP4,
    BitNetTernary,
    Bnb4WeightOnly,
    Float8Block,
    Float8Dynamic,
    Float8WeightOnly,
    Int4WeightOnly,
    Int8WeightOnly,
    IntxWeightOnly,
    LLMInt8,
    QuantConfig,
    Scheme,
)

__all__ = ["HF_CONFIGS", "ApproximationWarning", "calibration_from_hf", "docs_table", "from_hf"]


class ApproximationWarning(UserWarning):
    """A Hugging Face config was mapped with a documented approximation (its ``HF_CONFIGS``
    entry's ``"approximated"``): raised as a warning so that it is never silent."""


_SKIP = "QuantConfig.modules_to_not_convert (names; None keeps fxquant's default, lm_head)"
_NOT_YET = "refused with the config"

# quant_method → (transformers class, status, why / how, {field: how it is honoured}).
HF_CONFIGS: dict[str, dict[str, Any]] = {
    "eetq": {
        "class": "EetqConfig",
        "status": "mapped",
        "fields": {
            "weights": "'int8' → Int8WeightOnly (per output channel, amax / 127, as EETQ); "
            "anything else refused",
            "modules_to_not_convert": _SKIP,
        },
    },
    "fbgemm_fp8": {
        "class": "FbgemmFp8Config",
        "status": "mapped",
        "fields": {
            "activation_scale_ub": "Float8Dynamic(granularity='row', activation_scale_ub=...)",
            "modules_to_not_convert": _SKIP,
        },
    },
    "fp8": {
        "class": "FineGrainedFP8Config",
        "status": "mapped",
        "fields": {
            "activation_scheme": "'dynamic' → per-token 1×b groups (Float8Block); 'static' "
            "refused (needs a calibrated per-layer scale)",
            "weight_block_size": "(b, b), b in 32/64/128/256 → Float8Block(block_size=b); "
            "other shapes refused",
            "dequantize": "True → no layer quantized (the model stays in high precision)",
            "modules_to_not_convert": _SKIP,
            "modules_to_convert": "only these modules are quantized (QuantConfig.overrides)",
            "scale_fmt": "'float' honoured; 'ue8m0' (power-of-two block scales) refused",
            "expert_dtype": "'fp8' honoured for experts that are nn.Linear (3-D expert weights "
            "stay float: fxquant's grouped expert op is MXFP4 weight-only); 'fp4' refused "
            "(DeepSeek-V4's FP4 experts run with FP8 block activations, which that op lacks)",
        },
    },
    "quanto": {
        "class": "QuantoConfig",
        "status": "mapped",
        "fields": {
            "weights": "'int8' → Int8WeightOnly, 'float8' → Float8WeightOnly (per output "
            "channel, absmax / qmax, as quanto); 'int4' refused (quanto's affine groups "
            "carry a float shift, Int4WeightOnly an integer zero point), 'int2' refused "
            "(quanto's groups are 128, 96, 64 or 32 wide or per channel depending on K, and "
            "dequantize u·s - shift in the weight dtype; the nearest fxquant scheme, "
            "IntxWeightOnly(bits=2, zero_point='float'), computes (u - z)·s in fp32)",
            "activations": "None honoured; 'int8' / 'float8' refused (quanto calibrates "
            "static activation scales; no calibration yet)",
            "modules_to_not_convert": _SKIP,
        },
    },
    "torchao": {
        "class": "TorchAoConfig",
        "status": "mapped",
        "fields": {
            "quant_type": "'float8_weight_only' / Float8WeightOnlyConfig → Float8WeightOnly; "
            "'float8_dynamic_activation_float8_weight' / "
            "Float8DynamicActivationFloat8WeightConfig → Float8Dynamic (PerTensor → 'tensor', "
            "PerRow → 'row', activation_value_ub → activation_scale_ub); int8 configs refused "
            "(torchao scales symmetric int8 by amax / 127.5), int4 refused (float zero-point "
            "domain), the rest refused",
            "modules_to_not_convert": _SKIP,
            "include_input_output_embeddings": "False honoured; True refused (embeddings "
            "are not quantized)",
            "untie_embedding_weights": "accepted; no effect while embeddings stay in float",
        },
    },
    "compressed-tensors": {
        "class": "CompressedTensorsConfig",
        "status": "mapped",
        "fields": {
            "config_groups": "fp8 channel weights + fp8 dynamic token activations → "
            "Float8Dynamic('row'); fp8 tensor + dynamic tensor → Float8Dynamic('tensor'); fp8 "
            "channel weights alone → Float8WeightOnly; fp8 b×b block weights + dynamic 1×b "
            "group activations → Float8Block(b); presets FP8_DYNAMIC, FP8_BLOCK. Integer "
            "schemes refused (symmetric scale amax / 127.5 or / 7.5), static activations "
            "refused (calibration). FP4: NVFP4 weights (tensor_group, 16) alone → "
            "NVFP4(activations=False) (same two-level rule, except for blocks whose e4m3 "
            "scale falls below 2**-6: fxquant clamps it there as torchao, compressed-tensors "
            "rounds it and turns a zero into 0.125), with "
            "NVFP4 activations refused (their tensor scale is calibrated, fxquant's per "
            "call); MX weights (group 32, uint8 scales) → MXFP4(scale_rule='even', "
            "compressed-tensors' power-of-two rounding), with dynamic MX activations → "
            "activations=True; presets NVFP4A16, MXFP4A16, MXFP4. targets 'Linear' → default "
            "scheme, 're:<regex>' or names → overrides",
            "format": "accepted (the checkpoint layout; quantizing from float does not use it)",
            "quantization_status": "accepted, informational",
            "kv_cache_scheme": "None honoured; a KV-cache scheme is refused",
            "global_compression_ratio": "accepted, informational",
            "ignore": "QuantConfig.modules_to_not_convert ('re:' entries as regexes, names "
            "exactly)",
            "quant_method": "'compressed-tensors'",
            "run_compressed": "accepted: fxquant always runs the quantized ops",
            "dequantize": "True → no layer quantized",
            "use_optimized_inference": "accepted, no effect",
        },
    },
    "gptq": {
        "class": "GPTQConfig",
        "status": "calibration",
        "why": "GPTQ chooses its weights from calibration data, which a QuantConfig alone "
        "cannot say (quantize() would round to nearest): `fxquant.calibration_from_hf(cfg)` "
        "returns the QuantConfig and the `GPTQ` method for `fxquant.calibrate(model, config, "
        "data, method=...)`; GPTQ checkpoints (v1 and v2) load with `fxquant.load_quantized`",
        # keys that config.json files of GPTQ checkpoints carry beside GPTQConfig's own
        "private_fields": (
            "checkpoint_format",
            "static_groups",
            "lm_head",
            "model_name_or_path",
            "model_file_base_name",
            "use_exllama",
            "exllama_config",
            "use_cuda_fp16",
        ),
        "fields": {
            "bits": "4 → Int4WeightOnly, 8 → Int8WeightOnly (per output channel, needs "
            "group_size=-1 and sym=True); 2 and 3 refused (GPTQ produces int4 and int8 weights)",
            "group_size": "int4: 32, 64, 128 or 256 → Int4WeightOnly(group_size=...); -1 (one "
            "group per row) refused for int4",
            "damp_percent": "GPTQ(damp_percent=...)",
            "desc_act": "True → GPTQ(desc_act=True) with static_groups=True (config.json's "
            "static_groups); without static groups refused for int4 (the groups would follow "
            "g_idx, fxquant's are contiguous along K)",
            "act_group_aware": "GPTQ(act_group_aware=...) (groups whole, no g_idx; ignored "
            "with desc_act, as GPTQModel)",
            "sym": "Int4WeightOnly(symmetric=...): s = amax / 7 with z = 8, or an integer zero "
            "point and s = (max - min) / 15 over a range that includes 0, as GPTQ's quantizer",
            "true_sequential": "True honoured (finer: each linear is calibrated on the inputs "
            "the quantized linears before it give); False refused",
            "format": "accepted: a checkpoint layout ('gptq' / 'gptq_v2'), not a numeric",
            "tokenizer": "accepted, not used: `calibrate` takes token ids as `data`",
            "dataset": "accepted, not used: tokenize the samples and pass them as `data`",
            "model_seqlen": "accepted, not used: the samples' length is theirs",
            "batch_size": "accepted, no effect (all samples are run)",
            "pad_token_id": "accepted, not used",
            "max_input_length": "accepted, no effect",
            "cache_block_outputs": "accepted, no effect (a memory trade-off of transformers' loop)",
            "meta": "accepted, informational",
            "backend": "accepted, no effect (a kernel choice)",
            "block_name_to_quantize": "accepted, not needed: the linears are found in the "
            "exported graph",
            "module_name_preceding_first_block": "accepted, not needed",
            "modules_in_block_to_quantize": "None honoured; a list refused (use "
            "QuantConfig.overrides)",
        },
    },
    "awq": {
        "class": "AwqConfig",
        "status": "calibration",
        "why": "AWQ chooses per-channel scales and clipping from calibration data: "
        "`fxquant.calibration_from_hf(cfg)` returns the QuantConfig and the `AWQ` method for "
        "`fxquant.calibrate`; AWQ GEMM checkpoints load with `fxquant.load_quantized`",
        "private_fields": (
            "version",
            "do_fuse",
            "fuse_max_seq_len",
            "modules_to_fuse",
            "exllama_config",
        ),
        "fields": {
            "bits": "4 → Int4WeightOnly; anything else refused",
            "group_size": "32, 64, 128 or 256 → Int4WeightOnly(group_size=...); others refused",
            "zero_point": "True → symmetric=False (integer zero point; approximated: fxquant's "
            "range includes 0, AWQ's is the group's [min, max]); False → symmetric=True "
            "(amax / 7, codes -8..7, as AWQ)",
            "backend": "accepted, no effect (a kernel choice)",
            "modules_to_not_convert": _SKIP,
        },
    },
    "auto-round": {
        "class": "AutoRoundConfig",
        "status": "refused",
        "why": "AutoRound tunes "
        "rounding with signed gradient descent over calibration data (not built); "
        "its checkpoints use the GPTQ/AWQ layouts, whose loaders are not built",
    },
    "bitsandbytes": {
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
    },
    "hqq": {
        "class": "HqqConfig",
        "status": "mapped",
        # config.json holds HQQ's own dict (BaseQuantizeConfig) instead of the arguments
        "private_fields": ("quant_config",),
        "fields": {
            "nbits": "4, 3, 2 → IntxWeightOnly(bits=nbits, zero_point='float', "
            "optimizer='hqq'): HQQ's grid (the group's [min, max] onto [0, 2**nbits - 1], "
            "inverse scale capped at 2e4, float zero point) and its default solver "
            "(fxquant.core.hqq: p = 0.7, β = 10, κ = 1.01, 20 iterations, early stop), in fp32 as "
            "HQQ runs on CPU (on CUDA HQQ runs it in fp16 and keeps scale and zero in the "
            "compute dtype, so results differ by that rounding); 8 and 1 refused (no 8-bit "
            "asymmetric or 1-bit format)",
            "group_size": "32, 64, 128, 256 honoured; other sizes and None (whole rows) "
            "refused; layers whose K is not a multiple are skipped (HQQ would need groups "
            "spanning rows)",
            "view_as_float": "accepted: HQQ only reinterprets the packed bytes as floats for "
            "storage; the numerics are the same",
            "axis": "1 (groups along K; None means 1, as in transformers) honoured; 0 (groups "
            "strided along the output dim) refused",
            "dynamic_config": "{layer tag: params} → QuantConfig.overrides (the tag, e.g. "
            "'self_attn.q_proj', matches every module name ending in it); layers no tag "
            "names stay in float, as in transformers",
            "skip_modules": _SKIP,
        },
    },
    "sinq": {
        "class": "SinqConfig",
        "status": "refused",
        "why": "SINQ's Sinkhorn-normalised dual scales are not built",
    },
    "higgs": {
        "class": "HiggsConfig",
        "status": "refused",
        "why": "HIGGS needs a Hadamard "
        "rotation and vector quantization onto Gaussian-optimal grids: not built",
    },
    "aqlm": {
        "class": "AqlmConfig",
        "status": "refused",
        "why": "AQLM's additive codebooks "
        "(weights as sums of learned codewords) have no fxquant format",
    },
    "vptq": {
        "class": "VptqConfig",
        "status": "refused",
        "why": "VPTQ's vector codebooks with residual and outlier codebooks have no fxquant format",
    },
    "spqr": {
        "class": "SpQRConfig",
        "status": "refused",
        "why": "SpQR's 3-bit groups with "
        "bilevel scales and sparse fp16 outliers have no fxquant format",
    },
    "bitnet": {
        "class": "BitNetQuantConfig",
        "status": "mapped",
        "fields": {
            "linear_class": "'bitlinear' and 'autobitlinear' → BitNetTernary: ternary "
            "weights round(W / mean(abs(W))) clamped to ±1 and int8 activations per token "
            "(127 / amax, clamp [-128, 127]), both with transformers' eps 1e-5, integer "
            "products scaled once in fp32 (AutoBitLinear multiplies the dequantized operands "
            "in the model dtype instead: same grids, different rounding order)",
            "quantization_mode": "'offline' and 'online' both honoured: they say when "
            "transformers quantizes the weight (in the checkpoint, or at each forward), not "
            "how; fxquant quantizes it once with the same rule",
            "use_rms_norm": "False honoured; True refused (it puts an RMSNorm with its own "
            "trained weights inside each BitLinear, a layer the float model does not have)",
            "rms_norm_eps": "accepted; used only with use_rms_norm=True, which is refused",
            "modules_to_not_convert": _SKIP,
        },
    },
    "mxfp4": {
        "class": "Mxfp4Config",
        "status": "mapped",
        "fields": {
            "modules_to_not_convert": _SKIP + ". → MXFP4(activations=False, "
            "scale_rule='ceil') on the mixture-of-experts weights only (`experts.gate_up_proj`"
            " / `experts.down_proj`, 3-D, run by transformers' grouped_mm), as transformers "
            "quantizes gpt-oss: every nn.Linear (attention, router, lm_head) stays float. e2m1 "
            "weights in blocks of 32 along K with an E8M0 scale each, rounded up "
            "(triton_kernels' downcast_to_mxfp), activations in float",
            "dequantize": "False honoured; True refused (it asks for float weights: load the "
            "model with transformers, no fxquant config is needed)",
        },
    },
    "nvfp4": {
        "class": "NVFP4Config",
        "status": "mapped",
        "approximated": "the Hub kernel transformers loads for NVFP4Config runs decode (one "
        "token) with bf16 activations and quantizes only bias-free linears; fxquant quantizes "
        "activations at every batch size and biased linears too",
        "fields": {
            "modules_to_not_convert": _SKIP + ". → NVFP4(activations=True, "
            "scale_rule='six'): e2m1 weights, e4m3 scales per 16, fp32 tensor scale amax / "
            "(6 · 448), activations quantized per call the same way. Approximated (the mapping "
            "warns): the Hub kernel transformers loads runs decode GEMVs with bf16 activations "
            "(W4A16) and only bias-free linears with K and N multiples of 16; fxquant "
            "quantizes activations at every M and takes biased linears too",
        },
    },
    "fouroversix": {
        "class": "FourOverSixConfig",
        "status": "mapped",
        "fields": {
            "dtype": "'nvfp4' → NVFP4; 'mxfp4' → MXFP4(activations=True, scale_rule='ceil') "
            "(fouroversix's MXFP4: amax / 6 rounded up to a power of two), static_6 only; "
            "other dtypes refused",
            "scale_rule": "'mse' → NVFP4(scale_rule='four_over_six') (each 16-block keeps "
            "the lower squared error of amax → 6 and amax → 4, tensor scale amax / (6 · 256)); "
            "'static_6' → NVFP4(scale_rule='six') (block scales below 2**-6 are clamped there, "
            "as torchao; fouroversix leaves them unclamped); 'mae', 'abs_max', 'static_4' "
            "refused (not built)",
            "weight_dtype": "None or equal to dtype; anything else refused",
            "activation_dtype": "None or equal to dtype (weights and activations both "
            "quantized); anything else refused",
            "weight_scale_rule": "None or equal to scale_rule; anything else refused (one "
            "rule for weights and activations)",
            "activation_scale_rule": "None or equal to scale_rule; anything else refused",
            "gradient_dtype": "accepted, no effect (training only)",
            "gradient_scale_rule": "accepted, no effect (training only)",
            "keep_master_weights": "accepted: the weights quantize with the same rule once "
            "instead of every forward; no training",
            "matmul_backend": "accepted: every backend computes the dequantized product with "
            "fp32 accumulation, as fxquant",
            "quantize_backend": "accepted: the backends implement the same rounding",
            "output_dtype": "accepted: fxquant returns the activation's dtype (bf16 for a "
            "bf16 model) instead of forcing it",
            "weight_scale_2d": "False honoured; True (16×16 weight scale tiles, for training) "
            "refused",
            "module_config_overrides": "None or empty honoured; per-module overrides refused",
            "modules_to_not_convert": _SKIP,
        },
    },
    "fp_quant": {
        "class": "FPQuantConfig",
        "status": "refused",
        "why": "FP-Quant rotates each group of weights and activations by a Hadamard (or "
        "GSR) transform before MXFP4/NVFP4 quantization: fxquant has both formats but no "
        "rotation pass; transform_init='identity' is refused too, as its abs_max / QuEST "
        "scale rules are not checked against fxquant's",
    },
    "metal": {
        "class": "MetalConfig",
        "status": "refused",
        "why": "Apple Metal's affine "
        "groups (float scale and bias per group) have no fxquant format yet",
    },
    "quark": {
        "class": "QuarkConfig",
        "status": "refused",
        "why": "Quark configs name AMD Quark's own per-layer schemes; no mapping is built yet",
    },
    "gguf": {
        "class": "GgufConfig",
        "status": "refused",
        "why": "GGUF is a checkpoint format, not a way to quantize a float model: "
        "`fxquant.load_quantized(ep, 'model.gguf')` loads Q4_0, Q6_K and Q8_0 exactly and Q4_1 "
        "/ Q4_K with float zero points into fxquant constants (5-bit types refused: no 5-bit "
        "format); `fxquant quantize model.gguf` dequantizes and requantizes instead",
    },
}
_BY_CLASS = {v["class"]: k for k, v in HF_CONFIGS.items()}


def _fields(obj: Any) -> dict[str, Any]:
    if isinstance(obj, Mapping):
        return dict(obj)
    if hasattr(obj, "to_dict"):  # transformers' QuantizationConfigMixin
        d = dict(obj.to_dict())
        # to_dict serialises some objects (torchao configs); keep the live ones. Mxfp4Config's
        # to_dict drops dequantize, which changes what the config asks for.
        for key in ("quant_type", "dequantize"):
            if hasattr(obj, key):
                d[key] = getattr(obj, key)
        return d
    return {k: v for k, v in vars(obj).items() if not k.startswith("_")}


def _method(obj: Any, fields: dict[str, Any]) -> str:
    name = type(obj).__name__
    if name in _BY_CLASS:
        return _BY_CLASS[name]
    method = fields.get("quant_method")
    method = getattr(method, "value", method)
    if method in HF_CONFIGS:
        return str(method)
    raise ValueError(
        f"from_hf cannot tell which quantization config {obj!r} is: pass a transformers "
        "*Config object or a quantization_config dict with 'quant_method' (one of "
        f"{', '.join(sorted(HF_CONFIGS))})"
    )


def from_hf(config: Any) -> QuantConfig:
    """The fxquant config with the same numerics as a Hugging Face quantization config, or
    ``NotImplementedError`` naming what is missing. See ``HF_CONFIGS`` / docs/hf_configs.md.
    A mapping with a documented approximation (NVFP4Config's scope) warns with
    ``ApproximationWarning``."""
    fields = _fields(config)
    method = _method(config, fields)
    entry = HF_CONFIGS[method]
    if entry["status"] == "refused":
        raise NotImplementedError(f"{entry['class']} is not supported yet: {entry['why']}")
    if entry["status"] == "calibration":
        raise NotImplementedError(f"from_hf({entry['class']}): {entry['why']}")
    _check_fields(entry, config, fields)
    return _approximated(entry, _MAPPERS[method](fields))


def calibration_from_hf(config: Any) -> tuple[QuantConfig, Any]:
    """``(QuantConfig, method)`` for a config whose weights come from calibration (``GPTQConfig``,
    ``AwqConfig``): ``fxquant.calibrate(model, config, data, method=method)`` then quantizes as
    the original would. Other configs raise ``ValueError`` (use ``from_hf``)."""
    fields = _fields(config)
    method = _method(config, fields)
    entry = HF_CONFIGS[method]
    if entry["status"] != "calibration":
        raise ValueError(
            f"calibration_from_hf({entry['class']}): this config needs no calibration data; "
            "use fxquant.from_hf"
        )
    _check_fields(entry, config, fields)
    qconfig, algorithm, approximation = _CALIBRATION_MAPPERS[method](fields)
    if approximation:
        warnings.warn(f"{entry['class']} mapped approximately: {approximation}",
                      ApproximationWarning, stacklevel=2)  # fmt: skip
    return qconfig, algorithm


def _check_fields(entry: Mapping[str, Any], config: Any, fields: Mapping[str, Any]) -> None:
    if not isinstance(config, Mapping):
        return
    # a config.json dict may carry keys a transformers object would have rejected: a key we do
    # not know could change the numerics, so it is refused rather than ignored
    unknown = (
        set(fields)
        - set(entry["fields"])
        - set(entry.get("private_fields", ()))
        - {"quant_method", "fmt"}
    )
    if unknown:
        raise NotImplementedError(
            f"{entry['class']} fields {sorted(unknown)} are not known to fxquant; known: "
            + ", ".join(entry["fields"])
        )
    if fields.get("fmt", "e4m3") != "e4m3":
        raise _refuse(entry["class"], "fmt", fields["fmt"], "fxquant's fp8 is e4m3")


def _approximated(entry: Mapping[str, Any], result: QuantConfig) -> QuantConfig:
    how = entry.get("approximated")
    if how and (result.scheme is not None or result.overrides):
        warnings.warn(f"{entry['class']} mapped approximately: {how}", ApproximationWarning,
                      stacklevel=3)  # fmt: skip
    return result


def _refuse(cls: str, field: str, value: Any, why: str) -> NotImplementedError:
    return NotImplementedError(f"{cls}({field}={value!r}) is not supported: {why}")


def _skip(fields: dict[str, Any], key: str = "modules_to_not_convert") -> dict[str, Any]:
    names = fields.get(key)
    return {} if names is None else {"modules_to_not_convert": tuple(names)}


def _eetq(f: dict[str, Any]) -> QuantConfig:
    if f.get("weights", "int8") != "int8":
        raise _refuse("EetqConfig", "weights", f["weights"], "EETQ only defines int8")
    return QuantConfig(scheme=Int8WeightOnly(), **_skip(f))


def _fbgemm(f: dict[str, Any]) -> QuantConfig:
    ub = f.get("activation_scale_ub", 1200.0)
    return QuantConfig(scheme=Float8Dynamic(granularity="row", activation_scale_ub=ub), **_skip(f))


def _fine_grained(f: dict[str, Any]) -> QuantConfig:
    cls = "FineGrainedFP8Config"
    if str(f.get("activation_scheme", "dynamic")).lower() != "dynamic":
        raise _refuse(
            cls,
            "activation_scheme",
            f["activation_scheme"],
            "static activation scales need calibration (not built yet)",
        )
    block = f.get("weight_block_size", (128, 128))
    if (
        block is None
        or len(block) != 2
        or block[0] != block[1]
        or block[0] not in (32, 64, 128, 256)
    ):
        raise _refuse(
            cls, "weight_block_size", block, "Float8Block takes square blocks of 32, 64, 128 or 256"
        )
    if f.get("scale_fmt", "float") != "float":
        raise _refuse(
            cls,
            "scale_fmt",
            f["scale_fmt"],
            "power-of-two (ue8m0) block scales are not a Float8Block option yet",
        )
    if f.get("expert_dtype", "fp8") != "fp8":
        raise _refuse(
            cls,
            "expert_dtype",
            f["expert_dtype"],
            "DeepSeek-V4's FP4 experts run with FP8 block activations; fxquant's grouped "
            "expert op (fxquant::mxfp4_grouped_mm) is MXFP4 weight-only",
        )
    if f.get("dequantize"):
        return QuantConfig(scheme=None, **_skip(f))
    scheme = Float8Block(block_size=int(block[0]))
    only = f.get("modules_to_convert")
    if only:
        overrides = {re.escape(n): scheme for n in only}
        return QuantConfig(scheme=None, overrides=overrides, **_skip(f))
    return QuantConfig(scheme=scheme, **_skip(f))


def _quanto(f: dict[str, Any]) -> QuantConfig:
    cls = "QuantoConfig"
    if f.get("activations") is not None:
        raise _refuse(
            cls,
            "activations",
            f["activations"],
            "quanto calibrates static activation scales; calibration is not built yet",
        )
    weights = f.get("weights", "int8")
    schemes = {"int8": Int8WeightOnly(), "float8": Float8WeightOnly()}
    if weights not in schemes:
        why = {
            "int4": "quanto's int4 groups are affine with a float shift; Int4WeightOnly "
            "stores an integer zero point, so the grids differ",
            "int2": "quanto's int2 groups are 128, 96, 64 or 32 wide or per channel "
            "depending on K, with a float shift dequantized as u·s - shift in the weight "
            "dtype; IntxWeightOnly(bits=2, zero_point='float') has the same grid rule but "
            "computes (u - z)·s in fp32, so it is not the same numerics (use it directly to "
            "accept that)",
        }.get(weights, "unknown weight type")
        raise _refuse(cls, "weights", weights, why)
    return QuantConfig(scheme=schemes[weights], **_skip(f))


def _type_name(quant_type: Any) -> tuple[str, Any]:
    """(config class name or string alias, the object or its _data dict)."""
    if isinstance(quant_type, str):
        return quant_type, {}
    if isinstance(quant_type, Mapping):
        if "default" in quant_type:  # config.json: {"default": {"_type": ..., "_data": ...}}
            quant_type = quant_type["default"]
        if "_type" in quant_type:
            return str(quant_type["_type"]), quant_type.get("_data", {})
    return type(quant_type).__name__, quant_type


def _get(obj: Any, name: str, default: Any = None) -> Any:
    if isinstance(obj, Mapping):
        return obj.get(name, default)
    return getattr(obj, name, default)


def _granularity(g: Any) -> str:
    """torchao PerTensor / PerRow (objects, their config.json dicts, or a pair of them)."""
    if isinstance(g, (list, tuple)) and g:
        kinds = {_granularity(x) for x in g}
        if len(kinds) != 1:
            raise _refuse(
                "Float8DynamicActivationFloat8WeightConfig",
                "granularity",
                g,
                "activation and weight granularities must agree",
            )
        return kinds.pop()
    name = _get(g, "_type", type(g).__name__) if g is not None else "PerTensor"
    if name in ("PerTensor", "NoneType"):
        return "tensor"
    if name == "PerRow":
        return "row"
    raise _refuse(
        "Float8DynamicActivationFloat8WeightConfig",
        "granularity",
        name,
        "allowed: PerTensor, PerRow",
    )


def _torchao(f: dict[str, Any]) -> QuantConfig:
    cls = "TorchAoConfig"
    if f.get("include_input_output_embeddings"):
        raise _refuse(
            cls,
            "include_input_output_embeddings",
            True,
            "fxquant quantizes linear layers, not embeddings",
        )
    name, data = _type_name(f.get("quant_type"))
    scheme: Scheme
    if name in ("float8_weight_only", "Float8WeightOnlyConfig"):
        scheme = Float8WeightOnly()
    elif name in (
        "float8_dynamic_activation_float8_weight",
        "Float8DynamicActivationFloat8WeightConfig",
    ):
        if _get(data, "activation_value_lb") is not None:
            raise _refuse(
                cls,
                "quant_type.activation_value_lb",
                _get(data, "activation_value_lb"),
                "fxquant bounds the activation amax from above only",
            )
        scheme = Float8Dynamic(
            granularity=_granularity(_get(data, "granularity")),
            activation_scale_ub=_get(data, "activation_value_ub"),
        )
    elif "int8" in name.lower() or "Int8" in name:
        raise _refuse(
            cls,
            "quant_type",
            name,
            "torchao scales symmetric int8 by amax / 127.5 "
            "(half the int8 range), fxquant's int8 schemes by amax / 127",
        )
    elif "int4" in name.lower():
        raise _refuse(
            cls,
            "quant_type",
            name,
            "torchao's int4 keeps zero points in the float domain; Int4WeightOnly's are integers",
        )
    else:
        raise _refuse(cls, "quant_type", name, "no fxquant scheme computes it")
    return QuantConfig(scheme=scheme, **_skip(f))


_CT_NV4 = {"type": "float", "num_bits": 4, "strategy": "tensor_group", "group_size": 16}
# FP4 groups of 32 with uint8 (E8M0 exponent) scales: compressed-tensors' MXFP4
_CT_MX4 = {
    "type": "float",
    "num_bits": 4,
    "strategy": "group",
    "group_size": 32,
    "scale_dtype": "uint8",
}
_CT_PRESETS = {
    "FP8_DYNAMIC": (
        {"type": "float", "num_bits": 8, "strategy": "channel"},
        {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True},
    ),
    "FP8_BLOCK": (
        {"type": "float", "num_bits": 8, "strategy": "block", "block_structure": [128, 128]},
        {"type": "float", "num_bits": 8, "strategy": "group", "group_size": 128, "dynamic": True},
    ),
    "NVFP4A16": (_CT_NV4, None),
    "NVFP4": (_CT_NV4, {**_CT_NV4, "dynamic": "local"}),  # refused: calibrated tensor scale
    "MXFP4A16": (_CT_MX4, None),
    "MXFP4": (_CT_MX4, {**_CT_MX4, "dynamic": True}),
}


def _ct_fp4(name: str, w: Mapping, a: Mapping | None) -> Scheme:
    """compressed-tensors' FP4 groups: NVFP4 (tensor_group of 16, e4m3 scales) or MXFP4 (groups
    of 32, uint8 E8M0 scales)."""
    cls = "CompressedTensorsConfig"
    key = f"config_groups[{name!r}]"
    ws, g = w.get("strategy"), w.get("group_size")
    scale_dtype = str(w.get("scale_dtype")).removeprefix("torch.")
    if ws == "tensor_group" and g == 16:
        if a is not None:
            raise _refuse(
                cls,
                f"{key}.input_activations",
                dict(a),
                "NVFP4 activations take a tensor scale calibrated offline (static_minmax); "
                "fxquant computes it from each call's activation",
            )
        return NVFP4(activations=False, scale_rule="six")
    if ws == "group" and g == 32 and scale_dtype == "uint8":
        if a is None:
            return MXFP4(activations=False, scale_rule="even")
        if (
            a.get("type") == "float"
            and a.get("num_bits") == 4
            and a.get("strategy") == "group"
            and a.get("group_size") == 32
            and a.get("dynamic") is True
        ):
            return MXFP4(activations=True, scale_rule="even")
        raise _refuse(
            cls,
            f"{key}.input_activations",
            dict(a),
            "MXFP4 weights map alone or with dynamic MXFP4 activations (groups of 32)",
        )
    raise _refuse(
        cls,
        f"{key}.weights",
        dict(w),
        "FP4 maps as NVFP4 (strategy 'tensor_group', group_size 16) or MXFP4 (strategy "
        "'group', group_size 32, scale_dtype uint8)",
    )


def _ct_scheme(name: str, w: Mapping | None, a: Mapping | None) -> Scheme:
    cls = "CompressedTensorsConfig"
    if w is None:
        raise _refuse(cls, f"config_groups[{name!r}].weights", None, "weights must be quantized")
    if w.get("type") == "float" and w.get("num_bits") == 4:
        return _ct_fp4(name, w, a)
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise _refuse(
            cls,
            f"config_groups[{name!r}].weights",
            dict(w),
            "only fp8 weights map: compressed-tensors scales symmetric integers by "
            "amax / 127.5 (int8) or amax / 7.5 (int4), fxquant by amax / 127 and / 7",
        )
    ws = w.get("strategy")
    if a is None:
        if ws == "channel":
            return Float8WeightOnly()
        raise _refuse(
            cls,
            f"config_groups[{name!r}].weights.strategy",
            ws,
            "fp8 weight-only maps with strategy 'channel' only",
        )
    if a.get("type") != "float" or a.get("num_bits") != 8 or a.get("dynamic") is not True:
        raise _refuse(
            cls,
            f"config_groups[{name!r}].input_activations",
            dict(a),
            "only dynamic fp8 activations map (static ones need calibration)",
        )
    ast = a.get("strategy")
    if ws == "channel" and ast == "token":
        return Float8Dynamic(granularity="row")
    if ws == "tensor" and ast == "tensor":
        return Float8Dynamic(granularity="tensor")
    if ws == "block" and ast == "group":
        bs = w.get("block_structure")
        if isinstance(bs, str):  # older files: "128x128"
            bs = [int(v) for v in bs.lower().split("x")]
        g = a.get("group_size")
        if bs and len(bs) == 2 and bs[0] == bs[1] == g and g in (32, 64, 128, 256):
            return Float8Block(block_size=int(g))
    raise _refuse(
        cls,
        f"config_groups[{name!r}]",
        f"weights {ws} / activations {ast}",
        "maps: channel/token, tensor/tensor, b×b block / 1×b group (b = 32..256)",
    )


def _ct_pattern(target: str) -> str | None:
    """A compressed-tensors target or ignore entry as a module-name regex (None: a class)."""
    if target.startswith("re:"):
        return target[3:]
    if target in ("Linear", "torch.nn.Linear"):
        return None
    return re.escape(target)


def _compressed_tensors(f: dict[str, Any]) -> QuantConfig:
    cls = "CompressedTensorsConfig"
    if f.get("kv_cache_scheme") is not None:
        raise _refuse(
            cls, "kv_cache_scheme", f["kv_cache_scheme"], "KV-cache quantization is not supported"
        )
    skip = {}
    if f.get("ignore") is not None:
        skip = {
            "modules_to_not_convert": tuple(
                p for p in (_ct_pattern(t) for t in f["ignore"]) if p is not None
            )
        }
    if f.get("dequantize"):
        return QuantConfig(scheme=None, **skip)
    default: Scheme | None = None
    overrides: dict[str, Scheme] = {}
    for name, group in (f.get("config_groups") or {}).items():
        if isinstance(group, (list, tuple)):  # a preset named by the key: {"FP8_DYNAMIC": [...]}
            if name not in _CT_PRESETS:
                raise _refuse(
                    cls, "config_groups", name, f"presets that map: {', '.join(_CT_PRESETS)}"
                )
            w, a = _CT_PRESETS[name]
            targets = list(group)
        else:
            w, a = group.get("weights"), group.get("input_activations")
            targets = list(group.get("targets") or ["Linear"])
            if group.get("output_activations") is not None:
                raise _refuse(
                    cls,
                    f"config_groups[{name!r}].output_activations",
                    group["output_activations"],
                    "output quantization is not supported",
                )
        scheme = _ct_scheme(name, w, a)
        for t in targets:
            pattern = _ct_pattern(t)
            if pattern is None:
                default = scheme
            else:
                overrides[pattern] = scheme
    if default is None and not overrides:
        raise _refuse(cls, "config_groups", f.get("config_groups"), "no group quantizes Linear")
    return QuantConfig(scheme=default, overrides=overrides, **skip)


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
        raise _refuse(
            "BitsAndBytesConfig", name, value, f"it disagrees with _{name}={private!r} in the dict"
        )
    return bool(value)


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
    skip = _skip(f, "llm_int8_skip_modules")
    if in8:
        threshold = f.get("llm_int8_threshold", 6.0)
        # bnb decomposes only when threshold > 0: a negative one means no outliers, like 0
        return QuantConfig(scheme=LLMInt8(threshold=max(float(threshold), 0.0)), **skip)
    quant_type = f.get("bnb_4bit_quant_type", "fp4")
    if quant_type not in ("nf4", "fp4"):
        raise _refuse(cls, "bnb_4bit_quant_type", quant_type, "bitsandbytes defines 'nf4', 'fp4'")
    compute = _dtype_name(f.get("bnb_4bit_compute_dtype"), "float32")
    if compute not in _BNB_COMPUTE_DTYPES:
        raise _refuse(
            cls, "bnb_4bit_compute_dtype", compute, f"allowed: {', '.join(_BNB_COMPUTE_DTYPES)}"
        )
    storage = _dtype_name(f.get("bnb_4bit_quant_storage"), "uint8")
    if storage not in _BNB_STORAGE_DTYPES:
        raise _refuse(
            cls, "bnb_4bit_quant_storage", storage, f"allowed: {', '.join(_BNB_STORAGE_DTYPES)}"
        )
    double_quant = f.get("bnb_4bit_use_double_quant", False)
    if not isinstance(double_quant, bool):
        raise _refuse(cls, "bnb_4bit_use_double_quant", double_quant, "allowed: True, False")
    scheme = Bnb4WeightOnly(quant_type=quant_type, block_size=64, double_quant=double_quant)
    return QuantConfig(scheme=scheme, **skip)


# the 3-D expert weights transformers' Mxfp4Config quantizes (gpt-oss' names)
MXFP4_EXPERTS = r"experts\.(gate_up_proj|down_proj)"


def _mxfp4(f: dict[str, Any]) -> QuantConfig:
    if f.get("dequantize"):
        raise _refuse(
            "Mxfp4Config",
            "dequantize",
            f["dequantize"],
            "it asks for float weights: load the model with transformers, no fxquant config is "
            "needed",
        )
    return QuantConfig(
        overrides={MXFP4_EXPERTS: MXFP4(activations=False, scale_rule="ceil")}, **_skip(f)
    )


def _nvfp4(f: dict[str, Any]) -> QuantConfig:
    return QuantConfig(scheme=NVFP4(activations=True, scale_rule="six"), **_skip(f))


_FOS_RULES = {"mse": "four_over_six", "static_6": "six"}


def _fouroversix(f: dict[str, Any]) -> QuantConfig:
    cls = "FourOverSixConfig"

    def name(key: str, default: Any = None) -> Any:
        v = f.get(key, default)
        return getattr(v, "value", v)  # fouroversix's str enums

    dtype, rule = name("dtype", "nvfp4"), name("scale_rule", "mse")
    for key, want in (
        ("weight_dtype", dtype),
        ("activation_dtype", dtype),
        ("weight_scale_rule", rule),
        ("activation_scale_rule", rule),
    ):
        if name(key) not in (None, want):
            raise _refuse(
                cls,
                key,
                name(key),
                "fxquant uses one format and rule for weights and activations; allowed: "
                f"None or {want!r}",
            )
    if f.get("weight_scale_2d"):
        raise _refuse(cls, "weight_scale_2d", True, "16×16 weight scale tiles are not built")
    if f.get("module_config_overrides"):
        raise _refuse(cls, "module_config_overrides", f["module_config_overrides"], "not supported")
    scheme: Scheme
    if dtype == "nvfp4":
        if rule not in _FOS_RULES:
            raise _refuse(cls, "scale_rule", rule, "allowed: 'mse', 'static_6'")
        scheme = NVFP4(activations=True, scale_rule=_FOS_RULES[rule])
    elif dtype == "mxfp4":
        if rule != "static_6":
            raise _refuse(cls, "scale_rule", rule, "MXFP4 maps with 'static_6' only")
        scheme = MXFP4(activations=True, scale_rule="ceil")
    else:
        raise _refuse(cls, "dtype", dtype, "allowed: 'nvfp4', 'mxfp4'")
    return QuantConfig(scheme=scheme, **_skip(f))


_HQQ_DEFAULTS = {"channel_wise": True, "optimize": True, "axis": 1, "view_as_float": False}


def _hqq_scheme(params: Mapping[str, Any]) -> IntxWeightOnly:
    """HQQ's ``weight_quant_params`` (or HqqConfig's arguments) → the scheme, or a refusal."""
    cls = "HqqConfig"
    known = {"nbits", "group_size", "round_zero", "scale_quant_params", "zero_quant_params"}
    unknown = set(params) - known - set(_HQQ_DEFAULTS)
    if unknown:
        raise _refuse(cls, "quant_config", sorted(unknown), "unknown HQQ parameters")
    p = {**_HQQ_DEFAULTS, **params}
    nbits = p.get("nbits", 4)
    if nbits not in (2, 3, 4):
        raise _refuse(cls, "nbits", nbits, "allowed: 4, 3, 2 (no 8-bit asymmetric or 1-bit format)")
    if not p["channel_wise"]:
        raise _refuse(cls, "channel_wise", False, "a single per-tensor scale is not a format")
    if p["axis"] not in (1, None):  # transformers turns None into 1
        raise _refuse(cls, "axis", p["axis"], "fxquant groups run along K (axis=1)")
    group_size = p.get("group_size", 64)
    if group_size not in (32, 64, 128, 256):
        raise _refuse(cls, "group_size", group_size, "allowed: 32, 64, 128, 256")
    optimize = bool(p["optimize"])
    # HQQ rounds the initial zero point for 4 bits only (its BaseQuantizeConfig's rule), and
    # fxquant's solver does the same; any other combination is a different starting point
    round_zero = p.get("round_zero", nbits == 4)
    if round_zero != (nbits == 4 and optimize):
        raise _refuse(
            cls,
            "round_zero",
            round_zero,
            f"fxquant rounds the initial zero point exactly when HQQ's default does (nbits=4 "
            f"with optimize=True); got nbits={nbits}, optimize={optimize}",
        )
    for key in ("scale_quant_params", "zero_quant_params"):
        if params.get(key) is not None:
            raise _refuse(cls, key, params[key], "8-bit quantized scales / zero points not built")
    return IntxWeightOnly(
        bits=nbits,
        group_size=group_size,
        zero_point="float",
        optimizer="hqq" if optimize else None,
    )


def _hqq_layer(cfg: Mapping[str, Any]) -> IntxWeightOnly:
    """One layer's HQQ config: BaseQuantizeConfig's dict, or HqqConfig's keyword arguments."""
    if "weight_quant_params" in cfg:
        # offload_meta only says where HQQ keeps scale and zero (CPU or GPU memory)
        extra = {k: cfg.get(k) for k in ("scale_quant_params", "zero_quant_params")}
        return _hqq_scheme({**cfg["weight_quant_params"], **extra})
    return _hqq_scheme(cfg)


def _hqq(f: dict[str, Any]) -> QuantConfig:
    skip = _skip(f, "skip_modules")
    qc = f.get("quant_config")
    dynamic = f.get("dynamic_config")
    if qc is not None and "weight_quant_params" not in qc:
        dynamic = qc  # the serialised form of dynamic_config: {tag: BaseQuantizeConfig}
    if dynamic:
        overrides = {re.escape(tag): _hqq_layer(c) for tag, c in dynamic.items()}
        return QuantConfig(scheme=None, overrides=overrides, **skip)
    if qc is not None:
        return QuantConfig(scheme=_hqq_layer(qc), **skip)
    args = {k: f[k] for k in ("nbits", "group_size", "axis", "view_as_float") if k in f}
    return QuantConfig(scheme=_hqq_scheme(args), **skip)


def _bitnet(f: dict[str, Any]) -> QuantConfig:
    cls = "BitNetQuantConfig"
    linear_class = f.get("linear_class", "bitlinear")
    if linear_class not in ("bitlinear", "autobitlinear"):
        raise _refuse(cls, "linear_class", linear_class, "allowed: 'bitlinear', 'autobitlinear'")
    mode = f.get("quantization_mode", "offline")
    if mode not in ("offline", "online"):
        raise _refuse(cls, "quantization_mode", mode, "allowed: 'offline', 'online'")
    if f.get("use_rms_norm"):
        raise _refuse(
            cls,
            "use_rms_norm",
            True,
            "it adds an RMSNorm with its own trained weights inside each linear; fxquant "
            "quantizes the model's layers and adds none",
        )
    return QuantConfig(scheme=BitNetTernary(), **_skip(f))


def _int4(cls: str, group_size: Any, symmetric: bool) -> Int4WeightOnly:
    if group_size not in (32, 64, 128, 256):
        why = "allowed: 32, 64, 128, 256"
        if group_size == -1:
            why = "one int4 group per row is not an fxquant layout; " + why
        raise _refuse(cls, "group_size", group_size, why)
    return Int4WeightOnly(group_size=group_size, symmetric=symmetric)


def _gptq(f: dict[str, Any]) -> tuple[QuantConfig, Any, None]:
    from fxquant.calibrate import GPTQ

    cls = "GPTQConfig"
    bits, group_size, sym = f.get("bits", 4), f.get("group_size", 128), f.get("sym", True)
    desc_act, static = bool(f.get("desc_act", False)), bool(f.get("static_groups", False))
    if bits == 4:
        if desc_act and not static:
            raise _refuse(
                cls, "desc_act", True,
                "act-order without static_groups puts each column in the group g_idx says; "
                "fxquant's int4 groups are contiguous along K (static_groups=True is honoured)",
            )  # fmt: skip
        scheme: Scheme = _int4(cls, group_size, bool(sym))
    elif bits == 8:
        if group_size != -1:
            raise _refuse(cls, "group_size", group_size, "8-bit GPTQ maps to fxquant's per-row "
                          "int8 only with group_size=-1")  # fmt: skip
        if not sym:
            raise _refuse(cls, "sym", sym, "fxquant's int8 weights are symmetric")
        scheme = Int8WeightOnly()
    else:
        raise _refuse(cls, "bits", bits, "GPTQ here produces 4-bit (Int4WeightOnly) and 8-bit "
                      "(Int8WeightOnly) weights")  # fmt: skip
    if f.get("true_sequential", True) is not True:
        raise _refuse(cls, "true_sequential", f["true_sequential"], "fxquant calibrates each "
                      "linear on the inputs of the quantized layers before it")  # fmt: skip
    if f.get("modules_in_block_to_quantize") is not None:
        raise _refuse(cls, "modules_in_block_to_quantize", f["modules_in_block_to_quantize"],
                      "not mapped; choose the layers with QuantConfig.overrides")  # fmt: skip
    skip = {"modules_to_not_convert": ()} if f.get("lm_head") else {}
    method = GPTQ(
        damp_percent=float(f.get("damp_percent", 0.1)), desc_act=desc_act,
        static_groups=static and bits == 4, act_group_aware=bool(f.get("act_group_aware", False)),
    )  # fmt: skip
    return QuantConfig(scheme=scheme, **skip), method, None


def _awq(f: dict[str, Any]) -> tuple[QuantConfig, Any, str | None]:
    from fxquant.calibrate import AWQ

    cls = "AwqConfig"
    if f.get("bits", 4) != 4:
        raise _refuse(cls, "bits", f["bits"], "AWQ is 4-bit")
    zero_point = bool(f.get("zero_point", True))
    scheme = _int4(cls, f.get("group_size", 128), not zero_point)
    approximation = None
    if zero_point:
        approximation = (
            "zero_point=True: AWQ's integer grid spans each group's [min, max]; fxquant's "
            "Int4WeightOnly grid always includes 0 (as GPTQ's), so a group whose values all "
            "have one sign gets a wider step"
        )
    return QuantConfig(scheme=scheme, **_skip(f)), AWQ(), approximation


_CALIBRATION_MAPPERS = {"gptq": _gptq, "awq": _awq}

_MAPPERS = {
    "mxfp4": _mxfp4,
    "hqq": _hqq,
    "bitnet": _bitnet,
    "nvfp4": _nvfp4,
    "fouroversix": _fouroversix,
    "eetq": _eetq,
    "fbgemm_fp8": _fbgemm,
    "fp8": _fine_grained,
    "quanto": _quanto,
    "torchao": _torchao,
    "compressed-tensors": _compressed_tensors,
    "bitsandbytes": _bitsandbytes,
}


def docs_table(field_names: Mapping[str, list[str]], transformers_version: str) -> str:
    """docs/hf_configs.md: every config and every field (``field_names``: class → fields, as
    transformers defines them), with how fxquant honours it."""
    lines = [
        "# Hugging Face quantization configs → fxquant",
        "",
        "Generated by `python -m fxquant.hf > docs/hf_configs.md` from `fxquant.hf.HF_CONFIGS`",
        f"and the config signatures of transformers {transformers_version}; a test checks it is",
        "current. `fxquant.from_hf(cfg)`",
        "takes a transformers config object or a `quantization_config` dict. A config maps only",
        "where fxquant computes the same numerics; otherwise `from_hf` raises",
        "`NotImplementedError` with the reason below. Nothing is approximated, except where a",
        "row says \"Approximated\" and how (`NVFP4Config`'s scope, `AwqConfig`'s asymmetric",
        "grid); those mappings warn with `fxquant.hf.ApproximationWarning`. `GPTQConfig` and",
        "`AwqConfig` choose weights from data: `fxquant.calibration_from_hf(cfg)` gives the",
        "config and the method for `fxquant.calibrate`.",
        "",
        "| config | field | how fxquant honours it |",
        "|---|---|---|",
    ]
    for method, entry in sorted(HF_CONFIGS.items(), key=lambda kv: kv[1]["class"]):
        cls = entry["class"]
        if entry["status"] == "refused":
            lines.append(f"| `{cls}` (`{method}`) | — | **refused**: {entry['why']} |")
        elif entry["status"] == "calibration":
            lines.append(f"| `{cls}` (`{method}`) | — | **calibration**: {entry['why']} |")
        for name in field_names.get(cls, []):
            how = entry.get("fields", {}).get(name, _NOT_YET)
            lines.append(f"| `{cls}` | `{name}` | {how} |")
    return "\n".join(lines) + "\n"


def transformers_fields() -> dict[str, list[str]]:
    """class name → the keyword fields of its ``__init__`` in the installed transformers."""
    import inspect

    import transformers.utils.quantization_config as q

    out = {}
    for entry in HF_CONFIGS.values():
        init = getattr(q, entry["class"]).__init__
        out[entry["class"]] = [
            p.name
            for p in list(inspect.signature(init).parameters.values())[1:]
            if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)
        ]
    return out

