"""How fast is a mixture-of-experts model quantized by the ``from_pretrained`` bridge, in process?

``moe_decode.py``'s Qwen2-MoE-shaped model (random weights, fp32; ``--quick``: its smaller one),
saved with ``save_pretrained`` and loaded back by ``from_pretrained``, float and with
``quantization_config=FxquantHfConfig(...)`` (every linear and routed experts weight quantized;
the routers and the head float). Rows, measured side by side in one run, one forward of a
``--tokens``-token input without a cache (a prefill: M = tokens for the linears, about
tokens · top_k / E rows per expert) and of one token (a decode step's GEMMs without the
attention over a cache):

- float eager (transformers' ``grouped_mm`` experts: a Python loop over the experts on CPU) and
  float Inductor (``torch.compile``: the baseline every ratio is relative to);
- per recipe, the bridged model eager (its ops on the CPU lowering's kernels,
  ``fxquant.passes.eager``, the experts' grouped ones among them), the same under
  ``reference_math()`` (each op's plain-torch reference: dequantize, then multiply; what a
  bridged model ran eagerly before 2026-12-07), and under
  ``torch.compile(backend="fxquant", options={"config": fxquant.QuantConfig()})`` (the graph
  already holds fxquant's ops; the backend, told to quantize nothing more, lowers them onto this
  CPU's native kernels, the experts' grouped ones among them; the head and routers stay float
  as in the bridged model);
- and under plain ``torch.compile`` (the default backend, Inductor, as a user compiles any
  model): fxquant's decompositions (``fxquant.passes.stock``) put the CPU lowering's kernels
  under each op; the "(reference ops)" row compiles the same model without them (Inductor
  calling each op's reference, what it did before 2026-12-07).

``moe_decode.py`` measures the exported package with its KV cache; this is the in-process path of
a transformers user who quantizes at load time.

    python benchmarks/bridge_moe.py            # ~7 min on 2 cores
    python benchmarks/bridge_moe.py --quick

Writes results/bridge_moe.json (machine, versions, rows, ratios).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from machine import bench_interleaved, machine_info, own_forward, write_results  # noqa: E402
from moe_decode import build_model  # noqa: E402

import fxquant  # noqa: E402
from fxquant.passes.eager import reference_math  # noqa: E402

RECIPES = ("int8wo", "w8a8", "int4wo-64")
BASELINE = "float Inductor"
EAGER, REFERENCE, BACKEND, STOCK, STOCK_REFERENCE = (
    " bridge eager",
    " bridge eager (reference math)",
    " bridge + fxquant backend",
    " bridge + torch.compile",
    " bridge + torch.compile (reference ops)",
)


@contextlib.contextmanager
def without_stock_decompositions():
    """Inductor as it was before fxquant.passes.stock: each op a call of its reference. Off the
    disk caches too, which key a graph by its code, not by the decompositions it was built with."""
    from torch._inductor.decomposition import select_decomp_table

    from fxquant.passes.stock import is_stock

    table = select_decomp_table()
    saved = {op: fn for op, fn in table.items() if is_stock(fn)}
    for op in saved:
        del table[op]
    try:
        with (
            torch._inductor.config.patch(fx_graph_cache=False),
            torch._functorch.config.patch(enable_autograd_cache=False),
        ):
            yield
    finally:
        table.update(saved)


def main() -> None:
    import transformers

    from fxquant.hf.bridge import FxquantHfConfig

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--quick", action="store_true", help="the smaller model, fewer rounds")
    ap.add_argument("--tokens", type=int, default=32, help="tokens of the prefill forward")
    ap.add_argument("--recipes", nargs="+", default=list(RECIPES))
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--out", default=str(HERE / "results" / "bridge_moe.json"))
    args = ap.parse_args()
    t0 = time.time()
    torch.manual_seed(0)
    model = build_model("quick" if args.quick else "full")
    rounds = args.rounds or (3 if args.quick else 7)
    vocab = model.config.vocab_size
    inputs = {
        "prefill": torch.randint(0, vocab, (1, args.tokens)),
        "decode": torch.randint(0, vocab, (1, 1)),
    }
    models = {"float eager": model, BASELINE: torch.compile(own_forward(copy.deepcopy(model)))}
    reports = {}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        for recipe in args.recipes:
            config = fxquant.QuantConfig(
                scheme=fxquant.QuantConfig.from_recipe(recipe).scheme,
                modules_to_not_convert=("lm_head", "gate", "shared_expert_gate"),
            )
            bridged = transformers.AutoModelForCausalLM.from_pretrained(
                tmp, quantization_config=FxquantHfConfig(config)
            ).eval()
            reports[recipe] = bridged.fxquant_report
            models[recipe + EAGER] = bridged
            models[recipe + REFERENCE] = bridged
            own = own_forward(copy.deepcopy(bridged))
            # nothing more to quantize (QuantConfig()): the backend lowers the bridge's ops
            lower_only = {"config": fxquant.QuantConfig()}
            models[recipe + BACKEND] = torch.compile(own, backend="fxquant", options=lower_only)
            models[recipe + STOCK] = torch.compile(own_forward(copy.deepcopy(bridged)))
            models[recipe + STOCK_REFERENCE] = torch.compile(own_forward(copy.deepcopy(bridged)))
    rows = {}
    for what, ids in inputs.items():
        fns = {}
        for name, m in models.items():
            context = contextlib.nullcontext
            if name.endswith(REFERENCE):
                context = reference_math
            elif name.endswith(STOCK_REFERENCE):
                context = without_stock_decompositions  # the compile at the first call

            def call(m=m, ids=ids, context=context):
                with torch.no_grad(), context():
                    m(ids, use_cache=False)

            fns[name] = call
        print(f"timing {what} ({ids.shape[1]} tokens), {rounds} rounds ...", flush=True)
        timed = bench_interleaved(fns, rounds)
        for name, t in timed.items():
            row = rows.setdefault(name, {})
            row[f"{what}_ms"] = round(t["median_ms"], 3)
            row[f"{what}_x"] = round(timed[BASELINE]["median_ms"] / t["median_ms"], 2)
    for recipe, rep in reports.items():
        experts = [r for r in rep.rows if r["kind"] == "experts"]
        for suffix in (EAGER, REFERENCE, BACKEND, STOCK, STOCK_REFERENCE):
            rows[recipe + suffix]["experts_quantized"] = sum(
                r["status"] == "quantized" for r in experts
            )
            rows[recipe + suffix]["weight_bytes"] = rep.program_bytes
    rows["float eager"]["weight_bytes"] = rows[BASELINE]["weight_bytes"] = sum(
        p.numel() * p.element_size() for p in model.parameters()
    )
    print(f"\n{'row':48} {'prefill ms':>11} {'x':>6} {'decode ms':>10} {'x':>6} {'MB':>7}")
    for name, r in rows.items():
        print(f"{name:48} {r['prefill_ms']:11.2f} {r['prefill_x']:6.2f} {r['decode_ms']:10.2f} "
              f"{r['decode_x']:6.2f} {r['weight_bytes'] / 1e6:7.1f}")  # fmt: skip
    res = {
        "what": "from_pretrained bridge on a Qwen2-MoE-shaped model: one forward, no cache",
        "machine": machine_info(),
        "transformers": transformers.__version__,
        "model": "quick" if args.quick else "full",
        "prefill_tokens": args.tokens,
        "rounds": rounds,
        "baseline": BASELINE,
        "rows": rows,
        "wall_s": time.time() - t0,
    }
    write_results(res, args.out)


if __name__ == "__main__":
    main()
