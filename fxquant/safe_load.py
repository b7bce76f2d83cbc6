"""Load a ``.pt2`` program without running code from the file.

Where this sits: the entry of every path that reads a saved program back (``fxquant report``,
:func:`fxquant.load_program`). ``torch.export.load`` unpickles several entries of the archive
with ``torch.load(weights_only=False)`` or ``pickle.loads``: the sample inputs (after a safe
attempt fails, it falls back to the unsafe one), tensors saved in pickle form, opaque objects.
A crafted entry therefore runs its code during the load, before anything can look at the
program. Here the same load runs with each of those calls held to PyTorch's restricted
unpickler (``weights_only=True``: tensors, containers and plain values only) and the
arbitrary-object ones refused; an entry that needs more fails with :class:`UnsafeFileError`
naming it. fxquant's own programs need nothing more: tensors, a JSON graph, JSON metadata.

AOTInductor packages (also ``.pt2``) are compiled native code: loading one runs it. No loader
can make that safe; only load packages you trust (the README's Security section says so).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import re
import threading
import warnings
import zipfile
import zlib
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = ["ProgramLoadError", "UnsafeFileError", "load_program"]

_LOCK = threading.Lock()  # the load patches process-wide functions for its duration


class ProgramLoadError(ValueError):
    """A file that is not a loadable ``torch.export`` program (missing, truncated, another
    kind of file, an AOTInductor package, an op this process does not know)."""


class UnsafeFileError(ProgramLoadError):
    """An entry of the archive that only an unrestricted unpickler could load."""


def load_program(path: str | os.PathLike) -> torch.export.ExportedProgram:
    """``torch.export.load(path)`` that never executes pickled code from the file.

    Raises :class:`UnsafeFileError` for an entry that holds more than tensors and plain values
    (naming the entry), :class:`ProgramLoadError` for a file that is not a program (saying
    what it is instead). fxquant's ops are registered first, so a quantized program loads.
    """
    import fxquant.core.ops  # noqa: F401  (the fxquant:: ops the graph names)

    path = Path(path)
    if not path.is_file():
        raise ProgramLoadError(f"{path}: no such file")
    if not zipfile.is_zipfile(path):
        raise ProgramLoadError(
            f"{path}: not a .pt2 archive (not a zip file; truncated, or another format)"
        )
    try:
        with zipfile.ZipFile(path) as zf:
            names = zf.namelist()
            # torch's reader does not check the stored CRC-32s: a flipped bit in a weight would
            # load as a different model, silently. One pass over the bytes (~1 GB/s).
            bad = None if _crc_skipped(zf) else zf.testzip()
    # (a flipped bit in an entry's UTF-8 name fails to decode before any CRC is read)
    except (zipfile.BadZipFile, OSError, EOFError, zlib.error, UnicodeDecodeError) as e:
        raise ProgramLoadError(f"{path}: unreadable archive ({e})") from None
    if bad is not None:
        raise ProgramLoadError(
            f"{path}: entry {bad} fails its CRC-32 check: the file is corrupt (copy it again)"
        )
    if any(n.endswith("wrapper_metadata.json") or n.endswith(".wrapper.so") for n in names):
        raise ProgramLoadError(
            f"{path}: an AOTInductor package (compiled code), not a torch.export program; "
            "run it with fxquant generate / torch._inductor.aoti_load_package"
        )
    _register_lowered_ops()
    with _restricted_unpickling(path) as last_entry:
        try:
            return torch.export.load(path)
        except UnsafeFileError:
            raise
        except Exception as e:  # noqa: BLE001  (torch's failures are many kinds: say which file)
            raise ProgramLoadError(_why(path, e, last_entry())) from None


def _crc_skipped(zf: zipfile.ZipFile) -> bool:
    """A file saved under ``torch.serialization.set_crc32_options(False)`` stores CRC 0 for
    every entry with data: nothing to check."""
    return all(i.CRC == 0 for i in zf.infolist() if i.file_size)


def _register_lowered_ops() -> None:
    # a prepacked / lowered program names the CPU device ops, registered by their module
    with contextlib.suppress(Exception):  # no lowering here: the load then names the op
        import fxquant.passes.cpu  # noqa: F401


def _why(path: Path, e: Exception, entry: str | None) -> str:
    text = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
    if "fxquant" in text and ("op" in text.lower() or "operator" in text.lower()):
        return f"{path}: names an fxquant op this process does not have ({text}); import fxquant"
    where = f" (entry {entry})" if entry else ""
    return f"{path}: not a loadable torch.export program{where}: {type(e).__name__}: {text[:300]}"


@contextlib.contextmanager
def _restricted_unpickling(path: Path) -> Iterator:
    """For the duration: ``torch.load`` always ``weights_only=True``, ``pickle.loads`` and
    TorchScript object unpickling refused inside the pt2 reader, torch.export's error log
    quiet; yields a function that tells the archive entry read last (the culprit's name)."""
    from torch.export.pt2_archive import _package

    last: dict[str, str | None] = {"name": None}
    seen: dict[tuple, str] = {}  # (length, head) of each entry read → its name
    reader = _package.PT2ArchiveReader
    real_read, real_torch_load = reader.read_bytes, torch.load
    real_pickle_obj = torch._C._pickle_load_obj

    def read_bytes(self, name):
        data = real_read(self, name)
        last["name"] = name
        seen[(len(data), bytes(data[:512]))] = name
        return data

    def entry_of(data) -> str | None:
        # the reader hands torch.load the bytes, not the name: find them among those read
        if isinstance(data, io.BytesIO):
            data = data.getvalue()
        if isinstance(data, (bytes, bytearray)):
            return seen.get((len(data), bytes(data[:512])), last["name"])
        return last["name"]

    def torch_load(f, *args, weights_only=None, **kwargs):
        entry = entry_of(f)
        if isinstance(f, io.BytesIO):
            f.seek(0)
        try:
            return real_torch_load(f, *args, weights_only=True, **kwargs)
        except pickle.UnpicklingError as e:
            found = re.search(r"GLOBAL (\S+)", str(e))
            what = f" (it names {found.group(1)})" if found else ""
            raise UnsafeFileError(
                f"{path}: entry {entry} holds a pickle beyond tensors and plain values"
                f"{what}; refused: unpickling it could run code"
            ) from None

    def refuse(data=None, *args, **kwargs):
        raise UnsafeFileError(
            f"{path}: entry {entry_of(data)} is a pickled Python object; refused: fxquant "
            "does not unpickle objects from a file (it could run code)"
        )

    class _NoPickle:  # the reader's module-level `pickle`, with loads refused
        loads = staticmethod(refuse)
        UnpicklingError = pickle.UnpicklingError

    quiet = [logging.getLogger(n) for n in ("torch.export", "torch._export.serde.serialize")]
    levels = [lg.level for lg in quiet]
    with _LOCK, warnings.catch_warnings():
        # torch 2.11's reader makes tensors over the archive's read-only bytes, and says so
        warnings.filterwarnings("ignore", message="The given buffer is not writable")
        reader.read_bytes = read_bytes
        torch.load = torch_load
        torch._C._pickle_load_obj = refuse
        # torch 2.13's reader unpickles some constants with its module's `pickle`; 2.11's has none
        real_pickle_module = getattr(_package, "pickle", None)
        if real_pickle_module is not None:
            _package.pickle = _NoPickle
        for lg in quiet:
            lg.setLevel(logging.CRITICAL)
        try:
            yield lambda: last["name"]
        finally:
            reader.read_bytes = real_read
            torch.load = real_torch_load
            torch._C._pickle_load_obj = real_pickle_obj
            if real_pickle_module is not None:
                _package.pickle = real_pickle_module
            for lg, level in zip(quiet, levels, strict=True):
                lg.setLevel(level)
