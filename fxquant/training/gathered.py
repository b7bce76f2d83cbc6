"""The weight FSDP2 hands a linear after the FP8 all-gather: the gathered e4m3 values and their
per-tensor scale, kept as they arrived.

Where it sits: ``fxquant.training.fsdp.Float8AllGatherWeight.fsdp_post_all_gather`` builds one
per layer and step (FSDP's unsharded parameter); the FP8 training linear
(``fxquant.training.numerics``) reads its ``fp8_data`` and ``fp8_scale`` straight into
``torch._scaled_mm`` for fprop and dgrad, where a plain weight is cast first. Every other op
(a linear outside an FP8 region, an eval forward, a state-dict read) sees the dequantized weight
``fp8_data · fp8_scale`` in the parameter's dtype, so the subclass is invisible but for speed.

Why: without it the gathered bytes are dequantized into a high-precision unsharded weight (4 or
2 bytes a value, held from forward to backward) and cast again by the linear, which finds the
same scale and values (the second cast is lossless for per-tensor current scaling) at the cost
of a pass over the weight each way. This is what torchao's ``Float8TrainingTensor`` does for
its FP8 all-gather.
"""

from __future__ import annotations

import torch
from torch.utils._pytree import tree_map_only

__all__ = ["Float8GatheredWeight"]

aten = torch.ops.aten

# The ops that keep the values and only re-view them: FSDP2 builds its unsharded parameter with
# ``as_strided`` and ``nn.Parameter`` (a ``detach``); they return a gathered weight again.
_VIEWS = {
    aten.detach.default,
    aten.alias.default,
    aten.as_strided.default,
    aten.view.default,
}


class Float8GatheredWeight(torch.Tensor):
    """``fp8_data`` (float8_e4m3fn, the weight's shape) times ``fp8_scale`` (fp32, one element),
    standing for a weight of ``dtype``."""

    fp8_data: torch.Tensor
    fp8_scale: torch.Tensor

    # ops go straight to __torch_dispatch__ (no Python-level torch function overrides)
    __torch_function__ = torch._C._disabled_torch_function_impl

    @staticmethod
    def __new__(cls, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        return torch.Tensor._make_wrapper_subclass(
            cls,
            data.size(),
            strides=data.stride(),
            storage_offset=data.storage_offset(),
            dtype=dtype,
            layout=data.layout,
            device=data.device,
            requires_grad=False,
        )

    def __init__(self, data: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype):
        if data.dtype != torch.float8_e4m3fn or scale.dtype != torch.float32 or scale.numel() != 1:
            raise ValueError(
                "Float8GatheredWeight takes float8_e4m3fn data and a one-element fp32 scale; got "
                f"{data.dtype} data, {scale.dtype} scale of shape {tuple(scale.shape)}"
            )
        self.fp8_data = data
        self.fp8_scale = scale

    def __repr__(self) -> str:
        # no values: the inner tensors may be fakes (Dynamo, AOTAutograd)
        return f"Float8GatheredWeight(shape={tuple(self.shape)}, dtype={self.dtype})"

    def __tensor_flatten__(self):
        return ["fp8_data", "fp8_scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return Float8GatheredWeight(inner["fp8_data"], inner["fp8_scale"], dtype)

    def dequantize(self) -> torch.Tensor:
        """The weight it stands for, as a plain tensor of its dtype."""
        return (self.fp8_data.float() * self.fp8_scale.reshape(())).to(self.dtype)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _VIEWS:
            weight, *rest = args
            return cls(func(weight.fp8_data, *rest, **kwargs), weight.fp8_scale, weight.dtype)
        args, kwargs = tree_map_only(cls, cls.dequantize, (args, kwargs))
        return func(*args, **kwargs)
