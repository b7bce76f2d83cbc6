#!/usr/bin/env bash
# The one prepared call for a lent GPU (see benchmarks/README.md, "On a lent H200"):
#
#   run: bash benchmarks/gpu/run.sh            (writes JSON + a markdown table under $OUT)
#
# The device image has its own torch (2.11) and triton (3.6), no fxquant install and no network,
# so fxquant is staged as a package from this checkout (passes/ and kernels/ become
# fxquant.passes and fxquant.kernels, as pyproject's package-dir does) and put on PYTHONPATH.
# bench.py keeps to a wall-clock budget (--budget-s, default 420 s) and writes its JSON after
# every section, so a run that is cut short still returns what it measured.
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-benchmarks/results/gpu}"
mkdir -p "$OUT"

STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
cp -r fxquant "$STAGE/fxquant"
cp -r passes "$STAGE/fxquant/passes"
cp -r kernels "$STAGE/fxquant/kernels"

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
PYTHONPATH="$STAGE:benchmarks" python3 benchmarks/gpu/bench.py --out "$OUT" "$@" \
    2>&1 | tee "$OUT/log.txt"
