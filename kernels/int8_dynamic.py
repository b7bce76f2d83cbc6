"""w8a8: int8 activations (one scale per token) × int8 weights (one scale per output channel).

Where it sits: the CUDA lowerings at the end of this file (collected by
``fxquant.passes.lower_cuda``) map ``fxquant::int8_dynamic_linear`` onto the per-token quantizer
of ``kernels.quantize`` and ``fxquant::triton_int8_scaled_mm`` here, and
``fxquant::int8_scaled_linear`` (the norm-fusion pass already produced the int8 activation and
its scales) onto that GEMM alone; ``fxquant::triton_int8_dynamic_linear`` is both steps in one
op. The oracle is ``fxquant.core.reference.int8_scaled_linear`` / ``int8_dynamic_linear``.

The GEMM multiplies int8 tiles into an int32 accumulator (exact: no rounding until the
epilogue), then applies xs[m] · ws[n] (and the bias) in fp32, as the reference does. The same
kernel, with ``INT8=False``, is the e4m3 GEMM of ``float8_dynamic``. Decode (M ≤ 16, split-K)
and prefill paths as in ``gemm``: with split-K, decode outputs may differ between runs in the
last bit."""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op

from fxquant.core.registry import lowering
from fxquant.kernels import gemm, quantize
from fxquant.kernels.gemm import program_tile, store_tile

fxq = torch.ops.fxquant

# --------------------------------------------------------------------------------------------
# Kernel
# --------------------------------------------------------------------------------------------


@triton.jit
def scaled_dot_step(acc, x_rows, w_cols, k, K, mask_m, mask_n, INT8: tl.constexpr):
    """One K step of an int8 (``INT8``) or e4m3 GEMM: the A tile ``x_rows + k`` [BLOCK_M,
    BLOCK_K] and the weight tile ``w_cols + k`` read as [BLOCK_K, BLOCK_N] (zeros outside the
    masks and past K), their product added to ``acc`` (int32, exact; or fp32). Shared with
    the grouped kernel of ``int8_dynamic_grouped``."""
    mask_k = k < K
    mask_a = mask_m[:, None] & mask_k[None, :]
    mask_b = mask_k[:, None] & mask_n[None, :]
    if INT8:  # integer `other`s: the loads stay int8 (what the int8 tl.dot takes)
        a = tl.load(x_rows + k[None, :], mask=mask_a, other=0)
        b = tl.load(w_cols + k[:, None], mask=mask_b, other=0)
        return tl.dot(a, b, acc, out_dtype=tl.int32)
    else:  # the interpreter needs a float `other` for fp8 loads
        a = tl.load(x_rows + k[None, :], mask=mask_a, other=0.0)
        b = tl.load(w_cols + k[:, None], mask=mask_b, other=0.0)
        return tl.dot(a, b, acc)


@triton.jit
def _scaled_mm_kernel(
    x_ptr,  # [M, K] int8 or float8_e4m3fn, contiguous
    xs_ptr,  # fp32 activation scale: [M] (stride_xs = 1) or [1] (stride_xs = 0)
    w_ptr,  # [N, K] x's dtype, contiguous
    ws_ptr,  # fp32 weight scale: [N] (stride_ws = 1) or [1] (stride_ws = 0)
    bias_ptr,  # [N] float (read only when HAS_BIAS)
    y_ptr,  # [M, N]: the output dtype, or fp32 zeros when SPLIT_K > 1
    M,
    N,
    K,
    stride_xs,
    stride_ws,
    INT8: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    GROUP_M: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    # ---- tile of this program (grouped order) ---------------------------------------------
    offs_m, offs_n, pid_k = program_tile(M, N, BLOCK_M, BLOCK_N, GROUP_M)
    mask_m = offs_m < M
    mask_n = offs_n < N
    x_rows = x_ptr + offs_m.to(tl.int64)[:, None] * K  # [BLOCK_M, 1]
    w_cols = w_ptr + offs_n.to(tl.int64)[None, :] * K  # [1, BLOCK_N]: W tile read as [K, N]
    # ---- int8 · int8 → int32 (exact), or e4m3 · e4m3 → fp32, over this program's K share ---
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.int32 if INT8 else tl.float32)
    for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
        acc = scaled_dot_step(acc, x_rows, w_cols, k0 + tl.arange(0, BLOCK_K), K, mask_m, mask_n,
                              INT8)  # fmt: skip
    # ---- epilogue: activation × weight scales, bias (once, from split 0), store ------------
    xs = tl.load(xs_ptr + offs_m * stride_xs, mask=mask_m, other=0.0)
    ws = tl.load(ws_ptr + offs_n * stride_ws, mask=mask_n, other=0.0)
    y = acc.to(tl.float32) * xs[:, None] * ws[None, :]
    store_tile(y_ptr, y, bias_ptr, offs_m, offs_n, M, N, pid_k, HAS_BIAS, SPLIT_K)


# M is not in the prefill key: one tuning serves every prefill length.
_decode_kernel, _prefill_kernel = gemm.decode_and_prefill(
    _scaled_mm_kernel, key=["N", "K", "INT8"], prefill_key=["N", "K", "INT8"]
)


# --------------------------------------------------------------------------------------------
# Launchers
# --------------------------------------------------------------------------------------------


def scaled_mm(xq, xs, weight, scale, bias, out_dtype, *, operand_dtype, decode) -> Tensor:
    """The launcher of both scaled mms (int8 here, e4m3 in ``float8_dynamic``): check the
    operands, then ``gemm.launch``.

    A scale is read through a stride: 1 for one scale per row ([M, 1] activation, [N] weight),
    0 for one per tensor ([1]), so one compiled kernel serves every mix and nothing branches
    on M.
    """
    if (
        xq.dtype != operand_dtype
        or weight.dtype != operand_dtype
        or xq.shape[-1] != weight.shape[-1]
    ):
        raise ValueError(
            f"{'int8' if operand_dtype == torch.int8 else 'fp8'} scaled mm needs "
            f"{str(operand_dtype).removeprefix('torch.')} xq [M, K] and weight [N, K]; got xq "
            f"{xq.dtype} {tuple(xq.shape)}, weight {weight.dtype} {tuple(weight.shape)}"
        )
    xq, xs, weight = xq.contiguous(), xs.contiguous(), weight.contiguous()
    scale = scale.contiguous()
    m, k = xq.shape
    n = weight.shape[0]
    if (
        operand_dtype == torch.float8_e4m3fn
        and gemm.library_prefill(xq, m, decode)
        and gemm.scaled_mm_serves(xq, n, k, out_dtype)
    ):
        return gemm.library_scaled_mm(xq, xs, weight, scale, bias, out_dtype)
    # expand() gives a per-tensor scale stride 0 and leaves a per-row one at stride 1.
    strides = (xs.expand(m, 1).stride(0), scale.expand(n).stride(0))
    return gemm.launch(
        (_decode_kernel, _prefill_kernel),
        (xq, xs, weight, scale),
        bias,
        m,
        n,
        k,
        *strides,
        out_dtype=out_dtype,
        decode=decode,
        INT8=operand_dtype == torch.int8,
    )


def int8_scaled_mm(
    xq: Tensor,
    xs: Tensor,
    weight: Tensor,
    scale: Tensor,
    bias: Tensor | None,
    out_dtype: torch.dtype,
    decode: bool | None = None,
) -> Tensor:
    """xq int8 [M, K] with per-token xs fp32 [M, 1] · int8 W [N, K] with per-channel scale [N].

    Returns [M, N] in ``out_dtype``: (xq · Wᵀ) · xs · scale (+ bias), accumulated exactly in int32.
    ``decode`` forces the decode (True) or prefill (False) path; None picks from M.
    """
    return scaled_mm(
        xq, xs, weight, scale, bias, out_dtype, operand_dtype=torch.int8, decode=decode
    )


# --------------------------------------------------------------------------------------------
# Ops and lowerings
# --------------------------------------------------------------------------------------------


# The launcher is the op's body: its signature is the op's schema.
triton_int8_scaled_mm = triton_op("fxquant::triton_int8_scaled_mm", int8_scaled_mm, mutates_args=())


@triton_op("fxquant::triton_int8_dynamic_linear", mutates_args=())
def triton_int8_dynamic_linear(
    x: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None
) -> Tensor:
    """``fxquant::int8_dynamic_linear`` on CUDA: x [..., K] float → [..., N] in x's dtype."""
    xq, xs = quantize.int8_per_token(x.reshape(-1, x.shape[-1]))
    y = int8_scaled_mm(xq, xs, weight, scale, bias, x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


@lowering("cuda", "int8_scaled_linear")
def lower_int8_scaled_linear(xq, xs, weight, scale, bias, out_dtype):
    return gemm.scaled_linear(
        fxq.triton_int8_scaled_mm.default, xq, xs, weight, scale, bias, out_dtype
    )


@lowering("cuda", "int8_dynamic_linear")
def lower_int8_dynamic_linear(x, weight, scale, bias):
    xq, xs = fxq.triton_quantize_int8_per_token(gemm.rows(x))
    y = lower_int8_scaled_linear(xq, xs, weight, scale, bias, x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])
