"""AWQ: activation-aware per-input-channel scales for int4 weights (Lin et al., 2023).

Where this sits: ``fxquant.calibrate`` runs the float graph over calibration data
(``fxquant/calibration/interpreter.py``); at each group of linears that share one input ``x``
(q/k/v after a norm, gate/up, down after up, …) ``AWQRun`` (the driver, at the end of this module)
calls ``search_scale`` with the group's weights and the statistics of ``x``, then folds the chosen
``s`` into the op before ``x`` (``fxquant/calibration/fold.py``): ``W ← W·diag(s)``,
``x ← x/s``, the float model unchanged. Salient input channels (large mean ``|x|``) get larger
weights, so rounding hurts them less. ``search_clip`` then shrinks each group's weight range
where that lowers the output error. The weights are quantized afterwards by plain
round-to-nearest (``fxquant.quantize``): AWQ changes the float weights, not the rounding.

As in llm-awq: ``s = mean|x|^α`` per input channel, normalised by ``sqrt(max·min)``, α over a grid
in [0, 1); the loss is the output MSE of the quantized group. Unlike llm-awq, which runs the
whole attention/MLP module on a token subsample for each α, the loss here is the MSE of the
group's linear outputs, computed exactly over *all* calibration tokens from ``Σ = XᵀX / n``:
``mean((X Dᵀ)²) = tr(D Σ Dᵀ) / N`` for the weight error ``D``, one [N, K]×[K, K] product per α.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxquant.calibration.fold import find_absorber
from fxquant.calibration.interpreter import CalibrationRun
from fxquant.calibration.methods import AWQ
from fxquant.core.config import Int4WeightOnly, name_matches
from fxquant.passes.plan import LayerPlan

__all__ = ["AWQRun", "ScaleSearch", "output_mse", "search_clip", "search_scale"]


def output_mse(d: torch.Tensor, sigma: torch.Tensor) -> float:
    """Mean over outputs of ``((W - Q) x)²`` for the weight error ``d`` [N, K], ``Σ = E[x xᵀ]``."""
    return float(((d @ sigma) * d).sum() / d.shape[0])


def _rtn(scheme: Int4WeightOnly, w: torch.Tensor) -> torch.Tensor:
    """Round-to-nearest dequantized, exactly as ``fxquant.quantize`` will store it."""
    return scheme.quantize(w).dequantized


@dataclass
class ScaleSearch:
    scale: torch.Tensor  # [K], multiply the weights' columns, divide the input
    alpha: float  # the chosen exponent
    loss_rtn: float  # group output MSE with s = 1 (plain round-to-nearest)
    loss: float  # group output MSE with the chosen s


@torch.no_grad()
def search_scale(
    weight: torch.Tensor,
    sigma: torch.Tensor,
    x_absmean: torch.Tensor,
    scheme: Int4WeightOnly,
    *,
    n_grid: int = 20,
) -> ScaleSearch:
    """Grid-search ``s = mean|x|^α`` for the stacked group weight ``weight`` [N, K].

    Args:
        weight: the group's weights stacked along N (rows are independent under RTN).
        sigma: ``E[x xᵀ]`` [K, K] over the calibration tokens.
        x_absmean: ``E|x|`` per input channel, [K].
        scheme: the int4 scheme the group will be stored in.
        n_grid: α = 0, 1/n_grid, …, (n_grid-1)/n_grid.
    """
    w = weight.float()
    best: ScaleSearch | None = None
    loss_rtn = float("nan")
    for i in range(n_grid):
        alpha = i / n_grid
        s = x_absmean.float().pow(alpha).clamp(min=1e-4)
        s = s / (s.max() * s.min()).sqrt()
        q = _rtn(scheme, w * s) / s
        loss = output_mse(w - q, sigma)
        if i == 0:
            loss_rtn = loss
        if best is None or loss < best.loss:
            best = ScaleSearch(s, alpha, loss_rtn, loss)
    best.loss_rtn = loss_rtn
    return best


@torch.no_grad()
def search_clip(
    weight: torch.Tensor,
    sigma: torch.Tensor,
    scheme: Int4WeightOnly,
    *,
    n_grid: int = 20,
    max_shrink: float = 0.5,
) -> tuple[torch.Tensor, float, float]:
    """Per (row, group): the clipping range ``±r·amax`` (r from 1 down to ``1 - max_shrink``)
    whose quantized group contributes the least output error, as llm-awq's ``auto_clip``.

    The error of one row's group g is ``d_g Σ_gg d_gᵀ`` (its share of the output error, ignoring
    the cross terms between groups, as llm-awq's per-group loss does).

    Returns:
        (clipped weight [N, K], output MSE before, output MSE after), MSEs over the full ``Σ``;
        the weight is returned unclipped when clipping does not lower the full MSE.
    """
    w = weight.float()
    n, k = w.shape
    g = scheme.group_size
    kp = scheme.padded_in_features(k)
    wp = F.pad(w, (0, kp - k)).reshape(n, kp // g, g)
    sp = F.pad(sigma.float(), (0, kp - k, 0, kp - k))
    blocks = torch.stack([sp[i : i + g, i : i + g] for i in range(0, kp, g)])  # [G, g, g]
    org_max = wp.abs().amax(dim=-1, keepdim=True)
    best_err = torch.full((n, kp // g), float("inf"))
    best_max = org_max.clone()
    for i in range(int(max_shrink * n_grid)):
        max_val = org_max * (1 - i / n_grid)
        cur = torch.clamp(wp, -max_val, max_val)
        q = _rtn(scheme, cur.reshape(n, kp)[:, :k])
        d = F.pad(w - q, (0, kp - k)).reshape(n, kp // g, g)
        err = torch.einsum("ngi,gij,ngj->ng", d, blocks, d)
        better = err < best_err
        best_err = torch.where(better, err, best_err)
        best_max = torch.where(better[..., None], max_val, best_max)
    clipped = torch.clamp(wp, -best_max, best_max).reshape(n, kp)[:, :k]
    before = output_mse(w - _rtn(scheme, w), sigma)
    after = output_mse(w - _rtn(scheme, clipped), sigma)
    if not after < before:  # the per-group choice ignores cross-group terms: keep what is better
        return weight, before, before
    return clipped.to(weight.dtype), before, after


# --------------------------------------------------------------------------------------------
# The driver: AWQ at each group of planned linears of a calibration run
# --------------------------------------------------------------------------------------------


class AWQRun(CalibrationRun):
    """``method=AWQ(...)``: the int4 linears reading one input get one searched scale, folded into
    the op before it; then each weight's clipping range is searched."""

    def calibrate_group(self, x: fx.Node, group: list[LayerPlan]) -> None:
        m: AWQ = self.method
        int4 = []
        for p in group:
            if p.scheme is None:
                continue
            if not isinstance(p.scheme, Int4WeightOnly):
                self._skip(
                    p, f"AWQ searches scales for int4 weights, not {type(p.scheme).__name__}"
                )
            else:
                int4.append(p)
        if not int4:
            return
        schemes = {p.scheme for p in int4}
        if len(schemes) > 1:
            for p in int4:
                self._skip(p, "the linears sharing this input have different int4 schemes")
            return
        scheme = int4[0].scheme
        k = group[0].site.in_features
        stats = self._stats(x, k)
        sigma = stats["sigma"]
        orig = {p.site.weight_fqn: self.weight_nk(p.site).float() for p in int4}
        shared = [p.site.weight_fqn for p in group if self.weight_uses[p.site.weight_fqn] > 1]
        absorber = (
            f"{shared[0]} is shared by several linears"
            if shared
            else find_absorber(
                x, [p.site for p in group], self.sites_by_node, self.param_of, allow_linear=True
            )
        )
        rec: dict[str, Any] = {"method": "awq", "tokens": stats["tokens"]}
        s = torch.ones(k)
        if isinstance(absorber, str):
            rec.update(status="skipped", note=f"scale not folded: {absorber}")
        else:
            found = search_scale(
                torch.cat(list(orig.values())), sigma, stats["absmean"], scheme, n_grid=m.n_grid
            )
            s = found.scale
            self._fold(x, group, absorber, s)
            rec.update(
                status="calibrated",
                folded_into=f"{absorber.kind} {absorber.name}",
                alpha=found.alpha,
                group_loss_rtn=found.loss_rtn,
                group_loss=found.loss,
            )
        sigma_s = sigma / (s[:, None] * s[None, :])  # statistics of the scaled input x / s
        for p in int4:
            fqn = p.site.weight_fqn
            w_scaled = self.weight_nk(p.site).float()
            final = w_scaled
            r = dict(rec)
            if m.clip and not any(name_matches(pat, p.name) for pat in m.no_clip):
                final, before, after = search_clip(
                    w_scaled, sigma_s, scheme, n_grid=m.n_grid, max_shrink=m.clip_max_shrink
                )
                r["clip_loss_before"], r["clip_loss_after"] = before, after
                if final is not w_scaled:
                    self.set_weight_nk(p.site, final)
                    r["status"] = "calibrated"
                    # the pass runs on in float, as llm-awq's does: later layers see the
                    # unclipped (scaled) weight's output
                    stored = w_scaled.t() if p.site.transposed else w_scaled
                    self.override[p.site.node] = stored.to(self.state[fqn].dtype).contiguous()
            rtn = scheme.quantize(orig[fqn]).dequantized
            r["output_mse_rtn"] = output_mse(orig[fqn] - rtn, sigma)
            q = scheme.quantize(final).dequantized
            r["output_mse"] = output_mse(w_scaled - q, sigma_s)
            self.records[fqn] = r
