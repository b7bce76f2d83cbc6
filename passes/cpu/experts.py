"""The CPU lowering of the mixture-of-experts GEMMs (``int8_weight_only_grouped_mm``,
``mxfp4_grouped_mm``): each row of x [S, K] times its own expert's weight.

Where it sits: registered by op name (``fxquant.core.registry``) and read by the lowering pass
(``fxquant.passes.lower``); the oracles are ``fxquant.core.reference.grouped_linear`` and the ops'
references.

The reference loops over experts and slices rows at data-dependent offsets, which does not trace
into aten. Here every row gathers its expert's weight (``weight[ids]`` with ``ids`` from
``offs``) and reduces over K in one product Inductor fuses: no [S, N, K] copy is made, the loads
are indirect. Decode (S = top-k rows) reads only the experts its token chose, in their stored
bytes (int8: a quarter of fp32's); prefill reads each expert's weight once per row, not once per
expert, which the cache absorbs while rows are sorted by expert. Measured on a 2-core Zen 4 (32
experts of 1024 × 1024, Inductor, against transformers' fallback loop on fp32 weights): S = 4
2.0× faster, S = 16 4.9×, S = 64 3.7×, S = 512 about even. MXFP4's e2m1 decode is dear per
value: its gather serves decode (2-3 ms where one GEMM of every row with every expert took 54
ms), that dense GEMM prefill (past three rows per expert).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

import fxquant.core.ops  # noqa: F401  (registers the fxquant:: ops)
import fxquant.kernels.cpu  # noqa: F401  (declares the fxquant::native_* ops)
from fxquant.core import reference as ref
from fxquant.core import reference_mx as ref_mx
from fxquant.core.registry import lowering
from fxquant.passes.cpu.common import NATIVE
from fxquant.passes.cpu.dispatch import by_plan

fxq = torch.ops.fxquant


def per_row_expert(x: Tensor, offs: Tensor, experts: int, product: Callable) -> Tensor:
    """fp32 [S, N]: ``product(x, ids)`` with ``ids`` [S] each row's expert, zeros for the rows
    past ``offs[-1]`` (no expert owns them, as in the reference)."""
    ids = ref.expert_of_rows(offs, x.shape[0])
    owned = ids < experts
    y = product(x.float(), ids.clamp(max=experts - 1))
    return torch.where(owned[:, None], y, 0.0)


@lowering(NATIVE, "int8_weight_only_grouped_mm")
def _native_int8_weight_only_grouped_mm(x, weight, scale, offs):
    # the native kernel splits the rows by expert on the host and runs each expert's rows on the
    # int8 linear's own GEMV / GEMM (kernels/cpu/int8_fp8.cpp): fp32 x, the reference's products
    y = fxq.native_int8_weight_only_grouped_mm(
        x.float().contiguous(), weight.contiguous(), scale.float().contiguous(), offs.long()
    )
    return y.to(x.dtype)


@lowering("cpu", "int8_weight_only_grouped_mm")
def _int8_weight_only_grouped_mm(x, weight, scale, offs):
    def product(xf, ids):  # the codes' product, then the scale (the reference's order)
        return (xf[:, None, :] * weight[ids].float()).sum(-1) * scale[ids]

    return per_row_expert(x, offs, weight.shape[0], product).to(x.dtype)


# Measured on a 2-core Zen 4 (32 experts of 1024 × 1024, Inductor): the gather costs about 2 ms a
# row, the dense path about 230 ms at any S up to 512, so they cross near 3.5 rows per expert.
_GATHER_ROWS_PER_EXPERT = 3


@lowering("cpu", "mxfp4_grouped_mm")
def _mxfp4_grouped_mm(x, weight, scale, offs):
    # Per row, the gather decodes one expert's N·K values; the dense path decodes all E·N·K
    # once and multiplies every row by every expert ([S, E·N], each row keeping its expert's N
    # columns). Both scale with N·K, so they cross at a number of rows proportional to E.
    e = weight.shape[0]
    plan = [(_GATHER_ROWS_PER_EXPERT * e, "gather"), (None, "dense")]
    return by_plan(plan, x.shape[0], _MXFP4, x, weight, scale, offs)


def _mxfp4_gather(x, weight, scale, offs):
    def product(xf, ids):  # e2m1 decode of the gathered bytes, inside the reduction
        return (xf[:, None, :] * ref_mx.dequantize_mxfp4_weight(weight[ids], scale[ids])).sum(-1)

    return per_row_expert(x, offs, weight.shape[0], product).to(x.dtype)


def _mxfp4_dense(x, weight, scale, offs):
    e, n = weight.shape[0], weight.shape[1]
    w = ref_mx.dequantize_mxfp4_weight(weight, scale)  # [E, N, K]

    def product(xf, ids):
        every = (xf @ w.flatten(0, 1).t()).unflatten(-1, (e, n))  # [S, E, N]
        return every.gather(1, ids[:, None, None].expand(-1, 1, n)).squeeze(1)

    return per_row_expert(x, offs, e, product).to(x.dtype)


_MXFP4 = {"gather": _mxfp4_gather, "dense": _mxfp4_dense}
