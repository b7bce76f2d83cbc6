"""Where fxquant keeps what it makes once per machine: built native kernels, built LLM
packages, GGUF files converted to Hugging Face folders (``fxquant.kernels.cpu``,
``fxquant.packages``). A leaf: standard library only, so a serving process may import it.
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["cache_root"]


def cache_root() -> Path:
    """fxquant's cache folder: ``$FXQUANT_CACHE_DIR`` or ``~/.cache/fxquant``."""
    env = os.environ.get("FXQUANT_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "fxquant"
