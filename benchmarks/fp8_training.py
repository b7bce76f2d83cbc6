"""What does FP8 training through ``torch.compile(model, backend="fxquant")`` cost and give, on
this CPU, next to fp32 and bf16?

A Llama-shaped decoder (RMSNorm, q/k/v/o attention, SwiGLU MLP, tied lm_head; d=256, ffn=512,
4 layers, vocab 256) trains N steps of AdamW on a synthetic next-token task (a noisy bigram: the
next token is perm[token] with probability 3/4, else uniform; the best loss is about 1.9 nats),
batch 8 × 64 tokens, the same data and initial weights for every row. Rows:

- fp32 eager; fp32 Inductor (``torch.compile``); bf16 Inductor (weights and activations bf16);
- fxquant FP8 per recipe: delayed (TE's default, HYBRID), current per tensor (torchao
  tensorwise), current per row, MXFP8, block 128 — each ``torch.compile(model,
  backend="fxquant", options={"config": QuantConfig(scheme=Float8Recipe(...))})``.

Per row: first step (s, the compile), median step time over the remaining steps (ms) and steps/s,
loss (mean of the last 10 steps) and its gap to fp32 eager's. The FP8 GEMMs are *emulated* here
(fp8 values dequantized exactly to fp32 and multiplied in fp32), so on this CPU FP8 training is
slower than fp32, not faster: these rows measure the cost of the emulation and that the loss
follows fp32, not a speed-up. GPU anchors for the real thing (not measured here): Transformer
Engine on H200 reports 1.69× (delayed) / 1.57× (current) / 1.41× (block) per-layer GEMM
speed-ups over bf16; torchao float8 training +25% (tensorwise) / +10% (rowwise) end to end on
8×H100 Llama-3-8B.

    python benchmarks/fp8_training.py              # 100 steps per row (~6 min on 2 cores)
    python benchmarks/fp8_training.py --steps 20   # a quick look
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from machine import machine_info, write_results  # run as `python benchmarks/...`
from torch import nn

import fxquant
from fxquant import Float8Recipe, QuantConfig

OUT = Path(__file__).resolve().parent / "results" / "fp8_training.json"
VOCAB, D, FFN, LAYERS, BATCH, SEQ = 256, 256, 512, 4, 8, 64

RECIPES = {
    "fp8 delayed (HYBRID)": Float8Recipe(scaling="delayed"),
    "fp8 current, tensor": Float8Recipe(scaling="current"),
    "fp8 current, row": Float8Recipe(scaling="current", granularity="row"),
    "fp8 mxfp8": Float8Recipe(scaling="mxfp8", emulate=True),
    "fp8 block 128": Float8Recipe(scaling="block", emulate=True),
}


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(D)
        self.q_proj, self.k_proj = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)
        self.v_proj, self.o_proj = nn.Linear(D, D, bias=False), nn.Linear(D, D, bias=False)
        self.post_attention_layernorm = nn.RMSNorm(D)
        self.gate_proj = nn.Linear(D, FFN, bias=False)
        self.up_proj = nn.Linear(D, FFN, bias=False)
        self.down_proj = nn.Linear(FFN, D, bias=False)

    def forward(self, x):
        h = self.input_layernorm(x)
        q, k, v = (
            p(h).unflatten(-1, (4, D // 4)).transpose(1, 2)
            for p in (self.q_proj, self.k_proj, self.v_proj)
        )
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o_proj(att.transpose(1, 2).flatten(-2))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Llama(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, D)
        nn.init.normal_(self.embed_tokens.weight, std=0.02)
        self.layers = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.RMSNorm(D)
        self.lm_head = nn.Linear(D, VOCAB, bias=False)
        self.lm_head.weight = self.embed_tokens.weight

    def forward(self, ids):
        x = self.embed_tokens(ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


def batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    perm = torch.randperm(VOCAB, generator=g)
    out = []
    for _ in range(steps):
        x = torch.empty(BATCH, SEQ + 1, dtype=torch.long)
        x[:, 0] = torch.randint(0, VOCAB, (BATCH,), generator=g)
        for i in range(SEQ):
            noise = torch.randint(0, VOCAB, (BATCH,), generator=g)
            keep = torch.rand(BATCH, generator=g) < 0.75
            x[:, i + 1] = torch.where(keep, perm[x[:, i]], noise)
        out.append((x[:, :-1], x[:, 1:]))
    return out


def run(name: str, make_runner, data, *, dtype=torch.float32) -> dict:
    torch.manual_seed(0)
    model = Llama().to(dtype).train()
    runner = make_runner(model)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    times, losses = [], []
    for x, y in data:
        t0 = time.perf_counter()
        loss = F.cross_entropy(runner(x).float().flatten(0, 1), y.flatten())
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        times.append(time.perf_counter() - t0)
        losses.append(loss.item())
    med = statistics.median(times[1:]) if len(times) > 1 else times[0]
    row = {
        "name": name,
        "first_step_s": round(times[0], 2),
        "median_step_ms": round(1e3 * med, 1),
        "steps_per_s": round(1 / med, 2),
        "loss_last10": round(statistics.mean(losses[-10:]), 4),
        "losses": [round(v, 4) for v in losses],
    }
    print(
        f"{name:24s} first {row['first_step_s']:6.1f} s   median {row['median_step_ms']:7.1f} "
        f"ms/step ({row['steps_per_s']:5.2f}/s)   loss(last 10) {row['loss_last10']:.4f}",
        flush=True,
    )
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    t_start = time.time()
    data = batches(args.steps)
    rows = [
        run("fp32 eager", lambda m: m, data),
        run("fp32 inductor", lambda m: torch.compile(m), data),
        run("bf16 inductor", lambda m: torch.compile(m), data, dtype=torch.bfloat16),
    ]
    for name, recipe in RECIPES.items():
        cfg = QuantConfig(scheme=recipe)
        rows.append(
            run(
                name,
                lambda m, cfg=cfg: torch.compile(m, backend="fxquant", options={"config": cfg}),
                data,
            )
        )
        torch._dynamo.reset()
    base = rows[0]["loss_last10"]
    fp32_ind = rows[1]["median_step_ms"]
    for r in rows:
        r["loss_gap_vs_fp32"] = round(r["loss_last10"] - base, 4)
        r["step_time_vs_fp32_inductor"] = round(r["median_step_ms"] / fp32_ind, 2)
    res = {
        "script": "benchmarks/fp8_training.py",
        "steps": args.steps,
        "model": {"vocab": VOCAB, "d": D, "ffn": FFN, "layers": LAYERS, "batch": BATCH, "seq": SEQ},
        "emulated": True,
        "note": "FP8 GEMMs emulated in fp32 on this CPU: slower than fp32 by construction",
        "machine": machine_info(),
        "versions": {"torch": torch.__version__, "fxquant": fxquant.__version__},
        "results": rows,
        "wall_s": time.time() - t_start,
    }
    print(f"\n{'row':24s} {'ms/step':>8s} {'× fp32 Ind.':>11s} {'loss':>7s} {'gap':>7s}")
    for r in rows:
        print(
            f"{r['name']:24s} {r['median_step_ms']:8.1f} {r['step_time_vs_fp32_inductor']:11.2f} "
            f"{r['loss_last10']:7.4f} {r['loss_gap_vs_fp32']:+7.4f}"
        )
    write_results(res, args.out)


if __name__ == "__main__":
    main()
