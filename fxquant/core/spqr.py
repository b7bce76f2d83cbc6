"""Reference math of SpQR (Dettmers et al., 2023, "SpQR: A Sparse-Quantized Representation for
Near-Lossless LLM Weight Compression"; transformers' ``SpQRConfig``, the ``spqr_quant`` package):
3-bit weights in 16×16 tiles with 3-bit row scales and zeros that are themselves quantized per
tile (bilevel), plus a sparse matrix of fp16 outliers, in a permuted input-column order.

Where it sits: beside ``fxquant.core.reference``. The scheme ``Spqr``
(``fxquant/core/schemes/spqr.py``) holds checkpoints' constants (``fxquant.checkpoints.spqr``
reads them; SpQR's outlier search and GPTQ-style rounding need calibration, which fxquant does
not run for it); ``fxquant::spqr_linear`` runs :func:`spqr_linear` as its eager kernel.

Layout (``spqr_quant.inference.QuantizedLinear``, W [m, n], m and n multiples of 16; TI = m/16,
TJ = n/16):

- ``dense_weights`` int64 [TI·TJ·16]: word (ti·TJ + tj)·16 + r is row r of tile (ti, tj), bits
  0-2 its scale code, 3-5 its zero code, 6 + 3j the code of column j, 54-61 byte r // 2 of the
  tile's second-level word, four fp16 values (scale of scales, scale of zeros, zero of scales,
  zero of zeros); s = (s_code - zero_of_scales)·scale_of_scales, z likewise, w = (q - z)·s, each
  step in fp16 (the package's kernels);
- ``col_vals`` int32 [nnz]: low 16 bits the (permuted) column, high 16 bits an fp16 value added
  to the dense weight there (in fp32, then rounded to fp16 once); ``row_offsets`` int32 [m + 1]
  (CSR) or [m/16 + 1] (PTCSR: 16 rows interleaved per block);
- ``in_perm`` [n] (two uint16 a word in the file): x_p[k] = x[perm[k]], so W[:, perm] = W_p.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fxquant.core.reference import _finish

TILE = 16


def _half(bits: Tensor) -> Tensor:
    """int64 holding the 16 bits of an fp16 value → that fp16 value."""
    return torch.where(bits >= 32768, bits - 65536, bits).to(torch.int16).view(torch.float16)


def _fp16(lo: Tensor, hi: Tensor) -> Tensor:
    return _half(lo | (hi << 8))


def row_scale_zero(word: Tensor, even_rows: Tensor) -> tuple[Tensor, Tensor]:
    """(s, z) fp16 of tile rows ``word`` (int64 [...]), from the tile's words at rows 0, 2, …,
    14 (int64 [..., 8], broadcast against ``word``; rows 2p and 2p + 1 both carry byte p of the
    statistics)."""
    fr = (even_rows >> 54) & 0xFF
    w_s_s, w_z_s = _fp16(fr[..., 0], fr[..., 1]), _fp16(fr[..., 2], fr[..., 3])
    w_s_z, w_z_z = _fp16(fr[..., 4], fr[..., 5]), _fp16(fr[..., 6], fr[..., 7])
    s = ((word & 7).half() - w_s_z) * w_s_s
    z = (((word >> 3) & 7).half() - w_z_z) * w_z_s
    return s, z


def dense(dense_weights: Tensor, m: int, n: int) -> Tensor:
    """The dense part, fp16 [m, n] in permuted column order."""
    d = dense_weights.to(torch.int64).view(m // TILE, n // TILE, TILE)
    q = torch.stack([(d >> (6 + 3 * j)) & 7 for j in range(TILE)], -1).half()  # [TI, TJ, r, j]
    s, z = row_scale_zero(d, d[..., None, ::2])  # [TI, TJ, 1, 8]: broadcast over the 16 rows
    wp = (q - z[..., None]) * s[..., None]
    return wp.permute(0, 2, 1, 3).reshape(m, n)


def outlier_rows(row_offsets: Tensor, nnz: int, m: int) -> Tensor:
    """The row of each outlier, from CSR (m + 1 offsets) or PTCSR (m/16 + 1) offsets."""
    dev = row_offsets.device
    counts = row_offsets.diff().long()
    if row_offsets.numel() == m + 1:
        return torch.repeat_interleave(torch.arange(m, device=dev), counts, output_size=nnz)
    blocks = torch.repeat_interleave(
        torch.arange(row_offsets.numel() - 1, device=dev), counts, output_size=nnz
    )
    return blocks * TILE + torch.arange(nnz, device=dev) % TILE


def dequantize(
    dense_weights: Tensor, row_offsets: Tensor, col_vals: Tensor, perm: Tensor
) -> Tensor:
    """The stored layer → W fp32 (holding fp16 values) [m, n] (module docstring)."""
    n = perm.shape[0]
    m = dense_weights.shape[0] * TILE // n  # TI·TJ·16 words = m·n / 16
    w = dense(dense_weights, m, n).float()
    if col_vals.numel():
        cv = col_vals.to(torch.int64)
        col = cv & 0xFFFF
        val = _half((cv >> 16) & 0xFFFF)
        rows = outlier_rows(row_offsets, cv.numel(), m)
        w = w.index_put((rows, col), val.float(), accumulate=True)
    w = w.half().float()
    return w[:, torch.argsort(perm)]


def spqr_linear(
    x: Tensor,
    weight: Tensor,
    row_offsets: Tensor,
    col_vals: Tensor,
    perm: Tensor,
    bias: Tensor | None = None,
) -> Tensor:
    """x [..., n] · the decoded W [m, n] + bias, fp32 accumulation."""
    w = dequantize(weight, row_offsets, col_vals, perm)
    return _finish(x.float() @ w.t(), bias, x.dtype)
