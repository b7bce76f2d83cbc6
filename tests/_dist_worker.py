"""The rank side of tests/test_float8_distributed.py: one process of a two-rank DDP run (gloo, CPU)
that trains a small MLP in FP8 with delayed scaling, and the single-process run it is held to.

Its own module, not the test's: ``torch.multiprocessing.spawn`` pickles the worker function by
module and name, and a child process imports it from the parent's ``sys.path`` (where pytest put
``tests/``); importing the test module there would import pytest and the conftest too.

Both runs see the same global batches and the same initial weights. Rank r trains on rows
[r·B, (r+1)·B) of each batch; those rows are scaled by ``RANK_SCALE[r]``, so the two ranks' amaxes
differ by about that factor and only an all-reduce with MAX can make their scales agree.
"""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

from fxquant import Float8Recipe, QuantConfig
from fxquant.backend import last_reports
from fxquant.training.state import fp8_state_dict, layer_states, update_states

WORLD = 2
B = 16  # rows per rank and step
STEPS = 4
# 1.2 MB of parameters: two DDP buckets at bucket_cap_mb=1 (the least Dynamo's DDPOptimizer
# takes: its first bucket is 1 MiB), so the compiled DDP model is two FP8 graphs, fc1 | fc2 fc3,
# each all-reducing its own layers' amaxes
D_IN, D_HID, D_OUT = 32, 512, 32
BUCKET_CAP_MB = 1
RANK_SCALE = (1.0, 8.0)  # rank 1's inputs are 8x rank 0's
LR = 0.05
# Every Linear in FP8 (the default filter would skip the first and the last of three), history
# shorter than the run so the window also drops a step.
CONFIG = QuantConfig(
    scheme=Float8Recipe(scaling="delayed", amax_history_len=4),
    module_filter=lambda module, fqn: True,
)


class MLP(nn.Module):
    # A class of our own, not nn.Sequential: torch.compile(DDP(model)) traces DDP.forward, which
    # graph-breaks (its logger, then the dynamo-disabled _inside_ddp_forward) and Dynamo resumes
    # at the wrapped module's forward as a new frame. Dynamo does not start a frame in torch.nn's
    # own files, so a bare nn.Sequential would run eagerly in fp32, silently (torch 2.13).
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = nn.Linear(D_IN, D_HID)
        self.fc2 = nn.Linear(D_HID, D_HID)
        self.fc3 = nn.Linear(D_HID, D_OUT)

    def forward(self, x):
        return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))


def make_model() -> MLP:
    torch.manual_seed(0)
    return MLP().train()


def batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    """STEPS global batches (x [WORLD·B, D_IN], y [WORLD·B, D_OUT]); rank r owns rows r·B..."""
    g = torch.Generator().manual_seed(1)
    scale = torch.tensor(RANK_SCALE).repeat_interleave(B)[:, None]
    out = []
    for _ in range(STEPS):
        x = torch.randn(WORLD * B, D_IN, generator=g) * scale
        out.append((x, torch.randn(WORLD * B, D_OUT, generator=g)))
    return out


def _train(model: nn.Module, run, data, *, loss_scale: float = 1.0) -> list[float]:
    opt = torch.optim.SGD(model.parameters(), lr=LR / loss_scale)
    losses = []
    for x, y in data:
        loss = (run(x) - y).square().mean()
        (loss * loss_scale).backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _finish(model: nn.Module, losses: list[float], reports: list) -> dict:
    # The last step's amaxes sit unreduced in row 0 ("pending") until the next training forward
    # all-reduces and applies them; a state saved with all_reduce=True holds them reduced (the
    # single process has nothing to reduce: the same as without). Then run the update, as the
    # next step would.
    pending = fp8_state_dict(model)
    synced = fp8_state_dict(model, all_reduce=True)
    update_states(list(layer_states(model).values()))
    return {
        "losses": losses,
        "pending": pending,
        "synced": synced,
        "fp8": fp8_state_dict(model),
        "params": {n: p.detach().clone() for n, p in model.named_parameters()},
        # the FP8 layers of each graph the backend compiled for this run, in compile order
        "graphs": [[r["name"] for r in rows if r["status"] != "skipped"] for rows in reports],
    }


def new_reports():
    """A function giving the backend's reports added since this call (``last_reports`` is shared
    by every compile in the process and keeps the last 16)."""
    before = {id(rows) for rows in last_reports}
    return lambda: [rows for rows in last_reports if id(rows) not in before]


def init_gloo(rank: int, store: str) -> None:
    """Join the WORLD-rank gloo group through a file store, one thread per rank (two ranks on
    two cores). A rank that dies leaves the other in a collective: fail in a minute, not in
    gloo's 30."""
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{store}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=60),
    )


def spawn_ranks(rank_main, out: Path) -> list:
    """Run ``rank_main(rank, store, out)`` in WORLD spawned processes and load what each saved
    (``out/rank<r>.pt``). Spawn, never fork: the parent holds Dynamo/Inductor state and OpenMP
    threads. One Inductor compile thread per rank: each would otherwise start its own pool of
    compile workers on the same two cores."""
    import torch.multiprocessing as mp

    saved = os.environ.get("TORCHINDUCTOR_COMPILE_THREADS")
    os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = "1"
    try:
        mp.spawn(rank_main, args=(str(out / "store"), str(out)), nprocs=WORLD)
    finally:
        if saved is None:
            del os.environ["TORCHINDUCTOR_COMPILE_THREADS"]
        else:
            os.environ["TORCHINDUCTOR_COMPILE_THREADS"] = saved
    return [torch.load(out / f"rank{r}.pt") for r in range(WORLD)]


def single_process() -> dict:
    """The reference: one process, the whole global batch, no torch.distributed.

    Its loss is the mean over the global batch, as DDP's averaged gradients are; the backward
    runs on WORLD x that loss with the learning rate / WORLD, the same SGD steps in exact
    arithmetic (scaling by a power of two is exact), because a DDP rank's backward sees the
    gradient of its *local* mean, WORLD x its share of the global mean's: the FP8 casts of the
    gradients then see the same values in both runs. With the plain mean they would not at step
    0, where every scale is 1 and e5m2 rounds 2g and g differently below its normal range.
    """
    model = make_model()
    run = torch.compile(model, backend="fxquant", options={"config": CONFIG})
    reports = new_reports()
    losses = _train(model, run, batches(), loss_scale=WORLD)
    return _finish(model, losses, reports())


def rank_main(rank: int, store: str, out: str) -> None:
    """One DDP rank; writes its results to ``out/rank<r>.pt``."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    init_gloo(rank, store)
    # See every MAX all-reduce (only update_states sends one; DDP's own gradient all-reduce runs
    # in its C++ reducer): the rows before and after, to check the reduction elementwise.
    reductions = []
    real_all_reduce = dist.all_reduce

    def all_reduce(tensor, op=dist.ReduceOp.SUM, group=None, async_op=False):
        before = tensor.clone()
        work = real_all_reduce(tensor, op=op, group=group, async_op=async_op)
        if op == dist.ReduceOp.MAX:
            reductions.append((before, tensor.clone()))
        return work

    dist.all_reduce = all_reduce
    try:
        model = make_model()
        # Compile the DDP-wrapped module, as PyTorch recommends: Dynamo's DDPOptimizer splits
        # the graph at the gradient buckets (optimize_ddp, on by default), so each bucket's
        # all-reduce can start while the rest of the backward runs. Here that makes two FP8
        # graphs sharing one state registry, as any model over one bucket gets.
        ddp = DDP(model, bucket_cap_mb=BUCKET_CAP_MB)
        run = torch.compile(ddp, backend="fxquant", options={"config": CONFIG})
        data = [(x[rank * B : (rank + 1) * B], y[rank * B : (rank + 1) * B]) for x, y in batches()]
        reports = new_reports()
        result = _finish(model, _train(model, run, data), reports())
    finally:
        dist.all_reduce = real_all_reduce
    result["reductions"] = reductions
    torch.save(result, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()
