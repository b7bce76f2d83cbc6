"""The ``fxquant`` command line: ``quantize``, ``report``, ``recipes`` and ``demo``.

A thin shell over the entry points of ``fxquant.api``: it loads a model (a GGUF file, a Hugging
Face model directory, or ``module:function``), exports it with dynamic batch and sequence dims,
quantizes it, prints the report and writes a ``.pt2`` and/or an AOTInductor package.
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
    from fxquant.config import QuantConfig, scheme_from_dict

    given = [a for a in ("recipe", "scheme", "config") if getattr(args, a)]
    if len(given) > 1:
        raise SystemExit(f"fxquant quantize: give one of --recipe/--scheme/--config, not {given}")
    if args.scheme:
        try:
            return QuantConfig(scheme=scheme_from_dict(json.loads(args.scheme)))
        except json.JSONDecodeError as e:
            raise SystemExit(f"fxquant quantize: --scheme is not JSON ({e}): {args.scheme}") from e
    if args.config:
        return QuantConfig.from_json(Path(args.config).read_text())
    return QuantConfig.coerce(args.recipe or "int8wo")


def load_source(source: str, *, seq_len: int = 16):
    """(model, example_inputs, dynamic_shapes) for a GGUF file, an HF directory or module:function.

    ``module:function`` must return ``(model, example_inputs)`` or
    ``(model, example_inputs, dynamic_shapes)``.
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
        model = auto.from_pretrained(str(path), dtype=torch.float32, **kwargs).eval()
        wrapped = CausalLMWrapper(model) if causal else _HiddenStates(model)
        vocab = getattr(model.config, "vocab_size", 100)
        # Example sizes >= 2: torch.export specializes dims whose example size is 0 or 1.
        ids = torch.randint(0, vocab, (2, seq_len))
        return wrapped, (ids,), ({0: Dim.DYNAMIC, 1: Dim.DYNAMIC},)
    if ":" in source:
        module_name, _, fn_name = source.partition(":")
        sys.path.insert(0, os.getcwd())
        try:
            fn = getattr(importlib.import_module(module_name), fn_name)
        except (ImportError, AttributeError) as e:
            raise SystemExit(f"fxquant: cannot load {source!r}: {e}") from e
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


def _cmd_quantize(args) -> int:

    import fxquant

    config = _config_from_args(args)
    if not args.out and not args.aoti:
        raise SystemExit("fxquant quantize: give --out x.pt2 and/or --aoti package.pt2")
    model, example_inputs, dynamic_shapes = load_source(args.source, seq_len=args.seq_len)
    print(f"exporting {args.source} ...", file=sys.stderr)
    ep = torch.export.export(model, example_inputs, dynamic_shapes=dynamic_shapes)
    qep = fxquant.quantize(ep, config, progress=True)
    print(fxquant.report(qep))
    if args.out:
        out = Path(args.out)
        with fxquant.api.atomic_path(out) as tmp:  # never a half-written .pt2 at the final path
            torch.export.save(qep, tmp)
        print(f"wrote {out} ({out.stat().st_size / 2**20:.1f} MiB)")
    if args.aoti:
        print("compiling the AOTInductor package ...", file=sys.stderr)
        fxquant.aot_compile(qep, args.aoti)
        print(f"wrote {args.aoti} ({Path(args.aoti).stat().st_size / 2**20:.1f} MiB)")
    return 0


def _cmd_report(args) -> int:

    import fxquant

    path = Path(args.program)
    if not path.is_file():
        raise SystemExit(f"fxquant report: no file at {path}")
    try:
        ep = torch.export.load(path)
    except Exception as e:  # noqa: BLE001  (any load failure: say which file and why)
        raise SystemExit(f"fxquant report: {path} is not a loadable torch.export .pt2: {e}") from e
    rep = fxquant.report(ep)
    if args.json:
        print(json.dumps(rep.to_dict(), indent=2))
    elif not rep.rows:
        print(f"{path}: no fxquant layers (not made by fxquant.quantize?)")
    else:
        print(rep)
    return 0


def _cmd_recipes(args) -> int:
    from fxquant.config import RECIPES

    for name, scheme in RECIPES.items():
        print(f"{name:12s} {scheme}")
    return 0


def _cmd_demo(args) -> int:
    from fxquant.demo import run_from_args

    run_from_args(args)
    return 0


def build_parser() -> argparse.ArgumentParser:
    from fxquant.demo import add_demo_arguments

    parser = argparse.ArgumentParser(prog="fxquant", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)

    q = sub.add_parser("quantize", help="quantize a model and write a .pt2 / AOTInductor package")
    q.add_argument(
        "source", help="a .gguf file, a Hugging Face model directory, or module:function"
    )
    q.add_argument("--recipe", help="a recipe name (see `fxquant recipes`); default int8wo")
    q.add_argument("--scheme", help='a scheme as JSON, e.g. \'{"type": "Int4WeightOnly", ...}\'')
    q.add_argument("--config", help="a QuantConfig JSON file (QuantConfig.to_json())")
    q.add_argument("--out", help="write the quantized torch.export program here (.pt2)")
    q.add_argument("--aoti", help="write an AOTInductor package here (.pt2)")
    q.add_argument("--seq-len", type=int, default=16, help="example sequence length for export")
    q.set_defaults(fn=_cmd_quantize)

    r = sub.add_parser("report", help="print the per-layer report of a quantized .pt2")
    r.add_argument("program")
    r.add_argument("--json", action="store_true", help="print the rows as JSON")
    r.set_defaults(fn=_cmd_report)

    sub.add_parser("recipes", help="list the named recipes").set_defaults(fn=_cmd_recipes)

    d = sub.add_parser("demo", help="SmolLM2-135M: fp32 vs quantized size, perplexity and speed")
    add_demo_arguments(d)
    d.set_defaults(fn=_cmd_demo)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    # torch.export's own pytree pickling warns on every save/load in torch 2.13: not actionable.
    warnings.filterwarnings("ignore", message=r".*isinstance\(treespec, LeafSpec\)")
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except ValueError as e:  # config and input errors: say what, without a traceback
        raise SystemExit(f"fxquant {args.command}: {e}") from e


if __name__ == "__main__":
    sys.exit(main())
