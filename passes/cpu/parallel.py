"""OpenMP regions that open by the size they run at, not the size they were traced at: a scope
around Inductor's code generation for the CPU, in ``fxquant.aot_compile`` and in the backend's
inference compile (``torch.compile(backend="fxquant")``, where a batch dimension marked dynamic
or unbacked is traced at one size and run at others).

Where it sits: between fxquant's lowering and Inductor's C++ code generation. Inductor decides
once, at trace time, whether a kernel's loops run in an OpenMP region (``decide_parallel_depth``:
the product of the loop sizes at their size hints, against ``cpp.min_chunk_size`` a thread).
With a dynamic dimension that hint is the example's: ``fxquant.export_llm`` traces 8 tokens, so
every norm, rotary and activation kernel of an LLM program opens a region for both threads, and
its decode step (1 token) pays, for each of ~120 kernels of a few hundred elements, a wake-up
and three or four barriers while one thread does all the work. On SmolLM2-135M w8a8+lm_head
(AMD EPYC Zen 4, 2 cores; packages built with and without this scope, one process, interleaved)
a decode step measured 5.61 ms against 6.32 (1.13x) and the 128-token prefill 75.4 ms against
75.2; every kernel serial instead (a large ``cpp.min_chunk_size``) measured 5.51 ms a step but
cost the prefill 6-11 %.

So inside :func:`sized_regions` a region that Inductor opens over loops of dynamic size is
written twice, chosen by the size it runs at::

    if (576L*ks0 >= 16384) {            // MIN_PARALLEL_WORK: the work of the region's kernels
        #pragma omp parallel            // as Inductor wrote it
        { int tid = omp_get_thread_num(); ... #pragma omp for ... }
    } else {
        { int tid = omp_get_thread_num(); ... #pragma omp for ... }   // on the calling thread
    }

The second copy's ``omp for`` / ``omp single`` are orphaned constructs, which bind to the
calling thread alone: no team, no wake-up, no barrier. (An OpenMP ``if`` clause says the same
but still builds a team of one: ~0.9 us a region here, against ~0.02 us for the orphaned copy,
and a region with both threads 1-2 us, in a C loop on the same machine; ~5 us in the decode
step.) Inductor's parallel reductions keep one partial a thread, initialised to the identity,
and ``tid`` is 0 on the calling thread, so both copies compute the same values, up to the
order in which a parallel reduction adds its partials (as at any other thread count;
``tests/test_cpu_parallel.py`` compares code compiled with and without this scope: row kernels
bit for bit).

This reaches into Inductor's code generator (``WorkSharing.parallel`` / ``close`` /
``__exit__`` and ``CppKernel.codegen_loops_impl``, torch 2.13): where those are not there the
scope changes nothing, and a region not of the expected shape is left as Inductor wrote it.
``keyed`` puts the threshold in Inductor's cache key, so code generated with and without
the scope never share a cache entry.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import sympy

__all__ = ["MIN_PARALLEL_WORK", "keyed", "sized_regions"]

# Loop iterations (elements, for Inductor's elementwise and row kernels) below which a region
# runs on the calling thread. In a SmolLM2 decode step a region of two threads cost ~5 us more
# than its serial copy (0.7 ms over ~120 kernels), about the time two threads save on ~16-40k
# elements of vectorised row work. Not swept: prompts of 8, 16 and 24 tokens, whose norm
# kernels (576 wide) now run serial, prefilled 1.01x, 1.00x and 1.06x as fast as with every
# region parallel (Zen 4, one process, interleaved).
MIN_PARALLEL_WORK = 16384

# the patch is process-wide while any scope is open (nested and concurrent scopes share it)
_lock = threading.Lock()
_depth = 0
_saved: list = []


def keyed(configs: dict) -> dict:
    """``configs`` (Inductor config patches) with this scope's threshold in
    ``aot_inductor.metadata``, which Inductor's cache key reads: code generated with and without
    the scope never share a cache entry (and a package's metadata records the threshold)."""
    meta = configs.get("aot_inductor.metadata", {})
    meta = {**meta, "fxquant_serial_below": str(MIN_PARALLEL_WORK)}
    return {**configs, "aot_inductor.metadata": meta}


def _codegen():
    """Inductor's C++ code generator, or None where it is not the shape this module patches."""
    try:
        from torch._inductor.codegen import cpp
        from torch._inductor.codegen.cpp_utils import cexpr_index
    except ImportError:  # pragma: no cover - another torch
        return None
    ws, kernel = getattr(cpp, "WorkSharing", None), getattr(cpp, "CppKernel", None)
    if not all(
        hasattr(owner, name)
        for owner, name in (
            (ws, "parallel"),
            (ws, "close"),
            (ws, "__exit__"),
            (kernel, "codegen_loops_impl"),
            (kernel, "rename_indexing"),
        )
    ):
        return None  # pragma: no cover - another torch
    return cpp, cexpr_index


@contextlib.contextmanager
def sized_regions() -> Iterator[bool]:
    """Within this scope Inductor's C++ kernels run their OpenMP regions in parallel only where
    the loops they hold are at least ``MIN_PARALLEL_WORK`` iterations, decided each call;
    yields whether the code generator could be patched (False: Inductor's code, unchanged)."""
    found = _codegen()
    if found is None:  # pragma: no cover - another torch
        yield False
        return
    cpp, cexpr_index = found
    global _depth
    with _lock:
        if _depth == 0:
            _saved[:] = _patch(cpp, cexpr_index)
        _depth += 1
    try:
        yield True
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0:
                (
                    cpp.CppKernel.codegen_loops_impl,
                    cpp.WorkSharing.parallel,
                    cpp.WorkSharing.close,
                    cpp.WorkSharing.__exit__,
                ) = _saved
                _saved.clear()


def _patch(cpp, cexpr_index) -> tuple:
    """Install the wrappers; return the originals."""
    loops_impl = cpp.CppKernel.codegen_loops_impl
    parallel, close = cpp.WorkSharing.parallel, cpp.WorkSharing.close
    exit_ = cpp.WorkSharing.__exit__

    def codegen_loops_impl(self, loop_nest, code, worksharing):
        # the sizes of the loops this kernel is about to write, as its C++ names them
        work = sympy.Integer(1)
        for size in self.call_ranges or ():
            work *= size
        work = self.rename_indexing(work)
        worksharing._fxq_work = work if work.free_symbols else None
        try:
            return loops_impl(self, loop_nest, code, worksharing)
        finally:
            worksharing._fxq_work = None

    def sized_parallel(self, threads):
        opening = not self.in_parallel or threads != self.num_threads
        parallel(self, threads)
        work = getattr(self, "_fxq_work", None)
        if opening:
            lines = getattr(self.code, "_lines", None)
            start = None if lines is None else _last_pragma(lines)
            self._fxq_region = (start, [work])
        elif getattr(self, "_fxq_region", None) is not None:
            # a later kernel in the same region
            self._fxq_region[1].append(work)

    def closing(end):
        # a region ends at close() and, for the last one of a kernel, at __exit__
        def sized_end(self, *args):
            region = getattr(self, "_fxq_region", None) if self.in_parallel else None
            self._fxq_region = None
            result = end(self, *args)
            if region is not None and region[0] is not None:
                _split(self.code._lines, *region, MIN_PARALLEL_WORK, cexpr_index)
            return result

        return sized_end

    cpp.CppKernel.codegen_loops_impl = codegen_loops_impl
    cpp.WorkSharing.parallel = sized_parallel
    cpp.WorkSharing.close = closing(close)
    cpp.WorkSharing.__exit__ = closing(exit_)
    return loops_impl, parallel, close, exit_


def _last_pragma(lines: list) -> int | None:
    for i in range(len(lines) - 1, -1, -1):
        if isinstance(lines[i], str) and lines[i].lstrip().startswith("#pragma omp parallel"):
            return i
    return None  # pragma: no cover - another torch


def _split(lines: list, start: int, works: list, min_work: int, cexpr_index) -> None:
    """Write the region ``lines[start:]`` (its pragma, then its braced body) twice: parallel
    where its kernels' work reaches ``min_work``, else its body alone. Left as it is where one
    of its kernels has a static size (Inductor chose parallel by its real size) or the region
    is not the shape expected."""
    region = lines[start:]
    if any(w is None for w in works) or len(region) < 3:
        return
    pad = region[0][: len(region[0]) - len(region[0].lstrip())]
    if not (isinstance(region[1], str) and region[1].strip() == "{"):
        return  # pragma: no cover - another torch
    conds = dict.fromkeys(f"{cexpr_index(w)} >= {min_work}" for w in works)
    cond = " || ".join(f"({c})" for c in conds) if len(conds) > 1 else next(iter(conds))
    lines[start:] = [
        f"{pad}if ({cond})",
        f"{pad}{{",
        *region,
        f"{pad}}}",
        f"{pad}else",
        *region[1:],
    ]
