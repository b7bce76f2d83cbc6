"""Where fxquant keeps what it makes once per machine: built native kernels, built LLM
packages, GGUF files converted to Hugging Face folders (``fxquant.kernels.cpu``,
``fxquant.packages``). A leaf: standard library only, so a serving process may import it.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root() -> Path:
    """fxquant's cache folder: ``$FXQUANT_CACHE_DIR`` or ``~/.cache/fxquant``."""
    env = os.environ.get("FXQUANT_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "fxquant"


def source_digest(*roots: Path) -> str:
    """sha256 (16 hex digits) of every Python file and JSON table under ``roots``, with their
    paths: what a cache key uses for "this fxquant's code"."""
    h = hashlib.sha256()
    for root in roots:
        for f in sorted([*root.rglob("*.py"), *root.rglob("*.json")]):
            h.update(str(f.relative_to(root)).encode())
            h.update(f.read_bytes())
    return h.hexdigest()[:16]
