"""SINQ's calibration-free dual scaling: a grouped low-bit weight with one scale per (row, group)
and one per input column, found by Sinkhorn-style normalisation.

Where it sits: called once per weight at quantize time by ``SinqWeightOnly.quantize``
(``fxquant/core/schemes/lowbit.py``); at run time the op multiplies x by the column scales and
runs the grouped int-N linear of ``IntxWeightOnly`` (``reference_lowbit.sinq_weight_only_linear``).

SINQ (Müller et al., 2025, arXiv 2509.22944) as transformers' ``SinqConfig(method="sinq")`` runs
it (the ``sinq`` package 0.2.0, ``Quantizer.quantize`` with ``method="sinq_quantAux"``,
``tiling_mode="1D"``, on CPU in fp32), step for step:

1. **Kurtosis gate.** If the whole weight's kurtosis E[(w-μ)⁴] / E[(w-μ)²]² exceeds 5, the layer
   is quantized by plain round-to-nearest instead (step 2 is still run and undone: m / μ₁ / μ₂
   · μ₁ · μ₂, as the package does, with unit column scales).
2. **Sinkhorn normalisation**, per tile of ``group_size`` columns (W[:, t·g:(t+1)·g]): for 16
   steps, divide the tile by column factors μ₁ [g] and row factors μ₂ [N] and grow each log-factor
   by log(clamp(std / target, 0.7, 2)) (std: the unbiased standard deviation of the scaled
   tile's columns / rows, clamped to [1e-3, 1e3]; target: the smallest of the unscaled tile's
   clamped row and column stds, plus 1e-6; log-factors clipped to [-0.3, 10]); keep the factors
   of the step with the lowest imbalance (max std / min std over rows and columns), and stop
   updating at the first step whose imbalance rises.
3. **Round to nearest** on the normalised tile, per row: s = max(max - min, 1e-4) / (2ᵇ - 1),
   an integer zero z = -round(min / s), u = clamp(round(w / s + z), 0, 2ᵇ - 1). The row scale
   becomes s · μ₂, the column scale μ₁.
4. **8-bit metadata** ("quantAux"): the [N · K/g] row scales, as a [32, N·K/(32g)] view, are
   rounded to 8 bits per column of that view (x = min + q · (max - min) / 255); the zeros to 8
   bits as one group. The weight is then w = (u - z) · s · μ₁[k] with those rounded s and z.

So W ≈ ((u - z) ⊙ s) · diag(μ₁): fxquant stores u, s and z as ``IntxWeightOnly`` does (a float
zero point) and μ₁ as ``col_scale`` [K], and computes y = (x ⊙ μ₁) · ((u - z) ⊙ s)ᵀ.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["SINQ_KURTOSIS_GATE", "SinqWeight", "sinkhorn_scales", "sinq_quantize"]

SINQ_STEPS = 16  # the package's quantize_dual_scale_shift calls sinkhorn_log(matrix, 16)
SINQ_KURTOSIS_GATE = 5.0
_STD_MIN, _STD_MAX, _TARGET_EPS = 1e-3, 1e3, 1e-6
_STEP_MIN, _STEP_MAX = 0.7, 2.0
_LOG_MIN, _LOG_MAX = -0.3, 10.0
_RANGE_MIN = 1e-4  # the round-to-nearest step's floor on a row's max - min
_AUX_TILE = 32  # the row scales' 8-bit rounding: a [32, -1] view, one group per column


@dataclass
class SinqWeight:
    """One weight, SINQ-quantized: w[n, k] = (u[n, k] - zero[n, k/g]) · scale[n, k/g] · col[k]."""

    codes: torch.Tensor  # uint8 [N, K] in [0, 2**bits - 1]
    scale: torch.Tensor  # fp32 [N, K/g]
    zero: torch.Tensor  # fp32 [N, K/g] (integers before the 8-bit rounding)
    col_scale: torch.Tensor  # fp32 [K]
    gated: bool  # the kurtosis gate chose round-to-nearest (col_scale all ones)

    def dequantize(self) -> torch.Tensor:
        """The weight SINQ's own dequantization gives: ((u - z) · s) · μ₁, in that order."""
        n, k = self.codes.shape
        g = k // self.scale.shape[1]
        u = self.codes.float().reshape(-1, g)
        w = (u - self.zero.reshape(-1, 1)) * self.scale.reshape(-1, 1)
        return w.reshape(n, k) * self.col_scale


def kurtosis(w: torch.Tensor) -> float:
    x = w.float().reshape(-1)
    xc = x - x.mean()
    var = (xc * xc).mean().clamp_min(1e-6)
    return float(xc.pow(4).mean() / (var * var))


def sinkhorn_scales(tile: torch.Tensor, steps: int = SINQ_STEPS):
    """(tile / μ₁ / μ₂, μ₁ [g], μ₂ [N, 1]) for one [N, g] tile: step 2 of the module docstring."""
    m = tile.float()

    def imbalance(t: torch.Tensor) -> torch.Tensor:
        rows, cols = t.std(1), t.std(0)
        lo = torch.minimum(rows.min(), cols.min()).clamp_min(1e-12)
        return torch.maximum(rows.max(), cols.max()) / lo

    target = (
        torch.minimum(
            m.std(1).clamp(_STD_MIN, _STD_MAX).min(), m.std(0).clamp(_STD_MIN, _STD_MAX).min()
        )
        + _TARGET_EPS
    )
    log_col = torch.zeros(m.shape[1])
    log_row = torch.zeros(m.shape[0], 1)
    best = torch.minimum(torch.tensor(float("inf")), imbalance(m))
    col_best, row_best = log_col.exp(), log_row.exp()
    frozen = torch.tensor(0.0)
    for _ in range(steps):
        cur = (m / log_col.exp()) / log_row.exp()
        ib = imbalance(cur)
        better = ib <= best
        best = torch.min(best, ib)
        col_best = torch.where(better, log_col.exp(), col_best)
        row_best = torch.where(better, log_row.exp(), row_best)
        frozen = torch.clip(frozen + (ib > best).float(), max=1.0)
        go = 1.0 - frozen
        std_r = cur.std(1).clamp(_STD_MIN, _STD_MAX)
        std_c = cur.std(0).clamp(_STD_MIN, _STD_MAX)
        step_c = (std_c / target).clamp(_STEP_MIN, _STEP_MAX).log()
        step_r = (std_r[:, None] / target).clamp(_STEP_MIN, _STEP_MAX).log()
        log_col = (log_col + step_c * go).clip(_LOG_MIN, _LOG_MAX)
        log_row = (log_row + step_r * go).clip(_LOG_MIN, _LOG_MAX)
    return m / col_best / row_best, col_best, row_best


def _round_rows(t: torch.Tensor, qmax: int):
    # step 3: per row of the normalised tile, integer zero point
    hi, lo = t.amax(dim=1, keepdim=True), t.amin(dim=1, keepdim=True)
    s = (hi - lo).clamp(min=_RANGE_MIN) / qmax
    z = -torch.round(lo / s)
    u = torch.clamp(torch.round(t / s + z), 0, qmax)
    return u, s, z


def _round8(x: torch.Tensor, groups: int) -> torch.Tensor:
    # step 4: x as a [groups, -1] view, 8 bits per column of it, returned dequantized
    v = x.reshape(groups, -1)
    lo = v.min(0, keepdim=True).values
    v = v - lo
    step = v.max(0, keepdim=True).values / 255
    q = torch.round(v / step).clip(0, 255)
    q = torch.where(step > 0, q, torch.zeros_like(q)).to(torch.uint8)  # a flat column: its min
    return (q * step + lo).reshape(x.shape)


def sinq_quantize(w: torch.Tensor, *, bits: int, group_size: int) -> SinqWeight:
    """W [N, K] → SINQ's codes, row scales, zeros and column scales (module docstring).

    K must be a multiple of ``group_size`` and N · K / group_size a multiple of 32 (the 8-bit
    rounding of the row scales views them as 32 rows; the package fails otherwise).
    """
    n, k = w.shape
    if k % group_size:
        raise ValueError(f"SINQ: K={k} is not a multiple of group_size={group_size}")
    tiles = k // group_size
    if (n * tiles) % _AUX_TILE:
        raise ValueError(
            f"SINQ: N·K/group_size = {n * tiles} row scales are not a multiple of {_AUX_TILE} "
            "(SINQ rounds them to 8 bits in a 32-row view)"
        )
    qmax = 2**bits - 1
    wf = w.float()
    gated = kurtosis(wf) > SINQ_KURTOSIS_GATE
    codes, scales, zeros, cols = [], [], [], []
    for t in range(tiles):
        tile = wf[:, t * group_size : (t + 1) * group_size]
        normed, mu_col, mu_row = sinkhorn_scales(tile)
        if gated:  # undone, as the package does, so its fp32 rounding is the package's too
            normed = normed * mu_col * mu_row
            mu_col, mu_row = torch.ones_like(mu_col), torch.ones_like(mu_row)
        u, s, z = _round_rows(normed, qmax)
        codes.append(u)
        scales.append(s * mu_row)
        zeros.append(z)
        cols.append(torch.ones(1, group_size) * mu_col)
    # [N, tiles] in row-major (n, t) order: the package's [N·tiles, 1]
    scale = torch.cat(scales, dim=1)
    zero = torch.cat(zeros, dim=1)
    scale = _round8(scale.reshape(-1, 1), _AUX_TILE).reshape(n, tiles)
    zero = _round8(zero.reshape(-1, 1), zero.numel()).reshape(n, tiles)
    return SinqWeight(
        codes=torch.cat(codes, dim=1).to(torch.uint8),
        scale=scale.contiguous(),
        zero=zero.contiguous(),
        col_scale=torch.cat(cols, dim=1).reshape(k).contiguous(),
        gated=gated,
    )
