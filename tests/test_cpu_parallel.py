"""Inductor's C++ kernels of dynamic size open their OpenMP regions by the size they run at
(``fxquant.passes.cpu.parallel``): both copies of a region compute what Inductor's own code
computes, and the scope leaves Inductor as it found it."""

import re

import pytest
import torch
from torch._inductor.codegen import cpp
from torch._inductor.utils import run_and_get_code

from fxquant.passes.cpu import parallel

GUARD = r"if \((.*>= (\d+))\)\s*\{\s*#pragma omp parallel"
WIDTH = 256  # 1 row: 256 iterations, serial; 128 rows: 32768, parallel


def _norm_act(x, w):
    """Row kernels (an RMSNorm, an activation), a reduction over the dynamic rows and one over
    every element (a parallel reduction: one partial a thread)."""
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * w
    return torch.nn.functional.silu(y) * 2.0, y.sum(0), x.abs().sum()


def _compile(scoped: bool):
    torch._dynamo.reset()
    fn = torch.compile(_norm_act, dynamic=True)
    x, w = torch.randn(8, WIDTH), torch.randn(WIDTH)
    # two threads, as on a user's machine: a test worker has one, and Inductor writes no
    # OpenMP region for one
    with torch._inductor.config.patch({"fx_graph_cache": False, "cpp.threads": 2}):
        if scoped:
            with parallel.sized_regions() as patched:
                assert patched
                _, (code, *_) = run_and_get_code(fn, x, w)
        else:
            _, (code, *_) = run_and_get_code(fn, x, w)
    return fn, code


@pytest.fixture(scope="module")
def compiled():
    scoped, code = _compile(True)
    plain, plain_code = _compile(False)
    return scoped, code, plain, plain_code


def test_regions_of_dynamic_size_are_written_twice(compiled):
    _, code, _, plain_code = compiled
    regions = code.count("#pragma omp parallel")
    assert regions >= 1 and regions == plain_code.count("#pragma omp parallel")
    # each region sits in the parallel branch of a test on its work, with a serial copy after
    guards = re.findall(GUARD, code)
    assert len(guards) == regions
    assert all(int(n) == parallel.MIN_PARALLEL_WORK and "ks" in g for g, n in guards)
    assert code.count("else") >= regions
    assert "_arr[tid]" in code  # the parallel reduction's partials, in both copies
    assert not re.search(GUARD, plain_code)


@pytest.mark.parametrize("rows", [1, 3, 128])
def test_both_copies_compute_what_inductor_computes(compiled, rows):
    scoped, _, plain, _ = compiled
    x, w = torch.randn(rows, WIDTH), torch.randn(WIDTH)
    got, want, eager = scoped(x, w), plain(x, w), _norm_act(x, w)
    # row kernels: bit for bit; the reduction over rows may sum in another order when one
    # thread runs it instead of two, as at any other thread count
    assert torch.equal(got[0], want[0])
    for i in (1, 2):
        torch.testing.assert_close(got[i], want[i], rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(got[i], eager[i], rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(got[0], eager[0])


def test_the_scope_restores_inductor_and_nests():
    before = (cpp.CppKernel.codegen_loops_impl, cpp.WorkSharing.parallel, cpp.WorkSharing.close)
    with parallel.sized_regions():
        patched = cpp.WorkSharing.parallel
        assert patched is not before[1]
        with parallel.sized_regions():  # nested: the same patch, not a second layer
            assert cpp.WorkSharing.parallel is patched
        assert cpp.WorkSharing.parallel is patched
    after = (cpp.CppKernel.codegen_loops_impl, cpp.WorkSharing.parallel, cpp.WorkSharing.close)
    assert after == before
    with pytest.raises(RuntimeError, match="boom"), parallel.sized_regions():
        raise RuntimeError("boom")
    assert cpp.WorkSharing.parallel is before[1]


def test_the_threshold_keys_the_inductor_cache_without_touching_the_callers_configs():
    configs = {"aot_inductor.metadata": {"mine": "1"}, "cpp.threads": 2}
    got = parallel.keyed(configs)
    assert configs == {"aot_inductor.metadata": {"mine": "1"}, "cpp.threads": 2}
    assert got["cpp.threads"] == 2
    assert got["aot_inductor.metadata"] == {
        "mine": "1",
        "fxquant_serial_below": str(parallel.MIN_PARALLEL_WORK),
    }
