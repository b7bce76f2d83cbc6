"""The CPU lowering of the linears a config leaves in float (an LLM's tied ``lm_head`` under
``int8wo``, layers skipped for their shape, a float model packaged as it is): on a stored fp32
weight they run fxquant's native fp32 kernel (``kernels/cpu/float32.cpp``) instead of ATen's, on
a stored bf16 (fp16) weight with bf16 (fp16) x, a model loaded in its checkpoint's dtype, its
native bf16 (fp16) kernel (``kernels/cpu/bfloat16.cpp``).

Where it sits: a step of the native CPU prepack (``fxquant.passes.lower.prepack``), after the
rewrite left these nodes as ``aten.linear`` (or their torch-level spelling in a Dynamo graph).
Each becomes ``fxquant::cpu_native_<dtype>_linear`` (float32, bfloat16, float16), whose
composition here flattens x to fp32 rows, calls ``fxquant::native_<dtype>_linear`` and puts the
bias and shape back.

Why: at M = 1 a linear is a read of its weight, and MKL's sgemv does not read at the memory's
rate on every machine. On the AMD EPYC Zen 4 (2 cores) the 49152 × 576 lm_head of SmolLM2 took
9.6 ms through ATen at M = 1 (11 GB/s) and 3.1 ms in the native GEMV (37 GB/s), its 576 × 1536
and 1536 × 576 linears 1.3-1.9× faster; up to 8 rows the native kernel is 1.1-8× ATen's speed,
above it runs ATen's mm itself (one-off timings by hand, by shape, in one process). The same
fp32 products: only the order of the sums differs (tests/test_lower_float32.py bounds it).
The bf16 kernel, for the same reason: ATen's bf16 linear read SmolLM2's weights at ~12 GB/s at
M = 1 on the Zen 4; the native one 2.0-3.5x faster at M = 1, 1.7-2.9x at 4 (by shape, one-off
timings by hand; bfloat16.cpp has them by M). ATen's fp16 linear falls to ~1/10 of bf16's
speed from M = 16; the fp16 kernel runs 1.2-1.8x it at M = 1, 2-4x at 4-32 and 128. Their
numerics are the 16-bit linear's: products of the 16-bit values, fp32 sums (in another order),
one rounding to the dtype after the bias.
Only nodes whose weight is a stored, contiguous [N, K] constant of x's dtype (fp32, bf16 or
fp16) are rewritten: a ``linear``, or a matmul of its transpose (``x @ W.T``); a ``Conv1D``
weight ([K, N], ``addmm``) keeps ATen's GEMM.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch import Tensor

import fxquant.kernels.cpu as native  # noqa: F401  (defines fxquant::native_<dtype>_linear)
from fxquant.passes.cpu.common import NATIVE, device_op, finish, rows
from fxquant.passes.plan import find_sites, node_value

__all__ = ["KERNEL", "KERNELS", "lower_float32_linears"]

fxq = torch.ops.fxquant

# what the rewritten linears run, in words (reports), by M: the shim's GEMV limit
# (kGemvMaxMFloat32 in float32.cpp), then ATen's mm inside the same op
KERNEL = "fxquant native fp32 kernel up to M = 8, then ATen's fp32 GEMM (MKL)"
# bfloat16.cpp's paths (kRowsMaxMBf16, kGemvMaxMBf16)
KERNEL_BF16 = (
    "fxquant native bf16 kernel: bf16 dot products, rows up to M = 15, packed panels above "
    "(on AMX tiles where the CPU has them; without AVX-512 BF16: an fp32 GEMV up to M = 32, "
    "then MKL on the widened weight)"
)
KERNEL_FP16 = (
    "fxquant native fp16 kernel: an fp32 GEMV up to M = 32, then MKL on the widened weight"
)
# by the weight's dtype name (a report row's dtype): the one list of the dtypes lowered here
KERNELS = {"float32": KERNEL, "bfloat16": KERNEL_BF16, "float16": KERNEL_FP16}


def _fake(x, weight, bias):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))


def _define(dtype: str) -> None:
    """``fxquant::cpu_native_<dtype>_linear`` (x [..., K], weight, bias) → x's shape and dtype:
    x flattened to fp32 rows, ``fxquant::native_<dtype>_linear``, the bias and shape back."""
    kernel = getattr(fxq, f"native_{dtype}_linear")

    def composition(x: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        return finish(kernel(rows(x), weight), x, weight.shape[0], bias)

    schema = "(Tensor x, Tensor weight, Tensor? bias) -> Tensor"
    device_op(NATIVE, f"cpu_native_{dtype}_linear", schema=schema, fake=_fake)(composition)


for _dtype in KERNELS:
    _define(_dtype)


def lower_float32_linears(editor) -> int:
    """Rewrite every fp32 (bf16, fp16) ``linear`` on a stored fp32 (bf16, fp16) weight to the
    native device op of that dtype. Returns the nodes rewritten."""
    from fxquant.passes.rewrite import counters, swap_site

    ops = {getattr(torch, d): getattr(fxq, f"cpu_native_{d}_linear").default for d in KERNELS}
    done = 0
    for site in find_sites(editor.graph, editor.weight_of):
        weight = site.weight
        if site.transposed or site.experts is not None or not _eligible(site.x, weight, ops):
            continue
        op = ops[weight.dtype]
        swap_site(editor, site, op, (site.x, site.weight_source, site.bias))
        counters[f"prepack.{op._opname}"] += 1
        done += 1
    return done


def _eligible(x: fx.Node, weight: Tensor, dtypes) -> bool:
    val = node_value(x)
    return (
        isinstance(val, Tensor)
        and val.dtype == weight.dtype
        and weight.dtype in dtypes
        and weight.dim() == 2
        and weight.is_contiguous()
        and weight.device.type == "cpu"
    )
