"""The CUDA lowering table: each semantic ``fxquant::`` op → the Triton ops of ``fxquant.kernels``.

Used by ``fxquant.passes.lower.lowerings("cuda")`` (the last pass before Inductor or
AOTInductor on a CUDA program). Each entry is a small aten-level composition around one or two
``fxquant::triton_*`` ops: those are ``torch.library.triton_op``s, so Inductor traces into their
``wrap_triton`` kernels and AOTInductor embeds the compiled kernels in the package, and the
package runs where fxquant is not installed.

No prepack on CUDA: the kernels read the rewrite pass's storage layouts as they are (W [N, K]
row-major, int4 packed along K), so a quantized ``.pt2`` lowers for either device.

Imported only when a CUDA lowering is asked for: importing ``fxquant.kernels`` defines Triton
kernels, which CPU-only work never needs.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

import fxquant.core.ops  # noqa: F401
import fxquant.kernels.bitnet  # noqa: F401  (each import registers its fxquant::triton_* ops)
import fxquant.kernels.bnb4_weight_only  # noqa: F401
import fxquant.kernels.float8_block  # noqa: F401
import fxquant.kernels.float8_dynamic  # noqa: F401
import fxquant.kernels.float8_weight_only  # noqa: F401
import fxquant.kernels.int4_weight_only  # noqa: F401
import fxquant.kernels.int8_dynamic  # noqa: F401
import fxquant.kernels.int8_weight_only  # noqa: F401
import fxquant.kernels.intx_weight_only  # noqa: F401
import fxquant.kernels.llm_int8  # noqa: F401
import fxquant.kernels.mxfp4  # noqa: F401
import fxquant.kernels.mxfp4_grouped  # noqa: F401
import fxquant.kernels.mxfp8  # noqa: F401
import fxquant.kernels.norm_quant  # noqa: F401
import fxquant.kernels.nvfp4  # noqa: F401
import fxquant.kernels.quantize  # noqa: F401
from fxquant.core import reference as ref
from fxquant.core import reference_mx as ref_mx
from fxquant.kernels.configs import DECODE_MAX_M

fxq = torch.ops.fxquant


def _rows(t: Tensor) -> Tensor:
    return t.reshape(-1, t.shape[-1])


def _gemm(op, args: tuple, m) -> Tensor:
    """``op(*args)``, a GEMM whose last argument ``decode`` picks its kernel, on M rows.

    When M is known (a number, or a symbol whose range settles it) the op picks its own path.
    A dynamic M gets both paths under ``torch.cond(M <= DECODE_MAX_M, decode, prefill)``: one
    artifact then runs the split-K GEMV at M = 1 and the tiled kernel at M = 2048, chosen when
    it runs (the op alone could only take the path that is right for every M, the tiled one).
    ``torch.cond`` takes the tensor arguments as operands; the rest go in by keyword.
    """
    if statically_known_true(m <= DECODE_MAX_M) or statically_known_true(m > DECODE_MAX_M):
        return op(*args)
    names = [a.name for a in op._schema.arguments]
    tensors = {n: a for n, a in zip(names, args, strict=False) if isinstance(a, Tensor)}
    # Everything else (None bias, group size, dtype) goes in by keyword through the branch:
    # passed positionally, Dynamo lifted the ints into the branches' operands, which export's
    # placeholder naming pass cannot take ("'int' object has no attribute 'name'").
    fixed = {n: a for n, a in zip(names, args, strict=False) if n not in tensors}

    def branch(decode: bool):
        def run(*ts):
            return op(**dict(zip(tensors, ts, strict=True)), **fixed, decode=decode)

        return run

    # Dynamo traces every branch from this same code, so an int of `fixed` that differs between
    # two GEMMs (int2 and int3 layers in one program, or two group sizes in one process) would
    # be made a dynamic input by automatic-dynamic and lifted into the operands again (the
    # error above). The branches' tensor shapes come from the operands, so this loses nothing.
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        return torch.cond(m <= DECODE_MAX_M, branch(True), branch(False), tuple(tensors.values()))


def _weight_only(op):
    def lowering(x, *rest):
        x2 = _rows(x)
        y = _gemm(op, (x2, *rest), x2.shape[0])
        return y.reshape(*x.shape[:-1], y.shape[-1])

    return lowering


def _scaled(mm):
    """A *_scaled_mm on [..., K] activations: 2-D for the kernel, the leading dims back after.

    Per-token / per-group scales ([..., 1], [..., G]) flatten with the rows; a per-tensor
    scale ([1]) is left as it is.
    """

    def lowering(xq, xs, *rest):
        xq2 = _rows(xq)
        xs2 = xs if xs.dim() == 1 else _rows(xs)
        y = _gemm(mm, (xq2, xs2, *rest), xq2.shape[0])
        return y.reshape(*xq.shape[:-1], y.shape[-1])

    return lowering


_int8_scaled = _scaled(fxq.triton_int8_scaled_mm.default)
_float8_scaled = _scaled(fxq.triton_float8_scaled_mm.default)
_float8_block_scaled = _scaled(fxq.triton_float8_block_scaled_mm.default)


def _int8_dynamic(x, weight, scale, bias):
    xq, xs = fxq.triton_quantize_int8_per_token(_rows(x))
    y = _int8_scaled(xq, xs, weight, scale, bias, x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _int8_dynamic_int4(x, weight, scale, zero, bias, group_size):
    # W4A8: the per-token int8 grid from the quantize kernel, then int4 weight-only's GEMM on
    # the dequantized activation (exact in fp32: the reference's numerics)
    xq, xs = fxq.triton_quantize_int8_per_token(_rows(x))
    xd = xq.float() * xs.reshape(-1, 1)
    y = _weight_only(fxq.triton_int4_weight_only_linear.default)(
        xd, weight, scale, zero, bias, group_size
    )
    return y.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)


def _float8_dynamic(x, weight, scale, bias, per_row, activation_scale_ub):
    if per_row:
        xq, xs = fxq.triton_quantize_fp8_per_token(_rows(x), activation_scale_ub)
    else:
        xq, xs, _ = fxq.triton_quantize_fp8_per_tensor(_rows(x), activation_scale_ub)
    y = _float8_scaled(xq, xs, weight, scale, bias, x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _float8_static(x, weight, scale, activation_scale, bias):
    # a fixed scale needs no reduction: Inductor fuses this cast into one pointwise kernel
    xq = ref.quantize_fp8_static(x, activation_scale)
    return _float8_scaled(xq, activation_scale, weight, scale, bias, x.dtype)


def _float8_block(x, weight, scale, bias, block_size):
    xq, xs = fxq.triton_quantize_fp8_groups(_rows(x), block_size)
    y = _float8_block_scaled(xq, xs, weight, scale, bias, block_size, x.dtype)
    return y.reshape(*x.shape[:-1], weight.shape[0])


def _norm_quant(x, weight, bias, eps, rms, quant_dtype, group_size, scale_ub):
    q, scale, _ = fxq.triton_norm_quant(
        x, weight, bias, eps, rms, quant_dtype, group_size, scale_ub, False
    )
    return q, scale


# Microscaling formats: the activation is quantized (and dequantized) in aten ops, which Inductor
# fuses into its own kernels, and the Triton GEMM dequantizes the weight; the kernels return fp32.


def _mxfp8(x, weight, scale, bias, scale_rule):
    xd = ref_mx.mx_fake_quantize(_rows(x), elem="e4m3", rule=scale_rule)
    y = fxq.triton_mxfp8_linear(xd, weight, scale, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)


def _mxfp4(x, weight, scale, bias, activations, scale_rule):
    x2 = _rows(x)
    if activations:
        x2 = ref_mx.mx_fake_quantize(x2, elem="e2m1", rule=scale_rule)
    y = fxq.triton_mxfp4_linear(x2, weight, scale, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)


def _nvfp4(x, weight, scale, tensor_scale, bias, activations, scale_rule):
    x2 = _rows(x)
    if activations:
        x2 = ref_mx.nvfp4_fake_quantize(x2, rule=scale_rule)
    y = fxq.triton_nvfp4_linear(x2, weight, scale, tensor_scale, bias)
    return y.reshape(*x.shape[:-1], weight.shape[0]).to(x.dtype)


def _mxfp4_grouped_mm(x, weight, scale, offs):
    # the kernel takes the op as it is (x [S, K] sorted by expert) and returns x's dtype
    return fxq.triton_mxfp4_grouped_mm(x, weight, scale, offs)


CUDA_LOWERINGS = {
    fxq.int8_weight_only_linear.default: _weight_only(fxq.triton_int8_weight_only_linear.default),
    fxq.int4_weight_only_linear.default: _weight_only(fxq.triton_int4_weight_only_linear.default),
    fxq.float8_weight_only_linear.default: _weight_only(
        fxq.triton_float8_weight_only_linear.default
    ),
    fxq.int8_dynamic_linear.default: _int8_dynamic,
    fxq.int8_dynamic_int4_linear.default: _int8_dynamic_int4,
    fxq.float8_dynamic_linear.default: _float8_dynamic,
    fxq.float8_static_linear.default: _float8_static,
    fxq.float8_block_linear.default: _float8_block,
    fxq.int8_scaled_linear.default: _int8_scaled,
    fxq.float8_scaled_linear.default: _float8_scaled,
    fxq.float8_block_scaled_linear.default: _float8_block_scaled,
    fxq.norm_quant.default: _norm_quant,
    fxq.intx_weight_only_linear.default: _weight_only(fxq.triton_intx_weight_only_linear.default),
    fxq.bitnet_linear.default: _weight_only(fxq.triton_bitnet_linear.default),
    fxq.bnb4_weight_only_linear.default: _weight_only(fxq.triton_bnb4_weight_only_linear.default),
    # the outlier column mask is computed inside the op (an aten reduction before the kernels)
    fxq.llm_int8_linear.default: _weight_only(fxq.triton_llm_int8_linear.default),
    fxq.mxfp8_linear.default: _mxfp8,
    fxq.mxfp4_linear.default: _mxfp4,
    fxq.mxfp4_grouped_mm.default: _mxfp4_grouped_mm,
    fxq.nvfp4_linear.default: _nvfp4,
}
