"""``benchmarks/gpu/run.sh --smoke``: the one prepared call for a lent GPU still runs.

A GPU is lent rarely and for minutes, so the script it runs must not have rotted in between: the
smoke run is the same code on CPU tensors (Triton's interpreter, tiny shapes), staged the way
``run.sh`` stages it on the device (fxquant copied with ``passes/`` and ``kernels/`` inside, put
first on ``PYTHONPATH``). The sections here are the ones no other test exercises end to end:
the LLM decode section (``export_llm`` → quantize → the program), FP8 training (three of its
rows: ``fp8_training.SMOKE_ROWS``), the exported stack and the experts (~70 s on two cores
with empty caches). The kernel and every-K sections run the CUDA lowering that
``tests/test_lower_cuda.py`` and ``tests/test_lower_every_k.py`` cover.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")
pytest.importorskip("transformers")
pytestmark = [pytest.mark.slow, pytest.mark.interpreter]

ROOT = Path(__file__).resolve().parent.parent
SECTIONS = ("stack", "decode", "fp8_training", "experts")


def test_the_gpu_script_smoke_runs_its_sections_without_an_error(tmp_path):
    env = {
        **os.environ,
        "OUT": str(tmp_path),
        # run.sh calls `python3`: this interpreter, as the device's python3 is the one with torch
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
        # the stack section's first attempt dies as the H200's aoti_load_package did: the call
        # goes on, and the section runs again under the other runner
        "FXQ_GPU_BENCH_CRASH": "stack",
    }
    run = subprocess.run(
        ["bash", "benchmarks/gpu/run.sh", "--smoke", "--sections", ",".join(SECTIONS)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    rec = json.loads((tmp_path / "gpu.json").read_text())
    assert rec["complete"] and rec["smoke"]
    # backend="fxquant" resolves through the staged copy's own entry point, not an install's
    assert rec["fxquant_dist_from"] == rec["fxquant_from"] != str(ROOT)
    decode = rec["decode"]
    assert {r["recipe"] for r in decode} >= {"bf16", "int8wo+lm_head"}
    assert rec["fp8_training"]["smoke"]
    formats = {r["format"] for r in rec["experts"]}
    assert formats == {"mxfp4", "int8", "int4", "w8a8", "fp8wo", "fp8-row", "fp8-block"}
    for section in SECTIONS:
        rows = rec[section]["rows"] if section == "fp8_training" else rec[section]
        assert rows, section
        failed = [r for r in rows if "error" in r]  # a failing row is recorded, not raised
        assert not failed, (section, failed[:3])
    assert rec["section_runner"] == {"stack": "inductor", "decode": "aoti"}
    [crash] = rec["section_crashes"]
    assert crash["section"] == "stack" and crash["runner"] == "aoti"
    assert crash["ended"] == "signal SIGSEGV"
    assert "stack with the aoti runner ended by signal SIGSEGV" in (tmp_path / "gpu.md").read_text()
