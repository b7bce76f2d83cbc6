"""The host compiler check of Inductor's CPU code (``fxquant.passes.cpu.compiler_check``)."""

from __future__ import annotations

import pytest
import torch
from torch._inductor import config as inductor_config

from fxquant.passes.cpu import compiler_check


def _two_transposed(a, b):
    # the kernel GCC 12 got wrong at -O3 with generic AVX-512 tuning: two loop nests that each
    # read a 16-bit float tensor transposed
    return (a.t().float() * 2).contiguous(), (b.t().float() * 4).contiguous()


def test_patches_are_none_or_a_known_mend():
    patches = compiler_check.inductor_patches()
    assert patches == {} or patches in compiler_check._MENDS


def test_a_user_choice_of_simdlen_or_march_is_not_checked():
    with inductor_config.patch({"cpp.simdlen": 256}):
        assert not compiler_check._applies()
    if hasattr(inductor_config.cpp, "march"):  # torch 2.11 has no cpp.march
        with inductor_config.patch({"cpp.march": "x86-64-v3"}):
            assert not compiler_check._applies()


def test_the_backend_compiles_transposed_bf16_nests_right():
    # bit for bit against eager, on whatever machine and compiler runs the tests
    torch._dynamo.reset()
    fn = torch.compile(_two_transposed, backend="fxquant")
    g = torch.Generator().manual_seed(0)
    for dtype in (torch.bfloat16, torch.float16):
        a, b = (torch.randn(128, 128, generator=g).to(dtype) for _ in range(2))
        for got, want in zip(fn(a, b), _two_transposed(a, b), strict=True):
            assert torch.equal(got, want), dtype


@pytest.mark.parametrize(
    ("probe", "want"),
    [([True], {})]
    + [([False] * (i + 1) + [True], mend) for i, mend in enumerate(compiler_check._MENDS)],
)
def test_the_first_mend_the_probe_finds_right_is_used_and_kept(probe, want, tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(compiler_check, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(compiler_check, "_applies", lambda: True)
    monkeypatch.setattr(compiler_check, "_probe", lambda: calls.append(1) or probe)
    check = compiler_check.inductor_patches.__wrapped__
    assert check() == want
    assert check() == want and len(calls) == 1  # the second answer comes from the cache file


def test_no_mend_that_works_is_a_warning(tmp_path, monkeypatch):
    monkeypatch.setattr(compiler_check, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(compiler_check, "_applies", lambda: True)
    monkeypatch.setattr(
        compiler_check, "_probe", lambda: [False] * (1 + len(compiler_check._MENDS))
    )
    with pytest.warns(UserWarning, match="no known option mends it"):
        assert compiler_check.inductor_patches.__wrapped__() == {}


def test_a_probe_that_cannot_run_is_a_warning_and_not_kept(tmp_path, monkeypatch):
    monkeypatch.setattr(compiler_check, "cache_root", lambda: tmp_path)
    monkeypatch.setattr(compiler_check, "_applies", lambda: True)
    monkeypatch.setattr(compiler_check, "_probe", lambda: "g++: not found")
    with pytest.warns(UserWarning, match="(?s)could not check.*g\\+\\+: not found"):
        assert compiler_check.inductor_patches.__wrapped__() == {}
    assert not list(tmp_path.rglob("*.json"))
