"""``TorchAoConfig`` (``quant_method="torchao"``) → ``Float8WeightOnly`` / ``Float8Dynamic``:
its ``HF_CONFIGS`` entry beside its mapper; ``from_hf`` dispatches on quant_method. torchao is
not imported: its config objects are read by class name and attribute, and config.json's
``{"_type": ..., "_data": ...}`` dicts the same way."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from fxquant.core.config import (
    Float8Dynamic,
    Float8WeightOnly,
    Int4WeightOnly,
    Int8WeightOnly,
    QuantConfig,
    Scheme,
)
from fxquant.hf.base import SKIP, maps, not_converted, refuse

TORCHAO = {
    "class": "TorchAoConfig",
    "status": "mapped",
    "fields": {
        "quant_type": "'float8_weight_only' / Float8WeightOnlyConfig → Float8WeightOnly; "
        "'float8_dynamic_activation_float8_weight' / "
        "Float8DynamicActivationFloat8WeightConfig → Float8Dynamic (PerTensor → 'tensor', "
        "PerRow → 'row', activation_value_ub → activation_scale_ub); 'int8_weight_only' / "
        "Int8WeightOnlyConfig (per channel) → Int8WeightOnly(grid='torchao') and "
        "IntxWeightOnlyConfig(torch.int4, PerGroup(g), SYMMETRIC) → Int4WeightOnly(g, "
        "symmetric=True, grid='torchao'): torchao's amax / 127.5 and / 7.5 grids, bit for bit "
        "(tests/fixtures/torchao_0.18.0_grids.pt); int8-activation configs refused (their "
        "activations use the / 127.5 grid too), Int4WeightOnlyConfig refused (float "
        "zero-point domain), the rest refused",
        "modules_to_not_convert": SKIP,
        "include_input_output_embeddings": "False honoured; True refused (embeddings "
        "are not quantized)",
        "untie_embedding_weights": "accepted; no effect while embeddings stay in float",
    },
}


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
            raise refuse(
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
    raise refuse(
        "Float8DynamicActivationFloat8WeightConfig",
        "granularity",
        name,
        "allowed: PerTensor, PerRow",
    )


def _granularity_name(data: Any) -> str | None:
    g = _get(data, "granularity")
    if g is None:
        return None
    return str(_get(g, "_type", type(g).__name__))


def _value_name(v: Any, default: str) -> str:
    """An enum / dtype as torchao's objects or config.json's {"_type", "_data"} dicts write it."""
    if v is None:
        return default
    if isinstance(v, Mapping):
        return str(v.get("_data", default)).rsplit(".", 1)[-1]
    return str(getattr(v, "name", v)).rsplit(".", 1)[-1]


def _intx(cls: str, data: Any) -> Scheme:
    """IntxWeightOnlyConfig: int4, symmetric, per group → Int4WeightOnly(grid="torchao")."""
    dtype = _value_name(_get(data, "weight_dtype"), "int8")
    mapping = _value_name(_get(data, "mapping_type"), "SYMMETRIC")
    g = _get(data, "granularity")
    group = _get(g, "group_size", _get(_get(g, "_data", {}), "group_size"))
    if dtype != "int4" or mapping != "SYMMETRIC" or group not in (32, 64, 128, 256):
        raise refuse(
            cls, "quant_type", f"IntxWeightOnlyConfig({dtype}, {mapping}, group {group})",
            "maps as int4, MappingType.SYMMETRIC, PerGroup(32 / 64 / 128 / 256)",
        )  # fmt: skip
    if _get(data, "scale_dtype") is not None:
        raise refuse(cls, "quant_type.scale_dtype", _get(data, "scale_dtype"), "allowed: None")
    return Int4WeightOnly(group_size=int(group), symmetric=True, grid="torchao")


@maps("torchao", TORCHAO)
def _torchao(f: dict[str, Any]) -> QuantConfig:
    cls = "TorchAoConfig"
    if f.get("include_input_output_embeddings"):
        raise refuse(
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
            raise refuse(
                cls,
                "quant_type.activation_value_lb",
                _get(data, "activation_value_lb"),
                "fxquant bounds the activation amax from above only",
            )
        scheme = Float8Dynamic(
            granularity=_granularity(_get(data, "granularity")),
            activation_scale_ub=_get(data, "activation_value_ub"),
        )
    elif name in ("int8_weight_only", "Int8WeightOnlyConfig"):
        if _get(data, "group_size") is not None or _granularity_name(data) not in (
            "PerRow",
            "PerAxis",
            None,
        ):
            raise refuse(cls, "quant_type", name, "int8 weights map per output channel only")
        scheme = Int8WeightOnly(grid="torchao")
    elif name == "IntxWeightOnlyConfig":
        scheme = _intx(cls, data)
    elif "int8" in name.lower() or "Int8" in name:
        raise refuse(
            cls,
            "quant_type",
            name,
            "torchao's int8 activations use its amax / 127.5 grid, fxquant's amax / 127 "
            "(its int8 weight-only and IntxWeightOnlyConfig int4 weights map)",
        )
    elif "int4" in name.lower():
        raise refuse(
            cls,
            "quant_type",
            name,
            "torchao's int4 keeps zero points in the float domain; Int4WeightOnly's are integers",
        )
    else:
        raise refuse(cls, "quant_type", name, "no fxquant scheme computes it")
    return QuantConfig(scheme=scheme, **not_converted(f))
