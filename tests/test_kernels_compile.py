"""Every Triton kernel of ``fxquant.kernels`` compiles for Hopper (sm_90), without a GPU.

The kernel tests run under ``TRITON_INTERPRET=1``, which executes the kernel bodies as Python
and never meets the real compiler: code that only the compiler rejects (a plain Python float
global read inside ``@triton.jit``, a dtype conversion or ``tl.dot`` operand mix that sm_90
has no lowering for, a tile whose layout the backend cannot handle) passes every CPU test and
fails on the first GPU launch. This test closes that gap: it compiles each kernel down to a
cubin for ``GPUTarget("cuda", 90, 32)`` with ``triton.compile`` (Triton ships ``ptxas``, so no
GPU or CUDA toolkit is needed), once per launch path (decode, prefill, split-K for the GEMMs;
int8 and fp8 outputs for the quantizers), with the dtypes and constexprs the launchers pass and
the first autotune config of each path.

It also guards two properties of the generated PTX that the interpreter cannot show: kernels
that handle e4m3 really convert to or multiply e4m3, and modules that promise correctly rounded
division (``div_rn``, for bit-exactness with ``fxquant.core.reference``) contain no approximate
``div.full.f32`` / ``div.approx.f32`` (what Triton's plain fp32 ``/`` becomes).

A ``@triton.jit`` function that no case compiles, directly or as a helper called from one,
fails the test: a new kernel must get a case here.

The compile runs in a subprocess with ``TRITON_INTERPRET=0``: under the interpreter (which
conftest turns on for this CPU-only machine) ``triton.jit`` makes InterpretedFunction objects,
which cannot be compiled. The subprocess runs this file as a script.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
RESULT = "RESULT "  # prefix of the script's JSON lines on stdout (warnings go to stderr)

# Sizes that only pick constexprs the way the launchers do (norm_quant's tile, the group count
# of quantize's group kernel); the compiled kernels take M, N, K at run time.
_K = 4096
_K_LONG = 32768  # longer than norm_quant.MAX_ROW_BLOCK: the multi-tile path
_FP8_BLOCK = 128  # float8_block's block size (DeepSeek-V3's), also the int4/fp8 group size


# ---------------------------------------------------------------------------------------------
# The script side (runs in the subprocess, TRITON_INTERPRET=0)
# ---------------------------------------------------------------------------------------------


def _unwrap(obj):
    """JITFunction, or an Autotuner / Heuristics around one → the JITFunction; else None."""
    from triton.runtime.jit import JITFunction

    for _ in range(4):  # autotune(heuristics(jit)) at most
        if isinstance(obj, JITFunction):
            return obj
        obj = getattr(obj, "fn", None)
    return None


def _case(label, autotuned_or_jit, types, constexprs, config=None):
    """One compile: kernel, full signature in argument order, constexprs and options.

    ``types`` gives the runtime arguments' Triton types; ``constexprs`` and the config's
    kwargs the compile-time ones. Every argument of the kernel must be named exactly once, so
    a kernel whose arguments change fails here with the names, not deep in the compiler.
    """
    fn = _unwrap(autotuned_or_jit)
    constexprs = {**constexprs, **(config.kwargs if config is not None else {})}
    names = list(fn.arg_names)
    missing = [n for n in names if n not in types and n not in constexprs]
    extra = [n for n in {**types, **constexprs} if n not in names]
    both = [n for n in types if n in constexprs]
    if missing or extra or both:
        raise ValueError(
            f"{label}: arguments out of date (missing {missing}, unknown {extra}, given as "
            f"both runtime and constexpr {both})"
        )
    signature = {n: "constexpr" if n in constexprs else types[n] for n in names}
    options = {}
    if config is not None:
        options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    return {
        "label": label,
        "fn": fn,
        "signature": signature,
        "constexprs": constexprs,
        "options": options,
    }


def _first_split_k(autotuner):
    """The first decode config that splits K: the fp32 atomic_add epilogue (SPLIT_K=1 stores)."""
    return next(c for c in autotuner.configs if c.kwargs.get("SPLIT_K", 1) > 1)


def _gemm_cases(name, decode, prefill, types, out_key, decode_group_m, extra=None):
    """decode (first config, fp32 split-K buffer), decode with SPLIT_K > 1, prefill (first
    config, bf16 output): the launchers' two paths and the decode epilogue's two branches."""
    extra = extra or {}
    cases = []
    for path, kernel, config, out, group_m in (
        ("decode", decode, decode.configs[0], "*fp32", decode_group_m),
        ("decode split-K", decode, _first_split_k(decode), "*fp32", decode_group_m),
        ("prefill", prefill, prefill.configs[0], "*bf16", 8),
    ):
        constexprs = {"HAS_BIAS": True, "GROUP_M": group_m, **extra}
        if path == "prefill":
            constexprs["SPLIT_K"] = 1  # the launcher passes it; prefill configs leave it out
        cases.append(_case(f"{name} {path}", kernel, {**types, out_key: out}, constexprs, config))
    return cases


def _cases():
    """Every launch path of every kernel, with the launchers' dtypes: bf16 activations, int8 /
    e4m3 / packed-uint4 weights, fp32 scales, bf16 bias."""
    import triton

    from fxquant.kernels import (
        float8_block,
        gemm,
        int4_weight_only,
        int8_dynamic,
        int8_weight_only,
        intx_weight_only,
        norm_quant,
        quantize,
    )

    cases = []
    ints = {"M": "i32", "N": "i32", "K": "i32"}

    # ---- weight-only GEMMs: one kernel for int8 and e4m3 weights (float8_weight_only's op)
    m = int8_weight_only
    for wname, wtype in (("int8", "*i8"), ("float8", "*fp8e4nv")):
        types = {"x_ptr": "*bf16", "w_ptr": wtype, "scale_ptr": "*fp32", "bias_ptr": "*bf16"}
        cases += _gemm_cases(
            f"{wname}_weight_only",
            m._decode_kernel,
            m._prefill_kernel,
            {**types, **ints},
            "y_ptr",
            gemm.GROUP_M,
        )

    # int4's GEMM is intx_weight_only's kernel at 4 bits with integer zero points
    m = intx_weight_only
    types = {
        "x_ptr": "*bf16",
        "w_ptr": "*u8",
        "scale_ptr": "*fp32",
        "zero_ptr": "*u8",
        "bias_ptr": "*bf16",
        "GROUPS": "i32",
        **ints,
    }
    cases += _gemm_cases(
        "int4_weight_only",
        m._decode_kernel,
        m._prefill_kernel,
        types,
        "y_ptr",
        gemm.GROUP_M,
        {"BITS": 4, "INT_ZERO": True, "GROUP_SIZE": _FP8_BLOCK},
    )
    m = int4_weight_only
    cases.append(
        _case(
            "int4 dequantize",
            m._dequantize_kernel,
            {
                "w_ptr": "*u8",
                "scale_ptr": "*fp32",
                "zero_ptr": "*u8",
                "out_ptr": "*bf16",
                "N": "i32",
                "K": "i32",
                "GROUPS": "i32",
            },
            {
                "GROUP_SIZE": _FP8_BLOCK,
                "BLOCK_N": m._DEQUANT_BLOCK_N,
                "BLOCK_K": m._DEQUANT_BLOCK_K,
            },
        )
    )

    # ---- scaled mms on quantized activations
    scaled = {"xs_ptr": "*fp32", "ws_ptr": "*fp32", "bias_ptr": "*bf16", **ints}
    # int8 and e4m3 share one kernel (INT8 picks the accumulator and the dot)
    m = int8_dynamic
    for label, dtype, int8 in (("int8", "*i8", True), ("float8", "*fp8e4nv", False)):
        types = {
            "x_ptr": dtype,
            "w_ptr": dtype,
            "stride_xs": "i32",
            "stride_ws": "i32",
            **scaled,
        }
        cases += _gemm_cases(
            f"{label}_scaled_mm",
            m._decode_kernel,
            m._prefill_kernel,
            types,
            "y_ptr",
            gemm.GROUP_M,
            {"INT8": int8},
        )
    # float8_block builds its autotuners per block size; the configs depend on it.
    decode, prefill = float8_block._kernels(_FP8_BLOCK)
    types = {"x_ptr": "*fp8e4nv", "w_ptr": "*fp8e4nv", "KB": "i32", **scaled}
    cases += _gemm_cases(
        f"float8_block_scaled_mm b={_FP8_BLOCK}", decode, prefill, types, "y_ptr", gemm.GROUP_M
    )

    # ---- activation quantization: bf16 x → int8 / e4m3, per token, per tensor, groups
    m = quantize
    rows = m._quantize_rows_kernel
    for label, qtype, amax_type, constexprs in (
        # per row, amax_ptr unused: the launcher passes x in its place
        ("int8 per token", "*i8", "*bf16", {"FP8": False, "HAS_UB": False, "SCALE_UB": 0.0}),
        (
            "fp8 per token ub",
            "*fp8e4nv",
            "*bf16",
            {"FP8": True, "HAS_UB": True, "SCALE_UB": 1200.0},
        ),
    ):
        cases.append(
            _case(
                f"quantize rows {label}",
                rows,
                {
                    "x_ptr": "*bf16",
                    "q_ptr": qtype,
                    "s_ptr": "*fp32",
                    "amax_ptr": amax_type,
                    "K": "i32",
                },
                {**constexprs, "TENSOR_AMAX": False, "BLOCK": m._ROW_BLOCK},
                rows.configs[0],
            )
        )
    cases.append(
        _case(
            "quantize rows fp8 per tensor",
            rows,
            {
                "x_ptr": "*bf16",
                "q_ptr": "*fp8e4nv",
                "s_ptr": "*fp32",
                "amax_ptr": "*fp32",
                "K": "i32",
            },
            {
                "FP8": True,
                "HAS_UB": False,
                "SCALE_UB": 0.0,
                "TENSOR_AMAX": True,
                "BLOCK": m._ROW_BLOCK,
            },
            rows.configs[0],
        )
    )
    cases.append(
        _case(
            "quantize tensor absmax",
            m._tensor_absmax_kernel,
            {"x_ptr": "*bf16", "amax_ptr": "*fp32", "K": "i32"},
            {"BLOCK": m._ROW_BLOCK},
            m._tensor_absmax_kernel.configs[0],
        )
    )
    num_groups = _K // _FP8_BLOCK
    cases.append(
        _case(
            f"quantize fp8 groups g={_FP8_BLOCK}",
            m._quantize_groups_kernel,
            {
                "x_ptr": "*bf16",
                "q_ptr": "*fp8e4nv",
                "s_ptr": "*fp32",
                "K": "i32",
                "NUM_GROUPS": "i32",
            },
            {
                "GROUP": _FP8_BLOCK,
                "BLOCK_G": triton.next_power_of_2(_FP8_BLOCK),
                "GROUPS_PER_TILE": min(
                    max(1, m._GROUP_TILE // _FP8_BLOCK), triton.next_power_of_2(num_groups)
                ),
            },
            m._quantize_groups_kernel.configs[0],
        )
    )

    # ---- fused norm → quantize: RMSNorm and LayerNorm, one tile and multi-tile rows, per token
    # and groups, int8 and e4m3. Tile constexprs and the warp count come from the launcher's own
    # _tile and _prune_warps (the first config that survives the prune, as autotuning would try).
    m = norm_quant
    for label, k, rms, fp8, group_size, has_ub in (
        ("rms int8 per token", _K, True, False, -1, False),
        ("layernorm fp8 per token ub", _K, False, True, -1, True),
        (f"rms fp8 groups g={_FP8_BLOCK}", _K, True, True, _FP8_BLOCK, False),
        ("layernorm fp8 per token ub, multi-tile", _K_LONG, False, True, -1, True),
        (f"rms fp8 groups g={_FP8_BLOCK}, multi-tile", _K_LONG, True, True, _FP8_BLOCK, False),
    ):
        group, block_r, block_c, per_token = m._tile(k, group_size)
        tile = {"BLOCK_R": block_r, "BLOCK_C": block_c}
        config = m._prune_warps(m._kernel.configs, tile)[0]
        cases.append(
            _case(
                f"norm_quant {label}",
                m._kernel,
                {
                    "x_ptr": "*bf16",
                    "w_ptr": "*bf16",
                    "b_ptr": "*bf16",
                    "q_ptr": "*fp8e4nv" if fp8 else "*i8",
                    "scale_ptr": "*fp32",
                    "normed_ptr": "*bf16",
                    "K": "i32",
                    "eps": "fp32",
                    "scale_ub": "fp32",
                },
                {
                    "RMS": rms,
                    "HAS_WEIGHT": True,
                    "HAS_BIAS": not rms,
                    "FP8": fp8,
                    "PER_TOKEN": per_token,
                    "HAS_UB": has_ub,
                    "WRITE_NORMED": True,
                    "GROUP": group,
                    "ONE_TILE": block_r * group >= k,
                    **tile,
                },
                config,
            )
        )
    cases += _lowbit_cases()
    cases += _format_cases()
    cases += _rotation_and_codebook_cases()
    return cases


def _format_cases():
    """bitsandbytes 4-bit (plain and double-quantized absmax), LLM.int8's activation quantizer
    (with and without outlier columns), MXFP4 / NVFP4 (E8M0 or e4m3 block scales), the MXFP4,
    int8 (weight-only, W8A8), int4 and fp8 (row-scaled, block-scaled) experts' grouped GEMMs and
    MXFP8."""
    from fxquant.kernels import (
        bnb4_weight_only,
        float8_block_grouped,
        gemm,
        int4_weight_only_grouped,
        int8_dynamic_grouped,
        int8_weight_only_grouped,
        llm_int8,
        mxfp4,
        mxfp4_grouped,
        mxfp8,
    )

    cases = []
    ints = {"M": "i32", "N": "i32", "K": "i32"}
    m = bnb4_weight_only
    for nested in (False, True):
        types = {
            "x_ptr": "*bf16",
            "w_ptr": "*u8",
            "absmax_ptr": "*u8" if nested else "*fp32",
            "code_ptr": "*fp32",
            "nested_absmax_ptr": "*fp32",
            "nested_code_ptr": "*fp32",
            "nested_offset_ptr": "*fp32",
            "bias_ptr": "*bf16",
            **ints,
        }
        cases += _gemm_cases(
            f"bnb4_weight_only nested={nested}",
            m._decode_kernel,
            m._prefill_kernel,
            types,
            "y_ptr",
            gemm.GROUP_M,
            {"NESTED": nested, "BLOCK_SIZE": 64},
        )
    m = llm_int8
    for outliers in (False, True):
        cases.append(
            _case(
                f"llm_int8 activation quant outliers={outliers}",
                m._llm_int8_quantize_kernel,
                {
                    "x_ptr": "*bf16",
                    "cols_ptr": "*i8",
                    "q_ptr": "*i8",
                    "s_ptr": "*fp32",
                    "xo_ptr": "*fp32",
                    "K": "i32",
                },
                {"THRESHOLD": 6.0, "OUTLIERS": outliers, "BLOCK": m._ROW_BLOCK},
                m._llm_int8_quantize_kernel.configs[0],
            )
        )
    for label, e8m0, scale_type, bs in (
        ("mxfp4", True, "*u8", 32),
        ("nvfp4", False, "*fp8e4nv", 16),
    ):
        for rows in (1, 128):
            bm, bn = mxfp4.block_sizes(rows)
            cases.append(
                _case(
                    f"{label} linear M={rows}",
                    mxfp4._fp4_linear_kernel,
                    {
                        "x_ptr": "*bf16",
                        "w_ptr": "*u8",
                        "s_ptr": scale_type,
                        "g_ptr": "*fp32",
                        "bias_ptr": "*bf16",
                        "out_ptr": "*fp32",
                        **ints,
                    },
                    {
                        "HAS_BIAS": True,
                        "E8M0": e8m0,
                        "BS": bs,
                        "X_BF16": True,
                        "BLOCK_M": bm,
                        "BLOCK_N": bn,
                        "BLOCK_K": mxfp4._BLOCK_K,
                    },
                )
            )
    # the MoE grouped GEMM, with either offsets dtype; bf16 x on the tensor cores, fp32 x in
    # IEEE fp32 dots
    for offs, x in (("*i32", "bf16"), ("*i64", "fp32")):
        cases.append(
            _case(
                f"mxfp4 grouped mm offs={offs} x={x}",
                mxfp4_grouped._fp4_grouped_kernel,
                {
                    "x_ptr": f"*{x}",
                    "w_ptr": "*u8",
                    "s_ptr": "*u8",
                    "offs_ptr": offs,
                    "out_ptr": f"*{x}",
                    "S": "i32",
                    "N": "i32",
                    "K": "i32",
                },
                {
                    "X_BF16": x == "bf16",
                    "BLOCK_M": mxfp4_grouped._BLOCK_M,
                    "BLOCK_N": mxfp4_grouped._BLOCK_N,
                    "BLOCK_K": mxfp4_grouped._BLOCK_K,
                },
            )
        )
    # the int8 and int4 experts' grouped GEMMs (int4's also W4A8's, on dequantized int8 rows):
    # bf16 x on the tensor cores, fp32 x in IEEE fp32 dots
    g8, g4 = int8_weight_only_grouped, int4_weight_only_grouped
    grouped = (
        ("int8 weight-only", g8, g8._int8_grouped_kernel, {"w_ptr": "*i8", "s_ptr": "*fp32"}, {}),
        # fp8wo's experts: the same kernel on e4m3 weights
        ("fp8 weight-only", g8, g8._int8_grouped_kernel, {"w_ptr": "*fp8e4nv", "s_ptr": "*fp32"},
         {}),
        ("int4", g4, g4._int4_grouped_kernel,
         {"w_ptr": "*u8", "s_ptr": "*fp32", "z_ptr": "*u8"}, {"GROUP_SIZE": 128}),
    )  # fmt: skip
    for name, g, kernel, weight, group in grouped:
        for offs, x in (("*i32", "bf16"), ("*i64", "fp32")):
            sig = {"x_ptr": f"*{x}", **weight, "offs_ptr": offs, "out_ptr": f"*{x}"}
            sig.update(S="i32", N="i32", K="i32", **({"GROUPS": "i32"} if group else {}))
            tile = {"BLOCK_M": g._BLOCK_M, "BLOCK_N": g._BLOCK_N, "BLOCK_K": g._BLOCK_K}
            cases.append(
                _case(f"{name} grouped mm offs={offs} x={x}", kernel, sig, {**group, **tile})
            )
    # the W8A8 and fp8-row experts' grouped GEMM (one kernel, INT8 on or off): int8 tiles on
    # the int8 tensor cores (exact int32 sums), e4m3 ones on the fp8 tensor cores, with either
    # offsets dtype and output dtype
    g = int8_dynamic_grouped
    for name, operand in (("int8", "*i8"), ("fp8", "*fp8e4nv")):
        for offs, out in (("*i32", "bf16"), ("*i64", "fp32")):
            sig = {"x_ptr": operand, "xs_ptr": "*fp32", "w_ptr": operand, "s_ptr": "*fp32"}
            sig.update(offs_ptr=offs, out_ptr=f"*{out}", S="i32", N="i32", K="i32")
            meta = {"INT8": name == "int8", "BLOCK_M": g._BLOCK_M, "BLOCK_N": g._BLOCK_N}
            label = f"{name} row-scaled grouped mm offs={offs} out={out}"
            cases.append(
                _case(label, g._scaled_grouped_kernel, sig, {**meta, "BLOCK_K": g._BLOCK_K})
            )
    # the fp8-block experts' grouped GEMM (BLOCK_K = b: 128, and the least b the launcher
    # takes, fp8 tl.dot's least K), with either offsets dtype and output dtype
    gb = float8_block_grouped
    for offs, out, block_k in (("*i32", "bf16", _FP8_BLOCK), ("*i64", "fp32", gb._MIN_BLOCK)):
        sig = {"x_ptr": "*fp8e4nv", "xs_ptr": "*fp32", "w_ptr": "*fp8e4nv", "ws_ptr": "*fp32"}
        sig.update(offs_ptr=offs, out_ptr=f"*{out}", S="i32", N="i32", K="i32", KB="i32")
        tile = {"BLOCK_M": gb._BLOCK_M, "BLOCK_N": gb._BLOCK_N, "BLOCK_K": block_k}
        label = f"fp8 block grouped mm offs={offs} out={out} BLOCK_K={block_k}"
        cases.append(_case(label, gb._float8_block_grouped_kernel, sig, tile))
    for rows in (1, 128):
        bm, bn = mxfp4.block_sizes(rows)  # mxfp8 launches with mxfp4.launch
        cases.append(
            _case(
                f"mxfp8 linear M={rows}",
                mxfp8._mxfp8_linear_kernel,
                {
                    "x_ptr": "*bf16",
                    "w_ptr": "*fp8e4nv",
                    "s_ptr": "*u8",
                    "bias_ptr": "*bf16",
                    "out_ptr": "*fp32",
                    **ints,
                },
                {"HAS_BIAS": True, "BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": mxfp8._BLOCK_K},
            )
        )
    return cases


def _lowbit_cases():
    """int2 / int3 / float-zero int4 / int6 weight-only GEMMs and BitNet's two kernels."""
    import triton

    from fxquant.kernels import bitnet, gemm, intx_weight_only

    cases = []
    ints = {"M": "i32", "N": "i32", "K": "i32"}
    m = intx_weight_only
    # 6 bits in groups of 16 (GGUF Q6_K): the 16-wide K step, tl.dot's smallest K
    for bits, zero, group in (
        (2, "*u8", 64),
        (3, "*u8", 64),
        (3, "*fp32", 64),
        (4, "*fp32", 64),
        (6, "*u8", 16),
    ):
        types = {
            "x_ptr": "*bf16",
            "w_ptr": "*u8",
            "scale_ptr": "*fp32",
            "zero_ptr": zero,
            "bias_ptr": "*bf16",
            "GROUPS": "i32",
            **ints,
        }
        cases += _gemm_cases(
            f"intx_weight_only b={bits} g={group} zero {zero}",
            m._decode_kernel,
            m._prefill_kernel,
            types,
            "y_ptr",
            gemm.GROUP_M,
            {"BITS": bits, "INT_ZERO": False, "GROUP_SIZE": group},
        )
    m = bitnet
    types = {
        "xq_ptr": "*i8",
        "inv_ptr": "*fp32",
        "w_ptr": "*u8",
        "ws_ptr": "*fp32",
        "bias_ptr": "*bf16",
        **ints,
    }
    cases += _gemm_cases(
        "bitnet", m._decode_kernel, m._prefill_kernel, types, "y_ptr", gemm.GROUP_M
    )
    cases.append(
        _case(
            "bitnet activation quant",
            m._act_quant_kernel,
            {"x_ptr": "*bf16", "q_ptr": "*i8", "inv_ptr": "*fp32", "K": "i32"},
            {"BLOCK_K": triton.next_power_of_2(_K)},
        )
    )
    return cases


def _rotation_and_codebook_cases():
    """FP-Quant's fused rotate-and-quantize kernel (MXFP4 QuEST / abs_max, NVFP4), and the
    HIGGS, AQLM, VPTQ and SpQR GEMMs that decode their codes in the K loop."""
    from fxquant.kernels import aqlm, fp_quant, gemm, higgs, spqr, vptq

    cases = []
    for label, g, bs, mx, quest in (
        ("mxfp4 quest", 32, 32, True, True),
        ("mxfp4 abs_max", 64, 32, True, False),
        ("nvfp4 abs_max", 16, 16, False, False),
    ):
        cases.append(
            _case(
                f"fp_quant activation {label}",
                fp_quant._fp_quant_act_kernel,
                {
                    "x_ptr": "*bf16",
                    "r_ptr": "*fp32",
                    "gs_ptr": "*fp32",
                    "out_ptr": "*fp32",
                    "M": "i32",
                    "K": "i32",
                },
                {"G": g, "BS": bs, "MX": mx, "QUEST": quest, "BLOCK_M": fp_quant._BLOCK_M},
            )  # fmt: skip
        )
    for p_ in (2, 1):
        cases.append(
            _case(
                f"higgs linear p={p_}",
                higgs._higgs_linear_kernel,
                {
                    "x_ptr": "*fp32",
                    "c_ptr": "*u8",
                    "s_ptr": "*fp32",
                    "g_ptr": "*fp32",
                    "bias_ptr": "*bf16",
                    "out_ptr": "*fp32",
                    "M": "i32",
                    "N": "i32",
                    "K": "i32",
                },
                {
                    "HAS_BIAS": True,
                    "P": p_,
                    "H": 512,
                    "BLOCK_M": 16,
                    "BLOCK_N": 64,
                    "BLOCK_K": higgs._BLOCK_K,
                },
            )  # fmt: skip
        )
    for c in (1, 2):
        cases.append(
            _case(
                f"aqlm linear {c} codebooks",
                aqlm._aqlm_linear_kernel,
                {
                    "x_ptr": "*bf16",
                    "c_ptr": "*i32",
                    "cb_ptr": "*fp32",
                    "s_ptr": "*fp32",
                    "bias_ptr": "*bf16",
                    "out_ptr": "*fp32",
                    "M": "i32",
                    "N": "i32",
                    "K": "i32",
                    "S": "i32",
                },
                {
                    "HAS_BIAS": True,
                    "C": c,
                    "IG": 8,
                    "BLOCK_M": 64,
                    "BLOCK_N": 64,
                    "BLOCK_G": aqlm._BLOCK_G,
                },
            )  # fmt: skip
        )
    for rb in (8, 0):
        cases.append(
            _case(
                f"vptq linear residual bits={rb}",
                vptq._vptq_linear_kernel,
                {
                    "x_ptr": "*fp32",
                    "i_ptr": "*i32",
                    "cb_ptr": "*fp32",
                    "rcb_ptr": "*fp32",
                    "rows_ptr": "*i64",
                    "out_ptr": "*fp32",
                    "M": "i32",
                    "N": "i32",
                    "NV": "i32",
                    "P": "i32",
                    "G": "i32",
                    "K": "i32",
                    "R": "i32",
                },
                {
                    "C": 1,
                    "VL": 8,
                    "IB": 16,
                    "RB": rb,
                    "BLOCK_M": 16,
                    "BLOCK_N": 64,
                    "BLOCK_G": vptq._BLOCK_G,
                },
            )  # fmt: skip
        )
    # SpQR: a decode / prefill GEMM; bf16 x (two bf16 dots a step) with the outlier epilogue on
    # every path, fp16 and fp32 x (one dot) on the prefill path
    m = spqr
    types = {
        "x_ptr": "*bf16",
        "w_ptr": "*i64",
        "ro_ptr": "*i32",
        "oc_ptr": "*i32",
        "od_ptr": "*fp32",
        "bias_ptr": "*bf16",
        "M": "i32",
        "N": "i32",
        "K": "i32",
    }
    cases += _gemm_cases(
        "spqr linear",
        m._decode_kernel,
        m._prefill_kernel,
        types,
        "y_ptr",
        gemm.GROUP_M,
        {"HAS_OUTLIERS": True},
    )
    for x_type in ("*fp16", "*fp32"):
        cases.append(
            _case(
                f"spqr linear prefill x={x_type[1:]} no outliers",
                m._prefill_kernel,
                {**types, "x_ptr": x_type, "bias_ptr": x_type, "y_ptr": x_type},
                {"HAS_OUTLIERS": False, "HAS_BIAS": True, "GROUP_M": gemm.GROUP_M, "SPLIT_K": 1},
                m._prefill_kernel.configs[0],
            )  # fmt: skip
        )
    return cases


def _jit_functions(modules):
    """{JITFunction: 'module.name'} for every @triton.jit defined in ``modules``, bare or
    behind an autotuner (helpers included: they must be reached from a compiled kernel)."""
    found = {}
    for module in modules:
        for obj in vars(module).values():
            fn = _unwrap(obj)
            if fn is not None and fn.fn.__module__ == module.__name__:
                found[fn] = f"{module.__name__.rsplit('.', 1)[1]}.{fn.__name__}"
    return found


def _callees(fn):
    """JITFunctions a kernel body names: globals (``round_half_even``) or module attributes
    (``rounding.round_half_even``), read from its code object."""
    code, scope = fn.fn.__code__, fn.fn.__globals__
    out = set()
    for name in code.co_names:
        obj = scope.get(name)
        if obj is None:
            continue
        for candidate in [obj] + [getattr(obj, attr, None) for attr in code.co_names]:
            callee = _unwrap(candidate)
            if callee is not None:
                out.add(callee)
    return out


def _ptx_problems(case, ptx, div_rn_module):
    """What the PTX must (not) contain; empty when it is fine."""
    problems = []
    if any(t == "*fp8e4nv" for t in case["signature"].values()) and "e4m3" not in ptx:
        problems.append("handles e4m3 data, but its PTX has no e4m3 instruction")
    if case["constexprs"].get("FP8") and not re.search(r"\bcvt\.[\w.]*e4m3", ptx):
        problems.append("quantizes to e4m3, but its PTX has no cvt to e4m3")
    # Triton's fp32 `/` is div.full.f32 (runtime divisor) or div.approx.f32 (constant one).
    if div_rn_module and re.search(r"\bdiv\.(?:full|approx)\.[\w.]*f32", ptx):
        problems.append("its module divides with div_rn, but the PTX has an approximate div")
    return problems


def _compile_all(shard: int = 0, shards: int = 1) -> int:
    """Compile every ``shards``-th case for sm_90, from case ``shard`` on; print one RESULT
    line per case and a summary line (the test runs one shard per core and merges them)."""
    import importlib
    import inspect
    import pkgutil

    import triton
    from triton.backends.compiler import GPUTarget

    import fxquant.kernels

    target = GPUTarget("cuda", 90, 32)
    # Every module of the package, so that a kernel in a new file is found too.
    modules = [
        importlib.import_module(f"fxquant.kernels.{info.name}")
        for info in pkgutil.iter_modules(fxquant.kernels.__path__)
    ]
    jit_fns = _jit_functions(modules)
    # Modules whose source promises correctly rounded division (quantize, norm_quant).
    div_rn_modules = {m.__name__ for m in modules if "div_rn" in inspect.getsource(m)}

    try:
        cases = _cases()[shard::shards]
    except Exception as e:  # e.g. a kernel's argument list changed: _case names the arguments
        print(f"cases could not be built: {e!r}", flush=True)
        return 1

    covered = set()
    div_rn_seen = set()
    for case in cases:
        fn = case["fn"]
        module = fn.fn.__module__
        # Pointers as the launchers' torch tensors arrive: 16-byte aligned, which the JIT
        # specializes on and which enables vectorized and async-copy loads.
        attrs = {
            (i,): [["tt.divisibility", 16]]
            for i, t in enumerate(case["signature"].values())
            if t.startswith("*")
        }
        record = {
            "label": case["label"],
            "kernel": jit_fns.get(fn, fn.__name__),
            "constexprs": case["constexprs"],
            "options": case["options"],
        }
        start = time.perf_counter()
        try:
            src = triton.compiler.ASTSource(
                fn=fn, signature=case["signature"], constexprs=case["constexprs"], attrs=attrs
            )
            compiled = triton.compile(src, target=target, options=case["options"])
            if not compiled.asm.get("cubin"):
                raise RuntimeError("no cubin produced")
            ptx = compiled.asm["ptx"]
            record["problems"] = _ptx_problems(case, ptx, module in div_rn_modules)
            if "div.rn.f32" in ptx:
                div_rn_seen.add(module)
        except Exception as e:
            # The compiler's message ends with the reason; its head is the source excerpt.
            record["problems"] = [f"{type(e).__name__}: {e}"[-3000:]]
        record["ok"] = not record["problems"]
        record["seconds"] = round(time.perf_counter() - start, 2)
        print(RESULT + json.dumps(record), flush=True)
        # Helpers are inlined into the kernels that call them: compiled with them.
        todo = [fn]
        while todo:
            f = todo.pop()
            if f not in covered:
                covered.add(f)
                todo += _callees(f)

    summary = {
        "summary": True,
        "uncovered": sorted(name for fn, name in jit_fns.items() if fn not in covered),
        # If no case of a div_rn module shows div.rn.f32, the PTX check above looks at the
        # wrong text (a renamed instruction), and its silence means nothing.
        "div_rn_cases": sorted({c["fn"].fn.__module__ for c in cases} & div_rn_modules),
        "div_rn_seen": sorted(div_rn_seen),
    }
    print(RESULT + json.dumps(summary), flush=True)
    return 0


# ---------------------------------------------------------------------------------------------
# The test
# ---------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_every_kernel_compiles_for_sm90(tmp_path):
    env = {
        **os.environ,
        # The real JIT: JITFunction objects, which triton.compile takes.
        "TRITON_INTERPRET": "0",
        # A fresh cache, so every kernel really goes through the compiler and ptxas.
        "TRITON_CACHE_DIR": str(tmp_path / "triton-cache"),
    }
    from conftest import run_in_shards  # not at the top: this file also runs as the script

    start = time.perf_counter()
    # One shard per core: the compiles are independent and single-threaded.
    ran = run_in_shards(lambda i, n: [__file__, str(i), str(n)], most=4, cwd=REPO, env=env)
    shards = len(ran)
    records, summaries = [], []
    for rc, out, err in ran:
        lines = [json.loads(ln[len(RESULT) :]) for ln in out.splitlines() if ln.startswith(RESULT)]
        shard_summary = next((r for r in lines if r.get("summary")), None)
        assert rc == 0 and shard_summary is not None, (
            f"compile script failed (rc={rc}):\n{out[-4000:]}\n{err[-8000:]}"
        )
        summaries.append(shard_summary)
        records += [r for r in lines if not r.get("summary")]
    elapsed = time.perf_counter() - start
    # a function is uncovered if no shard compiled it; div.rn must show in some shard's PTX
    summary = {
        "uncovered": sorted(set.intersection(*(set(s["uncovered"]) for s in summaries))),
        "div_rn_unseen": sorted(
            set().union(*(s["div_rn_cases"] for s in summaries))
            - set().union(*(s["div_rn_seen"] for s in summaries))
        ),
    }

    results = records
    how = f"{shards} shards, {elapsed:.0f} s"
    print(f"\n{len(results)} kernel variants compiled for sm_90 ({how}):")
    for r in results:
        tile = {k: v for k, v in r["constexprs"].items() if k.startswith("BLOCK") or k == "SPLIT_K"}
        config = " ".join(f"{k}={v}" for k, v in {**tile, **r["options"]}.items())
        print(
            f"  {'ok  ' if r['ok'] else 'FAIL'} {r['seconds']:5.1f} s  {r['label']:<50}"
            f" {r['kernel']}  {config}"
        )

    failures = [
        f"{r['label']} ({r['kernel']}, {r['constexprs']}): " + "; ".join(r["problems"])
        for r in results
        if not r["ok"]
    ]
    assert not failures, "kernels that do not compile cleanly for sm_90:\n" + "\n".join(failures)
    assert not summary["div_rn_unseen"], (
        f"no div.rn.f32 in the PTX of {summary['div_rn_unseen']}: the div_rn check is blind"
    )
    assert not summary["uncovered"], (
        "@triton.jit functions that no case compiles (add a case to _cases(), with the "
        f"launcher's dtypes and constexprs): {summary['uncovered']}"
    )


if __name__ == "__main__":
    sys.exit(_compile_all(*(int(a) for a in sys.argv[1:3])))
