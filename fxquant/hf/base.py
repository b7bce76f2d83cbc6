"""What every ``fxquant.hf`` method module shares: the ``HF_CONFIGS`` table and the mapper
table that ``from_hf`` dispatches on, the decorator that fills both, and the refusal message.

Where it sits: the bottom of ``fxquant.hf``; each method module (``eetq.py``, ``fp8.py`` …)
registers its table entry beside its mapper here, and ``fxquant/hf/__init__.py`` reads them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

__all__ = [
    "HF_CONFIGS",
    "MAPPERS",
    "SKIP",
    "ApproximationWarning",
    "maps",
    "not_converted",
    "refuse",
    "refuses",
]


class ApproximationWarning(UserWarning):
    """A Hugging Face config was mapped with a documented approximation (its ``HF_CONFIGS``
    entry's ``"approximated"``): raised as a warning so that it is never silent."""


SKIP = "QuantConfig.modules_to_not_convert (names; None keeps fxquant's default, lm_head)"

# quant_method → (transformers class, status, why / how, {field: how it is honoured}).
HF_CONFIGS: dict[str, dict[str, Any]] = {}
# quant_method → its mapper: the config's fields → a QuantConfig (status "mapped"), or
# (QuantConfig, calibration method, approximation or None) (status "calibration")
MAPPERS: dict[str, Callable[[dict[str, Any]], Any]] = {}


def maps(quant_method: str, entry: dict[str, Any]) -> Callable:
    """Decorator: ``entry`` becomes ``HF_CONFIGS[quant_method]`` and the function its mapper."""

    def register(mapper: Callable[[dict[str, Any]], Any]) -> Callable[[dict[str, Any]], Any]:
        HF_CONFIGS[quant_method] = entry
        MAPPERS[quant_method] = mapper
        return mapper

    return register


def refuses(quant_method: str, cls: str, why: str) -> None:
    """``HF_CONFIGS[quant_method]`` for a config fxquant refuses whole: ``from_hf`` raises
    ``NotImplementedError`` with ``why``."""
    HF_CONFIGS[quant_method] = {"class": cls, "status": "refused", "why": why}


def refuse(cls: str, field: str, value: Any, why: str) -> NotImplementedError:
    """The error for one field value fxquant cannot honour (the caller raises it)."""
    return NotImplementedError(f"{cls}({field}={value!r}) is not supported: {why}")


def not_converted(fields: dict[str, Any], key: str = "modules_to_not_convert") -> dict[str, Any]:
    """``QuantConfig`` keyword arguments for the config's skip list (none: fxquant's default)."""
    names = fields.get(key)
    return {} if names is None else {"modules_to_not_convert": tuple(names)}
