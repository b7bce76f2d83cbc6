"""How fast does a mixture-of-experts LLM decode on this CPU once its experts are int8 or int4?

A Qwen2-MoE-shaped model (``--arch qwen2_moe``, the default) or a Llama-4-shaped one
(``--arch llama4``) with random weights (no small MoE checkpoint ships with the assets; speed
does not depend on the values), fp32, batch 1, built by ``fxquant.export_llm`` (one program with
its KV cache). Per layer: attention, a shared expert, a router and E routed experts of which
each token takes top-k; the routed experts hold most of the weights. transformers runs
Qwen2-MoE's as two grouped GEMMs (``grouped_mm`` over the tokens sorted by expert) and Llama 4's
as two bmm of every token through every expert (scaled by 0 where the token did not choose it),
which fxquant's ``int8wo`` quantizes to ``fxquant::int8_weight_only_grouped_mm`` (Llama 4's: E
groups of T rows), its int4 recipes to their grouped ops. Rows, measured side by side in one
run:

- fp32 Inductor (``torch.compile`` of the program with ``llm_decode.py``'s generation settings:
  the baseline every ratio is relative to; Qwen2-MoE's experts run transformers' grouped_mm
  fallback op, a loop over the experts in Python, Llama 4's its bmm over every expert) and fp32
  AOTInductor (the program packaged by fxquant; its experts on fxquant's native fp32 grouped
  kernel, ``passes/cpu/experts.py``, which skips Llama 4's rows of zeros);
- torchao ``Int8WeightOnlyConfig`` under ``torch.compile`` (``llm_decode.py``'s row, where torchao
  imports): what a user of torchao gets; its ``quantize_`` takes ``nn.Linear`` only, so the
  experts stay float;
- fxquant ``int8wo`` with the experts left float (every linear int8; every recipe left the
  experts float before 2026-12-07), ``int8wo`` (experts int8 too), ``int4wo-64`` and
  ``w4a8-64`` (experts int4 too: ``fxquant::int4_weight_only_grouped_mm`` /
  ``int8_dynamic_int4_grouped_mm``), ``w8a8`` (experts int8 too, x per token in int8:
  ``fxquant::int8_dynamic_grouped_mm``), ``fp8wo`` (experts e4m3, x in float:
  ``fxquant::float8_weight_only_grouped_mm``), ``fp8-row`` and ``fp8-block`` (experts e4m3 too, x
  quantized per token or in 1×128 groups: ``fxquant::float8_dynamic_grouped_mm`` /
  ``float8_block_grouped_mm``, what FbgemmFp8Config and FineGrainedFP8Config make of Llama 4's
  and of every model's experts), each an AOTInductor package. No CPU peer runs fp8 experts
  (transformers' fp8 experts need fbgemm-gpu or its CUDA kernels).

Timed: one decode step at position P (the cache holding a P-token prompt; the same step repeated,
so identical work per call) and a P-token prefill, interleaved rounds, medians. Per row: weight
bytes (the program's constants but the embedding table), decode tok/s and ratio, prefill tok/s
and ratio, and the SQNR of its last-position prefill logits against the fp32 program's (dB; a
sanity check: with random weights, near-tied routers flip experts under any perturbation).

    python benchmarks/moe_decode.py                 # ~4.5 min on 2 cores, cold
    python benchmarks/moe_decode.py --arch llama4   # Llama 4's experts
    python benchmarks/moe_decode.py --quick         # smaller model, fewer rounds

Writes results/moe_decode.json (results/moe_decode_llama4.json for Llama 4).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from llm_decode import build_inductor, build_torchao, torchao_status  # noqa: E402
from machine import bench_interleaved, machine_info, write_results  # noqa: E402

import fxquant  # noqa: E402
from fxquant.core.config import EXPERT_WEIGHTS  # noqa: E402
from fxquant.core.reference import sqnr  # noqa: E402
from fxquant.llm import export_llm  # noqa: E402

# Qwen1.5-MoE-A2.7B's proportions, narrowed to fit a 2-core run: hidden 1024 (2048 there),
# experts 512 wide (1408), 16 experts (60) of which 4 per token (4), a shared expert 4× as wide
SIZES = {
    "full": dict(hidden_size=1024, num_hidden_layers=4, moe_intermediate_size=512,
                 shared_expert_intermediate_size=2048, num_experts=16, num_experts_per_tok=4),
    "quick": dict(hidden_size=512, num_hidden_layers=2, moe_intermediate_size=256,
                  shared_expert_intermediate_size=1024, num_experts=8, num_experts_per_tok=2),
}  # fmt: skip


# Llama 4 Scout's proportions, narrowed the same way: hidden 1024 (5120 there), 16 experts (16)
# 512 wide (8192) of which 1 per token (1), a shared expert as wide as one routed expert; every
# layer a MoE layer (interleave_moe_layer_step 1, as Scout); attention chunks past the cache
LLAMA4_SIZES = {
    "full": dict(hidden_size=1024, num_hidden_layers=4, intermediate_size=512,
                 num_local_experts=16, num_experts_per_tok=1),
    "quick": dict(hidden_size=512, num_hidden_layers=2, intermediate_size=256,
                  num_local_experts=8, num_experts_per_tok=1),
}  # fmt: skip
ARCHS = {
    "qwen2_moe": ("Qwen2MoeForCausalLM (random weights)", SIZES),
    "llama4": ("Llama4ForCausalLM, text only (random weights)", LLAMA4_SIZES),
}


def build_model(size: str, arch: str = "qwen2_moe"):
    import transformers

    dims = ARCHS[arch][1][size]
    common = dict(vocab_size=8192, num_attention_heads=16, num_key_value_heads=4,
                  max_position_embeddings=1024)  # fmt: skip
    if arch == "llama4":
        config = transformers.Llama4TextConfig(
            **common, **dims, head_dim=dims["hidden_size"] // 16,
            intermediate_size_mlp=4 * dims["hidden_size"], attention_chunk_size=8192,
        )  # fmt: skip
    else:
        config = transformers.Qwen2MoeConfig(
            **common, **dims, intermediate_size=4 * dims["hidden_size"]
        )
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def weight_bytes(ep) -> int:
    """Bytes of the program's parameters and constants, but the embedding table (a gather)."""
    tensors = {**ep.state_dict, **ep.constants}
    return sum(
        t.numel() * t.element_size()
        for name, t in tensors.items()
        if isinstance(t, torch.Tensor) and "embed_tokens" not in name
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--prompt", type=int, default=128, help="prefill tokens P")
    parser.add_argument("--rounds", type=int, default=None)
    parser.add_argument("--arch", choices=sorted(ARCHS), default="qwen2_moe")
    parser.add_argument("--out", default=None, help="default results/moe_decode[_llama4].json")
    args = parser.parse_args()
    suffix = "" if args.arch == "qwen2_moe" else f"_{args.arch}"
    out = args.out or str(HERE / "results" / f"moe_decode{suffix}.json")
    size = "quick" if args.quick else "full"
    rounds = args.rounds or (5 if args.quick else 9)
    t_start = time.time()
    torch.set_grad_enabled(False)

    model = build_model(size, args.arch)
    p = args.prompt
    program = export_llm(model, max_cache_len=2 * p)  # logits of the last position, as served
    ids = torch.randint(
        0, model.config.vocab_size, (1, p), generator=torch.Generator().manual_seed(1)
    )
    configs = {
        "int8wo_linears_only": fxquant.QuantConfig(
            scheme=fxquant.Int8WeightOnly(), modules_to_not_convert=("lm_head",),
            overrides={EXPERT_WEIGHTS: None},
        ),
        "int8wo": fxquant.QuantConfig(scheme=fxquant.Int8WeightOnly()),
        "int4wo-64": fxquant.QuantConfig(scheme=fxquant.Int4WeightOnly(group_size=64)),
        "w4a8-64": fxquant.QuantConfig(scheme=fxquant.Int8DynamicActivationInt4(group_size=64)),
        "w8a8": fxquant.QuantConfig.from_recipe("w8a8"),
        "fp8wo": fxquant.QuantConfig.from_recipe("fp8wo"),
        "fp8-row": fxquant.QuantConfig.from_recipe("fp8-row"),
        "fp8-block": fxquant.QuantConfig.from_recipe("fp8-block"),
    }  # fmt: skip
    rows, calls, notes = {}, {}, {}
    reference = program.module()(ids, torch.arange(p))

    def add(name: str, fn, nbytes: int | None) -> None:
        logits = fn(ids, torch.arange(p))  # also fills the cache for the decode step
        rows[name] = {
            "weight_mb": None if nbytes is None else nbytes / 2**20,
            "last_logits_sqnr_db": sqnr(reference, logits),
        }
        tok, pos = ids[:, -1:], torch.tensor([p])
        calls[f"{name}/decode"] = lambda: fn(tok, pos)
        calls[f"{name}/prefill"] = lambda: fn(ids, torch.arange(p))

    t = time.time()
    fn, _, notes["fp32_inductor"] = build_inductor(model, program, ids, 2 * p)
    add("fp32_inductor", fn, weight_bytes(program))
    print(f"fp32 Inductor compiled in {time.time() - t:.0f} s", flush=True)
    why = torchao_status()
    if why is None:
        t = time.time()
        try:
            fn, _, notes["torchao_int8wo_compile"] = build_torchao("Int8WeightOnlyConfig")(
                model, program, ids, 2 * p
            )
            add("torchao_int8wo_compile", fn, None)
            print(f"torchao int8wo compiled in {time.time() - t:.0f} s", flush=True)
        except Exception as e:  # noqa: BLE001 - a peer that does not run is a result too
            why = f"failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}"
    if why is not None:
        notes["torchao_int8wo_compile"] = why
        print(f"torchao int8wo: {why}", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        t = time.time()
        package = fxquant.aot_compile(program, os.path.join(tmp, "fp32.pt2"))
        add("fp32_aoti", package, weight_bytes(program))
        notes["fp32_aoti"] = "export_llm program, fxquant.aot_compile"
        print(f"fp32 package built in {time.time() - t:.0f} s", flush=True)
        reports = {}
        for name, config in configs.items():
            t = time.time()
            qep = fxquant.quantize(program, config)
            rep = fxquant.report(qep)
            reports[name] = {
                "quantized": len(rep.quantized),
                "experts_quantized": sum(1 for r in rep.quantized if r.experts is not None),
            }
            add(name, fxquant.aot_compile(qep, os.path.join(tmp, f"{name}.pt2")), weight_bytes(qep))
            notes[name] = "export_llm → quantize → fxquant.aot_compile"
            print(f"{name} package built in {time.time() - t:.0f} s", flush=True)
        timings = bench_interleaved(calls, rounds=rounds)

    base = {ph: timings[f"fp32_inductor/{ph}"]["median_ms"] for ph in ("decode", "prefill")}
    print(f"\n{args.arch} {size} model, prompt {p}, {rounds} rounds, {machine_info()['cpu_model']}")
    print(f"{'row':24} {'MB':>7} {'decode tok/s':>12} {'×':>6} {'prefill tok/s':>13} {'×':>6} "
          f"{'SQNR dB':>8}")  # fmt: skip
    for name, row in rows.items():
        dec, pre = timings[f"{name}/decode"], timings[f"{name}/prefill"]
        row.update(
            how=notes[name],
            decode_ms=dec["median_ms"],
            decode_min_ms=dec["min_ms"],
            decode_tok_s=1e3 / dec["median_ms"],
            decode_speedup_vs_fp32_inductor=base["decode"] / dec["median_ms"],
            prefill_ms=pre["median_ms"],
            prefill_tok_s=p * 1e3 / pre["median_ms"],
            prefill_speedup_vs_fp32_inductor=base["prefill"] / pre["median_ms"],
            **reports.get(name, {}),
        )
        mb = "–" if row["weight_mb"] is None else f"{row['weight_mb']:.1f}"
        print(
            f"{name:24} {mb:>7} {row['decode_tok_s']:12.1f} "
            f"{row['decode_speedup_vs_fp32_inductor']:6.2f} {row['prefill_tok_s']:13.1f} "
            f"{row['prefill_speedup_vs_fp32_inductor']:6.2f} {row['last_logits_sqnr_db']:8.1f}"
        )
    res = {
        "benchmark": "moe_decode",
        "machine": machine_info(),
        "model": {
            "architecture": ARCHS[args.arch][0],
            **ARCHS[args.arch][1][size],
            "vocab_size": model.config.vocab_size,
            "dtype": "float32",
        },  # fmt: skip
        "prompt_tokens": p,
        "rounds": rounds,
        "rows": rows,
        "skipped": {k: v for k, v in notes.items() if k not in rows},
        "wall_s": time.time() - t_start,
    }
    write_results(res, out)


if __name__ == "__main__":
    main()
