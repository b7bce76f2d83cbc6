"""What a scheme is, and the registry that derives everything else from one declaration.

Part of the core vocabulary (``docs/architecture.md``). A scheme is declared once, in its
family's module under ``fxquant/core/schemes/``: a frozen, keyword-only dataclass (its config,
validated in ``__post_init__``) that also says

- ``quantize(w)``: its weight quantization (reference math, ``fxquant.core.reference*``),
  returning the stored constants by name;
- ``constants`` / ``optional_constants``: the names of those constants, in the op's order
  (the first, ``qweight``, is the op's ``weight`` argument);
- ``reference``: its op's eager kernel, the reference linear (``x, *constants, bias,
  **op params``); ``op_params``: the scheme fields the op takes after ``bias``, with their
  schema types;
- where its activation is quantized per token or per group, how (``activation_quant``) and
  which ``*_scaled_linear`` op reads an activation a fused norm already quantized
  (``scaled_linear``): what ``fxquant.passes.fuse`` needs.

``@register_scheme`` then derives what used to be written by hand in five places: the
``fxquant::<name>_linear`` op (schema and fake kernel; ``op_schema`` reproduces the schemas
earlier releases inferred, so saved ``.pt2`` files keep loading), the rewrite's op arguments
(``op_args``, by name), the class registry that configs round-trip through (``SCHEMES``,
``scheme_from_dict``) and the storage-layout probe (``layout_of``). ``recipe()`` adds a short
name to ``RECIPES``. Lowerings are registered by op name next to their kernels
(``fxquant.core.registry``).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any, ClassVar

import torch
from torch import Tensor

__all__ = [
    "OPS",
    "RECIPES",
    "SCHEMES",
    "ActivationQuant",
    "QuantizedWeight",
    "Scheme",
    "check_choice",
    "check_int",
    "check_number",
    "check_layout",
    "from_recipe_name",
    "layout_of",
    "named_args",
    "op_schema",
    "recipe",
    "register_scheme",
    "scheme_from_dict",
]

SCHEMES: dict[str, type[Scheme]] = {}  # class name → class (what a config's JSON names)
OPS: dict[str, type[Scheme]] = {}  # op name (fxquant::<op>) → the scheme declaring it
# Named recipes, the short names users type (CLI --recipe, quantize(model, "int8wo")).
RECIPES: dict[str, Scheme] = {}


def check_choice(cls_name: str, field_name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(
            f"{cls_name}.{field_name}={value!r} is not supported; allowed: "
            + ", ".join(repr(a) for a in allowed)
        )


def check_number(
    cls_name: str, field_name: str, value: Any, *, ok: Callable[[float], bool], allowed: str
) -> float:
    """``value`` as a float if it is a number (not a bool) that ``ok`` accepts; else a
    ``ValueError`` naming the field, the value and what is ``allowed``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
        raise ValueError(f"{cls_name}.{field_name}={value!r} is not supported; allowed: {allowed}")
    return float(value)


def check_int(cls_name: str, field_name: str, value: Any, *, minimum: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(
            f"{cls_name}.{field_name}={value!r} is not supported; allowed: an int >= {minimum}"
        )


@dataclass
class QuantizedWeight:
    """A weight in a scheme's storage form: the constants its op takes, by name, in order."""

    tensors: dict[str, Tensor]
    # fp32 [N, K], for the report's SQNR against the graph's float weight; None when that
    # weight is not the one these constants came from (a checkpoint loaded into a skeleton)
    dequantized: Tensor | None

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


@dataclass(frozen=True)
class ActivationQuant:
    """How a linear quantizes its activation, as ``norm_quant``'s arguments say it."""

    quant_dtype: torch.dtype
    group_size: int  # -1: per token; > 0: 1×group_size groups along K
    scale_ub: float | None

    def __str__(self) -> str:
        name = "int8" if self.quant_dtype == torch.int8 else "fp8 e4m3"
        layout = "per token" if self.group_size == -1 else f"in 1×{self.group_size} groups"
        bound = "" if self.scale_ub is None else f", amax ≤ {self.scale_ub:g}"
        return f"{name} {layout}{bound}"


class Scheme:
    """Base of all schemes. ``name`` is the one name a scheme has in all three layers: the op
    ``fxquant::<name>_linear``, its CPU lowering in ``fxquant.passes`` and (for CUDA) the Triton
    kernel file ``kernels/<name>.py`` (installed as ``fxquant.kernels.<name>``)."""

    name: ClassVar[str]
    # True when the activation is quantized too (so the GEMM itself runs in low precision).
    quantizes_activation: ClassVar[bool] = False

    # ---- the declaration (see the module docstring) ----
    constants: ClassVar[tuple[str, ...]] = ()
    optional_constants: ClassVar[tuple[str, ...]] = ()  # ``Tensor?``: None where not stored
    op_params: ClassVar[tuple[tuple[str, str], ...]] = ()  # (scheme attribute, schema type)
    # the op's eager kernel: reference(x, *constants, bias, **op params); None: no op
    reference: ClassVar[Callable[..., Tensor] | None] = None

    @classmethod
    def op_name(cls) -> str | None:
        """``<name>_linear``, the ``fxquant::`` op this scheme rewrites a linear to (None for a
        scheme without an inference op, such as FP8 training)."""
        return None if cls.reference is None else f"{cls.name}_linear"

    @classmethod
    def out_features(cls, weight: Tensor) -> int:
        """N, from the stored ``qweight`` (rows of W unless the format packs along N)."""
        return weight.shape[0]

    @classmethod
    def out_features_of(cls, weight: Tensor, *rest: Any) -> int:
        """N from the op's arguments (``weight``, then the other constants, bias and params):
        ``out_features(weight)`` unless a format needs another constant to say it."""
        return cls.out_features(weight)

    def quantize(self, w: Tensor) -> QuantizedWeight:
        """The stored constants of the fp32 weight ``w`` [N, K] (reference math)."""
        raise NotImplementedError(f"{type(self).__name__} has no weight quantization")

    def op_args(self, x, constants: Mapping[str, Any], bias) -> tuple:
        """(op overload, args) replacing ``x @ W.T + bias``, with the constants by name."""
        op = self.op_name()
        if op is None:
            raise NotImplementedError(f"{type(self).__name__} has no inference op")
        names = (*self.constants, *self.optional_constants)
        params = [getattr(self, p) for p, _ in self.op_params]
        return getattr(torch.ops.fxquant, op).default, (
            x,
            *[constants.get(n) for n in names],
            bias,
            *params,
        )

    @property
    def takes_experts(self) -> bool:
        """Whether ``grouped_op_args`` serves: the scheme has a mixture-of-experts op."""
        return False

    def grouped_op_args(self, x, constants: Mapping[str, Any], offs) -> tuple:
        """(op overload, args) replacing a mixture-of-experts ``grouped_mm`` site."""
        raise NotImplementedError(f"no grouped (experts) op for {self.to_dict()}")

    # ---- activation fusion (fxquant.passes.fuse): ops that quantize x per token / group ----
    @classmethod
    def activation_quant(cls, args: Mapping[str, Any]) -> ActivationQuant | str | None:
        """How the op with these arguments (by name) quantizes x, a reason it cannot be fused,
        or None: its activation is not quantized by a norm_quant-compatible quantizer."""
        return None

    @classmethod
    def scaled_linear(cls, q, s, args: Mapping[str, Any], out_dtype: torch.dtype) -> tuple:
        """(op overload, args) reading the activation ``(q, s)`` a fused norm quantized."""
        raise NotImplementedError(f"{cls.__name__} has no scaled linear")

    # ---- planning ----
    def unsupported_reason(self, *, out_features: int, in_features: int) -> str | None:
        """Why a weight of shape [out_features, in_features] cannot take this scheme, or None."""
        return None

    def layout(self, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], Any]]:
        """``{constant: (shape, dtype)}`` stored for a weight of ``shape``: by default found by
        quantizing zeros (exact about layout; the all-zero path never NaNs). A scheme that
        cannot quantize (its constants come from checkpoints only) says it directly."""
        stored = self.quantize(torch.zeros(shape)).tensors
        return {k: (tuple(t.shape), t.dtype) for k, t in stored.items()}

    def padded_in_features(self, in_features: int) -> int:
        """K after the padding this scheme applies to the weight (zeros, which change nothing)."""
        return in_features

    def _shown(self) -> list[tuple[str, Any]]:
        """(field, value) pairs a config prints and stores: a field added to a released scheme
        (metadata ``omit_default``) appears only when set, so that configs, reports and saved
        programs from before it read and print as they did."""
        return [
            (f.name, getattr(self, f.name))
            for f in dataclasses.fields(self)
            if not (f.metadata.get("omit_default") and getattr(self, f.name) == f.default)
        ]

    def to_dict(self) -> dict[str, Any]:
        return {"type": type(self).__name__, **dict(self._shown())}

    def __str__(self) -> str:
        args = ", ".join(f"{name}={value!r}" for name, value in self._shown())
        return f"{type(self).__name__}({args})"


# --------------------------------------------------------------------------------------------
# Registration: the op, the class registry and the recipes, from the declaration
# --------------------------------------------------------------------------------------------


def op_schema(cls: type[Scheme]) -> str:
    """The op's schema, ``(Tensor x, Tensor weight, <constants>, Tensor? bias, <params>) ->
    Tensor``: the first constant is named ``weight`` in the op, as it always was."""
    tensors = ["Tensor x"]
    for i, name in enumerate(cls.constants):
        tensors.append(f"Tensor {'weight' if i == 0 else name}")
    tensors += [f"Tensor? {n}" for n in cls.optional_constants]
    tensors.append("Tensor? bias")
    params = [f"{kind} {name}" for name, kind in cls.op_params]
    return f"({', '.join(tensors + params)}) -> Tensor"


def _define_op(cls: type[Scheme]) -> None:
    name = cls.op_name()
    n_tensors = len(cls.constants) + len(cls.optional_constants)
    param_names = [p for p, _ in cls.op_params]
    reference = cls.reference

    def kernel(x, *rest):
        constants, bias, params = rest[:n_tensors], rest[n_tensors], rest[n_tensors + 1 :]
        return reference(x, *constants, bias, **dict(zip(param_names, params, strict=True)))

    kernel.__name__ = name
    kernel.__doc__ = cls.__doc__
    op = torch.library.custom_op(f"fxquant::{name}", kernel, mutates_args=(), schema=op_schema(cls))

    @op.register_fake
    def _(x, weight, *rest):
        return x.new_empty((*x.shape[:-1], cls.out_features_of(weight, *rest)))


def register_scheme(cls: type[Scheme]) -> type[Scheme]:
    """Class decorator: record the scheme by class name and define its ``fxquant::`` op."""
    if cls.__name__ in SCHEMES:
        raise RuntimeError(f"scheme {cls.__name__} is declared twice")
    SCHEMES[cls.__name__] = cls
    op = cls.op_name()
    if op is not None:
        OPS[op] = cls
        _define_op(cls)
    return cls


def recipe(name: str, scheme: Scheme) -> None:
    """Add a recipe name (``quantize(model, name)``, ``--recipe name``) for ``scheme``."""
    if name in RECIPES:
        raise RuntimeError(f"recipe {name!r} is declared twice")
    RECIPES[name] = scheme


def from_recipe_name(name: str) -> Scheme:
    """The scheme behind a recipe name such as ``"int8wo"`` or ``"fp8-row"``."""
    try:
        return RECIPES[name]
    except KeyError:
        raise ValueError(f"unknown recipe {name!r}; known recipes: {', '.join(RECIPES)}") from None


def scheme_from_dict(d: Mapping[str, Any] | None) -> Scheme | None:
    """Inverse of ``Scheme.to_dict`` (``None`` stays ``None``: keep the layer in float)."""
    if d is None:
        return None
    if not isinstance(d, Mapping):
        hint = (
            " (a recipe name: use --recipe / QuantConfig.from_recipe)"
            if isinstance(d, str) and d in RECIPES
            else ""
        )
        raise ValueError(
            f'a scheme is a dict such as {{"type": "Int8WeightOnly"}} or null, not '
            f"{type(d).__name__} {d!r}{hint}"
        )
    d = dict(d)
    type_name = d.pop("type", None)
    if type_name not in SCHEMES:
        raise ValueError(
            f"scheme type {type_name!r} is not known; allowed: {', '.join(sorted(SCHEMES))}"
        )
    cls = SCHEMES[type_name]
    fields = [f.name for f in dataclasses.fields(cls) if f.init]
    unknown = sorted(set(d) - set(fields))
    if unknown:
        raise ValueError(
            f"{type_name} has no field {', '.join(map(repr, unknown))}; its fields: "
            + (", ".join(fields) or "none")
        )
    return cls(**d)


# --------------------------------------------------------------------------------------------
# Layouts and named arguments
# --------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=512)
def layout_of(scheme: Scheme, shape: tuple[int, ...]) -> dict[str, tuple[tuple[int, ...], Any]]:
    """``{constant: (shape, dtype)}`` that ``scheme`` stores for a weight of ``shape``.

    Found by quantizing zeros (cheap, exact about layout, and the all-zero path never NaNs),
    here and nowhere else; cached per (scheme, shape).
    """
    return scheme.layout(shape)


def check_layout(scheme: Scheme, weight_name: str, shape: tuple, given: QuantizedWeight) -> None:
    """Raise unless ``given`` has the constants (names, shapes, dtypes) the scheme's op takes for
    a weight of ``shape``: a precomputed weight (calibration, a loaded checkpoint) must be exactly
    what the rewrite would have stored, or the op would read it wrong."""
    want = layout_of(scheme, tuple(shape))
    got = {k: (tuple(t.shape), t.dtype) for k, t in given.tensors.items()}

    def fits(name: str) -> bool:  # a None dimension: any length (a sparse format's count)
        (ws, wd), (gs, gd) = want[name], got[name]
        return (
            wd == gd
            and len(ws) == len(gs)
            and all(a in (None, b) for a, b in zip(ws, gs, strict=True))
        )

    if list(got) != list(want) or not all(fits(n) for n in want):
        raise ValueError(
            f"precomputed weight for {weight_name!r} does not match the scheme "
            f"{scheme.to_dict()} for a weight of shape {list(shape)}: expected constants "
            f"{want}, got {got}"
        )


def named_args(target, args: tuple, kwargs: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """An op call's arguments by the op's own argument names (defaults filled in), so passes
    read ``args["group_size"]``, never ``node.args[5]``."""
    names, defaults = _signature(target)
    out = dict(zip(names, args, strict=False))  # the rest: keywords and defaults
    for name in names[len(args) :]:
        if kwargs and name in kwargs:
            out[name] = kwargs[name]
        elif name in defaults:
            default = defaults[name]
            out[name] = list(default) if isinstance(default, list) else default
    return out


@functools.cache  # eager kernels bind every call: the schema's accessors cost more than that
def _signature(target) -> tuple[tuple[str, ...], dict[str, Any]]:
    arguments = target._schema.arguments
    defaults = {a.name: a.default_value for a in arguments if a.has_default_value()}
    return tuple(a.name for a in arguments), defaults
