"""DeepSeek-style FP8 block checkpoints (``quant_method: "fp8"``, transformers'
``FineGrainedFP8Config``) → ``Float8Block`` constants.

Where it sits: a reader behind ``fxquant.checkpoints.read_quantized``. Layout (DeepSeek-V3,
Qwen3-FP8, ...): per quantized linear ``<m>.weight`` float8_e4m3fn [N, K] and
``<m>.weight_scale_inv`` fp32 [ceil(N/b), ceil(K/b)], the dequant multiplier of each b×b tile
(despite its name: w = q · scale_inv), a short last tile keeping its own scale. That is
``Float8Block(block_size=b)``'s storage as it is; activations are quantized per token in 1×b
groups at run time, as DeepSeek's ``act_quant`` does (amax / 448).

A mixture-of-experts model's checkpoint stores each expert as linears
(``<block>.mlp.experts.<i>.gate_proj`` / ``up_proj`` / ``down_proj``), read here as linears;
``load_quantized`` stacks their tiles where the model stacks its experts
(``fxquant.checkpoints.experts``: ``Float8Block``'s experts constants, which need I a multiple
of b, gate and up each whole tiles; DeepSeek-V3's 2048, Qwen3-30B-A3B's 768 of 128).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fxquant.checkpoints.base import (
    CheckpointError,
    LoadedCheckpoint,
    TensorSource,
    e4m3_beside,
    expect,
)
from fxquant.core.config import Float8Block
from fxquant.core.scheme import QuantizedWeight

__all__ = ["read_fp8_blocks"]


def read_fp8_blocks(source: TensorSource, qcfg: Mapping[str, Any]) -> LoadedCheckpoint:
    from fxquant.hf import from_hf

    if qcfg.get("dequantize"):
        raise NotImplementedError(
            "FineGrainedFP8Config(dequantize=True) asks for float "
            "weights: load the model with transformers instead"
        )
    # from_hf checks every field (static activations, ue8m0 scales, non-square blocks: refused)
    schemes = [s for s in from_hf(dict(qcfg)).schemes if isinstance(s, Float8Block)]
    scheme = schemes[0]
    b = scheme.block_size
    out = LoadedCheckpoint(format="fp8 (DeepSeek-style blocks)")
    scales = [n for n in source if n.endswith(".weight_scale_inv")]
    if not scales:
        raise CheckpointError("fp8 block checkpoint has no '*.weight_scale_inv' tensor")
    used = set()
    for sname in scales:
        module = sname.removesuffix(".weight_scale_inv")
        wname = f"{module}.weight"
        layout = "[N, K] (a linear's; these checkpoints do not store experts stacked)"
        w = e4m3_beside(source, wname, sname, layout)
        n, k = w.shape
        s = expect(
            sname,
            source[sname],
            shape=(-(-n // b), -(-k // b)),
            dtype=(torch.float32, torch.bfloat16, torch.float16),
        )
        used.update((wname, sname))
        out.add(module, scheme, QuantizedWeight({"qweight": w, "scale": s.float()}, None), (n, k))
    for name in source:
        if name in used:
            continue
        t = source[name]
        if t.dtype == torch.float8_e4m3fn:
            raise CheckpointError(
                f"tensor {name!r} is float8 but has no '{name.rsplit('.', 1)[0]}.weight_scale_inv'"
            )
        out.tensors[name] = t
    return out
