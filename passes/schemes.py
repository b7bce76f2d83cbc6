"""Transitional: the names the scheme handlers had here, now derived from each scheme's
declaration (``fxquant.core.scheme``). Removed once every importer reads them there."""

from __future__ import annotations

from dataclasses import dataclass

from fxquant.core.scheme import QuantizedWeight, Scheme, check_layout

__all__ = ["QuantizedWeight", "check_layout", "grouped_op_args", "handler_for"]


@dataclass(frozen=True)
class _Handler:
    scheme: Scheme

    def quantize(self, scheme: Scheme, w) -> QuantizedWeight:
        return scheme.quantize(w)

    def op_args(self, scheme: Scheme, x, constants: list, bias) -> tuple:
        names = (*scheme.constants, *scheme.optional_constants)
        return scheme.op_args(x, dict(zip(names, constants, strict=False)), bias)


def handler_for(scheme: Scheme) -> _Handler:
    return _Handler(scheme)


def grouped_op_args(scheme: Scheme, x, constants, offs) -> tuple:
    return scheme.grouped_op_args(x, constants, offs)
