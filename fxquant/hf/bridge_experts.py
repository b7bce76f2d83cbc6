"""The from_pretrained bridge for mixture-of-experts weights: transformers 5's experts modules
(``@use_experts_implementation``: Qwen2/3-MoE, Mixtral, DeepSeek, OLMoE, gpt-oss …) run their
grouped GEMMs on fxquant's experts ops.

Where it sits: beside ``fxquant.hf.bridge`` (which swaps ``nn.Linear`` modules), called by its
quantizer after the float weights load (quantizing) or before (reloading a saved model). An
experts module holds its weights as 3-D parameters (``gate_up_proj`` [E, 2I, H], ``down_proj``
[E, H, I]; [E, K, N] where ``is_transposed``, gpt-oss') and runs them in transformers' grouped
GEMM. Each weight the plan quantizes becomes an ``ExpertWeights`` submodule of the same name
holding the constants the graph rewrite would store for it ([E, N, K] layout, the scheme's
``quantize`` of each expert), and the module's class becomes a subclass of its own whose forward
is transformers' ``grouped_mm`` experts forward (tokens sorted by expert, cumulative row ends,
the module's own gate, activation, biases and routing weights) with each grouped GEMM the
scheme's experts op (``Scheme.grouped_op_args``). Everything else of the module stays as
transformers built it; a weight the plan leaves float runs transformers' grouped GEMM. The
constants are buffers (``<experts>.gate_up_proj.qweight`` …), so ``save_pretrained`` writes them
and a reload fills them. Llama 4's experts (no ``use_experts_implementation``: every token
through every expert, a bmm each) get the same treatment with their own forward.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn
from transformers.core_model_loading import WeightConverter
from transformers.integrations.moe import _grouped_linear

from fxquant.core.config import EXPERT_SCHEMES, QuantConfig, Scheme
from fxquant.core.reference import sqnr
from fxquant.core.row import LayerRow
from fxquant.core.scheme import QuantizedWeight, layout_of
from fxquant.passes.eager import EagerKernels
from fxquant.passes.plan import FLOAT_DTYPES

__all__ = [
    "ExpertWeights",
    "unknown_expert_rows",
    "build_experts_skeleton",
    "keep_stacked_on_save",
    "quantize_experts",
]


class ExpertWeights(nn.Module):
    """One quantized 3-D experts weight: its constants as buffers, ``forward(x, offs)`` the
    scheme's grouped op (x [S, K] sorted by expert, ``offs`` [E] cumulative row ends), eagerly
    on CPU on the lowering's grouped kernels (``fxquant.passes.eager``)."""

    def __init__(self, scheme: Scheme, weight: QuantizedWeight, *, experts: int, n: int, k: int):
        super().__init__()
        self.scheme, self.experts, self.out_features, self.in_features = scheme, experts, n, k
        self._constants = list(weight.tensors)
        for name, t in weight.tensors.items():
            self.register_buffer(name, t)
        self._kernels = EagerKernels()

    def forward(self, x: torch.Tensor, offs: torch.Tensor) -> torch.Tensor:
        consts = {c: getattr(self, c) for c in self._constants}
        op, args = self.scheme.grouped_op_args(x, consts, offs)
        return self._kernels(op, args, consts.values())

    def extra_repr(self) -> str:
        return f"experts={self.experts}, n={self.out_features}, k={self.in_features}, {self.scheme}"


class _FxquantExperts:
    """The forward of the experts classes ``_quantized_class`` makes: transformers 5.25's
    ``grouped_mm_experts_forward`` (integrations/moe.py, less expert parallelism, which the plan
    refuses; 5.17's is the same without it and the post-expert norm), each grouped GEMM on an
    ``ExpertWeights`` where the weight is one."""

    def forward(self, hidden_states, top_k_index, top_k_weights):
        num_top_k, num_tokens = top_k_index.size(-1), hidden_states.size(0)
        expert_ids_g, perm = torch.sort(top_k_index.reshape(-1))
        x = hidden_states[perm // num_top_k]
        weights_g = top_k_weights.reshape(-1)[perm]
        # histc as transformers counts (no bincount: CUDA graphs); float bins on the CPU
        ids = expert_ids_g.float() if x.device.type in ("cpu", "mps") else expert_ids_g.int()
        counts = torch.histc(ids, bins=self.num_experts, min=0, max=self.num_experts - 1)
        offs = torch.cumsum(counts, dim=0, dtype=torch.int32)
        up = self._grouped("gate_up_proj" if self.has_gate else "up_proj", x, offs, expert_ids_g)
        h = self._apply_gate(up) if self.has_gate else self.act_fn(up)
        out = self._grouped("down_proj", h, offs, expert_ids_g)
        if getattr(self, "has_post_expert_norm", False):  # transformers 5.25, not 5.17
            out = self.post_expert_norm(out)
        out = out * weights_g.unsqueeze(-1)
        inv = torch.empty_like(perm)
        inv[perm] = torch.arange(perm.size(0), device=perm.device)
        out = out[inv].view(num_tokens, num_top_k, hidden_states.size(-1)).sum(dim=1)
        return out.to(hidden_states.dtype)

    def _grouped(self, name, x, offs, expert_ids_g):
        w = getattr(self, name)
        bias = getattr(self, f"{name}_bias")[expert_ids_g] if self.has_bias else None
        if not isinstance(w, ExpertWeights):
            return _grouped_linear(x, w, offs, bias=bias, is_transposed=self.is_transposed)
        y = w(x, offs)
        return y if bias is None else y + bias


class _FxquantBmmExperts:
    """The forward of Llama 4's experts class as ``_quantized_class`` makes it: transformers'
    ``Llama4TextExperts.forward`` (5.17 to 5.25: every token through every expert, the rows
    grouped by expert, a bmm each, the router's scores already applied to the rows), each bmm
    on an ``ExpertWeights`` (E groups of T rows, as the export path rewrites it) where the
    weight is one."""

    def forward(self, hidden_states):
        x = hidden_states.view(-1, self.hidden_size)  # [E·T, H], expert by expert
        rows = x.shape[0] // self.num_experts
        offs = torch.arange(1, self.num_experts + 1, device=x.device, dtype=torch.int32) * rows
        gate, up = self._bmm("gate_up_proj", x, offs).chunk(2, dim=-1)
        return self._bmm("down_proj", up * self.act_fn(gate), offs)

    def _bmm(self, name, x, offs):
        w = getattr(self, name)
        if isinstance(w, ExpertWeights):
            return w(x, offs)
        return torch.bmm(x.view(w.shape[0], -1, x.shape[-1]), w).view(-1, w.shape[-1])


@functools.cache
def _quantized_class(cls: type, forward: type) -> type:
    return type(f"Fxquant{cls.__name__}", (forward, cls), {"__module__": __name__})


_EXPERT_PARAMS = ("gate_up_proj", "up_proj", "down_proj")  # transformers' 3-D experts weights
# experts classes whose forward _FxquantBmmExperts reproduces (tests/test_bmm_experts.py holds it
# to the export path bit for bit)
_BMM_EXPERTS = ("Llama4TextExperts",)


# ---- planning: from names, shapes and dtypes only (the same on a meta skeleton) ----------------


@dataclass
class _Weight:
    """One 3-D experts weight and what the plan decided for it."""

    module: str
    param: str
    scheme: Scheme | None
    row: LayerRow
    transposed: bool  # stored [E, K, N]
    bmm: bool  # Llama 4's experts (every token through every expert)

    @property
    def name(self) -> str:
        return self.row.name


def _experts_modules(model: nn.Module):
    """(name, module, bmm) for each experts module the bridge knows how to run."""
    for name, module in model.named_modules():
        if hasattr(module, "has_gate") and hasattr(module, "is_transposed"):
            yield name, module, False  # transformers' @use_experts_implementation classes
        elif type(module).__name__ in _BMM_EXPERTS or isinstance(module, _FxquantBmmExperts):
            yield name, module, True


def _plan(model, config, *, quantized_from: Mapping[str, torch.dtype] | None = None):
    weights = []
    for name, module, bmm in _experts_modules(model):
        transposed = bmm or module.is_transposed  # Llama 4's: [E, K, N]
        first = "gate_up_proj" if bmm or module.has_gate else "up_proj"
        for param in (first, "down_proj"):
            p = getattr(module, param, None)
            if not isinstance(p, nn.Parameter) or p.dim() != 3:
                continue
            full = f"{name}.{param}"
            scheme, why = config.scheme_for(full)
            if scheme is None:
                continue  # not planned: as float as the rest of the model the config leaves
            dtype = (quantized_from or {}).get(full, p.dtype)
            e, a, b = p.shape
            n, k = (b, a) if transposed else (a, b)
            if dtype not in FLOAT_DTYPES:
                problem = f"weight dtype {dtype} is not floating point"
            elif not scheme.takes_experts:
                problem = f"{scheme.name} has no experts op; experts take {EXPERT_SCHEMES}"
            elif getattr(module, "_is_expert_parallel", False):
                problem = "expert parallelism (sharded experts) is not supported here"
            else:
                problem = scheme.unsupported_reason(out_features=n, in_features=k)
            if problem is not None:
                scheme, why = None, problem
            size = p.numel() * dtype.itemsize
            row = LayerRow(
                name=full, weight=full, node=None, kind="experts", experts=e,
                in_features=k, out_features=n, dtype=str(dtype).removeprefix("torch."),
                status="skipped" if scheme is None else "quantized",
                scheme=None if scheme is None else scheme.to_dict(), reason=why,
                bytes_before=size, bytes_after=size, sqnr_db=None,
            )  # fmt: skip
            weights.append(_Weight(name, param, scheme, row, transposed, bmm))
    return weights


def _swap(model: nn.Module, w: _Weight, weight: QuantizedWeight) -> None:
    module = model.get_submodule(w.module)
    row = w.row
    del module._parameters[w.param]
    module.add_module(w.param, ExpertWeights(w.scheme, weight, experts=row.experts,
                                             n=row.out_features, k=row.in_features))  # fmt: skip
    forward = _FxquantBmmExperts if w.bmm else _FxquantExperts
    if not isinstance(module, forward):
        module.__class__ = _quantized_class(type(module), forward)


def quantize_experts(model: nn.Module, config: QuantConfig) -> list[LayerRow]:
    """Quantize, in place, every experts weight of ``model`` the config gives a scheme that
    takes experts; → a report row for each experts weight the config plans (skips say why)."""
    rows = []
    for w in _plan(model, config):
        if w.scheme is not None:
            p = model.get_submodule(w.module).get_parameter(w.param).detach().float()
            wf = (p.transpose(1, 2) if w.transposed else p).contiguous()  # [E, N, K]
            q = w.scheme.quantize(wf)
            w.row = w.row.replace(bytes_after=q.nbytes, sqnr_db=round(sqnr(wf, q.dequantized), 2))
            _swap(model, w, q)
        rows.append(w.row)
    return rows


def keep_stacked_on_save(model: nn.Module, rows: list[LayerRow]) -> None:
    """transformers' ``save_pretrained`` reverts the conversions that stacked a checkpoint's
    per-expert weights as it loaded them (``model._weight_conversions``: ``experts.<i>.gate_proj``
    … → ``experts.gate_up_proj``), which would split the quantized constants into per-expert
    tensors under float names; quantized experts are saved as they are (and reload so), so those
    conversions are dropped. A float experts weight they also stacked is then saved stacked,
    which transformers 5 loads as it is."""
    conversions = getattr(model, "_weight_conversions", None)
    names = [r.name for r in rows if r.status == "quantized"]
    if not conversions or not names:
        return

    def stacks_quantized(c) -> bool:
        targets = c._original_target_patterns if isinstance(c, WeightConverter) else ()
        return any(re.search(t, n) for t in targets for n in names)

    model._weight_conversions = [c for c in conversions if not stacks_quantized(c)]


def build_experts_skeleton(
    model: nn.Module, config: QuantConfig, quantized_from: Mapping[str, torch.dtype]
) -> tuple[list[_Weight], dict[str, tuple]]:
    """On transformers' (meta) skeleton before a saved model loads: each planned experts weight
    swapped for an ``ExpertWeights`` with empty buffers of the scheme's layout; → the plan and
    {buffer name: (shape, dtype)} the checkpoint must hold."""
    planned, layouts = _plan(model, config, quantized_from=quantized_from), {}
    for w in planned:
        if w.scheme is None:
            continue
        r = w.row
        with torch.device("cpu"):  # the probe quantizes zeros: not on the meta device
            layout = layout_of(w.scheme, (r.experts, r.out_features, r.in_features))
        device = model.get_submodule(w.module).get_parameter(w.param).device
        tensors = {c: torch.empty(s, dtype=d, device=device) for c, (s, d) in layout.items()}
        layouts.update({f"{r.name}.{c}": v for c, v in layout.items()})
        _swap(model, w, QuantizedWeight(tensors, dequantized=None))
    return planned, layouts


def unknown_expert_rows(model: nn.Module, config: QuantConfig) -> list[LayerRow]:
    """Skipped rows for 3-D experts weights the config gives a scheme in a module the bridge
    does not know how to run (neither a transformers experts module nor Llama 4's): its own
    forward computes with them, which the bridge cannot redirect. Read as [E, N, K]."""
    known = {name for name, _, _ in _experts_modules(model)}
    rows = []
    for name, p in model.named_parameters():
        module, _, leaf = name.rpartition(".")
        if p.dim() != 3 or leaf not in _EXPERT_PARAMS or module in known:
            continue  # not an experts weight (a Conv1d's is 3-D too), or one the bridge runs
        scheme, owner = config.scheme_for(name)[0], model.get_submodule(module)
        if scheme is None:
            continue
        e, n, k = p.shape
        size = p.numel() * p.dtype.itemsize
        rows.append(LayerRow(
            name=name, weight=name, node=None, kind="experts", experts=e,
            in_features=k, out_features=n, dtype=str(p.dtype).removeprefix("torch."),
            status="skipped", scheme=None,
            reason=f"expert weights ({scheme.name} planned) run in the forward of "
            f"{type(owner).__name__}, which the from_pretrained bridge does not know; export "
            "the model and use fxquant.quantize or load_quantized, which rewrite its GEMMs",
            bytes_before=size, bytes_after=size, sqnr_db=None,
        ))  # fmt: skip
    return rows
