"""Where do fxquant's native CPU kernels beat fp32, and the ATen kernels, as M grows?

The question behind the GEMV / dequantize-and-mm thresholds in ``kernels/cpu/native.h``: all
211 linears of SmolLM2-135M (30 blocks of q, k, v, o, gate, up, down, plus the 49152 × 576
lm_head; random weights of the same shapes), called one after another as a decode step or a
prefill calls them, for M in {1, 4, 8, 16, 32, 64, 128} rows. Candidates per M: fp32
``F.linear`` (MKL), the native ops (``fxquant::native_*``: int8, int8 × int8, int4 g64, int4
g64 × int8 (W4A8), fp8), and the ATen kernels the aten lowering uses (``_weight_int8pack_mm``
and ``_weight_int4pack_mm_for_cpu``, bf16 activations). Rounds are interleaved (every round runs
every candidate); the figure is the median time of one pass over the 211 linears and the
weight bytes it read per second. Eager calls: each pass includes 211 op dispatches
(~15 µs each), which a compiled package does not pay.

    python benchmarks/native_kernels.py                 # ~5 min on 2 cores
    python benchmarks/native_kernels.py --ms 1,16,128   # a subset

Writes results/native_kernels.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from machine import machine_info, write_results

import fxquant.kernels.cpu as native
from fxquant.core import reference as ref

HERE = Path(__file__).resolve().parent
D, FFN, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152  # SmolLM2-135M
SHAPES = [(D, D), (KV, D), (KV, D), (D, D), (FFN, D), (FFN, D), (D, FFN)] * LAYERS + [(VOCAB, D)]


def candidates(m: int) -> dict[str, tuple[callable, int]]:
    """name → (one pass over the 211 linears at M = m, weight bytes it reads)."""
    torch.manual_seed(0)
    ws = [torch.randn(n, k) * 0.02 for n, k in SHAPES]
    xs = {k: torch.randn(m, k) for k in (D, FFN)}
    i8 = [ref.quantize_int8_per_channel(w) for w in ws]
    f8 = [ref.quantize_fp8_per_channel(w) for w in ws]
    i4 = [
        native.prepack_int4(
            *ref.quantize_int4_grouped(w, group_size=64, symmetric=False), group_size=64
        )
        for w in ws
    ]
    xq = {k: ref.quantize_int8_per_token(v) for k, v in xs.items()}
    ones = [torch.ones(n, dtype=torch.bfloat16) for n, _ in SHAPES]
    xb = {k: v.bfloat16() for k, v in xs.items()}
    cpu4 = []
    for w in ws:
        p, s, z = ref.quantize_int4_grouped(w, group_size=64, symmetric=False)
        u = ref.unpack_int4(p).to(torch.int32)
        packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(u, 1)
        sz = torch.stack([s, (8 - z.float()) * s], -1).transpose(0, 1).contiguous().bfloat16()
        cpu4.append((packed, sz))
    fxq = torch.ops.fxquant
    nb8 = sum(q.nbytes for q, _ in i8)
    return {
        "fp32 F.linear": (
            lambda: [F.linear(xs[w.shape[1]], w) for w in ws],
            sum(w.nbytes for w in ws),
        ),
        "native int8": (
            lambda: [fxq.native_int8_weight_only_linear(xs[q.shape[1]], q, s) for q, s in i8],
            nb8,
        ),
        "native int8 x int8": (
            lambda: [
                fxq.native_int8_scaled_linear(
                    xq[q.shape[1]][0], xq[q.shape[1]][1].reshape(-1), q, s
                )
                for q, s in i8
            ],
            nb8,
        ),
        "native int4 g64": (
            lambda: [
                fxq.native_int4_weight_only_linear(xs[w.shape[1] * 2], w, s, o, 64)
                for w, s, o in i4
            ],
            sum(w.nbytes + s.nbytes + o.nbytes for w, s, o in i4),
        ),
        "native int4 g64 x int8": (
            lambda: [
                fxq.native_int8_int4_linear(
                    xq[w.shape[1] * 2][0], xq[w.shape[1] * 2][1].reshape(-1), w, s, o, 64
                )
                for w, s, o in i4
            ],
            sum(w.nbytes + s.nbytes + o.nbytes for w, s, o in i4),
        ),
        "native fp8": (
            lambda: [fxq.native_float8_weight_only_linear(xs[q.shape[1]], q, s) for q, s in f8],
            nb8,
        ),
        "aten _weight_int8pack_mm (bf16)": (
            lambda: [
                torch.ops.aten._weight_int8pack_mm(xb[q.shape[1]], q, o)
                for (q, _), o in zip(i8, ones, strict=True)
            ],
            nb8,
        ),
        "aten _weight_int4pack_mm_for_cpu (bf16)": (
            lambda: [
                torch.ops.aten._weight_int4pack_mm_for_cpu(xb[k], p, 64, sz)
                for (p, sz), (_, k) in zip(cpu4, SHAPES, strict=True)
            ],
            sum(p.nbytes + sz.nbytes for p, sz in cpu4),
        ),
    }


def run(ms: list[int], rounds: int) -> dict:
    t_start = time.perf_counter()
    if not native.available():
        raise SystemExit(f"native kernels unavailable: {native.unavailable_reason()}")
    rows = []
    for m in ms:
        cands = candidates(m)
        for f, _ in cands.values():
            f()
        samples = {k: [] for k in cands}
        for _ in range(rounds):
            for name, (f, _) in cands.items():
                t0 = time.perf_counter()
                f()
                samples[name].append(time.perf_counter() - t0)
        base = statistics.median(samples["fp32 F.linear"])
        for name, (_, nbytes) in cands.items():
            t = statistics.median(samples[name])
            rows.append(
                {
                    "m": m,
                    "candidate": name,
                    "median_ms": t * 1e3,
                    "speedup_vs_fp32": base / t,
                    "weight_gbs": nbytes / t / 1e9,
                }
            )
        print(
            f"M={m:4d} "
            + " | ".join(
                f"{r['candidate'].split(' (')[0]} {r['median_ms']:.1f} ms "
                f"({r['speedup_vs_fp32']:.2f}x)"
                for r in rows
                if r["m"] == m
            ),
            flush=True,
        )
    return {
        "script": "benchmarks/native_kernels.py",
        "machine": machine_info(),
        "shapes": "SmolLM2-135M: 210 block linears + lm_head",
        "rounds": rounds,
        "results": rows,
        "wall_s": time.perf_counter() - t_start,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,4,8,16,32,64,128")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", type=Path, default=HERE / "results" / "native_kernels.json")
    args = ap.parse_args()
    res = run([int(v) for v in args.ms.split(",")], args.rounds)
    write_results(res, args.out)


if __name__ == "__main__":
    main()
