"""``fxquant.calibrate``: quantize with an algorithm that sees real data (GPTQ, AWQ, SmoothQuant,
AutoRound).

Where this sits: in front of ``fxquant.quantize``. The model is exported (or an
``ExportedProgram`` is taken as it is), the planning pass decides which linears get which scheme
(the same plan ``quantize`` makes, so weight names match), and then the exported graph itself is
*interpreted* over the calibration samples, node by node, all samples at each node before the
next (``fxquant/calibration/interpreter.py``). Each planned linear is therefore met once, in graph
order, with the real inputs of every sample in hand, and the method's driver acts on it:

- **GPTQ** (``fxquant/calibration/gptq.py``): the Hessian ``2/n·XᵀX`` of those inputs drives
  GPTQ; the linear's output is then computed with the GPTQ weight, so every later layer is
  calibrated on the inputs the quantized model really gives it (``sequential=True``, the
  standard; finer than block by block: ``o_proj`` sees quantized q/k/v). Linears sharing one
  input (q/k/v, gate/up) share one Hessian and are solved as one stacked matrix. The result is in
  the scheme's storage form and goes to ``quantize(..., weights=...)`` untouched.
- **AWQ** (``fxquant/calibration/awq.py``) and **SmoothQuant**
  (``fxquant/calibration/smoothquant.py``): the group of linears reading one input gets a
  per-channel scale chosen from its statistics, folded into the op before it
  (``fxquant/calibration/fold.py``); the graph runs on in float with the folded weights. The
  folded float program is then quantized by round-to-nearest (``quantize``).
- **AutoRound** (``fxquant/calibration/autoround.py``): when the run reaches a transformer block,
  the rounding offsets and clipping ranges of all its int4 linears are tuned together by signed
  gradient descent on the block's output error; the result is in storage form, as GPTQ's.

The methods themselves are plain configs (``fxquant/calibration/methods.py``). The whole run is
one forward pass over the data (only the nodes that lead to a planned linear are run, so e.g. the
logits are never computed). The caller's model or program is never modified: changed weights are
new tensors in a new program.

What calibration did to each layer is added to that layer's report row under ``"calibration"``
(``fxquant.report(qep).rows``): GPTQ's output error against round-to-nearest on the same inputs,
AWQ's chosen α and group loss, SmoothQuant's activation maxima before/after; or why a layer was
left to round-to-nearest.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch.export import ExportedProgram

from fxquant.calibration.autoround import AutoRoundRun
from fxquant.calibration.awq import AWQRun
from fxquant.calibration.gptq import GPTQRun
from fxquant.calibration.interpreter import CalibrationRun
from fxquant.calibration.methods import AWQ, GPTQ, AutoRound, Method, SmoothQuant
from fxquant.calibration.smoothquant import SmoothQuantRun
from fxquant.core.config import QuantConfig, Scheme
from fxquant.core.row import LayerRow
from fxquant.core.scheme import QuantizedWeight
from fxquant.passes.plan import find_sites, plan_sites
from fxquant.passes.rewrite import ProgramEditor

__all__ = ["CalibrationResult", "calibrate", "calibration_pass"]

# Each method's driver: the interpreter with the method's algorithm at each group of linears.
_DRIVERS: dict[type, type[CalibrationRun]] = {
    GPTQ: GPTQRun,
    AWQ: AWQRun,
    SmoothQuant: SmoothQuantRun,
    AutoRound: AutoRoundRun,
}
# Methods whose result is quantized constants (no later method can take them): they come last.
_LAST = (GPTQ, AutoRound)


def calibrate(
    model: torch.nn.Module | ExportedProgram,
    config: QuantConfig | Scheme | str,
    data: Iterable,
    *,
    method: Method | tuple[Method, ...],
    progress: bool = True,
    dynamic_shapes: Any = None,
) -> ExportedProgram:
    """Run a calibration algorithm over ``data``, then quantize.

    Args:
        model: an ``nn.Module`` (exported here with the first sample as example input) or an
            ``ExportedProgram``; it is never modified.
        config: what to quantize to, as for ``fxquant.quantize`` (e.g. ``Int4WeightOnly(
            group_size=64)``); the algorithm applies to the layers whose scheme it supports, the
            others are quantized by round-to-nearest (their report rows say so).
        data: calibration samples; each a tensor (the model's one positional input) or a tuple
            of positional inputs. Without ``dynamic_shapes`` all samples must have the shape of
            the first (the exported graph is specialised to it).
        method: ``GPTQ(...)``, ``AWQ(...)``, ``SmoothQuant(...)`` or ``AutoRound(...)``, or
            several in a tuple, run one after the other, each on the program the one before left
            (e.g. ``(AWQ(clip=False), GPTQ(...))``: AWQ's scales folded in, then GPTQ rounds the
            scaled weights). Only the last may be GPTQ or AutoRound, whose output is quantized
            constants, not a float program.
        progress: show a progress bar (calibration, then quantization).
        dynamic_shapes: passed to ``torch.export.export`` when ``model`` is a module.

    Returns:
        The quantized ``ExportedProgram``; ``fxquant.report(qep).rows[i]["calibration"]`` says
        what calibration did to each layer.
    """
    config = QuantConfig.coerce(config)
    methods = method if isinstance(method, tuple) else (method,)
    if not methods or not all(isinstance(m, tuple(_DRIVERS)) for m in methods):
        raise ValueError(
            f"calibrate: method={method!r} is not supported; allowed: GPTQ(...), AWQ(...), "
            "SmoothQuant(...) or AutoRound(...) from fxquant, or a tuple of them"
        )
    if any(isinstance(m, _LAST) for m in methods[:-1]):
        raise ValueError(
            f"calibrate: method={method!r}: GPTQ and AutoRound must come last (they yield "
            "quantized constants, which no later method can take)"
        )
    samples = [_as_args(s, i) for i, s in enumerate(data)]
    if not samples:
        raise ValueError("calibrate: data is empty; pass at least one calibration sample")
    if isinstance(model, ExportedProgram):
        if dynamic_shapes is not None:
            raise ValueError("calibrate: dynamic_shapes is only used to export an nn.Module")
        ep = model
    elif isinstance(model, torch.nn.Module):
        ep = torch.export.export(model, samples[0], dynamic_shapes=dynamic_shapes)
    else:
        raise ValueError(
            f"calibrate() takes an nn.Module or an ExportedProgram, got {type(model).__name__}"
        )

    program, records = ep, {}
    for m in methods:
        result = calibration_pass(program, config, samples, method=m, progress=progress)
        program = result.program
        for fqn, rec in result.records.items():
            # a later method's record leads; what the earlier ones did is kept under it
            before = records.pop(fqn, None)
            records[fqn] = rec if before is None else {**rec, "after": before}

    from fxquant.api import quantize  # api imports the passes; keep this module light to import

    qep = quantize(program, config, progress=progress, weights=result.weights)
    _attach(qep, records)
    return qep


@dataclass
class CalibrationResult:
    """What ``calibration_pass`` found, before quantization."""

    # a new float program: the input's, with AWQ/SmoothQuant scales folded into its weights
    program: ExportedProgram
    weights: dict[str, QuantizedWeight]  # GPTQ's constants by weight name, for quantize()
    records: dict[str, dict]  # per weight name: what calibration did, or why it did not


def calibration_pass(
    ep: ExportedProgram,
    config: QuantConfig | Scheme | str,
    samples: list[tuple],
    *,
    method: Method,
    progress: bool = False,
) -> CalibrationResult:
    """The calibration run of ``calibrate`` on an exported program, without the quantization:
    the graph interpreted over ``samples`` (tuples of positional inputs), the algorithm applied
    at each planned linear. ``ep`` is not modified."""
    config = QuantConfig.coerce(config)
    editor = ProgramEditor(ep)
    plans = plan_sites(find_sites(editor.graph, editor.weight_of), config)
    run = _driver(method)(editor, ep, plans, method, samples, progress=progress)
    run.check()
    run.run()
    for fqn in run.changed:
        target = editor.state_dict if fqn in editor.state_dict else editor.constants
        target[fqn] = run.state[fqn]
    return CalibrationResult(editor.finish(), run.weights, run.records)


def _driver(method: Method) -> type[CalibrationRun]:
    for cls, run in _DRIVERS.items():
        if isinstance(method, cls):
            return run
    raise ValueError(
        f"calibration_pass: method={method!r} is not supported; allowed: GPTQ(...), AWQ(...), "
        "SmoothQuant(...) or AutoRound(...) from fxquant"
    )


def _as_args(sample: Any, i: int) -> tuple:
    if isinstance(sample, torch.Tensor):
        return (sample,)
    if isinstance(sample, tuple):
        return sample
    raise ValueError(
        f"calibrate: data[{i}] is a {type(sample).__name__}; allowed: a tensor (the model's one "
        "input) or a tuple of positional inputs"
    )


def _attach(qep: ExportedProgram, records: dict[str, dict]) -> None:
    """Add each layer's calibration record to its report row (kept by ``torch.export.save``)."""
    for node in qep.graph.nodes:
        row = LayerRow.from_node(node)
        rec = None if row is None else records.get(row.weight)
        if rec is not None and row.status == "quantized":
            row.replace(calibration=rec).store(node)
