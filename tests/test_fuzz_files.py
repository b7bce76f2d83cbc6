"""Damaged files get a clear error or a correct result: never a crash, a hang or a traceback.

For each of a quantized ``.pt2`` program, a GGUF file and a compressed-tensors safetensors
checkpoint, 200 variants (100 truncations, 100 single bit flips, seeded) go through fxquant's
reader in a subprocess (a native crash fails the test with its signal instead of killing
pytest), each under a time bound; then a sample through the CLI (``fxquant report`` /
``fxquant quantize``), which must exit non-zero with a one-line error and write nothing.

A ``.pt2`` is a zip whose entries carry CRC-32s: a flipped bit must be an error, never a
program that computes something else. GGUF and safetensors have no checksum: a flip in a
tensor's bytes is a valid file with other values, so there a flip may load (with other
values); a truncation never may.
"""

from __future__ import annotations

import json
import random
import shutil
import subprocess
import sys
import textwrap

import pytest
import torch

import fxquant

pytestmark = pytest.mark.slow

VARIANTS = 200

CHILD = textwrap.dedent(
    """
    import json, signal, sys
    from pathlib import Path
    import torch
    from fxquant.checkpoints import CheckpointError
    from fxquant.safe_load import ProgramLoadError

    kind, good, paths = sys.argv[1], sys.argv[2], sys.argv[3:]
    x = torch.randn(2, 64)

    def load(path):
        if kind == "pt2":
            from fxquant.safe_load import load_program

            return [load_program(path).module()(x)]
        if kind == "gguf":
            from fxquant.checkpoints.gguf import read_gguf

            ckpt = read_gguf(path)
        else:  # a model folder: config.json + model.safetensors
            from fxquant.checkpoints import read_quantized

            ckpt = read_quantized(Path(path).parent)
        out = [t for _, t in sorted(ckpt.tensors.items())]
        for _, w in sorted(ckpt.weights.items()):
            out += [t for _, t in sorted(w.tensors.items())]
        return out

    def same(a, b):
        return len(a) == len(b) and all(
            u.shape == v.shape and u.dtype == v.dtype and torch.equal(u, v) for u, v in zip(a, b)
        )

    def timeout(*_):
        raise TimeoutError

    signal.signal(signal.SIGALRM, timeout)
    want = load(good)
    out = {}
    for path in paths:
        signal.alarm(20)
        try:
            out[path] = "same" if same(load(path), want) else "loaded, different values"
        except TimeoutError:
            out[path] = "hang"
        except (CheckpointError, ProgramLoadError, NotImplementedError) as e:
            # the first two name the file; NotImplementedError names the tensor and its type
            named = any(str(f) in str(e) for f in (path, Path(path).parent))
            named = named or isinstance(e, NotImplementedError)
            out[path] = "error" if named else f"error without the file name: {e}"
        except Exception as e:  # noqa: BLE001
            out[path] = f"unclear {type(e).__name__}: {str(e)[:200]}"
        finally:
            signal.alarm(0)
    print(json.dumps(out))
    """
)


def _variants(data: bytes, folder, name: str, n: int) -> tuple[list, list]:
    """(truncated, flipped) copies of ``data``, each ``folder/<i>/name`` (a model folder's file
    keeps its name)."""
    rng = random.Random(0)
    cuts, flips = [], []
    for i in range(n):
        if i < n // 2:  # truncations, from nothing to one byte short
            body = data[: rng.randrange(len(data))]
        else:  # one flipped bit anywhere
            b = bytearray(data)
            pos = rng.randrange(len(b))
            b[pos] ^= 1 << rng.randrange(8)
            body = bytes(b)
        path = folder / str(i) / name
        path.parent.mkdir(parents=True)
        path.write_bytes(body)
        (cuts if i < n // 2 else flips).append(path)
    return cuts, flips


def _run_reader(kind: str, good, paths) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", CHILD, kind, str(good), *map(str, paths)],
        capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert out.returncode == 0, f"crashed (exit {out.returncode}):\n{out.stderr[-2000:]}"
    return json.loads(out.stdout.strip().splitlines()[-1])


def _check(result: dict, flips, *, flips_may_load: bool) -> None:
    """Every variant: the same values or a clear error; a flipped bit in a format without a
    checksum may also load as the other values it now holds."""
    flipped = set(map(str, flips))
    bad = {
        p: r
        for p, r in result.items()
        if r not in ("same", "error")
        and not (flips_may_load and p in flipped and r == "loaded, different values")
    }
    assert not bad, bad


def _cli_fails_in_one_line(args: list, cwd, out=None, *, only_line: bool = False) -> None:
    cli = subprocess.run(
        [sys.executable, "-m", "fxquant.cli", *args], cwd=cwd,
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert cli.returncode != 0, cli.stdout[-500:]
    assert "Traceback" not in cli.stderr, cli.stderr[-2000:]
    lines = cli.stderr.strip().splitlines()
    assert lines[-1].startswith("fxquant "), cli.stderr[-500:]
    assert not only_line or len(lines) == 1, cli.stderr[-2000:]
    assert out is None or not out.exists()  # nothing written, half or whole


def test_damaged_pt2_files_give_a_clear_error_or_the_program(tmp_path):
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU()).eval()
    ep = torch.export.export(model, (torch.randn(2, 64),))
    good = tmp_path / "good.pt2"
    torch.export.save(fxquant.quantize(ep, "int8wo"), good)
    cuts, flips = _variants(good.read_bytes(), tmp_path, "p.pt2", VARIANTS)
    result = _run_reader("pt2", good, cuts + flips)
    # a flipped bit in a stored tensor's bytes fails the zip's CRC-32: "loaded, different
    # values" would be a silent wrong answer
    _check(result, flips, flips_may_load=False)
    assert all(result[str(p)] == "error" for p in cuts)  # a zip cut short has no directory
    # the CLI on a sample (two cuts, two flips; ~3 s a run): one line on stderr, non-zero exit,
    # no torch log above it
    for path in (cuts + flips)[:: VARIANTS // 4]:
        if result[str(path)] == "error":
            _cli_fails_in_one_line(["report", str(path)], tmp_path, only_line=True)


def test_damaged_gguf_files_give_a_clear_error_or_their_tensors(tmp_path):
    from conftest import write_tiny_llama_gguf

    good = write_tiny_llama_gguf(tmp_path / "good.gguf", v_proj="Q4_0")
    cuts, flips = _variants(good.read_bytes(), tmp_path, "m.gguf", VARIANTS)
    result = _run_reader("gguf", good, cuts + flips)
    _check(result, flips, flips_may_load=True)
    # fxquant quantize (transformers' GGUF loader, then fxquant's reader): one line, no file
    for path in [p for p in cuts[::25] + flips[::25] if result[str(p)] == "error"][:4]:
        out = path.parent / "q.pt2"
        _cli_fails_in_one_line(
            ["quantize", str(path), "--recipe", "gguf", "--out", str(out)], tmp_path, out
        )


def test_damaged_safetensors_give_a_clear_error_or_their_tensors(tmp_path):
    from conftest import TinyLlama

    ids = torch.randint(0, 96, (2, 5))
    config = fxquant.QuantConfig(scheme=fxquant.Int4WeightOnly(group_size=32, symmetric=False))
    qep = fxquant.quantize(TinyLlama(layers=1).eval(), config, example_inputs=(ids,))
    folder = fxquant.save_compressed_tensors(
        qep, tmp_path / "good", model_config={"vocab_size": 96}
    )
    good = folder / "model.safetensors"
    cuts, flips = _variants(good.read_bytes(), tmp_path, "model.safetensors", VARIANTS)
    for path in cuts + flips:
        shutil.copy(folder / "config.json", path.parent / "config.json")
    result = _run_reader("safetensors", good, cuts + flips)
    _check(result, flips, flips_may_load=True)
