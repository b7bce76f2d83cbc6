"""End-to-end demo on a real model: SmolLM2-135M through every stage of the data flow.

Where this sits: it drives the whole pipeline once, the way a user would. SmolLM2 is loaded
(:mod:`fxquant.assets`), exported once with dynamic batch and sequence
(:func:`fxquant.evaluate.export_causal_lm`); then for fp32 and each recipe the program is
quantized (``fxquant.quantize``), reported (``fxquant.report``), saved as a ``.pt2``
(``torch.export.save``) and packaged by AOTInductor (``fxquant.aot_compile``). The loaded
package — the artifact that ships — is what perplexity and decode speed are measured on, so
the table says what a deployment gets, lowering included. The fp32 row goes through the same
``aot_compile`` with no quantized ops in it, so the speed ratios compare like with like.

Run it as ``fxquant demo`` (or ``python -m fxquant.demo``); ``--quick`` scores fewer tokens.
Expect minutes per recipe on 2 CPU cores, most of it in the AOTInductor C++ build.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import statistics
import tempfile
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

import fxquant
from fxquant import assets, evaluate

__all__ = ["DEFAULT_SCHEMES", "DemoRow", "add_demo_arguments", "main", "run_demo"]

DEFAULT_SCHEMES = ("int8wo", "fp8-row", "int4wo-64")
_QUICK_TOKENS = 512  # one perplexity window: enough to see a broken recipe, not to rank them


@dataclass
class DemoRow:
    """One line of the final table: a variant (``"fp32"`` or a recipe name) and what it got."""

    name: str
    pt2_bytes: int | None = None
    package_bytes: int | None = None
    ppl: float | None = None
    tokens_per_s: float | None = None
    greedy: torch.Tensor | None = None  # decoded ids, compared with fp32's in the table
    quantize_s: float | None = None
    compile_s: float | None = None
    error: str | None = None


def add_demo_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the ``fxquant demo`` options to ``parser`` (the CLI calls this for its subcommand)."""
    parser.add_argument(
        "--schemes",
        default=",".join(DEFAULT_SCHEMES),
        help="comma-separated recipe names to compare with fp32 (default: %(default)s)",
    )
    parser.add_argument(
        "--tokens",
        type=int,
        default=2048,
        help="Lee background tokens scored for perplexity (default: %(default)s)",
    )
    parser.add_argument(
        "--new-tokens",
        type=int,
        default=16,
        help="greedy tokens decoded for the speed figure (default: %(default)s)",
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help=f"score {_QUICK_TOKENS} tokens and decode 8: a smoke run, not a measurement",
    )
    parser.add_argument(
        "--out-dir",
        type=Path,
        default=None,
        help="keep the .pt2 files and AOTInductor packages here (default: a temporary folder)",
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
    tokens = _QUICK_TOKENS if args.quick else args.tokens
    new_tokens = 8 if args.quick else args.new_tokens
    rows = run_demo(schemes=schemes, tokens=tokens, new_tokens=new_tokens, out_dir=args.out_dir)
    if args.json is not None:
        write_json(rows, args.json, tokens=tokens, new_tokens=new_tokens)
    return rows


def write_json(rows: list[DemoRow], path: Path, *, tokens: int, new_tokens: int) -> None:
    """The demo's figures as JSON (what the README's demo table is made from)."""
    import json
    import os
    import platform

    record = {
        "script": "fxquant demo",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "machine": {
            "cpu": platform.processor() or platform.machine(),
            "cores": os.cpu_count(),
            "torch": torch.__version__,
        },
        "perplexity_tokens": tokens,
        "decode_new_tokens": new_tokens,
        "rows": [
            {
                **{k: v for k, v in vars(r).items() if k != "greedy"},
                "greedy_same_as_fp32": None
                if r.greedy is None or rows[0].greedy is None
                else _common_prefix(r.greedy, rows[0].greedy),
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


@contextlib.contextmanager
def _workdir(out_dir: str | Path | None) -> Iterator[Path]:
    if out_dir is not None:
        path = Path(out_dir)
        path.mkdir(parents=True, exist_ok=True)
        yield path
    else:
        # Packages are ~100-500 MB each: do not leave them behind unless asked to.
        with tempfile.TemporaryDirectory(prefix="fxquant-demo-") as tmp:
            yield Path(tmp)


def _mb(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:.1f}"


def _unique_param_bytes(model: torch.nn.Module) -> tuple[int, int]:
    # Tied embeddings share one storage: count each storage once, as a saved file does.
    seen, numel, nbytes = set(), 0, 0
    for p in model.parameters():
        key = p.untyped_storage().data_ptr()
        if key not in seen:
            seen.add(key)
            numel += p.numel()
            nbytes += p.numel() * p.element_size()
    return numel, nbytes


def _say(msg: str) -> None:
    from tqdm.auto import tqdm

    tqdm.write(msg)  # keeps the progress bar at the bottom intact


def _measure(
    name: str,
    ep: torch.export.ExportedProgram,
    *,
    token_ids: torch.Tensor,
    prompt_ids: torch.Tensor,
    tokens: int,
    new_tokens: int,
    workdir: Path,
    bar,
) -> DemoRow:
    row = DemoRow(name)
    if name == "fp32":
        program = ep
    else:
        bar.set_description(f"{name}: quantize")
        t0 = time.perf_counter()
        program = fxquant.quantize(ep, name, progress=True)
        row.quantize_s = time.perf_counter() - t0
        _say(f"\n[{name}] quantized in {row.quantize_s:.1f} s")
        _say(fxquant.report(program).summary())
    bar.update()

    bar.set_description(f"{name}: save .pt2")
    pt2 = workdir / f"smollm2-{name}.pt2"
    torch.export.save(program, pt2)
    row.pt2_bytes = pt2.stat().st_size
    bar.update()

    bar.set_description(f"{name}: AOTInductor")
    package = workdir / f"smollm2-{name}-aoti.pt2"
    t0 = time.perf_counter()
    compiled = fxquant.aot_compile(program, package)
    row.compile_s = time.perf_counter() - t0
    row.package_bytes = package.stat().st_size if package.exists() else None
    _say(f"[{name}] AOTInductor package built and loaded in {row.compile_s:.1f} s")
    bar.update()

    bar.set_description(f"{name}: perplexity")
    row.ppl = evaluate.perplexity(compiled, token_ids, max_tokens=tokens)
    bar.update()

    bar.set_description(f"{name}: decode")
    times: list[float] = []
    row.greedy = evaluate.greedy_decode(
        compiled, prompt_ids, new_tokens=new_tokens, step_times=times
    )
    row.tokens_per_s = 1.0 / statistics.median(times[1:])  # as decode_tokens_per_s does
    bar.update()
    _say(
        f"[{name}] .pt2 {_mb(row.pt2_bytes)} MB, package {_mb(row.package_bytes)} MB, "
        f"ppl {row.ppl:.2f}, decode {row.tokens_per_s:.2f} tok/s"
    )
    return row


def _common_prefix(a: torch.Tensor, b: torch.Tensor) -> int:
    # Leading tokens that agree: after the first divergence the contexts differ, so agreement
    # further on says nothing about the quantization error.
    n = min(a.numel(), b.numel())
    diff = (a[:n] != b[:n]).nonzero()
    return int(diff[0]) if diff.numel() else n


def _table(rows: list[DemoRow], *, tokens: int, new_tokens: int) -> str:
    base = rows[0] if rows and rows[0].name == "fp32" and rows[0].error is None else None
    head = (
        f"{'variant':<11} {'.pt2 MB':>8} {'size':>6} {'ppl':>8} {'Δppl':>7} "
        f"{'tok/s':>7} {'speed':>6} {'same greedy':>11} {'compile s':>9}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if r.error:
            lines.append(f"{r.name:<11} FAILED: {r.error}")
            continue
        size = f"{r.pt2_bytes / base.pt2_bytes:.2f}x" if base else "-"
        dppl = f"{r.ppl - base.ppl:+.2f}" if base else "-"
        speed = f"{r.tokens_per_s / base.tokens_per_s:.2f}x" if base else "-"
        same = f"{_common_prefix(r.greedy, base.greedy)}/{r.greedy.numel()}" if base else "-"
        lines.append(
            f"{r.name:<11} {_mb(r.pt2_bytes):>8} {size:>6} {r.ppl:>8.2f} {dppl:>7} "
            f"{r.tokens_per_s:>7.2f} {speed:>6} {same:>11} {r.compile_s:>9.0f}"
        )
    lines.append(
        f"ppl: first {tokens} tokens of lee_background.cor, 512-token windows, no BOS. "
        f"tok/s: greedy, {new_tokens} tokens, no KV cache (full sequence each step), "
        "AOTInductor package, median step. same greedy: leading tokens equal to fp32's."
    )
    return "\n".join(lines)


def run_demo(
    *,
    schemes: Sequence[str] = DEFAULT_SCHEMES,
    tokens: int = 2048,
    new_tokens: int = 16,
    prompt_tokens: int = 64,
    out_dir: str | Path | None = None,
) -> list[DemoRow]:
    """Quantize SmolLM2 with each recipe, then compare size, perplexity and decode speed.

    Args:
        schemes: recipe names for ``fxquant.quantize`` (fp32 is always measured first).
        tokens: Lee background tokens scored for perplexity (512 per window).
        new_tokens: greedy tokens decoded per variant (the first is a warm-up, not timed).
        prompt_tokens: length of the decode prompt, taken from ``lee.cor`` (held-out text).
        out_dir: where to write the ``.pt2`` files and packages; a temporary folder if None.

    Returns:
        One :class:`DemoRow` per variant, fp32 first.

    Raises:
        RuntimeError: after printing the table, if any variant failed (its row says why).
    """
    from tqdm.auto import tqdm

    for name in schemes:
        fxquant.from_recipe_name(name)  # a typo fails now, not after minutes of fp32 work

    t0 = time.perf_counter()
    model, tokenizer = assets.load_smollm2()
    numel, nbytes = _unique_param_bytes(model)
    print(
        f"SmolLM2-135M-Instruct: {numel / 1e6:.1f}M parameters, {nbytes / 2**20:.1f} MB fp32 "
        f"(tied embeddings counted once); loaded in {time.perf_counter() - t0:.1f} s"
    )
    token_ids = torch.tensor(tokenizer(assets.lee_text("background")).input_ids[:tokens])
    prompt_ids = torch.tensor(tokenizer(assets.lee_text("test")).input_ids[:prompt_tokens])

    t0 = time.perf_counter()
    ep = evaluate.export_causal_lm(model)
    print(f"exported once, dynamic batch and seq, in {time.perf_counter() - t0:.1f} s")

    rows: list[DemoRow] = []
    variants = ["fp32", *schemes]
    with _workdir(out_dir) as workdir:
        bar = tqdm(total=5 * len(variants), desc="demo", unit="step")
        for name in variants:
            done = bar.n
            try:
                row = _measure(
                    name,
                    ep,
                    token_ids=token_ids,
                    prompt_ids=prompt_ids,
                    tokens=tokens,
                    new_tokens=new_tokens,
                    workdir=workdir,
                    bar=bar,
                )
            except Exception as exc:  # noqa: BLE001 - reported in the table and re-raised below
                row = DemoRow(name, error=f"{type(exc).__name__}: {exc}".splitlines()[0][:200])
                _say(f"[{name}] FAILED: {row.error}")
                bar.update(5 - (bar.n - done))
            rows.append(row)
            gc.collect()  # a loaded package holds its weights: free one before the next
        bar.close()

    print()
    print(_table(rows, tokens=min(tokens, token_ids.numel()), new_tokens=new_tokens))
    failed = [r.name for r in rows if r.error]
    if failed:
        raise RuntimeError(f"fxquant demo: {len(failed)} variant(s) failed: {', '.join(failed)}")
    return rows


if __name__ == "__main__":
    raise SystemExit(main())
