"""MXFP4 grouped GEMM (mixture-of-experts, gpt-oss' experts): row s of x [S, K] times its
expert's packed e2m1 W [E, N, K/2] with E8M0 scales per 1×32 [E, N, K/32] → [S, N].

Where it sits: the CUDA lowering at the end of this file (collected by
``fxquant.passes.lower_cuda``) maps ``fxquant::mxfp4_grouped_mm`` (the op the rewrite puts where
an exported MoE layer had its grouped_mm) onto ``fxquant::triton_mxfp4_grouped_mm`` below. The
oracle is ``fxquant.core.reference_mx.mxfp4_grouped_mm``.

The rows of x are sorted by expert and ``offs`` [E] holds each expert's cumulative row end, so
expert e owns rows ``[offs[e-1], offs[e])`` (``offs[-1]`` taken as 0). The grid is
(E, cdiv(S, BLOCK_M), cdiv(N, BLOCK_N)): program (e, mb, nb) takes the rows
``offs[e-1] + mb * BLOCK_M`` onwards, clipped to the expert's end, and returns at once when it
has none. The offsets stay on the device (no host sync, so the op traces and exports with a
dynamic S), at the price of programs that only exit: E · cdiv(S, BLOCK_M) row tiles where
about cdiv(S, BLOCK_M) + E do work. Rows at or past ``offs[-1]`` belong to no expert; the output
is allocated zeroed so they read 0, as in the reference.

The weight decode and the fp32 arithmetic are those of ``kernels.mxfp4`` (its ``e2m1_to_f32`` /
``e8m0_to_f32``, ``dot_fp4``): each K step splits into the even columns of x against the low
nibbles and the odd columns against the high ones, two dots summed in fp32 (on the bf16 tensor
cores for bf16 x, exactly; IEEE fp32 otherwise), rounded once to x's dtype at the store. On the
H200 (2026-12-04) the IEEE fp32 dots ran gpt-oss' experts at 0.03-0.09x bf16 grouped_mm.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from fxquant.core.registry import lowering
from fxquant.kernels.gemm import store_tile
from fxquant.kernels.mxfp4 import dot_fp4, e8m0_to_f32

_MX_BLOCK = 32  # K values per E8M0 scale


@triton.jit
def expert_tile(offs_ptr, S, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """This program's tile: (expert e = program_id(0), its first row, the expert's row end, the
    tile's rows and columns and their masks). Expert e owns rows ``[offs[e-1], offs[e])``
    (``offs[-1]`` as 0) and tile program_id(1) of them starts BLOCK_M · program_id(1) rows in;
    an end past S is clipped to S, so no row past S is read; columns are tile program_id(2) of
    N. A program whose first row is at or past the end has no work. The grouped kernels'
    (MXFP4's here, int8's, int4's) shared prologue."""
    e = tl.program_id(0)
    start = tl.load(offs_ptr + e - 1, mask=e > 0, other=0).to(tl.int64)
    end = tl.minimum(tl.load(offs_ptr + e).to(tl.int64), S)
    row0 = start + tl.program_id(1) * BLOCK_M
    offs_m = row0 + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(2) * BLOCK_N + tl.arange(0, BLOCK_N)
    return e, row0, end, offs_m, offs_n, offs_m < end, offs_n < N


# One fixed tile, not autotuned (kernels.configs' lists are for the dense GEMMs): BLOCK_M = 32
# suits the few rows an expert gets per step (decode: about one; prefill: S·top_k/E), and
# BLOCK_K = 64 (32 bytes a weight row, two 32-deep dots) divides gpt-oss' K = 2880. Not yet
# measured on a GPU.
_BLOCK_M, _BLOCK_N, _BLOCK_K = 32, 64, 64
_X_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


@triton.jit
def _fp4_grouped_kernel(
    x_ptr,  # [S, K] float: rows sorted by expert
    w_ptr,  # [E, N, K/2] uint8: two e2m1 codes a byte, the even column in the low nibble
    s_ptr,  # [E, N, K/32] uint8: E8M0 exponents
    offs_ptr,  # [E] int32/int64: cumulative row end of each expert
    out_ptr,  # [S, N] x's dtype, zeroed: rows no program writes stay 0
    S,
    N,
    K,
    X_BF16: tl.constexpr,  # x is bf16: the dots on the bf16 tensor cores (mxfp4.dot_fp4)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # ---- rows of this program: its expert's slice of x, from offs ----------------------------
    e, row0, end, offs_m, offs_n, mask_m, mask_n = expert_tile(offs_ptr, S, N, BLOCK_M, BLOCK_N)
    if row0 >= end:
        return
    kh = K // 2
    ks = K // 32
    x_rows = x_ptr + offs_m[:, None] * K  # [BLOCK_M, 1]
    w_cols = w_ptr + (e.to(tl.int64) * N + offs_n[None, :]) * kh  # [1, BLOCK_N]: as [K/2, N]
    s_cols = s_ptr + (e.to(tl.int64) * N + offs_n[None, :]) * ks  # [1, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # ---- per K step: decode BLOCK_K/2 bytes a weight row, scale, two fp32 dots ---------------
    for k0 in range(0, K, BLOCK_K):
        j = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte columns of this step
        mask_j = j < kh  # K is a multiple of 32, not of BLOCK_K: the last step may be half
        mask_w = mask_j[:, None] & mask_n[None, :]
        byte = tl.load(w_cols + j[:, None], mask=mask_w, other=0).to(tl.int32)
        # both nibbles of byte j are columns 2j, 2j+1: the same 32-wide block, j // 16
        sc = tl.load(s_cols + (j // 16)[:, None], mask=mask_w, other=127).to(tl.int32)
        scale = e8m0_to_f32(sc)  # [BLOCK_K/2, BLOCK_N]; masked lanes decode code 0 → 0
        acc = dot_fp4(acc, x_rows, j, mask_m, mask_j, byte, scale, X_BF16)
    # ---- epilogue: one rounding to x's dtype (rows up to the expert's end) -------------------
    store_tile(out_ptr, acc, out_ptr, offs_m, offs_n, end, N, 0, False, 1)


def _check(x: Tensor, weight: Tensor, scale: Tensor, offs: Tensor) -> None:
    """ValueError naming the value and what is allowed, for each layout the kernel cannot read."""
    what = "mxfp4 grouped mm"
    if x.dim() != 2 or x.dtype not in _X_DTYPES:
        raise ValueError(
            f"{what}: x must be 2-D [S, K] float32/bfloat16/float16; got {x.dtype} {tuple(x.shape)}"
        )
    if weight.dtype != torch.uint8 or weight.dim() != 3:
        raise ValueError(
            f"{what}: weight must be packed uint8 [E, N, K/2]; "
            f"got {weight.dtype} {tuple(weight.shape)}"
        )
    if scale.dtype != torch.uint8:
        raise ValueError(f"{what}: scale must be uint8 E8M0 exponents; got {scale.dtype}")
    k = x.shape[1]
    if k % _MX_BLOCK:
        raise ValueError(f"{what}: K={k} (x's last dim) must be a multiple of {_MX_BLOCK}")
    e, n = weight.shape[0], weight.shape[1]
    if weight.shape[2] * 2 != k:
        raise ValueError(
            f"{what}: weight shape {tuple(weight.shape)} does not pack K={k}; "
            f"allowed: [E, N, {k // 2}]"
        )
    if tuple(scale.shape) != (e, n, k // _MX_BLOCK):
        raise ValueError(
            f"{what}: scale shape {tuple(scale.shape)}; allowed: {(e, n, k // _MX_BLOCK)} "
            f"([E, N, K/{_MX_BLOCK}])"
        )
    check_offsets(what, x, weight, scale, offs)


def check_offsets(what: str, x: Tensor, weight: Tensor, scale: Tensor, offs: Tensor) -> None:
    """The grouped kernels' (MXFP4's here, int8's) shared checks: ``offs`` int32/int64 [E] for
    the weight's E experts, and every operand on one device."""
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


@triton_op("fxquant::triton_mxfp4_grouped_mm", mutates_args=())
def triton_mxfp4_grouped_mm(x: Tensor, weight: Tensor, scale: Tensor, offs: Tensor) -> Tensor:
    """x [S, K] float (rows sorted by expert) · its expert's packed e2m1 W [E, N, K/2] with
    E8M0 (uint8) scales [E, N, K/32], experts from cumulative row ends ``offs`` [E] (int32 or
    int64, non-decreasing: not checked, that would need a host sync) → [S, N] in x's dtype,
    zeros for rows at or past ``offs[-1]``."""
    _check(x, weight, scale, offs)
    x, weight, scale = x.contiguous(), weight.contiguous(), scale.contiguous()
    offs = offs.contiguous()
    s, k = x.shape
    e, n = weight.shape[0], weight.shape[1]
    out = torch.zeros((s, n), dtype=x.dtype, device=x.device)
    grid = (e, triton.cdiv(s, _BLOCK_M), triton.cdiv(n, _BLOCK_N))
    wrap_triton(_fp4_grouped_kernel)[grid](
        x,
        weight,
        scale,
        offs,
        out,
        s,
        n,
        k,
        X_BF16=x.dtype == torch.bfloat16,
        BLOCK_M=_BLOCK_M,
        BLOCK_N=_BLOCK_N,
        BLOCK_K=_BLOCK_K,
    )
    return out


@lowering("cuda", "mxfp4_grouped_mm")
def lower_mxfp4_grouped_mm(x, weight, scale, offs):
    # the kernel takes the op as it is (x [S, K] sorted by expert) and returns x's dtype
    return torch.ops.fxquant.triton_mxfp4_grouped_mm(x, weight, scale, offs)
