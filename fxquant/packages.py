"""Built LLM packages, cached: model file + config → an AOTInductor package, made once.

Where this sits: between the model on disk and the runtime. :func:`llm_package` loads a
Hugging Face model (a GGUF file or a model folder), exports it with its KV cache
(``fxquant.export_llm``), quantizes it (``fxquant.quantize``) and packages it
(``fxquant.aot_compile``), with a progress bar, because on two cores the AOTInductor build takes
minutes. The package is kept under ``<cache>/packages/<key>.pt2``, the key made of the model
file (path, size, modification time), the config, the dtype the model is loaded in (fp32, bf16,
fp16), the cache length and batch, the fxquant and
torch versions, a digest of fxquant's own source (a changed lowering builds anew, version bump
or not) and the CPU: a second run with the same inputs starts in seconds. Written
atomically, so an interrupted build leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import hashlib
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from fxquant.core.config import QuantConfig
from fxquant.core.paths import source_digest

__all__ = [
    "DTYPES",
    "BuiltPackage",
    "build_packages",
    "converted",
    "llm_package",
    "load_causal_lm",
    "load_config",
    "load_tokenizer",
    "package_key",
]


# The dtypes a package's model can be loaded in, by the names the CLI takes. fp32 is the
# default: every benchmark's baseline. bf16 (what `from_pretrained` gives for most checkpoints)
# halves the bytes of what a recipe keeps in float (the tied embedding, an lm_head left
# unquantized) and of the KV cache. Zen 4 (AVX-512 BF16), SmolLM2, benchmarks/llm_decode.py
# --dtypes fp32,bf16: the float package decodes 1.56x faster in bf16, int8wo (its lm_head in
# float) 1.16x, the recipes that quantize lm_head too 0.98-1.05x their fp32 packages.
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def dtype_name(dtype: torch.dtype) -> str:
    """The CLI's name of a package dtype (``torch.bfloat16`` → ``"bf16"``)."""
    for name, d in DTYPES.items():
        if d == dtype:
            return name
    raise ValueError(
        f"fxquant: a package's model dtype must be one of {sorted(DTYPES)}, got {dtype}"
    )


@dataclass
class BuiltPackage:
    """A package on disk, what it was made from, and whether this call built it."""

    path: Path
    variant: str  # the recipe / config it was quantized with, or the float model's dtype ("fp32")
    built: bool
    build_s: float = 0.0


def _source_identity(source: Path) -> list:
    files = [source] if source.is_file() else sorted(p for p in source.rglob("*") if p.is_file())
    return [[str(p.resolve()), p.stat().st_size, int(p.stat().st_mtime)] for p in files]


def package_key(
    source: str | os.PathLike,
    config: QuantConfig | None,
    *,
    max_cache_len: int,
    max_batch: int,
    logits: str = "last",
    dtype: torch.dtype = torch.float32,
) -> str:
    """The cache key of a package: model file, config, dtype, sizes, versions and CPU."""
    from fxquant.passes.cpu.dispatch import machine_class
    from fxquant.runtime import isa_flags
    from fxquant.version import __version__

    record = {
        "source": _source_identity(Path(source)),
        "config": None if config is None else config.to_dict(),
        "dtype": dtype_name(dtype),
        "max_cache_len": max_cache_len,
        "max_batch": max_batch,
        "logits": logits,
        "fxquant": __version__,
        "torch": torch.__version__,
        "isa": isa_flags(),
        "native": _native_key(),
        "source_digest": _source_digest(),
        # the CPU lowering's kernel choice by M (passes/cpu/dispatch.py), forced or measured
        "cpu_dispatch": [machine_class(), os.environ.get("FXQUANT_CPU_DISPATCH", "table")],
    }
    return _digest(record)


def _digest(record: dict) -> str:
    """A cache key: 24 hex digits of the sha256 of ``record`` as sorted JSON."""
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:24]


@functools.cache
def _source_digest() -> str:
    """sha256 of every Python file (and data table: the CPU dispatch's) of fxquant,
    fxquant.passes and fxquant.kernels (what decides what a package computes; the native kernels'
    own sources are in ``_native_key``)."""
    import fxquant.kernels
    import fxquant.passes

    here = Path(__file__).resolve().parent  # fxquant/, this module's own package
    roots = (Path(fxquant.passes.__file__).parent, Path(fxquant.kernels.__file__).parent)
    return source_digest(here, *roots)


def _native_key() -> str | None:
    from fxquant.passes.lower import native_cpu

    if not native_cpu():
        return None
    import fxquant.kernels.cpu as native

    return native.build_dir().name


def load_causal_lm(source: str | os.PathLike, *, dtype: torch.dtype = torch.float32):
    """A causal LM from a ``.gguf`` file or a Hugging Face model folder (offline), in eval mode.

    A GGUF file is read through its converted folder (:func:`converted`): made on the first
    load, several times faster to load from then on.
    """
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    path, gguf = _model_folder(source)
    kwargs = {"config": _config_of(path, gguf=True)} if gguf else {}
    with readable(path):
        model = transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype, **kwargs)
    return model.eval()


def load_config(source: str | os.PathLike):
    """The Hugging Face config of a ``.gguf`` file (its converted folder) or a model folder,
    without loading the weights."""
    path, gguf = _model_folder(source)
    return _config_of(path, gguf=gguf)


def _model_folder(source: str | os.PathLike) -> tuple[Path, bool]:
    """The Hugging Face folder to load ``source`` from, and whether it is a GGUF file's."""
    path = Path(source)
    if path.suffix == ".gguf":
        return converted(path, "model"), True
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"fxquant: {path} is neither a .gguf file nor a model folder")
    return path, False


def _config_of(folder: Path, *, gguf: bool):
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    with readable(folder):
        config = transformers.AutoConfig.from_pretrained(str(folder))
    # A GGUF file's folder holds plain fp32 weights; one converted before 2026-12-05 kept the
    # file's `quantization_config` (gguf) in its config.json, which attaches transformers' GGUF
    # quantizer to the model and, for a dtype other than fp32, warns that "packed" weights
    # compute fastest in fp32: neither is true of these weights.
    return _plain(config) if gguf else config


def converted(gguf: str | os.PathLike, part: str, *, cache_dir=None) -> Path:
    """The Hugging Face folder of a GGUF file's ``part`` (``"model"``: config and weights as
    fp32 safetensors; ``"tokenizer"``), converted once into ``<cache>/models/<key>/<part>``.

    transformers reads GGUF slowly: in a fresh process SmolLM2-135M's model takes 21 s and its
    tokenizer 5.7 s on two cores, most of it gguf-py parsing the 49k-entry vocabulary arrays
    element by element in Python; from the converted folder 3.4 s and 0.7 s
    (``benchmarks/gguf_load.py``), so ``fxquant generate`` and every package build after the
    first start sooner. The price is
    disk: the weights are kept in fp32 (540 MB for SmolLM2). The key is the file (path, size,
    modification time) and the transformers version, as a package's; each part is written to a
    temporary folder and renamed into place, so a reader never sees half of one, and two
    processes converting at once both succeed (the second one's copy is dropped).
    """
    import shutil
    import tempfile

    import transformers

    path = Path(gguf)
    if not path.is_file():
        raise FileNotFoundError(f"fxquant: no GGUF file at {path}")
    if part not in ("model", "tokenizer"):
        raise ValueError(f"converted(part={part!r}): allowed: 'model', 'tokenizer'")
    from fxquant.core.paths import cache_root

    record = {"source": _source_identity(path), "transformers": transformers.__version__}
    folder = (
        (Path(cache_dir) if cache_dir is not None else cache_root()) / "models" / _digest(record)
    )
    final = folder / part
    if final.is_dir():
        return final
    folder.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{part}.", dir=folder))
    try:
        with readable(path):
            if part == "model":
                model = transformers.AutoModelForCausalLM.from_pretrained(
                    str(path.parent), gguf_file=path.name, dtype=torch.float32
                )
                # transformers marks a model read from GGUF "not serializable" (it was
                # quantized); its weights are plain fp32 tensors by now, written as such, and
                # the config says so (no gguf `quantization_config`)
                from safetensors.torch import save_model

                _plain(copy.deepcopy(model.config)).save_pretrained(tmp)
                save_model(model, str(tmp / "model.safetensors"), metadata={"format": "pt"})
            else:
                tokenizer = transformers.AutoTokenizer.from_pretrained(
                    str(path.parent), gguf_file=path.name
                )
                tokenizer.save_pretrained(tmp)
        (folder / "source.json").write_text(json.dumps(record, indent=2))
        try:
            tmp.rename(final)
        except OSError:
            if not final.is_dir():  # not another process's finished copy: a real failure
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        with contextlib.suppress(OSError):
            folder.rmdir()  # only if a failed first conversion left it empty
    return final


def _plain(config):
    """``config`` without the ``quantization_config`` transformers' GGUF reader leaves on it:
    the converted weights are plain fp32 tensors."""
    if getattr(config, "quantization_config", None) is not None:
        del config.quantization_config
    return config


@contextlib.contextmanager
def readable(path: Path):
    """Turn a reader's failure inside transformers / gguf / safetensors (``struct.error``,
    ``SafetensorError``, an index error deep in a parser) into a ``CheckpointError`` naming the
    file, so the caller gets one line, not the parser's traceback."""
    try:
        yield
    except (FileNotFoundError, KeyboardInterrupt, NotImplementedError):
        raise
    except Exception as e:  # noqa: BLE001  (a dependency's parser: any type)
        # imported on failure only: fxquant.checkpoints brings the graph passes, which a
        # serving process (a tokenizer read through here) must not import
        from fxquant.checkpoints import CheckpointError

        if isinstance(e, CheckpointError):
            raise
        kind = "GGUF file" if path.suffix == ".gguf" else "model folder"
        text = " ".join(str(e).split())[:240] or type(e).__name__
        module = type(e).__module__
        name = type(e).__qualname__ if module == "builtins" else f"{module}.{type(e).__qualname__}"
        raise CheckpointError(
            f"{path}: not a readable {kind} (truncated or corrupt?): {name}: {text}"
        ) from e


def load_tokenizer(source: str | os.PathLike):
    """The tokenizer of a ``.gguf`` file (through its converted folder, :func:`converted`) or
    of a Hugging Face model folder (offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    path = Path(source)
    if path.suffix == ".gguf":
        path = converted(path, "tokenizer")
    return transformers.AutoTokenizer.from_pretrained(str(path))


class _Ticker:
    """A progress bar that shows elapsed time while a step with no progress of its own runs."""

    def __init__(self, bar) -> None:
        self.bar, self._stop = bar, threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(1.0):
            self.bar.refresh()

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()


def llm_package(
    source: str | os.PathLike,
    config: QuantConfig | str | None,
    *,
    max_cache_len: int = 2048,
    max_batch: int = 1,
    logits: str = "last",
    model=None,
    program=None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    only_cached: bool = False,
    variant: str | None = None,
    dtype: torch.dtype = torch.float32,
) -> BuiltPackage | None:
    """The AOTInductor package of ``source`` loaded in ``dtype`` and quantized with ``config``
    (None: the float model), from the cache when it is there, else built now and cached.

    Args:
        source: a ``.gguf`` file or a Hugging Face model folder (the cache key).
        config: a QuantConfig, a recipe name (``"int8wo"``, ``"int4wo-64+lm_head=int8wo"`` …)
            or None for the float model.
        max_cache_len, max_batch, logits: as ``fxquant.export_llm``.
        model, program: the loaded model (or a function that loads it) / its ``export_llm``
            program, when the caller has them already (they must come from ``source``, in
            ``dtype``, the program with these sizes); the model is loaded only if a build needs
            it.
        cache_dir: default ``$FXQUANT_CACHE_DIR`` or ``~/.cache/fxquant``, then ``packages/``.
        progress: a progress bar over the steps (the AOTInductor build shows elapsed time).
        only_cached: return None instead of building when the package is not cached.
        variant: the name to list the package under (default: the recipe name, or the
            dtype's name, ``"fp32"``, for the float model).
        dtype: the model's dtype (``DTYPES``' values): the float weights, activations and
            cache of the package are in it.
    """
    from fxquant.api import aot_compile, quantize
    from fxquant.core.paths import cache_root
    from fxquant.llm import export_llm

    cfg = None if config is None else QuantConfig.coerce(config)
    if variant is None:
        variant = (
            config if isinstance(config, str) else (dtype_name(dtype) if cfg is None else "custom")
        )
    key = package_key(
        source, cfg, max_cache_len=max_cache_len, max_batch=max_batch, logits=logits, dtype=dtype
    )
    root = Path(cache_dir) if cache_dir is not None else cache_root()
    path = root / "packages" / f"{key}.pt2"
    if path.is_file():
        return BuiltPackage(path=path, variant=variant, built=False)
    if only_cached:
        return None

    from tqdm.auto import tqdm

    t0 = time.perf_counter()
    steps = ["load", "export", "quantize", "AOTInductor build"]
    with tqdm(total=len(steps), desc=f"{variant}", unit="step", disable=not progress) as bar:

        def step(name: str) -> None:
            bar.set_postfix_str(name)

        if program is None:
            step("load model")
            if model is None:
                model = load_causal_lm(source, dtype=dtype)
            elif not isinstance(model, torch.nn.Module):
                model = model()
            if next(model.parameters()).dtype != dtype:  # the key says dtype: so must the package
                raise ValueError(
                    f"llm_package: the model given is {next(model.parameters()).dtype}, "
                    f"the package asked for is {dtype}"
                )
            bar.update()
            step("export with KV cache")
            program = export_llm(
                model, max_cache_len=max_cache_len, max_batch=max_batch, logits=logits
            )
        else:
            bar.update()
        bar.update()
        step("quantize")
        if cfg is not None:
            program = quantize(program, cfg)

        bar.update()
        step("AOTInductor build (minutes on 2 cores)")
        with _Ticker(bar):
            # the runtime's default tokenizer: the model file the package was made from
            aot_compile(program, path, metadata={"source": str(Path(source).resolve())}, load=False)
        bar.update()
    info = {"source": str(Path(source).resolve()), "variant": variant, "dtype": dtype_name(dtype)}
    path.with_suffix(".json").write_text(json.dumps(info, indent=2))
    return BuiltPackage(path=path, variant=variant, built=True, build_s=time.perf_counter() - t0)


def build_packages(
    source: str | os.PathLike,
    configs: dict[str, QuantConfig | str | None],
    *,
    max_cache_len: int = 2048,
    max_batch: int = 1,
    logits: str = "last",
    jobs: int | None = None,
    progress: bool = True,
    dtype: torch.dtype = torch.float32,
) -> dict[str, BuiltPackage]:
    """:func:`llm_package` for several variants at once: the cached ones at once, the others
    built side by side, each in its own process (``python -m fxquant.packages``).

    A build is mostly single-threaded Python (tracing, Inductor's scheduling and codegen), so
    on two cores two or three builds in parallel take little longer than one.

    Args:
        configs: ``{variant name: config, recipe name or None (the float model)}``.
        max_cache_len, max_batch, logits: as ``fxquant.export_llm``.
        dtype: the model's dtype, as :func:`llm_package`'s.
        jobs: builds at a time (default: one per core, plus one).
    """
    import subprocess
    import sys
    import tempfile

    from tqdm.auto import tqdm

    from fxquant.core.paths import cache_root

    out: dict[str, BuiltPackage] = {}
    todo = {}
    for name, config in configs.items():
        cached = llm_package(
            source,
            config,
            max_cache_len=max_cache_len,
            max_batch=max_batch,
            logits=logits,
            progress=False,
            only_cached=True,
            dtype=dtype,
        )
        if cached is not None:
            out[name] = cached
        else:
            todo[name] = None if config is None else QuantConfig.coerce(config)
    if not todo:
        return out
    # What every build process needs, made once here rather than in each of them: the native
    # kernels' library (g++, ~10 s), the check of the compiler on Inductor's code (a subprocess,
    # ~15 s where it applies; fxquant.passes.cpu.compiler_check), both in threads while Python
    # converts, and, for a GGUF file, the converted model (GGUF reads slowly)
    import fxquant.kernels.cpu as native
    from fxquant.passes.cpu.compiler_check import inductor_patches

    with ThreadPoolExecutor(max_workers=2) as pool:
        kernels = pool.submit(native.load)
        check = pool.submit(inductor_patches)
        if Path(source).suffix == ".gguf":
            converted(source, "model")
        kernels.result()
        check.result()
    jobs = jobs or (os.cpu_count() or 1) + 1
    logs = Path(tempfile.mkdtemp(prefix="fxquant-build-"))
    # the children run in `logs` (below): paths they are given are absolute
    env = {**os.environ, "FXQUANT_CACHE_DIR": str(cache_root().absolute())}
    pending = list(todo.items())
    running: dict[str, tuple[subprocess.Popen, float, Path]] = {}
    desc = f"building {len(todo)} package(s), {min(jobs, len(todo))} at a time"
    with tqdm(total=len(todo), desc=desc, unit="pkg", disable=not progress) as bar, _Ticker(bar):
        while pending or running:
            while pending and len(running) < jobs:
                name, cfg = pending.pop(0)
                cmd = [
                    sys.executable,
                    "-m",
                    "fxquant.packages",
                    str(Path(source).absolute()),
                    "--max-cache-len",
                    str(max_cache_len),
                    "--max-batch",
                    str(max_batch),
                    "--logits",
                    logits,
                    "--dtype",
                    dtype_name(dtype),
                ]
                cmd += ["--variant", name, "--source-digest", _source_digest()]
                if cfg is not None:
                    cmd += ["--config", cfg.to_json()]
                log = logs / f"build-{len(out) + len(running)}.log"
                with open(log, "w") as f:
                    # run from the log folder: `-m` puts the working directory on sys.path,
                    # and in a checkout's root that holds kernels/, which would stand in for
                    # the `kernels` distribution transformers imports (the source is absolute)
                    proc = subprocess.Popen(
                        cmd, stdout=f, stderr=subprocess.STDOUT, cwd=logs, env=env
                    )
                running[name] = (proc, time.time(), log)
                bar.set_postfix_str(", ".join(running))
            time.sleep(0.5)
            for name, (proc, t0, log) in list(running.items()):
                if proc.poll() is None:
                    continue
                del running[name]
                bar.update()
                if proc.returncode:
                    for other, *_ in running.values():
                        other.kill()
                    raise RuntimeError(
                        f"building the {name} package failed (exit {proc.returncode}); the end "
                        f"of its log ({log}):\n{log.read_text()[-3000:]}"
                    )
                built = llm_package(
                    source,
                    todo[name],
                    max_cache_len=max_cache_len,
                    max_batch=max_batch,
                    logits=logits,
                    progress=False,
                    only_cached=True,
                    dtype=dtype,
                )
                if built is None:
                    raise RuntimeError(f"the {name} build finished but left no package ({log})")
                out[name] = BuiltPackage(built.path, name, True, time.time() - t0)
                bar.set_postfix_str(", ".join(running))
    return {name: out[name] for name in configs}


def _main(argv=None) -> int:
    """``python -m fxquant.packages SOURCE [--config JSON]``: build one package into the cache
    (what :func:`build_packages` runs in each of its processes)."""
    import argparse

    from fxquant.llm import LOGITS

    parser = argparse.ArgumentParser(prog="python -m fxquant.packages", description=_main.__doc__)
    parser.add_argument("source")
    parser.add_argument("--config", default=None, help="QuantConfig JSON; omit for fp32")
    parser.add_argument("--max-cache-len", type=int, default=2048)
    parser.add_argument("--max-batch", type=int, default=1)
    parser.add_argument("--logits", choices=LOGITS, default="last")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    parser.add_argument("--variant", default=None, help="the name the package is listed under")
    parser.add_argument("--source-digest", default=None, help="the parent's _source_digest()")
    args = parser.parse_args(argv)
    if args.source_digest is not None and args.source_digest != _source_digest():
        # the package would land under another key than the one the parent waits for
        raise SystemExit(
            "fxquant.packages: fxquant's source changed while its packages were being built; "
            "run again"
        )
    config = None if args.config is None else QuantConfig.from_json(args.config)
    llm_package(
        args.source,
        config,
        max_cache_len=args.max_cache_len,
        max_batch=args.max_batch,
        logits=args.logits,
        progress=False,
        variant=args.variant,
        dtype=DTYPES[args.dtype],
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())
