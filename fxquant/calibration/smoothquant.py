"""SmoothQuant: move activation outliers into the weights before w8a8 (Xiao et al., 2022).

Where this sits: ``fxquant.calibrate`` runs the float graph over calibration data
(``fxquant/calibration/interpreter.py``); at each group of activation-quantizing linears
(``Int8DynamicActivation``, ``Float8Dynamic``) that share one normed input ``x``,
``SmoothQuantRun`` (the driver, below) calls ``smoothing_scale`` with the per-channel maxima of
``|x|`` and of the group's weights, and folds ``s`` into the norm
(``fxquant/calibration/fold.py``): ``γ ← γ/s``, ``W ← W·diag(s)``. Per-token activation
quantization then meets a flatter ``x``; the float model is unchanged. The program is quantized
afterwards by ``fxquant.quantize`` as usual.

``s_j = max|X_j|^α / max|W_·j|^(1-α)``, with the weight maxima and ``s`` clamped to 1e-5 as
the reference does (mit-han-lab/smoothquant ``smooth_ln_fcs``), so a channel that is always
zero (in x or in W) never divides by zero.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from fxquant.calibration.fold import find_absorber
from fxquant.calibration.interpreter import CalibrationRun
from fxquant.calibration.methods import SmoothQuant
from fxquant.core import reference as ref
from fxquant.core.config import Float8Dynamic, Int8DynamicActivation, Scheme
from fxquant.passes.plan import LayerPlan

__all__ = ["SmoothQuantRun", "smoothing_scale"]

_SMOOTH_SCHEMES = (Int8DynamicActivation, Float8Dynamic)


@torch.no_grad()
def smoothing_scale(act_max: torch.Tensor, weight: torch.Tensor, *, alpha: float) -> torch.Tensor:
    """The migration scale ``s`` [K] for input-channel maxima ``act_max`` [K] and the group's
    stacked weight ``weight`` [N, K]."""
    w_max = weight.float().abs().amax(dim=0).clamp(min=1e-5)
    return (act_max.float().pow(alpha) / w_max.pow(1 - alpha)).clamp(min=1e-5)


# --------------------------------------------------------------------------------------------
# The driver: SmoothQuant at each group of planned linears of a calibration run
# --------------------------------------------------------------------------------------------


class SmoothQuantRun(CalibrationRun):
    """``method=SmoothQuant(...)``: the activation-quantizing linears reading one normed input get
    one migration scale, folded into the norm."""

    def calibrate_group(self, x: fx.Node, group: list[LayerPlan]) -> None:
        m: SmoothQuant = self.method
        act = []
        for p in group:
            if p.scheme is None:
                continue
            if not isinstance(p.scheme, _SMOOTH_SCHEMES):
                self._skip(
                    p, f"SmoothQuant is for activation-quantizing schemes, not "
                    f"{type(p.scheme).__name__}",
                )  # fmt: skip
            else:
                act.append(p)
        if not act:
            return
        shared = [p.site.weight_fqn for p in group if self.weight_uses[p.site.weight_fqn] > 1]
        absorber = (
            f"{shared[0]} is shared by several linears"
            if shared
            else find_absorber(
                x, [p.site for p in group], self.sites_by_node, self.param_of, allow_linear=False
            )
        )
        if isinstance(absorber, str):
            for p in act:
                self._skip(p, f"no smoothing: {absorber}")
            return
        k = group[0].site.in_features
        stats = self._stats(x, k)
        sample = self._token_sample(x, k, 2048)
        before = {p.site.weight_fqn: self.weight_nk(p.site).float() for p in act}
        weights = torch.cat([self.weight_nk(p.site).float() for p in group])
        s = smoothing_scale(stats["absmax"], weights, alpha=m.alpha)
        self._fold(x, group, absorber, s)
        amax_after = stats["absmax"] / s
        for p in act:
            w_after = self.weight_nk(p.site).float()
            y = sample @ before[p.site.weight_fqn].t()
            self.records[p.site.weight_fqn] = {
                "method": "smoothquant",
                "status": "calibrated",
                "tokens": stats["tokens"],
                "alpha": m.alpha,
                "folded_into": f"{absorber.kind} {absorber.name}",
                "act_absmax_before": float(stats["absmax"].max()),
                "act_absmax_after": float(amax_after.max()),
                "output_mse_rtn": _mse(_simulate(p.scheme, sample, before[p.site.weight_fqn]), y),
                "output_mse": _mse(_simulate(p.scheme, sample / s, w_after), y),
                "output_mse_tokens": sample.shape[0],
            }

    def _token_sample(self, x: fx.Node, k: int, n: int) -> torch.Tensor:
        """The first ``n`` calibration tokens reaching ``x`` as fp32 [n, K]."""
        v = self.env[x]
        rows = torch.cat([t.reshape(-1, k) for t in (v if isinstance(v, list) else [v.value])])
        return rows[:n].float()


def _mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).pow(2).mean())


def _simulate(scheme: Scheme, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """The scheme's reference linear on ``x`` with round-to-nearest weights (no bias)."""
    q = scheme.quantize(w).tensors
    if isinstance(scheme, Int8DynamicActivation):
        return ref.int8_dynamic_linear(x, q["qweight"], q["scale"])
    return ref.float8_dynamic_linear(
        x, q["qweight"], q["scale"], per_row=scheme.per_row,
        activation_scale_ub=scheme.activation_scale_ub,
    )  # fmt: skip
