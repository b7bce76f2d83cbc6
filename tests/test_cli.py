"""The ``fxquant`` command: quantize a module:function, report the .pt2, clear errors."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest
import torch

import fxquant  # noqa: F401  (loading a quantized .pt2 needs the fxquant:: ops registered)

MODEL = textwrap.dedent(
    """
    import torch
    from torch.export import Dim

    def build():
        torch.manual_seed(0)
        m = torch.nn.Sequential(
            torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 32)
        )
        return m, (torch.randn(2, 64),), ({0: Dim.DYNAMIC},)
    """
)


def _fxquant(*args, cwd):
    return subprocess.run(
        [sys.executable, "-m", "fxquant.cli", *args],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture
def project(tmp_path):
    (tmp_path / "mymodel.py").write_text(MODEL)
    return tmp_path


def test_quantize_then_report(project):
    out = _fxquant("quantize", "mymodel:build", "--recipe", "w8a8", "--out", "q.pt2", cwd=project)
    assert out.returncode == 0, out.stderr
    assert "2 of 2 linear layers quantized" in out.stdout
    ep = torch.export.load(project / "q.pt2")
    assert ep.module()(torch.randn(5, 64)).shape == (5, 32)  # batch stayed dynamic
    rep = _fxquant("report", "q.pt2", "--json", cwd=project)
    assert rep.returncode == 0, rep.stderr
    data = json.loads(rep.stdout)
    assert data["config"]["scheme"] == {"type": "Int8DynamicActivation"}
    assert [r["name"] for r in data["layers"]] == ["0", "2"]


def test_scheme_as_json(project):
    scheme = '{"type": "Int4WeightOnly", "group_size": 32, "symmetric": true}'
    out = _fxquant("quantize", "mymodel:build", "--scheme", scheme, "--out", "q.pt2", cwd=project)
    assert out.returncode == 0, out.stderr
    assert "Int4WeightOnly(group_size=32, symmetric=True)" in out.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (
            ["quantize", "mymodel:build", "--recipe", "int3", "--out", "q.pt2"],
            "unknown recipe 'int3'",
        ),
        (["quantize", "mymodel:nope", "--out", "q.pt2"], "cannot load 'mymodel:nope'"),
        (["quantize", "mymodel:build"], "give --out x.pt2 and/or --aoti"),
        (["quantize", "missing.gguf", "--out", "q.pt2"], "no GGUF file at missing.gguf"),
        (["report", "mymodel.py"], "mymodel.py is not a loadable torch.export .pt2"),
        (["report", "nothere.pt2"], "no file at nothere.pt2"),
    ],
)
def test_errors_say_what_is_wrong(project, args, message, monkeypatch):
    from fxquant.cli import main

    monkeypatch.chdir(project)
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert message in str(exc.value)
    assert not (project / "q.pt2").exists()


def test_version(capsys):
    from fxquant.cli import main

    with pytest.raises(SystemExit) as exc:
        main(["--version"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.strip() == (
        f"fxquant {fxquant.__version__} (torch {torch.__version__})"
    )


def test_atomic_path_leaves_nothing_behind_on_failure(tmp_path):
    from fxquant.api import atomic_path

    target = tmp_path / "sub" / "model.pt2"
    with pytest.raises(RuntimeError), atomic_path(target) as tmp:
        tmp.write_bytes(b"half")
        raise RuntimeError("compile failed")
    assert list((tmp_path / "sub").iterdir()) == []
    with atomic_path(target) as tmp:
        tmp.write_bytes(b"whole")
    assert target.read_bytes() == b"whole"
    assert target.stat().st_mode & 0o044  # readable by others, unlike mkstemp's 0600
    assert list((tmp_path / "sub").iterdir()) == [target]
