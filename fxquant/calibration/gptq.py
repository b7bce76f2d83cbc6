"""GPTQ: quantize one weight matrix column by column, feeding each column's rounding error
forward through the inverse Hessian of the layer's inputs (Frantar et al., 2022).

Where this sits: ``fxquant.calibrate`` runs the exported graph over calibration data
(``fxquant/calibration/interpreter.py``) and, at each linear it plans to quantize, ``GPTQRun`` (the
driver, at the end of this module) hands ``gptq_quantize`` the layer's weight and ``H = 2/n · XᵀX``
of the real inputs that reach it (from the already-quantized layers before it). What comes back
is the weight in the scheme's *storage* form (the constants the ``fxquant::`` op takes), which
``fxquant.quantize(..., weights=...)`` stores as they are: the program holds GPTQ's constants,
not a re-rounding of them.

The algorithm follows the reference (IST-DASLab/gptq ``fasterquant``, AutoGPTQ): dead columns
(``H[i, i] == 0``: an input channel that is always zero) are zeroed, ``H`` is damped by
``percdamp · mean(diag H)``, the upper Cholesky factor of ``H⁻¹`` drives the updates, columns are
processed in blocks with the updates to later columns applied once per block (lazy batch
updates), and optionally in order of decreasing ``diag H`` (act-order).

Storage (``fxquant.core.reference``): int4 groups are contiguous along K, ``w = (u - z)·s`` with u,
z integers in [0, 15] (symmetric: z = 8, s = amax/7); int8 is per output channel, ``w = q·s``, s =
amax/127. With act-order, a group's columns are visited out of order, so a group's scale cannot be
chosen from the error-updated columns as they arrive (its columns would not be contiguous in the
order they are met): the scales of all groups are taken up front from the original weight in
original column order ("static groups", as AutoGPTQ's ``static_groups``). Without act-order, each
group's scale is taken from its error-updated columns when the pass reaches the group's first
column, as the reference does. Group-aware reordering (GAR, GPTQModel's ``act_group_aware``, the
default of transformers' ``GPTQConfig``) is the act-order that keeps groups whole: groups are
visited by decreasing max ``diag H`` and, within a group, columns by decreasing ``diag H``; each
group's columns stay contiguous in the visiting order, so its scale is still taken from its
error-updated columns when the pass reaches it. With ``mse=p`` (the reference quantizer's option) a
group's range is not its min/max but that range shrunk by the factor in 1, 0.99, …, 0.21 whose
rounding of the group has the least p-norm error.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.fx as fx
import torch.nn.functional as F

from fxquant.calibration.interpreter import CalibrationRun
from fxquant.calibration.methods import GPTQ
from fxquant.core import reference as ref
from fxquant.core.config import Int4WeightOnly, Int8DynamicActivation, Int8WeightOnly, Scheme
from fxquant.core.scheme import QuantizedWeight
from fxquant.passes.plan import LayerPlan

__all__ = ["GPTQ_SCHEMES", "GPTQResult", "GPTQRun", "gptq_quantize", "output_error"]

# Range shrink factors 1, 0.99, …, 0.21 tried by the mse search (the reference: grid 100,
# maxshrink 0.8).
_SHRINK_STEPS = 80

# Schemes whose weight GPTQ can produce in storage form.
GPTQ_SCHEMES = (Int4WeightOnly, Int8WeightOnly, Int8DynamicActivation)


@dataclass
class GPTQResult:
    weight: QuantizedWeight  # storage form, the scheme's constants in op argument order
    dequantized: torch.Tensor  # fp32 [N, K]: what the stored constants dequantize to
    # fp32 [N, K]: the quantized columns the error feedback used, as the pass made them (equal
    # to ``dequantized``: the tests check that the stored constants are exactly these)
    quantized: torch.Tensor


# --------------------------------------------------------------------------------------------
# The grid: per-group (int4) or per-row (int8) scale and zero, and rounding onto it, written with
# the same float operations as fxquant.core.reference so that RTN on this grid is the
# reference's RTN.
# --------------------------------------------------------------------------------------------


class _Grid:
    """Scale and zero point for every (row, group) and the rounding onto them."""

    def __init__(self, scheme: Scheme, n: int, k: int, *, mse: float = 0.0) -> None:
        self.scheme = scheme
        self.int4 = isinstance(scheme, Int4WeightOnly)
        self.group = scheme.group_size if self.int4 else k
        self.mse = mse
        groups = k // self.group
        # [groups, N]: a group's scales are one contiguous row
        self.scale = torch.zeros(groups, n)
        self.zero = torch.zeros(groups, n)

    def fit(self, g: int, w: torch.Tensor) -> None:
        """Set group ``g``'s scale (and zero) from ``w`` [N, group]: the reference's range, or
        with ``mse`` > 0 the range shrunk by the factor (1, 0.99, …, 0.21) that minimises
        ``Σ |dequantized - w|^mse`` per row (the reference quantizer's ``mse`` search: its grid
        of 100 steps, ``maxshrink`` 0.8)."""
        s, z = self._range(w, 1.0)
        if self.mse > 0:
            best = self._error(w, s, z)
            for i in range(1, _SHRINK_STEPS):
                s_i, z_i = self._range(w, 1.0 - i / 100)
                err = self._error(w, s_i, z_i)
                better = err < best
                best = torch.where(better, err, best)
                s, z = torch.where(better, s_i, s), torch.where(better, z_i, z)
        self.scale[g], self.zero[g] = s, z

    def _range(self, w: torch.Tensor, p: float) -> tuple[torch.Tensor, torch.Tensor]:
        """Scale and zero of each row of ``w`` for its range shrunk by ``p`` (1: the reference)."""
        n = w.shape[0]
        if not self.int4:
            return (p * w.abs().amax(dim=1)).clamp(min=ref.EPS) / ref.INT8_MAX, torch.zeros(n)
        if self.scheme.symmetric:
            return (p * w.abs().amax(dim=1)).clamp(min=ref.EPS) / 7, torch.full((n,), 8.0)
        lo = p * w.amin(dim=1).clamp(max=0)
        hi = p * w.amax(dim=1).clamp(min=0)
        s = ((hi - lo) / 15).clamp(min=ref.EPS)
        return s, torch.round(-lo / s).clamp(0, 15)

    def _error(self, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """Per row of ``w`` [N, group]: Σ |rounded - w|^mse on the grid (s, z) [N]."""
        wt = w.t()  # [group, N]: columns, as codes() takes them
        return (self._dequant(self._round(wt, s, z), s, z) - wt).abs().pow(self.mse).sum(dim=0)

    def codes(self, w: torch.Tensor, g: int) -> torch.Tensor:
        """Integer codes of column(s) ``w`` [N] in group ``g`` (u for int4, q for int8)."""
        return self._round(w, self.scale[g], self.zero[g])

    def value(self, u: torch.Tensor, g: int) -> torch.Tensor:
        """What the codes dequantize to: the same expression as the reference dequantizers."""
        return self._dequant(u, self.scale[g], self.zero[g])

    def _round(self, w: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if not self.int4:
            return torch.round(w / s).clamp(-ref.INT8_MAX, ref.INT8_MAX)
        if self.scheme.symmetric:
            return torch.round(w / s).clamp(-8, 7) + 8
        return (torch.round(w / s) + z).clamp(0, 15)

    def _dequant(self, u: torch.Tensor, s: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        if not self.int4:
            return u * s
        return (u - z) * s

    def storage(self, u: torch.Tensor) -> QuantizedWeight:
        """Codes [N, K] → the scheme's constants (and their exact dequantization)."""
        if not self.int4:
            q = u.to(torch.int8)
            s = self.scale[0].contiguous()
            return QuantizedWeight(
                {"qweight": q, "scale": s}, ref.dequantize_int8_per_channel(q, s)
            )
        packed = ref.pack_int4(u.to(torch.uint8))
        s, z = self.scale.t().contiguous(), self.zero.t().to(torch.uint8).contiguous()
        dq = ref.dequantize_int4_grouped(packed, s, z, group_size=self.group)
        return QuantizedWeight({"qweight": packed, "scale": s, "zero": z}, dq)


# --------------------------------------------------------------------------------------------
# GPTQ
# --------------------------------------------------------------------------------------------


@torch.no_grad()
def gptq_quantize(
    weight: torch.Tensor,
    hessian: torch.Tensor,
    scheme: Scheme,
    *,
    percdamp: float = 0.01,
    blocksize: int = 128,
    act_order: bool = False,
    static_groups: bool = False,
    group_aware: bool = False,
    mse: float = 0.0,
) -> GPTQResult:
    """Quantize ``weight`` [N, K] with GPTQ for ``scheme`` (int4 groups or int8 per channel).

    Args:
        weight: the float weight, [N, K] (rows may stack several layers that share their input:
            GPTQ treats rows independently given ``hessian``).
        hessian: ``2/n · XᵀX`` [K, K] of the layer's inputs (K before any padding).
        scheme: ``Int4WeightOnly`` (K is zero-padded to a multiple of the group, as the rewrite
            does; padded columns are dead and quantize to exactly 0), ``Int8WeightOnly`` or
            ``Int8DynamicActivation`` (the weight half: int8 per output channel).
        percdamp: damping added to the diagonal, as a fraction of its mean.
        blocksize: columns per lazy batch update.
        act_order: visit columns by decreasing ``diag(H)``; with int4 groups this needs
            ``static_groups=True`` (fxquant's groups are contiguous along K).
        static_groups: int4: fit every group's scale up front from the original weight.
        group_aware: int4 without ``act_order``: visit groups by decreasing max ``diag(H)`` and
            each group's columns by decreasing ``diag(H)`` (GAR); ignored with ``act_order``
            (a column order of its own) and for int8 (one group per row).
        mse: ``0``: each group's range is its min/max (the reference's default); ``p > 0``:
            the range shrunk by the factor that minimises the p-norm of the group's rounding
            error (the reference quantizer's ``mse`` option, which uses p = 2.4).

    Returns:
        The storage-form weight, its dequantization and the pass's own quantized columns (fp32
        [N, K], K unpadded).
    """
    if not isinstance(scheme, GPTQ_SCHEMES):
        raise ValueError(
            f"gptq_quantize: scheme {type(scheme).__name__} is not supported; allowed: "
            + ", ".join(s.__name__ for s in GPTQ_SCHEMES)
        )
    int4 = isinstance(scheme, Int4WeightOnly)
    if act_order and int4 and not static_groups:
        raise ValueError(
            "gptq_quantize: act_order=True with int4 groups needs static_groups=True: fxquant "
            "stores contiguous groups along K, so the scales must be fixed in column order"
        )
    n, k = weight.shape
    if tuple(hessian.shape) != (k, k):
        raise ValueError(f"gptq_quantize: hessian shape {tuple(hessian.shape)} != ({k}, {k})")
    kp = scheme.padded_in_features(k) if int4 else k
    W = F.pad(weight.detach().float(), (0, kp - k))
    H = F.pad(hessian.detach().float(), (0, kp - k, 0, kp - k)).clone()

    # An input channel that is always zero carries no information: its weight is irrelevant
    # to the output, so set it to 0 (exact in every grid) and make H invertible there.
    dead = torch.diagonal(H) == 0
    H[dead, dead] = 1.0
    W[:, dead] = 0.0

    grid = _Grid(scheme, n, kp, mse=mse)
    groups = kp // grid.group
    dynamic_groups = int4 and not static_groups
    if not dynamic_groups:
        # Static groups, and int8's one "group" per row: fixed from the original weight before
        # the pass, as the reference's quantizer.find_params(W) / AutoGPTQ's static_groups.
        for g in range(groups):
            grid.fit(g, W[:, g * grid.group : (g + 1) * grid.group])

    perm = None
    if act_order:
        perm = torch.argsort(torch.diagonal(H), descending=True)
    elif group_aware and int4:
        perm = _group_aware_order(torch.diagonal(H), grid.group)
    if perm is not None:
        W, H = W[:, perm], H[perm][:, perm]
    group_of = (perm if perm is not None else torch.arange(kp)) // grid.group

    H += percdamp * torch.mean(torch.diagonal(H)) * torch.eye(kp)
    Hinv = _upper_cholesky_of_inverse(H)

    # Columns as contiguous rows (Wt[c] is column c): the per-column loop touches one vector at
    # a time, and runs on one thread: for vectors this small, waking a second thread costs more
    # than the arithmetic (8 ms vs 8 µs per op measured on a loaded 2-core machine).
    Wt = W.t().contiguous()
    Ut = torch.zeros_like(Wt)  # integer codes, in the (possibly permuted) processing order
    Qt = torch.zeros_like(Wt)  # their values, as the error feedback saw them
    threads = torch.get_num_threads()
    try:
        for i1 in range(0, kp, blocksize):
            i2 = min(i1 + blocksize, kp)
            W1 = Wt[i1:i2].clone()
            Err1 = torch.zeros_like(W1)
            Hinv1 = Hinv[i1:i2, i1:i2]
            torch.set_num_threads(1)
            for i in range(i2 - i1):
                col = i1 + i
                g = int(group_of[col])
                if dynamic_groups and col % grid.group == 0:
                    # The group's scale from its columns as updated so far (block + rest).
                    grid.fit(g, torch.cat([W1[i:], Wt[i2:]])[: grid.group].t())
                w = W1[i]
                u = grid.codes(w, g)
                q = grid.value(u, g)
                Ut[col], Qt[col] = u, q
                err = (w - q) / Hinv1[i, i]
                W1[i:] -= Hinv1[i, i:].unsqueeze(1) * err.unsqueeze(0)
                Err1[i] = err
            torch.set_num_threads(threads)
            Wt[i2:] -= Hinv[i1:i2, i2:].t() @ Err1
    finally:
        torch.set_num_threads(threads)
    U, Q = Ut.t(), Qt.t()
    if perm is not None:
        inv = torch.argsort(perm)
        U, Q = U[:, inv], Q[:, inv]
    stored = grid.storage(U)
    dq = stored.dequantized[:, :k]
    stored.dequantized = dq
    return GPTQResult(stored, dq, Q[:, :k].contiguous())


def _group_aware_order(diag: torch.Tensor, group: int) -> torch.Tensor:
    """GAR's column order: groups by decreasing max ``diag``, within each by decreasing ``diag``
    (stable sorts: ties keep column order). Groups stay contiguous and aligned to ``group``."""
    d = diag.reshape(-1, group)
    within = torch.sort(d, dim=1, descending=True, stable=True).indices
    groups = torch.sort(d.amax(dim=1), descending=True, stable=True).indices
    return (within[groups] + groups.unsqueeze(1) * group).reshape(-1)


def _upper_cholesky_of_inverse(H: torch.Tensor) -> torch.Tensor:
    """Upper Cholesky factor of H⁻¹; if H is not positive definite, add damping until it is."""
    damp = 0.0
    eye = torch.eye(H.shape[0])
    mean_diag = torch.mean(torch.diagonal(H)).clamp(min=ref.EPS)
    for _ in range(8):
        L, info = torch.linalg.cholesky_ex(H + damp * eye)
        if int(info) == 0:
            Hinv = torch.cholesky_inverse(L)
            U, info = torch.linalg.cholesky_ex(Hinv, upper=True)
            if int(info) == 0:
                return U
        damp = mean_diag * 0.01 if damp == 0.0 else damp * 10
    raise ValueError("gptq: the Hessian is not positive definite even with 10^5 % damping")


def output_error(weight: torch.Tensor, dequantized: torch.Tensor, hessian: torch.Tensor) -> float:
    """Mean squared output error per output element, E_x mean((W - Q) x)², from ``H = 2/n XᵀX``:
    ``tr(D H Dᵀ) / (2 N)``, the quantity GPTQ minimises (no need to keep the inputs)."""
    d = weight.float() - dequantized.float()
    return float(((d @ hessian.float()) * d).sum() / (2 * d.shape[0]))


# --------------------------------------------------------------------------------------------
# The driver: GPTQ at each group of planned linears of a calibration run
# --------------------------------------------------------------------------------------------


class GPTQRun(CalibrationRun):
    """``method=GPTQ(...)``: the linears reading one input share its Hessian and are solved as one
    stacked matrix per scheme; with ``sequential`` each then computes with its GPTQ weight."""

    def check(self) -> None:
        method: GPTQ = self.method
        if method.desc_act and not method.static_groups:
            grouped = [p.name for p in self.plans if isinstance(p.scheme, Int4WeightOnly)]
            if grouped:
                raise ValueError(
                    f"GPTQ(desc_act=True) with int4 groups (e.g. {grouped[0]}) needs "
                    "static_groups=True: fxquant stores contiguous groups along K with no g_idx, "
                    "so the group scales must be fixed in column order before the act-order pass"
                )

    def calibrate_group(self, x: fx.Node, group: list[LayerPlan]) -> None:
        m: GPTQ = self.method
        todo: dict[Scheme, list[LayerPlan]] = {}
        for p in group:
            if p.scheme is None:
                continue
            if not isinstance(p.scheme, GPTQ_SCHEMES):
                self._skip(p, f"GPTQ does not produce {type(p.scheme).__name__} weights")
            elif self.weight_uses[p.site.weight_fqn] > 1:
                self._skip(p, "the weight is shared by several linears (one Hessian per weight)")
            else:
                todo.setdefault(p.scheme, []).append(p)
        if not todo:
            return
        k = group[0].site.in_features
        stats = self._stats(x, k)
        H = 2 * stats["sigma"]
        for scheme, plans in todo.items():
            ws = [self.weight_nk(p.site).float() for p in plans]
            res = gptq_quantize(
                torch.cat(ws), H, scheme, percdamp=m.damp_percent, blocksize=m.blocksize,
                act_order=m.desc_act, static_groups=m.static_groups,
                group_aware=m.act_group_aware, mse=m.mse,
            )  # fmt: skip
            sizes = [w.shape[0] for w in ws]
            parts = {n: t.split(sizes) for n, t in res.weight.tensors.items()}
            dqs = res.dequantized.split(sizes)
            for j, (p, w, dq) in enumerate(zip(plans, ws, dqs, strict=True)):
                tensors = {n: parts[n][j].contiguous() for n in parts}
                self.weights[p.site.weight_fqn] = QuantizedWeight(tensors, dq.contiguous())
                rtn = scheme.quantize(w).dequantized
                self.records[p.site.weight_fqn] = {
                    "method": "gptq",
                    "status": "calibrated",
                    "tokens": stats["tokens"],
                    "inputs": "from the quantized layers before" if m.sequential else "float",
                    "stacked_with": [q.name for q in plans if q is not p],
                    "output_mse_rtn": output_error(w, rtn, H),
                    "output_mse": output_error(w, dq, H),
                }
                if m.sequential:
                    stored = self.state[p.site.weight_fqn]
                    deq = dq.t() if p.site.transposed else dq
                    self.override[p.site.node] = deq.to(stored.dtype).contiguous()
