"""compressed-tensors (llm-compressor, vLLM) ↔ fxquant: the format's schemes, and the writer.

Where it sits: the one place that knows what compressed-tensors' quantization schemes mean to
fxquant. ``scheme_from_args`` (with ``PRESETS`` and ``target_pattern``) maps a config group to the
fxquant scheme that computes the same when quantizing from float: ``fxquant.hf``'s
``CompressedTensorsConfig`` mapping (``fxquant/hf/compressed_tensors.py``) is built on it. The
writer behind ``fxquant.save_compressed_tensors`` is below; the reader behind
``fxquant.checkpoints.read_quantized`` is ``fxquant/checkpoints/compressed_tensors_read.py``.

The layouts follow the compressed-tensors library's compressors (``naive_quantized``,
``pack_quantized``): per quantized module ``<m>``

- ``naive-quantized`` / ``int-quantized`` / ``float-quantized``: ``<m>.weight`` int8 or
  float8_e4m3fn [N, K], ``<m>.weight_scale`` ([N, 1] channel, [1] tensor, [N/b, K/b] block,
  [N, K/g] group), ``<m>.input_scale`` for static activations; w = q · s.
- ``pack-quantized``: ``<m>.weight_packed`` int32 [N, ceil(K·bits/32)], consecutive K values in
  rising bit order, each stored as q + 2^(bits-1); ``<m>.weight_shape`` [N, K];
  ``<m>.weight_scale`` [N, G]; asymmetric: ``<m>.weight_zero_point`` packed the same way but
  along N ([ceil(N·bits/32), G]); w = (q - zp) · s with q, zp signed.

So symmetric int4 (q in [-8, 7], zp = 0) is ``Int4WeightOnly``'s u = q + 8, z = 8, exactly, and
an asymmetric zp is z = zp + 8. Quantizing from float on compressed-tensors' own rules
(symmetric amax / 127.5 for int8, / 7.5 for int4, its asymmetric zero point, in the weight's
dtype) is ``grid="compressed-tensors"`` of ``Int8WeightOnly`` / ``Int4WeightOnly``, which
``scheme_from_args`` gives W8A16 and W4A16 groups; a checkpoint's stored integers and scales load
as they are, whatever chose them.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch.export import ExportedProgram

from fxquant.checkpoints.base import CheckpointError
from fxquant.core import reference as ref
from fxquant.core import reference_lowbit as ref_lowbit
from fxquant.core.config import (
    MXFP4,
    NVFP4,
    Float8Block,
    Float8Dynamic,
    Float8Static,
    Float8WeightOnly,
    Int4WeightOnly,
    Int8DynamicActivation,
    Int8WeightOnly,
    IntxWeightOnly,
    Scheme,
)
from fxquant.core.row import LayerRow
from fxquant.core.scheme import layout_of

__all__ = [
    "PRESETS",
    "block_structure",
    "save_compressed_tensors",
    "scheme_from_args",
    "target_pattern",
]

# --------------------------------------------------------------------------------------------
# Schemes: a config group's arguments → the fxquant scheme with the same numerics
# --------------------------------------------------------------------------------------------


def _refuse(field: str, value: Any, why: str) -> NotImplementedError:
    # worded as fxquant.from_hf words every config field it cannot honour
    return NotImplementedError(
        f"CompressedTensorsConfig({field}={value!r}) is not supported: {why}"
    )


def block_structure(weights: Mapping) -> list[int] | None:
    """A block strategy's ``block_structure``: ``[b, b]``, or older files' ``"bxb"``."""
    bs = weights.get("block_structure")
    if isinstance(bs, str):  # older files: "128x128"
        bs = [int(v) for v in bs.lower().split("x")]
    return bs


_NV4 = {"type": "float", "num_bits": 4, "strategy": "tensor_group", "group_size": 16}
# FP4 groups of 32 with uint8 (E8M0 exponent) scales: compressed-tensors' MXFP4
_MX4 = {
    "type": "float",
    "num_bits": 4,
    "strategy": "group",
    "group_size": 32,
    "scale_dtype": "uint8",
}
# compressed-tensors' preset schemes (config_groups may name one by its key instead of spelling
# out its arguments): name → (weights, input_activations)
PRESETS = {
    "FP8_DYNAMIC": (
        {"type": "float", "num_bits": 8, "strategy": "channel"},
        {"type": "float", "num_bits": 8, "strategy": "token", "dynamic": True},
    ),
    "FP8_BLOCK": (
        {"type": "float", "num_bits": 8, "strategy": "block", "block_structure": [128, 128]},
        {"type": "float", "num_bits": 8, "strategy": "group", "group_size": 128, "dynamic": True},
    ),
    "NVFP4A16": (_NV4, None),
    "NVFP4": (_NV4, {**_NV4, "dynamic": "local"}),  # refused: calibrated tensor scale
    "MXFP4A16": (_MX4, None),
    "MXFP4": (_MX4, {**_MX4, "dynamic": True}),
}


def _fp4_scheme(name: str, w: Mapping, a: Mapping | None) -> Scheme:
    """compressed-tensors' FP4 groups: NVFP4 (tensor_group of 16, e4m3 scales) or MXFP4 (groups
    of 32, uint8 E8M0 scales)."""
    key = f"config_groups[{name!r}]"
    ws, g = w.get("strategy"), w.get("group_size")
    scale_dtype = str(w.get("scale_dtype")).removeprefix("torch.")
    if ws == "tensor_group" and g == 16:
        if a is not None:
            raise _refuse(
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
            f"{key}.input_activations",
            dict(a),
            "MXFP4 weights map alone or with dynamic MXFP4 activations (groups of 32)",
        )
    raise _refuse(
        f"{key}.weights",
        dict(w),
        "FP4 maps as NVFP4 (strategy 'tensor_group', group_size 16) or MXFP4 (strategy "
        "'group', group_size 32, scale_dtype uint8)",
    )


def scheme_from_args(name: str, w: Mapping | None, a: Mapping | None) -> Scheme:
    """The fxquant scheme that computes what config group ``name`` (its ``weights`` and
    ``input_activations`` arguments) does when quantizing from float, or ``NotImplementedError``
    saying why none does."""
    if w is None:
        raise _refuse(f"config_groups[{name!r}].weights", None, "weights must be quantized")
    if w.get("type") == "float" and w.get("num_bits") == 4:
        return _fp4_scheme(name, w, a)
    if w.get("type", "int") == "int":
        return _int_scheme(name, w, a)
    if w.get("type") != "float" or w.get("num_bits") != 8:
        raise _refuse(
            f"config_groups[{name!r}].weights",
            dict(w),
            "weights map as int8 / int4 (W8A16, W4A16), fp8 and fp4",
        )
    ws = w.get("strategy")
    if a is None:
        if ws == "channel":
            return Float8WeightOnly()
        raise _refuse(
            f"config_groups[{name!r}].weights.strategy",
            ws,
            "fp8 weight-only maps with strategy 'channel' only",
        )
    if a.get("type") != "float" or a.get("num_bits") != 8 or a.get("dynamic") is not True:
        raise _refuse(
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
        bs = block_structure(w)
        g = a.get("group_size")
        if bs and len(bs) == 2 and bs[0] == bs[1] == g and g in (32, 64, 128, 256):
            return Float8Block(block_size=int(g))
    raise _refuse(
        f"config_groups[{name!r}]",
        f"weights {ws} / activations {ast}",
        "maps: channel/token, tensor/tensor, b×b block / 1×b group (b = 32..256)",
    )


def _int_scheme(name: str, w: Mapping, a: Mapping | None) -> Scheme:
    """W8A16 / W4A16: compressed-tensors' own integer grid (``grid="compressed-tensors"``:
    amax / 127.5 and / 7.5 symmetric, its asymmetric rule, in the weight's dtype), bit for bit."""
    where = f"config_groups[{name!r}]"
    if a is not None:
        raise _refuse(
            f"{where}.input_activations",
            dict(a),
            "integer weights map weight-only (W8A16, W4A16): compressed-tensors' int8 "
            "activations use its amax / 127.5 grid, fxquant's int8 activations amax / 127",
        )
    bits, strategy, sym = w.get("num_bits"), w.get("strategy"), w.get("symmetric", True)
    grid = "compressed-tensors"
    if bits == 8 and strategy == "channel" and sym:
        return Int8WeightOnly(grid=grid)
    if bits == 4 and strategy == "group" and w.get("group_size") in (32, 64, 128, 256):
        return Int4WeightOnly(group_size=int(w["group_size"]), symmetric=bool(sym), grid=grid)
    raise _refuse(
        f"{where}.weights",
        dict(w),
        "integer weights map as int8 per channel, symmetric (W8A16) and int4 in groups of 32, "
        "64, 128 or 256, symmetric or not (W4A16)",
    )


def target_pattern(target: str) -> str | None:
    """A compressed-tensors target or ignore entry as a module-name regex (None: a class)."""
    if target.startswith("re:"):
        return target[3:]
    if target in ("Linear", "torch.nn.Linear"):
        return None
    return re.escape(target)


# --------------------------------------------------------------------------------------------
# Writing
# --------------------------------------------------------------------------------------------


def _pack_int32(u: torch.Tensor, bits: int) -> torch.Tensor:
    """[R, C] unsigned values → int32 [R, ceil(C·bits/32)], the inverse of ``unpack_int32``:
    one little-endian bit stream per row (for 2, 4 and 8 bits, whole fields per word)."""
    r, c = u.shape
    u = torch.nn.functional.pad(u.to(torch.int64), (0, -c % 32))
    stream = ((u[..., None] >> torch.arange(bits)) & 1).reshape(r, -1, 32)  # bits, lowest first
    words = (stream << torch.arange(32)).sum(-1)[:, : -(-c * bits // 32)]
    words = torch.where(words >= 2**31, words - 2**32, words)  # two's complement, as stored
    return words.to(torch.int32).contiguous()


def _weight_args(**kw) -> dict[str, Any]:
    return {"symmetric": True, "dynamic": False, **kw}


_TOKEN_INT8 = {
    "type": "int",
    "num_bits": 8,
    "strategy": "token",
    "symmetric": True,
    "dynamic": True,
}


def _layer_entry(scheme: Scheme, c: dict[str, torch.Tensor], n: int, k: int):
    """(format, weights args, activation args, tensors without the module prefix)."""
    if isinstance(scheme, (Int8WeightOnly, Int8DynamicActivation)):
        w = _weight_args(type="int", num_bits=8, strategy="channel")
        scale = c["scale"].reshape(n, 1)
        if isinstance(scheme, Int8DynamicActivation):
            return (
                "int-quantized",
                w,
                dict(_TOKEN_INT8),
                {"weight": c["qweight"], "weight_scale": scale},
            )
        # W8A16: compressed-tensors packs int8 weight-only layers (4 per int32, stored q + 128)
        u = c["qweight"].to(torch.int32) + 128
        return (
            "pack-quantized",
            w,
            None,
            {
                "weight_packed": _pack_int32(u, 8),
                "weight_shape": torch.tensor([n, k], dtype=torch.int64),
                "weight_scale": scale,
            },
        )
    if isinstance(scheme, (Int4WeightOnly, IntxWeightOnly)):
        bits = getattr(scheme, "bits", 4)
        if isinstance(scheme, IntxWeightOnly):
            if scheme.zero_point == "float":
                raise NotImplementedError(
                    "IntxWeightOnly(zero_point='float') has no compressed-tensors form (its zero "
                    "points are integers)"
                )
            u = ref_lowbit.unpack_intx(c["qweight"], bits)[:, :k]
        else:
            u = ref.unpack_int4(c["qweight"])[:, :k]
        g, z, mid = scheme.group_size, c["zero"], 1 << (bits - 1)
        symmetric = bool((z == mid).all())
        if int(z.max()) >= 2 * mid:
            raise NotImplementedError(
                f"int{bits} zero points above {2 * mid - 1} (a GPTQ v1 'zero minus one' layer) "
                f"have no compressed-tensors form (its zero points are int{bits} too)"
            )
        w = _weight_args(
            type="int", num_bits=bits, strategy="group", group_size=g, symmetric=symmetric
        )
        tensors = {
            "weight_packed": _pack_int32(u, bits),
            "weight_shape": torch.tensor([n, k], dtype=torch.int64),
            "weight_scale": c["scale"].contiguous(),
        }
        if not symmetric:
            zp = _pack_int32(z.t().contiguous(), bits).t().contiguous()
            tensors["weight_zero_point"] = zp
        return "pack-quantized", w, None, tensors
    if isinstance(scheme, Float8WeightOnly):
        w = _weight_args(type="float", num_bits=8, strategy="channel")
        return (
            "naive-quantized",
            w,
            None,
            {"weight": c["qweight"], "weight_scale": c["scale"].reshape(n, 1)},
        )
    if isinstance(scheme, Float8Dynamic):
        if scheme.activation_scale_ub is not None:
            raise NotImplementedError(
                "Float8Dynamic(activation_scale_ub=...) has no "
                "compressed-tensors form (no activation scale bound)"
            )
        if scheme.per_row:
            w = _weight_args(type="float", num_bits=8, strategy="channel")
            a = {
                "type": "float",
                "num_bits": 8,
                "strategy": "token",
                "symmetric": True,
                "dynamic": True,
            }
            scale = c["scale"].reshape(n, 1)
        else:
            w = _weight_args(type="float", num_bits=8, strategy="tensor")
            a = {
                "type": "float",
                "num_bits": 8,
                "strategy": "tensor",
                "symmetric": True,
                "dynamic": True,
            }
            scale = c["scale"].reshape(1)
        return "float-quantized", w, a, {"weight": c["qweight"], "weight_scale": scale}
    if isinstance(scheme, Float8Static):
        w = _weight_args(type="float", num_bits=8, strategy="tensor")
        a = {
            "type": "float",
            "num_bits": 8,
            "strategy": "tensor",
            "symmetric": True,
            "dynamic": False,
        }
        return (
            "float-quantized",
            w,
            a,
            {
                "weight": c["qweight"],
                "weight_scale": c["scale"],
                "input_scale": c["activation_scale"].reshape(1),
            },
        )
    if isinstance(scheme, Float8Block):
        b = scheme.block_size
        w = _weight_args(type="float", num_bits=8, strategy="block", block_structure=[b, b])
        a = {
            "type": "float",
            "num_bits": 8,
            "strategy": "group",
            "group_size": b,
            "symmetric": True,
            "dynamic": True,
        }
        return "float-quantized", w, a, {"weight": c["qweight"], "weight_scale": c["scale"]}
    raise NotImplementedError(f"{type(scheme).__name__} has no compressed-tensors writer yet")


# per-expert linears as transformers 4 checkpoints (and transformers 5's save_pretrained) name
# them: Mixtral's (and MiniMax's, which share its conversion) w1 / w3 / w2 in block_sparse_moe,
# every other MoE model's gate_proj / up_proj / down_proj in mlp
_MIXTRAL_TYPES = ("mixtral", "minimax", "minimax_m2")
_MIXTRAL_BLOCK = (".mlp.", ".block_sparse_moe.")


def _quantized_layers(ep: ExportedProgram, *, mixtral: bool = False):
    """(module name, scheme, {constant name: tensor}, N, K, constant fqns) per quantized weight;
    a mixture-of-experts weight gives one per expert's linear (``checkpoints.experts``)."""
    from fxquant.checkpoints.experts import expert_linears
    from fxquant.core.config import EXPERT_WEIGHTS, scheme_from_dict

    by_node = {
        s.arg.name: s.target for s in ep.graph_signature.input_specs if hasattr(s.arg, "name")
    }
    state = ep.state_dict
    seen: dict[str, tuple] = {}
    for node in ep.graph.nodes:
        row = LayerRow.from_node(node)
        if node.op != "call_function" or row is None or row.status != "quantized":
            continue
        scheme = scheme_from_dict(row.scheme)
        if row.experts is not None and not row.read_transposed:
            raise CheckpointError(
                f"{row.name!r}: mixture-of-experts weights stored [E, K, N] ({row.experts} "
                f"experts, quantized {scheme}: gpt-oss', Llama 4's) have no per-expert "
                "compressed-tensors layout here; quantize with the experts kept in float to "
                f"write this program: QuantConfig(..., overrides={{r'{EXPERT_WEIGHTS}': None}})"
            )
        fqns = [by_node.get(a.name) for a in node.args if isinstance(a, torch.fx.Node)]
        qfqn = next((f for f in fqns if f and f.endswith("qweight")), None)
        if qfqn is None:
            raise CheckpointError(f"layer {row.name!r}: no quantized weight constant found")
        prefix = qfqn.removesuffix("qweight")
        if prefix in seen:
            continue  # a weight shared by two layers is written once
        n, k = row.out_features, row.in_features
        names = list(layout_of(scheme, (n, k)))
        consts = {name: state[prefix + name] for name in names}
        if row.float_weight_kept:
            raise NotImplementedError(
                f"{row.weight!r} is quantized for {row.name!r} and kept in float for "
                "another use (a tied weight): a compressed-tensors module holds one form"
            )
        fqn_set = {prefix + name for name in names}
        if row.experts is None:
            module = row.weight.removesuffix(".weight")
            seen[prefix] = [(module, scheme, consts, n, k, fqn_set)]
            continue
        proj = ("w1", "w3", "w2") if mixtral else ("gate_proj", "up_proj", "down_proj")
        linears = expert_linears(row.weight, scheme, consts, n, k, names=proj)
        seen[prefix] = [(m, scheme, c, n2, k2, fqn_set) for m, c, n2, k2 in linears]
    return [layer for layers in seen.values() for layer in layers]


def save_compressed_tensors(
    ep: ExportedProgram,
    directory: str | os.PathLike,
    *,
    model_config: Mapping[str, Any] | None = None,
) -> Path:
    """Write a quantized program as a compressed-tensors checkpoint.

    ``directory/model.safetensors`` gets each quantized layer in compressed-tensors' layout
    (int8 and fp8 unpacked, int4 packed into int32 with its shape) and every other parameter and
    buffer of the program as it is; ``directory/config.json`` gets ``model_config`` (e.g.
    ``model.config.to_dict()``) plus a ``quantization_config`` with one config group per scheme,
    targeting the layers by name. The compressed-tensors library (and engines that read it, such
    as vLLM) decompress it to exactly the weights fxquant computes with.

    Mixture-of-experts weights a model stores stacked [E, N, K] (transformers 5's Qwen2/3-MoE,
    Mixtral, DeepSeek ``experts.gate_up_proj`` / ``down_proj``) are written as each expert's
    linears, as transformers 5 saves them and vLLM reads them: ``experts.<i>.gate_proj`` /
    ``up_proj`` / ``down_proj``, or, for a ``model_config`` of ``model_type`` Mixtral (MiniMax),
    ``block_sparse_moe.experts.<i>.w1`` / ``w3`` / ``w2`` with the whole block under
    ``block_sparse_moe``. ``load_quantized`` stacks them back.

    Everything is built in memory first, then each file is written to a temporary name and
    renamed, so an error leaves no partial checkpoint behind.

    Returns:
        The directory.
    """
    from fxquant.api import atomic_path

    try:
        from safetensors.torch import save_file
    except ImportError as e:  # pragma: no cover - an optional dependency
        raise ImportError("save_compressed_tensors needs `pip install safetensors`") from e
    if not isinstance(ep, ExportedProgram):
        raise ValueError(
            f"save_compressed_tensors takes an ExportedProgram, got {type(ep).__name__}"
        )
    mixtral = (model_config or {}).get("model_type") in _MIXTRAL_TYPES
    layers = _quantized_layers(ep, mixtral=mixtral)
    if not layers:
        raise ValueError("the program has no quantized layer (run fxquant.quantize first)")
    tensors: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[str, Any]] = {}
    formats, quantized_consts = set(), set()
    for module, scheme, consts, n, k, fqns in layers:
        fmt, w, a, own = _layer_entry(scheme, consts, n, k)
        formats.add(fmt)
        quantized_consts |= fqns
        key = json.dumps([fmt, w, a], sort_keys=True)
        group = groups.setdefault(
            key,
            {
                "targets": [],
                "weights": w,
                "input_activations": a,
                "output_activations": None,
                "format": fmt,
            },
        )
        group["targets"].append(module)
        for name, t in own.items():
            tensors[f"{module}.{name}"] = t.detach().contiguous()
    seen_ids = set()
    graph_inputs = [s.target for s in ep.graph_signature.input_specs if s.target in ep.state_dict]
    for name in [*graph_inputs, *ep.state_dict]:  # a tied tensor under the name the graph uses
        t = ep.state_dict[name]
        if name in quantized_consts or id(t) in seen_ids or name in tensors:
            continue
        seen_ids.add(id(t))
        tensors[name] = t.detach().contiguous()
    if mixtral:  # the MoE block under its checkpoint name, as transformers 5 saves Mixtral
        tensors = {n.replace(*_MIXTRAL_BLOCK): t for n, t in tensors.items()}
        for group in groups.values():
            group["targets"] = [m.replace(*_MIXTRAL_BLOCK) for m in group["targets"]]
    qcfg = {
        "quant_method": "compressed-tensors",
        "format": formats.pop() if len(formats) == 1 else "mixed-precision",
        "quantization_status": "compressed",
        "config_groups": {f"group_{i}": g for i, g in enumerate(groups.values())},
        "ignore": [],
        "kv_cache_scheme": None,
    }
    config = {**dict(model_config or {}), "quantization_config": qcfg}
    text = json.dumps(config, indent=2, sort_keys=True, default=str)
    directory = Path(directory)
    with atomic_path(directory / "model.safetensors") as tmp:
        save_file(tensors, str(tmp), metadata={"format": "pt"})
    with atomic_path(directory / "config.json") as tmp:
        tmp.write_text(text)
    return directory
