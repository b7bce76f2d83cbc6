"""AutoRound (SignRound; Cheng et al., 2023; Intel's ``auto_round``): tune each weight's rounding
and each group's clipping range with signed gradient descent, block by block, so that every
transformer block's output matches the float model's on the calibration data.

Where this sits: ``fxquant.calibrate(..., method=AutoRound(...))`` runs the exported graph over
the calibration samples (``fxquant/calibration/interpreter.py``); ``AutoRoundRun`` (the driver,
below) finds the blocks in the graph and, when the run reaches a block's first node, tunes all
its planned linears at once. What comes back is each weight in ``Int4WeightOnly``'s storage form,
which ``fxquant.quantize(..., weights=...)`` stores as it is.

**Blocks** are read from the graph: a linear's block is its module path up to the first numeric
component (``model.layers.3`` for ``model.layers.3.self_attn.q_proj``), and the block's nodes
are every node whose ``nn_module_stack`` holds that path. Its inputs are the values from outside
it that its nodes read (hidden states, rotary tables, masks); its outputs are its values read
outside it. Linears outside every block (and weights two linears share) are left to
round-to-nearest, as auto-round leaves layers outside its blocks; the report says so.

**The quantizer** (auto-round 0.15 ``data_type/int.py``) on groups of W [N, K] along K, with per
weight an offset v (init 0) and per group factors a, b (init 1, clamped to [0, 1]):

- asymmetric (``int_asym``): lo = min(w, 0)·a, hi = max(w, 0)·b, s = (hi - lo) / 15 (at least
  1e-5), z = round(-lo / s), u = clamp(round(w / s + v) + z, 0, 15): at v = 0, a = b = 1 this
  is fxquant's round-to-nearest grid;
- symmetric (``int_sym``, auto-round's full range): m = the larger of -lo and hi, signed
  negative when hi is the larger, s = m / 8, u = clamp(round(w / s + v), -8, 7) + 8, z = 8
  (so s may be negative, which the int4 storage and kernels take as it is).

Rounding passes gradients straight through (``round_ste``). auto-round keeps its scales in fp16;
here they stay fp32, as fxquant's int4 stores them.

**Tuning**, per block (auto-round's defaults): the float block run on the float model's inputs
gives the targets; each step draws ``batch_size`` samples (a shuffled cycle over the data), runs
the block with its weights fake-quantized on the inputs the quantized blocks before it give
(``enable_quanted_input``), and takes the mean squared error of its outputs; every parameter
moves by -lr·sign(grad) with lr decayed linearly from ``lr`` to 0 over ``iters`` steps; the
parameters of the step with the lowest loss are kept. The block then runs on with those weights,
so the next block sees what the quantized model gives it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch
import torch.fx as fx
from torch import Tensor

from fxquant.calibration.interpreter import CalibrationRun, _Param, _Same
from fxquant.calibration.methods import AutoRound
from fxquant.core import reference as ref
from fxquant.core.config import Int4WeightOnly
from fxquant.core.scheme import QuantizedWeight
from fxquant.passes.plan import LayerPlan

__all__ = ["AutoRoundRun", "RoundingParams", "block_of"]

_SCALE_MIN = 1e-5  # auto-round's q_scale_thresh


def block_of(module_name: str) -> str | None:
    """``model.layers.3`` for ``model.layers.3.self_attn.q_proj``: the path up to its first
    numeric component; None when it has none (the linear is in no block)."""
    m = re.match(r"^(.*?\.\d+)(\.|$)", module_name)
    return m.group(1) if m else None


def _round_ste(t: Tensor) -> Tensor:
    return t + (torch.round(t) - t).detach()


@dataclass
class RoundingParams:
    """One weight's tuned parameters: offsets v [N, G, g], clipping factors a, b [N, G]."""

    v: Tensor
    lo: Tensor  # a
    hi: Tensor  # b

    @classmethod
    def init(cls, n: int, k: int, group: int) -> RoundingParams:
        g = k // group
        return cls(torch.zeros(n, g, group), torch.ones(n, g), torch.ones(n, g))

    def tensors(self) -> list[Tensor]:
        return [self.v, self.lo, self.hi]

    def snapshot(self) -> RoundingParams:
        return RoundingParams(*(t.detach().clone() for t in self.tensors()))


def qdq(w: Tensor, p: RoundingParams, *, symmetric: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """W [N, K] with the parameters ``p`` → (dequantized W [N, K], codes u [N, G, g], scale
    [N, G], zero [N, G]), differentiable in ``p`` (module docstring)."""
    n, k = w.shape
    b = w.float().reshape(n, p.v.shape[1], -1)
    lo = b.amin(-1).clamp(max=0) * p.lo.clamp(0, 1)  # the tuning loop keeps a, b in [0, 1]
    hi = b.amax(-1).clamp(min=0) * p.hi.clamp(0, 1)
    if symmetric:
        neg = -lo
        mag = torch.maximum(neg, hi)
        m = torch.where(hi > neg, -mag, mag)  # the larger extreme maps to -8
        s = m / 8
        s = torch.where(s.abs() < _SCALE_MIN, torch.where(s < 0, -_SCALE_MIN, _SCALE_MIN), s)
        q = torch.clamp(_round_ste(b / s[..., None] + p.v), -8, 7)
        z = torch.full_like(s, 8.0)
        u = q + 8
    else:
        s = ((hi - lo) / 15).clamp(min=_SCALE_MIN)
        z = _round_ste(-lo / s)
        u = torch.clamp(_round_ste(b / s[..., None] + p.v) + z[..., None], 0, 15)
    dq = (u - z[..., None]) * s[..., None]
    return dq.reshape(n, k), u, s, z


class AutoRoundRun(CalibrationRun):
    """``method=AutoRound(...)``: each block's planned int4 linears tuned together when the run
    reaches the block (module docstring)."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.blocks: dict[str, list[LayerPlan]] = {}
        for p in self.plans:
            if p.scheme is None:
                continue
            block = block_of(p.name)
            if not isinstance(p.scheme, Int4WeightOnly):
                self._skip(p, f"AutoRound does not produce {type(p.scheme).__name__} weights")
            elif block is None:
                self._skip(
                    p, "outside the model's numbered blocks (AutoRound tunes block by block)"
                )
            elif self.weight_uses[p.site.weight_fqn] > 1:
                self._skip(p, "the weight is shared by several linears")
            elif p.site.in_features % p.scheme.group_size:
                self._skip(p, f"K={p.site.in_features} is not a multiple of the group")
            else:
                self.blocks.setdefault(block, []).append(p)
        self.block_nodes = {b: self._nodes_of(b) for b in self.blocks}
        self.start = {nodes[0]: b for b, nodes in self.block_nodes.items() if nodes}
        self.block_inputs = {b: self._inputs_of(nodes) for b, nodes in self.block_nodes.items()}
        self.untuned = set(self.blocks)
        # the float model's block outputs, per sample, while a block still to tune reads them
        self.fp_outputs: dict[fx.Node, list[Tensor]] = {}

    def _nodes_of(self, block: str) -> list[fx.Node]:
        def inside(n: fx.Node) -> bool:
            stack = n.meta.get("nn_module_stack") or {}
            return any(path == block for path, _ in stack.values())

        return [n for n in self.editor.graph.nodes if n.op == "call_function" and inside(n)]

    @staticmethod
    def _inputs_of(nodes: list[fx.Node]) -> list[fx.Node]:
        inside = set(nodes)
        return list(dict.fromkeys(a for n in nodes for a in n.all_input_nodes if a not in inside))

    def calibrate_group(self, x, group) -> None:
        pass  # the block's linears were tuned when the run reached the block

    def also_run(self) -> list[fx.Node]:
        return [n for nodes in self.block_nodes.values() for n in nodes]

    def before_node(self, node: fx.Node) -> None:
        block = self.start.get(node)
        if block is not None:
            with torch.enable_grad():
                self._tune(block)

    # ------------------------------------------------------------------ one block

    def _tune(self, block: str) -> None:
        m: AutoRound = self.method
        nodes, inputs = self.block_nodes[block], self.block_inputs[block]
        inside = set(nodes)
        outputs = [n for n in nodes if any(u not in inside for u in n.users)]
        plans = self.blocks[block]
        n_samples = len(self.samples)
        q_in = [{a: self._sample(a, i) for a in inputs} for i in range(n_samples)]
        fp_in = [{a: self._fp_sample(a, i) for a in inputs} for i in range(n_samples)]
        self.untuned.discard(block)
        still_read = {a for b in self.untuned for a in self.block_inputs[b]}
        for node in [n for n in self.fp_outputs if n not in still_read]:
            del self.fp_outputs[node]
        with torch.no_grad():
            targets = [self._run_block(nodes, fp_in[i], outputs, {}) for i in range(n_samples)]
        for j, out in enumerate(outputs):
            self.fp_outputs[out] = [t[j] for t in targets]
        train_in = q_in if m.enable_quanted_input else fp_in

        sites = {p.site.node: p for p in plans}
        weights = {node: self.weight_nk(p.site).float() for node, p in sites.items()}
        params = {
            node: RoundingParams.init(*weights[node].shape, p.scheme.group_size)
            for node, p in sites.items()
        }
        for p in params.values():
            for t in p.tensors():
                t.requires_grad_(True)
        lr = m.lr if m.lr is not None else 1.0 / m.iters
        minmax_lr = m.minmax_lr if m.minmax_lr is not None else lr
        gen = torch.Generator().manual_seed(m.seed)
        order: list[int] = []
        best, best_loss, first_loss, best_iter = None, float("inf"), None, 0
        for it in range(m.iters):
            batch = []
            while len(batch) < min(m.batch_size, n_samples):
                if not order:
                    order = torch.randperm(n_samples, generator=gen).tolist()
                batch.append(order.pop(0))
            with torch.no_grad():  # auto-round clamps the factors themselves, in place
                for p in params.values():
                    p.lo.clamp_(0, 1)
                    p.hi.clamp_(0, 1)
            # the block's fake-quantized weights, once per step; each sample's backward keeps
            # their graph for the next sample's (retain_graph), then the step drops it
            fq = {node: self._layout(sites[node], qdq(weights[node], params[node],
                  symmetric=sites[node].scheme.symmetric)[0]) for node in sites}  # fmt: skip
            total = 0.0
            for i in batch:
                pred = self._run_block(nodes, train_in[i], outputs, fq)
                loss = sum(
                    torch.mean((y.float() - t.float()) ** 2)
                    for y, t in zip(pred, targets[i], strict=True)
                    if y.is_floating_point()
                ) / len(batch)
                loss.backward(retain_graph=True)
                total += float(loss.detach())
            if first_loss is None:
                first_loss = total
            if total < best_loss:  # the parameters this loss was computed with
                best_loss, best_iter = total, it
                best = {node: p.snapshot() for node, p in params.items()}
            decay = 1.0 - it / m.iters  # LinearLR(1 → 0) over iters
            with torch.no_grad():
                for p in params.values():
                    for t, step in ((p.v, lr), (p.lo, minmax_lr), (p.hi, minmax_lr)):
                        if t is not p.v and not m.enable_minmax_tuning:
                            t.grad = None
                            continue
                        if t.grad is not None:
                            t -= step * decay * torch.sign(t.grad)
                            t.grad = None
        assert best is not None
        for node, p in sites.items():
            with torch.no_grad():
                dq, u, s, z = qdq(weights[node], best[node], symmetric=p.scheme.symmetric)
            n = dq.shape[0]
            stored = {
                "qweight": ref.pack_int4(u.reshape(n, -1).to(torch.uint8)).contiguous(),
                "scale": s.float().contiguous(),
                "zero": z.to(torch.uint8).contiguous(),
            }
            self.weights[p.site.weight_fqn] = QuantizedWeight(stored, dq.detach())
            self.records[p.site.weight_fqn] = {
                "method": "autoround",
                "status": "calibrated",
                "block": block,
                "iters": m.iters,
                "samples": n_samples,
                "inputs": "from the quantized blocks before" if m.enable_quanted_input else "float",
                "block_mse_rtn": first_loss,
                "block_mse": best_loss,
                "best_iter": best_iter,
            }
            self.override[node] = self._layout(p, dq.detach()).to(
                self.state[p.site.weight_fqn].dtype
            )

    # ------------------------------------------------------------------ running a block

    def _layout(self, plan: LayerPlan, w_nk: Tensor) -> Tensor:
        return w_nk.t() if plan.site.transposed else w_nk

    def _sample(self, node: fx.Node, i: int):
        v = self.env.get(node)
        if v is None:
            raise RuntimeError(
                f"AutoRound: the block input {node.name} was not computed before the block"
            )
        if isinstance(v, _Param):
            return v
        return v.value if isinstance(v, _Same) else v[i]

    def _fp_sample(self, node: fx.Node, i: int):
        # the float model's value where an earlier block produced it; anything else (rotary
        # tables, masks, embeddings) is the same in both models
        fp = self.fp_outputs.get(node)
        return fp[i] if fp is not None else self._sample(node, i)

    def _run_block(self, nodes, inputs: dict, outputs, weights: dict) -> list:
        env = dict(inputs)

        def get(a: fx.Node):
            v = env[a]
            return self.state[v.fqn] if isinstance(v, _Param) else v

        for node in nodes:
            site = self.sites_by_node.get(node)
            w = weights.get(node)
            args = fx.map_arg(
                node.args,
                lambda a, w=w, s=site: (
                    s.weight_arg(w) if w is not None and a is s.weight_node else get(a)
                ),
            )
            kwargs = fx.map_arg(node.kwargs, get)
            env[node] = node.target(*args, **kwargs)
        return [env[o] for o in outputs]
