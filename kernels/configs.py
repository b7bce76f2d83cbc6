"""Every autotune config of the kernels, in one place.

GEMM kernels come in two shapes of problem: decode (M ≤ 16: a GEMV that is all weight bandwidth,
so tiles are narrow in M and long in K, with split-K to fill the SMs) and prefill (tiled, compute
bound). Under ``TRITON_INTERPRET=1`` (the CPU tests) each list shrinks to its first config:
autotuning there would only multiply the test time, and the interpreter has no timing to tune on.
"""

from __future__ import annotations

import os

import triton


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _pick(configs: list[triton.Config]) -> list[triton.Config]:
    return configs[:1] if interpreting() else configs


def _c(bm: int, bn: int, bk: int, *, warps: int, stages: int, **extra) -> triton.Config:
    return triton.Config(
        {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, **extra}, num_warps=warps, num_stages=stages
    )


def prefill_configs() -> list[triton.Config]:
    """Tiled GEMM, M > 16."""
    return _pick(
        [
            _c(32, 32, 32, warps=4, stages=2),
            _c(128, 128, 64, warps=8, stages=3),
            _c(128, 256, 64, warps=8, stages=3),
            _c(64, 128, 64, warps=4, stages=4),
            _c(128, 64, 64, warps=4, stages=4),
            _c(64, 64, 128, warps=4, stages=3),
            _c(128, 128, 128, warps=8, stages=3),
        ]
    )


def decode_configs() -> list[triton.Config]:
    """GEMV-like, M ≤ 16: BLOCK_M = 16 (the smallest tl.dot tile), split-K over SPLIT_K programs."""
    return _pick(
        [
            _c(16, 32, 32, warps=4, stages=2, SPLIT_K=1),
            _c(16, 64, 128, warps=4, stages=3, SPLIT_K=1),
            _c(16, 128, 128, warps=4, stages=3, SPLIT_K=1),
            _c(16, 64, 256, warps=4, stages=3, SPLIT_K=2),
            _c(16, 128, 128, warps=4, stages=4, SPLIT_K=4),
            _c(16, 64, 128, warps=2, stages=4, SPLIT_K=8),
            _c(16, 32, 256, warps=2, stages=3, SPLIT_K=4),
        ]
    )


def rowwise_configs() -> list[triton.Config]:
    """One program per row (activation quantization, norm_quant): only the warp count varies."""
    return _pick([triton.Config({}, num_warps=w) for w in (4, 1, 2, 8, 16)])


DECODE_MAX_M = 16  # M at or below this takes the decode path
