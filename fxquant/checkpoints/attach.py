"""``load_quantized``: a ``LoadedCheckpoint`` attached to a float skeleton of the model, through
``fxquant.quantize(..., weights=)``.

Where it sits: the top of ``fxquant.checkpoints``, beside ``fxquant.quantize``, which it calls.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.export import ExportedProgram

from fxquant.checkpoints.base import CheckpointError, LoadedCheckpoint
from fxquant.checkpoints.experts import stack_expert_linears
from fxquant.checkpoints.read import read_quantized
from fxquant.core.config import QuantConfig
from fxquant.passes.rewrite import copy_call_graph


def load_quantized(
    model: torch.nn.Module | ExportedProgram,
    checkpoint: str | os.PathLike | Mapping[str, torch.Tensor] | LoadedCheckpoint,
    *,
    example_inputs: tuple | None = None,
    example_kwargs: dict[str, Any] | None = None,
    dynamic_shapes: Any = None,
    quantization_config: Mapping[str, Any] | None = None,
    tensor_names: Callable[[str], str | None] | None = None,
    strict: bool = True,
    fuse_norms: bool = True,
) -> ExportedProgram:
    """A quantized program computing with a pre-quantized checkpoint's own weights.

    Args:
        model: the float skeleton (``nn.Module``, exported here, or an ``ExportedProgram``). Its
            values do not matter (build it from the config with any weights): quantized layers
            take the checkpoint's constants, every other parameter and buffer its tensors. The
            model itself is not changed.
        checkpoint: what ``read_quantized`` takes, or its result.
        example_inputs, example_kwargs, dynamic_shapes: for ``torch.export`` of ``model``.
        quantization_config, tensor_names: passed to ``read_quantized``.
        strict: a checkpoint tensor the model has no place for raises (``False``: ignored).
            A model tensor the checkpoint lacks always raises.
        fuse_norms: as ``QuantConfig.fuse_norms``.

    Returns:
        The ``ExportedProgram`` ``fxquant.quantize`` makes, with the checkpoint's constants;
        ``fxquant.report`` marks each loaded layer ``weights: given``.
    """
    from fxquant.api import quantize

    if isinstance(checkpoint, LoadedCheckpoint):
        ckpt = checkpoint
    else:
        ckpt = read_quantized(
            checkpoint, quantization_config=quantization_config, tensor_names=tensor_names
        )
    if isinstance(model, ExportedProgram):
        if example_inputs is not None or dynamic_shapes is not None:
            raise ValueError("example_inputs/dynamic_shapes are only used to export an nn.Module")
        ep = model
    elif isinstance(model, torch.nn.Module):
        if not isinstance(example_inputs, tuple):
            raise ValueError(
                "load_quantized(model, ...) of an nn.Module needs example_inputs=(...) (a tuple) "
                "to export it, or pass an ExportedProgram"
            )
        ep = torch.export.export(
            model, example_inputs, kwargs=example_kwargs, dynamic_shapes=dynamic_shapes
        )
    else:
        raise ValueError(
            f"load_quantized() takes an nn.Module or an ExportedProgram, got {type(model).__name__}"
        )
    # a checkpoint's per-expert linears, where the model stacks its experts
    ckpt = stack_expert_linears(ckpt, ep.state_dict.keys())
    ep = _with_tensors(ep, ckpt, strict=strict)
    config = ckpt.config
    if not fuse_norms:
        config = QuantConfig(
            scheme=None, overrides=config.overrides, modules_to_not_convert=(), fuse_norms=False
        )
    return quantize(ep, config, weights=ckpt.weights)


def _with_tensors(ep: ExportedProgram, ckpt: LoadedCheckpoint, *, strict: bool) -> ExportedProgram:
    """A new program whose non-quantized parameters and buffers are the checkpoint's."""
    state = dict(ep.state_dict)
    aliases: dict[int, list[str]] = {}
    for name, t in state.items():
        aliases.setdefault(id(t), []).append(name)
    groups = list(aliases.values())  # tied weights: one tensor under several names

    for name, shape in ckpt.shapes.items():
        if name not in state:
            raise CheckpointError(
                f"the checkpoint quantizes {name!r}, but the model has no such weight"
            )
        if tuple(state[name].shape) != shape:
            raise CheckpointError(
                f"the checkpoint's {name!r} is {list(shape)} (as the model stores it), the "
                f"model's is {list(state[name].shape)}"
            )
    missing, used = [], set()
    for names in groups:
        if any(n in ckpt.weights for n in names):
            continue
        given = [n for n in names if n in ckpt.tensors]
        if not given:
            missing.append(names[0])
            continue
        value = ckpt.tensors[given[0]]
        for other in given[1:]:
            if not torch.equal(ckpt.tensors[other], value):
                raise CheckpointError(
                    f"the model ties {names} but the checkpoint's {given[0]!r} and {other!r} differ"
                )
        old = state[names[0]]
        if tuple(value.shape) != tuple(old.shape):
            raise CheckpointError(
                f"tensor {given[0]!r} has shape {list(value.shape)}, the model expects "
                f"{list(old.shape)}"
            )
        new = value.detach().to(old.dtype).clone()
        if isinstance(old, torch.nn.Parameter):
            new = torch.nn.Parameter(new, requires_grad=old.requires_grad)
        for n in names:
            state[n] = new
        used.update(given)
    if missing:
        raise CheckpointError(
            f"the checkpoint has no tensor for {len(missing)} of the model's parameters/buffers "
            f"(the skeleton's values would be used silently): {', '.join(missing[:8])}"
        )
    unexpected = sorted(set(ckpt.tensors) - used)
    if unexpected and strict:
        raise CheckpointError(
            f"the checkpoint has {len(unexpected)} tensor(s) the model has no place for: "
            f"{', '.join(unexpected[:8])} (strict=False ignores them)"
        )
    return ExportedProgram(
        root=ep.graph_module,
        graph=ep.graph,
        graph_signature=ep.graph_signature,
        state_dict=state,
        range_constraints=copy.copy(ep.range_constraints),
        module_call_graph=copy_call_graph(ep.module_call_graph),
        example_inputs=ep.example_inputs,
        constants=ep.constants,
        verifiers=ep.verifiers,
    )
