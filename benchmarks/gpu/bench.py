"""Are the Triton kernels right on a real GPU, and how fast are they against what CUDA users have?

Run by ``benchmarks/gpu/run.sh`` on a lent H200 (one call; see benchmarks/README.md). Five
sections, in priority order, each written to ``$OUT/gpu.json`` as soon as it finishes, inside a
wall-clock budget (``--budget-s``) so the call ends well before the device's per-call limit
(``--sections fp8_training`` runs that section alone, about 2-3 minutes):

1. **kernels**: every recipe at Llama-3-8B linear shapes (``shapes.py`` ``llama3-8b``: q/o, kv,
   gate_up, down) and M in 1, 16, 128, 2048. The weight is quantized by the scheme itself
   (``Scheme.quantize``, as the rewrite does), the op and its arguments come from it too
   (``Scheme.op_args``),
   and the CUDA lowering (``fxquant.passes.lower.lowerings("cuda")``) runs them: exactly what a
   lowered program calls. Each is checked against the semantic op's reference math (SQNR) and
   timed with ``triton.testing.do_bench`` (median) beside bf16 ``F.linear``,
   ``torch._scaled_mm`` (per-tensor and per-row fp8) and ``torch._int_mm`` on the same M, N, K.
   Dynamic-activation recipes are timed twice: the whole linear (activation quantization +
   GEMM) and the GEMM alone on a pre-quantized activation (what ``_scaled_mm`` is given).
1b. **experts**: gpt-oss-20b's expert GEMM shapes (32 experts, d = 2880, top-4; 1, 16, 512
   tokens) in MXFP4, int8, int4 and fp8 weight-only, W8A8 and fp8 (per row, blocks), through
   the CUDA lowerings of ``fxquant::mxfp4_grouped_mm``, ``int8_weight_only_grouped_mm``,
   ``int4_weight_only_grouped_mm``, ``float8_weight_only_grouped_mm``,
   ``int8_dynamic_grouped_mm``, ``float8_dynamic_grouped_mm`` and
   ``float8_block_grouped_mm``, checked against their references and timed beside bf16
   ``torch._grouped_mm`` on the dequantized weights.
2. **norm_quant**: the fused RMSNorm → quantize kernel on a [8192, 4096] bf16 activation, as a
   fraction of the HBM copy bandwidth measured in the same run (target >= 75 %).
3. **stack**: an 8-layer Llama-3-8B-shaped decoder (random weights, bf16) exported with a dynamic
   sequence, quantized with each recipe (norm fusion on), packaged by AOTInductor for CUDA and
   timed at decode (M = 1) and prefill (M = 2048) against the bf16 package. This section and
   the cached decode one run in a child process each (``run_isolated``): one that crashes is run
   again under Inductor instead of AOTInductor (``build``), and the call goes on.
4. the targets of the kernels issue, printed beside the measured ratios (never asserted).
4b. **fp8_training** (``fp8_training.py``): one Llama-3-8B decoder block, sequence 4096, forward
   + backward in bf16 (Inductor) vs each FP8 training recipe (``backend="fxquant"``, real
   ``torch._scaled_mm`` GEMMs), at batch 1 then 4 then 2 as the budget allows; 20 training
   steps' loss beside bf16's; the training issue's targets beside the ratios (never asserted).
5. **every_k**: each recipe's CUDA lowering at every K in 1..200 (``nn.Linear(K, 24)``), M = 1
   (decode kernels) and M = 17 (prefill kernels), against the semantic op's reference: the
   shape preconditions (masks, groups, padding) on a real device, no timing.
   ``tests/test_lower_every_k.py`` runs a subset of the K under the interpreter.

``--smoke`` runs the same code on CPU tensors under ``TRITON_INTERPRET=1`` with tiny shapes and
no timing worth reading: it is how the script is checked where there is no GPU.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.metadata
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

RECIPES = (
    "int8wo",
    "int4wo-128",
    "int4wo-64",
    "fp8wo",
    "w8a8",
    "fp8-row",
    "fp8-tensor",
    "fp8-block",
)
STACK_RECIPES = ("fp8-row", "int4wo-128", "int8wo", "fp8-block", "w8a8", "fp8wo")
# decode and the longest prefill first (the targets' Ms), so a budget cut loses the middle Ms:
# the second H200 run reached M = 128 of (1, 16, 128, 2048) and measured no prefill target
MS = (1, 2048, 16, 128)
TARGETS = {
    "decode int4wo vs bf16 (M=1)": 3.0,
    "decode int8wo vs bf16 (M=1)": 1.8,
    "decode fp8wo vs bf16 (M=1)": 1.8,
    "prefill fp8-row vs bf16 (M=2048)": 1.6,
    "prefill fp8-row vs _scaled_mm row (M=2048)": 0.95,
    "prefill fp8-block vs bf16 (M=2048)": 1.3,
    "norm_quant vs copy bandwidth": 0.75,
}


class Budget:
    def __init__(self, seconds: float):
        self.t0, self.seconds = time.perf_counter(), seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.t0)


class Results:
    def __init__(self, out: Path, meta: dict):
        self.path = out / "gpu.json"
        self.rec = {
            **meta,
            "kernels": [],
            "experts": [],
            "norm_quant": None,
            "stack": [],
            "decode": [],
            "fp8_training": None,
            "complete": False,
        }

    def write(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.rec, indent=1, default=str))
        tmp.replace(self.path)


def timer(smoke: bool) -> Callable[[Callable], float]:
    """Median ms of fn: CUDA events through do_bench on the GPU, a few wall-clock calls in smoke."""
    if smoke:

        def wall(fn):
            fn()
            ts = []
            for _ in range(3):
                t0 = time.perf_counter()
                fn()
                ts.append(time.perf_counter() - t0)
            return statistics.median(ts) * 1e3

        return wall
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=10, rep=40, return_mode="median")


def graph_timer(smoke: bool) -> Callable[[Callable], float | None]:
    """Median ms of fn replayed from a CUDA graph: the GPU's time alone, without the Python and
    launch overhead that ``timer`` includes (what a compiled or AOTInductor program, or a
    CUDA-graphed server, pays instead). None where fn cannot be captured; in smoke, ``timer``."""
    if smoke:
        return timer(smoke)
    from triton.testing import do_bench_cudagraph

    def graph(fn):
        try:
            return do_bench_cudagraph(fn, rep=20, return_mode="median")
        except Exception as e:  # noqa: BLE001 - a capture failure is a result, not a crash
            print(f"  (cuda graph capture failed: {type(e).__name__}: {str(e)[:120]})", flush=True)
            return None

    return graph


def sqnr(ref: torch.Tensor, out: torch.Tensor) -> float:
    from fxquant.core.reference import sqnr as _sqnr

    return _sqnr(ref.float(), out.float())


# --------------------------------------------------------------------------- 1. kernels


def gemm_shapes(smoke: bool) -> list[tuple[str, int, int]]:
    if smoke:
        return [("tiny", 48, 64), ("tiny-odd", 40, 96)]
    from shapes import get_shape, linears

    s = get_shape("llama3-8b")
    lin = {name: (n, k) for name, n, k in linears(s)}
    return [
        ("q/o", *lin["q_proj"]),
        ("kv", *lin["k_proj"]),
        ("gate_up", 2 * lin["gate_proj"][0], lin["gate_proj"][1]),
        ("down", *lin["down_proj"]),
    ]


def baselines(x: torch.Tensor, w: torch.Tensor, bench, graph, smoke: bool) -> dict:
    """bf16 F.linear, _scaled_mm (tensor, row) and _int_mm on the same problem."""
    from fxquant.core import reference as ref

    out = {"bf16": bench(lambda: F.linear(x, w))}
    out["bf16_graph"] = graph(lambda: F.linear(x, w))
    if smoke:  # _scaled_mm / _int_mm have no CPU kernels worth timing
        return out
    m = x.shape[0]
    xq, xs = ref.quantize_fp8_per_tensor(x)
    wq, ws = ref.quantize_fp8_per_tensor(w)
    xr, xrs = ref.quantize_fp8_per_token(x)
    wr, wrs = ref.quantize_fp8_per_channel(w)
    bf = torch.bfloat16
    try:
        out["scaled_mm_tensor"] = bench(
            lambda: torch._scaled_mm(xq, wq.t(), scale_a=xs, scale_b=ws, out_dtype=bf)
        )
        wrs_row = wrs.reshape(1, -1)
        out["scaled_mm_row"] = bench(
            lambda: torch._scaled_mm(xr, wr.t(), scale_a=xrs, scale_b=wrs_row, out_dtype=bf)
        )
        out["scaled_mm_row_graph"] = graph(
            lambda: torch._scaled_mm(xr, wr.t(), scale_a=xrs, scale_b=wrs_row, out_dtype=bf)
        )
    except Exception as e:  # noqa: BLE001 - recorded, not fatal
        out["scaled_mm_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    if m > 16:  # _int_mm needs M > 16
        xi, _ = ref.quantize_int8_per_token(x)
        wi, _ = ref.quantize_int8_per_channel(w)
        try:
            out["int_mm"] = bench(lambda: torch._int_mm(xi, wi.t()))
        except Exception as e:  # noqa: BLE001
            out["int_mm_error"] = f"{type(e).__name__}: {str(e)[:200]}"
    return out


def gemm_only(op, args) -> Callable | None:
    """For a dynamic-activation linear: (the GEMM alone on a pre-quantized activation)."""
    from fxquant.core import reference as ref
    from fxquant.passes.lower import lowerings

    fxq = torch.ops.fxquant
    table = lowerings("cuda")
    x = args[0]
    if op == fxq.int8_dynamic_linear.default:
        xq, xs = ref.quantize_int8_per_token(x)
        f, a = table[fxq.int8_scaled_linear.default], (xq, xs, *args[1:4], x.dtype)
    elif op == fxq.float8_dynamic_linear.default:
        per_row = args[4]
        xq, xs = (ref.quantize_fp8_per_token if per_row else ref.quantize_fp8_per_tensor)(x)
        f, a = table[fxq.float8_scaled_linear.default], (xq, xs, *args[1:4], x.dtype)
    elif op == fxq.float8_block_linear.default:
        xq, xs = ref.quantize_fp8_groups(x, group_size=args[4])
        f = table[fxq.float8_block_scaled_linear.default]
        a = (xq, xs, *args[1:4], args[4], x.dtype)
    else:
        return None
    return lambda: f(*a)


def run_kernels(res: Results, budget: Budget, *, device: str, smoke: bool) -> None:
    import fxquant
    from fxquant.kernels import gemm
    from fxquant.passes.lower import lowerings

    bench, graph = timer(smoke), graph_timer(smoke)
    table = lowerings("cuda")
    ms = (1, 3, 17) if smoke else MS
    weights = {}
    for label, n, k in gemm_shapes(smoke):
        torch.manual_seed(0)
        weights[label] = (torch.randn(n, k, device=device) * 0.02).to(torch.bfloat16)
    for m in ms:
        for label, n, k in gemm_shapes(smoke):
            w = weights[label]
            if budget.left() < 15:
                print("kernels: budget spent, stopping", flush=True)
                return
            x = torch.randn(m, k, device=device, dtype=torch.bfloat16)
            base = baselines(x, w, bench, graph, smoke)
            row = {"shape": label, "M": m, "N": n, "K": k, "baselines_ms": base, "recipes": {}}
            for recipe in RECIPES:
                scheme = fxquant.from_recipe_name(recipe)
                qw = scheme.quantize(w)
                op, args = scheme.op_args(x, qw.tensors, None)
                fast = table[op]
                entry: dict = {}
                try:
                    y = fast(*args)
                    entry["sqnr_vs_reference_db"] = sqnr(op(*args), y)
                    entry["sqnr_vs_bf16_db"] = sqnr(F.linear(x.float(), w.float()), y)
                    entry["ms"] = bench(lambda fast=fast, args=args: fast(*args))
                    entry["speedup_vs_bf16"] = base["bf16"] / entry["ms"]
                    entry["graph_ms"] = graph(lambda fast=fast, args=args: fast(*args))
                    if entry["graph_ms"] and base["bf16_graph"]:
                        entry["graph_speedup_vs_bf16"] = base["bf16_graph"] / entry["graph_ms"]
                    if m > 16:  # the fused Triton prefill kernel, beside the library path
                        gemm.LIBRARY_PREFILL = False
                        try:
                            entry["fused_prefill_graph_ms"] = graph(
                                lambda fast=fast, args=args: fast(*args)
                            )
                        finally:
                            gemm.LIBRARY_PREFILL = True
                    g = gemm_only(op, args)
                    if g is not None:
                        entry["gemm_only_ms"] = bench(g)
                        entry["gemm_only_graph_ms"] = graph(g)
                        sm_row = base.get("scaled_mm_row_graph")
                        if entry["gemm_only_graph_ms"] and sm_row:
                            entry["gemm_only_graph_vs_scaled_mm_row"] = (
                                sm_row / entry["gemm_only_graph_ms"]
                            )
                        for b in ("scaled_mm_row", "scaled_mm_tensor", "int_mm"):
                            if b in base:
                                entry[f"gemm_only_vs_{b}"] = base[b] / entry["gemm_only_ms"]
                except Exception as e:  # noqa: BLE001 - a failing kernel is a result
                    entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
                row["recipes"][recipe] = entry
            res.rec["kernels"].append(row)
            res.write()
            print(_kernel_line(row), flush=True)


def _kernel_line(row: dict) -> str:
    parts = [f"{row['shape']:>8} M={row['M']:<5} bf16 {row['baselines_ms']['bf16']:.3f} ms"]
    for r, e in row["recipes"].items():
        if "error" in e:
            parts.append(f"{r} ERROR")
        else:
            g = e.get("graph_speedup_vs_bf16")
            graphed = "-" if g is None else f"{g:.2f}x"
            db = e["sqnr_vs_reference_db"]
            parts.append(f"{r} {e['speedup_vs_bf16']:.2f}x/{graphed} graph ({db:.0f} dB)")
    return " | ".join(parts)


# --------------------------------------------------------------------------- 1b. experts


def run_experts(res: Results, budget: Budget, *, device: str, smoke: bool) -> None:
    """gpt-oss-20b's expert shapes (E = 32, d = 2880, top-4) in MXFP4, int8 and int4 (groups of
    64) and fp8 weight-only, W8A8 and fp8 (per row, 128×128 blocks; x quantized at run time):
    the lowered ``fxquant::mxfp4_grouped_mm`` / ``int8_weight_only_grouped_mm`` /
    ``int4_weight_only_grouped_mm`` / ``float8_weight_only_grouped_mm`` /
    ``int8_dynamic_grouped_mm`` / ``float8_dynamic_grouped_mm`` / ``float8_block_grouped_mm``
    beside bf16 ``torch._grouped_mm`` on the dequantized weight."""
    from fxquant.core import reference as ref
    from fxquant.core import reference_mx as rmx
    from fxquant.core.schemes.float8 import Float8Block
    from fxquant.passes.lower import lowerings

    bench, graph = timer(smoke), graph_timer(smoke)
    ops = lowerings("cuda")
    e, top_k, d = (4, 2, 64) if smoke else (32, 4, 2880)
    shapes = [("gate_up", 2 * d, d), ("down", d, d)] if not smoke else [("gate_up", 48, d)]

    def mxfp4(w):
        packed, scale = rmx.quantize_mxfp4_weight(w, rule="ceil")
        op = ops[torch.ops.fxquant.mxfp4_grouped_mm.default]
        return op, rmx.mxfp4_grouped_mm, (packed, scale), rmx.dequantize_mxfp4_weight(packed, scale)

    def int8(w):
        q, scale = ref.quantize_int8_per_channel(w)
        op = ops[torch.ops.fxquant.int8_weight_only_grouped_mm.default]
        dq = ref.dequantize_int8_per_channel(q, scale)
        return op, ref.int8_weight_only_grouped_mm, (q, scale), dq

    def int4(w, g=64):  # 2880 = 45 groups of 64
        packed, scale, zero = ref.quantize_int4_grouped(
            w.flatten(0, 1), group_size=g, symmetric=False
        )
        dq = ref.dequantize_int4_grouped(packed, scale, zero, group_size=g)[:, : w.shape[2]]
        consts = tuple(t.unflatten(0, w.shape[:2]) for t in (packed, scale, zero))
        op = ops[torch.ops.fxquant.int4_weight_only_grouped_mm.default]

        def fast(x, *c):
            return op(x, *c, g)

        def reference(x, *c):
            return ref.int4_weight_only_grouped_mm(x, *c, group_size=g)

        return fast, reference, consts, dq.reshape(w.shape)

    def w8a8(w):  # int8 per channel, x per token in int8
        q, scale = ref.quantize_int8_per_channel(w)
        op = ops[torch.ops.fxquant.int8_dynamic_grouped_mm.default]
        dq = ref.dequantize_int8_per_channel(q, scale)
        return op, ref.int8_dynamic_grouped_mm, (q, scale), dq

    def fp8wo(w):  # e4m3 per channel, x in bf16: int8 weight-only's kernel on e4m3 bytes
        q, scale = ref.quantize_fp8_per_channel(w)
        op = ops[torch.ops.fxquant.float8_weight_only_grouped_mm.default]
        return op, ref.float8_weight_only_grouped_mm, (q, scale), q.float() * scale[..., None]

    def fp8_row(w):  # FbgemmFp8Config's experts: x per token (amax uncapped here)
        q, scale = ref.quantize_fp8_per_channel(w)
        op = ops[torch.ops.fxquant.float8_dynamic_grouped_mm.default]

        def fast(x, *c):
            return op(x, *c, None)

        return fast, ref.float8_dynamic_grouped_mm, (q, scale), q.float() * scale[..., None]

    def fp8_block(w, b=128):  # FineGrainedFP8Config's: 128×128 tiles, x in 1×128 groups
        stored = Float8Block(block_size=b).quantize(w)
        op = ops[torch.ops.fxquant.float8_block_grouped_mm.default]

        def fast(x, *c):
            return op(x, *c, b)

        def reference(x, *c):
            return ref.float8_block_grouped_mm(x, *c, block_size=b)

        consts = (stored.tensors["qweight"], stored.tensors["scale"])
        return fast, reference, consts, stored.dequantized

    formats = (("mxfp4", mxfp4), ("int8", int8), ("int4", int4), ("w8a8", w8a8),
               ("fp8wo", fp8wo), ("fp8-row", fp8_row), ("fp8-block", fp8_block))  # fmt: skip
    for fmt, quantize in formats:
        for label, n, k in shapes:
            torch.manual_seed(0)
            w = torch.randn(e, n, k, device=device) * 0.02
            fast, reference, consts, dq = quantize(w)
            w_ekn = dq.to(torch.bfloat16).transpose(1, 2).contiguous()
            for tokens in (1, 5) if smoke else (1, 16, 512):
                if budget.left() < 15:
                    print("experts: budget spent, stopping", flush=True)
                    return
                rows = tokens * top_k
                x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
                ids = torch.randint(0, e, (rows,), device=device).sort().values
                offs = torch.bincount(ids, minlength=e).cumsum(0).to(torch.int32)
                row = {"format": fmt, "shape": label, "tokens": tokens, "rows": rows}
                row.update(N=n, K=k, E=e)
                try:
                    args = (x, *consts, offs)
                    y = fast(*args)
                    row["sqnr_vs_reference_db"] = sqnr(reference(*args), y)
                    row["ms"] = bench(lambda f=fast, args=args: f(*args))
                    row["graph_ms"] = graph(lambda f=fast, args=args: f(*args))
                    if hasattr(torch, "_grouped_mm") and not smoke:
                        bf16 = (x, w_ekn)
                        base = bench(lambda b=bf16, o=offs: torch._grouped_mm(*b, offs=o))
                        row["bf16_grouped_mm_ms"] = base
                        row["speedup_vs_bf16"] = base / row["ms"]
                        gbase = graph(lambda b=bf16, o=offs: torch._grouped_mm(*b, offs=o))
                        if gbase and row["graph_ms"]:
                            row["graph_speedup_vs_bf16"] = gbase / row["graph_ms"]
                except Exception as ex:  # noqa: BLE001 - a failing kernel is a result
                    row["error"] = f"{type(ex).__name__}: {str(ex)[:300]}"
                res.rec["experts"].append(row)
                res.write()
                print(f"experts {fmt} {label} tokens={tokens}: {row}", flush=True)


# --------------------------------------------------------------------------- 2. norm_quant


def run_norm_quant(res: Results, *, device: str, smoke: bool) -> None:
    import fxquant.kernels.norm_quant  # noqa: F401  (registers fxquant::triton_norm_quant)

    bench = graph_timer(smoke)  # GPU time: at ~0.1 ms a call, launch overhead would be half
    rows, k = (64, 256) if smoke else (8192, 4096)
    x = torch.randn(rows, k, device=device, dtype=torch.bfloat16)
    w = torch.randn(k, device=device, dtype=torch.bfloat16)
    y = torch.empty_like(x)
    copy_ms = bench(lambda: y.copy_(x))
    copy_gbs = 2 * x.numel() * x.element_size() / copy_ms / 1e6
    out = {"shape": [rows, k], "copy_ms": copy_ms, "copy_GBps": copy_gbs, "variants": {}}
    nq = torch.ops.fxquant.triton_norm_quant
    for name, qdtype, group in (
        ("int8 per token", torch.int8, -1),
        ("fp8 per token", torch.float8_e4m3fn, -1),
        ("fp8 1x128 groups", torch.float8_e4m3fn, 128),
    ):
        ms = bench(lambda q=qdtype, g=group: nq(x, w, None, 1e-5, True, q, g, None, False))
        if ms is None:
            out["variants"][name] = {"error": "cuda graph capture failed"}
            continue
        n_scales = rows * (1 if group == -1 else -(-k // group))
        moved = x.numel() * 2 + x.numel() * 1 + n_scales * 4 + k * 2
        gbs = moved / ms / 1e6
        out["variants"][name] = {"ms": ms, "GBps": gbs, "fraction_of_copy_bw": gbs / copy_gbs}
        print(f"norm_quant {name}: {gbs:.0f} GB/s = {gbs / copy_gbs:.0%} of copy", flush=True)
    res.rec["norm_quant"] = out
    res.write()


# --------------------------------------------------------------------------- 3. stack


class RMSNorm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return F.rms_norm(x, (x.shape[-1],), self.weight, self.eps)


class Layer(nn.Module):
    """A Llama-3 decoder layer without RoPE (not what is being timed): GQA attention through
    SDPA, SwiGLU MLP, pre-norm residuals."""

    def __init__(self, d: int, ffn: int, heads: int, kv_heads: int):
        super().__init__()
        hd = d // heads
        self.heads, self.kv_heads, self.hd = heads, kv_heads, hd
        self.input_layernorm = RMSNorm(d)
        self.q_proj = nn.Linear(d, heads * hd, bias=False)
        self.k_proj = nn.Linear(d, kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(heads * hd, d, bias=False)
        self.post_attention_layernorm = RMSNorm(d)
        self.gate_proj = nn.Linear(d, ffn, bias=False)
        self.up_proj = nn.Linear(d, ffn, bias=False)
        self.down_proj = nn.Linear(ffn, d, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        h = self.input_layernorm(x)
        q = self.q_proj(h).view(b, t, self.heads, self.hd).transpose(1, 2)
        k = self.k_proj(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        v = self.v_proj(h).view(b, t, self.kv_heads, self.hd).transpose(1, 2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        x = x + self.o_proj(a.transpose(1, 2).reshape(b, t, -1))
        h = self.post_attention_layernorm(x)
        return x + self.down_proj(F.silu(self.gate_proj(h)) * self.up_proj(h))


class Stack(nn.Module):
    def __init__(self, layers: int, **kw):
        super().__init__()
        self.layers = nn.ModuleList(Layer(**kw) for _ in range(layers))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def run_stack(res: Results, budget: Budget, *, device: str, smoke: bool, runner: str) -> None:
    import fxquant

    bench = timer(smoke)
    if smoke:
        kw, layers, prefill = {"d": 64, "ffn": 128, "heads": 4, "kv_heads": 2}, 2, 32
    else:
        from shapes import get_shape

        s = get_shape("llama3-8b")
        kw = {"d": s.d_model, "ffn": s.ffn, "heads": s.heads, "kv_heads": s.kv_heads}
        layers, prefill = 8, 2048
    torch.manual_seed(0)
    model = Stack(layers, **kw).to(device=device, dtype=torch.bfloat16).eval()
    for p in model.parameters():
        nn.init.normal_(p, std=0.02) if p.ndim == 2 else nn.init.ones_(p)
    d = kw["d"]
    xs = {
        "decode": torch.randn(1, 1, d, device=device, dtype=torch.bfloat16),
        "prefill": torch.randn(1, prefill, d, device=device, dtype=torch.bfloat16),
    }
    example = torch.randn(1, 16, d, device=device, dtype=torch.bfloat16)
    with torch.no_grad():
        ep = torch.export.export(model, (example,), dynamic_shapes=({1: torch.export.Dim.DYNAMIC},))
        refs = {ph: model(x).float() for ph, x in xs.items()}
    tmp = Path(tempfile.mkdtemp(prefix="fxq_gpu_stack_"))
    base_ms: dict[str, float] = {}
    for recipe in ("bf16", *STACK_RECIPES):
        if budget.left() < 90:
            print(f"stack: budget spent before {recipe}", flush=True)
            break
        row: dict = {"recipe": recipe, "layers": layers, "prefill_tokens": prefill}
        t0 = time.perf_counter()
        try:
            program = ep if recipe == "bf16" else fxquant.quantize(ep, recipe)
            if smoke:
                ops = {str(n.target) for n in program.graph.nodes if n.op == "call_function"}
                row["fxquant_ops"] = sorted(o for o in ops if o.startswith("fxquant."))
            fn, info = build(
                program, tmp / f"{recipe}.pt2", runner=runner, smoke=smoke, section="stack"
            )
            row.update(info)
            row["build_s"] = time.perf_counter() - t0
            with torch.no_grad():
                for ph, x in xs.items():
                    row[f"{ph}_sqnr_vs_bf16_db"] = sqnr(refs[ph], fn(x))
                    row[f"{ph}_ms"] = bench(lambda fn=fn, x=x: fn(x))
                    if recipe == "bf16":
                        base_ms[ph] = row[f"{ph}_ms"]
                    row[f"{ph}_speedup_vs_bf16"] = base_ms[ph] / row[f"{ph}_ms"]
        except Exception as e:  # noqa: BLE001 - a failing recipe is a result
            row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
        res.rec["stack"].append(row)
        res.write()
        print(f"stack {recipe}: {_stack_line(row)}", flush=True)


def _stack_line(row: dict) -> str:
    if "error" in row:
        return row["error"][:200]
    return (
        f"decode {row['decode_ms']:.3f} ms ({row['decode_speedup_vs_bf16']:.2f}x), prefill "
        f"{row['prefill_ms']:.2f} ms ({row['prefill_speedup_vs_bf16']:.2f}x), built in "
        f"{row['build_s']:.0f} s"
    )


def build(program, path: Path, *, runner: str, smoke: bool, section: str) -> tuple[Callable, dict]:
    """The callable a section times, and what to record about it. ``aoti``: fxquant's
    AOTInductor package (what a deployment loads); ``inductor``: the same lowered program under
    ``torch.compile`` (Inductor, same kernels, Python around them), what ``main`` falls back to
    when loading a package crashed the process (the second H200 run: ``aoti_load_package``
    segfaulted on its first, bf16, package under torch 2.11)."""
    import fxquant
    from fxquant.passes.lower import lower

    if os.environ.get("FXQ_GPU_BENCH_CRASH") == section and runner == "aoti":
        os.kill(os.getpid(), signal.SIGSEGV)  # tests/test_gpu_script.py: the fallback path
    if smoke:
        # triton_op bodies cannot be compiled for CPU tensors, and lowering cannot trace them
        # while Triton interprets: tests/test_lower_cuda.py covers that lowering
        return program.module(), {"runner": "eager (smoke)"}
    if runner == "aoti":
        fn = fxquant.aot_compile(program, path, device="cuda")
        return fn, {"runner": "aoti", "package_bytes": path.stat().st_size}
    # export_llm's programs read the cache length as data (.item()): keep it in the graph
    torch._dynamo.config.capture_scalar_outputs = True
    return torch.compile(lower(program, device="cuda").module()), {"runner": "inductor"}


# --------------------------------------------------------------------------- 3b. cached decode

DECODE_RECIPES = ("int8wo+lm_head", "int4wo-64+lm_head=int8wo", "fp8-row+lm_head")


def run_decode(res: Results, budget: Budget, *, device: str, smoke: bool, runner: str) -> None:
    """LLM decode with a static KV cache (``fxquant.export_llm``): a Llama-3-8B-shaped decoder
    (8 of its 32 layers, its vocabulary; random weights), bf16, batch 1 and 8. Per recipe the
    AOTInductor package's decode step (median of 32) and a 2048-token prefill, beside bf16's
    package of the same program. Needs transformers (StaticCache) on the machine."""
    import transformers

    import fxquant

    bench = timer(smoke)
    if smoke:
        cfg = dict(
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            vocab_size=256,
        )
        prefill, batches = 16, (1,)  # batch > 1 programs: tests/test_llm.py
    else:
        from shapes import get_shape

        sh = get_shape("llama3-8b")
        cfg = dict(
            hidden_size=sh.d_model,
            intermediate_size=sh.ffn,
            num_hidden_layers=8,
            num_attention_heads=sh.heads,
            num_key_value_heads=sh.kv_heads,
            vocab_size=sh.vocab,
        )
        prefill, batches = 2048, (1, 8)
    config = transformers.LlamaConfig(**cfg, max_position_embeddings=prefill + 64)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16).eval()
    tmp = Path(tempfile.mkdtemp(prefix="fxq_gpu_decode_"))
    try:  # the packages (GBs each at 8B shapes) leave the device's disk with the section
        for batch in batches:
            try:
                ep = fxquant.export_llm(model, max_cache_len=prefill + 64, max_batch=batch)
            except Exception as e:  # noqa: BLE001 - a failing export is a result
                error = f"{type(e).__name__}: {e}"[:400]
                res.rec["decode"].append({"batch": batch, "error": error})
                res.write()
                continue
            ids = torch.randint(0, config.vocab_size, (batch, prefill), device=device)
            base: dict[str, float] = {}
            for recipe in ("bf16", *DECODE_RECIPES):
                if budget.left() < 100:
                    print(f"decode: budget spent before batch {batch} {recipe}", flush=True)
                    return
                row: dict = {
                    "recipe": recipe,
                    "batch": batch,
                    "layers": config.num_hidden_layers,
                    "prefill_tokens": prefill,
                }
                t0 = time.perf_counter()
                try:
                    program = ep if recipe == "bf16" else fxquant.quantize(ep, recipe)
                    path = tmp / f"{recipe}-{batch}.pt2"
                    fn, info = build(program, path, runner=runner, smoke=smoke, section="decode")
                    row.update(info)
                    row["build_s"] = time.perf_counter() - t0
                    row["prefill_ms"], row["decode_ms"] = _time_llm(fn, ids, bench)
                    row["decode_tokens_per_s"] = batch * 1e3 / row["decode_ms"]
                    row["prefill_tokens_per_s"] = batch * prefill * 1e3 / row["prefill_ms"]
                    for ph in ("decode", "prefill"):
                        if recipe == "bf16":
                            base[ph] = row[f"{ph}_ms"]
                        row[f"{ph}_speedup_vs_bf16"] = base[ph] / row[f"{ph}_ms"] if base else None
                except Exception as e:  # noqa: BLE001 - a failing recipe is a result
                    row["error"] = f"{type(e).__name__}: {str(e)[:400]}"
                res.rec["decode"].append(row)
                res.write()
                line = row.get("error") or _decode_line(row)
                print(f"decode b={batch} {recipe}: {line}", flush=True)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _time_llm(fn, ids: torch.Tensor, bench) -> tuple[float, float]:
    """(prefill ms of all of ``ids``, decode ms of one token per row at the next positions)."""
    b, t = ids.shape
    pos = torch.arange(t, device=ids.device)
    tok = ids[:, :1].contiguous()
    steps = [torch.tensor([t + i], device=ids.device) for i in range(32)]
    count = iter(range(10**9))
    with torch.no_grad():
        prefill_ms = bench(lambda: fn(ids, pos))
        decode_ms = bench(lambda: fn(tok, steps[next(count) % len(steps)]))
    return prefill_ms, decode_ms


def _decode_line(row: dict) -> str:
    return (
        f"decode {row['decode_tokens_per_s']:.1f} tok/s ({row['decode_speedup_vs_bf16']:.2f}x), "
        f"prefill {row['prefill_tokens_per_s']:.0f} tok/s ({row['prefill_speedup_vs_bf16']:.2f}x),"
        f" built in {row['build_s']:.0f} s"
    )


# --------------------------------------------------------------------------- 4. targets


# --------------------------------------------------------------------------- 4b. fp8 training


def _fp8_training_module():
    """benchmarks/gpu/fp8_training.py, loaded by its path: benchmarks/ (on PYTHONPATH) has a
    CPU benchmark of the same module name."""
    import importlib.util

    name = "fxquant_gpu_fp8_training"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            name, Path(__file__).with_name("fp8_training.py")
        )
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    return sys.modules[name]


def run_fp8_training(res: Results, budget: Budget, *, device: str, smoke: bool) -> None:
    """FP8 training of one Llama-3-8B block vs bf16: see fp8_training.py."""
    _fp8_training_module().run_fp8_training(res, budget, device=device, smoke=smoke, layer=Layer)


# --------------------------------------------------------------------------- 5. every K


class _EveryK(nn.Module):
    def __init__(self, ks):
        super().__init__()
        self.fc = nn.ModuleList(nn.Linear(k, 24) for k in ks)

    def forward(self, x):
        return torch.stack([fc(x[..., : fc.in_features]) for fc in self.fc])


@contextlib.contextmanager
def _first_configs_only():
    """Every fxquant autotuner keeps its first config, inside the block. every_k checks
    correctness at 200 Ks, and autotuning keys on K: on the H200 (2026-12-04) tuning each new K
    put the first recipe alone past five minutes. The first configs are the small tiles that
    serve every shape."""
    from triton.runtime.autotuner import Autotuner

    tuners = {
        id(v): v
        for name, module in list(sys.modules.items())
        if name.startswith("fxquant.kernels") and module is not None
        for v in vars(module).values()
        if isinstance(v, Autotuner)
    }
    saved = {i: t.configs for i, t in tuners.items()}
    for t in tuners.values():
        t.configs = t.configs[:1]
    try:
        yield
    finally:
        for i, t in tuners.items():
            t.configs = saved[i]


def run_every_k(res: Results, budget: Budget, *, device: str, smoke: bool) -> None:
    with _first_configs_only():
        _every_k(res, budget, device=device, smoke=smoke)


def _every_k(res: Results, budget: Budget, *, device: str, smoke: bool) -> None:
    import fxquant
    from fxquant.passes.lower import lowerings

    table = lowerings("cuda")

    class Lowered(torch.fx.Interpreter):
        def call_function(self, target, args, kwargs):
            fn = table.get(target)
            return super().call_function(target, args, kwargs) if fn is None else fn(*args)

    ks = list(range(1, 9 if smoke else 201))
    torch.manual_seed(0)
    model = _EveryK(ks).eval().to(device)
    x = torch.randn(3, max(ks), device=device)
    ep = torch.export.export(model, (x,), dynamic_shapes=({0: torch.export.Dim.DYNAMIC},))
    out = res.rec.setdefault("every_k", {})
    for recipe in fxquant.RECIPES:
        if budget.left() < 5:
            out[recipe] = {"error": "not run: the time budget was spent"}
            continue
        entry: dict = {}
        try:
            qep = fxquant.quantize(ep, recipe)
            gm = qep.module()
            worst, at = float("inf"), None
            for m in (1, 17):
                xi = torch.randn(m, max(ks), device=device)
                with torch.no_grad():
                    got, want = Lowered(gm).run(xi), gm(xi)
                for i, k in enumerate(ks):
                    db = sqnr(want[i], got[i])
                    if db < worst:
                        worst, at = db, k
            rows = fxquant.report(qep).rows
            entry = {
                "worst_sqnr_db": worst,
                "at_k": at,
                "quantized": sum(r["status"] == "quantized" for r in rows),
            }
        except Exception as e:  # noqa: BLE001 - a failing lowering is a result
            entry["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        out[recipe] = entry
        res.write()
        print(f"every_k {recipe}: {entry}", flush=True)


def targets(rec: dict) -> list[dict]:
    """The issue's targets beside what was measured (kernel rows: the largest-N shape)."""

    def kernel(recipe: str, m: int, key: str = "speedup_vs_bf16") -> float | None:
        """The median over shapes, of the CUDA-graph (GPU time) ratio where it was measured."""
        rows = [r for r in rec["kernels"] if r["M"] == m and recipe in r["recipes"]]
        graphed = key.replace("speedup", "graph_speedup").replace("gemm_only", "gemm_only_graph")
        vals = [r["recipes"][recipe].get(graphed, r["recipes"][recipe].get(key)) for r in rows]
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    nq = rec.get("norm_quant") or {}
    nq_frac = [v["fraction_of_copy_bw"] for v in nq.get("variants", {}).values()]
    measured = {
        "decode int4wo vs bf16 (M=1)": kernel("int4wo-128", 1),
        "decode int8wo vs bf16 (M=1)": kernel("int8wo", 1),
        "decode fp8wo vs bf16 (M=1)": kernel("fp8wo", 1),
        "prefill fp8-row vs bf16 (M=2048)": kernel("fp8-row", 2048),
        "prefill fp8-row vs _scaled_mm row (M=2048)": kernel(
            "fp8-row", 2048, "gemm_only_vs_scaled_mm_row"
        ),
        "prefill fp8-block vs bf16 (M=2048)": kernel("fp8-block", 2048),
        "norm_quant vs copy bandwidth": min(nq_frac) if nq_frac else None,
    }
    return [
        {
            "target": name,
            "at_least": goal,
            "measured_median_over_shapes": measured[name],
            "met": None if measured[name] is None else measured[name] >= goal,
        }
        for name, goal in TARGETS.items()
    ]


def write_table(rec: dict, path: Path) -> None:
    lines = ["| target | at least | measured | met |", "|---|---|---|---|"]
    for t in rec["targets"]:
        v = t["measured_median_over_shapes"]
        lines.append(
            f"| {t['target']} | {t['at_least']} | {'-' if v is None else f'{v:.2f}'} | "
            f"{'-' if t['met'] is None else 'yes' if t['met'] else 'no'} |"
        )
    runner = rec.get("section_runner", {})
    lines += [
        "",
        f"| stack recipe ({runner.get('stack', '-')}) | decode x bf16 | prefill x bf16 | build s |",
        "|---|---|---|---|",
    ]
    for r in rec["stack"]:
        if "error" in r:
            lines.append(f"| {r['recipe']} | error | {r['error'][:80]} | |")
        else:
            lines.append(
                f"| {r['recipe']} | {r['decode_speedup_vs_bf16']:.2f} | "
                f"{r['prefill_speedup_vs_bf16']:.2f} | {r['build_s']:.0f} |"
            )
    lines += [
        "",
        f"| cached decode recipe ({runner.get('decode', '-')}) | batch | decode tok/s | x bf16 "
        "| prefill tok/s | x bf16 |",
        "|---|---|---|---|---|---|",
    ]
    for r in rec.get("decode", []):
        if "error" in r:
            lines.append(
                f"| {r.get('recipe', '-')} | {r['batch']} | error | {r['error'][:80]} | | |"
            )
        else:
            lines.append(
                f"| {r['recipe']} | {r['batch']} | {r['decode_tokens_per_s']:.1f} | "
                f"{r['decode_speedup_vs_bf16']:.2f} | {r['prefill_tokens_per_s']:.0f} | "
                f"{r['prefill_speedup_vs_bf16']:.2f} |"
            )
    lines += [
        "",
        "| experts | tokens | ms | x bf16 grouped_mm | SQNR dB |",
        "|---|---|---|---|---|",
    ]
    for r in rec["experts"]:
        what = f"{r.get('format', 'mxfp4')} {r['shape']}"
        if "error" in r:
            lines.append(f"| {what} | {r['tokens']} | error | {r['error'][:80]} | |")
        else:
            speed = r.get("speedup_vs_bf16")
            lines.append(
                f"| {what} | {r['tokens']} | {r['ms']:.3f} | "
                f"{'-' if speed is None else f'{speed:.2f}'} | {r['sqnr_vs_reference_db']:.0f} |"
            )
    lines += _fp8_training_module().table_lines(rec.get("fp8_training"))
    lines += ["", "| every K 1..200 | worst SQNR dB | at K | layers quantized |"]
    lines.append("|---|---|---|---|")
    for recipe, r in rec.get("every_k", {}).items():
        if "error" in r:
            lines.append(f"| {recipe} | error | {r['error'][:80]} | |")
        else:
            lines.append(
                f"| {recipe} | {r['worst_sqnr_db']:.0f} | {r['at_k']} | {r['quantized']} |"
            )
    for c in rec.get("section_crashes", []):
        lines.append(
            f"\n{c['section']} with the {c['runner']} runner ended by {c['ended']} after "
            f"{len(c['rows_before'])} rows"
        )
    path.write_text("\n".join(lines) + "\n")


def _version_of(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# Sections that load AOTInductor packages run in a child process each: a crash in one (the second
# H200 run lost the whole call to a segfault in aoti_load_package) loses that attempt only, and the
# section runs again with the same programs under Inductor (``build``), if its budget allows.
ISOLATED = ("stack", "decode")


def run_isolated(name: str, res: Results, budget: Budget, a: argparse.Namespace) -> None:
    for runner in ("aoti", "inductor"):
        seconds = budget.left()
        if seconds < 100:
            print(f"{name}: {seconds:.0f} s left, not enough for the {runner} runner", flush=True)
            return
        with tempfile.TemporaryDirectory(prefix=f"fxq_gpu_{name}_") as d:
            cmd = [sys.executable, __file__, "--child", "--out", d, "--sections", name]
            cmd += ["--budget-s", f"{seconds:.0f}", "--runner", runner]
            cmd += ["--smoke"] if a.smoke else []
            try:
                rc: int | str = subprocess.run(cmd, timeout=seconds + 120).returncode
            except subprocess.TimeoutExpired:
                rc = "timeout"
            path = Path(d) / "gpu.json"
            part = json.loads(path.read_text()) if path.exists() else {}
        rows = part.get(name) or []
        if rc == 0:
            res.rec[name] = rows
            res.rec.setdefault("section_runner", {})[name] = runner
            if name in part.get("section_errors", {}):
                res.rec.setdefault("section_errors", {})[name] = part["section_errors"][name]
            return
        how = f"signal {signal.Signals(-rc).name}" if isinstance(rc, int) and rc < 0 else rc
        res.rec.setdefault("section_crashes", []).append(
            {"section": name, "runner": runner, "ended": how, "rows_before": rows}
        )
        res.write()
        print(f"{name} with the {runner} runner ended by {how} after {len(rows)} rows", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/fxq_gpu")))
    ap.add_argument("--budget-s", type=float, default=420.0)
    ap.add_argument("--smoke", action="store_true", help="CPU + TRITON_INTERPRET=1, tiny shapes")
    ap.add_argument(
        "--caps",
        default="",
        help="per-section seconds, e.g. kernels=150,fp8_training=170 (each also within --budget-s)",
    )
    ap.add_argument(
        "--sections",
        default="kernels,experts,norm_quant,stack,decode,fp8_training,every_k",
        help="comma-separated subset to run",
    )
    ap.add_argument(
        "--runner",
        choices=("aoti", "inductor"),
        default="aoti",
        help="how stack and decode run their programs (see build); main retries with inductor",
    )
    ap.add_argument("--child", action="store_true", help="run in-process (set by run_isolated)")
    a = ap.parse_args()
    if a.smoke:
        os.environ["TRITON_INTERPRET"] = "1"  # before any kernel module is imported
        from fxquant.kernels.interpreter import allow_interpreted_kernels

        allow_interpreted_kernels()  # under torch 2.11 (see that module)
    device = "cpu" if a.smoke else "cuda"
    if not a.smoke and not torch.cuda.is_available():
        raise SystemExit("no CUDA device: run with --smoke to check the script on CPU")
    import triton

    import fxquant

    a.out.mkdir(parents=True, exist_ok=True)
    budget = Budget(a.budget_s)
    meta = {
        "script": "benchmarks/gpu/bench.py",
        "argv": sys.argv[1:],
        "smoke": a.smoke,
        "device": torch.cuda.get_device_name() if device == "cuda" else "cpu (interpreter)",
        "versions": {
            "torch": torch.__version__,
            "triton": triton.__version__,
            "python": platform.python_version(),
            "fxquant": getattr(fxquant, "__version__", "dev"),
            "transformers": _version_of("transformers"),
        },
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        # run.sh stages fxquant with a dist-info, so backend="fxquant" resolves to the staged copy
        "fxquant_from": str(Path(fxquant.__file__).parent.parent),
        "fxquant_dist_from": str(importlib.metadata.distribution("fxquant").locate_file("")),
        "timing": "median ms, triton.testing.do_bench (CUDA events)",
    }
    res = Results(a.out, meta)
    caps = {k: float(v) for k, v in (kv.split("=") for kv in a.caps.split(",") if kv)}

    def part(name: str) -> Budget:
        """The section's own budget: its cap, never past the call's budget."""
        return Budget(min(caps.get(name, float("inf")), budget.left()))

    runners = {
        "kernels": lambda: run_kernels(res, part("kernels"), device=device, smoke=a.smoke),
        "experts": lambda: run_experts(res, part("experts"), device=device, smoke=a.smoke),
        "norm_quant": lambda: (
            budget.left() > 30 and run_norm_quant(res, device=device, smoke=a.smoke)
        ),
        "stack": lambda: run_stack(
            res, part("stack"), device=device, smoke=a.smoke, runner=a.runner
        ),
        "decode": lambda: run_decode(
            res, part("decode"), device=device, smoke=a.smoke, runner=a.runner
        ),
        "fp8_training": lambda: run_fp8_training(
            res, part("fp8_training"), device=device, smoke=a.smoke
        ),
        "every_k": lambda: run_every_k(res, part("every_k"), device=device, smoke=a.smoke),
    }
    # in the order given: the call that has the least device time runs what matters most first
    for name in a.sections.split(","):
        t0 = time.perf_counter()
        try:
            if name in ISOLATED and not a.child:
                run_isolated(name, res, part(name), a)
            else:
                runners[name]()
        except Exception as e:  # noqa: BLE001 - one broken section must not lose the others
            res.rec.setdefault("section_errors", {})[name] = f"{type(e).__name__}: {e}"[:500]
            print(f"section {name} failed: {e}", flush=True)
        res.rec.setdefault("section_s", {})[name] = round(time.perf_counter() - t0, 1)
        res.write()
    res.rec["targets"] = targets(res.rec)
    res.rec["complete"] = True
    res.rec["wall_s"] = budget.seconds - budget.left()
    res.write()
    write_table(res.rec, a.out / "gpu.md")
    print((a.out / "gpu.md").read_text())


if __name__ == "__main__":
    main()
