"""MXFP4 GEMM: y = x · dequant(W)ᵀ + bias, W packed e2m1 [N, K/2] with E8M0 scales per 1×32.

Where it sits: the CUDA lowering at the end of this file (collected by
``fxquant.passes.lower_cuda``) maps ``fxquant::mxfp4_linear`` onto ``fxquant::triton_mxfp4_linear``
below (quantizing x to MXFP4 first, in aten ops Inductor fuses, when the scheme quantizes
activations); the kernel returns fp32. ``kernels.nvfp4`` runs the same kernel with e4m3 block
scales and a tensor scale. The oracle is ``fxquant.core.reference_mx.mxfp4_linear`` /
``nvfp4_linear``.

The weight is dequantized in the kernel and multiplied with fp32 accumulation: on the bf16
tensor cores when x is bf16 (exact: ``dot_fp4``), else as IEEE fp32 dots; the emulation every
GPU without FP4 tensor cores needs (Blackwell's block-scaled MMA is not used yet). A K step is
32 values = 16 bytes of a weight row: the low nibbles hold the even columns and the high nibbles
the odd ones, so the step is two dots, the even columns of x against the low nibbles and the odd
columns against the high ones, and the codes are never interleaved in registers. Every weight
byte reads its block's scale (both nibbles of a byte are in the same block), so 16- and 32-wide
blocks take the same code. Ragged M and N are masked; K is a multiple of the block (the scheme
skips other layers).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from fxquant.core import reference_mx as ref_mx
from fxquant.core.registry import lowering
from fxquant.kernels import gemm
from fxquant.kernels.gemm import dot_f32, store_tile

_BLOCK_K = 32  # values of K per step: 16 bytes, so each of the two dots is 16 deep


@triton.jit
def e2m1_to_f32(c):
    """int32 e2m1 codes (sign << 3 | exponent << 1 | mantissa) → fp32 values."""
    e = (c >> 1) & 3
    m = (c & 1).to(tl.float32)
    pow2 = tl.where(e == 1, 1.0, tl.where(e == 2, 2.0, 4.0))
    mag = tl.where(e == 0, m * 0.5, (1.0 + m * 0.5) * pow2)
    return tl.where((c & 8) != 0, -mag, mag)


@triton.jit
def e8m0_to_f32(s):
    """int32 biased E8M0 exponents → fp32 2**(s - 127), built from the exponent bits (s = 0 is
    the subnormal 2**-127, bit 22)."""
    bits = tl.where(s == 0, 0x400000, s << 23)
    return bits.to(tl.float32, bitcast=True)


@triton.jit
def dot_fp4(acc, x_rows, j, mask_m, mask_j, byte, scale, X_BF16: tl.constexpr):
    """acc + x · dequant(W) over one K step of weight bytes ``j``: the even columns of x
    against the low nibbles, the odd ones against the high nibbles, two dots accumulated in
    fp32 (the codes are never interleaved in registers).

    x_rows [BLOCK_M, 1] pointers to x's rows; byte [len(j), BLOCK_N] int32; scale the block
    scale of each byte as fp32, 0 where masked. ``X_BF16``: x is bf16, and the dots run on the
    bf16 tensor cores. That loses nothing: a decoded weight (1 mantissa bit) times an E8M0 or
    e4m3 block scale (0 or 3 bits) is exact in bf16, and bf16 × bf16 products are exact in the
    fp32 accumulator, so the sums are the fp32 IEEE dots' up to summation order. Otherwise
    (fp32 or fp16 x: fp16's exponent range does not hold every scaled code) IEEE fp32 dots."""
    w_even = e2m1_to_f32(byte & 15) * scale  # [len(j), BLOCK_N]
    w_odd = e2m1_to_f32(byte >> 4) * scale
    mask_x = mask_m[:, None] & mask_j[None, :]
    x_even = tl.load(x_rows + 2 * j[None, :], mask=mask_x, other=0.0)
    x_odd = tl.load(x_rows + 2 * j[None, :] + 1, mask=mask_x, other=0.0)
    if X_BF16:
        acc += dot_f32(x_even, w_even.to(tl.bfloat16))
        acc += dot_f32(x_odd, w_odd.to(tl.bfloat16))
    else:
        acc += tl.dot(x_even.to(tl.float32), w_even, input_precision="ieee")
        acc += tl.dot(x_odd.to(tl.float32), w_odd, input_precision="ieee")
    return acc


@triton.jit
def _fp4_linear_kernel(
    x_ptr,  # [M, K] float: the activation as the GEMM sees it
    w_ptr,  # [N, K/2] uint8: two e2m1 codes a byte, the even column in the low nibble
    s_ptr,  # [N, K/BS]: uint8 E8M0 exponents (E8M0) or float8_e4m3fn block scales
    g_ptr,  # [1] fp32 tensor scale (read only when not E8M0)
    bias_ptr,  # [N] float (read only when HAS_BIAS)
    out_ptr,  # [M, N] fp32
    M,
    N,
    K,
    HAS_BIAS: tl.constexpr,
    E8M0: tl.constexpr,
    BS: tl.constexpr,  # values per block scale: 32 (MX) or 16 (NVFP4)
    X_BF16: tl.constexpr,  # x is bf16: the dots on the bf16 tensor cores (dot_fp4)
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    # ---- tile of this program -------------------------------------------------------------
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m = offs_m < M
    mask_n = offs_n < N
    kh = K // 2
    ks = K // BS
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * K  # [BLOCK_M, 1]
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * kh  # [1, BLOCK_N]: bytes read as [K/2, N]
    s_cols = s_ptr + offs_n.to(tl.int64)[None, :] * ks  # [1, BLOCK_N]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    # ---- per K step: decode 16 bytes a row, scale, two fp32 dots -----------------------------
    for k0 in range(0, K, BLOCK_K):
        j = k0 // 2 + tl.arange(0, BLOCK_K // 2)  # byte columns of this step
        mask_j = j < kh
        mask_w = mask_j[:, None] & mask_n[None, :]
        byte = tl.load(w_cols + j[:, None], mask=mask_w, other=0).to(tl.int32)
        # no ``other``: an fp8 fill value does not cast; masked lanes are zeroed below, so a
        # K tail (16-wide NVFP4 blocks in a 32-wide step) never multiplies garbage
        sc = tl.load(s_cols + (2 * j // BS)[:, None], mask=mask_w)
        if E8M0:  # noqa: SIM108  (a constexpr branch: only the taken one is compiled)
            scale = e8m0_to_f32(sc.to(tl.int32))
        else:
            scale = sc.to(tl.float32)
        scale = tl.where(mask_w, scale, 0.0)
        acc = dot_fp4(acc, x_rows, j, mask_m, mask_j, byte, scale, X_BF16)
    # ---- epilogue: tensor scale, bias --------------------------------------------------------
    if not E8M0:
        acc = acc * tl.load(g_ptr)
    store_tile(out_ptr, acc, bias_ptr, offs_m, offs_n, M, N, 0, HAS_BIAS, 1)


def block_sizes(m: int) -> tuple[int, int]:
    """(BLOCK_M, BLOCK_N): a 16-row tile for decode-sized M, 64 otherwise."""
    return (16 if m <= 16 else 64), 64


def launch(kernel, operands: tuple, bias: Tensor | None, m, n, k, **constexprs) -> Tensor:
    """Run an MX GEMM kernel (here, ``kernels.mxfp8``) on a new fp32 y [m, n]: one program per
    ``block_sizes`` tile, no autotuning (not yet measured on a GPU). The kernel takes
    ``(*operands, bias_ptr, out_ptr, M, N, K, HAS_BIAS, ..., BLOCK_M, BLOCK_N, BLOCK_K)``."""
    y = torch.empty((m, n), dtype=torch.float32, device=operands[0].device)
    bm, bn = block_sizes(m)
    wrap_triton(kernel)[(triton.cdiv(m, bm), triton.cdiv(n, bn))](
        *operands,
        operands[0] if bias is None else bias.contiguous(),  # HAS_BIAS=False never reads it
        y,
        m,
        n,
        k,
        HAS_BIAS=bias is not None,
        BLOCK_M=bm,
        BLOCK_N=bn,
        **constexprs,
    )
    return y


def fp4_linear(x, weight, scale, tensor_scale, bias, *, block: int) -> Tensor:
    """The launcher shared with ``kernels.nvfp4``: check, allocate, launch. Returns fp32 [M, N].

    ``tensor_scale`` None means E8M0 (uint8) block scales; otherwise e4m3 block scales and this
    fp32 [1] tensor scale.
    """
    m, k = x.shape
    n = weight.shape[0]
    if weight.dtype != torch.uint8 or weight.shape[1] * 2 != k or k % block:
        raise ValueError(
            f"fp4 linear needs x [M, K] with K a multiple of {block} and a packed uint8 weight "
            f"[N, K/2]; got x {tuple(x.shape)}, weight {weight.dtype} {tuple(weight.shape)}"
        )
    if scale.shape != (n, k // block):
        raise ValueError(f"fp4 linear: scale shape {tuple(scale.shape)} != {(n, k // block)}")
    e8m0 = tensor_scale is None
    g = scale if e8m0 else tensor_scale.float().contiguous()  # a stand-in when never read
    operands = (x.contiguous(), weight.contiguous(), scale.contiguous(), g)
    return launch(
        _fp4_linear_kernel,
        operands,
        bias,
        m,
        n,
        k,
        E8M0=e8m0,
        BS=block,
        X_BF16=x.dtype == torch.bfloat16,
        BLOCK_K=_BLOCK_K,
    )


@triton_op("fxquant::triton_mxfp4_linear", mutates_args=())
def triton_mxfp4_linear(x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None) -> Tensor:
    """x [M, K] float (already MXFP4-quantized where the scheme quantizes activations) · packed
    e2m1 W [N, K/2] with E8M0 (uint8) scales [N, K/32] → fp32 [M, N]."""
    return fp4_linear(x, weight, scale, None, bias, block=32)


@lowering("cuda", "mxfp4_linear")
def lower_mxfp4_linear(x, weight, scale, bias, activations, scale_rule):
    x2 = gemm.rows(x)
    if activations:
        x2 = ref_mx.mx_fake_quantize(x2, elem="e2m1", rule=scale_rule)
    y = torch.ops.fxquant.triton_mxfp4_linear(x2, weight, scale, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)
