"""The house's rules, checked by reading the source (no imports run, but in 3).

1. Imports point down. The layers, lowest first, are written once here (``LAYERS``); a module
   may import its own layer or lower ones, lazily or not, and no set of modules may import each
   other in a circle.
2. Every path a docstring or comment names (``passes/lower.py``, ``docs/checkpoints.md``)
   exists (a benchmark's output under ``benchmarks/results/`` once its script has run).
3. Python that the tests start in the checkout's root cannot import our ``kernels/`` as the
   ``kernels`` distribution transformers imports (conftest.py keeps the root off sys.path).
"""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = {"fxquant": ROOT / "fxquant", "fxquant.passes": ROOT / "passes",
            "fxquant.kernels": ROOT / "kernels"}  # fmt: skip

# Lowest first. A module belongs to the first entry that is it or its package.
LAYERS = [
    # the vocabulary everything speaks: configs, reference math, ops
    ("core", ["fxquant.version", "fxquant.core"]),
    # FP8 training: numerics, delayed-scaling state, accelerate recipes (the passes use them)
    ("training", ["fxquant.training"]),
    ("kernels", ["fxquant.kernels"]),
    ("passes", ["fxquant.passes"]),
    # the entry points, and what runs or measures their output
    ("entry", ["fxquant.report", "fxquant.runtime", "fxquant.llm", "fxquant.evaluate",
                  "fxquant.api", "fxquant.backend", "fxquant.safe_load", "fxquant.calibration"]),
    # the outside world's formats and APIs
    # (fxquant.hf_quantizer: the old path of fxquant.hf.bridge, a re-export; fxquant.assets
    # reads the installed models through fxquant.packages' converted GGUF folders)
    ("integrations", ["fxquant.hf", "fxquant.checkpoints", "fxquant.hf_quantizer",
                      "fxquant.packages", "fxquant.assets"]),
    ("facade", ["fxquant"]),  # fxquant/__init__.py: lazy re-exports of the public names
    ("apps", ["fxquant.cli", "fxquant.demo"]),
]  # fmt: skip


def _modules() -> dict[str, Path]:
    out = {}
    for pkg, root in PACKAGES.items():
        for path in root.rglob("*.py"):
            parts = list(path.relative_to(root).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join([pkg, *parts])] = path
    return out


def _imports(name: str, path: Path, modules: dict) -> set[str]:
    """The fxquant modules ``name`` imports anywhere in its body (function bodies too)."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join(up + ([node.module] if node.module else []))
            subs = [f"{base}.{a.name}" for a in node.names if f"{base}.{a.name}" in modules]
            # `from fxquant.core import reference` imports the submodule; the facade only for names
            targets = subs if len(subs) == len(node.names) else [base, *subs]
        else:
            continue
        for t in targets:
            while t and t not in modules:
                t = t.rpartition(".")[0]
            if t and t != name:
                found.add(t)
    return found


def _layer(name: str) -> int:
    best, depth = None, -1
    for i, (_, prefixes) in enumerate(LAYERS):
        for p in prefixes:
            if (name == p or name.startswith(p + ".")) and len(p) > depth:
                best, depth = i, len(p)
    assert best is not None, f"{name} is in no layer: add it to LAYERS in {__file__}"
    return best


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    return {name: _imports(name, path, modules) for name, path in modules.items()}


def test_every_import_points_down_a_layer_or_stays_in_it():
    upward = [
        f"{a} ({LAYERS[_layer(a)][0]}) imports {b} ({LAYERS[_layer(b)][0]})"
        for a, deps in _graph().items()
        for b in deps
        if _layer(b) > _layer(a)
    ]
    assert not upward, "\n".join(sorted(upward))


def test_no_import_circles():
    graph = _graph()
    graph["fxquant"] = set()  # the facade imports everything, lazily, and is imported by apps
    index, low, stack, on, circles, counter = {}, {}, [], set(), [], [0]

    def visit(v):  # Tarjan's strongly connected components
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                circles.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    assert not circles, circles


_PATH = re.compile(r"(?<![\w./-])((?:fxquant|passes|kernels|docs|benchmarks|tests|scripts)"
                   r"/[\w./<>-]*\w\.(?:py|md|sh|json|cpp))")  # fmt: skip


def test_every_path_the_source_names_exists():
    missing = []
    for root in (*PACKAGES.values(), ROOT / "benchmarks", ROOT / "scripts"):
        for path in root.rglob("*.py"):
            for ref in _PATH.findall(path.read_text()):
                if "<" in ref or "*" in ref:  # a pattern (``benchmarks/results/<name>.json``)
                    continue
                if ref.startswith("benchmarks/results/"):  # written when its script runs
                    continue
                if not (ROOT / ref).exists():
                    missing.append(f"{path.relative_to(ROOT)} names {ref}")
    assert not missing, "\n".join(missing)


def test_python_started_in_the_root_cannot_import_our_kernels_as_kernels():
    """kernels/ sits at the checkout's root (it installs as fxquant.kernels); transformers imports
    the Hugging Face distribution named ``kernels``. conftest.py keeps the root off sys.path
    here and in the children the tests start in the root (PYTHONSAFEPATH)."""
    probe = "import importlib.util as u; s = u.find_spec('kernels'); print(s and s.origin)"
    found = subprocess.run([sys.executable, "-c", probe], cwd=ROOT, capture_output=True, text=True)
    assert found.returncode == 0, found.stderr[-2000:]
    assert found.stdout.strip() != str(ROOT / "kernels" / "__init__.py"), found.stdout
    # a module run with -m in the root, importing transformers
    hf = subprocess.run(
        [sys.executable, "-m", "fxquant.hf"], cwd=ROOT, capture_output=True, text=True
    )
    assert hf.returncode == 0, hf.stderr[-2000:]
    assert not any(Path(p or ".").resolve() == ROOT for p in sys.path)


def test_every_package_is_installed():
    """pyproject.toml lists the packages (its package-dir maps passes/ and kernels/ under
    fxquant): a folder with an ``__init__.py`` missing from that list is left out of a wheel."""
    import tomllib

    listed = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    found = set()
    for pkg, root in PACKAGES.items():
        for init in root.rglob("__init__.py"):
            found.add(".".join([pkg, *init.parent.relative_to(root).parts]))
    assert found == listed, (
        f"missing from pyproject.toml: {sorted(found - listed)}; "
        f"listed but absent: {sorted(listed - found)}"
    )
