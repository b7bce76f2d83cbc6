"""Quantization configs: what the user asks for, as data.

This is the first stop of the data flow: a ``QuantConfig`` (or a single scheme, or a recipe name)
goes into ``fxquant.quantize``; the planning pass (``fxquant.passes.plan``) reads it to choose a
scheme per linear-like node, and its JSON form is stored in the quantized program so a ``.pt2``
says how it was made.

The schemes themselves are declared in ``fxquant/core/schemes/`` (one module per family, each
a frozen, keyword-only dataclass validated in ``__post_init__``: a bad value raises
``ValueError`` naming the field, the value and what is allowed); they register by class name so
configs round-trip through dicts/JSON (``scheme_from_dict``), and every scheme class is a name
of this module too.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from fxquant.core.scheme import (
    RECIPES,
    SCHEMES,
    Scheme,
    from_recipe_name,
    scheme_from_dict,
)
from fxquant.core.schemes import *  # noqa: F403  (every scheme class, re-exported)
from fxquant.core.schemes import __all__ as _SCHEME_NAMES
from fxquant.core.schemes.float8_recipe import Float8Recipe

__all__ = [
    *_SCHEME_NAMES,
    "QuantConfig",
    "RECIPES",
    "Scheme",
    "from_recipe_name",
    "name_matches",
    "scheme_from_dict",
]


LM_HEAD_SUFFIX = "+lm_head"  # "<recipe>+lm_head[=<recipe>]": QuantConfig.from_recipe
# a pattern naming a mixture-of-experts model's 3-D expert weights (transformers 5's
# experts.gate_up_proj / down_proj, run by grouped_mm), for overrides
EXPERT_WEIGHTS = r"experts\.(gate_up_proj|down_proj)"
# Llama 4's routed experts (Llama4TextExperts, a bmm over every expert), by their module path
LLAMA4_EXPERTS = r"feed_forward\.experts\.(gate_up_proj|down_proj)"
# the schemes whose ``takes_experts`` is true, as error messages name them
EXPERT_SCHEMES = (
    "Int8WeightOnly, Int8DynamicActivation, Int4WeightOnly, Int8DynamicActivationInt4, "
    "Float8WeightOnly, Float8Dynamic(granularity='row'), Float8Block or MXFP4(activations=False)"
)
# patterns naming a model family's layers, which the configs mapped from Hugging Face
# (fxquant.hf) carry for every model: one matching no layer of a model without such layers is
# not a typo, so it is never reported as unmatched
FAMILY_PATTERNS = (EXPERT_WEIGHTS, LLAMA4_EXPERTS)


def name_matches(pattern: str, module_name: str) -> bool:
    """Whether ``pattern`` (a regex) fully matches the module name or any run of its dotted parts.

    ``"lm_head"`` matches ``"lm_head"`` and ``"model.lm_head"``; ``r"layers\\.0\\.mlp\\..*"``
    matches ``"model.layers.0.mlp.up_proj"``; ``"model.layers.0"`` matches every module inside
    that block (like Hugging Face's ``modules_to_not_convert``), but ``"lm_head"`` never matches
    ``"lm_head_2"``.
    """
    parts = module_name.split(".")
    regex = re.compile(pattern)
    return any(
        regex.fullmatch(".".join(parts[i:j]))
        for i in range(len(parts))
        for j in range(i + 1, len(parts) + 1)
    )


NONFINITE = ("error", "skip")  # QuantConfig.nonfinite


@dataclass(frozen=True, kw_only=True)
class QuantConfig:
    """Which scheme each linear-like layer gets.

    Args:
        scheme: the default scheme for every linear-like node (``None``: none by default, only
            ``overrides`` apply).
        overrides: ``{pattern: scheme or None}``, tried in order, first match wins; ``None`` keeps
            the matched layers in float. Patterns are regexes matched against the module name
            (the weight's name without ``.weight``) as ``name_matches`` describes.
        modules_to_not_convert: patterns of layers that always stay in float, checked before
            ``overrides``. Defaults to ``("lm_head",)``, as in Hugging Face.
        fuse_norms: where a LayerNorm/RMSNorm feeds only linears that quantize their activation
            the same way (int8 per token, fp8 per token, fp8 1×b groups), replace the norm and
            their activation quantizers by one ``fxquant::norm_quant`` (``fxquant.passes.fuse``).
            The result is the same bit for bit in fp32; per-tensor fp8 is never fused (its
            scale needs the whole tensor first). ``False`` leaves the rewritten graph as it is.
        module_filter: ``callable(module, fqn) -> bool`` deciding which linears a
            ``Float8Recipe`` region takes (accelerate's ``AORecipeKwargs.module_filter_func``); it
            replaces the default rule (skip the first and the last linear). The other limits
            still apply. A config's JSON records the callable's name only: a config read back
            from JSON has no filter (the program it describes was already planned).
        nonfinite: what a weight with NaN or inf values gets. ``"error"`` (the default): the
            quantize call fails before anything is made, naming each such layer and its count
            (a quantized NaN poisons every output of a block-scaled layer, and an MX scale can
            hide it). ``"skip"``: those layers stay in float, reported with the count.
        strict: an ``overrides`` pattern or a ``modules_to_not_convert`` entry (other than the
            default ``lm_head``) that matches no layer of the exported program is an error;
            ``False`` (the default) warns, naming the patterns. A typo silently quantizing a
            layer the user meant to keep is the mistake this catches.
    """

    scheme: Scheme | None = None
    overrides: Mapping[str, Scheme | None] = field(default_factory=dict)
    modules_to_not_convert: tuple[str, ...] = ("lm_head",)
    fuse_norms: bool = True
    module_filter: Callable[[Any, str], bool] | None = None
    nonfinite: str = "error"
    strict: bool = False

    def __post_init__(self) -> None:
        if self.scheme is not None and not isinstance(self.scheme, Scheme):
            raise ValueError(
                f"QuantConfig.scheme={self.scheme!r} is not a scheme; allowed: None or one of "
                + ", ".join(sorted(SCHEMES))
            )
        if not isinstance(self.overrides, Mapping):
            raise ValueError(
                f"QuantConfig.overrides={self.overrides!r} is not supported; "
                "allowed: a mapping {regex: scheme or None}"
            )
        for pattern, scheme in self.overrides.items():
            _check_pattern("overrides", pattern)
            if scheme is not None and not isinstance(scheme, Scheme):
                raise ValueError(
                    f"QuantConfig.overrides[{pattern!r}]={scheme!r} is not supported; "
                    "allowed: None or a scheme instance such as Int8WeightOnly()"
                )
        if not isinstance(self.modules_to_not_convert, (list, tuple)):
            raise ValueError(
                f"QuantConfig.modules_to_not_convert={self.modules_to_not_convert!r} is "
                + ("a string" if isinstance(self.modules_to_not_convert, str) else "not supported")
                + "; allowed: a list or tuple of patterns, e.g. ('lm_head',), or () for none"
            )
        for pattern in self.modules_to_not_convert:
            _check_pattern("modules_to_not_convert", pattern)
        if not isinstance(self.fuse_norms, bool):
            raise ValueError(
                f"QuantConfig.fuse_norms={self.fuse_norms!r} is not supported; "
                "allowed: True or False"
            )
        if self.module_filter is not None and not callable(self.module_filter):
            raise ValueError(
                f"QuantConfig.module_filter={self.module_filter!r} is not callable; allowed: None "
                "or a function (module, fqn) -> bool"
            )
        if self.module_filter is not None and not any(
            isinstance(s, Float8Recipe) for s in self.schemes
        ):
            raise ValueError(
                "QuantConfig.module_filter applies to Float8Recipe (FP8 training) regions only; "
                "for inference schemes use overrides / modules_to_not_convert"
            )
        if not isinstance(self.strict, bool):
            raise ValueError(
                f"QuantConfig.strict={self.strict!r} is not supported; allowed: True or False"
            )
        if self.nonfinite not in NONFINITE:
            raise ValueError(
                f"QuantConfig.nonfinite={self.nonfinite!r} is not supported; allowed: "
                + ", ".join(repr(v) for v in NONFINITE)
            )
        # Frozen and hashable: torch.compile options and caches want hashable configs.
        object.__setattr__(self, "overrides", _FrozenMapping(self.overrides))
        object.__setattr__(self, "modules_to_not_convert", tuple(self.modules_to_not_convert))

    @property
    def schemes(self) -> list[Scheme]:
        """Every scheme the config names (default first, then the overrides')."""
        found = [self.scheme, *self.overrides.values()]
        return [s for s in found if s is not None]

    def unmatched_patterns(self, module_names: Iterable[str]) -> list[str]:
        """The ``overrides`` patterns (but ``FAMILY_PATTERNS``) and ``modules_to_not_convert``
        entries (but the default ``lm_head``) that match none of ``module_names``, each as
        ``'field: pattern'``."""
        names = list(module_names)
        out = [
            f"overrides: {p!r}"
            for p in self.overrides
            if p not in FAMILY_PATTERNS and not any(name_matches(p, n) for n in names)
        ]
        if self.modules_to_not_convert != ("lm_head",):
            out += [
                f"modules_to_not_convert: {p!r}"
                for p in self.modules_to_not_convert
                if not any(name_matches(p, n) for n in names)
            ]
        return out

    def scheme_for(self, module_name: str) -> tuple[Scheme | None, str]:
        """(scheme or None, why) for one module name."""
        for pattern in self.modules_to_not_convert:
            if name_matches(pattern, module_name):
                return None, f"modules_to_not_convert {pattern!r}"
        for pattern, scheme in self.overrides.items():
            if name_matches(pattern, module_name):
                return scheme, f"override {pattern!r}"
        if self.scheme is None:
            return None, "no default scheme and no override matches"
        return self.scheme, "default scheme"

    def to_dict(self) -> dict[str, Any]:
        return {
            "scheme": None if self.scheme is None else self.scheme.to_dict(),
            "overrides": [
                [p, None if s is None else s.to_dict()] for p, s in self.overrides.items()
            ],
            "modules_to_not_convert": list(self.modules_to_not_convert),
            "fuse_norms": self.fuse_norms,
            "module_filter": None
            if self.module_filter is None
            else getattr(self.module_filter, "__qualname__", repr(self.module_filter)),
            **({} if self.nonfinite == "error" else {"nonfinite": self.nonfinite}),
            **({"strict": True} if self.strict else {}),
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> QuantConfig:
        allowed = {
            "scheme", "overrides", "modules_to_not_convert", "fuse_norms", "module_filter",
            "nonfinite", "strict",
        }  # fmt: skip
        unknown = set(d) - allowed
        if unknown:
            raise ValueError(
                f"QuantConfig dict has unknown keys {sorted(unknown)}; "
                f"allowed: {', '.join(sorted(allowed))}"
            )
        overrides = d.get("overrides", [])
        if isinstance(overrides, Mapping):
            overrides = list(overrides.items())
        if not isinstance(overrides, (list, tuple)) or any(
            not isinstance(o, (list, tuple)) or len(o) != 2 for o in overrides
        ):
            raise ValueError(
                f"QuantConfig overrides={overrides!r} is not supported; allowed: a mapping "
                '{pattern: scheme} or a list of [pattern, scheme] pairs, e.g. [["lm_head", null]]'
            )
        mtnc = d.get("modules_to_not_convert", ("lm_head",))
        return cls(
            scheme=scheme_from_dict(d.get("scheme")),
            overrides={p: scheme_from_dict(s) for p, s in overrides},
            modules_to_not_convert=tuple(mtnc) if isinstance(mtnc, list) else mtnc,
            # programs saved before fusion existed have no key: they load with the default
            fuse_norms=d.get("fuse_norms", True),
            nonfinite=d.get("nonfinite", "error"),
            strict=d.get("strict", False),
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> QuantConfig:
        return cls.from_dict(json.loads(text))

    @classmethod
    def from_recipe(cls, name: str) -> QuantConfig:
        """A config from a recipe name, optionally with an ``lm_head`` suffix.

        ``"int8wo"`` quantizes every linear but ``lm_head`` (Hugging Face's default);
        ``"int8wo+lm_head"`` quantizes ``lm_head`` too, with the same scheme; and
        ``"int4wo-64+lm_head=int8wo"`` gives ``lm_head`` another recipe's scheme (as llama.cpp's
        4-bit files keep the output matrix in 8 bits). For a causal LM decoded one token at a
        time, ``lm_head`` is the largest single matrix read per token; a tied input embedding
        keeps its float table for the lookup (the report says ``float_weight_kept``).
        """
        base, plus, head = name.partition(LM_HEAD_SUFFIX)
        if not plus:
            return cls(scheme=from_recipe_name(name))
        if head and not head.startswith("="):
            raise ValueError(
                f"recipe {name!r}: after {LM_HEAD_SUFFIX!r} comes nothing (lm_head takes the "
                "same scheme) or '=<recipe>' (e.g. 'int4wo-64+lm_head=int8wo')"
            )
        scheme = from_recipe_name(base)
        head_scheme = from_recipe_name(head[1:]) if head else scheme
        return cls(
            scheme=scheme,
            overrides={} if head_scheme == scheme else {"lm_head": head_scheme},
            modules_to_not_convert=(),
        )

    @classmethod
    def coerce(cls, config: QuantConfig | Scheme | str) -> QuantConfig:
        """A QuantConfig from what ``quantize`` accepts: a config, a scheme or a recipe name."""
        if isinstance(config, QuantConfig):
            return config
        if isinstance(config, Scheme):
            return cls(scheme=config)
        if isinstance(config, str):
            return cls.from_recipe(config)
        raise ValueError(
            f"config={config!r} is not supported; allowed: a QuantConfig, a scheme instance "
            f"such as Int8WeightOnly(), or a recipe name ({', '.join(RECIPES)})"
        )


def _check_pattern(field_name: str, pattern: Any) -> None:
    if not isinstance(pattern, str):
        raise ValueError(f"QuantConfig.{field_name} pattern {pattern!r} is not a string regex")
    try:
        re.compile(pattern)
    except re.error as e:
        raise ValueError(f"QuantConfig.{field_name} pattern {pattern!r} is not a regex: {e}") from e


class _FrozenMapping(Mapping):
    """A read-only, hashable, ordered mapping (first match wins, so order matters)."""

    def __init__(self, items: Mapping) -> None:
        self._items = tuple(items.items())
        self._dict = dict(self._items)

    def __getitem__(self, key):
        return self._dict[key]

    def __iter__(self):
        return iter(self._dict)

    def __len__(self) -> int:
        return len(self._items)

    def __hash__(self) -> int:
        return hash(self._items)

    def __eq__(self, other) -> bool:
        return isinstance(other, Mapping) and list(self.items()) == list(other.items())

    def __repr__(self) -> str:
        return repr(self._dict)
