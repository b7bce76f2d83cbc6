"""The ``fxquant`` command line: ``quantize``, ``generate``, ``report``, ``recipes``, ``demo``.

A thin shell over the entry points of ``fxquant.api``: it loads a model (a GGUF file, a Hugging
Face model directory, or ``module:function``), exports it with dynamic batch and sequence dims
(or, with ``--llm``, with its KV cache: ``fxquant.export_llm``), quantizes it, prints the
report and writes a ``.pt2`` and/or an AOTInductor package. ``generate`` streams text from an
LLM package through ``fxquant.runtime`` alone (no passes are imported), or builds (and caches)
the packages of a model first (``fxquant.packages``), one recipe or two side by side.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import torch
from torch.export import Dim

__all__ = ["main"]


def _config_from_args(args):
    from fxquant.core.config import QuantConfig, scheme_from_dict

    given = [a for a in ("recipe", "scheme", "config") if getattr(args, a)]
    if len(given) > 1:
        raise SystemExit(f"fxquant quantize: give one of --recipe/--scheme/--config, not {given}")
    if args.scheme:
        try:
            return QuantConfig(scheme=scheme_from_dict(json.loads(args.scheme)))
        except json.JSONDecodeError as e:
            raise SystemExit(f"fxquant quantize: --scheme is not JSON ({e}): {args.scheme}") from e
    if args.config:
        path = Path(args.config)
        if not path.is_file():
            raise SystemExit(f"fxquant quantize: --config {path}: no such file")
        try:
            return QuantConfig.from_json(path.read_text())
        except json.JSONDecodeError as e:
            raise SystemExit(f"fxquant quantize: --config {path} is not JSON ({e})") from None
    if args.recipe == "gguf":  # the file's own types, exactly: decided once the file is read
        if Path(args.source).suffix != ".gguf":
            raise SystemExit(
                f"fxquant quantize: --recipe gguf keeps a GGUF file's own types; {args.source} "
                "is not a .gguf file"
            )
        return None
    return QuantConfig.coerce(args.recipe or "int8wo")


def load_source(source: str, *, seq_len: int = 16, dtype: torch.dtype | None = None):
    """(model, example_inputs, dynamic_shapes) for a GGUF file, an HF directory or module:function.

    ``module:function`` must return ``(model, example_inputs)`` or
    ``(model, example_inputs, dynamic_shapes)``; its model comes in the dtype it makes, so
    ``dtype`` (default fp32) is for the other two only.
    """
    path = Path(source)
    if path.suffix == ".gguf" or path.is_dir():
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import transformers

        from fxquant.evaluate import CausalLMWrapper

        if path.suffix == ".gguf":
            if not path.is_file():
                raise SystemExit(f"fxquant: no GGUF file at {path}")
            kwargs = {"gguf_file": path.name}
            path = path.parent
            causal = True
        else:
            if not (path / "config.json").is_file():
                raise SystemExit(f"fxquant: {path} has no config.json: not a Hugging Face model")
            kwargs = {}
            archs = json.loads((path / "config.json").read_text()).get("architectures") or []
            causal = any(a.endswith("ForCausalLM") for a in archs)
        auto = transformers.AutoModelForCausalLM if causal else transformers.AutoModel
        from fxquant.packages import readable

        with readable(Path(source)):
            model = auto.from_pretrained(str(path), dtype=dtype or torch.float32, **kwargs).eval()
        wrapped = CausalLMWrapper(model) if causal else _HiddenStates(model)
        vocab = getattr(model.config, "vocab_size", 100)
        # Example sizes >= 2: torch.export specializes dims whose example size is 0 or 1.
        ids = torch.randint(0, vocab, (2, seq_len))
        return wrapped, (ids,), ({0: Dim.DYNAMIC, 1: Dim.DYNAMIC},)
    if ":" in source:
        if dtype is not None:
            raise SystemExit(
                f"fxquant: --dtype is for a .gguf file or a model folder; {source}() makes its "
                "model in the dtype it chooses"
            )
        module_name, _, fn_name = source.partition(":")
        # the current directory is searched last: a file there named like an installed package
        # (torch.py, transformers/) cannot shadow it
        if os.getcwd() not in sys.path:
            sys.path.append(os.getcwd())
        try:
            module = importlib.import_module(module_name)
            fn = getattr(module, fn_name)
        except (ImportError, AttributeError) as e:
            raise SystemExit(f"fxquant: cannot load {source!r}: {e}") from e
        # this runs the user's code: say whose
        print(f"running {module_name}.{fn_name}() from {module.__file__}", file=sys.stderr)
        result = fn()
        if not isinstance(result, tuple) or len(result) not in (2, 3):
            raise SystemExit(
                f"fxquant: {source}() must return (model, example_inputs[, dynamic_shapes]), "
                f"got {type(result).__name__}"
            )
        model, example_inputs, *rest = result
        return model, tuple(example_inputs), (rest[0] if rest else None)
    raise SystemExit(
        f"fxquant: {source!r} is neither a .gguf file, a Hugging Face model directory "
        "nor module:function"
    )


class _HiddenStates(torch.nn.Module):
    """An HF encoder as ``input_ids → last_hidden_state``: the graph that gets exported."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, input_ids):
        return self.model(input_ids=input_ids).last_hidden_state


def _dtype_arg(args) -> torch.dtype | None:
    """``--dtype`` as a torch dtype (None when not given)."""
    from fxquant.packages import DTYPES

    return None if args.dtype is None else DTYPES[args.dtype]


def _check_writable(flag: str, out: Path) -> None:
    if out.is_dir():
        raise SystemExit(f"fxquant quantize: {flag} {out} is a directory; give a file path (.pt2)")
    parent = out.resolve().parent
    if not parent.is_dir():
        raise SystemExit(f"fxquant quantize: {flag} {out}: the folder {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise SystemExit(f"fxquant quantize: {flag} {out}: the folder {parent} is not writable")


def _cmd_quantize(args) -> int:

    import fxquant

    config = _config_from_args(args)
    if not args.out and not args.aoti:
        raise SystemExit("fxquant quantize: give --out x.pt2 and/or --aoti package.pt2")
    if args.seq_len < 2:
        raise SystemExit(
            f"fxquant quantize: --seq-len {args.seq_len} is not supported; allowed: 2 or more "
            "(torch.export fixes a dim whose example size is 0 or 1)"
        )
    for flag, out in (("--out", args.out), ("--aoti", args.aoti)):
        if out:  # before minutes of loading and quantizing, not after
            _check_writable(flag, Path(out))
    dtype = _dtype_arg(args)
    if args.llm:
        from fxquant.packages import load_causal_lm

        path = Path(args.source)
        if path.suffix != ".gguf" and not path.is_dir():
            raise SystemExit(
                "fxquant quantize --llm: the source must be a .gguf file or a model folder"
            )
        try:
            model = load_causal_lm(path, dtype=dtype or torch.float32)
        except FileNotFoundError as e:
            raise SystemExit(str(e)) from e
        cache_len = args.max_cache_len
        if cache_len is None:
            cache_len = _capped_cache_len(model.config, 2048)
        print(f"exporting {args.source} with a KV cache of {cache_len} ...", file=sys.stderr)
        ep = fxquant.export_llm(
            model, max_cache_len=cache_len, max_batch=args.max_batch, logits=args.logits
        )
    else:
        model, example_inputs, dynamic_shapes = load_source(
            args.source, seq_len=args.seq_len, dtype=dtype
        )
        print(f"exporting {args.source} ...", file=sys.stderr)
        ep = torch.export.export(model, example_inputs, dynamic_shapes=dynamic_shapes)
    weights = None
    if Path(args.source).suffix == ".gguf":
        # transformers dequantized the file to float: layers whose scheme is the one the file's
        # blocks map to take those blocks instead of being quantized a second time
        from fxquant.checkpoints.gguf import exact_plan
        from fxquant.packages import readable

        with readable(Path(args.source)):
            plan = exact_plan(args.source, ep, config)
        config, weights = plan.config, plan.weights
        print(plan.summary, file=sys.stderr)
    qep = fxquant.quantize(ep, config, progress=True, weights=weights)
    rep = fxquant.report(qep)
    print(rep)
    if args.aoti:  # the package is built for this CPU: which kernel each layer runs, by M
        print("\n" + rep.cpu_kernels_table())
    if args.out:
        out = Path(args.out)
        with fxquant.api.atomic_path(out) as tmp:  # never a half-written .pt2 at the final path
            torch.export.save(qep, tmp)
        print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    if args.aoti:
        print("compiling the AOTInductor package ...", file=sys.stderr)
        extra = {"source": str(Path(args.source).resolve())} if args.llm else None
        fxquant.aot_compile(qep, args.aoti, metadata=extra)
        print(f"wrote {args.aoti} ({Path(args.aoti).stat().st_size / 2**20:.1f} MiB)")
    return 0


def _cmd_report(args) -> int:

    import fxquant
    from fxquant.safe_load import ProgramLoadError, load_program

    path = Path(args.program)
    if not path.is_file():
        raise SystemExit(f"fxquant report: no file at {path}")
    try:
        ep = load_program(path)  # never unpickles code from the file
    except ProgramLoadError as e:
        raise SystemExit(f"fxquant report: {e}") from None
    rep = fxquant.report(ep)
    if args.json:
        print(json.dumps({**rep.to_dict(), "cpu_kernels": rep.cpu_kernels()}, indent=2))
    elif not rep.rows:
        print(f"{path}: no fxquant layers (not made by fxquant.quantize?)")
    else:
        print(rep)
        print("\n" + rep.cpu_kernels_table())
    return 0


def _is_package(path: Path) -> bool:
    import zipfile

    if path.suffix != ".pt2" or not zipfile.is_zipfile(path):
        return False
    with zipfile.ZipFile(path) as zf:
        return any(n.endswith("wrapper_metadata.json") for n in zf.namelist())


def _generate_one(pkg, tokenizer, args, *, stream: bool):
    from fxquant.runtime import generate

    out = generate(
        pkg,
        tokenizer,
        args.prompt,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        seed=args.seed,
    )
    if stream:
        print(args.prompt, end="", flush=True)
        for piece in out:
            print(piece, end="", flush=True)
        print()
    else:
        out.text()
    return out


def _cmd_generate(args) -> int:
    # Serving a package imports fxquant.runtime (torch only) and a tokenizer; building one (a
    # model as the source) takes the whole pipeline, through fxquant.packages.
    from fxquant.runtime import LLMPackage, PackageError

    source = Path(args.source)
    if not source.exists():
        raise SystemExit(f"fxquant generate: no file or folder at {source}")
    try:
        if _is_package(source):
            if args.compare or args.recipe or args.dtype:
                raise SystemExit(
                    "fxquant generate: --recipe/--compare/--dtype build packages from a model; "
                    f"{source} is a package already"
                )
            pkg = LLMPackage(source)
            tokenizer = _tokenizer(args.tokenizer or pkg.info.get("source"), source)
            out = _generate_one(pkg, tokenizer, args, stream=True)
            print(out.stats.summary())
            return 0
        return _generate_from_model(source, args)
    except PackageError as e:
        raise SystemExit(f"fxquant generate: {e}") from e


def _tokenizer(where, package: Path):
    from fxquant.packages import load_tokenizer

    if not where:
        raise SystemExit(
            f"fxquant generate: {package} does not say which model it was made from; "
            "give --tokenizer path/to/model(.gguf)"
        )
    try:
        return load_tokenizer(where)
    except (OSError, ValueError) as e:
        raise SystemExit(f"fxquant generate: cannot load a tokenizer from {where}: {e}") from e


def _generate_from_model(source: Path, args) -> int:
    import functools

    from fxquant.packages import DTYPES, llm_package, load_causal_lm, load_tokenizer
    from fxquant.runtime import LLMPackage

    dtype = args.dtype or "fp32"
    variants = []  # (name, recipe or None for the float model, dtype name)
    for r in [args.recipe or "int8wo", *([args.compare] if args.compare else [])]:
        if r in DTYPES:  # fp32 / bf16 / fp16: the float model in that dtype
            variants.append((r, None, r))
        else:
            _recipe_config(r)  # a typo fails now, not after minutes of building
            variants.append((r if dtype == "fp32" else f"{r} ({dtype})", r, dtype))
    needed = len(args.prompt) + args.max_new_tokens  # characters: at least the tokens
    cache_len = args.max_cache_len or _default_cache_len(source, -(-needed // 256) * 256)
    tokenizer = load_tokenizer(args.tokenizer or source)
    # each dtype's model loaded once, only if a build needs it
    models = {
        d: functools.cache(functools.partial(load_causal_lm, source, dtype=DTYPES[d]))
        for d in DTYPES
    }
    rows = []
    for name, recipe, d in variants:
        built = llm_package(
            source, recipe, max_cache_len=cache_len, model=models[d], dtype=DTYPES[d]
        )
        how = f"built in {built.build_s:.0f} s" if built.built else "from the cache"
        print(f"[{name}] package {built.path} ({how})", file=sys.stderr)
        pkg = LLMPackage(built.path)
        out = _generate_one(pkg, tokenizer, args, stream=not args.compare)
        rows.append((name, out, built.path.stat().st_size))
        if not args.compare:
            print(out.stats.summary())
        del pkg
    if args.compare:
        print(_compare_table(rows, tokenizer))
    return 0


def _default_cache_len(source: Path, wanted: int) -> int:
    """``wanted`` cache positions (at least 256), or fewer where the model takes no more (its
    positional limit): a request that outgrows them is refused at generate time, with the
    lengths, not as an export error."""
    from fxquant.packages import load_config

    return _capped_cache_len(load_config(source), max(256, wanted))


def _capped_cache_len(config, wanted: int) -> int:
    """``wanted`` cache positions, or the model's positional limit where that is fewer (a
    default cache length the export would otherwise refuse)."""
    from fxquant.llm import cache_len_limit

    limit = cache_len_limit(config)
    return wanted if limit is None else max(2, min(wanted, limit))


def _recipe_config(name: str):
    from fxquant.core.config import QuantConfig

    try:
        return QuantConfig.coerce(name)
    except ValueError as e:
        raise SystemExit(f"fxquant generate: {e}") from e


def _compare_table(rows, tokenizer) -> str:
    base = rows[0][1].token_ids
    head = (
        f"{'variant':<26} {'decode tok/s':>12} {'prefill tok/s':>13} {'package MiB':>11} "
        f"{'same greedy':>11}"
    )
    lines = [head, "-" * len(head)]
    for name, out, size in rows:
        same = next(
            (i for i, (a, b) in enumerate(zip(out.token_ids, base, strict=False)) if a != b), None
        )
        same = min(len(out.token_ids), len(base)) if same is None else same
        lines.append(
            f"{name:<26} {out.stats.decode_tokens_per_s:>12.1f} "
            f"{out.stats.prefill_tokens_per_s:>13.0f} {size / 2**20:>11.1f} "
            f"{same:>5}/{len(out.token_ids):<5}"
        )
    lines.append(
        f"same greedy: leading tokens equal to {rows[0][0]}'s; completion of {rows[0][0]}:"
    )
    lines.append(repr(tokenizer.decode(base, skip_special_tokens=True)))
    return "\n".join(lines)


def _cmd_recipes(args) -> int:
    from fxquant.core.config import RECIPES

    for name, scheme in RECIPES.items():
        print(f"{name:12s} {scheme}")
    print(
        "\nAny recipe + '+lm_head' quantizes lm_head too (same scheme), or '+lm_head=<recipe>' "
        "with another one, e.g. int4wo-64+lm_head=int8wo"
    )
    return 0


def _cmd_demo(args) -> int:
    from fxquant.demo import run_from_args

    run_from_args(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from fxquant.demo import add_demo_arguments
    from fxquant.llm import LOGITS
    from fxquant.packages import DTYPES

    # the module docstring is RST; --help shows it without the double backticks
    description = __doc__.splitlines()[0].replace("``", "")
    parser = argparse.ArgumentParser(prog="fxquant", description=description)
    parser.add_argument(
        "--version", action="version", version=f"fxquant {_version()} (torch {torch.__version__})"
    )
    sub = parser.add_subparsers(dest="command", required=True)
    # every subcommand takes --debug (after its name, where users type it)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("--debug", action="store_true", help="on an error, show the full traceback")

    q = sub.add_parser(
        "quantize", parents=[common], help="quantize a model and write a .pt2 / AOTInductor package"
    )
    q.add_argument(
        "source",
        help="a .gguf file, a Hugging Face model directory, or module:function (imports that "
        "module and runs the function: your code; the current directory is searched after "
        "installed packages)",
    )
    q.add_argument(
        "--recipe",
        help="a recipe name (see `fxquant recipes`); default int8wo. For a .gguf source, "
        "`gguf` keeps the file's own quantized blocks as they are (Q4_0/Q4_1/Q4_K/Q6_K, Q8_0 with "
        "one scale per row), and any recipe whose scheme is what a layer's blocks map to uses "
        "them exactly",
    )
    q.add_argument("--scheme", help='a scheme as JSON, e.g. \'{"type": "Int4WeightOnly", ...}\'')
    q.add_argument("--config", help="a QuantConfig JSON file (QuantConfig.to_json())")
    q.add_argument("--out", help="write the quantized torch.export program here (.pt2)")
    q.add_argument("--aoti", help="write an AOTInductor package here (.pt2)")
    q.add_argument("--seq-len", type=int, default=16, help="example sequence length for export")
    q.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="for a .gguf file or a model folder: the dtype to load the model in before it is "
        "quantized (default fp32; bf16 halves what stays in float, the tied embedding among it, "
        "and the KV cache)",
    )
    q.add_argument(
        "--llm",
        action="store_true",
        help="export a causal LM with its KV cache (prefill and decode in one program, for "
        "fxquant generate) instead of input_ids -> logits",
    )
    q.add_argument(
        "--max-cache-len",
        type=int,
        default=None,
        help="with --llm: cache positions (default 2048, or the model's positional limit "
        "where that is fewer)",
    )
    q.add_argument("--max-batch", type=int, default=1, help="with --llm: sequences per call")
    q.add_argument(
        "--logits",
        choices=LOGITS,
        default="last",
        help="with --llm: the last position's logits (for generating; prefill skips the LM head "
        "on the other prompt tokens) or every position's (for scoring text)",
    )
    q.set_defaults(fn=_cmd_quantize)

    g = sub.add_parser(
        "generate",
        parents=[common],
        help="stream text from an LLM package, or build (cached) packages of a model and run them",
    )
    g.add_argument(
        "source",
        help="an LLM package (.pt2 from fxquant quantize --llm --aoti), or a .gguf file / Hugging "
        "Face model folder to build packages of (cached in ~/.cache/fxquant/packages)",
    )
    g.add_argument(
        "--tokenizer",
        help="model file or folder to take the tokenizer from "
        "(default: the model the package was made from)",
    )
    g.add_argument("--prompt", default="Once upon a time", help="default: %(default)r")
    g.add_argument("--max-new-tokens", type=int, default=64, help="default: %(default)s")
    g.add_argument("--temperature", type=float, default=0.0, help="0 (default): greedy")
    g.add_argument("--top-k", type=int, default=0, help="sample from the k likeliest (0: all)")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (1: all)")
    g.add_argument("--seed", type=int, default=None, help="makes sampling reproducible")
    g.add_argument(
        "--recipe",
        help="with a model source: the recipe to build (default int8wo), or fp32 / bf16 / fp16 "
        "for the float model in that dtype",
    )
    g.add_argument(
        "--compare",
        help="with a model source: also build this recipe (or fp32 / bf16 / fp16) and print "
        "both side by side",
    )
    g.add_argument(
        "--dtype",
        choices=list(DTYPES),
        default=None,
        help="with a model source: the dtype the model is loaded in before a recipe quantizes "
        "it (default fp32; bf16 halves what stays in float, the tied embedding among it, and "
        "the KV cache)",
    )
    g.add_argument(
        "--max-cache-len",
        type=int,
        default=None,
        help="with a model source: cache positions (default: prompt + new tokens, "
        "rounded up to 256, at most the model's positional limit)",
    )
    g.set_defaults(fn=_cmd_generate)

    r = sub.add_parser(
        "report", parents=[common], help="print the per-layer report of a quantized .pt2"
    )
    r.add_argument("program")
    r.add_argument("--json", action="store_true", help="print the rows as JSON")
    r.set_defaults(fn=_cmd_report)

    sub.add_parser("recipes", parents=[common], help="list the named recipes").set_defaults(
        fn=_cmd_recipes
    )

    d = sub.add_parser(
        "demo", parents=[common], help="SmolLM2-135M: fp32 vs quantized size, perplexity and speed"
    )
    add_demo_arguments(d)
    d.set_defaults(fn=_cmd_demo)
    return parser


def _version() -> str:
    import fxquant

    return fxquant.__version__


def main(argv: Sequence[str] | None = None) -> int:
    # torch.export's own pytree pickling warns on every save/load in torch 2.13: not actionable.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    args = build_parser().parse_args(argv)
    # fxquant's warnings (a config pattern that matched nothing, ...) as one plain line, for
    # this command only (main() also runs in-process, from tests and scripts)
    plain, warnings.formatwarning = warnings.formatwarning, _one_line_warning
    try:
        return args.fn(args)
    except BrokenPipeError:
        # `fxquant report --json | head`: the reader left early, which is not an error; point
        # stdout at /dev/null so the interpreter's final flush does not raise again
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except KeyboardInterrupt:
        print(f"fxquant {args.command}: interrupted", file=sys.stderr)
        return 130
    except Exception as e:  # noqa: BLE001  (the CLI's edge: one line, the traceback on --debug)
        if args.debug:
            raise
        raise SystemExit(f"fxquant {args.command}: {_one_line(e, args)}") from None
    finally:
        warnings.formatwarning = plain


def _one_line_warning(message, *_, **__) -> str:
    return f"fxquant: warning: {message}\n"


def _one_line(e: Exception, args) -> str:
    """An error as one line: what went wrong, in which file, and how to see more."""
    text = " ".join(str(e).split()) or type(e).__name__
    if not isinstance(e, ValueError):  # fxquant's own errors are ValueErrors that say it all
        text = f"{type(e).__module__.removeprefix('builtins')}.{type(e).__name__}: {text}"
        text = text.lstrip(".")
    path = getattr(args, "source", None) or getattr(args, "program", None)
    if path and str(path) not in text and not isinstance(e, ValueError):
        text = f"{path}: {text}"
    if len(text) > 400:
        text = text[:400] + " ..."
    return f"{text} (--debug shows the traceback)"


if __name__ == "__main__":
    sys.exit(main())
