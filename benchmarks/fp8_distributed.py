"""What does FP8 training through ``torch.compile(backend="fxquant")`` cost under DDP, next to fp32,
in steps/s, bytes all-reduced per step and peak memory? Two CPU processes, gloo.

The model is a row of ``shapes.py`` built as the issue's MLP stack: blocks of LayerNorm →
Linear(D, ffn) → GELU → Linear(ffn, D) with a residual (default ``bench-stack-1024``: D=1024,
ffn=4096, 4 blocks, 33.6 M parameters), wrapped in ``DistributedDataParallel`` and compiled as
PyTorch recommends, ``torch.compile(DDP(model))`` (Dynamo's DDPOptimizer splits the graph at the
gradient buckets, so each bucket's all-reduce can start while the backward runs). Each rank trains
AdamW on its own rows (MSE to a fixed random linear map of the input). Rows:

- ``fp32 inductor``: ``torch.compile(DDP(model))``;
- ``fp8 delayed``: ``torch.compile(DDP(model), backend="fxquant", options={"config":
  QuantConfig(scheme=Float8Recipe(scaling="delayed"))})`` (the first and the last Linear stay in
  high precision: accelerate's default filter).

Per row, each in its own pair of processes (a clean compile cache in memory and a clean peak):

- steps/s: 1 / the median step time after ``--warmup`` steps, a step being the slower rank's
  forward + backward (with DDP's all-reduce) + optimizer step, ranks lined up by a barrier first;
- bytes per step each rank all-reduces: DDP's gradient buckets (counted in a comm hook that wraps
  PyTorch's default ``allreduce_hook``: the bucket buffer's bytes; both rows pay the hook's bit of
  Python) and the FP8 amaxes (``fxquant.training.state.update_states`` all-reduces 5 fp32 per FP8
  layer with MAX, once a step in each compiled graph that has FP8 layers: DDPOptimizer's pieces
  each send their own; counted by wrapping ``torch.distributed.all_reduce`` in the rank). These
  are the payloads: a ring all-reduce over 2 ranks sends and receives that much per rank;
- peak RSS per rank (``resource.getrusage(RUSAGE_SELF).ru_maxrss``): the whole process, the
  compile included.

FP8 GEMMs on this CPU are ``torch._scaled_mm`` (or emulated): slower than fp32 by construction,
so the step-time ratio measures that cost, not a speed-up; the byte counts are what carries over
to a GPU: FP8 leaves the gradients (fp32, the master weights' dtype) as they are and adds a few
bytes of amaxes a step. The results are keyed by parallelism ({"ddp": ...}) so an FSDP2 section
can sit beside them.

    python benchmarks/fp8_distributed.py               # ~1.5 min on 2 cores, ~3 cold
    python benchmarks/fp8_distributed.py --steps 6     # a quick look
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

# The benchmark stack of cpu_latency.py. A class of our own matters here: under
# torch.compile(DDP(model)) Dynamo starts a new frame at the wrapped module's forward, and it does
# not start frames in torch.nn's files (an nn.Sequential would run eagerly, uncompiled).
from cpu_latency import Stack  # run as `python benchmarks/...`: a sibling script
from machine import machine_info, write_results
from shapes import get_shape
from torch import nn

import fxquant
from fxquant import Float8Recipe, QuantConfig
from fxquant.passes.cpu.dispatch import machine_class

RESULTS = Path(__file__).resolve().parent / "results"
WORLD = 2
ROWS = {
    "fp32 inductor": None,
    "fp8 delayed": QuantConfig(scheme=Float8Recipe(scaling="delayed")),
}


def _rank(rank: int, row: str, args: argparse.Namespace, store: str, out: str) -> None:
    """One DDP rank of one row; writes ``out/rank<r>.json``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.nn.parallel import DistributedDataParallel as DDP

    from fxquant.backend import last_reports
    from fxquant.training.state import layer_states

    torch.set_num_threads(1)  # two ranks on two cores
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(minutes=5),
    )
    shape = get_shape(args.shape)
    torch.manual_seed(0)
    model = Stack(shape).train()
    teacher = torch.randn(shape.d_model, shape.d_model) / shape.d_model**0.5
    g = torch.Generator().manual_seed(100 + rank)  # each rank its own rows
    xs = [torch.randn(args.rows, shape.d_model, generator=g) for _ in range(4)]
    count = {"grad_bytes": 0, "grad_calls": 0, "amax_bytes": 0, "amax_calls": 0}

    def counting_allreduce_hook(state, bucket):
        buf = bucket.buffer()
        count["grad_bytes"] += buf.numel() * buf.element_size()
        count["grad_calls"] += 1
        return default_hooks.allreduce_hook(None, bucket)  # divide by world size, all-reduce

    real_all_reduce = dist.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        if op == dist.ReduceOp.MAX:  # only update_states sends one
            count["amax_bytes"] += tensor.numel() * tensor.element_size()
            count["amax_calls"] += 1
        return real_all_reduce(tensor, op=op, group=group, async_op=async_op)

    dist.all_reduce = all_reduce
    ddp = DDP(model)
    ddp.register_comm_hook(None, counting_allreduce_hook)
    config = ROWS[row]
    if config is None:
        run = torch.compile(ddp)
    else:
        run = torch.compile(ddp, backend="fxquant", options={"config": config})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = []
    for i in range(args.warmup + args.steps):
        x = xs[i % len(xs)]
        dist.barrier()
        before = dict(count)
        t0 = time.perf_counter()
        loss = F.mse_loss(run(x), x @ teacher)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()
        seconds = time.perf_counter() - t0
        steps.append({"s": seconds, "loss": loss_value, **{k: count[k] - before[k] for k in count}})
    dist.all_reduce = real_all_reduce
    result = {
        "steps": steps,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
        # the FP8 layers of each graph fxquant compiled (DDPOptimizer's per-bucket pieces)
        "fp8_graphs": [
            [r["name"] for r in rows if r["status"] != "skipped"] for rows in last_reports
        ],
        "fp8_layers": len(layer_states(model)),
        "linears": sum(isinstance(m, nn.Linear) for m in model.modules()),
        "param_bytes": sum(p.numel() * p.element_size() for p in model.parameters()),
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def measure(row: str, args: argparse.Namespace) -> dict:
    load = os.getloadavg()[0]  # other jobs share the cores: a loaded row is slower
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        mp.spawn(_rank, args=(row, args, f"{tmp}/store", tmp), nprocs=WORLD)
        wall = time.perf_counter() - t0
        ranks = [json.loads(Path(tmp, f"rank{r}.json").read_text()) for r in range(WORLD)]
    timed = [
        [r["steps"][i] for r in ranks] for i in range(args.warmup, args.warmup + args.steps)
    ]  # per timed step, both ranks
    step_s = [max(s["s"] for s in both) for both in timed]
    med = statistics.median(step_s)

    def per_step(key: str) -> int:
        # the same on every timed step and rank (DDP rebuilds its buckets after the first step,
        # inside the warmup); the median guards against a stray one
        return int(statistics.median(s[key] for both in timed for s in both))

    out = {
        "steps_per_s": round(1 / med, 3),
        "median_step_ms": round(1e3 * med, 1),
        "min_step_ms": round(1e3 * min(step_s), 1),
        "first_step_s": round(max(r["steps"][0]["s"] for r in ranks), 1),
        "grad_allreduce_bytes_per_step": per_step("grad_bytes"),
        "grad_allreduce_calls_per_step": per_step("grad_calls"),
        "amax_allreduce_bytes_per_step": per_step("amax_bytes"),
        "amax_allreduce_calls_per_step": per_step("amax_calls"),
        "peak_rss_mib_per_rank": [round(r["peak_rss_mib"], 1) for r in ranks],
        "fp8_graphs": ranks[0]["fp8_graphs"],
        "fp8_layers": ranks[0]["fp8_layers"],
        "linears": ranks[0]["linears"],
        "param_bytes": ranks[0]["param_bytes"],
        "loss_first_last": [
            round(statistics.mean(r["steps"][i]["loss"] for r in ranks), 4) for i in (0, -1)
        ],
        "wall_s": round(wall, 1),
        "loadavg_1min_before": round(load, 2),
    }
    out["allreduce_bytes_per_step"] = (
        out["grad_allreduce_bytes_per_step"] + out["amax_allreduce_bytes_per_step"]
    )
    print(
        f"{row:14s} first {out['first_step_s']:5.1f} s  median {out['median_step_ms']:7.1f} ms"
        f"/step ({out['steps_per_s']:.2f}/s)  {out['allreduce_bytes_per_step'] / 2**20:8.2f} MiB"
        f"/step  peak {max(out['peak_rss_mib_per_rank']):6.0f} MiB  ({out['wall_s']:.0f} s)",
        flush=True,
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="bench-stack-1024", help="a row of benchmarks/shapes.py")
    ap.add_argument("--rows", type=int, default=128, help="rows (tokens) per rank and step")
    ap.add_argument("--steps", type=int, default=20, help="timed steps per row")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps first (compile)")
    ap.add_argument(
        "--out", default=None, help="JSON path (default results/fp8_distributed_<class>.json)"
    )
    args = ap.parse_args()
    out_path = args.out or str(RESULTS / f"fp8_distributed_{machine_class()}.json")
    t_start = time.time()
    ddp = {row: measure(row, args) for row in ROWS}
    base, fp8 = ddp["fp32 inductor"], ddp["fp8 delayed"]
    ratios = {
        "step_time": round(fp8["median_step_ms"] / base["median_step_ms"], 2),
        "allreduce_bytes": round(
            fp8["allreduce_bytes_per_step"] / base["allreduce_bytes_per_step"], 6
        ),
        "peak_rss": round(
            max(fp8["peak_rss_mib_per_rank"]) / max(base["peak_rss_mib_per_rank"]), 2
        ),
    }
    shape = get_shape(args.shape)
    res = {
        "script": "benchmarks/fp8_distributed.py",
        "question": " ".join(__doc__.split("\n\n")[0].split()),
        "world": WORLD,
        "backend": "gloo",
        "threads_per_rank": 1,
        "shape": {
            "name": shape.name,
            "d_model": shape.d_model,
            "ffn": shape.ffn,
            "layers": shape.layers,
        },
        "rows_per_rank": args.rows,
        "steps": args.steps,
        "warmup": args.warmup,
        "optimizer": "AdamW lr 1e-3",
        "note": "FP8 GEMMs are torch._scaled_mm on CPU: slower than fp32 here by construction. "
        "Bytes are all-reduce payloads per rank and step (grad buckets via a DDP comm hook, FP8 "
        "amaxes via torch.distributed.all_reduce). Peak RSS includes the compile. Machines are "
        "shared: quote the ratios.",
        "machine": machine_info(),
        "versions": {"torch": torch.__version__, "fxquant": fxquant.__version__},
        "results": {"ddp": {**ddp, "fp8_vs_fp32": ratios}},  # an "fsdp2" section sits beside
        "wall_s": time.time() - t_start,
    }
    print(f"\nDDP, {WORLD} ranks (gloo), {shape.name}, {args.rows} rows/rank, medians:")
    print(f"{'row':14s} {'steps/s':>8s} {'ms/step':>8s} {'grad B/step':>12s} {'amax B/step':>12s}"
          f" {'amax calls':>10s} {'peak RSS MiB (r0, r1)':>22s}")  # fmt: skip
    for row, r in ddp.items():
        rss = ", ".join(f"{v:.0f}" for v in r["peak_rss_mib_per_rank"])
        print(
            f"{row:14s} {r['steps_per_s']:8.2f} {r['median_step_ms']:8.1f} "
            f"{r['grad_allreduce_bytes_per_step']:12d} {r['amax_allreduce_bytes_per_step']:12d} "
            f"{r['amax_allreduce_calls_per_step']:10d} {rss:>22s}"
        )
    print(
        f"{'fp8 / fp32':14s} step time {ratios['step_time']:.2f}x, bytes all-reduced "
        f"{ratios['allreduce_bytes']:.6f}x, peak RSS {ratios['peak_rss']:.2f}x"
    )
    write_results(res, out_path)


if __name__ == "__main__":
    main()
