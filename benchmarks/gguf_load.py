"""How long does a GGUF model take to load, read by transformers directly and through the folder
``fxquant.packages.converted`` makes of it once?

Every package build and every ``fxquant generate`` starts by loading the model or its tokenizer;
for a GGUF file transformers parses the whole file in Python each time. This script times, on
SmolLM2-135M's GGUF, each way in a fresh process (imports excluded), rounds interleaved: the model
and the tokenizer read from the GGUF file, the first load through ``converted`` (the conversion
itself, into an empty cache) and the later ones (from the folder). Writes
``results/gguf_load.json``.

    python benchmarks/gguf_load.py [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from machine import machine_info, write_results

HERE = Path(__file__).resolve().parent

# one load in a fresh process: imports first, then the timed call; prints its seconds
_CHILD = """
import json, sys, time
from pathlib import Path
import torch, transformers
from fxquant.packages import load_causal_lm, load_tokenizer
path, how, part = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
t0 = time.perf_counter()
if how == "gguf" and part == "model":
    transformers.AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32
    )
elif how == "gguf":
    transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
elif part == "model":
    load_causal_lm(path)
else:
    load_tokenizer(path)
print(json.dumps(time.perf_counter() - t0))
"""


def _load_s(path: Path, how: str, part: str, cache: Path) -> float:
    # PYTHONSAFEPATH: `-c` in the checkout's root would put the root, and its kernels/, on
    # sys.path in place of the `kernels` distribution transformers imports
    env = {
        **os.environ,
        "FXQUANT_CACHE_DIR": str(cache),
        "HF_HUB_OFFLINE": "1",
        "PYTHONSAFEPATH": "1",
    }
    out = subprocess.run(
        [sys.executable, "-c", _CHILD, str(path), how, part],
        capture_output=True,
        text=True,
        env=env,
        check=True,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv=None) -> int:
    from fxquant import assets

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "gguf_load.json"))
    args = ap.parse_args(argv)
    t_start = time.perf_counter()
    path = assets.smollm2_gguf()
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as cache:
        for part in ("model", "tokenizer"):
            first = _load_s(path, "fxquant", part, Path(cache))  # converts into the empty cache
            results[f"{part}: first load through converted (converts)"] = {"s": [first]}
        for r in range(args.rounds):
            for part in ("model", "tokenizer"):
                for how, label in (
                    ("gguf", "transformers from the GGUF file"),
                    ("fxquant", "converted folder"),
                ):
                    s = _load_s(path, how, part, Path(cache))
                    results.setdefault(f"{part}: {label}", {"s": []})["s"].append(s)
                    print(f"round {r}: {part} via {label}: {s:.2f} s", flush=True)
    for row in results.values():
        row["median_s"] = statistics.median(row["s"])
    for part in ("model", "tokenizer"):
        direct = results[f"{part}: transformers from the GGUF file"]["median_s"]
        folder = results[f"{part}: converted folder"]["median_s"]
        results[f"{part}: converted folder"]["speedup_vs_gguf"] = direct / folder
    res = {
        "question": "How long does SmolLM2's GGUF take to load, directly and through converted()?",
        "machine": machine_info(),
        "model": str(path.name),
        "rounds": args.rounds,
        "note": "each load in a fresh process, imports excluded; medians of interleaved rounds",
        "results": results,
        "wall_s": time.perf_counter() - t_start,
    }
    write_results(res, args.out)
    print()
    for name, row in results.items():
        extra = f"  ({row['speedup_vs_gguf']:.0f}x faster)" if "speedup_vs_gguf" in row else ""
        print(f"{name:55s} {row['median_s']:7.2f} s{extra}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
