"""Which kernel should each quantized GEMM run on this CPU, at each M?

The measurement behind the CPU lowering's dispatch table (``passes/cpu/dispatch_table.json``, read
by ``passes/cpu/dispatch.py``). Workload: all 211 linears of SmolLM2-135M (30 blocks of q, k, v, o,
gate, up, down and the 49152 × 576 lm_head; random weights of those shapes), called one after
another as a decode step or a prefill calls them, for M in 1 … 512 rows. For each GEMM the native
lowering dispatches (int8 weight-only, w8a8, fp8 e4m3, int4 g64 weight-only, W4A8 g64), every
candidate the lowering has (the functions in ``passes/cpu/int8.py`` / ``float8.py`` / ``int4.py``,
under ``torch.compile``, one graph per decoder block as a package runs them) is timed beside fp32
and bf16 ``F.linear`` (compiled the same way), rounds interleaved; the figure is the median time of
one pass over the 211 linears. The fastest candidate at each M makes the plan for this machine's
class: ``[[largest M it won, candidate], ..., [null, the winner at the largest M]]``.

    python benchmarks/cpu_kernels.py                     # ~10 min on 2 cores
    python benchmarks/cpu_kernels.py --ms 1,16,128       # a subset
    python benchmarks/cpu_kernels.py --write-table       # and put this class's plan in the table
    python benchmarks/cpu_kernels.py --replan benchmarks/results/cpu_kernels_avx2.json --write-table
                                                         # plans again from saved timings

Writes ``results/cpu_kernels_<class>.json`` (the class: ``passes/cpu/dispatch.py``'s
``machine_class()``; the CPU model and ISA flags are recorded beside it).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from machine import bench_interleaved, machine_info, write_results

import fxquant.kernels.cpu as native
from fxquant.core import reference as ref
from fxquant.passes.cpu import dispatch

# the family modules declare their GEMMs' candidates (dispatch.GEMMS) when imported
from fxquant.passes.cpu import float8 as _float8  # noqa: F401
from fxquant.passes.cpu import int4 as _int4  # noqa: F401
from fxquant.passes.cpu import int8 as _int8  # noqa: F401

HERE = Path(__file__).resolve().parent
D, FFN, KV, LAYERS, VOCAB = 576, 1536, 192, 30, 49152  # SmolLM2-135M
SHAPES = [(D, D), (KV, D), (KV, D), (D, D), (FFN, D), (FFN, D), (D, FFN)] * LAYERS + [(VOCAB, D)]
GROUP = 64


def _weights() -> dict[str, list]:
    torch.manual_seed(0)
    ws = [torch.randn(n, k) * 0.02 for n, k in SHAPES]
    int8 = [ref.quantize_int8_per_channel(w) for w in ws]
    int4 = [
        native.prepack_int4(
            *ref.quantize_int4_grouped(w, group_size=GROUP, symmetric=False), group_size=GROUP
        )
        for w in ws
    ]
    fp8 = [ref.quantize_fp8_per_channel(w) for w in ws]
    vnni = [(*native.prepack_int8_vnni(q), s.float().contiguous()) for q, s in int8]
    return {
        "fp32": ws,
        "bf16": [w.bfloat16() for w in ws],
        "int8": int8,
        "fp8": fp8,
        "int4": int4,
        "int8_vnni": vnni,
    }


# op → (which weights it reads, its arguments from (x, (xq, xs), stored weight))
ARGS: dict[str, tuple[str, Callable]] = {
    "native_int8_weight_only_linear": ("int8", lambda x, xq, w: (x, *w)),
    "native_int8_scaled_linear": ("int8", lambda x, xq, w: (*xq, *w)),
    "native_float8_weight_only_linear": ("fp8", lambda x, xq, w: (x, *w)),
    "native_int4_weight_only_linear": ("int4", lambda x, xq, w: (x, *w, GROUP)),
    "native_int8_int4_linear": ("int4", lambda x, xq, w: (x, *w, GROUP)),  # quantizes x itself
}
# op → its candidates: the functions its lowering dispatches over (declared with
# ``dispatch.candidates`` in passes/cpu/int8.py, float8.py, int4.py)
CANDIDATES: dict[str, dict[str, Callable]] = {op: dispatch.GEMMS[op] for op in ARGS}
# op → (weights, arguments, kernel) of its native kernel on the weight layout of its own that
# the lowering stores where the class's plan is that kernel at every M (``dispatch.packs``);
# timed as "<op>:native_packed", a plan of its own (see ``plan``)
PACKED: dict[str, tuple[str, Callable, Callable]] = {
    "native_int8_scaled_linear": (
        "int8_vnni",
        lambda x, xq, w: (*xq, *w),
        torch.ops.fxquant.native_int8_scaled_vnni_linear,
    ),
}
PACKED_SUFFIX = "_packed"


def _passes(m: int, weights: dict) -> dict[str, Callable[[], None]]:
    """name → one pass over the 211 linears at M = m."""
    torch.manual_seed(m)
    xs = {k: torch.randn(m, k) for k in (D, FFN)}
    xq = {k: ref.quantize_int8_per_token(v) for k, v in xs.items()}
    xq = {k: (q, s.reshape(-1).contiguous()) for k, (q, s) in xq.items()}

    def run(fn, calls):
        # one compiled graph per decoder block (its 7 GEMMs, the same shapes in every block)
        # and one for lm_head: static shapes, as in a package, and few calls from Python
        f = torch.compile(lambda group: [fn(*c) for c in group], dynamic=False)
        groups = [calls[i : i + 7] for i in range(0, LAYERS * 7, 7)] + [calls[LAYERS * 7 :]]
        return lambda: [f(g) for g in groups]

    def calls(weights_, args) -> list[tuple]:
        return [args(xs[k], xq[k], w) for (_, k), w in zip(SHAPES, weights_, strict=True)]

    out = {
        "fp32 F.linear": run(F.linear, calls(weights["fp32"], lambda x, xq, w: (x, w))),
        "bf16 F.linear": run(F.linear, calls(weights["bf16"], lambda x, xq, w: (x.bfloat16(), w))),
    }
    for op, cands in CANDIDATES.items():
        kind, args = ARGS[op]
        each = calls(weights[kind], args)
        for name, fn in cands.items():
            out[f"{op}:{name}"] = run(fn, each)
        if op in PACKED and dispatch.packs_on(op, dispatch.machine_class()):
            kind, args, fn = PACKED[op]
            out[f"{op}:native{PACKED_SUFFIX}"] = run(fn, calls(weights[kind], args))
    return out


# A candidate that gives the scheme other activation numerics (int4 weight-only's x rounded to
# int8) competes only from this M: prefill and batched serving, where it pays most (~1.8x the
# weight-only path at M = 128 on AVX2); decode keeps the scheme's own numerics (~10 % there).
MIN_M = {"int8_act": 16}
# A candidate that runs the native kernel itself below some M (the bf16 dot-product kernels
# take the fp32 GEMV for one row): there it is the native kernel, timed as such, so run-to-run
# noise between two timings of the same code does not decide the plan.
NATIVE_BELOW = {"bf16_dot": 2}
TIE = 0.05


def plan(by_m: dict[int, dict[str, float]], op: str) -> list[list]:
    """``[[max M, candidate], [None, candidate]]`` or ``[[None, candidate]]``: at most one
    boundary. Each boundary is a ``torch.cond`` on M around every call of the GEMM, which costs
    at every M, not only where the second candidate wins: it keeps Inductor from fusing across
    the call and adds the branch's handles (an A/B of AOTInductor packages of the benchmark
    stack on the Zen 4, interleaved: +7 % a call at M = 1 for one boundary, +25 % for two). Of
    the plans with one candidate, or two and a boundary at a measured M (a candidate serving no
    M below its ``MIN_M``), the one whose time over the measured M's, each as a ratio to the
    fastest candidate there, has the smallest geometric mean; a boundary must buy more than
    ``TIE`` of that mean. Decode first: the plan's candidate at the smallest M (one token a
    call, what an LLM spends most calls on) is within ``TIE`` of the fastest there.

    Where the native kernel has a packed layout of its own on this class (``native_packed``
    timed), that is one more one-candidate plan, ``[[None, "native"]]``: the lowering packs the
    weight exactly when the plan is the native kernel at every M."""
    ms = sorted(by_m)
    times = {
        m: {n.split(":")[1]: t for n, t in by_m[m].items() if n.startswith(op + ":")} for m in ms
    }
    for name, below in NATIVE_BELOW.items():
        for m in ms:
            if m < below and name in times[m] and "native" in times[m]:
                times[m][name] = times[m]["native"]
    names = [n for n in times[ms[0]] if not n.endswith(PACKED_SUFFIX)]

    def allowed(name: str, m: int) -> bool:
        return m >= MIN_M.get(name, 0)

    best = {m: min(t for n, t in times[m].items() if allowed(n, m)) for m in ms}

    def score(pick) -> float | None:  # pick(m) -> candidate; None when a pick is not allowed
        total = 0.0
        for m in ms:
            name = pick(m)
            if not allowed(name, m):
                return None
            total += math.log(times[m][name] / best[m])
        return math.exp(total / len(ms))

    plans = []  # (score, plan)
    packed = "native" + PACKED_SUFFIX
    if packed in times[ms[0]] and times[ms[0]][packed] <= (1 + TIE) * best[ms[0]]:
        plans.append((score(lambda m: packed) * (1 + TIE), [[None, "native"]]))
    for a in names:
        if times[ms[0]][a] > (1 + TIE) * best[ms[0]] or not allowed(a, ms[0]):
            continue
        if (sc := score(lambda m, a=a: a)) is not None:
            plans.append((sc * (1 + TIE), [[None, a]]))
        for b in names:
            for bound in ms[:-1]:
                if a == b:
                    continue
                sc = score(lambda m, a=a, b=b, bound=bound: a if m <= bound else b)
                if sc is not None:
                    plans.append((sc * (1 + 2 * TIE), [[bound, a], [None, b]]))
    return min(plans, key=lambda p: p[0])[1]


def write_table(cls: str, plans: dict[str, list[list]]) -> None:
    data = json.loads(dispatch.TABLE_PATH.read_text())
    data["classes"][cls] = plans
    lines = ["{", f'  "about": {json.dumps(data["about"])},', '  "classes": {']
    for i, (name, ops) in enumerate(data["classes"].items()):
        lines.append(f"    {json.dumps(name)}: {{")
        rows = [f"      {json.dumps(op)}: {json.dumps(p)}" for op, p in ops.items()]
        lines += [",\n".join(rows), "    }" + ("," if i < len(data["classes"]) - 1 else "")]
    lines += ["  }", "}", ""]
    dispatch.TABLE_PATH.write_text("\n".join(lines))
    print(f"wrote the {cls} plans into {dispatch.TABLE_PATH}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ms", default="1,4,8,16,32,64,128,256,512")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--write-table", action="store_true", help="update dispatch_table.json")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument(
        "--replan", type=Path, default=None, help="no measuring: the plans from a results JSON"
    )
    a = ap.parse_args()
    if a.replan is not None:
        saved = json.loads(a.replan.read_text())
        by_m: dict[int, dict[str, float]] = {}
        for r in saved["results"]:
            by_m.setdefault(r["M"], {})[r["candidate"]] = r["median_ms"]
        saved["plans"] = {op: plan(by_m, op) for op in CANDIDATES}
        for op, p in saved["plans"].items():
            print(f"{op}: {p}")
        write_results(saved, a.replan)
        if a.write_table:
            write_table(saved["machine"]["cpu_class"], saved["plans"])
        return
    if not native.available():
        raise SystemExit(f"the native CPU kernels did not build: {native.unavailable_reason()}")
    torch.set_num_threads(2)
    # every candidate compiles the same block function (one code object): past Dynamo's
    # recompile limit (8) the later ones would silently run eager
    torch._dynamo.config.recompile_limit = 1024
    torch._dynamo.config.accumulated_recompile_limit = 4096
    cls = dispatch.machine_class()
    t0 = time.perf_counter()
    weights = _weights()
    by_m: dict[int, dict[str, float]] = {}
    rows = []
    for m in [int(v) for v in a.ms.split(",")]:
        res = bench_interleaved(_passes(m, weights), a.rounds, target_s=0.0)
        by_m[m] = {n: r["median_ms"] for n, r in res.items()}
        fp32, bf16 = by_m[m]["fp32 F.linear"], by_m[m]["bf16 F.linear"]
        line = [f"M={m:4d} fp32 {fp32:7.1f} ms  bf16 {fp32 / bf16:.2f}x"]
        for n, r in res.items():
            rows.append({"M": m, "candidate": n, **r, "speedup_vs_fp32": fp32 / r["median_ms"]})
            if ":" in n:
                short = n.replace("native_", "").replace("_linear", "")
                line.append(f"{short} {fp32 / r['median_ms']:.2f}x")
        print("  ".join(line), flush=True)
    plans = {op: plan(by_m, op) for op in CANDIDATES}
    for op, p in plans.items():
        print(f"{op}: {p}")
    res = {
        "question": __doc__.splitlines()[0],
        "machine": machine_info(),
        "workload": "SmolLM2-135M's 211 linears, one pass (median of interleaved rounds, ms)",
        "rounds": a.rounds,
        "results": rows,
        "plans": plans,
        "wall_s": time.perf_counter() - t0,
    }
    write_results(res, a.out or HERE / "results" / f"cpu_kernels_{cls}.json")
    if a.write_table:
        write_table(cls, plans)


if __name__ == "__main__":
    main()
