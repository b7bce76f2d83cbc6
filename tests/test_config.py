"""Configs are data: validated, hashable, JSON round-trippable; names match as documented."""

from __future__ import annotations

import json

import pytest

import fxquant
from fxquant.core.config import QuantConfig, name_matches, scheme_from_dict


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda: fxquant.Int4WeightOnly(group_size=100), r"Int4WeightOnly\.group_size=100.*32, 64"),
        (lambda: fxquant.Float8Dynamic(granularity="col"), r"granularity='col'.*'row', 'tensor'"),
        (lambda: fxquant.Float8Dynamic(activation_scale_ub=-1.0), r"activation_scale_ub=-1\.0"),
        (lambda: fxquant.Float8Dynamic(activation_scale_ub=True), r"activation_scale_ub=True"),
        (lambda: fxquant.Float8Block(block_size=100), r"block_size=100.*128"),
        (lambda: QuantConfig(scheme="int8wo"), r"QuantConfig\.scheme='int8wo'"),
        (lambda: QuantConfig(overrides={"(": None}), r"overrides pattern '\(' is not a regex"),
        (lambda: QuantConfig(overrides={"fc": "int8"}), r"overrides\['fc'\]='int8'"),
        (lambda: QuantConfig(modules_to_not_convert="lm_head"), r"is a string"),
        (lambda: QuantConfig(fuse_norms="yes"), r"QuantConfig\.fuse_norms='yes'.*True or False"),
        (lambda: QuantConfig.from_dict({"fuse": True}), r"unknown keys \['fuse'\].*fuse_norms"),
        (lambda: fxquant.from_recipe_name("int3"), r"unknown recipe 'int3'.*int8wo"),
        (lambda: QuantConfig.coerce(3), r"config=3 is not supported"),
    ],
)
def test_bad_values_name_field_value_and_allowed(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_schemes_are_frozen_and_keyword_only():
    s = fxquant.Int4WeightOnly(group_size=64)
    with pytest.raises(AttributeError):
        s.group_size = 32
    with pytest.raises(TypeError):
        fxquant.Int4WeightOnly(64)


def test_recipes_cover_the_issue_names():
    for name in ("int8wo", "int4wo-32", "int4wo-64", "int4wo-128", "w8a8", "fp8wo"):
        assert name in fxquant.RECIPES
    assert fxquant.from_recipe_name("fp8-row") == fxquant.Float8Dynamic(granularity="row")
    assert fxquant.from_recipe_name("fp8-tensor") == fxquant.Float8Dynamic(granularity="tensor")
    assert fxquant.from_recipe_name("fp8-block") == fxquant.Float8Block(block_size=128)


def test_config_round_trips_through_json_and_is_hashable():
    cfg = QuantConfig(
        scheme=fxquant.Int8WeightOnly(),
        overrides={
            r"layers\.0\.mlp\..*": fxquant.Float8Dynamic(
                granularity="row", activation_scale_ub=1200
            ),
            r".*\.o_proj": None,
        },
        modules_to_not_convert=["lm_head"],
    )
    again = QuantConfig.from_json(json.dumps(json.loads(cfg.to_json())))
    assert again == cfg
    assert hash(again) == hash(cfg)
    assert list(again.overrides) == list(cfg.overrides)  # order is part of the meaning
    for scheme in fxquant.RECIPES.values():
        assert scheme_from_dict(scheme.to_dict()) == scheme


def test_name_matching_rules():
    assert name_matches("lm_head", "lm_head")
    assert name_matches("lm_head", "model.lm_head")
    assert not name_matches("lm_head", "lm_head_2")
    assert name_matches(r"layers\.0\.mlp\..*", "model.layers.0.mlp.up_proj")
    assert not name_matches(r"layers\.0\.mlp\..*", "model.layers.10.mlp.up_proj")
    assert name_matches("model.layers.0", "model.layers.0.self_attn.q_proj")
    assert name_matches(r".*\.o_proj", "model.layers.3.self_attn.o_proj")


def test_precedence_not_convert_then_overrides_in_order_then_default():
    cfg = QuantConfig(
        scheme=fxquant.Int8WeightOnly(),
        overrides={"q_proj": None, r".*_proj": fxquant.Float8WeightOnly()},
        modules_to_not_convert=("lm_head", "layers.1"),
    )
    assert cfg.scheme_for("lm_head") == (None, "modules_to_not_convert 'lm_head'")
    assert cfg.scheme_for("layers.1.k_proj")[0] is None
    assert cfg.scheme_for("layers.0.q_proj") == (None, "override 'q_proj'")
    assert cfg.scheme_for("layers.0.k_proj")[0] == fxquant.Float8WeightOnly()
    assert cfg.scheme_for("layers.0.fc")[0] == fxquant.Int8WeightOnly()


def test_fuse_norms_round_trips_and_defaults_to_true_for_older_dicts():
    cfg = QuantConfig(scheme=fxquant.Int8DynamicActivation(), fuse_norms=False)
    assert QuantConfig.from_json(cfg.to_json()) == cfg
    assert QuantConfig.from_dict(cfg.to_dict()).fuse_norms is False
    older = {k: v for k, v in cfg.to_dict().items() if k != "fuse_norms"}  # a .pt2 from before
    assert QuantConfig.from_dict(older).fuse_norms is True
    assert QuantConfig().fuse_norms is True
    with pytest.raises(TypeError):
        QuantConfig(None, {}, ("lm_head",), False)  # keyword-only
