"""End-to-end demo on a real model: SmolLM2-135M served with its KV cache, fp32 vs quantized.

Where this sits: it drives the whole pipeline once, the way a user deploying an LLM would. For
fp32 and each recipe, SmolLM2 is exported with its KV cache (``fxquant.export_llm``: prefill and
decode in one program), quantized and packaged by AOTInductor (``fxquant.packages``: the
missing packages are built side by side, one process each, then served from the package
cache); the loaded package, the artifact that ships, is then measured: its size, perplexity
(the protocol of docs/assets.md, 512-token windows prefilled through the package), prefill
tokens/s at 128 tokens, decode tokens/s at one token per call (M = 1, the cache in the
package), and greedy agreement with fp32. Last, the fastest variant streams a completion through
``fxquant.generate``. Every variant, fp32 included, is an AOTInductor package of the same
program, so the ratios compare like with like.

Run it as ``fxquant demo`` (or ``python -m fxquant.demo``); ``--full`` scores and decodes more.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import torch

__all__ = ["DEFAULT_SCHEMES", "DemoRow", "add_demo_arguments", "main", "run_demo"]

# int8 and 4-bit as llama.cpp ships them: lm_head quantized too (8-bit in the 4-bit file); the
# int8 weight-only one for accuracy, W4A8 (int4 x int8 dot products, as llama.cpp's Q4 x Q8)
# for speed
DEFAULT_SCHEMES = ("int8wo+lm_head", "w4a8-64+lm_head=w8a8")
_CACHE_LEN = 512  # one perplexity window, and prompt + new tokens
_PROMPT_TOKENS = 128


@dataclass
class DemoRow:
    """One line of the final table: a variant (``"fp32"`` or a recipe name) and what it got."""

    name: str
    package_bytes: int | None = None
    ppl: float | None = None
    prefill_tokens_per_s: float | None = None
    decode_tokens_per_s: float | None = None
    greedy: list[int] = field(default_factory=list)
    build_s: float | None = None
    from_cache: bool = False
    error: str | None = None


def add_demo_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``fxquant demo`` options to ``parser`` (the CLI calls this for its subcommand)."""
    parser.add_argument(
        "--schemes",
        default=",".join(DEFAULT_SCHEMES),
        help="comma-separated recipes to compare with fp32 (default: %(default)s)",
    )
    parser.add_argument(
        "--full",
        action="store_true",
        help="score 8192 tokens and decode 64 (default: 1024 and 32; a few minutes either way "
        "once the packages are cached)",
    )
    parser.add_argument("--tokens", type=int, default=None, help="perplexity tokens to score")
    parser.add_argument("--new-tokens", type=int, default=None, help="greedy tokens to decode")
    parser.add_argument(
        "--prompt",
        default="The three most important things to know about Paris are",
        help="the prompt of the streamed completion at the end",
    )
    parser.add_argument(
        "--json",
        type=Path,
        default=None,
        help="also write the table's figures, with the machine and versions, to this JSON file",
    )
    return parser


def run_from_args(args: argparse.Namespace) -> list[DemoRow]:
    """Run the demo from parsed :func:`add_demo_arguments` options."""
    schemes = tuple(s.strip() for s in args.schemes.split(",") if s.strip())
    tokens = args.tokens or (8192 if args.full else 1024)
    new_tokens = args.new_tokens or (64 if args.full else 32)
    rows = run_demo(schemes=schemes, tokens=tokens, new_tokens=new_tokens, prompt=args.prompt)
    if args.json is not None:
        write_json(rows, args.json, tokens=tokens, new_tokens=new_tokens)
    return rows


def machine() -> dict:
    """The CPU this ran on (model, cores, vector ISA) and the versions: every result records it."""
    model = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "isa": torch.backends.cpu.get_cpu_capability(),
        "torch": torch.__version__,
    }


def write_json(rows: list[DemoRow], path: Path, *, tokens: int, new_tokens: int) -> None:
    """The demo's figures as JSON (what the README's demo table is made from)."""
    import fxquant

    base = rows[0] if rows and rows[0].name == "fp32" else None
    record = {
        "script": "fxquant demo",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {**machine(), "fxquant": fxquant.__version__},
        "perplexity_tokens": tokens,
        "prompt_tokens": _PROMPT_TOKENS,
        "decode_new_tokens": new_tokens,
        "max_cache_len": _CACHE_LEN,
        "rows": [
            {
                **{k: v for k, v in vars(r).items() if k != "greedy"},
                "greedy_same_as_fp32": None if base is None else _common_prefix(r, base),
                "top1_agreement": None if base is None else _agreement(r, base),
            }
            for r in rows
        ],
    }
    with fxquant.api.atomic_path(path) as tmp:
        tmp.write_text(json.dumps(record, indent=2))


def main(argv: Sequence[str] | None = None) -> int:
    summary = __doc__.splitlines()[0]
    parser = add_demo_arguments(argparse.ArgumentParser(prog="fxquant demo", description=summary))
    run_from_args(parser.parse_args(argv))
    return 0


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.0f}"


def _say(msg: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(msg)  # keeps a progress bar at the bottom intact


def _error(exc: Exception) -> str:
    # a failed variant's table cell: the exception's type and first line
    return f"{type(exc).__name__}: {exc}".splitlines()[0][:200]


def _common_prefix(a: DemoRow, b: DemoRow) -> int:
    # Leading tokens equal to fp32's: what free-running greedy decoding would share with fp32
    n = min(len(a.greedy), len(b.greedy))
    return next((i for i in range(n) if a.greedy[i] != b.greedy[i]), n)


def _agreement(a: DemoRow, b: DemoRow) -> float:
    # steps whose argmax equals fp32's, each fed fp32's previous token (teacher forcing)
    n = min(len(a.greedy), len(b.greedy))
    return sum(a.greedy[i] == b.greedy[i] for i in range(n)) / max(n, 1)


@torch.no_grad()
def _perplexity(pkg, token_ids: torch.Tensor, tokens: int) -> float:
    """docs/assets.md's protocol: non-overlapping 512-token windows, no BOS, each from 0."""
    from fxquant.evaluate import perplexity

    return perplexity(
        lambda ids: pkg(ids, torch.arange(ids.shape[1])), token_ids, max_tokens=tokens
    )


@torch.no_grad()
def _speeds(
    pkgs: dict, prompt: torch.Tensor, new_tokens: int, *, rounds: int = 5
) -> tuple[dict[str, tuple[float, float, list[int]]], dict[str, str]]:
    """Prefill and decode every package side by side: ``({name: (prefill tok/s, decode tok/s,
    greedy ids)}, {name: error})``.

    Each round times one prefill of every package in turn (median of ``rounds``), and each
    decode step steps every package in turn (median step): a slow spell of a shared machine,
    which lasts seconds, falls on all of them alike instead of on whichever ran then (measured
    one package after another, int8's prefill ratio to fp32 read 0.74 and 1.07 in two runs).

    When fp32 (the first package) runs, every package is fed fp32's greedy token at each step
    (teacher forcing), so the ids say where the argmaxes agree at every step, not only up to the
    first difference; the work per step is the same either way.
    """
    n = prompt.shape[1]
    live = list(pkgs)
    errors: dict[str, str] = {}
    pre: dict[str, list[float]] = {k: [] for k in live}
    steps: dict[str, list[float]] = {k: [] for k in live}
    ids: dict[str, list[int]] = {k: [] for k in live}

    def timed(name: str, times: dict[str, list[float]], *args) -> torch.Tensor | None:
        try:
            t0 = time.perf_counter()
            out = pkgs[name](*args)
            times[name].append(time.perf_counter() - t0)
            return out
        except Exception as exc:  # noqa: BLE001 - the variant's row reports it
            errors[name] = _error(exc)
            live.remove(name)
            return None

    for _ in range(rounds):
        for name in list(live):
            logits = timed(name, pre, prompt, torch.arange(n))
            if logits is not None:
                ids[name] = [int(logits[0, -1].argmax())]
    lead = "fp32" if "fp32" in live else None
    for i in range(new_tokens - 1):
        fed_lead = ids[lead][i] if lead in live else None
        for name in list(live):
            fed = ids[name][-1] if fed_lead is None else fed_lead
            logits = timed(name, steps, torch.tensor([[fed]]), torch.tensor([n + i]))
            if logits is not None:
                ids[name].append(int(logits[0, -1].argmax()))
    speeds = {
        k: (n / statistics.median(pre[k]), 1.0 / statistics.median(steps[k]), ids[k]) for k in live
    }
    return speeds, errors


def _table(rows: list[DemoRow], *, tokens: int, new_tokens: int) -> str:
    base = rows[0] if rows and rows[0].name == "fp32" and rows[0].error is None else None
    head = (
        f"{'variant':<26} {'MiB':>5} {'ppl':>7} {'prefill tok/s':>13} {'decode tok/s':>12} "
        f"{'speed-up':>8} {'top-1 agree':>11} {'same greedy':>11}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.error:
            lines.append(f"{r.name:<26} FAILED: {r.error}")
            continue
        up = f"{r.decode_tokens_per_s / base.decode_tokens_per_s:.2f}x" if base else "-"
        same = f"{_common_prefix(r, base)}/{len(r.greedy)}" if base else "-"
        agree = f"{_agreement(r, base):.0%}" if base else "-"
        lines.append(
            f"{r.name:<26} {_mb(r.package_bytes):>5} {r.ppl:>7.2f} "
            f"{r.prefill_tokens_per_s:>13.0f} {r.decode_tokens_per_s:>12.1f} {up:>8} "
            f"{agree:>11} {same:>11}"
        )
    lines.append(
        f"AOTInductor packages with the KV cache inside. ppl: first {tokens} Lee tokens, "
        f"512-token windows. prefill: {_PROMPT_TOKENS} tokens in one call. decode: greedy, "
        f"{new_tokens} tokens, one call each (median). speed-up: decode vs fp32. top-1 agree: "
        "steps whose next token equals fp32's, each fed fp32's tokens. same greedy: leading "
        "tokens equal to fp32's."
    )
    return "\n".join(lines)


def run_demo(
    *,
    schemes: Sequence[str] = DEFAULT_SCHEMES,
    tokens: int = 1024,
    new_tokens: int = 32,
    prompt: str = "The three most important things to know about Paris are",
) -> list[DemoRow]:
    """Build (or take from the cache) SmolLM2's packages for fp32 and each recipe; measure them.

    Returns:
        One :class:`DemoRow` per variant, fp32 first.

    Raises:
        RuntimeError: after printing the table, if any variant failed (its row says why).
    """
    import fxquant
    from fxquant import assets
    from fxquant.packages import build_packages, load_tokenizer
    from fxquant.runtime import LLMPackage

    configs = {name: fxquant.QuantConfig.coerce(name) for name in schemes}  # typos fail now
    source = assets.smollm2_gguf()
    variants = {"fp32": None, **configs}
    t0 = time.perf_counter()
    # every package first: the missing ones are built side by side, one process each
    # (about two minutes each on two cores; the package cache serves every later run)
    # every position's logits: the packages score perplexity too (a deployed one keeps the
    # last position's only, export_llm's default, and prefills faster)
    built = build_packages(source, variants, max_cache_len=_CACHE_LEN, logits="all")
    if any(b.built for b in built.values()):
        print(f"packages built in {time.perf_counter() - t0:.0f} s (cached for the next run)")
    tokenizer = load_tokenizer(source)
    token_ids = torch.tensor(tokenizer(assets.lee_text("background")).input_ids[:tokens])
    prompt_ids = torch.tensor([tokenizer(assets.lee_text("test")).input_ids[:_PROMPT_TOKENS]])

    by_name = {name: DemoRow(name) for name in variants}
    pkgs = {}
    for name, row in by_name.items():
        try:
            b = built[name]
            row.from_cache, row.build_s = not b.built, b.build_s or None
            row.package_bytes = b.path.stat().st_size
            pkg = LLMPackage(b.path)
            row.ppl = _perplexity(pkg, token_ids, tokens)
            pkgs[name] = pkg
        except Exception as exc:  # noqa: BLE001 - reported in the table and re-raised below
            row.error = _error(exc)
            _say(f"[{name}] FAILED: {row.error}")
    # all of them loaded at once (about 1 GiB): timed side by side, see _speeds
    speeds, errors = _speeds(pkgs, prompt_ids, new_tokens)
    for name, row in by_name.items():
        if name in errors:
            row.error = errors[name]
            _say(f"[{name}] FAILED: {row.error}")
        elif name in speeds:
            row.prefill_tokens_per_s, row.decode_tokens_per_s, row.greedy = speeds[name]
            how = "from the cache" if row.from_cache else f"built in {row.build_s:.0f} s"
            _say(
                f"[{name}] package {_mb(row.package_bytes)} MiB ({how}), ppl {row.ppl:.2f}, "
                f"prefill {row.prefill_tokens_per_s:.0f} tok/s, decode "
                f"{row.decode_tokens_per_s:.1f} tok/s"
            )
    del pkgs
    gc.collect()  # the loaded packages hold their weights
    rows = list(by_name.values())

    print()
    print(_table(rows, tokens=min(tokens, token_ids.numel()), new_tokens=new_tokens))
    ok = [r for r in rows if r.error is None and r.name != "fp32"]
    if ok:
        best = max(ok, key=lambda r: r.decode_tokens_per_s)
        print(f"\n{best.name}, streamed:")
        stream = fxquant.generate(built[best.name].path, tokenizer, prompt, max_new_tokens=48)
        print(prompt, end="", flush=True)
        for piece in stream:
            print(piece, end="", flush=True)
        print(f"\n{stream.stats.summary()}")
    failed = [r.name for r in rows if r.error]
    if failed:
        raise RuntimeError(f"fxquant demo: {len(failed)} variant(s) failed: {', '.join(failed)}")
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
