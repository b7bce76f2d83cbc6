"""FP-Quant checkpoints (transformers' ``FPQuantConfig``, real quantization) → ``FPQuant``
constants.

Where it sits: a reader behind ``fxquant.checkpoints.read_quantized``. ``FPQuantLinear`` saves,
per linear ``<m>`` (``fp_quant`` 0.3, QuTLASS's quantizer; all in the rotated basis):

    ``qweight`` uint8 [N, K/2]: e2m1 codes two a byte along K, the even column in the low nibble;
    ``scales`` uint8: one per block (MXFP4: E8M0 per 32; NVFP4: e4m3 bits per 16), in row-major
        block order from the buffer's start; QuTLASS allocates the buffer padded to
        [⌈N/128⌉·128, ⌈K/B/4⌉·4], so the first N·K/B bytes are read;
    ``weight_global_scale``, ``act_global_scale`` [1]: the tensor scales (the GEMM's
        α = 1 / (G_w · G_x));
    ``forward_hadamard_matrix`` [g, g]: the rotation (``backward_hadamard_matrix``: training
        only, not read).

These are exactly ``FPQuant``'s constants, so the layers compute what FP-Quant's forward does
(``fxquant.core.reference_fp_quant``). A pseudo-quantized checkpoint (``dqweight``: dequantized
bf16 weights, which fix neither codes nor scales) and one holding only master weights (float
``weight``) are refused with what to do instead.
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
    modules_with,
    need,
)
from fxquant.core.config import FPQuant
from fxquant.core.reference_fp_quant import BLOCK
from fxquant.core.scheme import QuantizedWeight
from fxquant.hf import from_hf

__all__ = ["read_fp_quant"]

# what every FPQuantLinear saves besides qweight; read here or (backward) deliberately dropped
_PARTS = ("scales", "weight_global_scale", "act_global_scale", "forward_hadamard_matrix")


def read_fp_quant(source: TensorSource, qcfg: Mapping[str, Any]) -> LoadedCheckpoint:
    """An ``fp_quant`` checkpoint's tensors → fxquant constants (module docstring)."""
    base = from_hf(dict(qcfg)).scheme  # the config's own checks, and its defaults
    assert isinstance(base, FPQuant)
    modules = modules_with(source, "qweight")
    if not modules:
        if any(n.endswith(".dqweight") for n in source):
            raise CheckpointError(
                "FP-Quant checkpoint is pseudo-quantized (dqweight: dequantized bf16 weights, "
                "which fix neither the codes nor the scales): load the model as float and "
                "quantize it with fxquant.from_hf(config)"
            )
        raise CheckpointError(
            "FP-Quant checkpoint has no '*.qweight' tensor (a store_master_weights checkpoint "
            "holds float weights: load the model as float and quantize it with "
            "fxquant.from_hf(config))"
        )
    block = BLOCK[base.dtype]
    out = LoadedCheckpoint(format=f"fp_quant ({base.dtype}, {base.method})")
    consumed: set[str] = set()
    for m in modules:
        why = f"FP-Quant layer {m}"
        q = expect(f"{m}.qweight", source[f"{m}.qweight"], dtype=torch.uint8)
        if q.dim() != 2:
            raise CheckpointError(
                f"tensor '{m}.qweight' has shape {list(q.shape)}, expected [N, K/2]"
            )
        n, k = q.shape[0], 2 * q.shape[1]
        parts = {p: need(source, f"{m}.{p}", why) for p in _PARTS}
        rot = expect(
            f"{m}.forward_hadamard_matrix", parts["forward_hadamard_matrix"], dtype=SCALE_DTYPES
        )
        g = base.rotation_size
        expect(f"{m}.forward_hadamard_matrix", rot, shape=(g, g))
        if k % g:
            raise CheckpointError(f"{m}: K={k} is not a multiple of hadamard_group_size={g}")
        scales = _block_scales(f"{m}.scales", parts["scales"], n, k // block, base.dtype)
        tensors = {
            "qweight": q,
            "scale": scales,
            "rotation": rot.float(),
            "weight_global_scale": _scalar(
                f"{m}.weight_global_scale", parts["weight_global_scale"]
            ),
            "act_global_scale": _scalar(f"{m}.act_global_scale", parts["act_global_scale"]),
        }
        out.add(m, base, QuantizedWeight(tensors, None), (n, k))
        consumed |= {f"{m}.qweight", *(f"{m}.{p}" for p in _PARTS), f"{m}.backward_hadamard_matrix"}
        # FPQuantLinear's unused parameters, saved empty
        consumed |= {
            f"{m}.{p}"
            for p in ("weight", "dqweight")
            if f"{m}.{p}" in source and source[f"{m}.{p}"].numel() == 0
        }
    for name in source:
        if name not in consumed:
            out.tensors[name] = source[name]
    return out


def _scalar(name: str, t: torch.Tensor) -> torch.Tensor:
    expect(name, t, dtype=SCALE_DTYPES)
    if t.numel() != 1:
        raise CheckpointError(f"tensor {name!r} has shape {list(t.shape)}, expected [1]")
    return t.float().reshape(1)


def _block_scales(name: str, t: torch.Tensor, n: int, blocks: int, dtype: str) -> torch.Tensor:
    """The first N·blocks bytes of the (possibly padded) scale buffer, as [N, blocks]: uint8
    E8M0 exponents for MXFP4, float8_e4m3fn for NVFP4."""
    if t.dtype in (torch.float8_e8m0fnu, torch.float8_e4m3fn):
        t = t.view(torch.uint8)
    expect(name, t, dtype=torch.uint8)
    padded = (-(-n // 128) * 128, -(-blocks // 4) * 4)
    if tuple(t.shape) not in {(n, blocks), padded}:
        raise CheckpointError(
            f"tensor {name!r} has shape {list(t.shape)}, expected {[n, blocks]} (or QuTLASS's "
            f"padded {list(padded)})"
        )
    s = t.reshape(-1)[: n * blocks].reshape(n, blocks).clone()
    return s if dtype == "mxfp4" else s.view(torch.float8_e4m3fn)
