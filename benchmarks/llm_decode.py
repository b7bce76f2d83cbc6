"""How fast does a quantized LLM decode on this CPU, with a KV cache, next to what CPU users run?

SmolLM2-135M (real weights, ``fxquant.assets``), fp32, batch 1: a 128-token prompt (the start of
``lee.cor``, held-out text) prefilled in one call, then 64 new tokens one call each (M = 1, the
cache in the program). Rows, measured side by side in one run:

- fp32: eager (transformers + ``fxquant.llm.CachedCausalLM``), Inductor (``torch.compile`` of
  the ``fxquant.export_llm`` program: the baseline every ratio is relative to), AOTInductor
  (the same program packaged by fxquant: its linears on fxquant's native fp32 kernel where the
  native kernels build, ``passes/cpu/float32.py``; a float model packaged by fxquant).
- fxquant per recipe: the AOTInductor package (``fxquant.packages``: export_llm → quantize →
  aot_compile, built side by side, one process each, cached in ~/.cache/fxquant/packages) and
  ``torch.compile(CachedCausalLM(model), backend="fxquant")``.
- peers: torchao ``Int8WeightOnlyConfig`` and ``Int8DynamicActivationInt8WeightConfig`` under
  ``torch.compile`` on the same static-cache model (when torchao imports),
  ``torch.ao.quantization.quantize_dynamic`` (eager fbgemm, every Linear but lm_head), and
  **llama.cpp** ``llama-bench -t <cores>`` on the same SmolLM2 GGUF: its shipped Q4_1 (output
  matrix Q8_0) and Q8_0 / F32 files made with its own ``llama-quantize``. llama.cpp is built by
  ``benchmarks/setup_llama_cpp.sh`` (once, 10-20 min, cached outside the repo); on AMX Xeons it
  runs with ``--repack 0`` (its AMX repack path crashed there), recorded in the JSON.

``--dtypes fp32,bf16`` adds the model in bf16 (what ``from_pretrained`` gives for most
checkpoints; ``fxquant generate --dtype bf16``): bf16 Inductor and AOTInductor rows, and every
recipe's package (and backend row, and torchao's rows) built from the bf16 model, named with a
``bf16`` suffix; ratios stay against fp32 Inductor, and ``*_speedup_vs_own_dtype_inductor`` puts
each row beside the Inductor row of its own dtype. ``quantize_dynamic`` runs in fp32 only (fbgemm
takes fp32 activations).

Timing: every round runs every candidate (prefill, then the 64 decode steps), so load from
other processes on the shared cores hits all alike; decode tok/s = 1 / median step, prefill
tok/s = 128 / median prefill (three prefills a round: one 0.3-s call is noisier than 63 steps).
The timed steps feed every candidate fp32 eager's greedy tokens (teacher forcing: identical
work per step); "top-1" is the share of steps whose argmax equals fp32's, "greedy" the leading
tokens a free-running greedy decode shares with fp32 eager.
llama-bench runs before and after the rounds (``-r 3`` each); the table gives the mean of the
two. Per AOTInductor row: bytes read per decode step (weights but the embedding table, plus the
KV cache at the mean position), the effective bandwidth that implies, and the time left after
streaming those bytes at the measured copy bandwidth of this machine (``overhead ms``: kernel
launches, attention, norms, the package call); the sampler/tokenizer cost per token of
``fxquant.generate`` is measured separately.

    bash benchmarks/setup_llama_cpp.sh                  # once: llama-bench, llama-quantize
    python benchmarks/llm_decode.py                     # everything (~30 min on 2 cores, cold)
    python benchmarks/llm_decode.py --quick             # the lm_head recipes, fp32, llama.cpp

Writes results/llm_decode.json and .png. The issue's targets are printed beside the measured
ratios, never asserted; ``parity`` in the JSON puts fxquant's fastest int8 row (int8wo, w8a8)
beside llama.cpp Q8_0 and its fastest 4-bit row (int4wo, w4a8) beside Q4_1.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
from machine import machine_info, own_forward, write_results

import fxquant
from fxquant import assets
from fxquant.llm import CachedCausalLM, llm_info
from fxquant.packages import DTYPES, build_packages, load_tokenizer
from fxquant.runtime import LLMPackage

HERE = Path(__file__).resolve().parent
RECIPES = (
    "int8wo",
    "int8wo+lm_head",
    "int4wo-64",
    "int4wo-64+lm_head=int8wo",
    "w8a8+lm_head",
    "w4a8-64+lm_head=w8a8",
    "fp8-row",
)
QUICK = ("int8wo+lm_head", "w8a8+lm_head", "int4wo-64+lm_head=int8wo", "w4a8-64+lm_head=w8a8")
BACKEND = ("int8wo+lm_head", "int4wo-64+lm_head=int8wo", "w8a8+lm_head", "w4a8-64+lm_head=w8a8")
BASELINE = "fp32 inductor"
# decode ratio targets vs fp32 Inductor (issue 14), by recipe family
TARGETS = {"int8wo": 2.2, "int4wo-64": 3.0}
# the llama.cpp parity targets: fxquant's best row of each width against this llama.cpp file
PARITY = {"int8": ("Q8_0", ("int8wo", "w8a8")), "4-bit": ("Q4_1", ("int4wo", "w4a8"))}
LLAMA_FILES = {"Q4_1": None, "Q8_0": "smollm2-Q8_0.gguf", "F32": "smollm2-F32.gguf"}
PREFILLS_PER_ROUND = 3
SKIP_MODULE_GUARDS = torch.compiler.skip_guard_on_all_nn_modules_unsafe


Step = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]  # (ids [1, T], pos [T]) → logits


# ------------------------------------------------------------------------------- candidates


def _no_grad(f: Callable) -> Step:
    def call(ids, pos):
        with torch.no_grad():
            out = f(ids, pos)
        return out[0] if isinstance(out, (list, tuple)) else out

    return call


def _warm(step: Step, prompt: torch.Tensor) -> float:
    t0 = time.perf_counter()
    step(prompt, torch.arange(prompt.shape[1]))
    step(prompt[:, :1], torch.tensor([prompt.shape[1]]))
    step(prompt[:, :1], torch.tensor([prompt.shape[1] + 1]))
    return time.perf_counter() - t0


def _compiled(module, prompt, *, options: dict | None = None, **kwargs) -> tuple[Step, float]:
    """Every ``torch.compile`` row (fp32 Inductor, the backend, torchao) with the settings
    docs/llm.md gives for a generation loop: each model its own ``forward`` (machine.py), the
    attended length captured (``.item()`` in the graph, not a break) and no guards on the
    modules (their attributes and parameters never change between steps; Dynamo's guards on
    SmolLM2's ~360 tensors and its cache layers cost ~1 ms a step, measured with the backend)."""
    torch._dynamo.config.capture_scalar_outputs = True
    options = {**(options or {}), "guard_filter_fn": SKIP_MODULE_GUARDS}
    fn = _no_grad(torch.compile(own_forward(module), options=options, **kwargs))
    return fn, _warm(fn, prompt)


def build_fp32_eager(model, program, prompt, cache_len):
    return _no_grad(CachedCausalLM(model, max_cache_len=cache_len).eval()), 0.0, "eager"


def build_inductor(model, program, prompt, cache_len):
    fn, s = _compiled(program.module(), prompt)
    return fn, s, "torch.compile of the export_llm program"


def build_backend(recipe: str):
    def build(model, program, prompt, cache_len):
        wrapper = CachedCausalLM(model, max_cache_len=cache_len).eval()
        fn, s = _compiled(wrapper, prompt, backend="fxquant", options={"config": recipe})
        return fn, s, "torch.compile(backend='fxquant')"

    return build


def torchao_status() -> str | None:
    """None when torchao's int8 configs import, else why not."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            from torchao.quantization import quantize_  # noqa: F401
    except Exception as e:  # noqa: BLE001 - an absent or broken install is data too
        return f"skipped: torchao unavailable ({type(e).__name__}: {str(e)[:120]})"
    return None


def build_torchao(config_name: str):
    def build(model, program, prompt, cache_len):
        import torchao
        import torchao.quantization as tq

        q = copy.deepcopy(model)
        t0 = time.perf_counter()
        tq.quantize_(q, getattr(tq, config_name)())  # torchao's default filter: every Linear
        quantize_s = time.perf_counter() - t0
        fn, s = _compiled(CachedCausalLM(q, max_cache_len=cache_len).eval(), prompt)
        return fn, s + quantize_s, f"torchao {torchao.__version__} quantize_ + torch.compile"

    return build


def build_quantize_dynamic(model, program, prompt, cache_len):
    q = copy.deepcopy(model)
    lm_head = q.lm_head
    torch.ao.quantization.quantize_dynamic(q, {torch.nn.Linear}, dtype=torch.qint8, inplace=True)
    q.lm_head = lm_head  # every Linear but lm_head, as fxquant's default
    return _no_grad(CachedCausalLM(q, max_cache_len=cache_len).eval()), 0.0, "eager fbgemm"


def build_package(path: Path):
    def build(model, program, prompt, cache_len):
        pkg = LLMPackage(path)
        return _no_grad(pkg), 0.0, "AOTInductor package"

    return build


# ------------------------------------------------------------------------------- llama.cpp


def llama_cpp_bin() -> Path | None:
    root = Path(os.environ.get("FXQUANT_LLAMA_CPP", Path.home() / ".cache/fxquant/llama.cpp"))
    b = root / "build" / "bin"
    return b if (b / "llama-bench").exists() and (b / "llama-quantize").exists() else None


def llama_cpp_models(bin_dir: Path) -> dict[str, Path]:
    """The shipped Q4_1 file and Q8_0 / F32 made from it with llama.cpp's own llama-quantize."""
    shipped = assets.smollm2_gguf()
    out_dir = bin_dir.parent.parent.parent / "gguf"
    out_dir.mkdir(parents=True, exist_ok=True)
    models = {}
    for kind, name in LLAMA_FILES.items():
        if name is None:
            models[kind] = shipped
            continue
        path = out_dir / name
        if not path.exists():
            cmd = [
                str(bin_dir / "llama-quantize"),
                "--allow-requantize",
                str(shipped),
                str(path),
                kind,
            ]
            subprocess.run(cmd, check=True, capture_output=True)
        models[kind] = path
    return models


def _amx() -> bool:
    try:
        return "amx_tile" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def run_llama_bench(bin_dir: Path, models: dict[str, Path], prompt: int, new: int) -> dict:
    threads = os.cpu_count() or 1
    cmd = [
        str(bin_dir / "llama-bench"),
        "-t",
        str(threads),
        "-p",
        str(prompt),
        "-n",
        str(new),
        "-r",
        "3",
        "-o",
        "json",
    ]
    if _amx():
        cmd += ["--repack", "0"]
    for m in models.values():
        cmd += ["-m", str(m)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=900)
    res: dict[str, dict] = {}
    by_path = {str(p): k for k, p in models.items()}
    for r in json.loads(out.stdout):
        kind = by_path.get(r.get("model_filename"), r.get("model_type"))
        phase = "decode" if r["n_gen"] else "prefill"
        res.setdefault(kind, {})[phase] = {"tokens_per_s": r["avg_ts"], "stddev": r["stddev_ts"]}
        res[kind]["build"] = r.get("build_commit")
    return {"threads": threads, "repack0": _amx(), "command": " ".join(cmd), "results": res}


# ------------------------------------------------------------------------------- measuring


def copy_bandwidth_gbs() -> float:
    """A streaming read of 256 MiB with all threads (an fp32 sum, vectorized by ATen): about
    what the cores can pull from memory."""
    t = torch.ones(64 * 2**20, dtype=torch.float32)
    t.sum()
    times = []
    for _ in range(5):
        t0 = time.perf_counter()
        t.sum()
        times.append(time.perf_counter() - t0)
    return t.nbytes / min(times) / 1e9


def run(args) -> dict:
    t_start = time.perf_counter()
    torch.manual_seed(0)
    model, _ = assets.load_smollm2()
    source = assets.smollm2_gguf()
    tokenizer = load_tokenizer(source)
    ids = tokenizer(assets.lee_text("test")).input_ids
    prompt = torch.tensor([ids[: args.prompt]])
    cache_len = args.cache
    recipes = QUICK if args.quick else tuple(args.recipes.split(","))
    dtypes = args.dtypes.split(",")
    if dtypes[0] != "fp32" or any(d not in DTYPES for d in dtypes):
        raise SystemExit(f"--dtypes {args.dtypes}: fp32 first (the baseline), then of {[*DTYPES]}")

    # AOTInductor packages first, side by side (cached for reruns): {dtype: {variant: package}}
    t0 = time.perf_counter()
    variants = {"float": None, **{r: r for r in recipes}}
    built = {
        d: build_packages(source, variants, max_cache_len=cache_len, dtype=DTYPES[d])
        for d in dtypes
    }
    print(f"packages ready in {time.perf_counter() - t0:.0f} s", flush=True)
    models = {"fp32": model}
    for d in dtypes[1:]:
        models[d] = copy.deepcopy(model).to(DTYPES[d])
    programs = {d: fxquant.export_llm(m, max_cache_len=cache_len) for d, m in models.items()}

    # (name, scheme, dtype, builder); a dtype past fp32 suffixes its rows' names
    cands: list[tuple[str, str, str, Callable]] = [("fp32 eager", "fp32", "fp32", build_fp32_eager)]
    for d in dtypes:
        sfx = "" if d == "fp32" else f" {d}"
        cands += [
            (f"{d} inductor", d, d, build_inductor),
            (f"{d} aoti", d, d, build_package(built[d]["float"].path)),
        ]
        for r in recipes:
            cands.append((f"fxquant {r} aoti{sfx}", r, d, build_package(built[d][r].path)))
        if not args.no_backend and not args.quick:
            for r in (r for r in BACKEND if r in recipes):
                cands.append((f"fxquant {r} backend{sfx}", r, d, build_backend(r)))
    status = {}
    if not args.no_peers and not args.quick:
        why = torchao_status()
        for d in dtypes:
            sfx = "" if d == "fp32" else f" {d}"
            for cfg, label in (
                ("Int8WeightOnlyConfig", "int8wo"),
                ("Int8DynamicActivationInt8WeightConfig", "w8a8"),
            ):
                name = f"torchao {label} compile{sfx}"
                if why:
                    status[name] = why
                else:
                    cands.append((name, label, d, build_torchao(cfg)))
        cands.append(("ao quantize_dynamic int8", "w8a8", "fp32", build_quantize_dynamic))

    steps: dict[str, Step] = {}
    rows: dict[str, dict] = {}
    for name, scheme, d, builder in cands:
        print(f"building {name} ...", flush=True)
        try:
            step, build_s, note = builder(models[d], programs[d], prompt, cache_len)
            if "aoti" in name:
                build_s = built[d][_variant(scheme, d)].build_s
            steps[name] = step
            rows[name] = {
                "candidate": name,
                "scheme": scheme,
                "dtype": d,
                "status": "ok",
                "note": note,
                "build_s": build_s,
            }
        except Exception as e:  # noqa: BLE001 - a failing candidate is a row, not a crash
            rows[name] = {
                "candidate": name,
                "scheme": scheme,
                "dtype": d,
                "status": f"failed: {type(e).__name__}: {str(e)[:200]}",
            }
            print(f"  {rows[name]['status']}", flush=True)
    for name, why in status.items():
        rows[name] = {"candidate": name, "status": why}

    # free-running greedy once per candidate (agreement), fp32 eager's tokens drive the rounds
    n, new = prompt.shape[1], args.new
    greedy: dict[str, list[int]] = {}
    ref_logits = None
    for name, step in steps.items():
        logits = step(prompt, torch.arange(n))
        if name == "fp32 eager":
            ref_logits = logits
        rows[name]["rel_err_prefill_logits"] = (
            float((logits - ref_logits).norm() / ref_logits.norm())
            if ref_logits is not None
            else None
        )
        out = [int(logits[0, -1].argmax())]
        for i in range(new - 1):
            out.append(int(step(torch.tensor([[out[-1]]]), torch.tensor([n + i]))[0, -1].argmax()))
        greedy[name] = out
    follow = greedy["fp32 eager"]

    llama = None
    bin_dir = None if args.no_llama_cpp else llama_cpp_bin()
    if bin_dir is not None:
        models = llama_cpp_models(bin_dir)
        print("llama-bench (before) ...", flush=True)
        llama = [run_llama_bench(bin_dir, models, n, new)]

    pre = {k: [] for k in steps}
    dec = {k: [] for k in steps}
    top1 = {k: 0 for k in steps}
    for r in range(args.rounds):
        print(f"round {r + 1}/{args.rounds}", flush=True)
        for name, step in steps.items():
            for _ in range(PREFILLS_PER_ROUND):  # each from position 0: the same work
                t0 = time.perf_counter()
                logits = step(prompt, torch.arange(n))
                pre[name].append(time.perf_counter() - t0)
            agree = int(int(logits[0, -1].argmax()) == follow[0])
            for i in range(new - 1):
                t0 = time.perf_counter()
                logits = step(torch.tensor([[follow[i]]]), torch.tensor([n + i]))
                dec[name].append(time.perf_counter() - t0)
                agree += int(int(logits[0, -1].argmax()) == follow[i + 1])
            top1[name] = agree  # the same every round (deterministic)

    if bin_dir is not None:
        print("llama-bench (after) ...", flush=True)
        llama.append(run_llama_bench(bin_dir, models, n, new))

    bw = copy_bandwidth_gbs()
    base = rows.get(BASELINE, {})
    for name in steps:
        row = rows[name]
        row["prefill_tokens_per_s"] = n / statistics.median(pre[name])
        row["decode_tokens_per_s"] = 1 / statistics.median(dec[name])
        row["decode_ms"] = statistics.median(dec[name]) * 1e3
        row["top1_agreement"] = top1[name] / new
        g = greedy[name]
        row["greedy_agree"] = next(
            (i for i, (a, b) in enumerate(zip(g, follow, strict=True)) if a != b), new
        )
    for name in steps:
        row = rows[name]
        own = rows.get(f"{row['dtype']} inductor", {})
        for ph in ("prefill", "decode"):
            b = base.get(f"{ph}_tokens_per_s")
            row[f"{ph}_speedup_vs_fp32_inductor"] = row[f"{ph}_tokens_per_s"] / b if b else None
            b = own.get(f"{ph}_tokens_per_s")
            row[f"{ph}_speedup_vs_own_dtype_inductor"] = (
                row[f"{ph}_tokens_per_s"] / b if b else None
            )
    for name, row in rows.items():
        if "aoti" in name and row.get("status") == "ok":
            pkg_path = built[row["dtype"]][_variant(row["scheme"], row["dtype"])].path
            pkg = LLMPackage(pkg_path)
            moved = weight_bytes_per_step(pkg, position=n + new // 2)
            row["package_bytes"] = pkg_path.stat().st_size
            row["bytes_per_step"] = moved
            row["effective_gbs"] = moved * row["decode_tokens_per_s"] / 1e9
            row["overhead_ms"] = row["decode_ms"] - moved / (bw * 1e9) * 1e3
            s = fxquant.generate(pkg, tokenizer, ids[:n], max_new_tokens=new)
            s.text()
            row["sampler_ms_per_token"] = s.stats.sample_s / max(s.stats.new_tokens, 1) * 1e3
            del pkg

    llama_rows = []
    if llama:
        for kind in LLAMA_FILES:
            vals = [rec["results"].get(kind, {}) for rec in llama]
            row = {
                "candidate": f"llama.cpp {kind}",
                "scheme": kind,
                "status": "ok",
                "note": "llama-bench, mean of a run before and after the rounds",
            }
            for ph in ("prefill", "decode"):
                ts = [v[ph]["tokens_per_s"] for v in vals if ph in v]
                row[f"{ph}_tokens_per_s"] = statistics.mean(ts) if ts else None
                b = base.get(f"{ph}_tokens_per_s")
                row[f"{ph}_speedup_vs_fp32_inductor"] = (
                    row[f"{ph}_tokens_per_s"] / b if b and ts else None
                )
            llama_rows.append(row)

    results = [*rows.values(), *llama_rows]
    return {
        "script": "benchmarks/llm_decode.py",
        "argv": sys.argv[1:],
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": machine_info(),
        "versions": {
            "torch": torch.__version__,
            "fxquant": fxquant.__version__,
            "torchao": _torchao_version(),
        },
        "model": "SmolLM2-135M-Instruct (fp32 from the Q4_1 GGUF)",
        "dtypes": dtypes,
        "prompt_tokens": n,
        "new_tokens": new,
        "max_cache_len": cache_len,
        # which logits every program returns (results files from before this field: "all")
        "logits": llm_info(programs["fp32"])["logits"],
        "rounds": args.rounds,
        "copy_bandwidth_gbs": bw,
        "llama_cpp": llama,
        "targets": {"decode_vs_fp32_inductor": TARGETS, "prefill_min_vs_fp32": 0.9},
        "results": results,
        "parity": parity(results),
        "wall_s": time.perf_counter() - t_start,
    }


def _variant(scheme: str, dtype: str) -> str:
    """A row's package in ``built[dtype]``: the float model's (scheme = its dtype) or a recipe's."""
    return "float" if scheme == dtype else scheme


def parity(results: list[dict]) -> dict:
    """fxquant's fastest decode row of each width against the llama.cpp file of that width."""
    out = {}
    by_name = {r["candidate"]: r for r in results if r.get("status") == "ok"}
    for width, (kind, families) in PARITY.items():
        ours = [
            r
            for r in by_name.values()
            if r["candidate"].startswith("fxquant") and r["scheme"].startswith(families)
        ]
        theirs = by_name.get(f"llama.cpp {kind}")
        if not ours or theirs is None or not theirs.get("decode_tokens_per_s"):
            continue
        best = max(ours, key=lambda r: r["decode_tokens_per_s"])
        out[width] = {
            "fxquant": best["candidate"],
            "decode_tokens_per_s": best["decode_tokens_per_s"],
            "llama_cpp": f"llama.cpp {kind}",
            "llama_cpp_decode_tokens_per_s": theirs["decode_tokens_per_s"],
            "ratio": best["decode_tokens_per_s"] / theirs["decode_tokens_per_s"],
        }
    return out


def weight_bytes_per_step(pkg: LLMPackage, *, position: int) -> int:
    """Bytes a decode step streams: the quantized weights (from the package's constants) but
    the embedding table, of which one row is read, plus K/V up to ``position``."""
    info = pkg.info
    return int(info.get("weight_bytes_per_step", 0)) + kv_bytes(info, position)


def kv_bytes(info: dict, position: int) -> int:
    per_position = int(info.get("kv_bytes_per_position", 0))
    return per_position * position


def _torchao_version() -> str | None:
    try:
        import torchao

        return torchao.__version__
    except Exception:  # noqa: BLE001
        return None


def print_table(res: dict) -> None:
    head = (
        f"{'candidate':38} {'prefill tok/s':>13} {'×':>5} {'decode tok/s':>12} {'×':>5} "
        f"{'top-1':>5} {'greedy':>6} {'MiB':>5} {'GB/s':>5} {'ovh ms':>6}"
    )
    print("\n" + head + "\n" + "-" * len(head))
    for r in res["results"]:
        if r.get("status") != "ok":
            print(f"{r['candidate']:38} {r.get('status', '?')[:90]}")
            continue

        def f(key, spec, row=r):
            v = row.get(key)
            return "-" if v is None else format(v, spec)

        mib = r.get("package_bytes")
        print(
            f"{r['candidate']:38} {f('prefill_tokens_per_s', '13.0f')} "
            f"{f('prefill_speedup_vs_fp32_inductor', '5.2f')} {f('decode_tokens_per_s', '12.1f')} "
            f"{f('decode_speedup_vs_fp32_inductor', '5.2f')} {f('top1_agreement', '5.0%')} "
            f"{f('greedy_agree', '6d')} {'-' if mib is None else format(mib / 2**20, '5.0f')} "
            f"{f('effective_gbs', '5.1f')} {f('overhead_ms', '6.1f')}"
        )
    print(f"copy bandwidth {res['copy_bandwidth_gbs']:.1f} GB/s; cache {res['max_cache_len']}")
    for width, p in res.get("parity", {}).items():
        print(
            f"best {width}: {p['fxquant']} {p['decode_tokens_per_s']:.1f} tok/s = "
            f"{p['ratio']:.2f}× {p['llama_cpp']} ({p['llama_cpp_decode_tokens_per_s']:.1f})"
        )


def plot(res: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["results"] if r.get("status") == "ok"]
    names = [r["candidate"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.36 * len(names) + 1.8), sharey=True)
    colors = [
        "tab:blue"
        if n.startswith("fxquant")
        else "tab:gray"
        if n.startswith(tuple(DTYPES))
        else "tab:green"
        if n.startswith("llama")
        else "tab:orange"
        for n in names
    ]
    for ax, ph in zip(axes, ("prefill", "decode"), strict=True):
        vals = [r.get(f"{ph}_tokens_per_s") or 0.0 for r in rows]
        ax.barh(range(len(names)), vals, color=colors)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        for y, v in enumerate(vals):
            ax.text(v, y, f" {v:.0f}" if ph == "prefill" else f" {v:.1f}", va="center", fontsize=7)
        ax.set_xlabel(f"{ph} tokens/s")
        ax.set_title(
            f"prefill, {res['prompt_tokens']} tokens in one call"
            if ph == "prefill"
            else f"decode with KV cache (M = 1), {res['new_tokens']} tokens",
            fontsize=9,
        )
    m = res.get("machine", {})
    fig.suptitle(
        f"benchmarks/llm_decode.py: SmolLM2-135M, batch 1; {m.get('cpu_model', '?')} "
        f"({m.get('cpu_capability', '?')}), {m.get('threads', '?')} threads, torch "
        f"{m.get('torch', '?')}; blue fxquant, green llama.cpp, orange other peers",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument(
        "--quick", action="store_true", help="the four lm_head recipes, fp32, llama.cpp; 2 rounds"
    )
    ap.add_argument("--prompt", type=int, default=128)
    ap.add_argument("--new", type=int, default=64)
    ap.add_argument("--cache", type=int, default=256, help="max_cache_len of every program")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-backend", action="store_true")
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--no-llama-cpp", action="store_true")
    ap.add_argument(
        "--dtypes",
        default="fp32",
        help="the model's dtypes, fp32 first (e.g. fp32,bf16): each gets its float rows and "
        "every recipe's package built from it",
    )
    ap.add_argument("--out", type=Path, default=HERE / "results" / "llm_decode.json")
    ap.add_argument(
        "--note", default="", help="what this run is for, kept in the JSON and printed by report.py"
    )
    args = ap.parse_args()
    if args.quick:
        args.rounds = min(args.rounds, 2)
    if not args.no_llama_cpp and llama_cpp_bin() is None:
        print(
            "llama.cpp is not built: run `bash benchmarks/setup_llama_cpp.sh` (or pass "
            "--no-llama-cpp); its rows will be missing",
            file=sys.stderr,
        )
    res = run(args)
    if args.note:
        res["note"] = args.note
    print_table(res)
    write_results(res, args.out)
    plot(res, args.out.with_suffix(".png"))


if __name__ == "__main__":
    main()
