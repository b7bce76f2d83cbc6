"""Loading a .pt2 never runs code from the file (fxquant.safe_load, fxquant report)."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys
import zipfile

import pytest
import torch

import fxquant
from fxquant.safe_load import ProgramLoadError, UnsafeFileError, load_program


class _Evil:
    """Unpickling this writes a marker file: the code a crafted .pt2 entry can run."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return (exec, (f"open({self.marker!r}, 'w').write('ran')",))


@pytest.fixture(scope="module")
def program_file(tmp_path_factory):
    model = torch.nn.Sequential(torch.nn.Linear(64, 32), torch.nn.ReLU()).eval()
    ep = torch.export.export(model, (torch.randn(2, 64),))
    path = tmp_path_factory.mktemp("pt2") / "q.pt2"
    torch.export.save(fxquant.quantize(ep, "int8wo"), path)
    return path


def _rewrite(src, dst, entry_filter, payload: bytes):
    """A copy of the archive with the first entry matching ``entry_filter`` replaced."""
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w") as zout:
        hit = None
        for info in zin.infolist():
            data = zin.read(info.filename)
            if hit is None and entry_filter(info.filename):
                hit, data = info.filename, payload
            zout.writestr(info, data)
    assert hit is not None
    return hit.split("/", 1)[1]  # as the reader names it: without the archive's root folder


def _evil_file(program_file, tmp_path):
    buf = io.BytesIO()
    torch.save((_Evil(tmp_path / "marker"),), buf)
    dst = tmp_path / "evil.pt2"
    entry = _rewrite(program_file, dst, lambda n: "sample_inputs" in n, buf.getvalue())
    return dst, entry


def test_torch_export_load_runs_the_crafted_pickle(program_file, tmp_path):
    # the hazard itself, so the test below cannot pass for the wrong reason
    evil, _ = _evil_file(program_file, tmp_path)
    # torch may fail after the code has run, or not: its weights_only load fails, it falls back
    # to a full unpickle and accepts the (None,) that exec returns as the sample inputs
    with contextlib.suppress(Exception):
        torch.export.load(evil)
    assert (tmp_path / "marker").exists()


def test_load_program_refuses_it_and_names_the_entry(program_file, tmp_path):
    evil, entry = _evil_file(program_file, tmp_path)
    with pytest.raises(UnsafeFileError, match=entry):
        load_program(evil)
    assert not (tmp_path / "marker").exists()
    # nothing of the patching outlives the call
    assert torch.load.__module__ == "torch.serialization"


def test_load_program_loads_fxquant_programs(program_file):
    ep = load_program(program_file)
    x = torch.randn(2, 64)
    torch.testing.assert_close(ep.module()(x), torch.export.load(program_file).module()(x))
    assert len(fxquant.report(ep).rows) == 1


def test_cli_report_refuses_it_in_one_line(program_file, tmp_path):
    evil, entry = _evil_file(program_file, tmp_path)
    out = subprocess.run(
        [sys.executable, "-m", "fxquant.cli", "report", str(evil)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert out.returncode != 0
    assert not (tmp_path / "marker").exists()
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and entry in lines[0] and "exec" in lines[0], out.stderr


def test_not_a_program_is_one_clear_error(program_file, tmp_path):
    truncated = tmp_path / "cut.pt2"
    truncated.write_bytes(program_file.read_bytes()[: program_file.stat().st_size // 2])
    with pytest.raises(ProgramLoadError, match="not a .pt2 archive"):
        load_program(truncated)
    package = tmp_path / "pkg.pt2"
    with zipfile.ZipFile(package, "w") as zf:
        zf.writestr("pkg/data/aotinductor/model/x.wrapper_metadata.json", "{}")
    with pytest.raises(ProgramLoadError, match="AOTInductor package"):
        load_program(package)
    with pytest.raises(ProgramLoadError, match="no such file"):
        load_program(tmp_path / "missing.pt2")


def test_an_entry_name_that_is_not_utf8_is_an_unreadable_archive(tmp_path):
    # what one flipped bit in the central directory's UTF-8 name does (found by the fuzz test)
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as zf:
        zf.writestr("p/data\u00e9.pkl", b"x")
    data = bytearray(buf.getvalue())
    data[data.rfind("data\u00e9".encode()) + 4] = 0xAF  # not a UTF-8 start byte
    path = tmp_path / "p.pt2"
    path.write_bytes(bytes(data))
    with pytest.raises(ProgramLoadError, match="unreadable archive.*utf-8"):
        load_program(path)
