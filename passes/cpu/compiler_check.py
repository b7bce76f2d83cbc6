"""A check of the host C++ compiler on Inductor's AVX-512 code for 16-bit floats, and the
Inductor option that mends it where it fails: added to the Inductor configuration of every CPU
compile fxquant starts (the backend's inference and FP8 training compiles, ``aot_compile``).

Found on 2026-12-06 (Xeon Emerald Rapids, Debian 12's GCC 12.2, torch 2.13): there
``-march=native`` resolves to ``cooperlake`` with generic tuning, which lets GCC's ``-O3``
vectorise 512 bits wide, and a kernel with two or more loop nests that each read a bf16 or
fp16 tensor transposed (Inductor's 2-D tiles, ``transpose_mxn<BFloat16>`` over 32 x 32 blocks)
writes garbage: FP8 training of a bf16 model got NaN weight gradients (the fp8 copy of ``x``
that wgrad reads is such a kernel). One such nest alone is right; so are ``-O2``, a named
``-march`` (``sapphirerapids``, ``icelake-server``), ``-mprefer-vector-width=256``, fp32 tiles
(16 x 16), and Inductor's AVX2 code (``cpp.simdlen=256``). Where it fails, fxquant's compiles
pass ``-mprefer-vector-width=256`` (through ``cpp.march``): it limits only the compiler's own
vectorisation (Inductor's ``at::vec`` code keeps its 512-bit intrinsics), as GCC's tuning for
each named Intel ``-march`` does by default. A torch without ``cpp.march`` (2.11) gets the
next mend, Inductor's AVX2 code (``cpp.simdlen=256``), where the check fails.

The check compiles that kernel in a subprocess (apart from the compile that asks, which may be
running inside Dynamo's) and compares it with eager: ~10-20 s, once per torch, compiler and CPU,
the answer kept in ``$FXQUANT_CACHE_DIR/compiler_check``. Only CPUs whose Inductor code is
AVX-512 are checked, and only where Inductor's ``cpp.march`` and ``cpp.simdlen`` are at their
defaults (a user who set them has chosen).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import subprocess
import sys
import tempfile
import warnings

import torch

from fxquant.core.paths import cache_root
from fxquant.kernels.cpu import cpu_signature

__all__ = ["inductor_patches"]


def _known(option: str) -> bool:
    from torch._inductor import config

    section, name = option.split(".")
    return hasattr(getattr(config, section), name)


# Candidates in order of preference: the first the probe finds right is used. Only those this
# torch has an option for: torch 2.11's Inductor has no cpp.march (it passes -march=native
# itself), and reading it there raised AttributeError in every CPU compile.
_MENDS = tuple(
    mend
    for mend in ({"cpp.march": "native -mprefer-vector-width=256"}, {"cpp.simdlen": 256})
    if all(_known(option) for option in mend)
)

# Two nests that each read a 128 x 128 bf16 / fp16 tensor transposed: the failing kernel's shape.
_PROBE = r"""
import json, sys
import torch

def q(x, s):
    return (x.t().float() / s).contiguous()

def f(a, b):
    return q(a, 0.5), q(b, 0.25)

def right(patch):
    torch._dynamo.reset()
    fn = torch.compile(f, backend="inductor", options=patch or None)
    for dt in (torch.bfloat16, torch.float16):
        g = torch.Generator().manual_seed(0)
        a, b = (torch.randn(128, 128, generator=g).to(dt) for _ in range(2))
        if not all(torch.equal(u, v) for u, v in zip(fn(a, b), f(a, b))):
            return False
    return True

results = []
for patch in json.loads(sys.argv[1]):  # up to the first that is right
    results.append(right(patch))
    if results[-1]:
        break
print(json.dumps(results))
"""


def _applies() -> bool:
    from torch._inductor import config
    from torch._inductor.cpu_vec_isa import VecAVX512, pick_vec_isa

    if getattr(config.cpp, "march", None) is not None or config.cpp.simdlen is not None:
        return False
    return isinstance(pick_vec_isa(), VecAVX512)


def _key() -> str:
    from torch._inductor.cpp_builder import get_cpp_compiler

    cxx = get_cpp_compiler()
    try:
        version = subprocess.run([cxx, "--version"], capture_output=True, text=True).stdout
    except OSError:
        version = cxx
    text = "\n".join([torch.__version__, version, cpu_signature(), json.dumps(_MENDS), _PROBE])
    return hashlib.sha256(text.encode()).hexdigest()[:20]


def _probe() -> list[bool] | str:
    """Whether the probe kernel is right with Inductor's defaults, then with each mend in turn,
    up to the first that is right; or why the probe could not run."""
    candidates = json.dumps([{}, *_MENDS])
    try:
        proc = subprocess.run(
            [sys.executable, "-P", "-c", _PROBE, candidates],
            capture_output=True,
            text=True,
            timeout=600,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return str(e)
    if proc.returncode:
        return proc.stderr[-2000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@functools.cache
def inductor_patches() -> dict:
    """Inductor options that this machine's compiler needs for right CPU code: ``{}`` where the
    check passes or does not apply, else the first mend the check found right."""
    if not _applies():
        return {}
    path = cache_root() / "compiler_check" / f"{_key()}.json"
    try:
        results = json.loads(path.read_text())
    except (OSError, ValueError):
        results = _probe()
        if isinstance(results, str):  # not kept: the next process checks again
            warnings.warn(
                "fxquant could not check this machine's C++ compiler on Inductor's AVX-512 "
                "bf16 / fp16 code, so compiles run with Inductor's defaults; the check's "
                f"error:\n{results}",
                stacklevel=2,
            )
            return {}
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
        with os.fdopen(fd, "w") as f:
            json.dump(results, f)
        os.replace(tmp, path)  # atomic: another process may be checking too
    if results[0]:
        return {}
    for mend, right in zip(_MENDS, results[1:], strict=False):
        if right:
            return dict(mend)
    warnings.warn(
        "Inductor's AVX-512 code for bf16 / fp16 transposes is wrong with this C++ compiler "
        f"and no known option mends it (tried {list(_MENDS)}): compiled bf16 / fp16 graphs "
        "may compute wrong values; set torch._inductor.config.cpp.simdlen = 1 or use another "
        "compiler (CXX)",
        stacklevel=2,
    )
    return {}
