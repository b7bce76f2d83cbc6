"""Which CPU kernel runs a quantized linear: by the machine's class and by M, from a measured
table.

Where it sits: under the native CPU lowerings of ``fxquant.passes.cpu`` (the ``"cpu-native"``
compositions of ``int8``, ``int4`` and ``float8``), which hand :func:`by_m` their candidate
implementations by name. The choice is data, not code: ``dispatch_table.json`` says, per
machine class and op, which candidate runs up to which M, as ``benchmarks/cpu_kernels.py``
measured it on a machine of that class (its results, with the CPU model and flags, are in
``benchmarks/results/cpu_kernels_<class>.json``; ``--write-table`` rewrites this package's
table from them). A class the table does not list gets the native kernels at every M.

With M known when the graph is traced the chosen candidate is the whole lowering; with M
dynamic (one AOTInductor package for decode and prefill) each boundary becomes a
``torch.cond`` on M, so the package runs the GEMV at M = 1 and the large-M kernel at M = 512,
chosen when it runs. A package is built for the class of the machine that builds it
(``fxquant.runtime`` refuses one whose builder had ISA flags the serving CPU lacks).

``FXQUANT_CPU_CLASS`` forces a class (tests run the other classes' dispatch this way, for
correctness; their speed is only what a machine of that class measures), and
``FXQUANT_CPU_DISPATCH=native`` runs the native kernels at every M, as before the table existed
(for measuring them, and for tests of the native kernels themselves).
"""

from __future__ import annotations

import functools
import json
import os
from collections.abc import Callable, Mapping
from pathlib import Path

import torch
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

__all__ = [
    "CANDIDATES",
    "CLASSES",
    "GEMMS",
    "TABLE_PATH",
    "by_m",
    "candidates",
    "dispatches",
    "kernel_plan",
    "machine_class",
    "packed",
    "packs",
    "packs_on",
    "plan_for",
    "table",
]

TABLE_PATH = Path(__file__).with_name("dispatch_table.json")
# Lowest to highest: what each class adds over the one before.
CLASSES = {
    "default": "no AVX2: the native kernels' portable build",
    "avx2": "AVX2 + FMA (AMD EPYC Zen 2/3, older Xeons)",
    "avx512": "AVX-512 without VNNI or bf16",
    "avx512_vnni_bf16": "AVX-512 with VNNI and bf16 dot products, no AMX (AMD EPYC Zen 4/5)",
    "amx": "AMX tiles for int8 and bf16 (Intel Xeon Sapphire Rapids and later)",
}

# What each candidate name in the table is, for reports (the numerics are the family modules').
CANDIDATES = {
    "native": "fxquant native kernel",
    "bf16": "bf16 GEMM (x and the sum rounded to bf16)",
    "bf16_dot": (
        "fxquant native kernel on bf16 dot products from 2 rows (x rounded to bf16 there, "
        "as is an int4 weight's dequantized value; fp32 sums; on AMX tiles from 8 rows where "
        "the CPU has them)"
    ),
    "int_mm": "torch._int_mm (int8, exact int32 sums)",
    "int8_act": "W4A8 kernel (x rounded to int8 per token)",
}

# semantic op name → (the dispatched GEMM its native lowering runs, on which of its schemes), so
# a report can say which kernel a layer gets without lowering it (``dispatches``)
_DISPATCHED: dict[str, tuple[str, Callable[[Mapping], bool] | None]] = {}

# GEMM (a table key) → (the classes where its native kernel has a layout of its own, that
# layout in words), declared by the family module that prepacks it (``packs``)
_PACKED: dict[str, tuple[tuple[str, ...], str]] = {}

# GEMM (a table key) → its candidates {name: rows function}, declared once by the family module
# whose lowering runs them (``candidates``): the lowering dispatches over them and
# benchmarks/cpu_kernels.py measures the same functions to write the table
GEMMS: dict[str, dict[str, Callable[..., Tensor]]] = {}


def candidates(gemm: str, **fns: Callable[..., Tensor]) -> dict[str, Callable[..., Tensor]]:
    """Declare the implementations the GEMM ``gemm`` (a table key) chooses between by M, by
    candidate name (a key of ``CANDIDATES``); returns them, for :func:`by_m`."""
    unknown = [name for name in fns if name not in CANDIDATES]
    if unknown:
        raise ValueError(f"{gemm}: unknown candidates {unknown}; allowed: {list(CANDIDATES)}")
    GEMMS[gemm] = fns
    return fns


def dispatches(gemm: str, *ops: str, when: Callable[[Mapping], bool] | None = None) -> None:
    """Declare that the native lowerings of ``ops`` (semantic op names, ``int8_dynamic_linear``)
    run the GEMM ``gemm`` (a table key) through :func:`by_m`; with ``when``, only for the
    schemes (``Scheme.to_dict()``) it accepts."""
    for op in ops:
        _DISPATCHED[op] = (gemm, when)


def packs(gemm: str, *, classes: tuple[str, ...], layout: str) -> None:
    """Declare that on ``classes``, where the table runs the GEMM ``gemm``'s native kernel at
    every M, its family module prepacks the weight into that kernel's own ``layout`` (words,
    for reports) instead of dispatching by M on the stored one (:func:`packed` says when)."""
    _PACKED[gemm] = (classes, layout)


def packed(gemm: str, machine: str | None = None) -> bool:
    """Whether the native lowering of ``gemm`` stores its weight in the kernel's own layout on
    ``machine`` (default: this one): a class that :func:`packs` names, whose plan is the native
    kernel at every M (one kernel, so one layout; a plan that hands some M to another candidate
    keeps the layout every candidate reads)."""
    machine = machine or machine_class()
    return packs_on(gemm, machine) and plan_for(gemm, machine) == [(None, "native")]


def packs_on(gemm: str, machine: str) -> bool:
    """Whether ``gemm``'s native kernel has a layout of its own on the class ``machine`` (what
    benchmarks/cpu_kernels.py times beside the stored layout's candidates)."""
    return machine in _PACKED.get(gemm, ((), ""))[0]


def machine_class() -> str:
    """This CPU's class (a key of ``CLASSES``), or ``$FXQUANT_CPU_CLASS`` when set."""
    forced = os.environ.get("FXQUANT_CPU_CLASS")
    if forced:
        if forced not in CLASSES:
            raise ValueError(
                f"FXQUANT_CPU_CLASS={forced!r} is not a CPU class; allowed: {', '.join(CLASSES)}"
            )
        return forced
    return _probed_class()


@functools.cache  # the CPU does not change under a process; eager calls ask at every GEMM
def _probed_class() -> str:
    cpu = torch.cpu
    if cpu._is_amx_tile_supported():
        return "amx"
    if cpu._is_avx512_supported():
        vnni_bf16 = cpu._is_vnni_supported() and cpu._is_avx512_bf16_supported()
        return "avx512_vnni_bf16" if vnni_bf16 else "avx512"
    return "avx2" if cpu._is_avx2_supported() else "default"


@functools.cache
def table() -> dict[str, dict[str, list[list]]]:
    """``{class: {op name: [[max_m or None, candidate], ...]}}``, as measured."""
    return json.loads(TABLE_PATH.read_text())["classes"]


def plan_for(op_name: str, machine: str | None = None) -> list[tuple[int | None, str]]:
    """[(max M, candidate), ...] for ``op_name`` on ``machine`` (default: this one), the last
    with max M None; ``[(None, "native")]`` where the table says nothing."""
    if os.environ.get("FXQUANT_CPU_DISPATCH", "table") == "native":
        return [(None, "native")]
    rows = table().get(machine or machine_class(), {}).get(op_name)
    return [(m, name) for m, name in rows] if rows else [(None, "native")]


def kernel_plan(op: str, scheme: Mapping | None = None, machine: str | None = None) -> str:
    """Which kernel the native CPU lowering of the semantic op ``op`` (for ``scheme``, a
    ``Scheme.to_dict()``) runs at each M on ``machine`` (default: this one), in words:
    ``"fxquant native kernel up to M = 16, then bf16 GEMM"``."""
    gemm, when = _DISPATCHED.get(op, (None, None))
    if gemm is None or (when is not None and (scheme is None or not when(scheme))):
        return "one lowering at every M (no per-M dispatch)"
    plan = plan_for(gemm, machine)
    if packed(gemm, machine):
        return f"{CANDIDATES['native']} at every M, on a weight prepacked in {_PACKED[gemm][1]}"
    if len(plan) == 1:
        return f"{CANDIDATES[plan[0][1]]} at every M"
    parts = [
        f"{CANDIDATES[name]} up to M = {max_m}" if max_m is not None else CANDIDATES[name]
        for max_m, name in plan
    ]
    return ", then ".join(parts)


def by_m(op_name: str, m, candidates: Mapping[str, Callable[..., Tensor]], *args) -> Tensor:
    """``candidates[name](*args)`` for the candidate the table picks at ``m`` rows.

    ``args`` are the op's arguments (tensors, None, numbers), the first the [M, K] activation
    (``m`` is its row count); a dynamic ``m`` puts each boundary under ``torch.cond``, whose
    branches take the tensor arguments as operands and close over the rest.
    """
    plan = plan_for(op_name)
    missing = [name for _, name in plan if name not in candidates]
    if missing:
        raise KeyError(
            f"dispatch_table.json names {missing} for {op_name}; it has {list(candidates)}"
        )
    return by_plan(plan, m, candidates, *args)


def by_plan(plan, m, candidates: Mapping[str, Callable[..., Tensor]], *args) -> Tensor:
    """``by_m`` with the plan given: ``[(max M, candidate name), ..., (None, name)]``."""
    return _run(plan, m, candidates, args)


def _run(plan, m, candidates, args) -> Tensor:
    (max_m, name), rest = plan[0], plan[1:]
    if max_m is None or statically_known_true(m <= max_m):
        return candidates[name](*args)
    if statically_known_true(m > max_m):
        return _run(rest, m, candidates, args)
    slots = [i for i, a in enumerate(args) if isinstance(a, Tensor)]

    def branch(run):
        def call(*tensors):
            full = list(args)
            for i, t in zip(slots, tensors, strict=True):
                full[i] = t
            return run(tuple(full))

        return call

    small = branch(lambda a: candidates[name](*a))
    # the next boundary reads M off the branch's own activation (args[0], M rows), not the
    # closure: an unbacked M (torch.compile's mark_unbacked) cannot enter a branch's trace
    large = branch(lambda a: _run(rest, a[0].shape[0], candidates, a))
    operands = tuple(args[i] for i in slots)
    if torch.compiler.is_dynamo_compiling():
        # a plan of three or more ranges: this cond sits in the outer one's large branch, which
        # Dynamo is tracing under the outer patch (and cannot trace the patch itself)
        return torch.cond(m <= max_m, small, large, operands)
    # As the CUDA lowering's torch.cond (kernels/gemm.py): Dynamo traces every branch from this
    # same code, and automatic-dynamic would lift an int that differs between two GEMMs (a
    # group size) into the operands, which export's placeholder naming cannot take.
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        return torch.cond(m <= max_m, small, large, operands)
