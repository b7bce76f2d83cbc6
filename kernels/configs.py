"""Every autotune config of the kernels, in one place.

GEMM kernels come in two shapes of problem: decode (M ≤ 16: a GEMV that is all weight bandwidth,
so tiles are narrow in M and long in K, with split-K to fill the SMs) and prefill (tiled, compute
bound). Under ``TRITON_INTERPRET=1`` (the CPU tests) each list shrinks to its first config:
autotuning there would only multiply the test time, and the interpreter has no timing to tune on.
"""

from __future__ import annotations

import os

import triton
from torch.fx.experimental.symbolic_shapes import statically_known_true


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


def block_scaled_decode_configs(block_size: int) -> list[triton.Config]:
    """fp8 block GEMM, M ≤ 16: BLOCK_K is the scale block (one activation and one weight scale
    per K step); fewer stages for 256-wide blocks, whose tiles would overflow shared memory."""
    s = 3 if block_size <= 128 else 2
    return _pick(
        [
            _c(16, 32, block_size, warps=4, stages=s, SPLIT_K=1),
            _c(16, 64, block_size, warps=4, stages=s, SPLIT_K=1),
            _c(16, 128, block_size, warps=4, stages=s, SPLIT_K=1),
            _c(16, 64, block_size, warps=4, stages=s, SPLIT_K=2),
            _c(16, 128, block_size, warps=4, stages=s, SPLIT_K=4),
            _c(16, 64, block_size, warps=2, stages=s, SPLIT_K=8),
        ]
    )


def block_scaled_prefill_configs(block_size: int) -> list[triton.Config]:
    """fp8 block GEMM, M > 16: BLOCK_K is the scale block, as for decode."""
    s = 3 if block_size <= 128 else 2
    return _pick(
        [
            _c(32, 32, block_size, warps=4, stages=s),
            _c(64, 64, block_size, warps=4, stages=s + 1),
            _c(128, 64, block_size, warps=4, stages=s),
            _c(64, 128, block_size, warps=4, stages=s),
            _c(128, 128, block_size, warps=8, stages=s),
            _c(128, 256, block_size, warps=8, stages=s - 1),
        ]
    )


def rowwise_configs() -> list[triton.Config]:
    """One program per row (activation quantization, norm_quant): only the warp count varies."""
    return _pick([triton.Config({}, num_warps=w) for w in (4, 1, 2, 8, 16)])


DECODE_MAX_M = 16  # M at or below this takes the decode path


def is_decode(m, decode: bool | None = None) -> bool:
    """Whether M takes the decode path.

    ``decode`` is the caller's choice when given: the CUDA lowering puts both paths of a GEMM
    whose M is dynamic under ``torch.cond(M <= DECODE_MAX_M, ...)`` and names the path in each
    branch, so one exported artifact runs the decode kernel at M = 1 and the tiled one at
    M = 2048. Otherwise it is decided without a shape guard: a concrete M, or a symbolic one
    whose range proves M ≤ DECODE_MAX_M, takes the decode path, and an unbounded dynamic M the
    prefill path, which is correct for every M (a plain ``m <= DECODE_MAX_M`` would guard, and
    torch.export rejects a dynamic M with "Constraints violated")."""
    if decode is not None:
        return decode
    return statically_known_true(m <= DECODE_MAX_M)
