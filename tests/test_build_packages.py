"""``fxquant.packages.build_packages`` starts one ``python -m fxquant.packages`` per missing
package: where and how it starts them (no build runs here; the demo and
tests/test_generate_compare_cli.py build for real)."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

import fxquant.kernels.cpu as native
from fxquant import packages
from fxquant.passes.cpu import compiler_check

ROOT = Path(__file__).resolve().parent.parent


class _Failed:
    """A child that exited 1 at once."""

    returncode = 1

    def poll(self) -> int:
        return 1

    def kill(self) -> None:
        pass


def test_children_run_outside_the_checkout_with_absolute_paths(tmp_path, monkeypatch):
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text("{}")
    started = []

    def popen(cmd, **kwargs):
        started.append((cmd, kwargs))
        return _Failed()

    monkeypatch.setattr(subprocess, "Popen", popen)
    monkeypatch.setattr(native, "load", lambda: None)  # the kernels' library is not needed here
    monkeypatch.setattr(compiler_check, "inductor_patches", dict)  # nor the compiler check
    monkeypatch.setenv("FXQUANT_CACHE_DIR", "cache")  # relative, as a user may set it
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError, match="building the fp32 package failed"):
        packages.build_packages("model", {"fp32": None}, max_cache_len=64, progress=False)
    ((cmd, kwargs),) = started
    # `-m` puts the working directory on sys.path: in the checkout's root, our kernels/ would
    # stand in for the `kernels` distribution transformers imports
    cwd = Path(kwargs["cwd"]).resolve()
    assert cwd != ROOT and not (cwd / "kernels" / "__init__.py").exists()
    assert cmd[1:3] == ["-m", "fxquant.packages"]
    assert cmd[3] == str(tmp_path / "model")  # the source, absolute
    assert kwargs["env"]["FXQUANT_CACHE_DIR"] == str(tmp_path / "cache")
