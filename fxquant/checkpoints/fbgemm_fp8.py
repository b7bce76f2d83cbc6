"""FBGEMM FP8 checkpoints (``quant_method: "fbgemm_fp8"``, transformers' ``FbgemmFp8Config``;
Meta's Llama-4-Maverick-17B-128E-Instruct-FP8) → ``Float8Dynamic(granularity="row")`` constants.

Where it sits: a reader behind ``fxquant.checkpoints.read_quantized``. Layout, as transformers'
``FbgemmFp8Quantize`` writes it and ``FbgemmFp8Linear`` / ``FbgemmFp8Llama4TextExperts`` read it:

- a linear ``<m>``: ``<m>.weight`` float8_e4m3fn [N, K] and ``<m>.weight_scale`` fp32 [N, 1],
  one dequant multiplier per output channel (fbgemm's ``quantize_fp8_per_row``: amax / 448);
- Llama 4's experts ``<block>.feed_forward.experts``: ``gate_up_proj`` e4m3 [E, K, 2I] with
  ``gate_up_proj_scale`` [E, 1, 2I], and ``down_proj`` e4m3 [E, I, K] with ``down_proj_scale``
  [E, K, 1]: the model's [E, K, N] bmm layout, a scale per output channel of each expert.

That is ``Float8Dynamic(granularity="row", activation_scale_ub=...)``'s storage, the experts read
through their transpose into [E, N, K] (``fxquant::float8_dynamic_grouped_mm``); activations are
quantized per token at run time, their amax capped at the config's ``activation_scale_ub``.
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
from fxquant.core.config import Float8Dynamic
from fxquant.core.scheme import QuantizedWeight

__all__ = ["read_fbgemm_fp8"]

_SCALE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def read_fbgemm_fp8(source: TensorSource, qcfg: Mapping[str, Any]) -> LoadedCheckpoint:
    from fxquant.hf import from_hf

    # from_hf checks every field (unknown keys refused) and names the scheme
    (scheme,) = {s for s in from_hf(dict(qcfg)).schemes if isinstance(s, Float8Dynamic)}
    out = LoadedCheckpoint(format="fbgemm_fp8 (per-channel e4m3)")
    used = set()
    for sname in [n for n in source if n.endswith("_scale")]:
        if sname.endswith(".weight_scale"):
            module = sname.removesuffix(".weight_scale")
            wname = f"{module}.weight"
            w = e4m3_beside(source, wname, sname, "[N, K]")
            n, k = w.shape
            s = expect(sname, source[sname], shape=(n, 1), dtype=_SCALE_DTYPES)
            weight = QuantizedWeight({"qweight": w, "scale": s.float().flatten()}, None)
            out.add(module, scheme, weight, (n, k))
        else:  # Llama 4's experts: <stack>.gate_up_proj_scale / down_proj_scale
            wname = sname.removesuffix("_scale")
            layout = "[E, K, N] (Llama 4's experts as FbgemmFp8Llama4TextExperts stores them)"
            w = e4m3_beside(source, wname, sname, layout)
            e, k, n = w.shape
            s = source[sname]
            if tuple(s.shape) not in ((e, 1, n), (e, n, 1)):  # gate_up's, down's
                raise CheckpointError(
                    f"tensor {sname!r} has shape {list(s.shape)}, expected [{e}, 1, {n}] or "
                    f"[{e}, {n}, 1] (one scale per output channel of each expert)"
                )
            s = expect(sname, s, dtype=_SCALE_DTYPES).float().reshape(e, n)
            qweight = w.transpose(1, 2).contiguous()  # as [E, N, K], each expert's rows
            out.add_experts(wname, scheme, QuantizedWeight({"qweight": qweight, "scale": s}, None),
                            (e, n, k))  # fmt: skip
        used.update((wname, sname))
    if not used:
        raise CheckpointError("fbgemm_fp8 checkpoint has no '*.weight_scale' tensor")
    for name in source:
        if name in used:
            continue
        t = source[name]
        if t.dtype == torch.float8_e4m3fn:
            raise CheckpointError(f"tensor {name!r} is float8 but has no scale beside it")
        out.tensors[name] = t
    return out
