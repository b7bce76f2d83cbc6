"""Quality floors on a real model: SmolLM2-135M perplexity after quantization (round to nearest,
no calibration), on the first 1024 tokens of the Lee news corpus, run as the quantized program.

Floors from the benchmarks issue: int8wo within +1% of fp32, fp8 row within +4%, int4 g64
within +30%. ``benchmarks/accuracy.py`` measures the full picture (8192 tokens, Wikipedia text,
every scheme, the peers).
"""

from __future__ import annotations

import pytest

import fxquant
from conftest import SMOLLM2_PPL_1024
from fxquant import evaluate


@pytest.fixture(scope="module")
def fp32_ppl(smollm2_program, lee_ids):
    ppl = evaluate.perplexity(smollm2_program.module(), lee_ids, max_tokens=1024, progress=False)
    assert ppl == pytest.approx(SMOLLM2_PPL_1024, abs=0.02)
    return ppl


@pytest.mark.slow
@pytest.mark.parametrize(
    ("recipe", "max_increase"), [("int8wo", 0.01), ("fp8-row", 0.04), ("int4wo-64", 0.30)]
)
def test_smollm2_perplexity_floor(smollm2_program, lee_ids, fp32_ppl, recipe, max_increase):
    qep = fxquant.quantize(smollm2_program, recipe)
    rep = fxquant.report(qep)
    assert len(rep.quantized) == 210 and [r["name"] for r in rep.skipped] == ["model.lm_head"]
    ppl = evaluate.perplexity(qep.module(), lee_ids, max_tokens=1024, progress=False)
    print(f"{recipe}: ppl {ppl:.4f} vs fp32 {fp32_ppl:.4f} ({ppl / fp32_ppl - 1:+.3%})")
    assert ppl <= fp32_ppl * (1 + max_increase)
    assert ppl > fp32_ppl * 0.9  # 10% better than fp32 would mean a broken evaluation
