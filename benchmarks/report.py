"""Regenerate the results section of the project README from benchmarks/results/*.json.

Where this sits: after the benchmark scripts. Each script writes one JSON file (with the machine
and versions it ran on); this script turns them into short markdown tables and the chart links,
and rewrites only the text between ``<!-- results:start -->`` and ``<!-- results:end -->`` in
README.md. Every figure names the JSON it came from. A missing or unreadable JSON gives a line
saying which script to run; nothing is measured here.

    python benchmarks/report.py              # rewrite README.md between the markers
    python benchmarks/report.py --stdout     # print the block only, change nothing

If README.md has no markers, the block is printed to stdout and the README is left untouched.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"
START, END = "<!-- results:start -->", "<!-- results:end -->"


def _load(name: str, how: str) -> tuple[dict | None, str | None]:
    """(record, None) or (None, a markdown line saying what to run)."""
    path = RESULTS / name
    if not path.exists():
        return None, f"_No `benchmarks/results/{name}` yet: run `{how}`._"
    try:
        return json.loads(path.read_text()), None
    except (OSError, json.JSONDecodeError) as e:
        return None, f"_`benchmarks/results/{name}` is unreadable ({e}): rerun `{how}`._"


def _f(v, spec: str, missing: str = "–") -> str:
    return missing if v is None else format(v, spec)


def _table(head: list[str], rows: list[list[str]], align: str | None = None) -> str:
    align = align or "l" + "r" * (len(head) - 1)
    sep = ["---:" if a == "r" else "---" for a in align]
    lines = ["| " + " | ".join(head) + " |", "| " + " | ".join(sep) + " |"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def _machine(rec: dict) -> str:
    m = rec.get("machine", {})
    cpu = m.get("cpu_model") or m.get("cpu") or "?"
    cores = m.get("os_cpu_count") or m.get("cores") or "?"
    cap = f", {m['cpu_capability']}" if m.get("cpu_capability") else ""
    date = (rec.get("date") or m.get("date") or "?")[:10]
    versions = rec.get("versions") or {"torch": m.get("torch", "?")}
    vs = ", ".join(f"{k} {v}" for k, v in versions.items() if v)
    return f"{date} · {cpu} ({cores} cores{cap}) · {vs}"


def _skipped(rows: list[dict]) -> list[str]:
    return [f"- {r['name']}: {r['status']}" for r in rows if r.get("status") != "ok"]


# --------------------------------------------------------------------------- sections


def accuracy_section() -> str:
    rec, missing = _load("accuracy.json", "python benchmarks/accuracy.py")
    out = ["### Accuracy on real models", ""]
    if rec is None:
        return "\n".join(out + [missing])
    src = "`benchmarks/accuracy.py` → `benchmarks/results/accuracy.json`"
    state = "" if rec.get("complete") else " **Partial run** (stopped before the end)."
    quick = " **Smoke run (`--quick`)**: few tokens, indicative only." if rec.get("quick") else ""
    out += [f"From {src}; {_machine(rec)}.{state}{quick}", ""]
    if (RESULTS / "accuracy.png").exists():
        out += ["![accuracy chart](benchmarks/results/accuracy.png)", ""]
    tok = rec.get("tokens") or {}
    lm = rec.get("smollm2") or []
    if lm:
        out += [
            f"SmolLM2-135M perplexity, 512-token windows, no BOS: first {tok.get('lee', '?')} "
            f"tokens of `lee_background.cor` and {tok.get('wiki', '?')} of the Wikipedia text. "
            "fxquant rows run the quantized `ExportedProgram`; peers run eager; `lm_head` stays "
            "float everywhere.",
            "",
        ]
        rows = []
        for r in lm:
            if r.get("status") != "ok":
                continue
            who = r["name"] if r["method"] != "fxquant" else f"**fxquant {r['name']}**"
            rows.append(
                [
                    who,
                    r.get("recipe", ""),
                    _f(r.get("ppl_lee"), ".2f"),
                    _f(r.get("ppl_lee_rel_pct"), "+.2f") + " %",
                    _f(r.get("ppl_wiki"), ".2f"),
                    _f(r.get("ppl_wiki_rel_pct"), "+.2f") + " %",
                    _f(r.get("linears_quantized"), "d"),
                ]
            )
        head = ["variant", "matches", "Lee ppl", "Δ", "Wiki ppl", "Δ", "linears q."]
        out += [_table(head, rows, "llrrrrr"), ""]
        skipped = _skipped(lm)
        if skipped:
            out += ["Not measured:", "", *skipped, ""]
    aoti = rec.get("aoti_check")
    if aoti:
        if aoti.get("status") == "ok":
            out += [
                f"AOTInductor spot check (int8wo, first {aoti['tokens']} Lee tokens): package "
                f"ppl {aoti['ppl_aoti']:.3f} vs program {aoti['ppl_program']:.3f} "
                f"(relative difference {aoti['rel_diff']:.1e}; built in {aoti['build_s']:.0f} s).",
                "",
            ]
        else:
            out += [f"AOTInductor spot check: {aoti.get('status')}", ""]
    enc = rec.get("minilm") or []
    if enc:
        out += [
            f"all-MiniLM-L6-v2 on {rec.get('sentences', '?')} Lee sentences: cosine of each "
            "sentence embedding to its fp32 embedding, and top-1 nearest-neighbour agreement with "
            "fp32 (the fp32 row compares the exported program with the eager model).",
            "",
        ]
        rows = [
            [
                r["name"] if r["method"] != "fxquant" else f"**fxquant {r['name']}**",
                r.get("recipe", ""),
                _f(r.get("mean_cos"), ".5f"),
                _f(r.get("min_cos"), ".5f"),
                _f(r.get("top1_agreement"), ".3f"),
            ]
            for r in enc
            if r.get("status") == "ok"
        ]
        head = ["variant", "matches", "mean cos", "min cos", "top-1 agree"]
        out += [_table(head, rows, "llrrr"), ""]
        skipped = _skipped(enc)
        if skipped:
            out += ["Not measured:", "", *skipped, ""]
    return "\n".join(out).rstrip()


def latency_section() -> str:
    """One subsection per CPU class measured (``cpu_latency_<class>.json``): speed is not
    carried from one class to another."""
    names = sorted(p.name for p in RESULTS.glob("cpu_latency_*.json"))
    if not names:
        return (
            "### CPU latency\n\n_No `benchmarks/results/cpu_latency_<class>.json` yet: run "
            "`python benchmarks/cpu_latency.py`._"
        )
    return "\n\n".join(_latency_class(name) for name in names)


def _latency_class(name: str) -> str:
    rec, missing = _load(name, "python benchmarks/cpu_latency.py")
    cls = name.removeprefix("cpu_latency_").removesuffix(".json")
    out = [f"### CPU latency, CPU class `{cls}`", ""]
    if rec is None:
        return "\n".join(out + [missing])
    shape = rec.get("shape", {})
    out += [
        f"From `benchmarks/cpu_latency.py` → `benchmarks/results/{name}`; "
        f"{_machine(rec)}, torchao {rec.get('torchao', '?')}.",
        "",
        f"Model: `{shape.get('name', '?')}` (LayerNorm → Linear(D, {shape.get('ffn', '?')}) → "
        f"GELU → Linear → residual, D={shape.get('d_model', '?')}, {shape.get('layers', '?')} "
        "blocks, fp32). Speed-up vs fp32 Inductor at the same M, from medians and from minima, "
        "measured side by side (interleaved rounds) on a shared machine: quote the ratios, not "
        "the milliseconds (in brackets: vs bf16 Inductor, where measured). "
        "rel. err = ‖y − y_fp32‖ / ‖y_fp32‖.",
        "",
    ]
    png = Path(name).with_suffix(".png").name
    if (RESULTS / png).exists():
        out += [f"![CPU latency chart, {cls}](benchmarks/results/{png})", ""]
    ms = rec.get("M") or sorted({r.get("M") for r in rec.get("results", [])})
    by: dict[str, dict] = {}
    for r in rec.get("results", []):
        by.setdefault(r.get("candidate", "?"), {})[r.get("M")] = r
    rows = []
    for cand, per_m in by.items():
        cells = [cand]
        for m in ms:
            r = per_m.get(m)
            ok = r is not None and r.get("status") == "ok"
            if not ok:
                cells.append("–")
                continue
            # median-based / min-based: under load the median of the slower fp32 baseline
            # inflates the first; the second is the conservative figure
            med = _f(r.get("speedup_vs_fp32_inductor"), ".2f")
            low = _f(r.get("speedup_of_min_vs_fp32_inductor"), ".2f")
            bf16 = r.get("speedup_vs_bf16_inductor")
            cells.append(f"{med}× / {low}×" + ("" if bf16 is None else f" ({bf16:.2f}×)"))
        errs = [r.get("rel_err_vs_fp32_eager") for r in per_m.values() if r.get("status") == "ok"]
        cells.append(_f(max(errs), ".1e") if errs else "–")
        sizes = [r.get("artifact_bytes") for r in per_m.values() if r.get("artifact_bytes")]
        cells.append(_f(sizes[0] / 2**20, ".1f") if sizes else "–")
        rows.append(cells)
    head = ["candidate", *[f"M={m} median / min" for m in ms], "rel. err", "package MiB"]
    out += [_table(head, rows), ""]
    bad = {r["candidate"]: r["status"] for r in rec.get("results", []) if r.get("status") != "ok"}
    if bad:
        out += ["Not measured:", "", *[f"- {k}: {v}" for k, v in bad.items()], ""]
    for c in rec.get("versus_quantize_dynamic", []):
        out.append(
            f"- M = {c['M']}: {c['fxquant']} runs {c['speed_ratio']:.2f}× the speed of "
            f"`quantize_dynamic` (rel. err {c['rel_err']:.1e} vs "
            f"{c['quantize_dynamic_rel_err']:.1e})"
        )
    return "\n".join(out).rstrip()


def fp8_training_section() -> str:
    how = "python benchmarks/fp8_training.py"
    rec, missing = _load("fp8_training.json", how)
    out = ["### FP8 training on the CPU (emulated GEMMs)", ""]
    if rec is None:
        return "\n".join(out + [missing])
    m = rec.get("model", {})
    out += [
        f"From `{how}` → `benchmarks/results/fp8_training.json`; {_machine(rec)}.",
        "",
        f"A Llama-shaped decoder (d={m.get('d')}, {m.get('layers')} layers), {rec.get('steps')} "
        f"AdamW steps, batch {m.get('batch')}×{m.get('seq')} tokens, the same data and weights "
        "for every row. **FP8 GEMMs are emulated in fp32 here: slower than fp32 by "
        "construction**; the point is that the loss follows fp32. Step time is the median after "
        "the first (compiling) step.",
        "",
    ]
    rows = [
        [
            r["name"],
            _f(r.get("first_step_s"), ".0f"),
            _f(r.get("median_step_ms"), ".0f"),
            _f(r.get("step_time_vs_fp32_inductor"), ".2f"),
            _f(r.get("loss_last10"), ".3f"),
            _f(r.get("loss_gap_vs_fp32"), "+.3f"),
        ]
        for r in rec.get("results", [])
    ]
    head = ["row", "first step s", "ms/step", "× fp32 Inductor time", "loss (last 10)", "vs fp32"]
    out += [_table(head, rows)]
    return "\n".join(out)


def gpu_section() -> str:
    how = "bash benchmarks/gpu/run.sh"
    path = RESULTS / "gpu" / "gpu.json"
    out = ["### GPU (Triton kernels)", ""]
    if not path.exists():
        return "\n".join(
            out
            + [
                "_No complete run yet. The first lent H200 (2026-12-04, one call cut by its "
                "timeout: `benchmarks/results/gpu/h200_2026-12-04.md`) found every kernel "
                "correct and every recipe slower than bf16 (0.01-0.26× below M = 2048, eager "
                "times dominated by ~80-200 µs of host overhead per op; 0.15-0.61× at M = 2048), "
                "and lost the FP8 training, stack and decode sections; benchmarks/README.md says "
                f"what changed from it. `{how}` writes `benchmarks/results/gpu/gpu.json`._"
            ]
        )
    rec, missing = _load("gpu/gpu.json", how)
    if rec is None:
        return "\n".join(out + [missing])
    out += [
        f"From `{how}` → `benchmarks/results/gpu/gpu.json`; {rec.get('device', '?')}, "
        f"{rec.get('date', '?')[:10]}, "
        + ", ".join(f"{k} {v}" for k, v in rec.get("versions", {}).items()),
        "",
    ]
    rows = []
    for t in rec.get("targets", []):
        v = t.get("measured_median_over_shapes")
        met = t.get("met")
        rows.append(
            [
                t["target"],
                f"≥ {t['at_least']}",
                _f(v, ".2f"),
                "–" if met is None else "yes" if met else "**no**",
            ]
        )
    out += [_table(["target", "goal", "measured", "met"], rows, "lrrl"), ""]
    fp8 = (rec.get("fp8_training") or {}).get("rows") or []
    if fp8:
        out += [
            "FP8 training, one Llama-3-8B block (sequence 4096, forward + backward, real "
            "`_scaled_mm` GEMMs), step time against bf16 Inductor:",
            "",
        ]
        rows = [
            [
                r["recipe"],
                str(r["batch"]),
                f"failed: {r['error'].strip()[:60]}" if r.get("error") else _f(r["step_ms"], ".2f"),
                _f(r.get("speedup_vs_bf16"), ".2f"),
                _f(
                    r.get("loss_max_rel_gap_vs_bf16") and 100 * r["loss_max_rel_gap_vs_bf16"], ".2f"
                ),
            ]
            for r in fp8
        ]
        out += [_table(["recipe", "batch", "ms/step", "× bf16", "loss gap %"], rows), ""]
    experts = rec.get("experts") or []
    if experts:
        out += ["Experts (gpt-oss-20b shapes) against bf16 `torch._grouped_mm`:", ""]
        rows = [
            [
                f"{r.get('format', 'mxfp4')} {r['shape']}",
                str(r["tokens"]),
                _f(r.get("graph_ms", r.get("ms")), ".3f"),
                _f(r.get("graph_speedup_vs_bf16", r.get("speedup_vs_bf16")), ".2f"),
            ]
            for r in experts
            if not r.get("error")
        ]
        out += [_table(["shape", "tokens", "ms", "× bf16"], rows), ""]
    return "\n".join(out).rstrip()


def demo_section() -> str:
    how = "fxquant demo --json benchmarks/results/demo.json"
    rec, missing = _load("demo.json", how)
    out = ["### End-to-end demo (SmolLM2 with its KV cache, AOTInductor packages)", ""]
    if rec is None:
        return "\n".join(out + [missing])
    out += [
        f"From `{how}` → `benchmarks/results/demo.json`; {_machine(rec)}.",
        "",
        f"Each variant is an AOTInductor package of the `fxquant.export_llm` program "
        f"(max_cache_len {rec.get('max_cache_len', '?')}). Perplexity on the first "
        f"{rec.get('perplexity_tokens', '?')} Lee tokens (512-token windows, prefilled through "
        f"the package); prefill: {rec.get('prompt_tokens', '?')} tokens in one call; decode: "
        f"{rec.get('decode_new_tokens', '?')} tokens one call each (M = 1), median step. "
        "Top-1: steps whose next token equals fp32's, each fed fp32's tokens; same greedy: "
        "leading tokens equal to fp32's. One run, not interleaved: the ratios move by tens of "
        "percent between runs on these shared cores (`benchmarks/llm_decode.py` measures side "
        "by side).",
        "",
    ]
    rows_in = rec.get("rows") or []
    base = next((r for r in rows_in if r.get("name") == "fp32" and not r.get("error")), None)

    def ratio(r: dict, key: str) -> str:
        if base is None or not r.get(key) or not base.get(key):
            return "–"
        return f"{r[key] / base[key]:.2f}×"

    rows = []
    for r in rows_in:
        if r.get("error"):
            rows.append([r.get("name", "?"), f"failed: {r['error'][:80]}", *["–"] * 6])
            continue
        mb: Callable[[int | None], str] = lambda n: _f(n and n / 2**20, ".0f")  # noqa: E731
        agree = r.get("top1_agreement")
        rows.append(
            [
                r.get("name", "?"),
                mb(r.get("package_bytes")),
                _f(r.get("ppl"), ".2f"),
                f"{_f(r.get('prefill_tokens_per_s'), '.0f')} ({ratio(r, 'prefill_tokens_per_s')})",
                f"{_f(r.get('decode_tokens_per_s'), '.1f')} ({ratio(r, 'decode_tokens_per_s')})",
                "–" if agree is None else f"{agree:.0%}",
                _f(r.get("greedy_same_as_fp32"), "d"),
            ]
        )
    head = ["variant", "MiB", "ppl", "prefill tok/s", "decode tok/s", "top-1", "same greedy"]
    out += [_table(head, rows), ""]
    return "\n".join(out).rstrip()


def llm_decode_section() -> str:
    """One table per machine class the script ran on: ``llm_decode.json`` and each
    ``llm_decode_<machine>.json`` (``--out``), newest machine file last."""
    title = "### LLM decode with a KV cache on the CPU: fxquant, fp32, torchao, llama.cpp"
    names = ["llm_decode.json", *sorted(p.name for p in RESULTS.glob("llm_decode_*.json"))]
    parts = [_llm_decode_run(name) for name in names]
    return "\n\n".join([title, *parts])


def _llm_decode_run(name: str) -> str:
    how = "python benchmarks/llm_decode.py"
    rec, missing = _load(name, how)
    out = []
    if rec is None:
        return missing
    if rec.get("argv"):  # recorded from 2026-12-05 on
        how = " ".join([how, *(a if " " not in a else repr(a) for a in rec["argv"])])
    vs = rec.get("versions", {})
    m = rec.get("machine", {})
    last = rec.get("logits") == "last"
    dtypes = rec.get("dtypes", ["fp32"])
    more = [d for d in dtypes if d != "fp32"]
    out += [
        f"#### {m.get('cpu_model', '?')}, {m.get('cpu_capability', '?')}"
        + (", prefill returning the last position's logits" if last else "")
        + (f", {' and '.join(dtypes)} models" if more else ""),
        "",
        f"From `{how}` → `benchmarks/results/{name}`; {_machine(rec)}"
        + ("." if vs.get("torchao") else ", torchao not installed."),
        "",
        *([rec["note"], ""] if rec.get("note") else []),  # what the run was for (--note)
        f"SmolLM2-135M, {' and '.join(dtypes)} weights before quantization, batch 1: a "
        f"{rec.get('prompt_tokens', '?')}-token prompt prefilled in one call, then "
        f"{rec.get('new_tokens', '?')} tokens one call each with the KV cache in the program "
        f"(max_cache_len {rec.get('max_cache_len', '?')}"
        + (
            "; every program returns the last position's logits, so a prefill runs the LM head "
            "on one row, as llama.cpp's does"
            if last
            else "; every program returns every position's logits"
        )
        + "). Every round runs every candidate "
        f"({rec.get('rounds', '?')} rounds; decode: 1 / median step); × is vs fp32 Inductor in "
        "the same run. "
        + (
            "llama.cpp: `llama-bench` on the same GGUF (Q4_1 as shipped, its output matrix Q8_0; "
            "Q8_0 and F32 made with its `llama-quantize`), the mean of a run before and after "
            "the rounds. "
            if rec.get("llama_cpp")
            else "llama.cpp was not run (`--no-llama-cpp`): no peer row in this run. "
        )
        + (
            f"Rows suffixed {' / '.join(more)}: the model loaded in that dtype, then exported, "
            "quantized and packaged (`fxquant generate --dtype`); × own: against the Inductor "
            "row of the row's own dtype. "
            if more
            else ""
        )
        + "Top-1: decode steps whose argmax equals fp32 eager's (teacher "
        f"forced). GB/s: bytes a decode step reads × tok/s (copy bandwidth here: "
        f"{_f(rec.get('copy_bandwidth_gbs'), '.1f')} GB/s).",
        "",
    ]
    chart = Path(name).with_suffix(".png").name
    if (RESULTS / chart).exists():
        out += [f"![LLM decode chart](benchmarks/results/{chart})", ""]
    rows = []
    for r in rec.get("results", []):
        if r.get("status") != "ok":
            rows.append([r.get("candidate", "?"), r.get("status", "?")[:70], *["–"] * 5])
            rows[-1] += ["–"] if more else []
            continue
        size = r.get("package_bytes")
        agree = r.get("top1_agreement")
        own = [_f(r.get("decode_speedup_vs_own_dtype_inductor"), ".2f")] if more else []
        rows.append(
            [
                r["candidate"],
                f"{_f(r.get('decode_tokens_per_s'), '.1f')} "
                f"({_f(r.get('decode_speedup_vs_fp32_inductor'), '.2f')}×)",
                *own,
                f"{_f(r.get('prefill_tokens_per_s'), '.0f')} "
                f"({_f(r.get('prefill_speedup_vs_fp32_inductor'), '.2f')}×)",
                "–" if agree is None else f"{agree:.0%}",
                _f(size and size / 2**20, ".0f"),
                _f(r.get("effective_gbs"), ".1f"),
                _f(r.get("build_s"), ".0f"),
            ]
        )
    head = ["candidate", "decode tok/s", *(["× own"] if more else []), "prefill tok/s", "top-1"]
    head += ["MiB", "GB/s", "build s"]
    out += [_table(head, rows), ""]
    for width, p in rec.get("parity", {}).items():
        out.append(
            f"- Best {width} decode: {p['fxquant']} {_f(p['decode_tokens_per_s'], '.1f')} tok/s, "
            f"{_f(p['ratio'], '.2f')}× {p['llama_cpp']} "
            f"({_f(p['llama_cpp_decode_tokens_per_s'], '.1f')} tok/s) in the same run."
        )
    return "\n".join(out).rstrip()


def hf_generate_section() -> str:
    """``hf_generate.json`` (the default 2048-position cache) and each ``hf_generate_*.json``
    (``--out``: other cache lengths), one table each."""
    title = '### Hugging Face `generate` under `torch.compile(backend="fxquant")`'
    names = ["hf_generate.json", *sorted(p.name for p in RESULTS.glob("hf_generate_*.json"))]
    return "\n\n".join([title, *(_hf_generate_run(name) for name in names)])


def _hf_generate_recipes(rec: dict) -> str:
    """The run's ``--recipes``, from its backend rows' names (hf_generate.py's ``_row_name``)."""
    out = []
    for r in rec.get("results", []):
        name = r.get("candidate", "")
        if name == "fxquant backend, nothing quantized":
            out.append("none")
        elif name.startswith("fxquant ") and name.endswith(" backend"):
            out.append(name.removeprefix("fxquant ").removesuffix(" backend"))
    return ",".join(out)


def _hf_generate_run(name: str) -> str:
    how = "python benchmarks/hf_generate.py"
    rec, missing = _load(name, how)
    if rec is None:
        return missing
    dtype = rec.get("dtype", "fp32")
    if rec.get("max_cache_len", 2048) != 2048:
        how += f" --max-cache-len {rec['max_cache_len']}"
    if dtype != "fp32":
        how += f" --dtype {dtype}"
    recipes = _hf_generate_recipes(rec)
    if recipes != "none,int8wo+lm_head,w8a8+lm_head,w4a8-64+lm_head=w8a8":  # the script's default
        how += f" --recipes {recipes}"
    if name != "hf_generate.json":
        how += f" --out benchmarks/results/{name}"
    out = [
        f"#### Static cache of {rec.get('max_cache_len', '?')} positions, {dtype} model",
        "",
        f"From `{how}` → `benchmarks/results/{name}`; {_machine(rec)}.",
        "",
        f"SmolLM2-135M, {dtype} weights before quantization, batch 1, transformers' own "
        f"`model.generate` with a static cache of {rec.get('max_cache_len', '?')} positions, "
        f"greedy, a {rec.get('prompt_tokens', '?')}-token prompt. Decode: (a generate of "
        f"{2 + rec.get('new_tokens_timed', 0)} new tokens - one of 2) / "
        f"{rec.get('new_tokens_timed', '?')}, medians of {rec.get('rounds', '?')} interleaved "
        f"rounds: transformers' Python between steps included. × is vs {dtype} Inductor "
        "(`torch.compile(model.forward)`) in the same run; every compiled row without module "
        f"guards (docs/llm.md). Greedy: leading new tokens equal to {dtype} eager's.",
        "",
    ]
    rows = [
        [
            r["candidate"],
            f"{_f(r.get('decode_ms'), '.2f')}",
            f"{_f(r.get('decode_tokens_per_s'), '.1f')} "
            f"({_f(r.get('decode_speedup_vs_baseline'), '.2f')}×)",
            f"{r.get('greedy_agree', '–')}",
            _f(r.get("build_s"), ".0f"),
        ]
        for r in rec.get("results", [])
    ]
    head = ["candidate", "decode ms", "decode tok/s", "greedy", "ready s"]
    return "\n".join([*out, _table(head, rows)])


def _rate(row: dict, phase: str, spec: str) -> str:
    ratio = _f(row.get(f"{phase}_speedup_vs_fp32_inductor"), ".2f")
    return f"{_f(row.get(f'{phase}_tok_s'), spec)} ({ratio}×)"


def moe_decode_section(arch: str = "qwen2_moe") -> str:
    llama4 = arch == "llama4"
    title = "### A mixture-of-experts LLM with int8, int4, W8A8 and fp8 experts (CPU)"
    if llama4:
        title = (
            "### Llama 4's experts (every token through every expert): int8, int4, W8A8, fp8 (CPU)"
        )
    how = "python benchmarks/moe_decode.py" + (" --arch llama4" if llama4 else "")
    file = "moe_decode_llama4.json" if llama4 else "moe_decode.json"
    rec, missing = _load(file, how)
    if rec is None:
        return "\n\n".join([title, missing])
    m, p = rec.get("model", {}), rec.get("prompt_tokens", "?")
    experts = m.get("num_experts", m.get("num_local_experts", "?"))
    width = m.get("moe_intermediate_size", m.get("intermediate_size", "?"))
    out = [
        title,
        "",
        f"From `{how}` → `benchmarks/results/{file}`; {_machine(rec)}.",
        "",
        f"{m.get('architecture', '?')}: {m.get('num_hidden_layers', '?')} layers, hidden "
        f"{m.get('hidden_size', '?')}, {experts} experts {width} wide "
        f"(top-{m.get('num_experts_per_tok', '?')})"
        f" and a shared one, fp32, batch 1, `export_llm` program. Decode: one step at position "
        f"{p}; prefill: {p} tokens; medians "
        f"of {rec.get('rounds', '?')} interleaved rounds, × vs fp32 Inductor in the same run. MB: "
        "weights but the embedding table. SQNR: last-position logits vs the fp32 program (random "
        "weights: a sanity check, not an accuracy figure).",
        "",
    ]
    rows = [
        [
            name,
            _f(r.get("weight_mb"), ".0f"),
            _rate(r, "decode", ".1f"),
            _rate(r, "prefill", ".0f"),
            _f(r.get("last_logits_sqnr_db"), ".1f"),
        ]
        for name, r in rec.get("rows", {}).items()
    ]
    out.append(_table(["row", "MB", "decode tok/s", "prefill tok/s", "SQNR dB"], rows))
    for name, why in rec.get("skipped", {}).items():
        out += ["", f"{name}: {why}"]
    return "\n".join(out)


def bridge_moe_section() -> str:
    title = "### A mixture-of-experts model quantized by the `from_pretrained` bridge (CPU)"
    how = "python benchmarks/bridge_moe.py"
    rec, missing = _load("bridge_moe.json", how)
    if rec is None:
        return "\n\n".join([title, missing])
    t = rec.get("prefill_tokens", "?")
    out = [
        title,
        "",
        f"From `{how}` → `benchmarks/results/bridge_moe.json`; {_machine(rec)}.",
        "",
        f"`moe_decode.py`'s Qwen2-MoE-shaped model ({rec.get('model', '?')}), random weights, "
        "fp32, loaded by `from_pretrained` as it is and with `FxquantHfConfig(recipe)` (linears "
        "and routed experts quantized; routers and head float). One forward without a cache, "
        f"{t} tokens and 1; medians of {rec.get('rounds', '?')} interleaved rounds, × vs "
        f"{rec.get('baseline', 'float Inductor')} in the same run. Eager rows run each op on "
        'the CPU lowering\'s kernels (`fxquant.passes.eager`), "reference math" rows under '
        '`reference_math()`; the backend rows (`torch.compile(backend="fxquant")`, quantizing '
        'nothing more) compile around the same kernels, and so do the "torch.compile" rows '
        "(the default backend, on fxquant's decompositions: `fxquant.passes.stock`); their "
        '"reference ops" rows compile without those (each op its reference, as before '
        "2026-12-07). MB: parameters and buffers.",
        "",
    ]
    rows = [
        [
            name,
            _f(r.get("weight_bytes") and r["weight_bytes"] / 1e6, ".0f"),
            f"{_f(r.get('prefill_ms'), '.1f')} ({_f(r.get('prefill_x'), '.2f')}×)",
            f"{_f(r.get('decode_ms'), '.2f')} ({_f(r.get('decode_x'), '.2f')}×)",
        ]
        for name, r in rec.get("rows", {}).items()
    ]
    out.append(_table(["row", "MB", f"{t} tokens, ms", "1 token, ms"], rows))
    return "\n".join(out)


def bridge_generate_section() -> str:
    """``bridge_generate.json`` (fp32) and each ``bridge_generate_*.json`` (``--dtype``, ``--out``),
    one table each."""
    title = "### `from_pretrained` with `FxquantHfConfig`, generating eagerly and compiled (CPU)"
    names = [
        "bridge_generate.json",
        *sorted(p.name for p in RESULTS.glob("bridge_generate_*.json")),
    ]
    return "\n\n".join([title, *(_bridge_generate_run(name) for name in names)])


def _bridge_generate_run(name: str) -> str:
    how = "python benchmarks/bridge_generate.py"
    rec, missing = _load(name, how)
    if rec is None:
        return missing
    dtype = rec.get("dtype", "fp32")
    compiled = rec.get("compiled", False)
    if dtype != "fp32":
        how += f" --dtype {dtype}"
    if compiled:
        how += " --compile"
    if name != "bridge_generate.json":
        how += f" --out benchmarks/results/{name}"
    k = rec.get("new_tokens_timed", 0)
    baseline = rec.get("baseline", f"{dtype} eager")
    if compiled:
        run = (
            "every row under plain `torch.compile(model.forward)` (Inductor, the default "
            f"backend; no guards on the modules), `model.generate` with a static cache of "
            f"{rec.get('max_cache_len', '?')} positions"
        )
        rows_say = (
            "Bridge rows compile their ops onto the CPU lowering's kernels "
            "(`fxquant.passes.stock`); no reference rows (`bridge_moe.py` has compiled ones). "
            "torchao rows: `TorchAoConfig` through the same `from_pretrained`, compiled the same "
            "way."
        )
    else:
        run = "`model.generate` with transformers' default cache, nothing compiled"
        rows_say = (
            "Bridge rows run their ops on the CPU lowering's kernels (`fxquant.passes.eager`); "
            '"reference math" rows the same model under `reference_math()`, as every bridged '
            "model ran before 2026-12-07. torchao rows: `TorchAoConfig` through the same "
            "`from_pretrained`."
        )
    held, held_api = ("eager kernels", "EagerKernels.extra_bytes")
    if compiled:
        held, held_api = ("`stock_*` ops", "fxquant.passes.stock.held_bytes")
    out = [
        f"#### {dtype} model{', compiled' if compiled else ''}",
        "",
        f"From `{how}` → `benchmarks/results/{name}`; {_machine(rec)}.",
        "",
        f"SmolLM2-135M saved and loaded back by `from_pretrained` in {dtype}, float and "
        f"quantized at load time, batch 1, {run}, greedy, a {rec.get('prompt_tokens', '?')}-"
        f"token prompt. Decode: (a generate of {2 + k} new tokens - one of 2) / {k}, medians "
        f"of {rec.get('rounds', '?')} interleaved rounds; × is vs {baseline} (the model the "
        f"quantized ones replace) in the same run. {rows_say} Greedy: leading new tokens equal "
        f"to {baseline}'s. MB: the state dict as `torch.save` writes it; +MB: what the "
        f"{held} hold beside it (prepacked weights, `{held_api}`).",
        "",
    ]
    rows = [
        [
            r["candidate"],
            _f(r.get("state_bytes") and r["state_bytes"] / 1e6, ".0f"),
            _f(r.get("eager_kernel_bytes", 0) / 1e6, ".0f"),
            _f(r.get("decode_ms"), ".2f"),
            f"{_f(r.get('decode_tokens_per_s'), '.1f')} "
            f"({_f(r.get('decode_speedup_vs_baseline'), '.2f')}×)",
            f"{r.get('greedy_agree', '–')}/{2 + k}",
        ]
        for r in rec.get("results", [])
    ]
    head = ["candidate", "MB", "+MB", "decode ms", "decode tok/s", "greedy"]
    return "\n".join([*out, _table(head, rows)])


def build_block() -> str:
    parts = [
        "_Generated by `python benchmarks/report.py` from `benchmarks/results/*.json`; "
        "do not edit by hand. How each script measures, and how to rerun it: "
        "[benchmarks/README.md](benchmarks/README.md)._",
        accuracy_section(),
        llm_decode_section(),
        hf_generate_section(),
        moe_decode_section(),
        moe_decode_section("llama4"),
        bridge_generate_section(),
        bridge_moe_section(),
        latency_section(),
        demo_section(),
        fp8_training_section(),
        gpu_section(),
    ]
    return "\n\n".join(parts)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--readme", type=Path, default=ROOT / "README.md")
    ap.add_argument("--stdout", action="store_true", help="print the block, change nothing")
    args = ap.parse_args()
    block = build_block()
    text = args.readme.read_text()
    if args.stdout:
        print(block)
        return 0
    if START not in text or END not in text or text.index(START) > text.index(END):
        print(block)
        print(
            f"\n{args.readme} has no `{START}` ... `{END}` markers: the block above was NOT "
            "written. Add the markers where the results belong and rerun.",
            file=sys.stderr,
        )
        return 1
    head, rest = text.split(START, 1)
    _, tail = rest.split(END, 1)
    new = f"{head}{START}\n{block}\n{END}{tail}"
    if new != text:
        args.readme.write_text(new)
        print(f"rewrote the results section of {args.readme}")
    else:
        print(f"{args.readme}: results section already up to date")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
