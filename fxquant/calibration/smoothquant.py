"""SmoothQuant: move activation outliers into the weights before w8a8 (Xiao et al., 2022).

Where this sits: ``fxquant.calibrate`` runs the float graph over calibration data; at each group
of activation-quantizing linears (``Int8DynamicActivation``, ``Float8Dynamic``) that share one
normed input ``x``, it calls ``smoothing_scale`` with the per-channel maxima of ``|x|`` and of the
group's weights, and folds ``s`` into the norm (``fxquant/fold.py``): ``γ ← γ/s``,
``W ← W·diag(s)``. Per-token activation quantization then meets a flatter ``x``; the float
model is unchanged. The program is quantized afterwards by ``fxquant.quantize`` as usual.

``s_j = max|X_j|^α / max|W_·j|^(1-α)``, with the weight maxima and ``s`` clamped to 1e-5 as
the reference does (mit-han-lab/smoothquant ``smooth_ln_fcs``), so a channel that is always
zero (in x or in W) never divides by zero.
"""

from __future__ import annotations

import torch

__all__ = ["smoothing_scale"]


@torch.no_grad()
def smoothing_scale(act_max: torch.Tensor, weight: torch.Tensor, *, alpha: float) -> torch.Tensor:
    """The migration scale ``s`` [K] for input-channel maxima ``act_max`` [K] and the group's
    stacked weight ``weight`` [N, K]."""
    w_max = weight.float().abs().amax(dim=0).clamp(min=1e-5)
    return (act_max.float().pow(alpha) / w_max.pow(1 - alpha)).clamp(min=1e-5)
