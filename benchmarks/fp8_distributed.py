"""What does FP8 training through ``torch.compile(backend="fxquant")`` cost under DDP and FSDP2,
next to high precision, in steps/s, bytes communicated per step and peak memory? Two CPU
processes, gloo.

The model is a row of ``shapes.py`` built as the issue's MLP stack (``cpu_latency.Stack``: blocks
of LayerNorm → Linear(D, ffn) → GELU → Linear(ffn, D) with a residual; default
``bench-stack-1024``: D=1024, ffn=4096, 4 blocks, 33.6 M parameters). Each rank trains AdamW on
its own rows (MSE to a fixed random linear map of the input). Rows:

- ``ddp``: ``DistributedDataParallel``, compiled as PyTorch recommends,
  ``torch.compile(DDP(model))`` (Dynamo's DDPOptimizer splits the graph at the gradient
  buckets): ``fp32 inductor``, and ``fp8 delayed`` (``backend="fxquant"``,
  ``Float8Recipe(scaling="delayed")``; the first and the last Linear stay in high precision:
  accelerate's default filter);
- ``fsdp2``: ``fully_shard`` on each block and the root, bf16 parameters for compute
  (``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``), then ``torch.compile(model)``:
  ``bf16 inductor``; ``fp8 current`` (every linear, current tensorwise scaling); and
  ``fp8 current + fp8 all-gather`` (the same, the weights all-gathered in e4m3 by
  ``fxquant.training.fsdp.enable_fsdp_float8_all_gather``); ``fp8 accelerate + fp8 all-gather``
  (accelerate's way: ``fxquant.accelerate.apply_fp8_autowrap`` with ``AORecipeKwargs`` fields,
  every linear admitted and ``enable_fsdp_float8_all_gather=True``, before ``fully_shard``; then
  ``torch.compile(model, backend="fxquant")`` with no config: the FP8 region comes from the
  wrapped forward).

Per row, each in its own pair of processes (a clean compile cache in memory and a clean peak):

- steps/s: 1 / the median step time after ``--warmup`` steps, a step being the slower rank's
  forward + backward (with its collectives) + optimizer step, ranks lined up by a barrier first;
- bytes per step and rank: DDP's gradient buckets (a comm hook wrapping PyTorch's default
  ``allreduce_hook``), the FP8 amax all-reduces (``torch.distributed.all_reduce`` with MAX:
  delayed scaling's state, the FP8 all-gather's shared scale), and FSDP2's all-gathers (bytes
  received) and reduce-scatters (bytes sent), counted by wrapping ``all_gather_single`` /
  ``reduce_scatter_single``, which FSDP2 calls;
- peak RSS per rank (``resource.getrusage(RUSAGE_SELF).ru_maxrss``): the whole process, the
  compile included.

FP8 GEMMs on this CPU are ``torch._scaled_mm``: slower than fp32 or bf16 by construction, so the
step-time ratio measures that cost, not a speed-up; the byte counts are what carries over to a
GPU.

    python benchmarks/fp8_distributed.py                   # ~3 min on 2 cores
    python benchmarks/fp8_distributed.py --parallel fsdp2  # one section
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
# Under FSDP2 each block is its own graph (Dynamo breaks at every fully_shard module), so the
# first/last rule would skip both linears of every block: the FSDP rows admit every linear.
_EVERY_LINEAR = QuantConfig(
    scheme=Float8Recipe(scaling="current"), module_filter=lambda module, fqn: True
)
# The accelerate row's recipe handler (AORecipeKwargs' fields; its default config is current
# tensorwise scaling, as _EVERY_LINEAR's) in place of a config
_ACCELERATE = {
    "config": None,
    "module_filter_func": lambda module, fqn: True,
    "enable_fsdp_float8_all_gather": True,
}
ROWS = {
    "ddp": {
        "fp32 inductor": None,
        "fp8 delayed": QuantConfig(scheme=Float8Recipe(scaling="delayed")),
    },
    "fsdp2": {
        "bf16 inductor": None,
        "fp8 current": _EVERY_LINEAR,
        "fp8 current + fp8 all-gather": _EVERY_LINEAR,
        "fp8 accelerate + fp8 all-gather": _ACCELERATE,
    },
}


def _fsdp2(model: nn.Module, row: str) -> None:
    """Shard each block, then the root, with bf16 mixed precision (fp32 gradient reduction);
    the all-gather row first wraps every linear weight for the FP8 all-gather."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from fxquant.accelerate import apply_fp8_autowrap
    from fxquant.training.fsdp import enable_fsdp_float8_all_gather

    if ROWS["fsdp2"][row] is _ACCELERATE:
        apply_fp8_autowrap(model, _ACCELERATE)  # the process group is up: the all-gather too
    elif row.endswith("fp8 all-gather"):
        enable_fsdp_float8_all_gather(model, recipe=_EVERY_LINEAR.scheme, world_size=WORLD)
    mesh = init_device_mesh("cpu", (WORLD,))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in model.blocks:
        fully_shard(block, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)


def _rank(
    rank: int, parallel: str, row: str, args: argparse.Namespace, store: str, out: str
) -> None:
    """One rank of one row (``parallel``: "ddp" or "fsdp2"); writes ``out/rank<r>.json``."""
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
    count = {
        "grad_bytes": 0,
        "grad_calls": 0,
        "amax_bytes": 0,
        "amax_calls": 0,
        "all_gather_bytes": 0,
        "reduce_scatter_bytes": 0,
    }

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

    # FSDP2 calls these through the module attribute: what each rank receives / sends
    real_all_gather, real_reduce_scatter = dist.all_gather_single, dist.reduce_scatter_single

    def all_gather_single(output, input, *a, **kw):
        count["all_gather_bytes"] += output.numel() * output.element_size()
        return real_all_gather(output, input, *a, **kw)

    def reduce_scatter_single(output, input, *a, **kw):
        count["reduce_scatter_bytes"] += input.numel() * input.element_size()
        return real_reduce_scatter(output, input, *a, **kw)

    dist.all_reduce = all_reduce
    dist.all_gather_single, dist.reduce_scatter_single = all_gather_single, reduce_scatter_single
    if parallel == "ddp":
        wrapped = DDP(model)
        wrapped.register_comm_hook(None, counting_allreduce_hook)
    else:
        _fsdp2(model, row)
        wrapped = model
    config = ROWS[parallel][row]
    if config is None:
        run = torch.compile(wrapped)
    elif config is _ACCELERATE:
        run = torch.compile(wrapped, backend="fxquant")
    else:
        run = torch.compile(wrapped, backend="fxquant", options={"config": config})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    steps = []
    for i in range(args.warmup + args.steps):
        x = xs[i % len(xs)]
        dist.barrier()
        before = dict(count)
        t0 = time.perf_counter()
        loss = F.mse_loss(run(x).float(), x @ teacher)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss_value = loss.item()
        seconds = time.perf_counter() - t0
        steps.append({"s": seconds, "loss": loss_value, **{k: count[k] - before[k] for k in count}})
    dist.all_reduce = real_all_reduce
    dist.all_gather_single, dist.reduce_scatter_single = real_all_gather, real_reduce_scatter
    result = {
        "steps": steps,
        "peak_rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,  # Linux: KiB
        # the FP8 layers of each graph fxquant compiled (DDPOptimizer's per-bucket pieces)
        "fp8_graphs": [
            [r["name"] for r in rows if r["status"] != "skipped"] for rows in last_reports
        ],
        "fp8_layers": len(layer_states(model)),
        "linears": sum(isinstance(m, nn.Linear) for m in model.modules()),
        "param_bytes": sum(
            p.numel() * p.element_size() for p in model.parameters()
        ),  # under FSDP2: of the whole (DTensor) parameters
    }
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    dist.destroy_process_group()


def measure(parallel: str, row: str, args: argparse.Namespace) -> dict:
    load = os.getloadavg()[0]  # other jobs share the cores: a loaded row is slower
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        mp.spawn(_rank, args=(parallel, row, args, f"{tmp}/store", tmp), nprocs=WORLD)
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
        "all_gather_bytes_per_step": per_step("all_gather_bytes"),
        "reduce_scatter_bytes_per_step": per_step("reduce_scatter_bytes"),
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
    out["communicated_bytes_per_step"] = (
        out["allreduce_bytes_per_step"]
        + out["all_gather_bytes_per_step"]
        + out["reduce_scatter_bytes_per_step"]
    )
    print(
        f"{parallel} {row:28s} first {out['first_step_s']:5.1f} s  "
        f"median {out['median_step_ms']:7.1f} ms"
        f"/step ({out['steps_per_s']:.2f}/s)  {out['communicated_bytes_per_step'] / 2**20:8.2f} MiB"
        f"/step  peak {max(out['peak_rss_mib_per_rank']):6.0f} MiB  ({out['wall_s']:.0f} s)",
        flush=True,
    )
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="bench-stack-1024", help="a row of benchmarks/shapes.py")
    ap.add_argument("--rows", type=int, default=128, help="rows (tokens) per rank and step")
    ap.add_argument("--steps", type=int, default=10, help="timed steps per row")
    ap.add_argument("--warmup", type=int, default=2, help="untimed steps first (compile)")
    ap.add_argument(
        "--parallel", default="ddp,fsdp2", help="comma-separated: ddp, fsdp2 (default both)"
    )
    ap.add_argument(
        "--out", default=None, help="JSON path (default results/fp8_distributed_<class>.json)"
    )
    args = ap.parse_args()
    out_path = args.out or str(RESULTS / f"fp8_distributed_{machine_class()}.json")
    t_start = time.time()
    parts = [p for p in args.parallel.split(",") if p]
    unknown = set(parts) - set(ROWS)
    if unknown:
        raise SystemExit(f"--parallel {sorted(unknown)}: allowed {', '.join(ROWS)}")
    results = {}
    for parallel in parts:
        rows = {row: measure(parallel, row, args) for row in ROWS[parallel]}
        base_name = next(iter(rows))
        base = rows[base_name]
        ratios = {}
        for row, r in list(rows.items())[1:]:
            ratios[f"{row} vs {base_name}"] = {
                "step_time": round(r["median_step_ms"] / base["median_step_ms"], 2),
                "communicated_bytes": round(
                    r["communicated_bytes_per_step"] / base["communicated_bytes_per_step"], 4
                ),
                "all_gather_bytes": round(
                    r["all_gather_bytes_per_step"] / base["all_gather_bytes_per_step"], 4
                )
                if base["all_gather_bytes_per_step"]
                else None,
                "peak_rss": round(
                    max(r["peak_rss_mib_per_rank"]) / max(base["peak_rss_mib_per_rank"]), 2
                ),
            }
        results[parallel] = {**rows, "ratios": ratios}
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
        "Bytes are payloads per rank and step: all-reduces (DDP grad buckets via a comm hook, FP8 "
        "amaxes via torch.distributed.all_reduce), FSDP2 all-gathers (received) and "
        "reduce-scatters (sent). Peak RSS includes the compile. Machines are shared: quote the "
        "ratios.",
        "machine": machine_info(),
        "versions": {"torch": torch.__version__, "fxquant": fxquant.__version__},
        "results": results,
        "wall_s": time.time() - t_start,
    }
    for parallel, rows in results.items():
        print(f"\n{parallel}, {WORLD} ranks (gloo), {shape.name}, {args.rows} rows/rank, medians:")
        print(f"{'row':30s} {'steps/s':>8s} {'ms/step':>8s} {'all-reduce B':>13s} "
              f"{'all-gather B':>13s} {'red-scat B':>12s} {'peak RSS MiB':>13s}")  # fmt: skip
        for row, r in rows.items():
            if row == "ratios":
                continue
            print(
                f"{row:30s} {r['steps_per_s']:8.2f} {r['median_step_ms']:8.1f} "
                f"{r['allreduce_bytes_per_step']:13d} {r['all_gather_bytes_per_step']:13d} "
                f"{r['reduce_scatter_bytes_per_step']:12d} {max(r['peak_rss_mib_per_rank']):13.0f}"
            )
        for name, q in rows["ratios"].items():
            gather = (
                "" if q["all_gather_bytes"] is None else f", all-gather {q['all_gather_bytes']}x"
            )
            print(
                f"  {name}: step time {q['step_time']}x, bytes {q['communicated_bytes']}x"
                f"{gather}, peak RSS {q['peak_rss']}x"
            )
    write_results(res, out_path)


if __name__ == "__main__":
    main()
