#!/usr/bin/env bash
# The one prepared call for a lent GPU (see benchmarks/README.md, "On a lent H200"):
#
#   run: bash benchmarks/gpu/run.sh            (writes JSON + a markdown table under $OUT)
#
# The device image has its own torch (2.11) and triton (3.6), no fxquant install and no network,
# so fxquant is staged as a package from this checkout (passes/ and kernels/ become
# fxquant.passes and fxquant.kernels, as pyproject's package-dir does) and put on PYTHONPATH.
# bench.py keeps to a wall-clock budget (--budget-s, default 420 s; --caps gives a section its
# own) and writes its JSON after every section, so a run that is cut short still returns what it
# measured. A session has 15 minutes of device time, a start costs 1-2: two calls, back to back
# (the machine stays warm 30 s), each with a timeout ~90 s above its budget (a section overruns
# by one item):
#   bash benchmarks/gpu/run.sh --budget-s 330 --sections kernels,norm_quant,fp8_training,experts \
#       --caps kernels=150,fp8_training=150
#   bash benchmarks/gpu/run.sh --budget-s 420 --sections decode,stack,every_k --caps decode=240
# (the first call held the machine ~305 s on 2026-12-04, start included, leaving ~590 s: the second
# gets 420 s and a ~500 s timeout, since stack and decode may each need a second, Inductor, attempt
# after an AOTInductor crash; see bench.py's run_isolated)
set -euo pipefail
cd "$(dirname "$0")/../.."
OUT="${OUT:-benchmarks/results/gpu}"
mkdir -p "$OUT"

STAGE="$(mktemp -d)"
trap 'rm -rf "$STAGE"' EXIT
cp -r fxquant "$STAGE/fxquant"
cp -r passes "$STAGE/fxquant/passes"
cp -r kernels "$STAGE/fxquant/kernels"
# A dist-info beside the package, as an install would write: torch finds backend="fxquant" through
# its entry point (without it the first H200 run lost every FP8 training row to InvalidBackend).
DIST="$STAGE/fxquant-0.0.0.dist-info"
mkdir -p "$DIST"
printf 'Metadata-Version: 2.1\nName: fxquant\nVersion: 0.0.0+staged\n' >"$DIST/METADATA"
printf '[torch_dynamo_backends]\nfxquant = fxquant.backend:fxquant_backend\n' >"$DIST/entry_points.txt"

nvidia-smi --query-gpu=name,memory.total,clocks.max.sm --format=csv,noheader || true
PYTHONPATH="$STAGE:benchmarks" python3 benchmarks/gpu/bench.py --out "$OUT" "$@" \
    2>&1 | tee "$OUT/log.txt"
