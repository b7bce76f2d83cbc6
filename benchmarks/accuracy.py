"""How much accuracy does each scheme cost on real models, beside the peers?

Two real models, fp32 CPU, every fxquant recipe (``fxquant.RECIPES``) next to what a PyTorch
user would reach for instead:

- **SmolLM2-135M** (causal LM): perplexity on the first N tokens (default 8192) of
  ``lee_background.cor`` and of the cleaned Wikipedia text (``assets.wiki_text``), 512-token
  non-overlapping windows, no BOS (the protocol of docs/assets.md, ``evaluate.perplexity``).
  The model is exported once (``evaluate.export_causal_lm``, dynamic batch and seq); each recipe is
  ``fxquant.quantize``-d from that program and run as the quantized program
  (``qep.module()``). Spot check (``--aoti-check``, default on): the int8wo AOTInductor package
  (``fxquant.aot_compile``) on the first 1024 Lee tokens against the program on the same tokens.
- **all-MiniLM-L6-v2** (sentence encoder): embeddings (attention-mask mean of
  ``last_hidden_state``, L2-normalised) of the first ``--sentences`` sentences of
  ``lee_background.cor``, 64 per padded batch; mean and min cosine to the fp32 embeddings and
  top-1 nearest-neighbour agreement (is each sentence's nearest other sentence the same one as
  under fp32). The encoder is exported as ``(input_ids, attention_mask) → last_hidden_state``
  with dynamic batch and seq, then quantized per recipe as above.

Calibrated rows (``--calibrated``; the full run's default is ``autoround-int4-64``):
``fxquant.calibrate`` with AutoRound, AWQ or GPTQ onto ``Int4WeightOnly(group_size=64)``, beside
the ``int4wo-64`` round-to-nearest row. Their data is never the evaluated text: SmolLM2 reads 32
windows of 512 Wikipedia tokens after the evaluated ones, MiniLM 8 batches of 16 Wikipedia
passages.

Peers, run eager on the same model and text, each beside the fxquant recipe it matches:
``torch.ao.quantization.quantize_dynamic`` (qint8, all ``nn.Linear`` but ``lm_head``: a w8a8
peer with per-tensor dynamic activations; with the default qconfig, per-tensor weights, and with
``per_channel_dynamic_qconfig``, per-channel weights like fxquant's) and torchao
``quantize_`` with Int8WeightOnlyConfig, Int4WeightOnlyConfig(group_size=64/128),
Int8DynamicActivationInt8WeightConfig, Float8WeightOnlyConfig and
Float8DynamicActivationFloat8WeightConfig (default per-tensor, and PerRow). torchao is imported
lazily; a config that cannot run on this CPU build gets a ``skipped: <reason>`` row. Note that
torchao's int4 leaves a layer in float when K is not a multiple of the group (SmolLM2's d=576
with g128): the ``linears_quantized`` column says how many were converted. ``lm_head`` stays
float everywhere (fxquant's default ``modules_to_not_convert``).

Per row: perplexity (or cosine / top-1 agreement) and the relative change vs fp32. Writes
``results/accuracy.json`` (machine, versions, date, token counts, every row; rewritten after
every row, so a long run that is stopped still leaves what it measured, with
``"complete": false``) and ``results/accuracy.png``.

    python benchmarks/accuracy.py --quick          # smoke run: 1024 tokens, 128 sentences,
                                                   # 4 recipes, no AOTI check (~15 min, 2 cores)
    python benchmarks/accuracy.py                  # full run (1-2 h on 2 quiet cores)
    python benchmarks/accuracy.py --schemes int8wo,int4wo-64 --no-aoti-check --out-dir /tmp/acc

One 512-token SmolLM2 forward takes ~1.5 s on 2 quiet cores (up to ~10 s on a loaded machine);
a variant costs 32 of them at the default 8192 tokens per text. Order: SmolLM2 then MiniLM
(fp32, every fxquant recipe, the peers), then the slow peers of both (torchao's int8
dynamic-activation path: ~20x slower than fp32 in eager on CPU), then the AOTI check.
"""

from __future__ import annotations

import argparse
import copy
import datetime
import gc
import json
import math
import os
import re
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from machine import machine_info  # run as `python benchmarks/accuracy.py`
from torch.export import Dim

import fxquant
from fxquant import assets, evaluate

QUICK_SCHEMES = ("int8wo", "int4wo-64", "w8a8", "fp8wo")
WINDOW = 512
MINILM_BATCH = 64
MINILM_MAX_LEN = 128
AOTI_TOKENS = 1024
SKIP = ("lm_head",)  # fxquant's default modules_to_not_convert, applied to every peer too


# --------------------------------------------------------------------------- peers


@dataclass(frozen=True)
class Peer:
    """A peer quantizer and the fxquant recipe it is compared with.

    Args:
        name: row label.
        recipe: the fxquant recipe it matches (the peer runs when that recipe is selected).
        torchao_config: torchao config class name, or None for ``quantize_dynamic``.
        kwargs: config arguments; ``"granularity": "PerRow"`` is resolved lazily. For
            ``quantize_dynamic``, ``{"per_channel": True}`` picks ``per_channel_dynamic_qconfig``.
        slow: runs far slower than fp32 in eager on CPU; measured last, so that a run that
            is stopped early still has every other row.
    """

    name: str
    recipe: str
    torchao_config: str | None = None
    kwargs: dict = field(default_factory=dict)
    slow: bool = False


PEERS = (
    Peer("torchao Int8WeightOnly", "int8wo", "Int8WeightOnlyConfig"),
    Peer("torchao Int4WeightOnly g64", "int4wo-64", "Int4WeightOnlyConfig", {"group_size": 64}),
    Peer("torchao Int4WeightOnly g128", "int4wo-128", "Int4WeightOnlyConfig", {"group_size": 128}),
    Peer("ao quantize_dynamic qint8", "w8a8"),
    Peer("ao quantize_dynamic qint8 per-channel", "w8a8", None, {"per_channel": True}),
    # ~20x slower than fp32 eager on CPU in torchao 0.18 (per-token int8 path in eager).
    Peer("torchao Int8DynAct-Int8W", "w8a8", "Int8DynamicActivationInt8WeightConfig", slow=True),
    Peer("torchao Float8WeightOnly", "fp8wo", "Float8WeightOnlyConfig"),
    Peer(
        "torchao Float8DynAct-Float8W row",
        "fp8-row",
        "Float8DynamicActivationFloat8WeightConfig",
        {"granularity": "PerRow"},
    ),
    Peer(
        "torchao Float8DynAct-Float8W tensor",
        "fp8-tensor",
        "Float8DynamicActivationFloat8WeightConfig",
    ),
)


def calibrated_variants() -> dict[str, tuple[object, object]]:
    """name → (scheme, method): fxquant.calibrate rows, beside the round-to-nearest recipe of the
    same scheme (int4wo-64). AutoRound at 50 steps of 4 samples (an eighth of auto-round's
    default cost; benchmarks/calibration.py has both); AWQ and GPTQ at their defaults."""
    int4 = fxquant.Int4WeightOnly(group_size=64)
    return {
        "autoround-int4-64": (int4, fxquant.AutoRound(iters=50, batch_size=4)),
        "awq-int4-64": (int4, fxquant.AWQ()),
        "gptq-int4-64": (int4, fxquant.GPTQ()),
    }


# Calibration data, never the evaluated text: SmolLM2 reads 32 windows of 512 tokens of the
# Wikipedia text after the evaluated tokens; MiniLM 8 batches of 16 Wikipedia passages.
CALIB_WINDOWS = 32
CALIB_BATCHES, CALIB_BATCH = 8, 16


def _calibrate(ep, name: str, data: list, row: dict):
    scheme, method = calibrated_variants()[name]
    row.update(method="calibrated", recipe=name, calibration=type(method).__name__)
    qep = fxquant.calibrate(ep, scheme, data, method=method, progress=True)
    rows = [r for r in fxquant.report(qep).rows if "calibration" in r]
    row["layers_calibrated"] = sum(r["calibration"]["status"] == "calibrated" for r in rows)
    return qep


def torchao_status() -> tuple[object | None, str]:
    """(torchao.quantization or None, torchao version or 'skipped: <reason>')."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import torchao
            import torchao.quantization as tq
    except ImportError as e:
        return None, f"skipped: torchao not installed ({e})"
    except Exception as e:  # noqa: BLE001 - a broken install is data too
        return None, f"skipped: torchao incompatible: {type(e).__name__}: {str(e)[:200]}"
    return tq, torchao.__version__


def _skip_fqn(fqn: str) -> bool:
    return any(fqn == s or fqn.endswith("." + s) for s in SKIP)


def apply_peer(model: nn.Module, peer: Peer, tq) -> tuple[nn.Module, int]:
    """A quantized deep copy of ``model`` and how many Linear layers the peer converted."""
    q = copy.deepcopy(model)
    names = [n for n, m in q.named_modules() if isinstance(m, nn.Linear) and not _skip_fqn(n)]
    with warnings.catch_warnings():  # torch.ao.quantization is deprecated in favour of torchao
        warnings.simplefilter("ignore")
        if peer.torchao_config is None:
            qcfg = (
                torch.ao.quantization.per_channel_dynamic_qconfig
                if peer.kwargs.get("per_channel")
                else torch.ao.quantization.default_dynamic_qconfig
            )
            q = torch.ao.quantization.quantize_dynamic(
                q, {n: qcfg for n in names}, dtype=torch.qint8
            )
            dyn = torch.ao.nn.quantized.dynamic.Linear
            return q, sum(isinstance(m, dyn) for m in q.modules())
        kwargs = dict(peer.kwargs)
        if kwargs.get("granularity") == "PerRow":
            from torchao.quantization.granularity import PerRow

            kwargs["granularity"] = PerRow()
        config = getattr(tq, peer.torchao_config)(**kwargs)
        tq.quantize_(
            q, config, filter_fn=lambda m, fqn: isinstance(m, nn.Linear) and not _skip_fqn(fqn)
        )
    # torchao swaps the weight for a tensor subclass; a layer it skipped keeps a plain tensor.
    converted = sum(
        type(m.weight.data) is not torch.Tensor
        for n, m in q.named_modules()
        if isinstance(m, nn.Linear) and not _skip_fqn(n)
    )
    return q, converted


class TorchaoMissing(RuntimeError):
    """torchao cannot be imported; the message is the 'skipped: ...' status itself."""


def _short(e: Exception) -> str:
    if isinstance(e, TorchaoMissing):
        return str(e).removeprefix("skipped: ")
    return f"{type(e).__name__}: {str(e).strip()}".splitlines()[0][:240]


# --------------------------------------------------------------------------- models


class EncoderWrapper(nn.Module):
    """A BERT encoder as ``(input_ids, attention_mask) → last_hidden_state``: what is exported."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, attention_mask=attention_mask).last_hidden_state


def lee_sentences(n: int) -> list[str]:
    """The first ``n`` sentences (>= 6 words) of lee_background.cor, in file order."""
    out = []
    for article in assets.lee_text("background").splitlines():
        for s in re.split(r"(?<=[.!?])\s+", article.strip()):
            if len(s.split()) >= 6:
                out.append(s)
                if len(out) == n:
                    return out
    raise ValueError(f"lee_background.cor has only {len(out)} sentences of >= 6 words; asked {n}")


def minilm_batches(tokenizer, sentences: list[str]) -> list[dict]:
    return [
        dict(
            tokenizer(
                sentences[i : i + MINILM_BATCH],
                padding=True,
                truncation=True,
                max_length=MINILM_MAX_LEN,
                return_tensors="pt",
            )
        )
        for i in range(0, len(sentences), MINILM_BATCH)
    ]


def export_encoder(model: nn.Module, batch: dict) -> torch.export.ExportedProgram:
    # Example sizes >= 2 in both dims: torch.export specializes a dim whose example size is 1.
    ids, mask = batch["input_ids"][:2], batch["attention_mask"][:2]
    b, s = Dim("batch"), Dim("seq", max=512)  # BERT's position table has 512 rows
    return torch.export.export(
        EncoderWrapper(model).eval(),
        (ids, mask),
        dynamic_shapes=({0: b, 1: s}, {0: b, 1: s}),
    )


@torch.no_grad()
def embed(fn: Callable, batches: list[dict]) -> torch.Tensor:
    outs = []
    for b in batches:
        mask = b["attention_mask"]
        h = fn(b["input_ids"], mask)
        m = mask.unsqueeze(-1).to(h.dtype)
        outs.append(F.normalize((h * m).sum(1) / m.sum(1).clamp(min=1), dim=-1))
    return torch.cat(outs)


def nearest(e: torch.Tensor) -> torch.Tensor:
    sim = e @ e.T
    sim.fill_diagonal_(-math.inf)
    return sim.argmax(dim=1)


def embedding_metrics(e: torch.Tensor, ref: torch.Tensor, ref_nn: torch.Tensor) -> dict:
    cos = (e * ref).sum(-1)
    return {
        "mean_cos": cos.mean().item(),
        "min_cos": cos.min().item(),
        "top1_agreement": (nearest(e) == ref_nn).float().mean().item(),
    }


# --------------------------------------------------------------------------- output


class Results:
    """The JSON record, rewritten (with the chart) after every row."""

    def __init__(self, out_dir: Path, meta: dict):
        self.out_dir = out_dir
        self.t0 = time.perf_counter()
        self.rec = {**meta, "complete": False, "smollm2": [], "minilm": [], "aoti_check": None}

    def add(self, section: str, row: dict) -> None:
        self.rec[section].append(row)
        self.write()

    def write(self) -> None:
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.rec["wall_s"] = time.perf_counter() - self.t0
        body = self.rec
        path = self.out_dir / "accuracy.json"
        tmp = path.with_suffix(f".json.{os.getpid()}.tmp")  # write whole, then swap in
        tmp.write_text(json.dumps(body, indent=1))
        tmp.replace(path)
        try:
            plot(body, self.out_dir / "accuracy.png")
        except Exception as e:  # noqa: BLE001 - a chart failure must not lose the numbers
            print(f"chart not written: {_short(e)}", flush=True)


def _ok(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r.get("status") == "ok" and r["method"] != "fp32"]


def _not_fp32(rows: list[dict]) -> list[dict]:
    return [r for r in rows if r["method"] != "fp32"]


def plot(rec: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FuncFormatter

    lm, enc = _not_fp32(rec["smollm2"]), _not_fp32(rec["minilm"])
    if not _ok(lm) and not _ok(enc):
        return
    recipes = list(dict.fromkeys(r["recipe"] for r in lm + enc))
    panels = [("lee", "Lee news"), ("wiki", "Wikipedia")] if _ok(lm) else []
    enc = enc if _ok(enc) else []
    n = len(panels) + (1 if enc else 0)
    width = max(10, 1.3 * len(recipes) + 4)
    fig, axes = plt.subplots(n, 1, figsize=(width, 3.8 * n), squeeze=False)
    colors = {
        "fxquant": "#1f77b4",
        "fxquant calibrated": "#17becf",
        "torchao": "#ff7f0e",
        "ao quantize_dynamic": "#2ca02c",
    }

    def family(r: dict) -> str:
        if r["method"] == "calibrated":
            return "fxquant calibrated"
        return r["method"] if r["method"] == "fxquant" else r["peer_family"]

    def bars(ax, rows: list[dict], value: Callable[[dict], float], fmt: str) -> None:
        slots = {rc: [r for r in rows if r["recipe"] == rc] for rc in recipes}
        width = 0.8 / max(1, max(len(v) for v in slots.values()))
        seen = set()
        for x, rc in enumerate(recipes):
            group = slots[rc]
            for i, r in enumerate(group):
                pos = x - 0.4 + width * (i + 0.5)
                fam = family(r)
                label = None if fam in seen else fam
                seen.add(fam)
                name = r["name"].replace("torchao ", "").replace("ao quantize_dynamic ", "")
                if r["status"] != "ok":  # a peer that cannot run here: say so in its slot
                    ax.annotate(
                        f"{name}: not run\n(see JSON)",
                        (pos, 0),
                        xycoords=("data", "axes fraction"),
                        rotation=90,
                        ha="center",
                        va="bottom",
                        fontsize=6,
                        color="grey",
                        xytext=(0, 4),
                        textcoords="offset points",
                    )
                    continue
                v = value(r)
                ax.bar(pos, v, width * 0.92, color=colors.get(fam, "grey"), label=label)
                ax.annotate(
                    f"{fmt.format(v)}\n{name}" if r["method"] != "fxquant" else fmt.format(v),
                    (pos, v),
                    ha="center",
                    va="bottom",
                    fontsize=6,
                    xytext=(0, 2),
                    textcoords="offset points",
                )
        ax.set_xticks(range(len(recipes)), recipes)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.grid(axis="y", alpha=0.3)

    for ax, (key, title) in zip(axes[:, 0], panels, strict=False):
        bars(ax, lm, lambda r, k=key: r[f"ppl_{k}_rel_pct"], "{:+.1f}%")
        ax.set_yscale("symlog", linthresh=1.0)
        top = max((r[f"ppl_{key}_rel_pct"] or 0 for r in _ok(lm)), default=1.0)
        ax.set_ylim(top=max(2.0, top) * 4)  # headroom for the labels on a log scale
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}%"))
        ax.set_ylabel("perplexity increase vs fp32 (%)")
        fp32 = next((r for r in rec["smollm2"] if r["method"] == "fp32"), None)
        base = f"fp32 ppl {fp32[f'ppl_{key}']:.2f}" if fp32 else ""
        ax.set_title(
            f"SmolLM2-135M, {title}: first {rec['tokens'][key]} tokens, 512-token windows "
            f"({base}; lower is better, symlog axis)",
            fontsize=9,
        )
    if enc:
        ax = axes[-1, 0]
        bars(ax, enc, lambda r: r["top1_agreement"], "{:.3f}")
        lo = min(r["top1_agreement"] for r in _ok(enc))
        ax.set_ylim(max(0.0, lo - 0.1), 1.06)
        ax.set_ylabel("top-1 NN agreement with fp32")
        ax.set_title(
            f"all-MiniLM-L6-v2: {rec['sentences']} Lee sentences, nearest-neighbour agreement "
            "with fp32 embeddings (higher is better)",
            fontsize=9,
        )
    m = rec["machine"]
    fig.suptitle(
        f"benchmarks/accuracy.py → results/accuracy.json · {m['date'][:10]} · {m['cpu_model']} "
        f"({m['os_cpu_count']} cores) · torch {m['torch']} · torchao {rec['torchao']}",
        fontsize=8,
    )
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# --------------------------------------------------------------------------- runs


def variants(schemes: list[str], calibrated: list[str] = ()) -> list[tuple[str, object]]:
    """fp32, every fxquant recipe, the calibrated rows, then the peers of those recipes (slow
    ones last)."""
    peers = [p for p in PEERS if p.recipe in schemes]
    peers.sort(key=lambda p: p.slow)  # stable: table order otherwise
    return [
        ("fp32", None),
        *[("fxquant", r) for r in schemes],
        *[("calibrated", c) for c in calibrated],
        *[("peer", p) for p in peers],
    ]


def _rel(v: float, base: float | None) -> float | None:
    return None if base is None else 100.0 * (v / base - 1.0)


def run_smollm2(args, res: Results, todo: list[tuple[str, object]], tq, ctx: dict) -> None:
    """Measure the variants ``todo`` on SmolLM2; ``ctx`` keeps the loaded model across calls."""
    from tqdm.auto import tqdm

    if not ctx:
        t0 = time.perf_counter()
        model, tok = assets.load_smollm2()
        wiki = assets.wiki_text()
        texts = {
            "lee": torch.tensor(tok(assets.lee_text("background")).input_ids[: args.tokens]),
            "wiki": torch.tensor(tok(wiki).input_ids[: args.tokens]),
        }
        res.rec["tokens"] = {k: int(v.numel()) for k, v in texts.items()}
        after = torch.tensor(tok(wiki).input_ids[args.tokens :])
        calib = [after[i * WINDOW : (i + 1) * WINDOW].unsqueeze(0) for i in range(CALIB_WINDOWS)]
        ctx["calib"] = [c for c in calib if c.numel() == WINDOW]
        ep = evaluate.export_causal_lm(model)
        took = time.perf_counter() - t0
        print(f"SmolLM2 loaded + exported in {took:.0f} s; tokens {res.rec['tokens']}")
        ctx.update(model=model, texts=texts, ep=ep, base={})
    model, texts, ep, base = ctx["model"], ctx["texts"], ctx["ep"], ctx["base"]
    bar = tqdm(todo, desc="SmolLM2", unit="variant")
    for kind, what in bar:
        name = "fp32" if kind == "fp32" else what.name if kind == "peer" else what
        bar.set_description(f"SmolLM2 {name}")
        row: dict = {"name": name, "status": "ok"}
        t1 = time.perf_counter()
        qep = fn = qm = None
        try:
            if kind == "fp32":
                row.update(method="fp32", recipe="fp32")
                fn = ep.module()
            elif kind == "fxquant":
                row.update(method="fxquant", recipe=what)
                qep = fxquant.quantize(ep, what)
                rep = fxquant.report(qep)
                row.update(
                    linears_quantized=len(rep.quantized),
                    linears_skipped=len(rep.skipped),
                    program_bytes=rep.program_bytes,
                )
                fn = qep.module()
            elif kind == "calibrated":
                row["calibration_tokens"] = WINDOW * len(ctx["calib"])
                qep = _calibrate(ep, what, ctx["calib"], row)
                fn = qep.module()
            else:
                fam = "ao quantize_dynamic" if what.torchao_config is None else "torchao"
                row.update(method="peer", recipe=what.recipe, peer_family=fam)
                row["config"] = what.torchao_config or "quantize_dynamic(qint8)"
                row["config_kwargs"] = what.kwargs
                if fam == "torchao" and tq is None:
                    raise TorchaoMissing(res.rec["torchao"])
                qm, row["linears_quantized"] = apply_peer(model, what, tq)
                fn = evaluate.CausalLMWrapper(qm).eval()
            row["quantize_s"] = time.perf_counter() - t1
            t2 = time.perf_counter()
            for key, ids in texts.items():
                ppl = evaluate.perplexity(fn, ids, window=WINDOW, max_tokens=args.tokens)
                row[f"ppl_{key}"] = ppl
                if kind == "fp32":
                    base[key] = ppl
                row[f"ppl_{key}_rel_pct"] = _rel(ppl, base.get(key))
            row["eval_s"] = time.perf_counter() - t2
        except Exception as e:  # noqa: BLE001 - a failing scheme is a row, not a crash
            row["status"] = ("skipped: " if kind == "peer" else "error: ") + _short(e)
        tqdm.write(
            f"[SmolLM2] {name:36} "
            + (
                f"lee {row['ppl_lee']:8.3f} ({row['ppl_lee_rel_pct'] or 0:+6.2f}%)  "
                f"wiki {row['ppl_wiki']:8.3f} ({row['ppl_wiki_rel_pct'] or 0:+6.2f}%)"
                if row["status"] == "ok"
                else row["status"]
            )
        )
        res.add("smollm2", row)
        qep = fn = qm = None  # a quantized copy holds its weights: free it before the next
        gc.collect()
    bar.close()


def aoti_check(qep, lee_ids: torch.Tensor) -> dict:
    """int8wo: the AOTInductor package vs the program, perplexity on the same first tokens."""
    rec: dict = {"recipe": "int8wo", "tokens": min(AOTI_TOKENS, lee_ids.numel())}
    with tempfile.TemporaryDirectory(prefix="fxq-acc-aoti-") as tmp:
        try:
            t0 = time.perf_counter()
            pkg = fxquant.aot_compile(qep, Path(tmp) / "smollm2-int8wo-aoti.pt2")
            rec["build_s"] = time.perf_counter() - t0
            rec["ppl_program"] = evaluate.perplexity(
                qep.module(), lee_ids, window=WINDOW, max_tokens=AOTI_TOKENS
            )
            rec["ppl_aoti"] = evaluate.perplexity(
                pkg, lee_ids, window=WINDOW, max_tokens=AOTI_TOKENS
            )
            rec["rel_diff"] = abs(rec["ppl_aoti"] / rec["ppl_program"] - 1.0)
            rec["status"] = "ok"
            del pkg
        except Exception as e:  # noqa: BLE001
            rec["status"] = "error: " + _short(e)
    print(f"[AOTI check] {rec}", flush=True)
    return rec


def run_minilm(args, res: Results, todo: list[tuple[str, object]], tq, ctx: dict) -> None:
    """Measure the variants ``todo`` on MiniLM; ``ctx`` keeps the loaded model across calls."""
    from tqdm.auto import tqdm

    if not ctx:
        model, tok = assets.load_minilm()
        sentences = lee_sentences(args.sentences)
        batches = minilm_batches(tok, sentences)
        res.rec["sentences"] = len(sentences)
        ep = export_encoder(model, batches[0])
        ref = embed(ep.module(), batches)
        ctx.update(model=model, batches=batches, ep=ep, ref=ref, ref_nn=nearest(ref))
        ctx["eager"] = embed(EncoderWrapper(model), batches)
        passages = [p for p in assets.wiki_text().split("\n") if len(p.split()) >= 6]
        enc = [
            tok(passages[i * CALIB_BATCH : (i + 1) * CALIB_BATCH], padding="max_length",
                truncation=True, max_length=MINILM_MAX_LEN, return_tensors="pt")
            for i in range(CALIB_BATCHES)
        ]  # fmt: skip
        ctx["calib"] = [(e["input_ids"], e["attention_mask"]) for e in enc]
    model, batches, ep = ctx["model"], ctx["batches"], ctx["ep"]
    ref, ref_nn, eager = ctx["ref"], ctx["ref_nn"], ctx["eager"]
    bar = tqdm(todo, desc="MiniLM", unit="variant")
    for kind, what in bar:
        name = "fp32" if kind == "fp32" else what.name if kind == "peer" else what
        bar.set_description(f"MiniLM {name}")
        row: dict = {"name": name, "status": "ok"}
        try:
            if kind == "fp32":
                # The exported program against eager: checks the export itself.
                row.update(method="fp32", recipe="fp32", **embedding_metrics(eager, ref, ref_nn))
            elif kind == "fxquant":
                row.update(method="fxquant", recipe=what)
                qep = fxquant.quantize(ep, what)
                row["linears_quantized"] = len(fxquant.report(qep).quantized)
                row.update(embedding_metrics(embed(qep.module(), batches), ref, ref_nn))
                del qep
            elif kind == "calibrated":
                qep = _calibrate(ep, what, ctx["calib"], row)
                row.update(embedding_metrics(embed(qep.module(), batches), ref, ref_nn))
                del qep
            else:
                fam = "ao quantize_dynamic" if what.torchao_config is None else "torchao"
                row.update(method="peer", recipe=what.recipe, peer_family=fam)
                row["config"] = what.torchao_config or "quantize_dynamic(qint8)"
                if fam == "torchao" and tq is None:
                    raise TorchaoMissing(res.rec["torchao"])
                qm, row["linears_quantized"] = apply_peer(model, what, tq)
                row.update(embedding_metrics(embed(EncoderWrapper(qm), batches), ref, ref_nn))
        except Exception as e:  # noqa: BLE001
            row["status"] = ("skipped: " if kind == "peer" else "error: ") + _short(e)
        tqdm.write(
            f"[MiniLM] {name:36} "
            + (
                f"cos mean {row['mean_cos']:.5f} min {row['min_cos']:.5f}  "
                f"top-1 {row['top1_agreement']:.3f}"
                if row["status"] == "ok"
                else row["status"]
            )
        )
        res.add("minilm", row)
        gc.collect()
    bar.close()


# --------------------------------------------------------------------------- main


def print_tables(rec: dict) -> None:
    print(f"\nSmolLM2-135M perplexity (tokens: {rec.get('tokens')})")
    for r in rec["smollm2"]:
        if r["status"] != "ok":
            print(f"  {r['name']:36} {r['status'][:100]}")
            continue
        print(
            f"  {r['name']:36} lee {r['ppl_lee']:8.3f} {r['ppl_lee_rel_pct'] or 0:+7.2f}%   "
            f"wiki {r['ppl_wiki']:8.3f} {r['ppl_wiki_rel_pct'] or 0:+7.2f}%"
        )
    print(f"\nall-MiniLM-L6-v2 ({rec.get('sentences')} sentences)")
    for r in rec["minilm"]:
        if r["status"] != "ok":
            print(f"  {r['name']:36} {r['status'][:100]}")
            continue
        print(
            f"  {r['name']:36} mean cos {r['mean_cos']:.5f}  min cos {r['min_cos']:.5f}  "
            f"top-1 {r['top1_agreement']:.3f}"
        )
    if rec.get("aoti_check"):
        print(f"\nAOTI check: {rec['aoti_check']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="1024 tokens, 128 sentences, 4 recipes")
    ap.add_argument("--schemes", default=None, help="comma-separated recipes (default: all)")
    ap.add_argument(
        "--calibrated",
        default=None,
        help="comma-separated fxquant.calibrate rows (default: autoround-int4-64 with the full "
        f"run, none with --quick; known: {', '.join(calibrated_variants())})",
    )
    ap.add_argument("--tokens", type=int, default=None, help="tokens per text (default 8192)")
    ap.add_argument("--sentences", type=int, default=None, help="MiniLM sentences (default 512)")
    ap.add_argument(
        "--aoti-check",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="int8wo AOTInductor package vs program on 1024 Lee tokens (default: on, off --quick)",
    )
    ap.add_argument("--out-dir", type=Path, default=Path(__file__).parent / "results")
    args = ap.parse_args()
    args.tokens = args.tokens or (1024 if args.quick else 8192)
    args.sentences = args.sentences or (128 if args.quick else 512)
    if args.aoti_check is None:
        args.aoti_check = not args.quick
    if args.schemes:
        schemes = [s.strip() for s in args.schemes.split(",") if s.strip()]
    else:
        schemes = list(QUICK_SCHEMES if args.quick else fxquant.RECIPES)
    for s in schemes:
        fxquant.from_recipe_name(s)  # a typo fails now, not after minutes of fp32 work
    if args.calibrated is None:
        args.calibrated = "" if args.quick else "autoround-int4-64"
    calibrated = [c.strip() for c in args.calibrated.split(",") if c.strip()]
    unknown = [c for c in calibrated if c not in calibrated_variants()]
    if unknown:
        raise SystemExit(f"unknown --calibrated {unknown}; known: {list(calibrated_variants())}")
    torch.set_num_threads(min(2, os.cpu_count() or 1))
    torch.manual_seed(0)

    tq, ao_status = torchao_status()
    print(f"torchao: {ao_status}")
    import transformers

    meta = {
        "question": __doc__.splitlines()[0],
        "script": "benchmarks/accuracy.py",
        "argv": sys.argv[1:],
        "quick": args.quick,
        "machine": machine_info(),
        "versions": {
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "fxquant": getattr(fxquant, "__version__", "dev"),
            "torchao": ao_status,
        },
        "torchao": ao_status,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "protocol": {
            "smollm2": "perplexity, non-overlapping 512-token windows, no BOS, first N tokens of "
            "lee_background.cor and of assets.wiki_text(); fxquant rows run qep.module()",
            "minilm": f"mean-pooled (attention mask), L2-normalised embeddings of Lee sentences "
            f"(>= 6 words), batches of {MINILM_BATCH} padded, max {MINILM_MAX_LEN} tokens; "
            "cosine and top-1 nearest-neighbour agreement vs the fp32 exported program",
            "peers": "eager, same model and text; lm_head excluded everywhere; "
            "quantize_dynamic: default qconfig (per-tensor weight) and "
            "per_channel_dynamic_qconfig; both per-tensor dynamic activations (fbgemm)",
            "rel_pct": "100 * (ppl / ppl_fp32 - 1)",
        },
        "schemes": schemes,
        "calibrated": {
            name: {"scheme": scheme.to_dict(), "method": {"type": type(m).__name__, **vars(m)}}
            for name, (scheme, m) in calibrated_variants().items()
            if name in calibrated
        },
        "calibration_data": {
            "smollm2": f"{CALIB_WINDOWS} windows of {WINDOW} tokens of assets.wiki_text() after "
            "the evaluated tokens",
            "minilm": f"{CALIB_BATCHES} batches of {CALIB_BATCH} Wikipedia passages (>= 6 "
            f"words), padded to {MINILM_MAX_LEN} tokens",
        },
        "tokens": {},
        "sentences": None,
    }
    res = Results(args.out_dir, meta)
    # Fast variants of both models first, then the slow peers: a run stopped early still has
    # every fxquant row of both models. The AOTI check (a build of minutes) comes last.
    todo = variants(schemes, calibrated)
    fast = [v for v in todo if not (v[0] == "peer" and v[1].slow)]
    slow = [v for v in todo if v not in fast]
    lm_ctx: dict = {}
    enc_ctx: dict = {}
    run_smollm2(args, res, fast, tq, lm_ctx)
    run_minilm(args, res, fast, tq, enc_ctx)
    if slow:
        run_smollm2(args, res, slow, tq, lm_ctx)
        run_minilm(args, res, slow, tq, enc_ctx)
    if args.aoti_check:
        qep = fxquant.quantize(lm_ctx["ep"], "int8wo")
        res.rec["aoti_check"] = aoti_check(qep, lm_ctx["texts"]["lee"])
        res.write()
    res.rec["complete"] = True
    res.write()
    print_tables(res.rec)
    print(f"wrote {args.out_dir / 'accuracy.json'} and accuracy.png ({res.rec['wall_s']:.0f} s)")


if __name__ == "__main__":
    main()
