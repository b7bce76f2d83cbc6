"""fp8 e4m3 with DeepSeek-V3-style block scales: 1×b activation groups × b×b weight tiles.

Where it sits: the CUDA lowerings at the end of this file (collected by
``fxquant.passes.lower_cuda``) map ``fxquant::float8_block_linear`` onto the 1×b group quantizer
of ``kernels.quantize`` and ``fxquant::triton_float8_block_scaled_mm`` here, and
``fxquant::float8_block_scaled_linear`` (the norm-fusion pass already produced the grouped e4m3
activation and its scales) onto that GEMM alone; ``fxquant::triton_float8_block_linear`` is both
steps in one op. The oracle is ``fxquant.core.reference.float8_block_scaled_linear`` /
``float8_block_linear``.

A scale changes every b columns of K, so it cannot wait for the epilogue: BLOCK_K is b, each K
step's e4m3 product is accumulated by ``tl.dot`` into a fresh fp32 tile, and that tile is added
to the running sum times its activation scales (one per row) and weight scales (one per column:
column n uses weight-scale row n // b, so BLOCK_N need not divide b). Promoting every b products
to a full fp32 sum also bounds the sm90 tensor cores' reduced-precision fp8 accumulation to one
block. Ragged last blocks in M, N and K are masked; a short last K group has its own scale.
Decode (split-K over K blocks) and prefill paths as in ``gemm``; the configs depend on b, so
each block size gets its own pair of autotuned kernels."""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

from fxquant.core.registry import lowering
from fxquant.kernels import configs, gemm, quantize
from fxquant.kernels.gemm import program_tile, store_tile

fxq = torch.ops.fxquant
_MIN_BLOCK = 16  # tl.dot needs every tile dimension >= 16

# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _float8_block_scaled_mm_kernel(
    x_ptr,  # [M, K] float8_e4m3fn, contiguous
    xs_ptr,  # [M, KB] fp32: one scale per row and K block
    w_ptr,  # [N, K] float8_e4m3fn, contiguous
    ws_ptr,  # [NB, KB] fp32: one scale per b×b weight tile
    bias_ptr,  # [N] float (read only when HAS_BIAS)
    y_ptr,  # [M, N]: the output dtype, or fp32 zeros when SPLIT_K > 1
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
    offs_m, offs_n, pid_k = program_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
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
    # ---- epilogue: bias (once, from split 0), store ------------------------------------------
    store_tile(y_ptr, acc, bias_ptr, offs_m, offs_n, M, N, pid_k, HAS_BIAS, SPLIT_K)


@functools.cache
def _kernels(block_size: int):
    """(decode, prefill) autotuned kernels for one block size (BLOCK_K = block_size)."""
    return gemm.decode_and_prefill(
        _float8_block_scaled_mm_kernel,
        key=["N", "K"],
        prefill_key=["N", "K"],
        decode_configs=configs.block_scaled_decode_configs(block_size),
        prefill_configs=configs.block_scaled_prefill_configs(block_size),
    )


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def _check_block_size(block_size: int) -> None:
    if block_size < _MIN_BLOCK or block_size & (block_size - 1):
        raise ValueError(
            f"block_size={block_size} is not supported by the Triton fp8 block GEMM; allowed: "
            f"powers of two >= {_MIN_BLOCK} (one K block per tl.dot step)"
        )


def float8_block_scaled_mm(
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
    return gemm.launch(
        _kernels(block_size),
        (xq, xs, weight, scale),
        bias,
        m,
        n,
        k,
        kb,
        out_dtype=out_dtype,
        decode=decode,
    )


# --------------------------------------------------------------------------------------------
# Ops and lowerings
# --------------------------------------------------------------------------------------------


# The launcher is the op's body: its signature is the op's schema.
triton_float8_block_scaled_mm = triton_op(
    "fxquant::triton_float8_block_scaled_mm", float8_block_scaled_mm, mutates_args=()
)


@triton_op("fxquant::triton_float8_block_linear", mutates_args=())
def triton_float8_block_linear(
    x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None, block_size: int
) -> Tensor:
    """``fxquant::float8_block_linear`` on CUDA: x [..., K] float → [..., N] in x's dtype."""
    _check_block_size(block_size)
    xq, xs = quantize.fp8_groups(x.reshape(-1, x.shape[-1]), block_size)
    y = float8_block_scaled_mm(xq, xs, weight, scale, bias, block_size, x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@lowering("cuda", "float8_block_scaled_linear")
def lower_float8_block_scaled_linear(xq, xs, weight, scale, bias, block_size, out_dtype):
    mm = fxq.triton_float8_block_scaled_mm.default
    return gemm.scaled_linear(mm, xq, xs, weight, scale, bias, block_size, out_dtype)


@lowering("cuda", "float8_block_linear")
def lower_float8_block_linear(x, weight, scale, bias, block_size):
    xq, xs = fxq.triton_quantize_fp8_groups(gemm.rows(x), block_size)
    y = lower_float8_block_scaled_linear(xq, xs, weight, scale, bias, block_size, x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])
