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
    # which CPU kernel the layers run by M, on this machine's class
    assert data["cpu_kernels"][0]["layers"] == ["0", "2"] and data["cpu_kernels"][0]["kernel"]
    text = _fxquant("report", "q.pt2", cwd=project).stdout
    assert "CPU kernels by M, CPU class" in text and "Int8DynamicActivation() (2 layers): " in text


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
        (["report", "mymodel.py"], "mymodel.py: not a .pt2 archive"),
        (["report", "nothere.pt2"], "no file at nothere.pt2"),
        (
            ["quantize", "mymodel:build", "--out", "q.pt2", "--scheme",
             '{"type": "Int4WeightOnly", "groupsize": 64}'],
            "Int4WeightOnly has no field 'groupsize'; its fields: group_size, symmetric",
        ),
        (
            ["quantize", "mymodel:build", "--out", "q.pt2", "--scheme", "5"],
            'a scheme is a dict such as {"type": "Int8WeightOnly"} or null, not int 5',
        ),
        (
            ["quantize", "mymodel:build", "--out", "q.pt2", "--scheme", '"int8wo"'],
            "not str 'int8wo' (a recipe name: use --recipe",
        ),
        (
            ["quantize", "mymodel:build", "--out", "q.pt2", "--config", "recipe.json"],
            "not str 'int8wo' (a recipe name",
        ),
        (
            ["quantize", "mymodel:build", "--out", "q.pt2", "--config", "missing.json"],
            "--config missing.json: no such file",
        ),
        (
            ["quantize", "mymodel:build", "--out", "q.pt2", "--seq-len", "0"],
            "--seq-len 0 is not supported; allowed: 2 or more",
        ),
        (
            ["quantize", "mymodel:build", "--out", "q.pt2", "--dtype", "bf16"],
            "--dtype is for a .gguf file or a model folder; mymodel:build() makes its model",
        ),
        (["quantize", "mymodel:build", "--out", "sub"], "--out sub is a directory"),
        (["quantize", "mymodel:build", "--out", "no/such/q.pt2"], "does not exist"),
        (
            ["quantize", "cut.gguf", "--out", "q.pt2"],
            "cut.gguf: not a readable GGUF file (truncated or corrupt?)",
        ),
    ],
)  # fmt: skip
def test_errors_say_what_is_wrong(project, args, message, monkeypatch, capsys):
    from fxquant.cli import main

    (project / "recipe.json").write_text('{"scheme": "int8wo"}')
    (project / "sub").mkdir()
    (project / "cut.gguf").write_bytes(b"GGUF\x03\x00\x00\x00" + b"\x01" * 20)
    monkeypatch.chdir(project)
    with pytest.raises(SystemExit) as exc:
        main(args)
    assert message in str(exc.value)
    assert "\n" not in str(exc.value)  # one line
    assert "running mymodel.build()" not in capsys.readouterr().err  # refused before any work
    assert not (project / "q.pt2").exists()


def test_debug_shows_the_traceback_and_a_closed_pipe_is_quiet(project):
    out = _fxquant("quantize", "cut.gguf", "--out", "q.pt2", "--debug", cwd=project)
    assert out.returncode != 0 and "Traceback" not in out.stderr  # no such file: a clean exit
    (project / "cut.gguf").write_bytes(b"GGUF" + b"\x01" * 8)
    out = _fxquant("quantize", "cut.gguf", "--out", "q.pt2", "--debug", cwd=project)
    assert out.returncode != 0 and "Traceback" in out.stderr
    out = _fxquant("quantize", "cut.gguf", "--out", "q.pt2", cwd=project)
    assert out.returncode != 0 and "Traceback" not in out.stderr
    assert len(out.stderr.strip().splitlines()) == 1, out.stderr
    assert _fxquant("quantize", "mymodel:build", "--out", "q.pt2", cwd=project).returncode == 0
    piped = subprocess.run(
        f"{sys.executable} -m fxquant.cli report q.pt2 --json | head -1",
        shell=True, cwd=project, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert piped.stdout.strip() == "{"
    assert "BrokenPipeError" not in piped.stderr and "Traceback" not in piped.stderr


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


def test_generate_caps_its_default_cache_at_what_the_model_takes(tmp_path):
    """A default ``--max-cache-len`` (prompt + new tokens rounded up to 256) past the model's
    positional limit is capped, not refused at export; a sliding window is no limit."""
    tf = pytest.importorskip("transformers")
    from fxquant.cli import _default_cache_len

    common = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2)  # fmt: skip
    window = tf.MistralConfig(**common, sliding_window=64, max_position_embeddings=4096)
    window.save_pretrained(tmp_path / "window")
    short = tf.LlamaConfig(**common, max_position_embeddings=200)
    short.save_pretrained(tmp_path / "short")
    long = tf.LlamaConfig(**common, max_position_embeddings=8192)
    long.save_pretrained(tmp_path / "long")
    assert _default_cache_len(tmp_path / "window", 512) == 512
    assert _default_cache_len(tmp_path / "short", 512) == 200
    assert _default_cache_len(tmp_path / "long", 0) == 256
    assert _default_cache_len(tmp_path / "long", 512) == 512
