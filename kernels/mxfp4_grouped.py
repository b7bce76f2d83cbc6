"""MXFP4 grouped GEMM (mixture-of-experts, gpt-oss' experts): row s of x [S, K] times its
expert's packed e2m1 W [E, N, K/2] with E8M0 scales per 1×32 [E, N, K/32] → [S, N].

Where it sits: the CUDA lowering at the end of this file (collected by
``fxquant.passes.lower_cuda``) maps ``fxquant::mxfp4_grouped_mm`` (the op the rewrite puts where
an exported MoE layer had its grouped_mm) onto ``fxquant::triton_mxfp4_grouped_mm`` below. The
oracle is ``fxquant.core.reference_mx.mxfp4_grouped_mm``.

Rows, programs and launch as every grouped kernel's (``kernels.grouped``).

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
from torch.library import triton_op

from fxquant.core.registry import lowering
from fxquant.kernels.gemm import store_tile
from fxquant.kernels.grouped import check_offsets, expert_tile, launch_grouped
from fxquant.kernels.mxfp4 import dot_fp4, e8m0_to_f32

_MX_BLOCK = 32  # K values per E8M0 scale


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


@triton_op("fxquant::triton_mxfp4_grouped_mm", mutates_args=())
def triton_mxfp4_grouped_mm(x: Tensor, weight: Tensor, scale: Tensor, offs: Tensor) -> Tensor:
    """x [S, K] float (rows sorted by expert) · its expert's packed e2m1 W [E, N, K/2] with
    E8M0 (uint8) scales [E, N, K/32], experts from cumulative row ends ``offs`` [E] (int32 or
    int64, non-decreasing: not checked, that would need a host sync) → [S, N] in x's dtype,
    zeros for rows at or past ``offs[-1]``."""
    _check(x, weight, scale, offs)
    return launch_grouped(
        _fp4_grouped_kernel, (x, weight, scale, offs), weight, x.dtype,
        X_BF16=x.dtype == torch.bfloat16, BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=_BLOCK_K,
    )  # fmt: skip


@lowering("cuda", "mxfp4_grouped_mm")
def lower_mxfp4_grouped_mm(x, weight, scale, offs):
    # the kernel takes the op as it is (x [S, K] sorted by expert) and returns x's dtype
    return torch.ops.fxquant.triton_mxfp4_grouped_mm(x, weight, scale, offs)
