"""gpt-oss MXFP4 checkpoints (``quant_method: "mxfp4"``, transformers' ``Mxfp4Config``) →
``MXFP4`` constants of the mixture-of-experts weights.

Where it sits: a reader behind ``fxquant.checkpoints.read_quantized``; ``load_quantized`` then
puts the constants into the ``fxquant::mxfp4_grouped_mm`` nodes the rewrite makes of the
experts' ``grouped_mm`` (``fxquant.passes.plan``). Layout (openai/gpt-oss-20b, -120b), per
expert weight ``<block>.mlp.experts.<proj>`` (``gate_up_proj``, ``down_proj``):

- ``<proj>_blocks`` uint8 [E, N, K/32, 16]: the e2m1 codes of each 32-block along K, two per
  byte, the even column in the low nibble, code = sign << 3 | magnitude index into
  {0, 0.5, 1, 1.5, 2, 3, 4, 6};
- ``<proj>_scales`` uint8 [E, N, K/32]: the block's E8M0 exponent, value 2**(s - 127);

with N the output features (``2·intermediate`` for gate_up, interleaved gate/up columns as the
model reads them) and K the input features. That is ``MXFP4``'s storage as it is: the blocks
flatten to the packed [E, N, K/2] and the scales are taken unchanged, so nothing is
dequantized. transformers' model stores the float weight as [E, K, N] (its
``convert_moe_packed_tensors`` dequantizes and transposes); every other tensor (attention,
router, norms, embeddings, the experts' biases) is kept as stored.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from fxquant.checkpoints.base import CheckpointError, LoadedCheckpoint, TensorSource, expect
from fxquant.core.config import MXFP4
from fxquant.core.reference_mx import MX_BLOCK
from fxquant.core.scheme import QuantizedWeight

__all__ = ["read_mxfp4_experts"]


def read_mxfp4_experts(source: TensorSource, qcfg: Mapping[str, Any]) -> LoadedCheckpoint:
    from fxquant.hf import from_hf

    # from_hf checks the fields (dequantize=True, unknown keys: refused) and names the scheme
    config = from_hf(dict(qcfg))
    (scheme,) = {s for s in config.overrides.values() if isinstance(s, MXFP4)}
    out = LoadedCheckpoint(format="mxfp4 (gpt-oss experts)")
    blocks = [n for n in source if n.endswith("_blocks")]
    if not blocks:
        raise CheckpointError("mxfp4 checkpoint has no '*_blocks' tensor (gpt-oss' expert codes)")
    paired = set()
    for bname in blocks:
        name = bname.removesuffix("_blocks")
        sname = f"{name}_scales"
        if sname not in source:
            raise CheckpointError(f"tensor {sname!r} is missing (its codes {bname!r} exist)")
        b = expect(bname, source[bname], dtype=torch.uint8)
        if b.dim() != 4 or b.shape[-1] != MX_BLOCK // 2:
            raise CheckpointError(
                f"tensor {bname!r} has shape {list(b.shape)}, expected [E, N, K/32, 16] "
                "(gpt-oss' MXFP4 expert blocks)"
            )
        e, n, g, _ = b.shape
        s = expect(sname, source[sname], shape=(e, n, g), dtype=torch.uint8)
        if bool((s == 255).any()):
            raise CheckpointError(f"tensor {sname!r} holds E8M0 code 255 (NaN)")
        weight = QuantizedWeight({"qweight": b.reshape(e, n, g * MX_BLOCK // 2), "scale": s}, None)
        out.add_experts(name, scheme, weight, (e, n, g * MX_BLOCK))
        paired.update((bname, sname))
    for tname in source:
        if tname in paired:
            continue
        t = source[tname]
        if t.dtype == torch.uint8 and tname.endswith("_scales"):
            raise CheckpointError(
                f"tensor {tname!r} has no '{tname.removesuffix('_scales')}_blocks' to scale"
            )
        out.tensors[tname] = t
    return out
