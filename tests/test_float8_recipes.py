"""The other FP8 training recipes (current per tensor and per row, MXFP8 and block, the last two
emulated) follow fp32 for 60 steps through ``torch.compile(model, backend="fxquant")``: the
model, data and comparison of test_float8_backend.py.

Its own file: the suite runs one file per worker, and these four trainings would otherwise queue
behind the rest of test_float8_backend.py on one worker.
"""

from __future__ import annotations

import pytest
from test_float8_backend import GRAD_AT, _compare, train
from test_float8_backend import _fresh_dynamo as _fresh_dynamo  # autouse: a clean Dynamo
from test_float8_backend import fp32_losses as fp32_losses  # the module fixture

from fxquant import Float8Recipe


@pytest.mark.slow
@pytest.mark.parametrize(
    "name, recipe",
    [
        ("current", Float8Recipe(scaling="current")),
        ("row", Float8Recipe(scaling="current", granularity="row")),
        ("mxfp8", Float8Recipe(scaling="mxfp8", emulate=True)),
        ("block", Float8Recipe(scaling="block", emulate=True)),
    ],
)
def test_other_recipes_follow_fp32_for_60_steps(name, recipe, fp32_losses):
    losses, grad_sqnr = train(recipe, 60, grad_at=GRAD_AT)
    _compare(name, losses, fp32_losses, grad_sqnr)
