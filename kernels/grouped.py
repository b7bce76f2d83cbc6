"""What every grouped (mixture-of-experts) GEMM kernel shares: the program's rows and columns
(``expert_tile``), the operand checks, and the launch (``launch_grouped``).

Where it sits: below the grouped kernels of this package (``mxfp4_grouped``,
``int8_weight_only_grouped``, ``int4_weight_only_grouped``, ``int8_dynamic_grouped`` with the
fp8 per-row kernel it also is, ``float8_block_grouped``), which the CUDA lowering maps the
experts' ops onto. The rows of x are sorted by expert and ``offs`` [E] holds each expert's
cumulative row end, so expert e owns rows ``[offs[e-1], offs[e])`` (``offs[-1]`` taken as 0).
The grid is (E, cdiv(S, BLOCK_M), cdiv(N, BLOCK_N)): program (e, mb, nb) takes the rows
``offs[e-1] + mb * BLOCK_M`` onwards, clipped to the expert's end, and returns at once when it
has none. The offsets stay on the device (no host sync, so the ops trace and export with a
dynamic S), at the price of programs that only exit: E · cdiv(S, BLOCK_M) row tiles where
about cdiv(S, BLOCK_M) + E do work. Rows at or past ``offs[-1]`` belong to no expert; the output
is allocated zeroed so they read 0, as in the references.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import wrap_triton


@triton.jit
def expert_tile(offs_ptr, S, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile: (expert e = program_id(0), its first row, the expert's row end, the
    tile's rows and columns and their masks). Expert e owns rows ``[offs[e-1], offs[e])``
    (``offs[-1]`` as 0) and tile program_id(1) of them starts BLOCK_M · program_id(1) rows in;
    an end past S is clipped to S, so no row past S is read; columns are tile program_id(2) of
    N. A program whose first row is at or past the end has no work. Every grouped kernel's
    prologue."""
    e = tl.program_id(0)
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
    end = tl.minimum(tl.load(offs_ptr + e).to(tl.int64), S)
    row0 = start + tl.program_id(1) * BLOCK_M
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    return e, row0, end, offs_m, offs_n, offs_m < end, offs_n < N


def check_offsets(what: str, x: Tensor, weight: Tensor, scale: Tensor, offs: Tensor) -> None:
    """Every grouped kernel's checks: ``offs`` int32/int64 [E] for the weight's E experts,
    and every operand on one device."""
    e = weight.shape[0]
    if offs.dtype not in (torch.int32, torch.int64) or tuple(offs.shape) != (e,):
        raise ValueError(
            f"{what}: offs must be int32/int64 [E] = [{e}]; got {offs.dtype} {tuple(offs.shape)}"
        )
    devices = {t.device for t in (x, weight, scale, offs)}
    if len(devices) != 1:
        raise ValueError(f"{what}: x, weight, scale and offs must share a device; got {devices}")


_OUT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_quantized_operands(
    what: str, dtype, xq: Tensor, xs: Tensor, xs_shape: str, weight: Tensor, out_dtype, kb
) -> tuple[int, int, int]:
    """The grouped kernels' checks of a quantized activation (W8A8's, fp8's): xq ``dtype``
    [S, K], W ``dtype`` [E, N, K], xs fp32 [S, kb(N, K)] on xq's device (``xs_shape`` names that
    shape), the output dtype. ValueError naming the value and what is allowed; → (E, N, K)."""
    name = str(dtype).removeprefix("torch.")
    if xq.dim() != 2 or xq.dtype != dtype:
        raise ValueError(f"{what}: xq must be 2-D [S, K] {name}; got {xq.dtype} {tuple(xq.shape)}")
    if weight.dtype != dtype or weight.dim() != 3:
        raise ValueError(
            f"{what}: weight must be {name} [E, N, K]; got {weight.dtype} {tuple(weight.shape)}"
        )
    e, n, k = weight.shape
    s = xq.shape[0]
    if xq.shape[1] != k:
        raise ValueError(f"{what}: xq has K={xq.shape[1]} features, the weight [E, N, K] K={k}")
    want = [s, kb(n, k)]
    if xs.dtype != torch.float32 or list(xs.shape) != want or xs.device != xq.device:
        raise ValueError(
            f"{what}: xs must be fp32 {xs_shape} = {want} on xq's device ({xq.device}); "
            f"got {xs.dtype} {tuple(xs.shape)} on {xs.device}"
        )
    if out_dtype not in _OUT_DTYPES:
        raise ValueError(f"{what}: out_dtype is {out_dtype}; allowed: float32, bfloat16, float16")
    return e, n, k


def check_row_scaled(what, dtype, xq, xs, weight, scale, offs, out_dtype) -> None:
    """``check_quantized_operands`` for one activation scale a row ([S, 1]) and one weight scale
    a channel ([E, N]), then the offsets."""
    e, n, _ = check_quantized_operands(what, dtype, xq, xs, "[S, 1]", weight, out_dtype,
                                       lambda n, k: 1)  # fmt: skip
    if scale.dtype != torch.float32 or tuple(scale.shape) != (e, n):
        raise ValueError(
            f"{what}: scale must be fp32 [E, N] = {[e, n]}; got {scale.dtype} {tuple(scale.shape)}"
        )
    check_offsets(what, xq, weight, scale, offs)


def launch_grouped(kernel, operands: tuple, weight: Tensor, out_dtype, *scalars, **meta) -> Tensor:
    """Launch a grouped kernel whose arguments are ``operands`` (its tensors in order, x [S, K]
    first, ``offs`` last; made contiguous), the output, S, N, K, then ``scalars`` and the
    constexprs ``meta`` (BLOCK_M and BLOCK_N among them) on the grid (E, cdiv(S, BLOCK_M),
    cdiv(N, BLOCK_N)), E and N read from ``weight`` [E, N, ...] → the output [S, N] in
    ``out_dtype``, allocated zeroed (rows no program writes, past ``offs[-1]``, stay 0)."""
    operands = tuple(t.contiguous() for t in operands)
    s, k = operands[0].shape
    e, n = weight.shape[0], weight.shape[1]
    out = torch.zeros((s, n), dtype=out_dtype, device=operands[0].device)
    grid = (e, triton.cdiv(s, meta["BLOCK_M"]), triton.cdiv(n, meta["BLOCK_N"]))
    wrap_triton(kernel)[grid](*operands, out, s, n, k, *scalars, **meta)
    return out
