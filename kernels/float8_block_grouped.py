"""fp8 e4m3 grouped GEMM with DeepSeek-V3-style block scales (mixture-of-experts, ``fp8-block``:
FineGrainedFP8Config's experts): row s of the e4m3 activation xq [S, K] with 1×b group scales
xs [S, ceil(K/b)] times its expert's e4m3 W [E, N, K] with b×b tile scales
[E, ceil(N/b), ceil(K/b)] → [S, N].

Where it sits: the CUDA lowering at the end of this file (collected by
``fxquant.passes.lower_cuda``) maps ``fxquant::float8_block_grouped_mm`` (the op the rewrite puts
where an exported MoE layer had its grouped_mm, under ``fp8-block``) onto the 1×b group quantizer
of ``kernels.quantize`` (``fxquant::triton_quantize_fp8_groups``: a row's groups do not depend
on its expert, so one launch quantizes every row) and
``fxquant::triton_float8_block_scaled_grouped_mm`` below. The oracle is
``fxquant.core.reference.float8_block_grouped_mm``.

Rows and programs as in ``kernels.grouped``: x sorted by expert, ``offs`` [E] each
expert's cumulative row end, grid (E, cdiv(S, BLOCK_M), cdiv(N, BLOCK_N)); program (e, mb, nb)
takes its expert's rows from ``offs[e-1] + mb * BLOCK_M`` and exits at once when it has none, so
the offsets stay on the device and S stays dynamic. Numerics as ``kernels.float8_block``'s: a
scale changes every b columns of K, so BLOCK_K is b and each K block's e4m3 product goes by
``tl.dot`` into a fresh fp32 tile, added to the running sum times its activation scales (one
per row) and its expert's weight tile scales (column n reads tile row n // b, so BLOCK_N need
not divide b); one rounding to ``out_dtype`` at the store. Promoting every block to a full fp32
sum also bounds the sm90 tensor cores' reduced-precision fp8 accumulation to b products. Ragged
last blocks in N and K are masked (a short last K group has its own scale). One fixed
BLOCK_M × BLOCK_N, not autotuned, as the other experts' kernels; not yet measured on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

from fxquant.core.registry import lowering
from fxquant.kernels import quantize  # noqa: F401  (registers triton_quantize_fp8_groups)
from fxquant.kernels.gemm import load_a, store_tile
from fxquant.kernels.grouped import (
    check_offsets,
    check_quantized_operands,
    expert_tile,
    launch_grouped,
)

fxq = torch.ops.fxquant
_BLOCK_M, _BLOCK_N = 32, 64  # BLOCK_K is the block size b
_MIN_BLOCK = 32  # Triton's tl.dot on 8-bit operands needs K >= 32 on NVIDIA (min_dot_size)


@triton.jit
def _float8_block_grouped_kernel(
    x_ptr,  # [S, K] float8_e4m3fn: rows sorted by expert
    xs_ptr,  # [S, KB] fp32: one scale per row and K block
    w_ptr,  # [E, N, K] float8_e4m3fn
    ws_ptr,  # [E, NB, KB] fp32: one scale per b×b weight tile, NB = ceil(N / b)
    offs_ptr,  # [E] int32/int64: cumulative row end of each expert
    out_ptr,  # [S, N] out_dtype, zeroed: rows no program writes stay 0
    S,
    N,
    K,
    KB,  # ceil(K / BLOCK_K)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # the scale block size b
):
    # ---- rows of this program: its expert's slice of x, from offs ----------------------------
    e, row0, end, offs_m, offs_n, mask_m, mask_n = expert_tile(offs_ptr, S, N, BLOCK_M, BLOCK_N)
    if row0 >= end:
        return
    e = e.to(tl.int64)
    w_cols = w_ptr + (e * N + offs_n[None, :]) * K  # [1, BLOCK_N]: as [K, N]
    xs_rows = xs_ptr + offs_m * KB  # [BLOCK_M]
    # [BLOCK_N]: each column's row of its expert's tile scales
    ws_rows = ws_ptr + (e * tl.cdiv(N, BLOCK_K) + offs_n // BLOCK_K) * KB
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # ---- per K block: e4m3 · e4m3 → fp32, scaled, summed --------------------------------------
    for kb in range(0, KB):
        k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        a, mask_k = load_a(x_ptr, offs_m, mask_m, k, K)
        b = tl.load(w_cols + k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        xs = tl.load(xs_rows + kb, mask=mask_m, other=0.0)
        ws = tl.load(ws_rows + kb, mask=mask_n, other=0.0)
        acc += tl.dot(a, b) * xs[:, None] * ws[None, :]
    # ---- epilogue: one rounding to out_dtype (rows up to the expert's end) -------------------
    store_tile(out_ptr, acc, out_ptr, offs_m, offs_n, end, N, 0, False, 1)


def _check(
    xq: Tensor,
    xs: Tensor,
    weight: Tensor,
    scale: Tensor,
    offs: Tensor,
    block_size: int,
    out_dtype: torch.dtype,
) -> None:
    """ValueError naming the value and what is allowed, for each layout the kernel cannot read."""
    what = "fp8 block scaled grouped mm"
    if block_size < _MIN_BLOCK or block_size & (block_size - 1):
        raise ValueError(
            f"{what}: block_size={block_size}; allowed: powers of two >= {_MIN_BLOCK} "
            "(one K block per tl.dot step)"
        )
    b = block_size
    fp8 = torch.float8_e4m3fn
    e, n, k = check_quantized_operands(
        what, fp8, xq, xs, "[S, ceil(K/b)]", weight, out_dtype, lambda n, k: -(-k // b)
    )  # fmt: skip
    nb, kb = -(-n // b), -(-k // b)
    if scale.dtype != torch.float32 or tuple(scale.shape) != (e, nb, kb):
        raise ValueError(
            f"{what}: scale must be fp32 [E, ceil(N/b), ceil(K/b)] = {[e, nb, kb]}; "
            f"got {scale.dtype} {tuple(scale.shape)}"
        )
    check_offsets(what, xq, weight, scale, offs)


@triton_op("fxquant::triton_float8_block_scaled_grouped_mm", mutates_args=())
def triton_float8_block_scaled_grouped_mm(
    xq: Tensor,
    xs: Tensor,
    weight: Tensor,
    scale: Tensor,
    offs: Tensor,
    block_size: int,
    out_dtype: torch.dtype,
) -> Tensor:
    """xq e4m3 [S, K] (rows sorted by expert) with 1×b group scales xs fp32 [S, ceil(K/b)] · its
    expert's e4m3 W [E, N, K] with b×b tile scales fp32 [E, ceil(N/b), ceil(K/b)], experts from
    cumulative row ends ``offs`` [E] (int32 or int64, non-decreasing: not checked, that would
    need a host sync) → [S, N] in ``out_dtype``, zeros for rows at or past ``offs[-1]``."""
    _check(xq, xs, weight, scale, offs, block_size, out_dtype)
    return launch_grouped(
        _float8_block_grouped_kernel, (xq, xs, weight, scale, offs), weight, out_dtype,
        triton.cdiv(xq.shape[1], block_size),
        BLOCK_M=_BLOCK_M, BLOCK_N=_BLOCK_N, BLOCK_K=block_size,
    )  # fmt: skip


@lowering("cuda", "float8_block_grouped_mm")
def lower_float8_block_grouped_mm(x, weight, scale, offs, block_size):
    # x [S, K] as the op has it: every row quantized in 1×b groups in one launch, then the
    # grouped GEMM back in x's dtype
    xq, xs = fxq.triton_quantize_fp8_groups(x, block_size)
    return fxq.triton_float8_block_scaled_grouped_mm(
        xq, xs, weight, scale, offs, block_size, x.dtype
    )
