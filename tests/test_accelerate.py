"""from_accelerate: every TERecipeKwargs / AORecipeKwargs field maps onto the config, and the
docs table says how each one is honoured."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from fxquant import Float8Recipe, from_accelerate
from fxquant.training.accelerate import AO_FIELDS, TE_FIELDS, te_module_filter

DOCS = Path(__file__).parents[1] / "docs" / "fp8_training.md"


# Stand-ins with accelerate 1.15's field names and defaults (accelerate is not a dependency,
# and its TERecipeKwargs refuses to build without Transformer Engine installed).
@dataclasses.dataclass
class TERecipeKwargs:
    use_autocast_during_eval: bool = False
    margin: int = 0
    interval: int = 1
    fp8_format: str = "HYBRID"
    amax_history_len: int = 1024
    amax_compute_algo: str = "most_recent"
    override_linear_precision: tuple = (False, False, False)
    use_mxfp8_block_scaling: bool = False


@dataclasses.dataclass
class AORecipeKwargs:
    config: object = None
    module_filter_func: object = None
    pad_inner_dim: bool | None = None
    enable_fsdp_float8_all_gather: bool | None = None


def test_stand_ins_have_exactly_the_mapped_fields():
    assert {f.name for f in dataclasses.fields(TERecipeKwargs)} == set(TE_FIELDS)
    assert {f.name for f in dataclasses.fields(AORecipeKwargs)} == set(AO_FIELDS)


def test_docs_table_covers_every_field():
    text = DOCS.read_text()
    for name in [*TE_FIELDS, *AO_FIELDS]:
        assert f"| `{name}` |" in text, name


def test_te_defaults_warn_that_accelerate_ran_max():
    with pytest.warns(UserWarning, match="ran TE's default 'max'"):
        cfg = from_accelerate(TERecipeKwargs())
    assert cfg.scheme == Float8Recipe(
        scaling="delayed", amax_compute_algo="most_recent", pad_inner_dim=False
    )
    assert cfg.module_filter is te_module_filter
    assert cfg.modules_to_not_convert == ()
    assert te_module_filter(torch.nn.Linear(16, 16), "x")
    assert not te_module_filter(torch.nn.LayerNorm(16), "x")


def test_every_te_field_reaches_the_recipe():
    kwargs = TERecipeKwargs(
        use_autocast_during_eval=True,
        margin=2,
        fp8_format="e4m3",
        amax_history_len=16,
        amax_compute_algo="MAX",
        override_linear_precision=(False, False, True),
        use_mxfp8_block_scaling=True,
    )
    r = from_accelerate(kwargs).scheme
    assert (r.use_autocast_during_eval, r.margin, r.fp8_format) == (True, 2, "E4M3")
    assert (r.amax_history_len, r.amax_compute_algo) == (16, "max")
    assert r.override_linear_precision == (False, False, True)
    assert r.scaling == "mxfp8"
    with pytest.warns(UserWarning, match="interval=3 is ignored"):
        from_accelerate({"interval": 3, "amax_compute_algo": "max"})
    with pytest.raises(ValueError, match="E5M2"):
        from_accelerate({"fp8_format": "E5M2", "amax_compute_algo": "max"})


def test_ao_default_is_tensorwise_current_scaling_with_padding():
    cfg = from_accelerate(AORecipeKwargs())
    assert cfg.scheme == Float8Recipe(scaling="current", granularity="tensor", pad_inner_dim=True)
    assert cfg.module_filter is None  # fxquant's default: skip the first and last Linear


def test_every_ao_field_reaches_the_config():
    def keep(module, fqn):
        return True

    cfg = from_accelerate(
        AORecipeKwargs(
            config="rowwise_with_gw_hp",
            module_filter_func=keep,
            pad_inner_dim=False,
            enable_fsdp_float8_all_gather=True,
        )
    )
    r = cfg.scheme
    assert (r.scaling, r.granularity, r.fp8_format) == ("current", "row", "E4M3")
    assert r.override_linear_precision == (False, False, True)
    assert r.pad_inner_dim is False
    assert cfg.module_filter is keep


def test_torchao_float8_linear_configs_map_by_their_fields():
    pytest.importorskip("torchao")
    from torchao.float8 import Float8LinearConfig

    r = from_accelerate({"config": Float8LinearConfig.from_recipe_name("tensorwise")}).scheme
    assert (r.granularity, r.fp8_format, r.override_linear_precision[2]) == (
        "tensor",
        "HYBRID",
        False,
    )
    with pytest.warns(UserWarning, match="round_scales_to_power_of_2"):
        cfg = from_accelerate({"config": Float8LinearConfig.from_recipe_name("rowwise_with_gw_hp")})
    r = cfg.scheme
    assert (r.granularity, r.fp8_format, r.override_linear_precision[2]) == ("row", "E4M3", True)


def test_bad_inputs_say_what_is_wrong():
    with pytest.raises(ValueError, match="cannot tell what"):
        from_accelerate({})
    with pytest.raises(ValueError, match=r"\['bogus'\] are not TERecipeKwargs fields"):
        from_accelerate({"margin": 1, "bogus": 2}, kind="te")
    with pytest.raises(ValueError, match="MSAMP"):
        from_accelerate({"backend": "MSAMP"}, kind="te")
    with pytest.raises(ValueError, match="recipe 'colwise' is not supported"):
        from_accelerate({"config": "colwise"})
    cfg = {"cast_config_input": {"scaling_type": "delayed"}}
    with pytest.raises(ValueError, match="scaling_type='delayed' is not supported"):
        from_accelerate({"config": cfg})
