"""Does ``torch.compile(backend="fxquant")`` speed up Hugging Face's own ``generate`` on the CPU?

SmolLM2-135M (real weights), fp32 (``--dtype bf16`` / ``fp16``: in that dtype), batch 1,
transformers' ``model.generate`` with a static cache of ``max_cache_len`` positions (2048 by
default: the cache a served model keeps, whatever the prompt), greedy, a 128-token prompt (the
start of ``lee.cor``, held-out text). Rows, measured side by side in one run: eager
(transformers does not compile on CPU by itself), ``torch.compile(model.forward)`` (Inductor:
the baseline every ratio is relative to), per recipe ``torch.compile(model.forward,
backend="fxquant", options={"config": recipe})``, and the backend with nothing quantized
(``"none"`` in ``--recipes``: ``QuantConfig()``, the weights as loaded: what fxquant's attention
pass and float lowering give alone; the rest of a recipe's ratio is quantization's). Every
compiled row uses the settings docs/llm.md gives for generation: a fixed cache length and no
guards on the modules (``torch.compiler.skip_guard_on_all_nn_modules_unsafe``), each model its
own copy of ``forward`` (Dynamo's caches are per code object).

Timing: a decode step is (a generate of 2 + K new tokens - a generate of 2) / K, medians over
interleaved rounds (every row in every round): what a user's ``generate`` loop pays per token,
transformers' own Python between the steps included. Greedy: the leading new tokens a row
shares with eager in the same dtype. ``benchmarks/llm_decode.py`` measures the exported
packages and the program's own decode loop beside llama.cpp; this script is the in-process path
of a transformers user.

    python benchmarks/hf_generate.py                       # ~5 min on 2 cores
    python benchmarks/hf_generate.py --max-cache-len 256 --recipes int8wo+lm_head
    python benchmarks/hf_generate.py --dtype bf16 --out benchmarks/results/hf_generate_bf16.json

``--dtype bf16`` loads the model in bf16 (what ``from_pretrained`` gives for SmolLM2's
checkpoint): the eager and Inductor rows are then bf16, the baseline bf16 Inductor; ``--dtype
fp16`` likewise in fp16 (what it gives for an fp16 checkpoint).

Writes results/hf_generate.json (machine, versions, rows, ratios).
"""

from __future__ import annotations

import argparse
import copy
import statistics
import time
import warnings
from pathlib import Path

import torch
import transformers
from machine import machine_info, own_forward, write_results

import fxquant
from fxquant import assets
from fxquant.packages import DTYPES

HERE = Path(__file__).resolve().parent
RECIPES = ("none", "int8wo+lm_head", "w8a8+lm_head", "w4a8-64+lm_head=w8a8")
NOT_QUANTIZED = "none"  # the backend row with nothing quantized (the model's own dtype)
PROMPT_TOKENS = 128


def build(model, name: str, recipe: str | None):
    m = copy.deepcopy(model)
    m.generation_config.eos_token_id = None  # every generate runs its full length
    if name.endswith(" eager"):
        return m
    own_forward(m)
    options = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
    if recipe is None:
        m.forward = torch.compile(m.forward, options=options)
    else:
        options["config"] = fxquant.QuantConfig() if recipe == NOT_QUANTIZED else recipe
        m.forward = torch.compile(m.forward, backend="fxquant", options=options)
    return m


def time_generate(built: dict, prompt, kw: dict, rounds: int, new_tokens: int, greedy_ref: str):
    """Per row of ``built`` (name → model): its decode step (a generate of 2 + ``new_tokens``
    new tokens less one of 2, over ``new_tokens``; medians over ``rounds`` interleaved rounds),
    and how many leading new tokens it shares with the row ``greedy_ref``."""
    short = {n: [] for n in built}
    long = {n: [] for n in built}
    tokens = {}
    for _ in range(rounds):
        for name, m in built.items():
            t0 = time.perf_counter()
            m.generate(prompt, max_new_tokens=2, **kw)
            short[name].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            out = m.generate(prompt, max_new_tokens=2 + new_tokens, **kw)
            long[name].append(time.perf_counter() - t0)
            tokens[name] = out[0, prompt.shape[1] :].tolist()
    want = tokens[greedy_ref]
    results = {}
    for name in built:
        step = (statistics.median(long[name]) - statistics.median(short[name])) / new_tokens
        pairs = enumerate(zip(tokens[name], want, strict=True))
        results[name] = dict(
            decode_ms=round(step * 1e3, 2),
            decode_tokens_per_s=round(1 / step, 1),
            generate_2_tokens_s=round(statistics.median(short[name]), 3),
            greedy_agree=next((i for i, (x, y) in pairs if x != y), len(want)),
        )
    return results


def _row_name(recipe: str) -> str:
    if recipe == NOT_QUANTIZED:
        return "fxquant backend, nothing quantized"
    return f"fxquant {recipe} backend"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--max-cache-len", type=int, default=2048)
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--new-tokens", type=int, default=32, help="K: decode steps timed")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--out", default=str(HERE / "results" / "hf_generate.json"))
    a = ap.parse_args()
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    t_start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, tokenizer = assets.load_smollm2()
    model = model.to(DTYPES[a.dtype])
    eager, baseline = f"{a.dtype} eager", f"{a.dtype} inductor"
    prompt = tokenizer(assets.lee_text("test"), return_tensors="pt").input_ids[:, :PROMPT_TOKENS]
    kw = dict(
        do_sample=False,
        cache_implementation="static",
        max_cache_len=a.max_cache_len,
        pad_token_id=tokenizer.eos_token_id or 0,
    )
    rows = [(eager, None), (baseline, None)]
    rows += [(_row_name(r), r) for r in a.recipes.split(",") if r]
    built, results = {}, {}
    for name, recipe in rows:
        t0 = time.perf_counter()
        m = build(model, name, recipe)
        m.generate(prompt, max_new_tokens=2, **kw)  # prefill and decode graphs
        m.generate(prompt, max_new_tokens=2, **kw)
        built[name] = m
        build_s = round(time.perf_counter() - t0, 1)
        scheme = a.dtype if recipe in (None, NOT_QUANTIZED) else recipe
        results[name] = {"candidate": name, "scheme": scheme, "build_s": build_s}
        print(f"[{name}] ready in {build_s} s", flush=True)
    for name, timed in time_generate(built, prompt, kw, a.rounds, a.new_tokens, eager).items():
        results[name].update(timed)
    base = results[baseline]["decode_ms"]
    print(f"\nmax_cache_len {a.max_cache_len}, prompt {PROMPT_TOKENS}, {a.new_tokens} steps timed")
    print(f"{'row':42} {'decode ms':>10} {'tok/s':>7} {'x inductor':>10} {'greedy':>7}")
    for r in results.values():
        r["decode_speedup_vs_baseline"] = round(base / r["decode_ms"], 2)
        print(
            f"{r['candidate']:42} {r['decode_ms']:10.2f} {r['decode_tokens_per_s']:7.1f} "
            f"{r['decode_speedup_vs_baseline']:9.2f}x {r['greedy_agree']:4d}/{a.new_tokens + 2}"
        )
    write_results(
        {
            "script": "benchmarks/hf_generate.py",
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "versions": {"torch": torch.__version__, "transformers": transformers.__version__},
            "question": __doc__.splitlines()[0],
            "machine": machine_info(),
            "model": f"SmolLM2-135M-Instruct ({a.dtype})",
            "dtype": a.dtype,
            "max_cache_len": a.max_cache_len,
            "prompt_tokens": PROMPT_TOKENS,
            "new_tokens_timed": a.new_tokens,
            "rounds": a.rounds,
            "baseline": baseline,
            "results": list(results.values()),
            "wall_s": round(time.perf_counter() - t_start, 1),
        },
        a.out,
    )


if __name__ == "__main__":
    main()
