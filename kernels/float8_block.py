"""fp8 e4m3 with DeepSeek-V3-style block scales: 1×b activation groups × b×b weight tiles.

Where it sits: the CUDA lowering (``fxquant.passes.lower``) maps ``fxquant::float8_block_linear``
onto ``fxquant::triton_float8_block_linear`` (quantize x in 1×b groups with ``kernels.quantize``,
then the GEMM here); where the norm-fusion pass already produced the grouped e4m3 activation and
its scales, ``fxquant::triton_float8_block_scaled_mm`` takes them directly. The oracle is
``fxquant.core.reference.float8_block_scaled_linear`` / ``float8_block_linear``.

A scale changes every b columns of K, so it cannot wait for the epilogue: BLOCK_K is b, each K
step's e4m3 product is accumulated by ``tl.dot`` into a fresh fp32 tile, and that tile is added
to the running sum times its activation scales (one per row) and weight scales (one per column:
column n uses weight-scale row n // b, so BLOCK_N need not divide b). Promoting every b products
to a full fp32 sum also bounds the sm90 tensor cores' reduced-precision fp8 accumulation to one
block. Ragged last blocks in M, N and K are masked; a short last K group has its own scale.
Paths as in ``int8_dynamic``: decode (M known to be ≤ ``configs.DECODE_MAX_M``, split-K over K
blocks into a zeroed fp32 buffer) and prefill (tiled); the configs depend on b, so each block
size gets its own pair of autotuned kernels.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from fxquant.kernels import configs, quantize
from fxquant.kernels.int8_weight_only import tile_coords

_GROUP_M = 8  # prefill: tiles of 8 consecutive M blocks share their weight columns in L2
_MIN_BLOCK = 16  # tl.dot needs every tile dimension >= 16


@triton.jit
def _float8_block_scaled_mm_kernel(
    x_ptr,  # [M, K] float8_e4m3fn, contiguous
    xs_ptr,  # [M, KB] fp32: one scale per row and K block
    w_ptr,  # [N, K] float8_e4m3fn, contiguous
    ws_ptr,  # [NB, KB] fp32: one scale per b×b weight tile
    bias_ptr,  # [N] float (read only when HAS_BIAS)
    out_ptr,  # [M, N]: the output dtype, or fp32 zeros when SPLIT_K > 1
    M,
    N,
    K,
    KB,  # ceil(K / BLOCK_K)
    HAS_BIAS: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,  # the scale block size b
    SPLIT_K: tl.constexpr,
):
    # ---- tile of this program (grouped order) ---------------------------------------------
    pid_m, pid_n = tile_coords(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    pid_k = tl.program_id(1)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * K  # [BLOCK_M, 1]
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * K  # [1, BLOCK_N]: W tile read as [K, N]
    xs_rows = xs_ptr + offs_m.to(tl.int64) * KB  # [BLOCK_M]
    ws_rows = ws_ptr + (offs_n // BLOCK_K) * KB  # [BLOCK_N]: each column's row of tile scales
    # ---- per K block: e4m3 · e4m3 → fp32, scaled, summed ----------------------------------
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for kb in range(pid_k, KB, SPLIT_K):
        offs_k = kb * BLOCK_K + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        a = tl.load(x_rows + offs_k[None, :], mask=mask_m[:, None] & mask_k[None, :], other=0.0)
        b = tl.load(w_cols + offs_k[:, None], mask=mask_k[:, None] & mask_n[None, :], other=0.0)
        xs = tl.load(xs_rows + kb, mask=mask_m, other=0.0)
        ws = tl.load(ws_rows + kb, mask=mask_n, other=0.0)
        acc += tl.dot(a, b) * xs[:, None] * ws[None, :]
    # ---- epilogue: bias (once, from split 0) ------------------------------------------------
    y = acc
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        y += tl.where(pid_k == 0, bias, 0.0)[None, :]
    out = out_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]
    mask = mask_m[:, None] & mask_n[None, :]
    if SPLIT_K > 1:
        tl.atomic_add(out, y, mask=mask)
    else:
        tl.store(out, y.to(out_ptr.dtype.element_ty), mask=mask)


@functools.cache
def _kernels(block_size: int):
    """(decode, prefill) autotuned kernels for one block size (BLOCK_K = block_size)."""
    decode = triton.autotune(
        configs=configs.block_scaled_decode_configs(block_size),
        key=["N", "K"],
        reset_to_zero=["out_ptr"],
    )(_float8_block_scaled_mm_kernel)
    prefill = triton.autotune(
        configs=configs.block_scaled_prefill_configs(block_size), key=["N", "K"]
    )(_float8_block_scaled_mm_kernel)
    return decode, prefill


def _grid(m: int, n: int):
    return lambda meta: (
        triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),
        meta["SPLIT_K"],
    )


def _check_block_size(block_size: int) -> None:
    if block_size < _MIN_BLOCK or block_size & (block_size - 1):
        raise ValueError(
            f"block_size={block_size} is not supported by the Triton fp8 block GEMM; allowed: "
            f"powers of two >= {_MIN_BLOCK} (one K block per tl.dot step)"
        )


def float8_block_scaled_mm(
    xq, xs, weight, scale, bias, block_size: int, out_dtype, *, decode: bool | None = None
) -> Tensor:
    """The launcher: check the block size and operands, pick the path, allocate, launch."""
    _check_block_size(block_size)
    fp8 = torch.float8_e4m3fn
    if xq.dtype != fp8 or weight.dtype != fp8 or xq.shape[-1] != weight.shape[-1]:
        raise ValueError(
            f"fp8 block scaled mm needs float8_e4m3fn xq [M, K] and weight [N, K]; got xq "
            f"{xq.dtype} {tuple(xq.shape)}, weight {weight.dtype} {tuple(weight.shape)}"
        )
    xq, xs, weight = xq.contiguous(), xs.contiguous(), weight.contiguous()
    scale = scale.contiguous()
    m, k = xq.shape
    n = weight.shape[0]
    kb = -(-k // block_size)
    decode_kernel, prefill_kernel = _kernels(block_size)
    # Without a bias, scale stands in for bias_ptr: HAS_BIAS=False never reads it.
    args = (xq, xs, weight, scale, scale if bias is None else bias.contiguous())
    if configs.is_decode(m, decode):
        # Split-K adds partial products into fp32, whatever the output dtype.
        out = torch.zeros((m, n), dtype=torch.float32, device=xq.device)
        wrap_triton(decode_kernel)[_grid(m, n)](
            *args, out, m, n, k, kb, HAS_BIAS=bias is not None, GROUP_M=1
        )
        return out.to(out_dtype)
    out = torch.empty((m, n), dtype=out_dtype, device=xq.device)
    wrap_triton(prefill_kernel)[_grid(m, n)](
        *args, out, m, n, k, kb, HAS_BIAS=bias is not None, GROUP_M=_GROUP_M, SPLIT_K=1
    )
    return out


@triton_op("fxquant::triton_float8_block_scaled_mm", mutates_args=())
def triton_float8_block_scaled_mm(
    xq: Tensor,
    xs: Tensor,
    weight: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    block_size: int,
    out_dtype: torch.dtype,
    decode: bool | None = None,
) -> Tensor:
    """xq e4m3 [M, K] with xs fp32 [M, ceil(K/b)] · e4m3 W [N, K] with scale fp32
    [ceil(N/b), ceil(K/b)]. Returns [M, N] in ``out_dtype``, accumulated in fp32.
    ``decode`` forces the decode (True) or prefill (False) path; None picks from M.
    """
    return float8_block_scaled_mm(xq, xs, weight, scale, bias, block_size, out_dtype, decode=decode)


@triton_op("fxquant::triton_float8_block_linear", mutates_args=())
def triton_float8_block_linear(
    x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None, block_size: int
) -> Tensor:
    """``fxquant::float8_block_linear`` on CUDA: x [..., K] float → [..., N] in x's dtype."""
    _check_block_size(block_size)
    xq, xs = quantize.fp8_groups(x.reshape(-1, x.shape[-1]), block_size)
    y = float8_block_scaled_mm(xq, xs, weight, scale, bias, block_size, x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])
