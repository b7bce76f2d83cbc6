"""Reference math of AQLM (Egiazarian et al., 2024, "Extreme Compression of Large Language Models
via Additive Quantization"; transformers' ``AqlmConfig``, the ``aqlm`` package): each group of
``out_group_size`` × ``in_group_size`` weights is the sum of one learned codeword from each of
``num_codebooks`` codebooks, times a scale per output group.

Where it sits: beside ``fxquant.core.reference``. The scheme ``Aqlm``
(``fxquant/core/schemes/aqlm.py``) holds checkpoints' constants (``fxquant.checkpoints.aqlm``
reads them; AQLM codebooks are learned over hours of calibration, so fxquant does not quantize a
float model to AQLM); ``fxquant::aqlm_linear`` runs :func:`aqlm_linear` as its eager kernel; the
CPU lowering compiles it and the Triton kernel (``fxquant.kernels.aqlm``) is tested against it.

Layout (``aqlm.inference.QuantizedLinear``, W [N, K]): ``codes`` [N/og, K/ig, C] integers in
[0, 2^b) (the package stores them in int8 / int16 with values ≥ 2^(b-1) wrapped negative; the
reader unwraps them), ``codebooks`` [C, 2^b, og, ig], ``scales`` [N/og] (stored [N/og, 1, 1, 1]):

    W[o·og + r, i·ig + j] = scales[o] · Σ_c codebooks[c, codes[o, i, c], r, j]

which is the package's ``_dequantize_weight`` (tests/test_aqlm.py compares with it).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fxquant.core.reference import _finish


def dequantize(codes: Tensor, codebooks: Tensor, scales: Tensor) -> Tensor:
    """(codes [Go, Gi, C], codebooks [C, S, og, ig], scales [Go]) → W fp32 [Go·og, Gi·ig]."""
    go, gi, c = codes.shape
    _, size, og, ig = codebooks.shape
    offsets = torch.arange(c, device=codes.device) * size
    flat = codebooks.float().flatten(0, 1)  # [C·S, og, ig]
    words = flat[(codes.long() + offsets).flatten()].unflatten(0, (go, gi, c)).sum(2)
    w = words * scales.float().reshape(go, 1, 1, 1)  # [Go, Gi, og, ig]
    return w.transpose(1, 2).reshape(go * og, gi * ig)


def aqlm_linear(
    x: Tensor, weight: Tensor, codebooks: Tensor, scale: Tensor, bias: Tensor | None = None
) -> Tensor:
    """x [..., K] · the decoded W [N, K] + bias, fp32 accumulation."""
    return _finish(x.float() @ dequantize(weight, codebooks, scale).t(), bias, x.dtype)
