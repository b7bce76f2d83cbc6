"""Which aten-only composition should fxquant lower each quantized linear to on CPU?

For every scheme (int8 weight-only, int4 grouped weight-only, int8 dynamic w8a8, fp8 e4m3
weight-only, fp8 dynamic) this times candidate compositions of plain aten ops side by side,
under torch.compile (Inductor) and eager, at K=1024/N=4096 and K=2048/N=8192 with M=1 and
M=128, against fp32 `F.linear` eager and fp32 Inductor. Every candidate's output is compared
with the pure-torch reference math of its scheme (relative error ||y - ref|| / ||ref||, ref in
float64). The winner of each scheme (the `lower_*` functions below) is then exported with a
dynamic batch dim, packaged with AOTInductor, loaded back and run at several M.

Timings are medians over rounds that interleave all candidates of a shape, so that load from
other processes on the shared cores hits them alike. Results go to
benchmarks/results/aten_kernels.json.

    python benchmarks/aten_kernels.py            # full run (~5 min on 2 cores)
    python benchmarks/aten_kernels.py --quick    # one shape, fewer rounds
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
import types
from collections.abc import Callable
from pathlib import Path

import torch
import torch._inductor.config as inductor_config
import torch.nn.functional as F
from machine import bench_interleaved, machine_info, write_results

from fxquant.passes.cpu import int4 as cpu_int4
from fxquant.passes.cpu import int8 as cpu_int8

BF16 = torch.bfloat16
E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
EPS = 1e-12


# --------------------------------------------------------------------------- winners
# The compositions fxquant lowers to, called from fxquant.passes.cpu itself (not copies), so
# this script times what the lowering emits. All weight-side tensors are prepared once (see
# `prepare`) and must be stored buffers, never computed in-graph: Inductor's
# `_weight_int8pack_mm` lowering does not realize its scale argument, so a scale computed in
# the graph (e.g. `scale.to(bf16)`, `torch.ones(...)`) fails with
# `LoweringException: AssertionError: <class '...Pointwise'>` (the message blames args[0]).


def lower_int8_woq(x, wq, scale, bias, ones_bf16):
    """int8 weight-only. wq int8 [N, K]; scale fp32 [N]; ones_bf16 bf16 [N] (all ones)."""
    return cpu_int8._cpu_int8_weight_only(x, wq, scale, ones_bf16, bias)


def lower_int4_woq(x, w_packed, scale_zero_bf16, bias, group_size: int):
    """int4 grouped weight-only. w_packed uint8 [N, K/2] from _convert_weight_to_int4pack_for_cpu;
    scale_zero_bf16 bf16 [K/g, N, 2] with w = (q - 8) * scale + zero, q in [0, 15]."""
    n = w_packed.shape[0]
    return cpu_int4._cpu_int4_weight_only(x, w_packed, scale_zero_bf16, bias, group_size, n)


def quantize_act_int8(x):
    """Per-token symmetric int8 activation quantization (reference math), values kept float."""
    sx = x.abs().amax(dim=-1, keepdim=True).clamp(min=EPS) / 127.0
    return torch.round(x / sx).clamp(-128, 127), sx


def lower_w8a8(x, wq, scale, bias, ones_bf16):
    """int8 dynamic activation x int8 weight. Same weight tensors as lower_int8_woq;
    xq (integers in [-127, 127]) is exact in bf16."""
    return cpu_int8._cpu_int8_dynamic(x, wq, scale, ones_bf16, bias)


def lower_fp8_woq(x, wq, scale, bias):
    """fp8 e4m3 weight-only. wq float8_e4m3fn [N, K]; scale fp32 [N]."""
    y = F.linear(x, wq.to(x.dtype)) * scale
    return y + bias if bias is not None else y


def lower_fp8_dyn(x, wq, scale, bias):
    """fp8 e4m3 dynamic per-token activation x per-channel weight (scale fp32 [N]; a
    per-tensor scale is the same code with numel-1 scales)."""
    xf = x.float()
    sx = xf.abs().amax(dim=-1, keepdim=True).clamp(min=EPS) / E4M3_MAX
    xq = (xf / sx).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    y = F.linear(xq.float(), wq.float()) * (sx * scale)
    if bias is not None:
        y = y + bias
    return y.to(x.dtype)


# --------------------------------------------------------------------------- quantization


def prepare(weight: torch.Tensor, bias: torch.Tensor, group_size: int = 128) -> dict:
    """Quantize one fp32 weight for all schemes (reference math); returns stored tensors."""
    n, k = weight.shape
    s8 = weight.abs().amax(dim=1).clamp(min=EPS) / 127.0
    wq8 = torch.round(weight / s8[:, None]).clamp(-128, 127).to(torch.int8)
    # int4 asymmetric, groups along K: w ~ (q - z) * s, q in [0, 15]
    wg = weight.reshape(n, k // group_size, group_size)
    lo, hi = wg.amin(-1), wg.amax(-1)
    s4 = ((hi - lo) / 15.0).clamp(min=EPS)
    z4 = torch.round(-lo / s4).clamp(0, 15)
    q4 = torch.round(wg / s4[..., None] + z4[..., None]).clamp(0, 15)
    # aten convention: (q - 8) * scale + zero  =>  zero = (8 - z) * scale
    zero4 = (8.0 - z4) * s4
    sfp8 = weight.abs().amax(dim=1).clamp(min=EPS) / E4M3_MAX
    wfp8 = (weight / sfp8[:, None]).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return {
        "bias": bias,
        "w_fp32": weight,
        "wq8": wq8,
        "s8": s8,
        "s8_bf16": s8.to(BF16),
        "ones_bf16": torch.ones(n, dtype=BF16),
        "q4": q4.reshape(n, k).to(torch.int32),
        "s4": s4,
        "zero4": zero4,
        "w4_packed": torch.ops.aten._convert_weight_to_int4pack_for_cpu(
            q4.reshape(n, k).to(torch.int32), 1
        ),
        "sz4_bf16": torch.stack([s4.t(), zero4.t()], dim=-1).contiguous().to(BF16),
        "sz4_fp32": torch.stack([s4.t(), zero4.t()], dim=-1).contiguous(),
        "wfp8": wfp8,
        "sfp8": sfp8,
        "group_size": group_size,
    }


def references(x: torch.Tensor, t: dict) -> dict:
    """Reference outputs per scheme, computed in float64 from the stored quantized values."""
    xd, b = x.double(), t["bias"].double()
    n, k = t["wq8"].shape
    g = t["group_size"]
    w8 = t["wq8"].double() * t["s8"].double()[:, None]
    q4 = t["q4"].double().reshape(n, k // g, g)
    w4 = ((q4 - 8) * t["s4"].double()[..., None] + t["zero4"].double()[..., None]).reshape(n, k)
    wf8 = t["wfp8"].double() * t["sfp8"].double()[:, None]
    xq, sx = quantize_act_int8(x)
    y_w8a8 = (xq.double() @ t["wq8"].double().T) * sx.double() * t["s8"].double() + b
    sxf = x.abs().amax(dim=-1, keepdim=True).clamp(min=EPS) / E4M3_MAX
    xqf = (x / sxf).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    y_fp8d = (xqf.double() @ t["wfp8"].double().T) * sxf.double() * t["sfp8"].double() + b
    return {
        "fp32": xd @ t["w_fp32"].double().T + b,
        "int8_woq": xd @ w8.T + b,
        "int4_woq": xd @ w4.T + b,
        "w8a8": y_w8a8,
        "fp8_woq": xd @ wf8.T + b,
        "fp8_dyn": y_fp8d,
    }


# --------------------------------------------------------------------------- candidates

NO_CFG: dict = {}
MA_FRZ = {"max_autotune": True, "freezing": True}


def _int8_pack_fp32x(x, t):
    return torch.ops.aten._weight_int8pack_mm(x, t["wq8"], t["s8"]) + t["bias"]


def _int8_pack_bf16_scale(x, t):
    return (
        torch.ops.aten._weight_int8pack_mm(x.to(BF16), t["wq8"], t["s8_bf16"]).float() + t["bias"]
    )


def _int8_dequant_linear(x, t):
    return F.linear(x, t["wq8"].to(x.dtype)) * t["s8"] + t["bias"]


def _int8_bf16_linear(x, t):  # Inductor's woq pattern rewrites this to _weight_int8pack_mm
    xb = x.to(BF16)
    return (F.linear(xb, t["wq8"].to(BF16)) * t["s8_bf16"]).float() + t["bias"]


def _int4_pack_fp32x(x, t):
    g = t["group_size"]
    return (
        torch.ops.aten._weight_int4pack_mm_for_cpu(x, t["w4_packed"], g, t["sz4_fp32"]) + t["bias"]
    )


def _int4_dequant_linear(x, t):
    n, k = t["q4"].shape
    g = t["group_size"]
    q = t["q4"].reshape(n, k // g, g).float()
    w = ((q - 8) * t["s4"][..., None] + t["zero4"][..., None]).reshape(n, k)
    return F.linear(x, w, t["bias"])


def _w8a8_float_mm(x, t):
    xq, sx = quantize_act_int8(x)
    return F.linear(xq, t["wq8"].float()) * (sx * t["s8"]) + t["bias"]


def _w8a8_int_mm(x, t):
    xq, sx = quantize_act_int8(x)
    acc = torch._int_mm(xq.to(torch.int8), t["wq8"].T)
    return acc.float() * (sx * t["s8"]) + t["bias"]


def _fp8_woq_folded_scale(x, t):
    return F.linear(x, t["wfp8"].float() * t["sfp8"][:, None], t["bias"])


def _fp8_dyn_scaled_mm(x, t):
    sx = x.abs().amax(dim=-1, keepdim=True).clamp(min=EPS) / E4M3_MAX
    xq = (x / sx).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    y = torch._scaled_mm(
        xq, t["wfp8"].T, scale_a=sx, scale_b=t["sfp8"][None, :], out_dtype=torch.float32
    )
    return y + t["bias"]


# (scheme, name, fn(x, t), mode, inductor config, max M or None). mode: "eager" | "compile".
CANDIDATES: list[tuple[str, str, Callable, str, dict, int | None]] = [
    (
        "fp32",
        "F.linear eager",
        lambda x, t: F.linear(x, t["w_fp32"], t["bias"]),
        "eager",
        NO_CFG,
        None,
    ),
    (
        "fp32",
        "F.linear inductor",
        lambda x, t: F.linear(x, t["w_fp32"], t["bias"]),
        "compile",
        NO_CFG,
        None,
    ),
    (
        "fp32",
        "F.linear inductor max_autotune+freezing",
        lambda x, t: F.linear(x, t["w_fp32"], t["bias"]),
        "compile",
        MA_FRZ,
        None,
    ),
    (
        "int8_woq",
        "WINNER int8pack_mm(bf16 x, ones)*s",
        lambda x, t: lower_int8_woq(x, t["wq8"], t["s8"], t["bias"], t["ones_bf16"]),
        "compile",
        NO_CFG,
        None,
    ),
    (
        "int8_woq",
        "int8pack_mm(bf16 x, ones)*s max_autotune+freezing (cpp template)",
        lambda x, t: lower_int8_woq(x, t["wq8"], t["s8"], t["bias"], t["ones_bf16"]),
        "compile",
        MA_FRZ,
        None,
    ),
    ("int8_woq", "int8pack_mm(bf16 x, bf16 s)", _int8_pack_bf16_scale, "compile", NO_CFG, None),
    ("int8_woq", "int8pack_mm(fp32 x, fp32 s)", _int8_pack_fp32x, "compile", NO_CFG, 1),
    ("int8_woq", "F.linear(x, wq.float())*s", _int8_dequant_linear, "compile", NO_CFG, None),
    (
        "int8_woq",
        "F.linear(x, wq.float())*s max_autotune+freezing",
        _int8_dequant_linear,
        "compile",
        MA_FRZ,
        None,
    ),
    (
        "int8_woq",
        "F.linear(bf16 x, wq.bf16())*s (woq pattern)",
        _int8_bf16_linear,
        "compile",
        NO_CFG,
        1,
    ),
    (
        "int4_woq",
        "WINNER int4pack_mm_for_cpu(bf16 x, bf16 sz)",
        lambda x, t: lower_int4_woq(x, t["w4_packed"], t["sz4_bf16"], t["bias"], t["group_size"]),
        "compile",
        NO_CFG,
        None,
    ),
    ("int4_woq", "int4pack_mm_for_cpu(fp32 x, fp32 sz)", _int4_pack_fp32x, "compile", NO_CFG, 1),
    ("int4_woq", "dequant in graph + F.linear", _int4_dequant_linear, "compile", NO_CFG, None),
    (
        "w8a8",
        "WINNER int8pack_mm(bf16 xq, ones)*sx*sw",
        lambda x, t: lower_w8a8(x, t["wq8"], t["s8"], t["bias"], t["ones_bf16"]),
        "compile",
        NO_CFG,
        None,
    ),
    ("w8a8", "fp32 F.linear(xq, wq.float())*sx*sw", _w8a8_float_mm, "compile", NO_CFG, None),
    ("w8a8", "_int_mm (eager)", _w8a8_int_mm, "eager", NO_CFG, 1),
    (
        "fp8_woq",
        "WINNER F.linear(x, wq.float())*s",
        lambda x, t: lower_fp8_woq(x, t["wfp8"], t["sfp8"], t["bias"]),
        "compile",
        NO_CFG,
        None,
    ),
    (
        "fp8_woq",
        "F.linear(x, wq.float()*s[:,None])",
        _fp8_woq_folded_scale,
        "compile",
        NO_CFG,
        None,
    ),
    (
        "fp8_woq",
        "F.linear(x, wq.float())*s max_autotune+freezing (folds to fp32 W)",
        lambda x, t: lower_fp8_woq(x, t["wfp8"], t["sfp8"], t["bias"]),
        "compile",
        MA_FRZ,
        None,
    ),
    (
        "fp8_dyn",
        "WINNER F.linear(xq.float(), wq.float())*sx*sw",
        lambda x, t: lower_fp8_dyn(x, t["wfp8"], t["sfp8"], t["bias"]),
        "compile",
        NO_CFG,
        None,
    ),
    ("fp8_dyn", "_scaled_mm (eager)", _fp8_dyn_scaled_mm, "eager", NO_CFG, 1),
]

WINNERS = {
    "int8_woq": (lower_int8_woq, ("wq8", "s8", "bias", "ones_bf16")),
    "int4_woq": (lower_int4_woq, ("w4_packed", "sz4_bf16", "bias", "group_size")),
    "w8a8": (lower_w8a8, ("wq8", "s8", "bias", "ones_bf16")),
    "fp8_woq": (lower_fp8_woq, ("wfp8", "sfp8", "bias")),
    "fp8_dyn": (lower_fp8_dyn, ("wfp8", "sfp8", "bias")),
}


class Holder(torch.nn.Module):
    """Holds the stored tensors as buffers, so Inductor/AOTI see them as constants."""

    def __init__(self, fn: Callable, tensors: dict):
        super().__init__()
        self.fn = fn
        self.extra = {k: v for k, v in tensors.items() if not isinstance(v, torch.Tensor)}
        for k, v in tensors.items():
            if isinstance(v, torch.Tensor):
                self.register_buffer(k, v)

    def forward(self, x):
        t = dict(self.extra)
        t.update(dict(self.named_buffers()))
        return self.fn(x, t)


def holder(fn: Callable, tensors: dict) -> Holder:
    """A Holder whose forward has its own code object: Dynamo caches compiled graphs per code
    object, so sharing one forward across candidates would hit the recompile limit and fall
    back to eager."""
    code = Holder.forward.__code__.replace()
    fwd = types.FunctionType(code, Holder.forward.__globals__, "forward")
    cls = type("Holder_" + str(id(code)), (Holder,), {"forward": fwd})
    return cls(fn, tensors).eval()


# --------------------------------------------------------------------------- timing


def rel_err(y: torch.Tensor, ref: torch.Tensor) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def run_shape(k: int, n: int, ms: list[int], rounds: int) -> list[dict]:
    torch.manual_seed(0)
    weight = torch.randn(n, k) * 0.02
    bias = torch.randn(n) * 0.01
    t = prepare(weight, bias)
    rows = []
    for m in ms:
        x = torch.randn(m, k)
        refs = references(x, t)
        fns, meta = {}, {}
        for scheme, name, fn, mode, cfg, max_m in CANDIDATES:
            if max_m is not None and m > max_m:
                continue
            key = f"{scheme} | {name}"
            mod = holder(fn, t)
            if mode == "compile":
                torch._dynamo.reset()
                with inductor_config.patch(cfg), torch.no_grad():
                    compiled = torch.compile(mod, dynamic=False)
                    y = compiled(x)

                def call(c=compiled, cfg=cfg, x=x):
                    with inductor_config.patch(cfg), torch.no_grad():
                        return c(x)
            else:
                with torch.no_grad():
                    y = mod(x)

                def call(mod=mod, x=x):
                    with torch.no_grad():
                        return mod(x)

            fns[key] = call
            meta[key] = (scheme, name, mode, cfg, rel_err(y, refs[scheme]))
            print(f"  compiled {key}", flush=True)
        timings = bench_interleaved(fns, rounds)
        base = timings["fp32 | F.linear inductor"]["median_ms"]
        for key, tm in timings.items():
            scheme, name, mode, cfg, err = meta[key]
            rows.append(
                {
                    "K": k,
                    "N": n,
                    "M": m,
                    "scheme": scheme,
                    "candidate": name,
                    "mode": mode,
                    "inductor_config": cfg,
                    **tm,
                    "speedup_vs_fp32_inductor": base / tm["median_ms"],
                    "rel_err_vs_reference": err,
                }
            )
    return rows


# --------------------------------------------------------------------------- AOTI check


def aoti_check(k: int, n: int, ms: list[int], rounds: int) -> list[dict]:
    """Export each winner with dynamic M (x of shape [B, S, K], both dynamic), package with
    AOTInductor, load, and check against the eager composition and the reference."""
    torch.manual_seed(0)
    t = prepare(torch.randn(n, k) * 0.02, torch.randn(n) * 0.01)
    out = []
    tmp = tempfile.mkdtemp(prefix="fxq_cpu_kernels_")
    for scheme, (fn, names) in WINNERS.items():
        args = {a: t[a] for a in names}

        def body(x, t, fn=fn, names=names):
            return fn(x, *[t[a] for a in names])

        mod = holder(body, args)
        rec = {"scheme": scheme, "K": k, "N": n}
        try:
            t0 = time.perf_counter()
            with torch.no_grad():
                ep = torch.export.export(
                    mod,
                    (torch.randn(2, 3, k),),
                    dynamic_shapes={
                        "x": {0: torch.export.Dim.DYNAMIC, 1: torch.export.Dim.DYNAMIC}
                    },
                )
            targets = sorted({str(nd.target) for nd in ep.graph.nodes if nd.op == "call_function"})
            path = torch._inductor.aoti_compile_and_package(
                ep, package_path=os.path.join(tmp, f"{scheme}.pt2")
            )
            runner = torch._inductor.aoti_load_package(path)
            rec.update(
                ok=True,
                compile_s=time.perf_counter() - t0,
                package_bytes=os.path.getsize(path),
                ops=targets,
            )
            errs = {}
            for m in [1, 7, 128]:
                x = torch.randn(1, m, k)
                y = runner(x)
                ref = references(x.reshape(m, k), t)[scheme]
                errs[m] = rel_err(y.reshape(m, n), ref)
            rec["rel_err_vs_reference_by_M"] = errs
            fns = {}
            for m in ms:
                x = torch.randn(1, m, k)
                fns[f"aoti M={m}"] = lambda r=runner, x=x: r(x)
            tm = bench_interleaved(fns, rounds)
            rec["aoti_median_ms_by_M"] = {m: tm[f"aoti M={m}"]["median_ms"] for m in ms}
        except Exception as e:  # noqa: BLE001 - report any failure as data
            rec.update(ok=False, error=f"{type(e).__name__}: {str(e)[:500]}")
        print(f"  AOTI {scheme}: {'OK' if rec.get('ok') else rec.get('error')}", flush=True)
        out.append(rec)
    return out


# --------------------------------------------------------------------------- main


def print_table(rows: list[dict], aoti: list[dict]) -> None:
    hdr = (
        f"{'K':>5} {'N':>5} {'M':>4}  {'scheme':9} {'candidate':60} "
        f"{'median ms':>9} {'min ms':>8} {'xInd':>6} {'rel.err':>8}"
    )
    print("\n" + hdr + "\n" + "-" * len(hdr))
    for r in rows:
        print(
            f"{r['K']:>5} {r['N']:>5} {r['M']:>4}  {r['scheme']:9} {r['candidate'][:60]:60} "
            f"{r['median_ms']:9.3f} {r['min_ms']:8.3f} {r['speedup_vs_fp32_inductor']:6.2f} "
            f"{r['rel_err_vs_reference']:8.1e}"
        )
    for r in aoti:
        if not r.get("ok"):
            print(f"AOTI dyn-M {r['scheme']:9} FAIL {r['error'][:200]}")
            continue
        errs = " ".join(f"M={m}:{e:.1e}" for m, e in r["rel_err_vs_reference_by_M"].items())
        tms = " ".join(f"M={m}:{v:.3f}ms" for m, v in r["aoti_median_ms_by_M"].items())
        mb = r["package_bytes"] / 1e6
        print(f"AOTI dyn-M {r['scheme']:9} OK  {mb:.1f} MB  {tms}  err {errs}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="one shape, fewer rounds")
    ap.add_argument("--no-aoti", action="store_true", help="skip the AOTInductor check")
    ap.add_argument("--rounds", type=int, default=None)
    ap.add_argument("--out", default=str(Path(__file__).parent / "results" / "aten_kernels.json"))
    a = ap.parse_args()
    torch.set_num_threads(2)
    shapes = [(1024, 4096)] if a.quick else [(1024, 4096), (2048, 8192)]
    rounds = a.rounds or (3 if a.quick else 5)
    ms = [1, 128]
    t_start = time.perf_counter()
    rows: list[dict] = []
    for k, n in shapes:
        print(f"K={k} N={n}", flush=True)
        rows += run_shape(k, n, ms, rounds)
    aoti = [] if a.no_aoti else aoti_check(1024, 4096, ms, rounds)

    print_table(rows, aoti)
    res = {
        "question": __doc__.splitlines()[0],
        "machine": machine_info(),
        "rounds": rounds,
        "note": "rel_err of fp32 rows is against the fp32 weight; of all other rows against the "
        "scheme's reference math on the stored quantized tensors (float64).",
        "results": rows,
        "aoti_dynamic_M": aoti,
        "wall_s": time.perf_counter() - t_start,
    }
    write_results(res, a.out)


if __name__ == "__main__":
    main()
