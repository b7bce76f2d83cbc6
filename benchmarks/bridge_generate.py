"""Does a model quantized at load time (``from_pretrained(..., quantization_config=
FxquantHfConfig(recipe))``) generate faster than the float model, eagerly, as a transformers
user runs it?

SmolLM2-135M (real weights; ``--dtype bf16``: loaded in bf16, what ``from_pretrained`` gives for
its checkpoint), saved with ``save_pretrained`` and loaded back float and quantized, batch 1,
``model.generate`` with transformers' default (dynamic) cache, greedy, a 128-token prompt (the
start of ``lee.cor``, held-out text), nothing compiled. Rows, measured side by side in one run:

- float eager: the model the quantized ones replace, the baseline every ratio is relative to;
- per recipe, the bridged model eager: its ops on the CPU lowering's kernels
  (``fxquant.passes.eager``), and, suffixed "reference math", the same model under
  ``reference_math()`` (each op's plain-torch reference, which every bridged model ran eagerly
  before 2026-12-07);
- peers, where torchao is installed: ``TorchAoConfig(Int8WeightOnlyConfig())`` and
  ``TorchAoConfig(Int8DynamicActivationInt8WeightConfig())`` through the same
  ``from_pretrained``, eager (what transformers' docs offer for int8 on the CPU).

``--compile``: every row (float included: the baseline is then float Inductor) under plain
``torch.compile(model.forward)``, Inductor's default backend, with a static cache of
``--max-cache-len`` positions, as ``hf_generate.py`` compiles (no guards on the modules): the
bridged rows on fxquant's decompositions (``fxquant.passes.stock``), the torchao rows as
torchao's docs compile them. No reference rows (``bridge_moe.py`` has the compiled ones).

Timing as ``hf_generate.py``: a decode step is (a generate of 2 + K new tokens - one of 2) / K,
medians over interleaved rounds, transformers' Python between steps included. Greedy: leading
new tokens shared with float eager. MB: the state dict as ``torch.save`` writes it; +MB: what
the eager kernels hold beside it (``EagerKernels.extra_bytes``: prepacked weights; compiled, what
the ``stock_*`` ops prepacked: ``fxquant.passes.stock.held_bytes``).
``hf_generate.py`` measures the compiled rows (``torch.compile(backend="fxquant")``).

    python benchmarks/bridge_generate.py                  # ~4 min on 2 cores
    python benchmarks/bridge_generate.py --dtype bf16 \
        --out benchmarks/results/bridge_generate_bf16.json
    python benchmarks/bridge_generate.py --compile \
        --out benchmarks/results/bridge_generate_compiled.json  # ~12 min

Writes results/bridge_generate.json (machine, versions, rows, ratios).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import tempfile
import time
import warnings
from pathlib import Path

import torch
import transformers
from hf_generate import PROMPT_TOKENS, time_generate
from machine import machine_info, own_forward, write_results

from fxquant import assets
from fxquant.hf.bridge import FxquantHfConfig
from fxquant.packages import DTYPES
from fxquant.passes.eager import EagerKernels, reference_math
from fxquant.passes.stock import held_bytes

HERE = Path(__file__).resolve().parent
RECIPES = ("int8wo", "int8wo+lm_head", "w8a8", "int4wo-64")
REFERENCE = " (reference math)"


class _Reference:
    """A bridged model whose ``generate`` runs its ops' reference math."""

    def __init__(self, model) -> None:
        self.model = model

    def generate(self, *args, **kwargs):
        with reference_math():
            return self.model.generate(*args, **kwargs)


def _torchao_configs() -> dict:
    with contextlib.suppress(ImportError):
        from torchao.quantization import (
            Int8DynamicActivationInt8WeightConfig,
            Int8WeightOnlyConfig,
        )

        return {
            "torchao int8 weight-only": Int8WeightOnlyConfig(),
            "torchao int8 dynamic": Int8DynamicActivationInt8WeightConfig(),
        }
    return {}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--recipes", default=",".join(RECIPES))
    ap.add_argument("--new-tokens", type=int, default=32, help="K: decode steps timed")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="fp32")
    ap.add_argument("--no-reference", action="store_true", help="leave out the reference rows")
    ap.add_argument(
        "--compile", action="store_true", help="torch.compile(model.forward), a static cache"
    )
    ap.add_argument("--max-cache-len", type=int, default=256, help="with --compile")
    ap.add_argument("--out", default=str(HERE / "results" / "bridge_generate.json"))
    a = ap.parse_args()
    torch.set_num_threads(2)
    torch.set_grad_enabled(False)
    t_start = time.perf_counter()
    dtype = DTYPES[a.dtype]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model, tokenizer = assets.load_smollm2()
    prompt = tokenizer(assets.lee_text("test"), return_tensors="pt").input_ids[:, :PROMPT_TOKENS]
    kw = dict(do_sample=False, pad_token_id=tokenizer.eos_token_id or 0)
    if a.compile:  # one cache length for every generate: one pair of graphs per model
        kw.update(cache_implementation="static", max_cache_len=a.max_cache_len)
    baseline = f"{a.dtype} {'inductor' if a.compile else 'eager'}"
    recipes = [r for r in a.recipes.split(",") if r]
    configs = {f"fxquant {r} bridge": FxquantHfConfig(r) for r in recipes}
    peers = _torchao_configs()
    configs.update({name: transformers.TorchAoConfig(c) for name, c in peers.items()})
    built, rows = {}, {}
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)
        del model
        for name, config in {baseline: None, **configs}.items():
            t0 = time.perf_counter()
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                m = transformers.AutoModelForCausalLM.from_pretrained(
                    tmp, quantization_config=config, dtype=dtype
                ).eval()
            m.generation_config.eos_token_id = None  # every generate runs its full length
            if a.compile:
                own_forward(m)
                guards = {"guard_filter_fn": torch.compiler.skip_guard_on_all_nn_modules_unsafe}
                m.forward = torch.compile(m.forward, options=guards)
            # builds the bridge's kernels (compiled: the prefill and decode graphs)
            m.generate(prompt, max_new_tokens=2, **kw)
            built[name] = m
            report = getattr(m, "fxquant_report", None)
            rows[name] = {
                "candidate": name,
                "load_s": round(time.perf_counter() - t0, 1),
                "state_bytes": _state_bytes(m),
                "eager_kernel_bytes": sum(
                    mod._kernels.extra_bytes
                    for mod in m.modules()
                    if isinstance(getattr(mod, "_kernels", None), EagerKernels)
                )
                + held_bytes(m.buffers()),  # compiled: what the stock_* ops prepacked
                "quantized_linears": len(report.quantized) if report else None,
            }
            if report is not None and not (a.no_reference or a.compile):
                built[name + REFERENCE] = _Reference(m)
                rows[name + REFERENCE] = {**rows[name], "candidate": name + REFERENCE}
            print(f"[{name}] ready in {rows[name]['load_s']} s", flush=True)
        timed = time_generate(built, prompt, kw, a.rounds, a.new_tokens, baseline)
    base = timed[baseline]["decode_ms"]
    how = f"torch.compile, static cache of {a.max_cache_len}" if a.compile else "eager"
    print(f"\nSmolLM2-135M {a.dtype}, prompt {PROMPT_TOKENS}, {a.new_tokens} steps timed, {how}")
    head = f"{'decode ms':>10} {'tok/s':>7} {'x float':>8} {'greedy':>7} {'MB':>6} {'+MB':>5}"
    print(f"{'row':48} {head}")
    for name, row in rows.items():
        speedup = round(base / timed[name]["decode_ms"], 2)
        row.update(timed[name], decode_speedup_vs_baseline=speedup)
        print(
            f"{name:48} {row['decode_ms']:10.2f} {row['decode_tokens_per_s']:7.1f} "
            f"{row['decode_speedup_vs_baseline']:7.2f}x {row['greedy_agree']:4d}/"
            f"{a.new_tokens + 2} {row['state_bytes'] / 1e6:6.0f} "
            f"{row['eager_kernel_bytes'] / 1e6:5.0f}"
        )
    versions = {"torch": torch.__version__, "transformers": transformers.__version__}
    with contextlib.suppress(ImportError):
        import torchao

        versions["torchao"] = torchao.__version__
    write_results(
        {
            "script": "benchmarks/bridge_generate.py",
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "versions": versions,
            "question": " ".join(__doc__.split("\n\n")[0].split()),
            "machine": machine_info(),
            "model": f"SmolLM2-135M-Instruct ({a.dtype})",
            "dtype": a.dtype,
            "compiled": a.compile,
            "max_cache_len": a.max_cache_len if a.compile else None,
            "prompt_tokens": PROMPT_TOKENS,
            "new_tokens_timed": a.new_tokens,
            "rounds": a.rounds,
            "baseline": baseline,
            "results": list(rows.values()),
            "wall_s": round(time.perf_counter() - t_start, 1),
        },
        a.out,
    )


def _state_bytes(model) -> int:
    """Bytes of the state dict as ``torch.save`` writes it (a tensor subclass's, torchao's, as
    its inner tensors: what it holds, not its logical float shape)."""
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    return buf.tell()


if __name__ == "__main__":
    main()
