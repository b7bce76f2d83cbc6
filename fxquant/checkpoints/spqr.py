"""SpQR checkpoints (``quant_method: "spqr"``, transformers' ``SpQRConfig``, the ``spqr_quant``
package) → ``Spqr`` constants.

Where it sits: a reader behind ``fxquant.checkpoints.read_quantized``. The config's ``shapes``
holds, per quantized linear ``<m>``, the lengths of its four 1-D tensors (``<m>.dense_weights``
int64, ``<m>.row_offsets`` int32, ``<m>.col_vals`` int32, ``<m>.in_perm`` int32 holding two
uint16 indices each, even index in the low half); the layout is ``fxquant.core.spqr``'s. The
shapes of W come from the model the checkpoint attaches to: ``dense_weights`` has m·n/16 words
and ``in_perm`` n/2, so n = 2·len(in_perm) and m = 16·len(dense_weights) / n; a layer without a
permutation (empty ``in_perm``) needs n from elsewhere and is refused. Only bits 3 with 16×16
tiles exist (the package and transformers fix them).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fxquant.checkpoints.base import (
    CheckpointError,
    LoadedCheckpoint,
    TensorSource,
    expect,
    need,
    quantized_modules,
)
from fxquant.core.config import Spqr
from fxquant.core.scheme import QuantizedWeight

__all__ = ["read_spqr"]


def read_spqr(source: TensorSource, qcfg: Mapping[str, Any]) -> LoadedCheckpoint:
    """A SpQR checkpoint's tensors → fxquant constants (module docstring)."""
    for key, want in (("bits", 3), ("beta1", 16), ("beta2", 16)):
        if int(qcfg.get(key, want)) != want:
            raise NotImplementedError(
                f"SpQR {key}={qcfg[key]}: only bits 3 with 16×16 tiles exist (the package and "
                "transformers' SpQRConfig allow nothing else)"
            )
    shapes = qcfg.get("shapes") or {}
    modules = quantized_modules(source, "dense_weights", "SpQR")
    out = LoadedCheckpoint(format="spqr (3-bit, 16×16)")
    consumed: set[str] = set()
    for m in modules:
        why = f"SpQR layer {m}"
        parts = {
            p: need(source, f"{m}.{p}", why)
            for p in ("dense_weights", "row_offsets", "col_vals", "in_perm")
        }
        for p, t in parts.items():
            length = shapes.get(f"{m}.{p}.shape")
            if length is not None:
                expect(f"{m}.{p}", t, shape=(int(length),))
        d = expect(f"{m}.dense_weights", parts["dense_weights"], dtype=torch.int64)
        ro = expect(f"{m}.row_offsets", parts["row_offsets"], dtype=torch.int32)
        cv = parts["col_vals"]
        cv = (
            cv.to(torch.int32)
            if cv.numel() == 0
            else expect(f"{m}.col_vals", cv, dtype=torch.int32)
        )
        ip = expect(f"{m}.in_perm", parts["in_perm"], dtype=torch.int32)
        if ip.numel() == 0:
            raise NotImplementedError(
                f"{why}: no input permutation (empty in_perm), so the file does not say the "
                "layer's in_features; not read"
            )
        n = 2 * ip.numel()
        if d.numel() * 16 % n:
            raise CheckpointError(f"tensor '{m}.dense_weights' has {d.numel()} words, not m·{n}/16")
        rows = d.numel() * 16 // n
        if ro.numel() not in (rows + 1, rows // 16 + 1):
            raise CheckpointError(
                f"tensor '{m}.row_offsets' has {ro.numel()} entries, expected {rows + 1} (CSR) "
                f"or {rows // 16 + 1} (PTCSR)"
            )
        u = ip.to(torch.int64) & 0xFFFFFFFF
        perm = torch.stack([u & 0xFFFF, u >> 16], -1).reshape(-1)
        if not torch.equal(torch.sort(perm).values, torch.arange(n)):
            raise CheckpointError(f"tensor '{m}.in_perm' is not a permutation of 0..{n - 1}")
        tensors = {"qweight": d, "row_offsets": ro, "col_vals": cv, "perm": perm}
        out.add(m, Spqr(), QuantizedWeight(tensors, None), (rows, n))
        consumed |= {f"{m}.{p}" for p in parts}
    for name in source:
        if name not in consumed:
            out.tensors[name] = source[name]
    return out
