"""Built LLM packages, cached: model file + config → an AOTInductor package, made once.

Where this sits: between the model on disk and the runtime. :func:`llm_package` loads a
Hugging Face model (a GGUF file or a model folder), exports it with its KV cache
(``fxquant.export_llm``), quantizes it (``fxquant.quantize``) and packages it
(``fxquant.aot_compile``), with a progress bar, because on two cores the AOTInductor build takes
minutes. The package is kept under ``<cache>/packages/<key>.pt2``, the key made of the model
file (path, size, modification time), the config, the cache length and batch, and the fxquant
and torch versions and CPU: a second run with the same inputs starts in seconds. Written
atomically, so an interrupted build leaves nothing behind.
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from fxquant.config import QuantConfig

__all__ = ["BuiltPackage", "llm_package", "load_causal_lm", "load_tokenizer", "package_key"]


@dataclass
class BuiltPackage:
    """A package on disk, what it was made from, and whether this call built it."""

    path: Path
    variant: str  # "fp32" or the recipe / config it was quantized with
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
) -> str:
    """The cache key of a package: model file, config, sizes, versions and CPU."""
    import fxquant
    from fxquant.runtime import isa_flags

    record = {
        "source": _source_identity(Path(source)),
        "config": None if config is None else config.to_dict(),
        "max_cache_len": max_cache_len,
        "max_batch": max_batch,
        "fxquant": fxquant.__version__,
        "torch": torch.__version__,
        "isa": isa_flags(),
        "native": _native_key(),
    }
    return hashlib.sha256(json.dumps(record, sort_keys=True).encode()).hexdigest()[:24]


def _native_key() -> str | None:
    from fxquant.passes.lower import native_cpu

    if not native_cpu():
        return None
    import fxquant.kernels.cpu as native

    return native.build_dir().name


def load_causal_lm(source: str | os.PathLike, *, dtype: torch.dtype = torch.float32):
    """A causal LM from a ``.gguf`` file or a Hugging Face model folder (offline), in eval mode."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    path = Path(source)
    if path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"fxquant: no GGUF file at {path}")
        return transformers.AutoModelForCausalLM.from_pretrained(
            str(path.parent), gguf_file=path.name, dtype=dtype
        ).eval()
    if not (path / "config.json").is_file():
        raise FileNotFoundError(f"fxquant: {path} is neither a .gguf file nor a model folder")
    return transformers.AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype).eval()


def load_tokenizer(source: str | os.PathLike):
    """The tokenizer of a ``.gguf`` file or a Hugging Face model folder (offline)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import transformers

    path = Path(source)
    if path.suffix == ".gguf":
        return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
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
    model=None,
    program=None,
    cache_dir: str | os.PathLike | None = None,
    progress: bool = True,
    only_cached: bool = False,
) -> BuiltPackage | None:
    """The AOTInductor package of ``source`` quantized with ``config`` (None: fp32), from the
    cache when it is there, else built now and cached.

    Args:
        source: a ``.gguf`` file or a Hugging Face model folder (the cache key).
        config: a QuantConfig, a recipe name (``"int8wo"``, ``"int4wo-64+lm_head=int8wo"`` …)
            or None for the float model.
        max_cache_len, max_batch: as ``fxquant.export_llm``.
        model, program: the loaded model (or a function that loads it) / its ``export_llm``
            program, when the caller has them already (they must come from ``source``, the
            program with these sizes); the model is loaded only if a build needs it.
        cache_dir: default ``$FXQUANT_CACHE_DIR`` or ``~/.cache/fxquant``, then ``packages/``.
        progress: a progress bar over the steps (the AOTInductor build shows elapsed time).
        only_cached: return None instead of building when the package is not cached.
    """
    import fxquant
    from fxquant.kernels.cpu import cache_root

    cfg = None if config is None else QuantConfig.coerce(config)
    variant = config if isinstance(config, str) else ("fp32" if cfg is None else "custom")
    key = package_key(source, cfg, max_cache_len=max_cache_len, max_batch=max_batch)
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
                model = load_causal_lm(source)
            elif not isinstance(model, torch.nn.Module):
                model = model()
            bar.update()
            step("export with KV cache")
            program = fxquant.export_llm(model, max_cache_len=max_cache_len, max_batch=max_batch)
        else:
            bar.update()
        bar.update()
        step("quantize")
        if cfg is not None:
            program = fxquant.quantize(program, cfg)

        bar.update()
        step("AOTInductor build (minutes on 2 cores)")
        with _Ticker(bar):
            # the runtime's default tokenizer: the model file the package was made from
            fxquant.aot_compile(program, path, metadata={"source": str(Path(source).resolve())})
        bar.update()
    info = {"source": str(Path(source).resolve()), "variant": variant}
    path.with_suffix(".json").write_text(json.dumps(info, indent=2))
    return BuiltPackage(path=path, variant=variant, built=True, build_s=time.perf_counter() - t0)
