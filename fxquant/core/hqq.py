"""HQQ's calibration-free optimizer: refine the zero points of a grouped low-bit weight.

Where it sits: called once per weight at quantize time by
``fxquant.core.reference_lowbit.quantize_intx_grouped`` for ``IntxWeightOnly(optimizer="hqq")``
(``zero_point="float"``); nothing at run time changes, the op just reads a better zero point.

Half-Quadratic Quantization (Badri & Shaji, 2023) minimises ||W - dequant(quant(W))||_p^p with
p < 1, which fits the heavy-tailed quantization error better than p = 2, by splitting it with an
auxiliary error variable W_e and alternating two closed-form steps:

1. W_e ← shrink_p(W - W_r, β): the proximal operator of the l_p norm, a generalised soft
   threshold sign(e) · relu(|e| - |e|^(p-1) / β);
2. z ← mean over the group of (W_q - (W - W_e) · i): the least-squares zero point given W_e
   (i is the inverse scale, which HQQ keeps fixed);

with β growing by κ each iteration. This is the default solver of the reference implementation
(mobiusml/hqq ``optimize_weights_proximal_legacy``) step for step, with its defaults (p = 0.7,
β = 10, κ = 1.01, 20 iterations) and its early stop: the loop ends at the first iteration whose
mean |W - W_r| (over the whole tensor) is not below the best so far; the zero point it returns
is the one updated in that last iteration, as the reference does. It runs here in fp32 (HQQ runs
it in fp16 on CUDA, fp32 on CPU).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

LP_NORM = 0.7
BETA = 10.0
KAPPA = 1.01
ITERS = 20


@dataclass
class HqqResult:
    zero: torch.Tensor  # the refined float zero points, same shape as the initial ones
    errors: list[float]  # mean |W - W_r| at each iteration run (the early-stop criterion)


def shrink_lp(e: torch.Tensor, beta: float, p: float) -> torch.Tensor:
    """The l_p proximal step: sign(e) · relu(|e| - |e|^(p-1) / β) (p = 1: soft threshold).

    e = 0 gives |e|^(p-1) = inf and relu(-inf) = 0, so zero errors stay exactly zero."""
    a = e.abs()
    if p == 1:
        return torch.sign(e) * torch.relu(a - 1.0 / beta)
    return torch.sign(e) * torch.relu(a - a.pow(p - 1) / beta)


@torch.no_grad()
def optimize_zero(
    groups: torch.Tensor,
    inv_scale: torch.Tensor,
    zero: torch.Tensor,
    *,
    qmax: int,
    lp_norm: float = LP_NORM,
    beta: float = BETA,
    kappa: float = KAPPA,
    iters: int = ITERS,
) -> HqqResult:
    """Refine the zero points of ``groups`` [G, g] (one group per row, HQQ's axis=1).

    Args:
        groups: the weight, fp32, one quantization group per row.
        inv_scale: [G, 1] the inverse scale i (codes are round(w · i + z)); not changed.
        zero: [G, 1] the initial (float) zero points.
        qmax: the largest code, 2**bits - 1.
        lp_norm, beta, kappa, iters: HQQ's p, β, κ and iteration cap.

    Returns:
        ``HqqResult`` with the refined zero points and the error history.
    """
    if not 0 < lp_norm <= 1:
        raise ValueError(f"lp_norm={lp_norm!r} is not supported; allowed: 0 < p <= 1")
    if beta <= 0 or kappa <= 1 or iters < 1:
        raise ValueError(
            f"beta={beta!r}, kappa={kappa!r}, iters={iters!r}: need beta > 0, kappa > 1, iters >= 1"
        )
    w = groups.float()
    inv = inv_scale.float()
    zero = zero.float().clone()
    best = float("inf")
    errors: list[float] = []
    for _ in range(iters):
        wq = torch.round(w * inv + zero).clamp(0, qmax)
        wr = (wq - zero) / inv
        we = shrink_lp(w - wr, beta, lp_norm)
        zero = (wq - (w - we) * inv).mean(dim=-1, keepdim=True)
        beta *= kappa
        err = float((w - wr).abs().mean())
        errors.append(err)
        if err < best:
            best = err
        else:
            break
    return HqqResult(zero, errors)
