"""What every checkpoint reader shares: the error type, lazy tensor access, the result type and
the conversions into fxquant's storage layouts.

Where it sits: the bottom of ``fxquant.checkpoints``; each reader (``gguf``,
``compressed_tensors_read``, ``fp8``, ``gptq``, ``mxfp4``) imports from here and nothing above
it, and ``read`` dispatches to the readers.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from fxquant.core import reference as ref
from fxquant.core.config import Int4WeightOnly, QuantConfig, Scheme
from fxquant.core.scheme import QuantizedWeight, check_layout


class CheckpointError(ValueError):
    """A checkpoint file or tensor is corrupt, truncated, missing or not what its format says."""


# --------------------------------------------------------------------------------------------
# Reading tensors: one lazy name → tensor view over a state dict, safetensors files (sharded or
# not) or a GGUF file's plain tensors, so a reader pulls only the tensors it converts.
# --------------------------------------------------------------------------------------------


class TensorSource(Mapping):
    """Read-only ``{name: tensor}`` over a state dict or safetensors files, loaded on access."""

    def __init__(self, tensors: Mapping[str, torch.Tensor] | None = None, *, files=()) -> None:
        self._dict = dict(tensors or {})
        self._where: dict[str, Any] = {}
        self._handles = []
        for path in files:
            handle = _open_safetensors(Path(path))
            self._handles.append(handle)
            for name in handle.keys():  # noqa: SIM118 (safe_open is not a Mapping)
                if name in self._where or name in self._dict:
                    raise CheckpointError(f"tensor {name!r} appears twice (again in {path})")
                self._where[name] = (handle, Path(path))

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self._dict:
            return self._dict[name]
        handle, path = self._where[name]
        try:
            return handle.get_tensor(name)
        except Exception as e:  # safetensors raises its own error types
            raise CheckpointError(f"tensor {name!r} in {path} cannot be read: {e}") from e

    def __iter__(self) -> Iterator[str]:
        yield from self._dict
        yield from self._where

    def __len__(self) -> int:
        return len(self._dict) + len(self._where)


def modules_with(source: Mapping[str, Any], suffix: str) -> list[str]:
    """The modules that hold a ``<module>.<suffix>`` tensor in ``source``, sorted."""
    return sorted(n.removesuffix(f".{suffix}") for n in source if n.endswith(f".{suffix}"))


def quantized_modules(source: Mapping[str, Any], suffix: str, fmt: str) -> list[str]:
    """:func:`modules_with`, or a CheckpointError naming the ``fmt`` checkpoint and the tensor
    every quantized layer of it has, when no module holds one."""
    modules = modules_with(source, suffix)
    if not modules:
        raise CheckpointError(f"{fmt} checkpoint has no '*.{suffix}' tensor (no quantized layer)")
    return modules


def _open_safetensors(path: Path):
    try:
        from safetensors import safe_open
    except ImportError as e:  # pragma: no cover - an optional dependency
        raise ImportError(
            "reading a .safetensors checkpoint needs `pip install safetensors`"
        ) from e
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} does not exist")
    try:
        return safe_open(str(path), framework="pt")
    except Exception as e:
        raise CheckpointError(
            f"{path} is not a readable safetensors file (corrupt or truncated?): {e}"
        ) from e


def _safetensors_files(directory: Path) -> list[Path]:
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (ValueError, KeyError) as e:
            raise CheckpointError(f"{index} has no readable 'weight_map': {e}") from e
        return [directory / f for f in dict.fromkeys(weight_map.values())]
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{directory} holds no .safetensors file")
    return files


def read_config_json(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as e:
        raise CheckpointError(f"{path} is not valid JSON: {e}") from e


# --------------------------------------------------------------------------------------------
# What every reader returns
# --------------------------------------------------------------------------------------------


@dataclass
class LoadedCheckpoint:
    """A checkpoint converted to fxquant's storage, not yet attached to a model.

    Attributes:
        format: the checkpoint format, e.g. ``"compressed-tensors/pack-quantized"``.
        schemes: module name → the fxquant scheme its constants are stored for.
        weights: weight name (``<module>.weight``) → its constants, in that scheme's layout.
        shapes: weight name → the float weight's [N, K] (what the model's linear must have;
            experts: the [E, K, N] the model stores).
        tensors: every other tensor (embeddings, norms, biases, unquantized linears), as stored.
    """

    format: str
    schemes: dict[str, Scheme] = field(default_factory=dict)
    weights: dict[str, QuantizedWeight] = field(default_factory=dict)
    shapes: dict[str, tuple[int, ...]] = field(default_factory=dict)
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)

    def add(self, module: str, scheme: Scheme, weight: QuantizedWeight, shape) -> None:
        name = f"{module}.weight"
        shape = (int(shape[0]), int(shape[1]))
        check_layout(scheme, name, shape, weight)  # a reader bug must not reach a graph
        self.schemes[module] = scheme
        self.weights[name] = weight
        self.shapes[name] = shape

    def add_experts(
        self, name: str, scheme: Scheme, weight: QuantizedWeight, shape, *, stored_nk: bool = False
    ) -> None:
        """A mixture-of-experts weight: ``name`` is the 3-D parameter itself
        (``<block>.mlp.experts.gate_up_proj``, no ``.weight``), which the model stores as
        [E, K, N] (gpt-oss') or, ``stored_nk``, as [E, N, K] (Qwen2/3-MoE's, DeepSeek's);
        ``shape`` is its [E, N, K], the layout the constants are in."""
        e, n, k = (int(d) for d in shape)
        check_layout(scheme, name, (e, n, k), weight)
        self.schemes[name] = scheme  # a grouped site's module name is its parameter's
        self.weights[name] = weight
        self.shapes[name] = (e, n, k) if stored_nk else (e, k, n)

    def with_prefix(self, prefix: str) -> LoadedCheckpoint:
        """The same checkpoint under ``prefix + name``: for a model wrapped in another module
        (e.g. ``CausalLMWrapper(model)``, whose parameters read ``model.<name>``)."""
        return LoadedCheckpoint(
            format=self.format,
            schemes={prefix + m: s for m, s in self.schemes.items()},
            weights={prefix + n: w for n, w in self.weights.items()},
            shapes={prefix + n: v for n, v in self.shapes.items()},
            tensors={prefix + n: t for n, t in self.tensors.items()},
        )

    @property
    def config(self) -> QuantConfig:
        """One override per quantized module (its exact name); every other linear stays float."""
        overrides = {re.escape(m): s for m, s in self.schemes.items()}
        return QuantConfig(scheme=None, overrides=overrides, modules_to_not_convert=())


# --------------------------------------------------------------------------------------------
# Shared conversions: readers build their constants through these, so the layout rules
# (int4 padding, group splitting, scale dtypes) live in one place.
# --------------------------------------------------------------------------------------------


def e4m3_beside(source: Mapping[str, torch.Tensor], wname: str, sname: str, layout: str):
    """The float8_e4m3fn tensor ``wname`` that the scale ``sname`` scales, of the dimensions
    ``layout`` names (``"[N, K]"``, ``"[E, K, N] ..."``): ``CheckpointError`` naming it if it is
    missing, of another dtype, or of another rank."""
    if wname not in source:
        raise CheckpointError(f"tensor {wname!r} is missing (its scale {sname!r} exists)")
    w = expect(wname, source[wname], dtype=torch.float8_e4m3fn)
    if w.dim() != layout.split("]")[0].count(",") + 1:
        raise CheckpointError(f"tensor {wname!r} has shape {list(w.shape)}, expected {layout}")
    return w


def expect(name: str, t: torch.Tensor, *, shape=None, dtype=None) -> torch.Tensor:
    """Raise ``CheckpointError`` naming ``name`` unless ``t`` has this shape / dtype."""
    if dtype is not None:
        dtypes = dtype if isinstance(dtype, tuple) else (dtype,)
        if t.dtype not in dtypes:
            want = " or ".join(str(d).removeprefix("torch.") for d in dtypes)
            raise CheckpointError(
                f"tensor {name!r} has dtype {str(t.dtype).removeprefix('torch.')}, expected {want}"
            )
    if shape is not None and tuple(t.shape) != tuple(shape):
        raise CheckpointError(f"tensor {name!r} has shape {list(t.shape)}, expected {list(shape)}")
    return t


def need(source: Mapping[str, torch.Tensor], name: str, why: str) -> torch.Tensor:
    if name not in source:
        raise CheckpointError(f"tensor {name!r} is missing ({why})")
    return source[name]


SCALE_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def int_weight(
    name: str,
    u: torch.Tensor,
    scale: torch.Tensor,
    zero: torch.Tensor,
    group_size: int | None,
    *,
    bits: int = 4,
) -> tuple[Scheme, QuantizedWeight]:
    """Grouped integer codes and their grid → fxquant constants, exactly: w = (u - z) · s.

    Args:
        u: [N, K] codes in [0, 2^bits) (the unsigned values).
        scale: [N, G] float; ``zero``: [N, G] integers, or floats (a float zero point, e.g.
            GGUF's w = d·q + m written as (q - (-m/d))·d). G groups of ``group_size`` along K
            (the last may be short); ``group_size=None``: one group per row.
        bits: 4 → ``Int4WeightOnly`` (integer zeros) or ``IntxWeightOnly(bits=4,
            zero_point="float")``; 2, 3 or 6 → ``IntxWeightOnly(bits)``.

    fxquant's groups are 32, 64, 128 or 256 wide (6-bit codes: also 16). A checkpoint group that
    is a multiple of one of these is split into groups of it, each repeating its scale and zero;
    columns beyond K are padded with u = z (integer zeros), which dequantize to exactly zero.
    """
    n, k = u.shape
    float_zero = zero.is_floating_point()
    g_ckpt = k if group_size is None else group_size
    widths = (256, 128, 64, 32, 16) if bits == 6 else (256, 128, 64, 32)
    choices = [g for g in widths if g_ckpt % g == 0]
    if group_size is None and not choices and not float_zero:
        choices = [32]  # one group per row: any split works, K is padded to the split
    if not choices:
        raise NotImplementedError(
            f"{name}: int{bits} groups of {g_ckpt} have no exact fxquant form (groups are "
            f"{', '.join(map(str, widths[::-1]))} wide, so the checkpoint's group must be a "
            f"multiple of {widths[-1]})"
        )
    g = choices[0]
    groups = -(-k // g_ckpt)
    expect(f"{name} scale", scale, shape=(n, groups))
    expect(f"{name} zero point", zero, shape=(n, groups))
    if u.numel() and (int(u.min()) < 0 or int(u.max()) >= 1 << bits):
        raise CheckpointError(f"{name}: int{bits} values outside [0, {(1 << bits) - 1}]")
    if not float_zero and zero.numel() and (int(zero.min()) < 0 or int(zero.max()) > 255):
        raise CheckpointError(f"{name}: int{bits} zero points outside [0, 255]")
    if float_zero and k % g:
        raise NotImplementedError(
            f"{name}: K={k} is not a multiple of the group {g}; a float zero point cannot pad "
            "K with columns that dequantize to zero"
        )
    kp = -(-k // g) * g
    # fxquant group j covers columns [j·g, (j+1)·g), all inside checkpoint group j·g // g_ckpt
    which = torch.arange(kp // g) * g // g_ckpt
    s = scale.float()[:, which].contiguous()
    if float_zero:
        z = zero.float()[:, which].contiguous()
    else:
        z = zero.to(torch.int32)[:, which].to(torch.uint8).contiguous()
    pad = z[:, -1:].expand(n, kp - k) if kp > k else u[:, :0]
    full = torch.cat([u.to(torch.uint8), pad.to(torch.uint8)], dim=1)
    symmetric = not float_zero and bool((z == 1 << (bits - 1)).all())
    if bits == 4 and not float_zero:
        packed = ref.pack_int4(full).contiguous()
        scheme: Scheme = Int4WeightOnly(group_size=g, symmetric=symmetric)
    else:
        from fxquant.core import reference_lowbit
        from fxquant.core.config import IntxWeightOnly

        packed = reference_lowbit.pack_intx(full, bits).contiguous()
        scheme = IntxWeightOnly(
            bits=bits,
            group_size=g,
            symmetric=symmetric,
            zero_point="float" if float_zero else "int",
        )
    return scheme, QuantizedWeight({"qweight": packed, "scale": s, "zero": z}, None)


def int4_weight(name, u, scale, zero, group_size):
    """``int_weight`` for 4-bit codes (kept for the readers' readability)."""
    return int_weight(name, u, scale, zero, group_size, bits=4)


def unpack_int32(packed: torch.Tensor, bits: int = 4, order: tuple[int, ...] | None = None):
    """int32 words → their ``32 // bits`` fields along a new last dim, lowest bits first
    (``order[i]`` = the output position of field i, AWQ's interleave), as int32 in [0, 2^bits)."""
    if 32 % bits:  # 3 bits: a dense little-endian bit stream, 32 values in `bits` words
        words = packed.to(torch.int64) & 0xFFFFFFFF
        stream = (words[..., None] >> torch.arange(32)) & 1  # [..., W, 32] bits, lowest first
        stream = stream.reshape(*packed.shape[:-1], -1, bits)
        return (stream << torch.arange(bits)).sum(-1).to(torch.int32)
    per = 32 // bits
    shifts = torch.arange(0, 32, bits, dtype=torch.int32)
    fields = (packed.to(torch.int32)[..., None] >> shifts) & ((1 << bits) - 1)
    if order is not None:
        out = torch.empty_like(fields)
        out[..., list(order)] = fields
        fields = out
    return fields.reshape(*packed.shape[:-1], packed.shape[-1] * per)
