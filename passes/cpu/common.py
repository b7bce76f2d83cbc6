"""What the CPU lowering's family modules share: the device key of the native kernels and the
epilogues that put a GEMM's fp32 rows back into the caller's shape and dtype.

Where it sits: below every family module of ``fxquant.passes.cpu`` (``fxquant.passes.lower``
reads their lowerings from ``fxquant.core.registry``).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from fxquant.core.registry import lowering

__all__ = ["BF16", "NATIVE", "device_op", "epilogue", "finish", "row_scales", "rows"]

# The device key of the compositions around fxquant's native kernels (``fxquant.kernels.cpu``):
# registered as ``@lowering(NATIVE, op)`` and ``@prepack_rule(NATIVE, op)``, they override
# ``"cpu"``'s where the kernels are available (``fxquant.passes.lower.lowerings``).
NATIVE = "cpu-native"

BF16 = torch.bfloat16


def device_op(device: str, *names: str, schema: str, fake: Callable) -> Callable:
    """Make the decorated composition the ``device`` lowering of each ``fxquant::<name>``, a
    device op that a prepack rule emits on its new constants, and define those ops with it as
    their eager kernel and ``fake`` as their fake kernel (one schema: the ops of one kernel
    family take the same arguments)."""

    def wrap(fn: Callable) -> Callable:
        for name in names:
            op = torch.library.custom_op(f"fxquant::{name}", fn, mutates_args=(), schema=schema)
            op.register_fake(fake)
        return lowering(device, *names)(fn)

    return wrap


# --------------------------------------------------------------------------------------------
# aten compositions
# --------------------------------------------------------------------------------------------


def epilogue(
    y: Tensor, x: Tensor, n: int, bias: Tensor | None, dtype: torch.dtype | None = None
) -> Tensor:
    """fp32 [M, N'] → x's leading dims × N, plus bias, in ``dtype`` (default: x's)."""
    y = y[:, :n]
    if bias is not None:
        y = y + bias.float()
    return y.reshape(x.shape[:-1] + (n,)).to(x.dtype if dtype is None else dtype)


# --------------------------------------------------------------------------------------------
# Native kernels: fp32 rows in, fp32 [M, N] out
# --------------------------------------------------------------------------------------------


def row_scales(scale: Tensor, n: int) -> Tensor:
    """The kernels take one weight scale per output row: per-tensor scales ([1]) broadcast."""
    return scale.float().reshape(-1).expand(n).contiguous()


def rows(x: Tensor) -> Tensor:
    """x [..., K] → contiguous fp32 [M, K], what the kernels read."""
    return x.reshape(-1, x.shape[-1]).float().contiguous()


def finish(y: Tensor, like: Tensor, n: int, bias: Tensor | None, dtype=None) -> Tensor:
    """The kernel's fp32 [M, N] → like's leading dims × N, plus bias, in ``dtype`` (default:
    like's)."""
    if bias is not None:
        y = y + bias.float()
    return y.reshape(like.shape[:-1] + (n,)).to(like.dtype if dtype is None else dtype)
