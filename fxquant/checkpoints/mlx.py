"""MLX affine checkpoints → ``IntxWeightOnly(zero_point="float", grid="mlx")`` constants.

Where it sits: a reader behind ``fxquant.checkpoints.read_quantized``. Two spellings of one
format: transformers' ``MetalConfig`` checkpoints (``quant_method: "metal"``; per linear
``<m>.weight``, ``<m>.scales``, ``<m>.qbiases``) and Apple MLX's own files (mlx-lm: config.json
``"quantization": {"group_size", "bits"}``, no ``quant_method``; ``<m>.biases``). Per linear:

    ``weight`` uint32 [N, K·bits/32]: codes along K, ``32 / bits`` a word, lowest bits first;
    ``scales``, ``biases`` [N, K/g] (fp16, bf16 or fp32): w = u·scale + bias per group of g.

fxquant stores w = (u - z)·s: s = scale and z = -bias / scale (a float zero point), so the codes
and scales are the file's and the dequantized weight equals MLX's up to fp32 rounding of that
quotient (a constant group whose scale underflowed to 0 in fp16 gets s = 2^-100, exactly its
bias for every code). 2 and 4 bits load; 8 bits (no grouped 8-bit format with a float zero
point) and MLX's 3, 5 and 6 bits (packed across word boundaries) are refused.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

import torch

from fxquant.checkpoints.base import (
    SCALE_DTYPES,
    CheckpointError,
    LoadedCheckpoint,
    TensorSource,
    expect,
    int_weight,
    need,
    quantized_modules,
)
from fxquant.core.reference_lowbit import unpack_mlx

__all__ = ["read_mlx"]

_FLAT_SCALE = 2.0**-100  # the scale a constant group with an underflowed scale gets


def read_mlx(source: TensorSource, qcfg: Mapping[str, Any]) -> LoadedCheckpoint:
    """A ``metal`` / MLX checkpoint's tensors → fxquant constants (module docstring)."""
    bits, group_size = qcfg.get("bits", 4), qcfg.get("group_size", 64)
    if bits not in (2, 4):
        raise NotImplementedError(
            f"MLX bits={bits}: 2- and 4-bit affine groups load; 8 bits has no grouped 8-bit "
            "format with a float zero point in fxquant, and MLX's 3, 5 and 6 bits pack codes "
            "across word boundaries (not read)"
        )
    per = 32 // bits
    bias_name = "qbiases" if any(n.endswith(".qbiases") for n in source) else "biases"
    modules = quantized_modules(source, "scales", "MLX")
    out = LoadedCheckpoint(format=f"mlx affine ({bits}-bit, groups of {group_size})")
    consumed: set[str] = set()
    for m in modules:
        why = f"MLX layer {m}"
        words = expect(
            f"{m}.weight", need(source, f"{m}.weight", why), dtype=(torch.uint32, torch.int32)
        )
        scales = expect(f"{m}.scales", source[f"{m}.scales"], dtype=SCALE_DTYPES)
        biases = need(source, f"{m}.{bias_name}", why)
        expect(f"{m}.{bias_name}", biases, dtype=SCALE_DTYPES, shape=scales.shape)
        consumed |= {f"{m}.weight", f"{m}.scales", f"{m}.{bias_name}"}
        if words.dim() != 2:
            raise CheckpointError(
                f"tensor '{m}.weight' has shape {list(words.shape)}, expected [N, K/{per}]"
            )
        n, k = words.shape[0], words.shape[1] * per
        if k % group_size:
            raise CheckpointError(f"{m}: K={k} is not a multiple of group_size={group_size}")
        expect(f"{m}.scales", scales, shape=(n, k // group_size))
        s, b = scales.float(), biases.float()
        # A constant group's scale (1e-8) underflows to 0 in fp16: every code then reads as the
        # bias. As s = 2^-100 and z = -b·2^100 (both exact: powers of two), (u - z)·s is b to
        # the last bit for any code u (u is below z's last digit in fp32)
        flat = (s == 0) & (b != 0)
        s = torch.where(flat, torch.full_like(s, _FLAT_SCALE), s)
        zero = torch.where(s == 0, torch.zeros_like(b), -b / s)
        scheme, weight = int_weight(m, unpack_mlx(words, bits), s, zero, group_size, bits=bits)
        out.add(m, dataclasses.replace(scheme, grid="mlx"), weight, (n, k))
    for name in source:
        if name not in consumed:
            out.tensors[name] = source[name]
    return out
