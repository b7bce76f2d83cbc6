"""Reference math of VPTQ (Liu et al., 2024, "VPTQ: Extreme Low-bit Vector Post-Training
Quantization"; transformers' ``VptqConfig``, Microsoft's ``vptq`` package): vectors of
``vector_len`` weights running down the output axis, each the sum of a main codebook entry and a
residual one, with an input-channel permutation and a per-input-column scale and bias.

Where it sits: beside ``fxquant.core.reference``. The scheme ``Vptq``
(``fxquant/core/schemes/vptq.py``) holds checkpoints' constants (``fxquant.checkpoints.vptq``
reads them; VPTQ's codebooks come from hours of second-order-guided k-means, which fxquant does
not run); ``fxquant::vptq_linear`` runs :func:`vptq_linear` as its eager kernel; the CPU lowering
compiles it and the Triton kernel (``fxquant.kernels.vptq``) is tested against it.

Layout (``vptq.layers.vqlinear.VQuantLinear``, packed indices; C codebook groups of G input
columns, in = C·G; Nv = ⌈out / vl⌉ output blocks, the last padded):

- ``indices`` int32 [C, Nv, P]: per (c, n) a bit stream, least significant bit first, of G
  fields of T = log2(K) + log2(R) bits, each ``(residual index << log2(K)) | main index``,
  padded to P 32-bit words (``vptq.utils.pack.pack_index``);
- ``centroids`` [C, K, vl], ``res_centroids`` [C, R, vl] (R = 0: no residual);
- ``perm`` [in]: permuted column k is original column perm[k]; ``weight_scale``,
  ``weight_bias`` [in], per original input column;
- optional ``outliers`` fp32 [out, S]: the first S permuted columns (``outlier_size``), which
  the package codes with a codebook of their own (vectors of ``vector_lens[0]`` down the output
  axis, no residual); the loader decodes them once, since S is a small share of ``in``.

    W'[o, S + c·G + g] = centroids[c, idx[c, o // vl, g], o % vl] + res_centroids[c, ridx, o % vl]
    W'[:, :S] = outliers,   W[:, perm] = W'   (rows past out dropped),
    W = W·diag(scale) + bias (per input column)

which is the package's ``dequant`` (``vptq.ops.quant_gemm``; tests/test_vptq.py compares with
it, outlier columns included).
"""

from __future__ import annotations

import torch
from torch import Tensor

from fxquant.core.reference import _finish


def decode_outliers(codes: Tensor, codebook: Tensor, *, rows: int) -> Tensor:
    """The package's outlier part → fp32 [rows, S]: ``codes`` [⌈rows / ovl⌉, S] (uint16 values
    in int64) index ``codebook`` [K0, ovl], whose vectors run down the output axis like the
    main part's (the last block padded, its tail dropped)."""
    nv, s = codes.shape
    ovl = codebook.shape[1]
    return codebook.float()[codes].permute(0, 2, 1).reshape(nv * ovl, s)[:rows]


def unpack_indices(words: Tensor, *, group_size: int, bits: int) -> Tensor:
    """int32 words [C, Nv, P] → the G fields of ``bits`` bits of each (c, n), int64 [C, Nv, G]:
    field e starts at bit e·bits of the little-endian stream (it may span two words)."""
    w = words.to(torch.int64) & 0xFFFFFFFF
    w = torch.cat([w, torch.zeros_like(w[..., :1])], dim=-1)  # a word past the end for spills
    start = torch.arange(group_size, device=words.device) * bits
    word, shift = start // 32, start % 32
    index = word.expand(*w.shape[:-1], group_size)
    lo, hi = w.gather(-1, index), w.gather(-1, index + 1)
    return ((lo | (hi << 32)) >> shift) & ((1 << bits) - 1)


def dequantize(
    indices: Tensor,
    centroids: Tensor,
    res_centroids: Tensor,
    perm: Tensor,
    weight_scale: Tensor,
    weight_bias: Tensor,
    rows: Tensor,
    outliers: Tensor | None = None,
) -> Tensor:
    """The stored layer → W fp32 [out, in] (module docstring); ``rows`` [out] picks the layer's
    rows of the decoded ones (0 … out-1: the padding of the last vector block is dropped);
    ``outliers`` [out, S], if given, are the first S permuted columns."""
    c, k, vl = centroids.shape
    r = res_centroids.shape[1]
    ib, rb = k.bit_length() - 1, (r.bit_length() - 1 if r > 0 else 0)
    s = 0 if outliers is None else outliers.shape[1]
    g = (perm.shape[0] - s) // c
    merged = unpack_indices(indices, group_size=g, bits=ib + rb)  # [C, Nv, G]
    ar = torch.arange(c, device=indices.device)[:, None, None]
    v = centroids.float()[ar, merged & ((1 << ib) - 1)]  # [C, Nv, G, vl]
    if r > 0:
        v = v + res_centroids.float()[ar, (merged >> ib) & ((1 << rb) - 1)]
    nv = indices.shape[1]
    wp = v.permute(1, 3, 0, 2).reshape(nv * vl, c * g)[rows]  # permuted columns
    if outliers is not None:
        wp = torch.cat([outliers.float(), wp], dim=1)
    w = wp[:, torch.argsort(perm)]
    return w * weight_scale.float() + weight_bias.float()


def vptq_linear(
    x: Tensor,
    weight: Tensor,
    centroids: Tensor,
    res_centroids: Tensor,
    perm: Tensor,
    weight_scale: Tensor,
    weight_bias: Tensor,
    rows: Tensor,
    outliers: Tensor | None = None,
    bias: Tensor | None = None,
) -> Tensor:
    """x [..., in] · the decoded W [out, in] + bias, fp32 accumulation."""
    w = dequantize(
        weight, centroids, res_centroids, perm, weight_scale, weight_bias, rows, outliers
    )
    return _finish(x.float() @ w.t(), bias, x.dtype)
