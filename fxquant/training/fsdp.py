"""FP8 all-gather for FSDP2 (``torch.distributed.fsdp.fully_shard``): each rank casts its weight
shard to float8_e4m3fn before FSDP all-gathers it, so the all-gather moves 1 byte per weight
element instead of 4 (fp32) or 2 (bf16).

Where it sits: between the user's model and ``fully_shard``. :func:`enable_fsdp_float8_all_gather`
wraps each eligible ``nn.Linear`` weight in :class:`Float8AllGatherWeight` *before*
``fully_shard``; FSDP2 then keeps that subclass as the local tensor of its sharded DTensor and
calls its two all-gather hooks (torch 2.13's extension contract, read in
``torch/distributed/fsdp/_fully_shard/_fsdp_param.py``):

- ``fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy)``: the shard's amax,
  all-reduced with MAX over the FSDP group so every rank uses the same per-tensor scale (that of
  the whole weight), then the shard (FSDP's ``param_dtype`` copy of it under mixed precision) cast
  to e4m3 and viewed as uint8 (FSDP's all-gather buffer is uint8 anyway once a group mixes
  dtypes, here fp8 weights and high-precision biases), with the scale as metadata;
- ``fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None)``: the gathered fp8 bytes
  and the scale as a ``Float8GatheredWeight`` (``fxquant.training.gathered``), FSDP's unsharded
  parameter; from the second all-gather on, FSDP refills its bytes in place and only the scale
  is written (``out``).

The FP8 training linear (``fxquant.training.numerics.float8_training_linear``) feeds that weight's
fp8 values and scale to ``torch._scaled_mm`` as they are, for fprop and (transposed) for dgrad:
no dequantize, no second cast, and 1 byte a weight value held from the forward to the backward
instead of the parameter dtype's 2 or 4. They are the values the linear would have cast from the
gathered weight, dequantized: with current tensorwise scaling the dequantized weight's amax is
448·scale, so a cast finds the same scale and the same e4m3 values, and training follows the
high-precision all-gather run (tests/test_float8_fsdp.py). Any other op on the weight (a linear
outside an FP8 region, eval) sees it dequantized to ``param_dtype``. Delayed scaling would take
the weight's scale from its amax history, not from this cast, so the weight would be rounded
twice (measured: losses 4% off the single process within 4 steps), and row-wise scales differ
from the per-tensor one gathered here: :func:`enable_fsdp_float8_all_gather` refuses any recipe
but current tensorwise scaling.

A weight whose dim 0 does not split evenly over the ranks keeps the high-precision all-gather
(FSDP pads such shards; the fp8 path here does not pad) and its row says so: in the rows
:func:`enable_fsdp_float8_all_gather` returns, and as ``all_gather`` / ``all_gather_reason`` in
the layer's FP8 training report row (``fxquant.backend.last_reports``).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.utils._pytree import tree_map_only

from fxquant.core.config import Float8Recipe
from fxquant.core.reference import EPS
from fxquant.training.gathered import Float8GatheredWeight
from fxquant.training.numerics import E4M3, fp8_max

# Each Linear's all-gather as enable_fsdp_float8_all_gather chose it, kept on the module
# (``{"all_gather": "fp8" | "high precision", "reason": ...}``): the FP8 training pass copies it
# into the layer's report row (fxquant.passes.float8_regions).
ALL_GATHER_ATTR = "_fxquant_all_gather"

__all__ = ["ALL_GATHER_ATTR", "Float8AllGatherWeight", "enable_fsdp_float8_all_gather"]

aten = torch.ops.aten

# The ops whose results stay wrapped: those FSDP2 uses to shard, pad, copy and detach the weight
# (the list torchao's WeightWithDynamicFloat8CastTensor keeps). Everything else (the optimizer's
# in-place updates, the reductions) runs on the plain tensor inside.
_PRESERVE = {
    aten.empty_like.default,
    aten.new_zeros.default,
    aten.slice.Tensor,
    aten.copy_.default,
    aten.view.default,
    aten.as_strided.default,
    aten._to_copy.default,
    aten._pin_memory.default,
    aten.split.Tensor,
    aten.clone.default,
    aten.detach.default,
    aten.alias.default,
}


class Float8AllGatherWeight(torch.Tensor):
    """A high-precision weight (or FSDP's shard of it) that FSDP2 all-gathers in FP8.

    Behaves as the tensor it wraps for every op; only FSDP's all-gather hooks differ.
    """

    _data: torch.Tensor

    @staticmethod
    def __new__(cls, data: torch.Tensor):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.size(),
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=data.dtype,
            layout=data.layout,
            device=data.device,
            requires_grad=data.requires_grad,
        )

    def __init__(self, data: torch.Tensor):
        self._data = data

    def __repr__(self) -> str:
        return f"Float8AllGatherWeight({self._data!r})"

    def __tensor_flatten__(self):
        return ["_data"], None

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return Float8AllGatherWeight(inner["_data"])

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        unwrap = tree_map_only(cls, lambda t: t._data, (args, kwargs or {}))
        out = func(*unwrap[0], **unwrap[1])
        if func not in _PRESERVE:
            return out
        return tree_map_only(torch.Tensor, cls, out)

    # ---- FSDP2 all-gather extension -------------------------------------------------------

    def fsdp_pre_all_gather(self, mesh, outer_size, outer_stride, module, mp_policy):
        data = self._data
        if mp_policy is not None and mp_policy.param_dtype is not None:
            # the values the linear would have cast without this hook: FSDP's mixed-precision
            # copy of the weight
            data = data.to(mp_policy.param_dtype)
        # one scale for the whole weight: the MAX of the shards' amaxes, as a single process
        # would compute it from the unsharded weight
        amax = data.detach().abs().amax().float().reshape(1)
        dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=mesh.get_group())
        scale = amax.clamp(min=EPS) / fp8_max(E4M3)  # dequantize multiplier, as cast_current
        q = (data.detach().float() / scale).clamp(-fp8_max(E4M3), fp8_max(E4M3)).to(E4M3)
        return (q.view(torch.uint8),), (scale,)

    def fsdp_post_all_gather(
        self,
        all_gather_outputs: tuple[torch.Tensor, ...],
        metadata: Any,
        param_dtype: torch.dtype,
        *,
        out: torch.Tensor | None = None,
    ):
        (data,) = all_gather_outputs
        (scale,) = metadata
        if out is not None:
            # FSDP's unsharded parameter from the first all-gather: its fp8 data is a view of
            # the all-gather buffer FSDP just refilled; only the scale is new. The backward's
            # re-all-gather writes it while autograd holds it saved for dgrad: keep its version,
            # as FSDP's own all-gather (a collective into the storage) does, or the backward
            # fails with "modified by an inplace operation".
            with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(out.fp8_scale):
                out.fp8_scale.copy_(scale)
            return None
        # The gathered bytes stay fp8 (1 byte a value until FSDP frees them after the forward),
        # read by the FP8 linear as they are; any other op sees them dequantized
        # (fxquant.training.gathered).
        return Float8GatheredWeight(data.view(E4M3), scale, param_dtype), (data,)


def _fallback_reason(module: nn.Linear, world_size: int) -> str | None:
    out_features = module.weight.shape[0]
    if out_features % world_size:
        return (
            f"dim 0 ({out_features}) does not shard evenly over {world_size} ranks; "
            "high-precision all-gather"
        )
    return None


def _check_recipe(recipe: Float8Recipe) -> None:
    # The gathered fp8 weight is what the linear would cast only when it computes the scale
    # from the weight itself, per tensor, with no margin, and when the forward and dgrad GEMMs
    # read the weight in fp8 at all.
    problems = []
    if recipe.scaling != "current":
        problems.append(f"scaling={recipe.scaling!r} (needs 'current')")
    if recipe.granularity != "tensor":
        problems.append(f"granularity={recipe.granularity!r} (needs 'tensor')")
    if recipe.margin:
        problems.append(f"margin={recipe.margin} (needs 0)")
    if any(recipe.override_linear_precision[:2]):
        problems.append("override_linear_precision keeps the fprop or dgrad GEMM high-precision")
    if problems:
        raise ValueError(
            "the FP8 all-gather (fxquant.training.fsdp) supports current tensorwise scaling "
            f"only; this recipe has {', '.join(problems)}"
        )


def enable_fsdp_float8_all_gather(
    model: nn.Module, *, recipe: Float8Recipe, world_size: int, module_filter=None
) -> list[dict]:
    """Wrap the weight of every ``nn.Linear`` in ``model`` (those ``module_filter(module, fqn)``
    accepts, when given) in :class:`Float8AllGatherWeight`, in place. Call before
    ``fully_shard``.

    Args:
        model: the model, not sharded yet.
        recipe: the ``Float8Recipe`` the model trains with (current tensorwise scaling only).
        world_size: the FSDP shard group's size (decides which weights shard evenly).
        module_filter: optional ``(module, fqn) -> bool``, as in ``QuantConfig``.

    Returns:
        One row per Linear: ``{"name", "all_gather": "fp8" | "high precision", "reason"}``.
    """
    _check_recipe(recipe)
    rows = []
    for fqn, module in model.named_modules():
        if not isinstance(module, nn.Linear):
            continue
        if module_filter is not None and not module_filter(module, fqn):
            reason = "filtered out"
        else:
            reason = _fallback_reason(module, world_size)
        if reason is None:
            w = module.weight
            module.weight = nn.Parameter(
                Float8AllGatherWeight(w.data), requires_grad=w.requires_grad
            )
        tag = {"all_gather": "fp8" if reason is None else "high precision", "reason": reason or ""}
        # the FP8 training rows (fxquant.backend.last_reports) read it from the module
        setattr(module, ALL_GATHER_ATTR, tag)
        rows.append({"name": fqn, **tag})
    return rows
