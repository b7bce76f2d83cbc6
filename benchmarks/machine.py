"""What every benchmark records and how it times: the machine it ran on (CPU model, ISA flags,
the CPU class the lowering dispatches on), interleaved median timing, atomic JSON output, and a
``forward`` of its own for each model compiled side by side.

Shared by the scripts in this folder (run as ``python benchmarks/<script>.py``). The dev and CI
CPUs vary between sessions (AVX2 EPYCs, AVX-512 EPYCs, AMX Xeons): a number without its
machine is not a result.
"""

from __future__ import annotations

import datetime
import json
import os
import platform
import statistics
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch

import fxquant.api
from fxquant.passes.cpu.dispatch import machine_class

__all__ = ["bench_interleaved", "machine_info", "own_forward", "write_results"]

# the flags that decide which kernels are fast here
_ISA = ("avx2", "fma", "avx512f", "avx512bw", "avx512vbmi", "avx512_vnni", "avx512_bf16",
        "avx_vnni", "amx_tile", "amx_int8", "amx_bf16")  # fmt: skip


def machine_info() -> dict:
    cpu = "unknown"
    flags: list[str] = []
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and cpu == "unknown":
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags") and not flags:
                flags = line.split(":", 1)[1].split()
    except OSError:
        pass
    return {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "cpu_model": cpu,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_class": machine_class(),
        "isa_flags": [f for f in _ISA if f in flags],
        "avx512": any(f.startswith("avx512") for f in flags),
        "os_cpu_count": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "loadavg_1_5_15": os.getloadavg(),  # other processes share the cores: read min_ms too
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
    }


def _time_once(f: Callable, inner: int) -> float:
    t0 = time.perf_counter()
    for _ in range(inner):
        f()
    return (time.perf_counter() - t0) / inner


def bench_interleaved(fns: dict[str, Callable], rounds: int, target_s: float = 0.03) -> dict:
    """Median per-call seconds; every round runs every candidate, so load spikes hit all."""
    inner = {}
    for name, f in fns.items():
        f()  # warmup (and compile)
        f()
        t = _time_once(f, 1)
        inner[name] = max(1, min(200, int(target_s / max(t, 1e-6))))
    samples: dict[str, list[float]] = {k: [] for k in fns}
    for _ in range(rounds):
        for name, f in fns.items():
            samples[name].append(_time_once(f, inner[name]))
    return {
        k: {"median_ms": statistics.median(v) * 1e3, "min_ms": min(v) * 1e3}
        for k, v in samples.items()
    }


def write_results(res: dict, out: str | Path) -> None:
    """Write a benchmark's JSON record (atomically: a killed run leaves the old file intact)."""
    with fxquant.api.atomic_path(out) as tmp:
        tmp.write_text(json.dumps(res, indent=1))
    print(f"wrote {out} ({res['wall_s']:.0f} s)")


def own_forward(module: torch.nn.Module) -> torch.nn.Module:
    """``module`` with a ``forward`` of its own code object, for models compiled side by side.

    Dynamo keeps compiled graphs, their guards and the recompile count (limit 8) per code
    object, and every instance of a class shares one ``forward``. In ``llm_decode.py``, six
    variants compiled in one process (a prefill and a decode graph each) hit the limit at the
    eighth graph: torchao's rows ran eager, and the backend rows decoded at 0.7x fp32 Inductor,
    where the same variant compiled alone takes 14 ms a step (seen in one run). With the module
    guards skipped (the generation settings of docs/llm.md) models sharing one code object
    would share graphs. A copy of the code per model keeps each model's cache its own.
    """
    fwd = type(module).forward
    own = types.FunctionType(
        fwd.__code__.replace(), fwd.__globals__, fwd.__name__, fwd.__defaults__, fwd.__closure__
    )
    own.__dict__.update(fwd.__dict__)  # what decorators set on it (transformers' forwards)
    module.forward = types.MethodType(own, module)
    return module
