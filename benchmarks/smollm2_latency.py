"""How fast does a real model run on a CPU after fxquant, next to fp32 and the peers, and what
does each variant cost to build and ship?

``python benchmarks/cpu_latency.py --model smollm2`` runs this (the module is the SmolLM2 part
of cpu_latency.py, kept in its own file). SmolLM2-135M (real weights, ``fxquant.assets``), fp32,
batch 1, the first Lee-corpus tokens as input:

- **prefill**: one forward over ``--prefill`` tokens (default 128; M = 128 rows per linear);
  tokens/s = tokens / latency.
- **decode**: greedy decoding WITHOUT a KV cache (``fxquant.evaluate.greedy_decode``): a
  ``--context``-token prompt (default 64) then ``--new-tokens`` single-token steps (default 8),
  each rerunning the whole, growing sequence, because the exported graph takes only
  ``input_ids``. tokens/s = new tokens / wall time of the loop. This is the regime the exported
  model can serve today (M ≈ 64-72 rows per step), not cached M = 1 decoding: the stack in
  cpu_latency.py has the M = 1 figures.

Candidates: fp32 eager; fp32 Inductor (``torch.compile`` of the HF wrapper: the baseline every
speed-up is relative to); fp32 AOTInductor (the exported program packaged as is); per fxquant
recipe an AOTInductor package (``fxquant.quantize`` + ``fxquant.aot_compile`` of the program
exported with dynamic batch and seq: one package serves prefill and every decode length) and
``torch.compile(backend="fxquant")``; peers: ``torch.ao.quantization.quantize_dynamic`` (qint8,
eager fbgemm, every Linear but ``lm_head``) and, when importable, torchao ``Int8WeightOnlyConfig``
+ ``torch.compile``.

Per row: prefill and decode tokens/s (median of interleaved rounds: every round runs every
candidate, so load from other processes hits all alike), speed-up vs fp32 Inductor, build time
(quantize + compile/package, or the compiling first calls), artifact size for packages, greedy
tokens agreeing with fp32 eager, and the relative error of the prefill logits vs fp32 eager.
Writes results/cpu_latency_smollm2.json and .png.
"""

from __future__ import annotations

import copy
import statistics
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn

import fxquant
from fxquant import assets, evaluate

SCHEMES = ("int8wo", "int4wo-64", "w8a8", "fp8-row")
BASELINE = "fp32 inductor"
SKIP = ("lm_head",)


def _ids_fn(f: Callable) -> Callable:
    """ids → logits with autograd off (AOTI packages and compiled modules alike)."""

    def call(ids: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            return f(ids)

    return call


# --------------------------------------------------------------------------- builders
# A builder returns (fn, info): fn maps ids [1, T] to logits; info has build_s, artifact_bytes
# and a note. Compiling builders are warmed at both a prefill and a decode length, so the
# timed rounds include no compile.


def _warm(fn: Callable, warm_ids: list[torch.Tensor]) -> float:
    t0 = time.perf_counter()
    for ids in warm_ids:
        fn(ids)
    return time.perf_counter() - t0


def build_eager(wrapper, ep, warm_ids, tmp):
    return _ids_fn(wrapper), {"note": "eager"}


def build_inductor(wrapper, ep, warm_ids, tmp):
    """torch.compile of the HF wrapper, dynamic=None: the second length recompiles with a
    symbolic sequence, which then serves every decode length."""
    fn = _ids_fn(torch.compile(copy.deepcopy(wrapper)))
    return fn, {"build_s": _warm(fn, warm_ids), "note": "torch.compile (automatic dynamic seq)"}


def build_aoti(program, name: str, tmp: Path, *, quantize_s: float = 0.0):
    path = tmp / f"{name}.pt2"
    t0 = time.perf_counter()
    pkg = fxquant.aot_compile(program, path)
    return _ids_fn(pkg), {
        "build_s": quantize_s + time.perf_counter() - t0,
        "artifact_bytes": path.stat().st_size,
        "note": "AOTInductor package, batch and seq dynamic",
    }


def build_fp32_aoti(wrapper, ep, warm_ids, tmp):
    return build_aoti(ep, "fp32", tmp)


def build_fxquant_aoti(recipe: str):
    def build(wrapper, ep, warm_ids, tmp):
        t0 = time.perf_counter()
        program = fxquant.quantize(ep, recipe)
        return build_aoti(program, recipe, tmp, quantize_s=time.perf_counter() - t0)

    return build


def build_fxquant_backend(recipe: str):
    def build(wrapper, ep, warm_ids, tmp):
        compiled = torch.compile(
            copy.deepcopy(wrapper), backend="fxquant", options={"config": recipe}
        )
        fn = _ids_fn(compiled)
        return fn, {
            "build_s": _warm(fn, warm_ids),
            "note": "torch.compile(backend='fxquant') (automatic dynamic seq)",
        }

    return build


def _linears(model: nn.Module) -> list[str]:
    return [
        n
        for n, m in model.named_modules()
        if isinstance(m, nn.Linear) and not any(n == s or n.endswith("." + s) for s in SKIP)
    ]


def build_quantize_dynamic(wrapper, ep, warm_ids, tmp):
    q = copy.deepcopy(wrapper)
    t0 = time.perf_counter()
    with warnings.catch_warnings():  # torch.ao.quantization is deprecated in favour of torchao
        warnings.simplefilter("ignore")
        qcfg = torch.ao.quantization.default_dynamic_qconfig
        q = torch.ao.quantization.quantize_dynamic(
            q, {n: qcfg for n in _linears(q)}, dtype=torch.qint8
        )
    return _ids_fn(q), {"build_s": time.perf_counter() - t0, "note": "eager fbgemm"}


def build_torchao_int8wo(wrapper, ep, warm_ids, tmp):
    import torchao.quantization as tq

    q = copy.deepcopy(wrapper)
    t0 = time.perf_counter()
    keep = set(_linears(q))
    tq.quantize_(q, tq.Int8WeightOnlyConfig(), filter_fn=lambda m, fqn: fqn in keep)
    fn = _ids_fn(torch.compile(q))
    quantize_s = time.perf_counter() - t0
    return fn, {
        "build_s": quantize_s + _warm(fn, warm_ids),
        "note": "torchao quantize_ + torch.compile",
    }


def torchao_available() -> tuple[bool, str]:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao
            import torchao.quantization  # noqa: F401
    except Exception as e:  # noqa: BLE001 - missing or broken, both are data
        return False, f"skipped: torchao unavailable ({type(e).__name__}: {str(e)[:160]})"
    return True, torchao.__version__


def candidates(schemes, peers: bool) -> list[tuple[str, str, str, Callable]]:
    """(name, scheme, path, builder) in table order."""
    out = [
        ("fp32 eager", "fp32", "eager", build_eager),
        (BASELINE, "fp32", "inductor", build_inductor),
        ("fp32 aoti", "fp32", "aoti", build_fp32_aoti),
    ]
    for r in schemes:
        out.append((f"fxquant {r} aoti", r, "aoti", build_fxquant_aoti(r)))
        out.append((f"fxquant {r} backend", r, "backend", build_fxquant_backend(r)))
    if peers:
        out.append(("ao quantize_dynamic int8", "w8a8", "eager", build_quantize_dynamic))
        out.append(("torchao int8wo compile", "int8wo", "inductor", build_torchao_int8wo))
    return out


# --------------------------------------------------------------------------- run


def _rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref.double()).norm() / ref.double().norm()).item()


def _agree(a: torch.Tensor, b: torch.Tensor) -> int:
    """Leading greedy tokens that agree."""
    same = (a == b).tolist() + [False]
    return same.index(False)


def run(
    *,
    schemes=SCHEMES,
    peers: bool = True,
    prefill: int = 128,
    context: int = 64,
    new_tokens: int = 8,
    rounds: int = 5,
) -> dict:
    torch.manual_seed(0)
    model, tok = assets.load_smollm2()
    model.eval()
    wrapper = evaluate.CausalLMWrapper(model).eval()
    ids = torch.tensor(tok(assets.lee_text("background")).input_ids[: max(prefill, context)])
    prefill_ids = ids[:prefill].unsqueeze(0)
    prompt = ids[:context]
    # Compiling builders see a prefill length and two decode lengths before timing.
    warm_ids = [prefill_ids, prompt[None, :-1], prompt[None]]
    t0 = time.perf_counter()
    ep = evaluate.export_causal_lm(model)
    export_s = time.perf_counter() - t0
    with torch.no_grad():
        ref_logits = wrapper(prefill_ids)
    ref_tokens = evaluate.greedy_decode(_ids_fn(wrapper), prompt, new_tokens=new_tokens)
    ao_ok, ao_status = torchao_available() if peers else (False, "not run (--no-peers)")

    rows: list[dict] = []
    timed: dict[str, dict[str, Callable]] = {"prefill": {}, "decode": {}}
    # Every compiled candidate adds cache entries (two, with automatic dynamic seq) to the same
    # forward; past Dynamo's default limit of 8 a frame silently runs *uncompiled*, which a run
    # of this script once measured as "fp8-row backend" and "torchao compile" rows.
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 1024
    with tempfile.TemporaryDirectory(prefix="fxq_smollm2_") as tmp:
        for name, scheme, path, build in candidates(schemes, peers):
            row = {"candidate": name, "scheme": scheme, "path": path}
            rows.append(row)
            if name.startswith("torchao") and not ao_ok:
                row["status"] = ao_status
                print(f"  {name}: {ao_status}", flush=True)
                continue
            t1 = time.perf_counter()
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            try:
                fn, info = build(wrapper, ep, warm_ids, Path(tmp))
                compiled = torch._dynamo.utils.counters["stats"]["unique_graphs"] > graphs
                if path in ("backend", "inductor") and not compiled:
                    raise RuntimeError("torch.compile compiled no graph: it would run eagerly")
                logits = fn(prefill_ids)
                tokens = evaluate.greedy_decode(fn, prompt, new_tokens=new_tokens)
            except Exception as e:  # noqa: BLE001 - a failing candidate is a result
                row["status"] = f"error: {type(e).__name__}: {str(e)[:400]}"
                print(f"  {name}: {row['status']}", flush=True)
                continue
            row.update(
                status="ok",
                build_s=info.get("build_s"),
                artifact_bytes=info.get("artifact_bytes"),
                note=info["note"],
                rel_err_vs_fp32_eager=_rel_err(logits, ref_logits),
                greedy_agree=_agree(tokens, ref_tokens),
            )
            timed["prefill"][name] = lambda fn=fn: fn(prefill_ids)
            timed["decode"][name] = lambda fn=fn: evaluate.greedy_decode(
                fn, prompt, new_tokens=new_tokens
            )
            print(f"  built {name} ({time.perf_counter() - t1:.0f} s)", flush=True)

        # Interleaved: each round runs every candidate once per phase.
        samples = {ph: {n: [] for n in fns} for ph, fns in timed.items()}
        print(f"timing {len(timed['prefill'])} candidates x {rounds} rounds", flush=True)
        for _ in range(rounds):
            for ph, fns in timed.items():
                for n, f in fns.items():
                    t1 = time.perf_counter()
                    f()
                    samples[ph][n].append(time.perf_counter() - t1)
    work = {"prefill": prefill, "decode": new_tokens}
    for row in rows:
        for ph in ("prefill", "decode"):
            s = samples[ph].get(row["candidate"])
            if not s:
                continue
            base = samples[ph].get(BASELINE)  # empty if the baseline failed to build
            med = statistics.median(s)
            row[f"{ph}_median_s"] = med
            row[f"{ph}_tokens_per_s"] = work[ph] / med
            row[f"{ph}_speedup_vs_fp32_inductor"] = statistics.median(base) / med if base else None
    return {
        "model": "SmolLM2-135M (fp32, real weights)",
        "prefill_tokens": prefill,
        "decode": {
            "context": context,
            "new_tokens": new_tokens,
            "kv_cache": False,
            "how": "greedy, each step reruns the whole growing sequence (no KV cache)",
        },
        "export_s": export_s,
        "rounds": rounds,
        "torchao": ao_status,
        "baseline": BASELINE,
        "results": rows,
    }


def print_table(res: dict) -> None:
    hdr = (
        f"{'candidate':28} {'prefill tok/s':>13} {'x':>5} {'decode tok/s':>12} {'x':>5} "
        f"{'build s':>8} {'MB':>6} {'rel.err':>8} {'greedy':>6}"
    )
    print("\n" + hdr + "\n" + "-" * len(hdr))
    n = res["decode"]["new_tokens"]
    for r in res["results"]:
        if r["status"] != "ok":
            print(f"{r['candidate']:28} {r['status'][:120]}")
            continue
        mb = "-" if r["artifact_bytes"] is None else f"{r['artifact_bytes'] / 1e6:6.0f}"
        bs = "-" if r["build_s"] is None else f"{r['build_s']:8.0f}"
        px, dx = (r[f"{ph}_speedup_vs_fp32_inductor"] for ph in ("prefill", "decode"))
        print(
            f"{r['candidate']:28} {r['prefill_tokens_per_s']:13.1f} {_x(px):>5} "
            f"{r['decode_tokens_per_s']:12.2f} {_x(dx):>5} {bs:>8} {mb:>6} "
            f"{r['rel_err_vs_fp32_eager']:8.1e} {r['greedy_agree']:>3}/{n}"
        )


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def plot(res: dict, path: Path) -> None:
    """Speed-up vs fp32 Inductor per candidate, prefill and decode side by side."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in res["results"] if r.get("status") == "ok"]
    names = [r["candidate"] for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(12, 0.38 * len(names) + 1.8), sharey=True)
    colors = [
        "tab:blue"
        if n.startswith("fxquant")
        else "tab:gray"
        if n.startswith("fp32")
        else "tab:orange"
        for n in names
    ]
    for ax, ph in zip(axes, ("prefill", "decode"), strict=True):
        vals = [r[f"{ph}_speedup_vs_fp32_inductor"] or 0.0 for r in rows]
        ax.barh(range(len(names)), vals, color=colors)
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_yticks(range(len(names)), names, fontsize=8)
        ax.invert_yaxis()
        for y, v in enumerate(vals):
            ax.text(v, y, f" {v:.2f}×", va="center", fontsize=7)
        label = (
            f"prefill ({res['prefill_tokens']} tokens)"
            if ph == "prefill"
            else f"decode without KV cache ({res['decode']['context']}-token prompt, "
            f"{res['decode']['new_tokens']} steps)"
        )
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("speed-up vs fp32 Inductor (medians)")
    m = res.get("machine", {})
    fig.suptitle(
        f"benchmarks/cpu_latency.py --model smollm2 → {Path(path).with_suffix('.json').name}: "
        f"SmolLM2-135M fp32; {m.get('cpu_model', '?')}, {m.get('threads', '?')} threads, "
        f"torch {m.get('torch', '?')}; blue fxquant, orange peers",
        fontsize=9,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")
