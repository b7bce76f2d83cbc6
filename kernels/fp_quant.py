"""FP-Quant on CUDA (``FPQuant``): one Triton kernel rotates and quantizes the activation, then
the FP4 GEMM of ``kernels.mxfp4`` / ``kernels.nvfp4`` multiplies it by the stored weight.

Where it sits: ``fxquant.passes.lower`` (device="cuda") replaces ``fxquant::fp_quant_linear``
by ``fxquant::triton_fp_quant_quantize`` (below) and ``fxquant::triton_mxfp4_linear`` /
``triton_nvfp4_linear`` on the weight's codes and block scales, the weight's global scale and
the bias applied after (aten ops Inductor fuses). The oracle is
``fxquant.core.reference_fp_quant.fp_quant_linear``.

The activation kernel is what QuTLASS's ``fusedQuantizeMx`` / ``fusedQuantizeNv`` fuse: one
program takes a [BLOCK_M, g] tile of x (g the rotation size), rounds it to bf16, multiplies it by
the g×g rotation with ``tl.dot`` (fp32 accumulation), cuts the product into the format's blocks
(32 or 16 values), takes each block's scale by FP-Quant's rule and writes the dequantized e2m1
values: x is read once and the rotated activation never reaches memory. The scale arithmetic is
the reference's, in IEEE fp32 (``sqrt_rn``, ``div_rn``: Triton's ``/`` is approximate on
NVIDIA), and the bf16 input and e4m3 block scale are rounded on their bit patterns
(``kernels.rounding``), so the kernel is bit for bit the reference's quantizer. The GEMM then
sees an fp32 activation, as the MXFP4 / NVFP4 lowerings feed theirs; Blackwell's block-scaled
MMA is not used yet.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor
from torch.library import triton_op, wrap_triton

from fxquant.core import reference_fp_quant as ref_fpq
from fxquant.core.registry import lowering
from fxquant.kernels import gemm
from fxquant.kernels import mxfp4 as _mxfp4  # noqa: F401  (defines triton_mxfp4_linear)
from fxquant.kernels import nvfp4 as _nvfp4  # noqa: F401  (defines triton_nvfp4_linear)
from fxquant.kernels.rounding import round_half_even, round_to_bf16, round_to_e4m3

_BLOCK_M = 16  # rows a program: tl.dot's smallest M
_QUEST_CLIP = tl.constexpr(ref_fpq.QUEST_CLIP)
_SCALE_EPS = tl.constexpr(ref_fpq.SCALE_EPS)
_GAIN = tl.constexpr(ref_fpq.ABS_MAX_GAIN)


@triton.jit
def round_to_e2m1(v):
    """fp32 → the nearest e2m1 value (fp32), ties to even, saturating at ±6."""
    a = tl.minimum(tl.abs(v), 6.0)
    r = tl.where(
        a < 2.0,
        round_half_even(a * 2.0) * 0.5,
        tl.where(a < 4.0, round_half_even(a), round_half_even(a * 0.5) * 2.0),
    )
    return tl.where(v < 0, -r, r)


@triton.jit
def _fp_quant_act_kernel(
    x_ptr,  # [M, K] float
    r_ptr,  # [G, G] fp32: the rotation
    gs_ptr,  # [1] fp32: the activation's global scale
    out_ptr,  # [M, K] fp32: the dequantized rotated activation
    M,
    K,
    G: tl.constexpr,  # rotation size
    BS: tl.constexpr,  # values per block scale: 32 (MXFP4) or 16 (NVFP4)
    MX: tl.constexpr,
    QUEST: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    # ---- one [BLOCK_M, G] tile: rounded to bf16 as FP-Quant's quantizer takes x, rotated ----
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.program_id(1) * G + tl.arange(0, G)
    mask = (offs_m < M)[:, None]
    ptrs = offs_m.to(tl.int64)[:, None] * K + cols[None, :]
    x = round_to_bf16(tl.load(x_ptr + ptrs, mask=mask, other=0.0).to(tl.float32))
    r = tl.load(r_ptr + tl.arange(0, G)[:, None] * G + tl.arange(0, G)[None, :])
    v = tl.dot(x, r, input_precision="ieee")
    # ---- blocks of BS values, FP-Quant's scale rule ----------------------------------------
    b = tl.reshape(v, (BLOCK_M * G // BS, BS))
    gs = tl.load(gs_ptr)
    if MX:
        if QUEST:
            mean = tl.math.div_rn(tl.sum(b, axis=1), BS * 1.0)
            var = tl.math.div_rn(tl.sum(b * b, axis=1), BS * 1.0) - mean * mean
            s = tl.where(var >= 0, tl.sqrt_rn(tl.maximum(var, 0.0)) * _QUEST_CLIP + _SCALE_EPS, 1.0)
            gain = 1.0
        else:
            s = tl.max(tl.abs(b), axis=1) + _SCALE_EPS
            gain = _GAIN
        # 2**floor(log2 s): the exponent bits alone, as QuTLASS masks them
        block = (s.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
        scaled = tl.math.div_rn(b, block[:, None]) * gain  # exact: a power of two
    else:
        amax = tl.max(tl.abs(b), axis=1)
        block = round_to_e4m3(tl.minimum(gs * (amax * (1.0 / 6.0)), 448.0))
        safe = tl.where(block == 0, 1.0, block)  # an all-zero block: no division by zero
        inv = tl.where(block == 0, 0.0, tl.math.div_rn(1.0, safe * tl.math.div_rn(1.0, gs)))
        scaled = b * inv[:, None]
    dq = tl.math.div_rn(round_to_e2m1(scaled) * block[:, None], gs)
    tl.store(out_ptr + ptrs, tl.reshape(dq, (BLOCK_M, G)), mask=mask)


@triton_op("fxquant::triton_fp_quant_quantize", mutates_args=())
def triton_fp_quant_quantize(
    x: Tensor, rotation: Tensor, global_scale: Tensor, dtype: str, method: str
) -> Tensor:
    """x [M, K] → its FP-Quant-quantized values in the rotated basis, fp32 [M, K]
    (``reference_fp_quant.fake_quantize``)."""
    m, k = x.shape
    g = rotation.shape[0]
    if k % g:
        raise ValueError(f"FP-Quant activation: K={k} is not a multiple of the rotation size {g}")
    out = torch.empty((m, k), dtype=torch.float32, device=x.device)
    wrap_triton(_fp_quant_act_kernel)[(triton.cdiv(m, _BLOCK_M), k // g)](
        x.contiguous(),
        rotation.float().contiguous(),
        global_scale.float().contiguous(),
        out,
        m,
        k,
        G=g,
        BS=ref_fpq.BLOCK[dtype],
        MX=dtype == "mxfp4",
        QUEST=method == "quest",
        BLOCK_M=_BLOCK_M,
    )
    return out


@lowering("cuda", "fp_quant_linear")
def lower_fp_quant_linear(
    x, weight, scale, rotation, weight_global_scale, act_global_scale, bias, dtype, method
):
    x2 = gemm.rows(x)
    xq = torch.ops.fxquant.triton_fp_quant_quantize(x2, rotation, act_global_scale, dtype, method)
    if dtype == "mxfp4":
        y = torch.ops.fxquant.triton_mxfp4_linear(xq, weight, scale, None)
    else:
        ones = weight_global_scale.new_ones(1, dtype=torch.float32)
        y = torch.ops.fxquant.triton_nvfp4_linear(xq, weight, scale, ones, None)
    y = y / weight_global_scale.float()
    if bias is not None:
        y = y + bias.float()
    return y.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)
