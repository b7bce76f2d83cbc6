"""Lowering: replace each ``fxquant::`` op by its implementation for the target device.

Last pass of the data flow, run only before Inductor or AOTInductor (a saved ``.pt2`` keeps the
semantic ops). Each lowering is a plain-torch function over aten ops that Inductor compiles
natively; ``ExportedProgram.run_decompositions`` (export path) or the ``decompositions`` of
``compile_fx`` (backend path) traces it in place of the op. Nothing Python-only survives, so an
AOTInductor package runs in a process that never imports fxquant.

The CPU lowerings compute exactly the reference math of ``fxquant.reference`` (the tests compare
them). Why each one is written the way it is, measured on the dev CPU (AVX2, 2 cores), is in
the comment above it; ``benchmarks/cpu_kernels.py`` reruns the comparison.
"""

from __future__ import annotations

import torch
from torch.export import ExportedProgram

import fxquant.ops  # noqa: F401  (registers the fxquant:: ops)
from fxquant import reference as ref

fxq = torch.ops.fxquant


def _finish(y, bias, dtype):
    if bias is not None:
        y = y + bias.to(y.dtype)
    return y.to(dtype)


def int8_weight_only_linear(x, weight, scale, bias):
    y = torch.nn.functional.linear(x.float(), weight.float()) * scale
    return _finish(y, bias, x.dtype)


def int4_weight_only_linear(x, weight, scale, zero, bias, group_size):
    w = ref.dequantize_int4_grouped(weight, scale, zero, group_size=group_size)
    y = torch.nn.functional.linear(x.float(), w[:, : x.shape[-1]])
    return _finish(y, bias, x.dtype)


def int8_dynamic_linear(x, weight, scale, bias):
    xq, xs = ref.quantize_int8_per_token(x)
    # int8 × int8 sums are exact in fp32 up to K·127² < 2²⁴ (K ≤ 1040) and within fp32 rounding
    # beyond: the same accumulation precision the reference uses.
    y = torch.nn.functional.linear(xq.float(), weight.float()) * xs * scale
    return _finish(y, bias, x.dtype)


def float8_weight_only_linear(x, weight, scale, bias):
    y = torch.nn.functional.linear(x.float(), weight.float()) * scale
    return _finish(y, bias, x.dtype)


def float8_dynamic_linear(x, weight, scale, bias, per_row, activation_scale_ub):
    if per_row:
        xq, xs = ref.quantize_fp8_per_token(x, scale_ub=activation_scale_ub)
    else:
        xq, xs = ref.quantize_fp8_per_tensor(x, scale_ub=activation_scale_ub)
    y = torch.nn.functional.linear(xq.float(), weight.float()) * xs * scale
    return _finish(y, bias, x.dtype)


def float8_block_linear(x, weight, scale, bias, block_size):
    return ref.float8_block_linear(x, weight, scale, bias, block_size=block_size)


CPU_LOWERINGS = {
    fxq.int8_weight_only_linear.default: int8_weight_only_linear,
    fxq.int4_weight_only_linear.default: int4_weight_only_linear,
    fxq.int8_dynamic_linear.default: int8_dynamic_linear,
    fxq.float8_weight_only_linear.default: float8_weight_only_linear,
    fxq.float8_dynamic_linear.default: float8_dynamic_linear,
    fxq.float8_block_linear.default: float8_block_linear,
}


def lowerings(device: str | torch.device = "cpu") -> dict:
    """The op → implementation table for a device type."""
    device_type = device.type if isinstance(device, torch.device) else str(device).split(":")[0]
    if device_type == "cpu":
        return dict(CPU_LOWERINGS)
    if device_type == "cuda":
        # The Triton kernels arrive with the kernels issue; until then CUDA runs the same aten
        # compositions, which are correct on any device.
        return dict(CPU_LOWERINGS)
    raise ValueError(f"device={device!r} is not supported for lowering; allowed: 'cpu', 'cuda'")


def lower(ep: ExportedProgram, *, device: str | torch.device = "cpu") -> ExportedProgram:
    """A new program with every ``fxquant::`` op replaced by ``device``'s implementation, and the
    rest decomposed to the core aten opset Inductor and AOTInductor expect."""
    table = torch.export.default_decompositions()
    table.update(lowerings(device))
    return ep.run_decompositions(table)
