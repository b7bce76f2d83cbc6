"""Delayed-scaling state for FP8 training, and the runtime around a compiled FP8 training graph.

Where it sits: the backend (``fxquant.backend``) compiles the graph that
``fxquant.passes.float8_regions`` rewrote and wraps it in a ``Float8TrainingProgram``. The
compiled graph is pure: it reads each layer's scales as inputs and hands the amaxes it saw back
out (forward amaxes as extra outputs, the grad_output amax as the gradient of a sink input). This
module keeps the per-layer state between steps, outside the graph, exactly as
../shared/FP8_RECIPES.md describes Transformer Engine's ``DelayedScaling``:

- per layer: ``amax_history [L, 3]`` and ``scale [3]`` for the forward roles (input, weight,
  output), ``[L, 2]`` and ``[2]`` for the backward roles (grad_output, grad_input); zero history,
  scale 1 at step 0. ``scale`` multiplies into fp8, as in TE.
- every cast writes its amax into row 0 (the max, when a layer runs more than once in a step);
- once per step (at the next training forward) the amaxes are all-reduced with MAX across ranks
  when ``torch.distributed`` is initialised, then ``delayed_scaling_update`` sets the scales and
  rolls the histories;
- nothing is recorded or updated under ``torch.no_grad()`` or in ``model.eval()``.

The state belongs to the weight ``Parameter`` (a weak-keyed registry), so every graph Dynamo
compiles for a model (recompiles, graph breaks) shares it, and ``fp8_state_dict(model)`` finds it
from the model's parameters.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Callable
from dataclasses import dataclass

import torch

from fxquant.core.config import Float8Recipe
from fxquant.training.numerics import (
    BWD_ROLES,
    E4M3,
    FWD_ROLES,
    delayed_scaling_update,
    fp8_max,
    grad_dtype,
)

__all__ = ["Float8TrainingProgram", "LayerState", "fp8_state_dict", "load_fp8_state_dict"]


@dataclass(eq=False)
class LayerState:
    """One linear's delayed-scaling state (TE's ``fp8_meta`` for its forward and backward)."""

    recipe: Float8Recipe
    fwd_amax_history: torch.Tensor  # [L, 3] fp32
    fwd_scale: torch.Tensor  # [3] fp32
    bwd_amax_history: torch.Tensor  # [L, 2] fp32
    bwd_scale: torch.Tensor  # [2] fp32
    pending: bool = False  # amaxes recorded since the last update

    @classmethod
    def new(cls, recipe: Float8Recipe, device: torch.device) -> LayerState:
        n = recipe.amax_history_len
        f32 = {"dtype": torch.float32, "device": device}
        return cls(
            recipe=recipe,
            fwd_amax_history=torch.zeros(n, len(FWD_ROLES), **f32),
            fwd_scale=torch.ones(len(FWD_ROLES), **f32),
            bwd_amax_history=torch.zeros(n, len(BWD_ROLES), **f32),
            bwd_scale=torch.ones(len(BWD_ROLES), **f32),
        )

    def update(self) -> None:
        """The once-per-step update of both metas (after any all-reduce of row 0)."""
        r = self.recipe
        kw = {"margin": r.margin, "amax_compute_algo": r.amax_compute_algo}
        fmax = fp8_max(E4M3)
        delayed_scaling_update(self.fwd_amax_history, self.fwd_scale, fp8_maxes=(fmax,) * 3, **kw)
        gmax = fp8_max(grad_dtype(r))
        delayed_scaling_update(self.bwd_amax_history, self.bwd_scale, fp8_maxes=(gmax,) * 2, **kw)
        self.pending = False


# id(weight) → (weakref to it, state). Not a WeakKeyDictionary: tensors compare elementwise.
_STATES: dict[int, tuple[weakref.ref, LayerState]] = {}


def _get(weight: torch.Tensor) -> LayerState | None:
    entry = _STATES.get(id(weight))
    return entry[1] if entry is not None and entry[0]() is weight else None


def _set(weight: torch.Tensor, state: LayerState) -> LayerState:
    key = id(weight)
    _STATES[key] = (weakref.ref(weight, lambda _, key=key: _STATES.pop(key, None)), state)
    return state


def state_for(weight: torch.Tensor, recipe: Float8Recipe, fqn: str) -> LayerState:
    """The state of the layer owning ``weight``, made at step 0 on first use."""
    state = _get(weight)
    if state is None:
        state = _set(weight, LayerState.new(recipe, weight.device))
    elif state.recipe.amax_history_len != recipe.amax_history_len:
        raise ValueError(
            f"{fqn}: its FP8 state has amax_history_len={state.recipe.amax_history_len} (loaded "
            f"or made by an earlier compile) but the recipe asks for {recipe.amax_history_len}; "
            "use one history length per layer"
        )
    else:
        state.recipe = recipe
    return state


def update_states(states: list[LayerState]) -> None:
    """Update every pending state, all-reducing their fresh amaxes with MAX first when
    ``torch.distributed`` is initialised, so every rank computes the same scales."""
    pending = reduce_pending(states)
    for s in pending:
        s.update()


def reduce_pending(states: list[LayerState]) -> list[LayerState]:
    """All-reduce the fresh amaxes (history row 0) of the pending ``states`` with MAX across
    ranks when ``torch.distributed`` is initialised (a collective: every rank calls it, with
    the same layers pending); returns the pending states. Reducing twice changes nothing."""
    pending = [s for s in dict.fromkeys(states) if s.pending]
    if not pending:
        return pending
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        rows = torch.cat(
            [torch.cat([s.fwd_amax_history[0], s.bwd_amax_history[0]]) for s in pending]
        )
        dist.all_reduce(rows, op=dist.ReduceOp.MAX)
        nf = len(FWD_ROLES)
        for s, r in zip(pending, rows.view(len(pending), -1), strict=True):
            s.fwd_amax_history[0].copy_(r[:nf])
            s.bwd_amax_history[0].copy_(r[nf:])
    return pending


# id(parameter) → (weakref to it, weakref to the module that owns it)
_OWNERS: dict[int, tuple[weakref.ref, weakref.ref]] = {}


def remember_owners(root: torch.nn.Module) -> None:
    """Note which module owns each parameter of ``root`` (the compile that found it)."""
    for module in root.modules():
        for p in module.parameters(recurse=False):
            _OWNERS[id(p)] = (weakref.ref(p), weakref.ref(module))


def owner_of(param: torch.Tensor) -> torch.nn.Module | None:
    """The module holding ``param`` in its ``_parameters``. Remembered at compile time; for
    another instance reusing the compiled graph, found once through the garbage collector's
    referrers (the ``_parameters`` dict, then its module) and remembered."""
    entry = _OWNERS.get(id(param))
    if entry is not None and entry[0]() is param and entry[1]() is not None:
        return entry[1]()
    for d in gc.get_referrers(param):
        if not isinstance(d, dict):
            continue
        for m in gc.get_referrers(d):
            if isinstance(m, torch.nn.Module) and m.__dict__.get("_parameters") is d:
                _OWNERS[id(param)] = (weakref.ref(param), weakref.ref(m))
                return m
    return None


class Float8TrainingProgram:
    """The callable the backend returns for a graph with FP8 regions.

    ``compiled`` takes the graph's own inputs, then per delayed-scaling site its forward and
    backward scales, then the amax sink; it returns the graph's outputs, then per site the
    forward amaxes. ``eval_fn`` runs the graph in high precision (``model.eval()``): whether the
    model is training is read, on every call, from the module owning a weight of the region
    (``model.eval()`` reaches every submodule; Dynamo does not guard on it).
    """

    def __init__(
        self,
        compiled: Callable,
        *,
        n_outputs: int,
        sites: list,
        probe: int | torch.Tensor | None,
        eval_fn: Callable,
        autocast_during_eval: bool,
    ) -> None:
        self.compiled = compiled
        self.n_outputs = n_outputs
        self.sites = sites  # fxquant.passes.float8_regions.StateSite
        self.probe = probe
        self.eval_fn = eval_fn
        self.autocast_during_eval = autocast_during_eval

    def _training(self, args) -> bool:
        if self.probe is None:
            return True
        weight = args[self.probe] if isinstance(self.probe, int) else self.probe
        owner = owner_of(weight)
        return True if owner is None else owner.training

    def __call__(self, *args):
        training = self._training(args)
        if not training and not self.autocast_during_eval:
            return self.eval_fn(*args)
        if not self.sites:
            return self.compiled(*args)
        states = [state_for(s.resolve(args), s.recipe, s.fqn) for s in self.sites]
        record = training and torch.is_grad_enabled()
        if record:
            update_states(states)
        extra = [t for s in states for t in (s.fwd_scale, s.bwd_scale)]
        sink = torch.zeros(
            len(states), 2, device=extra[0].device, requires_grad=torch.is_grad_enabled()
        )
        if record:
            sink.register_hook(lambda grad: _record_backward(states, grad))
        out = self.compiled(*args, *extra, sink)
        user, amaxes = out[: self.n_outputs], out[self.n_outputs :]
        if record:
            for s, a in zip(states, amaxes, strict=True):
                torch.maximum(s.fwd_amax_history[0], a, out=s.fwd_amax_history[0])
                s.pending = True
        return type(out)(user) if isinstance(out, tuple) else list(user)


def _record_backward(states: list[LayerState], grad: torch.Tensor) -> None:
    with torch.no_grad():
        for s, g in zip(states, grad, strict=True):
            torch.maximum(s.bwd_amax_history[0], g, out=s.bwd_amax_history[0])


def layer_states(model: torch.nn.Module) -> dict[str, LayerState]:
    """{layer name: state} for the FP8 layers of a model (or its torch.compile wrapper)."""
    model = getattr(model, "_orig_mod", model)  # a torch.compile'd module
    found = {}
    for name, p in model.named_parameters():
        state = _get(p)
        if state is not None:
            found[name.removesuffix(".weight")] = state
    return found


def fp8_state_dict(model: torch.nn.Module, *, all_reduce: bool = False) -> dict[str, torch.Tensor]:
    """The delayed-scaling state of every FP8 layer of ``model`` (or its ``torch.compile``
    wrapper), per layer and role: ``"<layer>.<role>.amax_history"`` ([L]) and
    ``"<layer>.<role>.scale"`` (0-d) for roles input, weight, output, grad_output, grad_input,
    and ``"<layer>.pending"`` (amaxes recorded but not yet applied). Copies, safe to save.

    Under data parallelism the pending amaxes are each rank's own until the next training step
    all-reduces them. ``all_reduce=True`` does that all-reduce now (MAX, as the step would; the
    step's own then changes nothing), so the state saved on one rank is the one every rank
    holds and a run resumed from it on any number of ranks makes the same next update. It is a
    collective: call it on every rank (then save on one), never on one rank alone.
    """
    states = layer_states(model)
    if all_reduce:
        reduce_pending(list(states.values()))
    sd: dict[str, torch.Tensor] = {}
    for layer, s in states.items():
        metas = (
            (FWD_ROLES, s.fwd_amax_history, s.fwd_scale),
            (BWD_ROLES, s.bwd_amax_history, s.bwd_scale),
        )
        for roles, history, scale in metas:
            for i, role in enumerate(roles):
                sd[f"{layer}.{role}.amax_history"] = history[:, i].clone()
                sd[f"{layer}.{role}.scale"] = scale[i].clone()
        sd[f"{layer}.pending"] = torch.tensor(s.pending)
    return sd


def load_fp8_state_dict(
    model: torch.nn.Module,
    state_dict: dict[str, torch.Tensor],
    *,
    recipe: Float8Recipe | None = None,
) -> None:
    """Restore what ``fp8_state_dict`` saved, in place (graphs already compiled keep reading
    the same tensors), so training resumes with the same scales and histories.

    Layers that have no state yet (the model was not compiled or has not run) get one with
    ``recipe`` (default: ``Float8Recipe()`` with the saved history length); their compile later
    checks that its recipe agrees on the history length. Unknown layers, missing keys and
    shape mismatches raise before anything is changed.
    """
    module = getattr(model, "_orig_mod", model)
    params = dict(module.named_parameters())
    layers = sorted({k.rsplit(".", 2)[0] for k in state_dict if k.endswith(".amax_history")})
    plans = []
    for layer in layers:
        weight = params.get(f"{layer}.weight")
        if weight is None:
            raise ValueError(
                f"fp8 state for layer {layer!r}, but the model has no parameter "
                f"{layer + '.weight'!r}; is it the model the state was saved from?"
            )
        try:
            fwd = [state_dict[f"{layer}.{r}.amax_history"] for r in FWD_ROLES]
            bwd = [state_dict[f"{layer}.{r}.amax_history"] for r in BWD_ROLES]
            fs = [state_dict[f"{layer}.{r}.scale"] for r in FWD_ROLES]
            bs = [state_dict[f"{layer}.{r}.scale"] for r in BWD_ROLES]
            pending = bool(state_dict[f"{layer}.pending"])
        except KeyError as e:
            raise ValueError(f"fp8 state for layer {layer!r} lacks key {e.args[0]!r}") from None
        hist_f, hist_b = torch.stack(fwd, 1), torch.stack(bwd, 1)
        if hist_f.shape[0] != hist_b.shape[0]:
            raise ValueError(f"fp8 state for layer {layer!r}: histories of unequal length")
        existing = _get(weight)
        if existing is not None and existing.fwd_amax_history.shape != hist_f.shape:
            raise ValueError(
                f"fp8 state for layer {layer!r} has amax_history_len={hist_f.shape[0]}, the "
                f"layer's compiled recipe {existing.fwd_amax_history.shape[0]}"
            )
        plans.append((weight, existing, hist_f, hist_b, torch.stack(fs), torch.stack(bs), pending))
    for weight, existing, hist_f, hist_b, fs, bs, pending in plans:
        if existing is None:
            r = recipe or Float8Recipe(amax_history_len=hist_f.shape[0])
            existing = _set(weight, LayerState.new(r, weight.device))
        existing.fwd_amax_history.copy_(hist_f)
        existing.bwd_amax_history.copy_(hist_b)
        existing.fwd_scale.copy_(fs)
        existing.bwd_scale.copy_(bs)
        existing.pending = pending
