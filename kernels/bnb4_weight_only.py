"""bitsandbytes 4-bit (NF4 / FP4) weight-only GEMM: the weight is decoded tile by tile in the
K loop and never written out.

Where it sits: ``fxquant.passes.lower`` (device="cuda") replaces
``fxquant::bnb4_weight_only_linear`` by ``fxquant::triton_bnb4_weight_only_linear`` below (same
arguments); Inductor sees the kernel through ``wrap_triton`` and AOTInductor embeds it.

Layout (``fxquant.core.reference_bnb.quantize_4bit``, bnb's own): the flattened W [N, K] is packed
two indices per byte, the first element in the high nibble (stored [N, K/2]); the block absmax
runs over the flattened W too, one per ``BLOCK_SIZE`` elements (fp32, or uint8 codes into the
256-entry dynamic map times a per-256-blocks fp32 scale plus an offset with double quant); the
index selects one of 16 fp32 values of ``quant_map``. Element (n, k) is flat index n·K + k, and
the kernel reads its byte, nibble, code and block scale from that index alone, so a block that
spans two rows (K not a multiple of the block) decodes as bnb decodes it.

Numerics: w = quant_map[idx] · absmax in fp32 (the reference's order: with double quant,
absmax = nested_map[q] · nested_absmax + offset first); the decoded tile is cast to x's dtype
for the dot (bnb, too, computes in its compute dtype), products accumulate in fp32, one
rounding to x's dtype at the end. Decode (M ≤ 16, split-K) and prefill paths and the tile
order are those of ``int8_weight_only``, whose helpers this file uses.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

from fxquant.core.registry import lowering
from fxquant.kernels import gemm
from fxquant.kernels.gemm import as_operand, dot_f32, load_a, program_tile, store_tile

NESTED_BLOCK_SIZE = 256  # bnb's double-quant block (fxquant.core.reference_bnb.NESTED_BLOCK_SIZE)
BLOCK_SIZES = (64, 128, 256, 512, 1024, 2048, 4096)


# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def _decode_tile(
    w_ptr,
    absmax_ptr,
    code_ptr,
    nested_absmax_ptr,
    nested_code_ptr,
    nested_offset_ptr,
    n,  # [1, BLOCK_N] output rows
    k,  # [BLOCK_K, 1] input columns
    mask,  # [BLOCK_K, BLOCK_N]
    K,
    BLOCK_SIZE: tl.constexpr,
    NESTED: tl.constexpr,
):
    """W[n, k] as fp32, a [BLOCK_K, BLOCK_N] tile (zeros where masked)."""
    flat = n.to(tl.int64) * K + k
    packed = tl.load(w_ptr + flat // 2, mask=mask, other=0).to(tl.int32)
    idx = (packed >> ((1 - flat % 2) * 4).to(tl.int32)) & 0xF  # even element: high nibble
    value = tl.load(code_ptr + idx)  # idx is always in [0, 15]
    block = flat // BLOCK_SIZE
    if NESTED:
        q = tl.load(absmax_ptr + block, mask=mask, other=0).to(tl.int32)
        s = tl.load(nested_absmax_ptr + block // 256, mask=mask, other=0.0)
        absmax = tl.load(nested_code_ptr + q) * s + tl.load(nested_offset_ptr)
    else:
        absmax = tl.load(absmax_ptr + block, mask=mask, other=0.0)
    return tl.where(mask, value * absmax, 0.0)


@triton.jit
def _bnb4_gemm_kernel(
    x_ptr,  # [M, K] bf16 / fp16 / fp32, row-major
    w_ptr,  # [N, K/2] uint8: the flattened W's indices, high nibble first
    absmax_ptr,  # [ceil(N·K/BLOCK_SIZE)] fp32, or uint8 (NESTED)
    code_ptr,  # [16] fp32
    nested_absmax_ptr,  # [ceil(blocks/256)] fp32 (NESTED; else any valid pointer, never read)
    nested_code_ptr,  # [256] fp32 (NESTED)
    nested_offset_ptr,  # [1] fp32 (NESTED)
    bias_ptr,  # [N] float; any valid pointer when HAS_BIAS is False (never read)
    y_ptr,  # [M, N] x's dtype, or fp32 zeros (decode)
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    NESTED: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    offs_m, offs_n, pid_k = program_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    offs_k = tl.arange(0, BLOCK_K)
    mask_m = offs_m < M
    mask_n = offs_n < N

    # ---- K loop: this program takes K steps pid_k, pid_k + SPLIT_K, ...
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        k = k0 + offs_k
        a, mask_k = load_a(x_ptr, offs_m, mask_m, k, K)
        w = _decode_tile(
            w_ptr,
            absmax_ptr,
            code_ptr,
            nested_absmax_ptr,
            nested_code_ptr,
            nested_offset_ptr,
            offs_n[None, :],
            k[:, None],
            mask_k[:, None] & mask_n[None, :],
            K,
            BLOCK_SIZE,
            NESTED,
        )
        acc += dot_f32(a, as_operand(w, a.dtype))

    store_tile(y_ptr, acc, bias_ptr, offs_m, offs_n, M, N, pid_k, HAS_BIAS, SPLIT_K)


_decode_kernel, _prefill_kernel = gemm.decode_and_prefill(
    _bnb4_gemm_kernel, key=["N", "K", "BLOCK_SIZE", "NESTED"]
)


# --------------------------------------------------------------------------------------------
# Launcher
# --------------------------------------------------------------------------------------------


def _check(weight, absmax, quant_map, nested, block_size: int, k: int) -> None:
    if block_size not in BLOCK_SIZES:
        raise ValueError(f"block_size={block_size} is not supported; allowed: {BLOCK_SIZES}")
    n = weight.shape[0]
    if weight.dtype != torch.uint8 or weight.dim() != 2 or 2 * weight.shape[1] != k:
        raise ValueError(
            f"packed weight must be uint8 [N, K/2] = [{n}, {k // 2}] for x with K={k}; got "
            f"{weight.dtype} {tuple(weight.shape)}"
        )
    blocks = -(-n * k // block_size)
    want = torch.uint8 if nested[0] is not None else torch.float32
    if absmax.dtype != want or tuple(absmax.shape) != (blocks,):
        raise ValueError(
            f"absmax must be {want} [{blocks}] (one per {block_size} of the {n}×{k} weight); "
            f"got {absmax.dtype} {tuple(absmax.shape)}"
        )
    if quant_map.dtype != torch.float32 or quant_map.numel() != 16:
        raise ValueError(f"quant_map must be fp32 [16]; got {quant_map.dtype} {quant_map.shape}")
    if any(t is None for t in nested) and any(t is not None for t in nested):
        raise ValueError("double quant needs nested_absmax, nested_quant_map and nested_offset")


def bnb4_linear(
    x: Tensor,
    weight: Tensor,
    absmax: Tensor,
    quant_map: Tensor,
    nested_absmax: Tensor | None,
    nested_quant_map: Tensor | None,
    nested_offset: Tensor | None,
    bias: Tensor | None,
    block_size: int,
    decode: bool | None = None,
) -> Tensor:
    """x [..., K] · bnb 4-bit W (N = weight.shape[0]) → [..., N] in x's dtype: the CUDA
    lowering of ``fxquant::bnb4_weight_only_linear`` (same arguments, then ``decode``: force the
    decode (True) or prefill (False) kernel; None picks from M)."""
    gemm.check_activation(x)
    k = x.shape[-1]
    nested = (nested_absmax, nested_quant_map, nested_offset)
    _check(weight, absmax, quant_map, nested, block_size, k)
    n = weight.shape[0]
    x2 = x.reshape(-1, k).contiguous()
    is_nested = nested_absmax is not None
    # unused pointers stand in with a tensor that exists (never read: NESTED is constexpr)
    na, nc, no = (t.contiguous() for t in nested) if is_nested else (absmax,) * 3
    y = gemm.launch(
        (_decode_kernel, _prefill_kernel),
        (x2, weight.contiguous(), absmax.contiguous(), quant_map.contiguous(), na, nc, no),
        bias,
        x2.shape[0],
        n,
        k,
        out_dtype=x.dtype,
        decode=decode,
        NESTED=is_nested,
        BLOCK_SIZE=block_size,
    )
    return y.reshape(*x.shape[:-1], n)


# --------------------------------------------------------------------------------------------
# Op and lowering
# --------------------------------------------------------------------------------------------


# The launcher is the op's body: its signature is the op's schema.
triton_bnb4_weight_only_linear = torch.library.triton_op(
    "fxquant::triton_bnb4_weight_only_linear", bnb4_linear, mutates_args=()
)


@lowering("cuda", "bnb4_weight_only_linear")
def lower_bnb4_weight_only_linear(
    x, weight, absmax, quant_map, nested_absmax, nested_quant_map, nested_offset, bias, block_size
):
    op = torch.ops.fxquant.triton_bnb4_weight_only_linear.default
    return gemm.linear(
        op,
        x,
        weight,
        absmax,
        quant_map,
        nested_absmax,
        nested_quant_map,
        nested_offset,
        bias,
        block_size,
    )
