"""from_hf: Hugging Face quantization configs → QuantConfig with the same numerics, or a
NotImplementedError that names what is missing; the docs table covers every field."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import fxquant
from fxquant import Float8Block, Float8Dynamic, Float8WeightOnly, Int8WeightOnly, from_hf
from fxquant.core.config import EXPERT_WEIGHTS
from fxquant.hf import HF_CONFIGS, docs_table, transformers_fields

DOCS = Path(__file__).parents[1] / "docs" / "hf_configs.md"

# The configs of the Transformers quantization reference (HfQuantizer is the bridge, not a config)
ISSUE_CONFIGS = [
    "QuantoConfig",
    "AqlmConfig",
    "VptqConfig",
    "AwqConfig",
    "EetqConfig",
    "GPTQConfig",
    "BitsAndBytesConfig",
    "HiggsConfig",
    "HqqConfig",
    "MetalConfig",
    "Mxfp4Config",
    "NVFP4Config",
    "FbgemmFp8Config",
    "CompressedTensorsConfig",
    "TorchAoConfig",
    "BitNetQuantConfig",
    "SpQRConfig",
    "FineGrainedFP8Config",
    "QuarkConfig",
    "FourOverSixConfig",
    "FPQuantConfig",
    "AutoRoundConfig",
    "SinqConfig",
    "GgufConfig",
]


def test_every_config_has_an_entry_and_the_docs_are_current():
    import transformers

    assert sorted(e["class"] for e in HF_CONFIGS.values()) == sorted(ISSUE_CONFIGS)
    text = DOCS.read_text()
    if f"transformers {transformers.__version__};" not in text:
        pytest.skip(
            f"docs/hf_configs.md was made for another transformers than "
            f"{transformers.__version__}: check the fields and regenerate (python -P -m fxquant.hf)"
        )
    fields = transformers_fields()
    for entry in HF_CONFIGS.values():
        if entry["status"] != "refused":  # every field of a config that maps says how
            assert set(entry["fields"]) == set(fields[entry["class"]]), entry["class"]
    assert text == docs_table(fields, transformers.__version__), "python -P -m fxquant.hf"


@pytest.mark.parametrize(
    "config, scheme",
    [
        ({"quant_method": "eetq", "weights": "int8"}, Int8WeightOnly()),
        (
            {"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0},
            Float8Dynamic(granularity="row", activation_scale_ub=1200.0),
        ),
        # DeepSeek-V3's config.json
        (
            {
                "quant_method": "fp8",
                "activation_scheme": "dynamic",
                "fmt": "e4m3",
                "weight_block_size": [128, 128],
            },
            Float8Block(block_size=128),
        ),
        ({"quant_method": "quanto", "weights": "float8"}, Float8WeightOnly()),
        ({"quant_method": "torchao", "quant_type": "float8_weight_only"}, Float8WeightOnly()),
        (
            {
                "quant_method": "torchao",
                "quant_type": {
                    "default": {
                        "_type": "Float8DynamicActivationFloat8WeightConfig",
                        "_data": {"granularity": [{"_type": "PerRow", "_data": {}}] * 2},
                    }
                },
            },
            Float8Dynamic(granularity="row"),
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "group_0": {
                        "targets": ["Linear"],
                        "weights": {
                            "num_bits": 8,
                            "type": "float",
                            "strategy": "channel",
                            "dynamic": False,
                        },
                        "input_activations": {
                            "num_bits": 8,
                            "type": "float",
                            "strategy": "token",
                            "dynamic": True,
                        },
                    }
                },
            },
            Float8Dynamic(granularity="row"),
        ),
        (
            {"quant_method": "compressed-tensors", "config_groups": {"FP8_BLOCK": ["Linear"]}},
            Float8Block(block_size=128),
        ),
    ],
)
def test_configs_that_map_get_the_scheme_with_the_same_numerics(config, scheme):
    assert from_hf(config).scheme == scheme


def test_transformers_objects_map_too():
    from transformers import FbgemmFp8Config, FineGrainedFP8Config

    cfg = from_hf(FbgemmFp8Config(activation_scale_ub=900.0, modules_to_not_convert=["lm_head"]))
    assert cfg.scheme == Float8Dynamic(granularity="row", activation_scale_ub=900.0)
    assert cfg.modules_to_not_convert == ("lm_head",)
    cfg = from_hf(FineGrainedFP8Config(weight_block_size=(64, 64), modules_to_convert=["mlp.up"]))
    assert cfg.scheme is None and dict(cfg.overrides) == {r"mlp\.up": Float8Block(block_size=64)}


def test_ignore_and_targets_become_name_rules():
    cfg = from_hf(
        {
            "quant_method": "compressed-tensors",
            "ignore": ["lm_head", "re:.*gate$"],
            "config_groups": {
                "g": {
                    "targets": ["re:.*proj$"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel"},
                }
            },
        }
    )
    assert cfg.modules_to_not_convert == ("lm_head", ".*gate$")
    # a MoE model's 3-D experts stay float first (transformers' compressed-tensors quantizes
    # Linear modules only), though ".*proj$" names them too
    want = {EXPERT_WEIGHTS: None, ".*proj$": Float8WeightOnly()}
    assert cfg.scheme is None and dict(cfg.overrides) == want
    assert list(cfg.overrides)[0] == EXPERT_WEIGHTS


@pytest.mark.parametrize(
    "config, match",
    [
        (
            {"quant_method": "gptq", "bits": 4},
            r"from_hf\(GPTQConfig\): GPTQ chooses its weights from calibration data.*"
            "calibration_from_hf",
        ),
        ({"quant_method": "gguf"}, "load_quantized"),
        ({"quant_method": "aqlm"}, "additive codebooks"),
        (
            {"quant_method": "bitsandbytes", "load_in_4bit": True, "bnb_4bit_quant_type": "int4"},
            "bnb_4bit_quant_type='int4'",
        ),
        (
            {"quant_method": "torchao", "quant_type": "int8_dynamic_activation_int8_weight"},
            r"amax / 127\.5",
        ),
        ({"quant_method": "quanto", "weights": "int2"}, "float shift"),
        ({"quant_method": "quanto", "weights": "int8", "activations": "int8"}, "calibrates"),
        ({"quant_method": "fp8", "activation_scheme": "static"}, "static activation scales"),
        ({"quant_method": "fp8", "weight_block_size": [128, 64]}, "square blocks"),
        ({"quant_method": "fp8", "scale_fmt": "ue8m0"}, "ue8m0"),
        (
            {"quant_method": "fp8", "weight_block_size": [128, 128], "bogus": 1},
            r"fields \['bogus'\] are not known",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "g": {
                        "weights": {"num_bits": 8, "type": "int", "strategy": "channel"},
                        "input_activations": {"num_bits": 8, "type": "int", "strategy": "token"},
                    }
                },
            },
            r"amax / 127\.5 grid",
        ),
        (
            {
                "quant_method": "compressed-tensors",
                "config_groups": {
                    "g": {
                        "weights": {"num_bits": 8, "type": "float", "strategy": "tensor"},
                        "input_activations": {
                            "num_bits": 8,
                            "type": "float",
                            "strategy": "tensor",
                            "dynamic": False,
                        },
                    }
                },
            },
            "static ones need calibration",
        ),
    ],
)
def test_configs_that_do_not_map_say_what_is_missing(config, match):
    with pytest.raises(NotImplementedError, match=match):
        from_hf(config)


@pytest.mark.parametrize(
    "config, scheme, method",
    [
        (
            {"quant_method": "gptq", "bits": 4, "group_size": 64, "sym": False},
            fxquant.Int4WeightOnly(group_size=64),
            fxquant.GPTQ(damp_percent=0.1),
        ),
        (
            # a GPTQ checkpoint's config.json: act-order with static groups, GAR ignored by it
            {
                "quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": True,
                "static_groups": True, "damp_percent": 0.01, "checkpoint_format": "gptq",
                "act_group_aware": True,
            },
            fxquant.Int4WeightOnly(group_size=128, symmetric=True),
            fxquant.GPTQ(damp_percent=0.01, desc_act=True, static_groups=True,
                         act_group_aware=True),
        ),
        (
            {"quant_method": "gptq", "bits": 8, "group_size": -1},
            Int8WeightOnly(),
            fxquant.GPTQ(damp_percent=0.1),
        ),
        (
            {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False,
             "version": "gemm"},
            fxquant.Int4WeightOnly(group_size=128, symmetric=True),
            fxquant.AWQ(),
        ),
    ],
)  # fmt: skip
def test_calibration_configs_give_the_scheme_and_the_method(config, scheme, method):
    cfg, got = fxquant.calibration_from_hf(config)
    assert cfg.scheme == scheme and got == method


def test_calibration_from_hf_objects_warnings_and_refusals():
    import warnings

    transformers = pytest.importorskip("transformers")
    # transformers' GPTQConfig defaults: 4 bits, g128, sym, damp 0.1, GAR on
    cfg, method = fxquant.calibration_from_hf(transformers.GPTQConfig(bits=4))
    assert cfg.scheme == fxquant.Int4WeightOnly(group_size=128, symmetric=True)
    assert method == fxquant.GPTQ(damp_percent=0.1, act_group_aware=True)
    # AWQ's asymmetric grid spans [min, max]; fxquant's includes 0: mapped, with a warning
    with pytest.warns(fxquant.hf.ApproximationWarning, match="includes 0"):
        fxquant.calibration_from_hf({"quant_method": "awq", "zero_point": True})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        fxquant.calibration_from_hf({"quant_method": "awq", "zero_point": False})
    for bad, match in [
        ({"quant_method": "gptq", "bits": 3}, r"bits=3"),
        ({"quant_method": "gptq", "bits": 4, "group_size": -1}, "one int4 group per row"),
        ({"quant_method": "gptq", "bits": 4, "desc_act": True}, "g_idx"),
        ({"quant_method": "gptq", "bits": 8, "group_size": 128}, "group_size=-1"),
        ({"quant_method": "gptq", "true_sequential": False}, "true_sequential"),
        ({"quant_method": "gptq", "bogus": 1}, r"fields \['bogus'\] are not known"),
        ({"quant_method": "awq", "bits": 8}, "AWQ is 4-bit"),
    ]:
        with pytest.raises(NotImplementedError, match=match):
            fxquant.calibration_from_hf(bad)
    with pytest.raises(ValueError, match="needs no calibration data; use fxquant.from_hf"):
        fxquant.calibration_from_hf({"quant_method": "eetq"})


def test_an_unrecognisable_config_is_a_value_error():
    with pytest.raises(ValueError, match="cannot tell which quantization config"):
        from_hf({"bits": 4})


def test_from_hf_config_quantizes_a_model(tiny_llama):
    x = torch.randint(0, 96, (1, 8))
    cfg = from_hf({"quant_method": "fbgemm_fp8", "activation_scale_ub": 1200.0})
    rows = fxquant.report(fxquant.quantize(tiny_llama, cfg, example_inputs=(x,))).rows
    quantized = [r for r in rows if r["status"] == "quantized"]
    assert len(quantized) == 14 and all(
        r["scheme"]
        == {"type": "Float8Dynamic", "granularity": "row", "activation_scale_ub": 1200.0}
        for r in quantized
    )
