"""A checkpoint's mixture-of-experts linears, one per expert, → the stacked experts weights a
transformers 5 model holds.

Where it sits: between the readers and the model, in ``load_quantized`` (it needs the model's
names, which ``read_quantized`` does not have). Checkpoints written for transformers 4 and vLLM
(Qwen3-FP8 and DeepSeek-V3's FineGrainedFP8, RedHatAI's compressed-tensors Qwen3-MoE and
Mixtral, GPTQ Qwen-MoE) store each expert as three linears, ``<block>.experts.<i>.gate_proj`` /
``up_proj`` / ``down_proj`` (Mixtral's ``block_sparse_moe.experts.<i>.w1`` / ``w3`` / ``w2``);
the readers convert them as they convert any linear. A transformers 5 model stacks them into
``<block>.experts.gate_up_proj`` [E, 2I, H] (each expert's gate rows over its up rows) and
``<block>.experts.down_proj`` [E, H, I] (``transformers.conversion_mapping``: ``MergeModulelist``
then ``Concatenate(dim=1)``; Mixtral's ``.block_sparse_moe.`` renamed ``.mlp.``). A scheme
quantizes experts as linears, one expert at a time, and every scheme that takes experts keeps
its constants per row of the weight (Float8Block: per b rows), so stacking the loaded linears'
constants the same way gives what ``from_hf`` computes from the float model, bit for bit.
Experts a checkpoint keeps float, one linear each (a block its quantization config ignored),
stack into the model's float experts the same way. A model that keeps its experts as linears
(transformers 4 remote code) takes them as they are.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping

import torch

from fxquant.checkpoints.base import CheckpointError, LoadedCheckpoint
from fxquant.core.config import EXPERT_SCHEMES, Float8Block, Scheme
from fxquant.core.scheme import QuantizedWeight, layout_of

__all__ = ["stack_expert_linears"]

# one expert's linear, as checkpoints name them (Mixtral's w1 = gate, w3 = up, w2 = down)
_ROLE = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up"}
_ROLE |= {"down_proj": "down", "w2": "down"}
_EXPERT = re.compile(rf"(?P<stack>.+\.experts)\.(?P<i>\d+)\.(?P<proj>{'|'.join(_ROLE)})")
_MIXTRAL = (".block_sparse_moe.", ".mlp.")  # transformers 5's renaming of Mixtral's block


def stack_expert_linears(ckpt: LoadedCheckpoint, model_names: Collection[str]) -> LoadedCheckpoint:
    """``ckpt`` with each block's per-expert linears stacked where the model (its parameter and
    buffer names, ``model_names``) holds that block's experts stacked; ``ckpt`` itself is not
    changed. CheckpointError / NotImplementedError naming the block where they cannot stack."""
    todo = _stacked_in_model(ckpt.schemes, model_names)
    # blocks whose experts the checkpoint keeps float, one linear each (a layer its quantization
    # config ignored)
    weights = [n for n in ckpt.tensors if n.endswith(".weight")]
    floats = _stacked_in_model(weights, model_names, skip=set(todo))
    if not todo and not floats:
        return ckpt
    out = LoadedCheckpoint(
        format=ckpt.format, schemes=dict(ckpt.schemes), weights=dict(ckpt.weights),
        shapes=dict(ckpt.shapes), tensors=dict(ckpt.tensors),
    )  # fmt: skip
    for stack, (target, by_index) in todo.items():
        _stack(out, stack, target, by_index)
    for stack, (target, by_index) in floats.items():
        _stack_float(out, stack, target, by_index)
    if any(target != stack for stack, (target, _) in (todo | floats).items()):
        # Mixtral: the router and every other weight of the block move with its experts
        out.schemes = {_renamed(m, model_names): v for m, v in out.schemes.items()}
        out.weights = {_renamed(n, model_names): v for n, v in out.weights.items()}
        out.shapes = {_renamed(n, model_names): v for n, v in out.shapes.items()}
        out.tensors = {_renamed(n, model_names): v for n, v in out.tensors.items()}
    return out


def _renamed(name: str, model_names: Collection[str]) -> str:
    """``name`` (a tensor's, or a module's whose weight is ``<name>.weight``) under Mixtral's
    transformers 5 name where the model has that one and not this one."""

    def has(n: str) -> bool:
        return n in model_names or f"{n}.weight" in model_names

    new = name.replace(*_MIXTRAL)
    return new if new != name and has(new) and not has(name) else name


def _stacked_in_model(names, model_names, *, skip=()) -> dict[str, tuple[str, dict]]:
    """The per-expert linears among ``names`` (modules, or their ``.weight`` tensors) by block,
    for the blocks the model stacks (not in ``skip``): {block: (the block's name in the model,
    {expert: {role: name}})}."""
    stacks: dict[str, dict[int, dict[str, str]]] = {}  # block → expert → role → name
    for name in names:
        m = _EXPERT.fullmatch(name.removesuffix(".weight"))
        if m is None or m["stack"] in skip:
            continue
        roles = stacks.setdefault(m["stack"], {}).setdefault(int(m["i"]), {})
        role = _ROLE[m["proj"]]
        if role in roles:
            raise CheckpointError(f"{name!r} and {roles[role]!r} are both expert {m['i']}'s "
                                  f"{role} projection")  # fmt: skip
        roles[role] = name
    out = {}
    for stack, by_index in stacks.items():
        target = stack.replace(*_MIXTRAL)
        first = [f"{n.removesuffix('.weight')}.weight" for n in by_index.get(0, {}).values()]
        if f"{target}.gate_up_proj" in model_names and not any(n in model_names for n in first):
            out[stack] = (target, by_index)
    return out


def _stack_float(out: LoadedCheckpoint, stack: str, target: str, by_index) -> None:
    """Float per-expert linears → ``<target>.gate_up_proj`` / ``down_proj`` tensors, in place,
    stacked as transformers 5 stacks them."""
    _check_experts(stack, by_index, "float")
    t = [{r: out.tensors.pop(by_index[i][r]) for r in ("gate", "up", "down")}
         for i in range(len(by_index))]  # fmt: skip
    out.tensors[f"{target}.gate_up_proj"] = torch.stack(
        [torch.cat([x["gate"], x["up"]]) for x in t]
    )
    out.tensors[f"{target}.down_proj"] = torch.stack([x["down"] for x in t])


def _check_experts(stack: str, by_index, kind: str) -> None:
    """Experts numbered 0 … E-1, each with its gate, up and down projections (``kind``:
    ``"quantized"`` or ``"float"``, as the block's first expert has them)."""
    e = len(by_index)
    if sorted(by_index) != list(range(e)):
        raise CheckpointError(
            f"{stack}: experts {sorted(by_index)} are not numbered 0 … {e - 1} (one missing?)"
        )
    for i, roles in sorted(by_index.items()):
        lacking = [f"{r}_proj" for r in ("gate", "up", "down") if r not in roles]
        if lacking:
            raise CheckpointError(f"{stack}.{i}: no {kind} {', '.join(lacking)} (every expert "
                                  "needs its gate, up and down projections)")  # fmt: skip


def _stack(out: LoadedCheckpoint, stack: str, target: str, by_index) -> None:
    """``<stack>.<i>.{gate,up,down}`` in ``out`` → ``<target>.gate_up_proj`` [E, 2I, H] and
    ``<target>.down_proj`` [E, H, I], in place."""
    _check_experts(stack, by_index, "quantized")
    e = len(by_index)
    modules = [by_index[i][r] for i in range(e) for r in ("gate", "up", "down")]
    schemes = {out.schemes[m] for m in modules}
    if len(schemes) != 1:
        raise NotImplementedError(
            f"{stack}: the experts' linears are quantized by {len(schemes)} schemes "
            f"({', '.join(sorted(str(s.to_dict()) for s in schemes))}); stacked experts take one"
        )
    (scheme,) = schemes
    if not scheme.takes_experts:
        raise NotImplementedError(
            f"{stack}: the experts are quantized {scheme.to_dict()}, which has no experts op, "
            f"and the model holds them stacked ({target}.gate_up_proj); experts take "
            f"{EXPERT_SCHEMES}"
        )
    shapes = {r: out.shapes[f"{by_index[0][r]}.weight"] for r in ("gate", "up", "down")}
    (i_dim, h) = shapes["gate"]
    if shapes["up"] != (i_dim, h) or shapes["down"] != (h, i_dim):
        raise CheckpointError(
            f"{stack}.0: gate, up and down projections are {list(shapes['gate'])}, "
            f"{list(shapes['up'])} and {list(shapes['down'])}, not [I, H], [I, H] and [H, I]"
        )
    for m in modules:
        role = _ROLE[m.rsplit(".", 1)[1]]
        if out.shapes[f"{m}.weight"] != shapes[role]:
            raise CheckpointError(
                f"{m} is {list(out.shapes[f'{m}.weight'])}, expert 0's is {list(shapes[role])}: "
                "the experts of one block must share their shapes"
            )
    _check_rows(scheme, stack, i_dim, h)
    weights = [{r: out.weights.pop(f"{by_index[i][r]}.weight").tensors for r in by_index[i]}
               for i in range(e)]  # fmt: skip
    for m in modules:
        del out.schemes[m], out.shapes[f"{m}.weight"]
    names = list(layout_of(scheme, (i_dim, h)))
    gate_up = {c: torch.stack([torch.cat([w["gate"][c], w["up"][c]]) for w in weights])
               for c in names}  # fmt: skip
    down = {c: torch.stack([w["down"][c] for w in weights]) for c in names}
    out.add_experts(f"{target}.gate_up_proj", scheme, QuantizedWeight(gate_up, None),
                    (e, 2 * i_dim, h), stored_nk=True)  # fmt: skip
    out.add_experts(f"{target}.down_proj", scheme, QuantizedWeight(down, None), (e, h, i_dim),
                    stored_nk=True)  # fmt: skip


def _check_rows(scheme: Scheme, stack: str, i_dim: int, h: int) -> None:
    """Gate's and up's constants concatenate into gate_up's only if each of their rows (or
    tiles of rows) covers rows of one projection."""
    if isinstance(scheme, Float8Block):
        b = scheme.block_size
        if i_dim % b:
            raise CheckpointError(
                f"{stack}: the experts' intermediate size {i_dim} is not a multiple of the "
                f"{b}×{b} tiles, so gate_proj's and up_proj's are not whole tiles of one "
                "gate_up_proj (Float8Block's experts layout)"
            )
        return
    for name, (shape, _) in layout_of(scheme, (i_dim, h)).items():
        if shape[0] != i_dim:  # a scheme whose constants are not per row: none takes experts yet
            raise NotImplementedError(
                f"{stack}: {scheme.to_dict()}'s {name!r} is {list(shape)} for a [{i_dim}, {h}] "
                "projection, not one row per output row: gate's and up's cannot be stacked"
            )


def expert_linears(
    param: str,
    scheme: Scheme,
    consts: Mapping[str, torch.Tensor],
    n: int,
    k: int,
    *,
    names: tuple[str, str, str] = ("gate_proj", "up_proj", "down_proj"),
) -> list[tuple[str, dict[str, torch.Tensor], int, int]]:
    """The constants of a stacked experts weight (``<block>.experts.gate_up_proj`` [E, 2I, H]
    or ``down_proj`` [E, H, I], the model storing it [E, N, K]) → (module, constants, N, K) of
    each expert's linears, named ``<block>.experts.<i>.<name>`` with ``names`` (gate, up, down):
    what ``stack_expert_linears`` stacks back, bit for bit. ``n``, ``k``: each expert's float
    [N, K]."""
    stack, _, leaf = param.rpartition(".")
    e = consts["qweight"].shape[0]
    gate, up, down = names
    if leaf == "down_proj":
        return [(f"{stack}.{i}.{down}", {c: t[i] for c, t in consts.items()}, n, k)
                for i in range(e)]  # fmt: skip
    if leaf != "gate_up_proj":
        raise NotImplementedError(
            f"{param!r}: experts weights write as per-expert linears from gate_up_proj and "
            "down_proj only"
        )
    i_dim = n // 2
    _check_rows(scheme, stack, i_dim, k)
    out = []
    for i in range(e):
        halves = {}
        for c, t in consts.items():
            rows = t.shape[1] // 2  # I rows, or I/b tiles of rows
            halves[c] = (t[i, :rows], t[i, rows:])
        for j, name in enumerate((gate, up)):
            out.append((f"{stack}.{i}.{name}", {c: h[j] for c, h in halves.items()}, i_dim, k))
    return out
