"""DeepSeek-style FP8 block checkpoints (``quant_method: "fp8"``, transformers'
``FineGrainedFP8Config``) → ``Float8Block`` constants.

Where it sits: a reader behind ``fxquant.checkpoints.read_quantized``. Layout (DeepSeek-V3,
Qwen3-FP8, ...): per quantized linear ``<m>.weight`` float8_e4m3fn [N, K] and
``<m>.weight_scale_inv`` fp32 [ceil(N/b), ceil(K/b)], the dequant multiplier of each b×b tile
(despite its name: w = q · scale_inv), a short last tile keeping its own scale. That is
``Float8Block(block_size=b)``'s storage as it is; activations are quantized per token in 1×b
groups at run time, as DeepSeek's ``act_quant`` does (amax / 448).

A mixture-of-experts model's checkpoint stores each expert as linears
(``<block>.mlp.experts.<i>.gate_proj`` / ``up_proj`` / ``down_proj``), which transformers 5
stacks as it loads them (its conversion mapping for Qwen2-MoE, shared by Qwen3-MoE,
DeepSeek-V2/V3, GLM-4-MoE …): ``experts.gate_up_proj`` [E, 2I, H], each expert's gate rows then
its up rows, and ``experts.down_proj`` [E, H, I]. Their tiles stack the same way into
``Float8Block``'s experts constants (``fxquant::float8_block_grouped_mm``), which needs I a
multiple of b (gate and up each whole tiles; DeepSeek-V3's 2048, Qwen3-30B-A3B's 768 of 128).
"""

from __future__ import annotations

import re
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
    experts: dict[str, dict[int, dict[str, tuple[torch.Tensor, torch.Tensor]]]] = {}
    used = set()
    for sname in scales:
        module = sname.removesuffix(".weight_scale_inv")
        wname = f"{module}.weight"
        layout = (
            "[N, K] (a linear's; experts stored stacked are not a layout these checkpoints use)"
        )
        w = e4m3_beside(source, wname, sname, layout)
        n, k = w.shape
        s = expect(
            sname,
            source[sname],
            shape=(-(-n // b), -(-k // b)),
            dtype=(torch.float32, torch.bfloat16, torch.float16),
        )
        used.update((wname, sname))
        expert = _EXPERT.fullmatch(module)
        if expert:
            slot = experts.setdefault(expert["stack"], {}).setdefault(int(expert["i"]), {})
            slot[expert["proj"]] = (w, s.float())
            continue
        out.add(module, scheme, QuantizedWeight({"qweight": w, "scale": s.float()}, None), (n, k))
    for stack, by_index in experts.items():
        _add_experts(out, scheme, stack, by_index)
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


# one expert's linear of a MoE block, as checkpoints name them
_EXPERT = re.compile(r"(?P<stack>.+\.experts)\.(?P<i>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)")
_PROJS = ("gate_proj", "up_proj", "down_proj")


def _add_experts(out: LoadedCheckpoint, scheme: Float8Block, stack: str, by_index) -> None:
    """``<stack>.<i>.{gate,up,down}_proj`` (e4m3 and tile scales) → the stacked
    ``<stack>.gate_up_proj`` [E, 2I, H] and ``<stack>.down_proj`` [E, H, I] constants."""
    b = scheme.block_size
    e = len(by_index)
    if sorted(by_index) != list(range(e)):
        raise CheckpointError(
            f"{stack}: experts {sorted(by_index)} are not numbered 0 … {e - 1} (one missing?)"
        )
    for i, projs in sorted(by_index.items()):
        lacking = [p for p in _PROJS if p not in projs]
        if lacking:
            raise CheckpointError(f"{stack}.{i}: no fp8 {', '.join(lacking)} (every expert needs "
                                  "gate_proj, up_proj and down_proj)")  # fmt: skip
    first = by_index[0]
    shapes = {p: tuple(first[p][0].shape) for p in _PROJS}
    (i_dim, h), (h2, i2) = shapes["gate_proj"], shapes["down_proj"]
    if shapes["up_proj"] != (i_dim, h) or (h2, i2) != (h, i_dim):
        raise CheckpointError(
            f"{stack}.0: gate_proj {list(shapes['gate_proj'])}, up_proj "
            f"{list(shapes['up_proj'])} and down_proj {list(shapes['down_proj'])} are not "
            "[I, H], [I, H] and [H, I]"
        )
    for i, projs in by_index.items():
        for p in _PROJS:
            if tuple(projs[p][0].shape) != shapes[p]:
                raise CheckpointError(
                    f"{stack}.{i}.{p} is {list(projs[p][0].shape)}, expert 0's is "
                    f"{list(shapes[p])}: the experts of one block must share their shapes"
                )
    if i_dim % b:
        raise CheckpointError(
            f"{stack}: the experts' intermediate size {i_dim} is not a multiple of the "
            f"{b}×{b} tiles, so gate_proj's and up_proj's tiles cannot stack into one "
            "gate_up_proj (Float8Block's experts layout)"
        )
    experts = [by_index[i] for i in range(e)]

    def stacked(parts):
        return torch.stack([torch.cat(p) for p in parts])

    gate_up = QuantizedWeight({
        "qweight": stacked([(x["gate_proj"][0], x["up_proj"][0]) for x in experts]),
        "scale": stacked([(x["gate_proj"][1], x["up_proj"][1]) for x in experts]),
    }, None)  # fmt: skip
    down = QuantizedWeight({
        "qweight": torch.stack([x["down_proj"][0] for x in experts]),
        "scale": torch.stack([x["down_proj"][1] for x in experts]),
    }, None)  # fmt: skip
    out.add_experts(f"{stack}.gate_up_proj", scheme, gate_up, (e, 2 * i_dim, h), stored_nk=True)
    out.add_experts(f"{stack}.down_proj", scheme, down, (e, h, i_dim), stored_nk=True)
