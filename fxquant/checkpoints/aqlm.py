"""AQLM checkpoints (``quant_method: "aqlm"``, transformers' ``AqlmConfig``, the ``aqlm``
package) → ``Aqlm`` constants.

Where it sits: a reader behind ``fxquant.checkpoints.read_quantized``. Per linear ``<m>``
(``aqlm.inference.QuantizedLinear``): ``codes`` [N/og, K/ig, C] in int8 / int16 (values
≥ 2^(b-1) wrapped negative, as the package's ``pack_int_data`` stores them; unwrapped here as its
``unpack_int_data`` does), ``codebooks`` [C, 2^b, og, ig], ``scales`` [N/og, 1, 1, 1], every
shape checked against the config's ``in_group_size``, ``out_group_size``, ``num_codebooks`` and
``nbits_per_codebook``. ``linear_weights_not_to_quantize`` layers are plain float tensors.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fxquant.checkpoints.base import (
    SCALE_DTYPES,
    CheckpointError,
    LoadedCheckpoint,
    TensorSource,
    expect,
    need,
    quantized_modules,
)
from fxquant.core.config import Aqlm
from fxquant.core.scheme import QuantizedWeight

__all__ = ["read_aqlm"]


def read_aqlm(source: TensorSource, qcfg: Mapping[str, Any]) -> LoadedCheckpoint:
    """An AQLM checkpoint's tensors → fxquant constants (module docstring)."""
    ig, og = int(qcfg.get("in_group_size", 8)), int(qcfg.get("out_group_size", 1))
    c, bits = int(qcfg.get("num_codebooks", 1)), int(qcfg.get("nbits_per_codebook", 16))
    if og != 1:
        raise NotImplementedError(
            f"AQLM out_group_size={og}: only one output row a group loads (the 1x16 and 2x8 "
            "formats); the codes of larger output groups would need a row expansion"
        )
    scheme = Aqlm(in_group_size=ig, num_codebooks=c, nbits_per_codebook=bits)
    modules = quantized_modules(source, "codes", "AQLM")
    out = LoadedCheckpoint(format=f"aqlm ({c}x{bits}, groups of {ig})")
    consumed: set[str] = set()
    for m in modules:
        why = f"AQLM layer {m}"
        codes = expect(
            f"{m}.codes", source[f"{m}.codes"], dtype=(torch.int8, torch.int16, torch.int32)
        )
        books = expect(f"{m}.codebooks", need(source, f"{m}.codebooks", why), dtype=SCALE_DTYPES)
        scales = expect(f"{m}.scales", need(source, f"{m}.scales", why), dtype=SCALE_DTYPES)
        consumed |= {f"{m}.codes", f"{m}.codebooks", f"{m}.scales"}
        if codes.dim() != 3:
            raise CheckpointError(
                f"tensor '{m}.codes' has shape {list(codes.shape)}, expected [N, K/{ig}, {c}]"
            )
        n, gi = codes.shape[0], codes.shape[1]
        expect(f"{m}.codes", codes, shape=(n, gi, c))
        expect(f"{m}.codebooks", books, shape=(c, 2**bits, og, ig))
        expect(f"{m}.scales", scales, shape=(n, 1, 1, 1))
        u = codes.to(torch.int64) % (2**bits)  # the package's unpack_int_data
        tensors = {
            "qweight": u.to(torch.int32).contiguous(),
            "codebooks": books.float().contiguous(),
            "scale": scales.float().reshape(n).contiguous(),
        }
        out.add(m, scheme, QuantizedWeight(tensors, None), (n, gi * ig))
    for name in source:
        if name not in consumed:
            out.tensors[name] = source[name]
    return out
