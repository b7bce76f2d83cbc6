"""Native CPU kernels: the ``fxquant::native_*`` ops, built from the C++ sources here on first use.

Where this sits: below ``fxquant.passes.lower``. On CPU the lowering rewrites the int8, int4,
w8a8, W4A8 and fp8 (per row, per tensor, blocks) linears to these ops (weights repacked once by
the ``prepack_*`` helpers here); in process they run through a small shared library registered
with torch's stable ABI, and
``aot_compile`` links the same kernels statically into the AOTInductor package
(:func:`aoti_options`), whose model .so then calls their C shims directly: the package needs
neither fxquant nor this library to run.

The library is compiled with the C++ compiler AOTInductor itself uses, for this machine
(``-march=native``), once per source, torch version and CPU, into ``$FXQUANT_CACHE_DIR``
(default ``~/.cache/fxquant``)/native/<key>; a build takes a few seconds and is reused by every
later process. ``FXQUANT_NATIVE_MARCH`` names another ``-march`` (``x86-64-v3``: AVX2 only), so
that the kernels' paths for a CPU class the machine is not can be tested here (for correctness,
not speed). Where no compiler works, :func:`available` is False with the reason, and the
lowering keeps its aten compositions (slower, same numerics).

The sources: ``linear.cpp`` (the large-M path and the shims' checks, shared by every format;
its header says why C++ and not an aten composition: memory bandwidth at M = 1, measured by
``benchmarks/native_kernels.py``), ``int8_fp8.cpp`` (byte weights), ``int4.cpp`` (int4 weights),
``float32.cpp`` (the fp32 linears a config leaves in float), ``decode.cpp`` (fp8 and int4
weights to bf16, for the large-M bf16 GEMMs), ``attention.cpp`` (attention over an LLM's KV
cache, for ``fxquant.export_llm``), ``native.h`` (what they share), ``bf16_dot.h`` (the
AVX-512 BF16 GEMMs the byte and int4 formats share), ``register.cpp`` (the in-process op
registrations).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from fxquant.core.paths import cache_root

__all__ = [
    "NATIVE_OPS",
    "aoti_options",
    "available",
    "build_dir",
    "cache_root",
    "cpu_signature",
    "link_path",
    "load",
    "pad_columns",
    "prepack_int4",
    "prepack_int8_vnni",
    "unavailable_reason",
]

_HERE = Path(__file__).resolve().parent
# compiled into the static archive (the kernels and their C shims); register.cpp is added for
# the in-process library only
_KERNEL_SOURCES = (
    "linear.cpp",
    "int8_fp8.cpp",
    "int4.cpp",
    "float32.cpp",
    "bfloat16.cpp",
    "decode.cpp",
    "attention.cpp",
)
# every file the build reads
_SOURCES = (*_KERNEL_SOURCES, "native.h", "amx.h", "bf16_dot.h", "float_rows.h", "register.cpp")
_ARCHIVE = "libfxquant_native.a"
_SHARED = "libfxquant_native.so"
INT4_BLOCK = 32  # nibble interleave block of the int4 kernel layout (int4.cpp)

# op name → (its schema, None where fxquant.core.ops declares it; its C shim declaration: what
# AOTInductor calls, named aoti_torch_cpu_<op>)
NATIVE_OPS = {
    "native_int8_weight_only_linear": (
        "native_int8_weight_only_linear(Tensor x, Tensor weight, Tensor scale) -> Tensor",
        "AOTITorchError aoti_torch_cpu_native_int8_weight_only_linear(AtenTensorHandle x, "
        "AtenTensorHandle weight, AtenTensorHandle scale, AtenTensorHandle* ret0)",
    ),
    # mixture-of-experts (int8_fp8.cpp): x [S, K] fp32 sorted by expert, weight [E, N, K] int8,
    # scale [E, N] fp32, offs [E] int64 cumulative row ends; each expert's rows on the linear's
    # paths (bf16_x: its bf16-dot GEMM from 2 rows, x rounded to bf16), rows past offs[-1] zeros
    "native_int8_weight_only_grouped_mm": (
        "native_int8_weight_only_grouped_mm(Tensor x, Tensor weight, Tensor scale, Tensor offs, "
        "int bf16_x) -> Tensor",
        "AOTITorchError aoti_torch_cpu_native_int8_weight_only_grouped_mm(AtenTensorHandle x, "
        "AtenTensorHandle weight, AtenTensorHandle scale, AtenTensorHandle offs, "
        "int64_t bf16_x, AtenTensorHandle* ret0)",
    ),
    # int4 experts (int4.cpp): weight [E, N, K/2] in the int4 linear's layout, scale and offset
    # [E, N, K/g]; an expert with at least int8_from rows (0: never) takes x per token in int8
    # and the W4A8 kernels, else from bf16_from rows (0: never) the bf16-dot path, else fp32
    "native_int4_grouped_mm": (
        "native_int4_grouped_mm(Tensor x, Tensor weight, Tensor scale, Tensor offset, "
        "Tensor offs, int group_size, int bf16_from, int int8_from) -> Tensor",
        "AOTITorchError aoti_torch_cpu_native_int4_grouped_mm(AtenTensorHandle x, "
        "AtenTensorHandle weight, AtenTensorHandle scale, AtenTensorHandle offset, "
        "AtenTensorHandle offs, int64_t group_size, int64_t bf16_from, int64_t int8_from, "
        "AtenTensorHandle* ret0)",
    ),
    # fp8 weight-only experts (int8_fp8.cpp): the int8 experts' shim on e4m3 [E, N, K]
    "native_float8_weight_only_grouped_mm": (
        "native_float8_weight_only_grouped_mm(Tensor x, Tensor weight, Tensor scale, "
        "Tensor offs, int bf16_x) -> Tensor",
        "AOTITorchError aoti_torch_cpu_native_float8_weight_only_grouped_mm(AtenTensorHandle x, "
        "AtenTensorHandle weight, AtenTensorHandle scale, AtenTensorHandle offs, "
        "int64_t bf16_x, AtenTensorHandle* ret0)",
    ),
    # W8A8 experts (int8_fp8.cpp): each expert's rows quantized per token to int8 inside the op,
    # then the w8a8 linear's integer kernels on its stored [N, K] weight
    "native_int8_dynamic_grouped_mm": (
        "native_int8_dynamic_grouped_mm(Tensor x, Tensor weight, Tensor scale, Tensor offs) "
        "-> Tensor",
        "AOTITorchError aoti_torch_cpu_native_int8_dynamic_grouped_mm(AtenTensorHandle x, "
        "AtenTensorHandle weight, AtenTensorHandle scale, AtenTensorHandle offs, "
        "AtenTensorHandle* ret0)",
    ),
    # fp8 experts (int8_fp8.cpp): weight [E, N, K] e4m3, x quantized inside the op as the
    # linear's (per token, its amax capped at scale_ub; or in 1 x b groups), each expert's rows
    # on that linear's paths (bf16_x: its bf16-dot GEMM from 2 rows, exact for e4m3 values)
    "native_float8_dynamic_grouped_mm": (
        "native_float8_dynamic_grouped_mm(Tensor x, Tensor weight, Tensor scale, Tensor offs, "
        "float scale_ub, int bf16_x) -> Tensor",
        "AOTITorchError aoti_torch_cpu_native_float8_dynamic_grouped_mm(AtenTensorHandle x, "
        "AtenTensorHandle weight, AtenTensorHandle scale, AtenTensorHandle offs, "
        "double scale_ub, int64_t bf16_x, AtenTensorHandle* ret0)",
    ),
    "native_float8_block_grouped_mm": (
        "native_float8_block_grouped_mm(Tensor x, Tensor weight, Tensor scale, Tensor offs, "
        "int block_size) -> Tensor",
        "AOTITorchError aoti_torch_cpu_native_float8_block_grouped_mm(AtenTensorHandle x, "
        "AtenTensorHandle weight, AtenTensorHandle scale, AtenTensorHandle offs, "
        "int64_t block_size, AtenTensorHandle* ret0)",
    ),
    # mixture-of-experts weights kept in fp32 (float32.cpp): weight [E, N, K], or [E, K, N] with
    # kn = 1 (gpt-oss' layout); skip_zero_rows = 1 where the weight is finite (Llama 4's)
    "native_float32_grouped_mm": (
        "native_float32_grouped_mm(Tensor x, Tensor weight, Tensor offs, int kn, "
        "int skip_zero_rows) -> Tensor",
        "AOTITorchError aoti_torch_cpu_native_float32_grouped_mm(AtenTensorHandle x, "
        "AtenTensorHandle weight, AtenTensorHandle offs, int64_t kn, int64_t skip_zero_rows, "
        "AtenTensorHandle* ret0)",
    ),
    "native_float8_weight_only_linear": (
        "native_float8_weight_only_linear(Tensor x, Tensor weight, Tensor scale) -> Tensor",
        "AOTITorchError aoti_torch_cpu_native_float8_weight_only_linear(AtenTensorHandle x, "
        "AtenTensorHandle weight, AtenTensorHandle scale, AtenTensorHandle* ret0)",
    ),
    # the same weights, x rounded to bf16 and multiplied with bf16 dot products (AVX-512 BF16)
    "native_int8_bf16dot_linear": (
        "native_int8_bf16dot_linear(Tensor x, Tensor weight, Tensor scale) -> Tensor",
        "AOTITorchError aoti_torch_cpu_native_int8_bf16dot_linear(AtenTensorHandle x, "
        "AtenTensorHandle weight, AtenTensorHandle scale, AtenTensorHandle* ret0)",
    ),
    "native_float8_bf16dot_linear": (
        "native_float8_bf16dot_linear(Tensor x, Tensor weight, Tensor scale) -> Tensor",
        "AOTITorchError aoti_torch_cpu_native_float8_bf16dot_linear(AtenTensorHandle x, "
        "AtenTensorHandle weight, AtenTensorHandle scale, AtenTensorHandle* ret0)",
    ),
    # fp8 with dynamic per-row activations: x quantized per token onto the e4m3 grid inside the
    # op (the reference's quantize_fp8_per_token values), each output row times its scale
    "native_float8_dynamic_linear": (
        "native_float8_dynamic_linear(Tensor x, Tensor weight, Tensor scale, float scale_ub) "
        "-> Tensor",
        "AOTITorchError aoti_torch_cpu_native_float8_dynamic_linear(AtenTensorHandle x, "
        "AtenTensorHandle weight, AtenTensorHandle scale, double scale_ub, "
        "AtenTensorHandle* ret0)",
    ),
    "native_float8_dynamic_bf16dot_linear": (
        "native_float8_dynamic_bf16dot_linear(Tensor x, Tensor weight, Tensor scale, "
        "float scale_ub) -> Tensor",
        "AOTITorchError aoti_torch_cpu_native_float8_dynamic_bf16dot_linear(AtenTensorHandle x, "
        "AtenTensorHandle weight, AtenTensorHandle scale, double scale_ub, "
        "AtenTensorHandle* ret0)",
    ),
    # fp8 with DeepSeek-V3 block scales (int8_fp8.cpp): weight tiles of block_size², scale
    # [ceil(N/b), ceil(K/b)]; x quantized in 1 × block_size groups inside the op (the
    # reference's quantize_fp8_groups), or, for the scaled op, by a fused norm (xq e4m3 values as
    # fp32, xs [M, ceil(K/b)])
    "native_float8_block_linear": (
        "native_float8_block_linear(Tensor x, Tensor weight, Tensor scale, int block_size) "
        "-> Tensor",
        "AOTITorchError aoti_torch_cpu_native_float8_block_linear(AtenTensorHandle x, "
        "AtenTensorHandle weight, AtenTensorHandle scale, int64_t block_size, "
        "AtenTensorHandle* ret0)",
    ),
    "native_float8_block_scaled_linear": (
        "native_float8_block_scaled_linear(Tensor xq, Tensor xs, Tensor weight, Tensor scale, "
        "int block_size) -> Tensor",
        "AOTITorchError aoti_torch_cpu_native_float8_block_scaled_linear(AtenTensorHandle xq, "
        "AtenTensorHandle xs, AtenTensorHandle weight, AtenTensorHandle scale, "
        "int64_t block_size, AtenTensorHandle* ret0)",
    ),
    "native_int8_scaled_linear": (
        "native_int8_scaled_linear(Tensor xq, Tensor xs, Tensor weight, Tensor scale) -> Tensor",
        "AOTITorchError aoti_torch_cpu_native_int8_scaled_linear(AtenTensorHandle xq, "
        "AtenTensorHandle xs, AtenTensorHandle weight, AtenTensorHandle scale, "
        "AtenTensorHandle* ret0)",
    ),
    # the same from fp32 activations, quantized per token inside the op (the reference's
    # quantize_int8_per_token, the same bytes)
    "native_int8_dynamic_linear": (
        "native_int8_dynamic_linear(Tensor x, Tensor weight, Tensor scale) -> Tensor",
        "AOTITorchError aoti_torch_cpu_native_int8_dynamic_linear(AtenTensorHandle x, "
        "AtenTensorHandle weight, AtenTensorHandle scale, AtenTensorHandle* ret0)",
    ),
    # w8a8 on a weight packed once for the AVX-512 VNNI GEMM (prepack_int8_vnni)
    "native_int8_scaled_vnni_linear": (
        "native_int8_scaled_vnni_linear(Tensor xq, Tensor xs, Tensor weight, Tensor comp, "
        "Tensor scale) -> Tensor",
        "AOTITorchError aoti_torch_cpu_native_int8_scaled_vnni_linear(AtenTensorHandle xq, "
        "AtenTensorHandle xs, AtenTensorHandle weight, AtenTensorHandle comp, "
        "AtenTensorHandle scale, AtenTensorHandle* ret0)",
    ),
    # the same from fp32 activations (as native_int8_dynamic_linear)
    "native_int8_dynamic_vnni_linear": (
        "native_int8_dynamic_vnni_linear(Tensor x, Tensor weight, Tensor comp, Tensor scale) "
        "-> Tensor",
        "AOTITorchError aoti_torch_cpu_native_int8_dynamic_vnni_linear(AtenTensorHandle x, "
        "AtenTensorHandle weight, AtenTensorHandle comp, AtenTensorHandle scale, "
        "AtenTensorHandle* ret0)",
    ),
    "native_int4_weight_only_linear": (
        "native_int4_weight_only_linear(Tensor x, Tensor weight, Tensor scale, Tensor offset, "
        "int group_size) -> Tensor",
        "AOTITorchError aoti_torch_cpu_native_int4_weight_only_linear(AtenTensorHandle x, "
        "AtenTensorHandle weight, AtenTensorHandle scale, AtenTensorHandle offset, "
        "int64_t group_size, AtenTensorHandle* ret0)",
    ),
    # int4 weight-only on bf16 dot products (x and the dequantized weight rounded to bf16)
    "native_int4_bf16dot_linear": (
        "native_int4_bf16dot_linear(Tensor x, Tensor weight, Tensor scale, Tensor offset, "
        "int group_size) -> Tensor",
        "AOTITorchError aoti_torch_cpu_native_int4_bf16dot_linear(AtenTensorHandle x, "
        "AtenTensorHandle weight, AtenTensorHandle scale, AtenTensorHandle offset, "
        "int64_t group_size, AtenTensorHandle* ret0)",
    ),
    "native_int8_int4_linear": (
        "native_int8_int4_linear(Tensor xq, Tensor xs, Tensor weight, Tensor scale, "
        "Tensor offset, int group_size) -> Tensor",
        "AOTITorchError aoti_torch_cpu_native_int8_int4_linear(AtenTensorHandle xq, "
        "AtenTensorHandle xs, AtenTensorHandle weight, AtenTensorHandle scale, "
        "AtenTensorHandle offset, int64_t group_size, AtenTensorHandle* ret0)",
    ),
    # W4A8 from fp32 activations, quantized per token inside the op (as the dynamic VNNI op)
    "native_int8_dynamic_int4_linear": (
        "native_int8_dynamic_int4_linear(Tensor x, Tensor weight, Tensor scale, Tensor offset, "
        "int group_size) -> Tensor",
        "AOTITorchError aoti_torch_cpu_native_int8_dynamic_int4_linear(AtenTensorHandle x, "
        "AtenTensorHandle weight, AtenTensorHandle scale, AtenTensorHandle offset, "
        "int64_t group_size, AtenTensorHandle* ret0)",
    ),
    # the fp32 linear a config leaves in float (float32.cpp): a GEMV at small M, MKL above
    "native_float32_linear": (
        "native_float32_linear(Tensor x, Tensor weight) -> Tensor",
        "AOTITorchError aoti_torch_cpu_native_float32_linear(AtenTensorHandle x, "
        "AtenTensorHandle weight, AtenTensorHandle* ret0)",
    ),
    # the bf16 linear a config leaves in float in a bf16 model (bfloat16.cpp): bf16 dot products
    "native_bfloat16_linear": (
        "native_bfloat16_linear(Tensor x, Tensor weight) -> Tensor",
        "AOTITorchError aoti_torch_cpu_native_bfloat16_linear(AtenTensorHandle x, "
        "AtenTensorHandle weight, AtenTensorHandle* ret0)",
    ),
    # the fp16 one (bfloat16.cpp too): fp32 products of the widened weight
    "native_float16_linear": (
        "native_float16_linear(Tensor x, Tensor weight) -> Tensor",
        "AOTITorchError aoti_torch_cpu_native_float16_linear(AtenTensorHandle x, "
        "AtenTensorHandle weight, AtenTensorHandle* ret0)",
    ),
    # weight decoders for the large-M bf16 GEMMs of the CPU dispatch (decode.cpp)
    "native_float8_to_bfloat16": (
        "native_float8_to_bfloat16(Tensor weight) -> Tensor",
        "AOTITorchError aoti_torch_cpu_native_float8_to_bfloat16(AtenTensorHandle weight, "
        "AtenTensorHandle* ret0)",
    ),
    "native_int4_to_bfloat16": (
        "native_int4_to_bfloat16(Tensor weight, Tensor scale, Tensor offset, int group_size) "
        "-> Tensor",
        "AOTITorchError aoti_torch_cpu_native_int4_to_bfloat16(AtenTensorHandle weight, "
        "AtenTensorHandle scale, AtenTensorHandle offset, int64_t group_size, "
        "AtenTensorHandle* ret0)",
    ),
    # grouped-query attention over the KV cache (attention.cpp): fxquant.export_llm's program
    # calls it on CPU, so its schema (None here), fake and fallback live in fxquant.core.ops
    "native_gqa_attention": (
        None,
        "AOTITorchError aoti_torch_cpu_native_gqa_attention(AtenTensorHandle q, "
        "AtenTensorHandle key, AtenTensorHandle value, AtenTensorHandle mask, double scale, "
        "AtenTensorHandle* ret0)",
    ),
}

_lib = torch.library.Library("fxquant", "FRAGMENT")
for _name, (_schema, _) in NATIVE_OPS.items():
    if _schema is not None:
        _lib.define(_schema)

_loading = threading.local()


def _load_then_call(name: str):
    """Each op's kernel until the library is loaded (CompositeExplicitAutograd: the library's CPU
    kernel, once registered, takes precedence). A graph that Inductor compiled in another
    process and serves from its disk cache calls these ops in a process where nothing traced,
    so nothing loaded the library: load it here and call the op again."""

    def kernel(*args, **kwargs):
        if getattr(_loading, "busy", False) or not load():
            raise NotImplementedError(
                f"fxquant::{name} has no kernel for these inputs here: the native CPU kernels "
                f"{'take CPU tensors' if load() else 'did not load: ' + str(_state['reason'])}"
            )
        _loading.busy = True
        try:
            return getattr(torch.ops.fxquant, name).default(*args, **kwargs)
        finally:
            _loading.busy = False

    return kernel


for _name, (_schema, _) in NATIVE_OPS.items():
    if _schema is not None:  # the others are declared, with a kernel, where their schema is
        _lib.impl(_name, _load_then_call(_name), "CompositeExplicitAutograd")


def _out(x: Tensor, weight: Tensor) -> Tensor:
    return x.new_empty((x.shape[0], weight.shape[0]), dtype=torch.float32)


torch.library.register_fake("fxquant::native_int8_weight_only_linear", lib=_lib)(
    lambda x, weight, scale: _out(x, weight)
)
torch.library.register_fake("fxquant::native_int8_weight_only_grouped_mm", lib=_lib)(
    lambda x, weight, scale, offs, bf16_x: x.new_empty(
        (x.shape[0], weight.shape[1]), dtype=torch.float32
    )
)
torch.library.register_fake("fxquant::native_int4_grouped_mm", lib=_lib)(
    lambda x, weight, scale, offset, offs, group_size, bf16_from, int8_from: x.new_empty(
        (x.shape[0], weight.shape[1]), dtype=torch.float32
    )
)
torch.library.register_fake("fxquant::native_float8_weight_only_grouped_mm", lib=_lib)(
    lambda x, weight, scale, offs, bf16_x: x.new_empty(
        (x.shape[0], weight.shape[1]), dtype=torch.float32
    )
)
torch.library.register_fake("fxquant::native_int8_dynamic_grouped_mm", lib=_lib)(
    lambda x, weight, scale, offs: x.new_empty((x.shape[0], weight.shape[1]), dtype=torch.float32)
)
torch.library.register_fake("fxquant::native_float8_dynamic_grouped_mm", lib=_lib)(
    lambda x, weight, scale, offs, scale_ub, bf16_x: x.new_empty(
        (x.shape[0], weight.shape[1]), dtype=torch.float32
    )
)
torch.library.register_fake("fxquant::native_float8_block_grouped_mm", lib=_lib)(
    lambda x, weight, scale, offs, block_size: x.new_empty(
        (x.shape[0], weight.shape[1]), dtype=torch.float32
    )
)
torch.library.register_fake("fxquant::native_float32_grouped_mm", lib=_lib)(
    lambda x, weight, offs, kn, skip_zero_rows: x.new_empty(
        (x.shape[0], weight.shape[2] if kn else weight.shape[1]), dtype=torch.float32
    )
)
torch.library.register_fake("fxquant::native_float8_weight_only_linear", lib=_lib)(
    lambda x, weight, scale: _out(x, weight)
)
torch.library.register_fake("fxquant::native_int8_bf16dot_linear", lib=_lib)(
    lambda x, weight, scale: _out(x, weight)
)
torch.library.register_fake("fxquant::native_float8_bf16dot_linear", lib=_lib)(
    lambda x, weight, scale: _out(x, weight)
)
torch.library.register_fake("fxquant::native_float8_dynamic_linear", lib=_lib)(
    lambda x, weight, scale, scale_ub: _out(x, weight)
)
torch.library.register_fake("fxquant::native_float8_dynamic_bf16dot_linear", lib=_lib)(
    lambda x, weight, scale, scale_ub: _out(x, weight)
)
torch.library.register_fake("fxquant::native_float8_block_linear", lib=_lib)(
    lambda x, weight, scale, block_size: _out(x, weight)
)
torch.library.register_fake("fxquant::native_float8_block_scaled_linear", lib=_lib)(
    lambda xq, xs, weight, scale, block_size: _out(xq, weight)
)
torch.library.register_fake("fxquant::native_int8_scaled_linear", lib=_lib)(
    lambda xq, xs, weight, scale: _out(xq, weight)
)
torch.library.register_fake("fxquant::native_int8_dynamic_linear", lib=_lib)(
    lambda x, weight, scale: _out(x, weight)
)
torch.library.register_fake("fxquant::native_int8_scaled_vnni_linear", lib=_lib)(
    lambda xq, xs, weight, comp, scale: xq.new_empty(
        (xq.shape[0], scale.shape[0]), dtype=torch.float32
    )
)
torch.library.register_fake("fxquant::native_int8_dynamic_vnni_linear", lib=_lib)(
    lambda x, weight, comp, scale: x.new_empty((x.shape[0], scale.shape[0]), dtype=torch.float32)
)
torch.library.register_fake("fxquant::native_int4_weight_only_linear", lib=_lib)(
    lambda x, weight, scale, offset, group_size: _out(x, weight)
)
torch.library.register_fake("fxquant::native_int4_bf16dot_linear", lib=_lib)(
    lambda x, weight, scale, offset, group_size: _out(x, weight)
)
torch.library.register_fake("fxquant::native_int8_int4_linear", lib=_lib)(
    lambda xq, xs, weight, scale, offset, group_size: _out(xq, weight)
)
torch.library.register_fake("fxquant::native_int8_dynamic_int4_linear", lib=_lib)(
    lambda x, weight, scale, offset, group_size: _out(x, weight)
)
torch.library.register_fake("fxquant::native_float32_linear", lib=_lib)(
    lambda x, weight: _out(x, weight)
)
torch.library.register_fake("fxquant::native_bfloat16_linear", lib=_lib)(
    lambda x, weight: _out(x, weight)
)
torch.library.register_fake("fxquant::native_float16_linear", lib=_lib)(
    lambda x, weight: _out(x, weight)
)
torch.library.register_fake("fxquant::native_float8_to_bfloat16", lib=_lib)(
    lambda weight: weight.new_empty(weight.shape, dtype=torch.bfloat16)
)
torch.library.register_fake("fxquant::native_int4_to_bfloat16", lib=_lib)(
    lambda weight, scale, offset, group_size: weight.new_empty(
        (weight.shape[0], 2 * weight.shape[1]), dtype=torch.bfloat16
    )
)

# --------------------------------------------------------------------------------------------
# Autograd: inference kernels, which say so when backward reaches them
# --------------------------------------------------------------------------------------------
# The native ops have no derivative. With no autograd kernel, torch's fallback ran backward
# through them with a warning and left their inputs without a gradient: a lowered program under
# grad mode gave silently wrong gradients, where the semantic ops (torch.library.custom_op) raise.
# Their backward here calls `native_no_backward`, which raises when it runs and, traced, only
# shapes its result: an eager backward raises at once, and a program compiled under grad mode
# (AOTAutograd traces the backward with fake tensors) still compiles and raises only if its
# backward ever runs.
_lib.define("native_no_backward(Tensor grad, SymInt[] shape, ScalarType dtype, str op) -> Tensor")


def _no_backward(grad: Tensor, shape, dtype, op: str) -> Tensor:
    raise RuntimeError(
        f"fxquant.{op} is an inference kernel (fxquant's native CPU lowering) and has no "
        "derivative, but backward reached it: run the lowered program under torch.no_grad() or "
        "torch.inference_mode(), or train the float model (FP8 training: fxquant.Float8Recipe)"
    )


_lib.impl("native_no_backward", _no_backward, "CompositeExplicitAutograd")
torch.library.register_fake("fxquant::native_no_backward", lib=_lib)(
    lambda grad, shape, dtype, op: grad.new_empty(shape, dtype=dtype)
)


def _remember_inputs(ctx, inputs, output) -> None:
    ctx.inputs = [(t.shape, t.dtype) if isinstance(t, Tensor) else None for t in inputs]


def _backward_of(op: str):
    def backward(ctx, grad):
        return tuple(
            torch.ops.fxquant.native_no_backward(grad, list(like[0]), like[1], op)
            if like is not None and needed
            else None
            for like, needed in zip(ctx.inputs, ctx.needs_input_grad, strict=True)
        )

    return backward


for _name, (_schema, _) in NATIVE_OPS.items():
    if _schema is not None:
        torch.library.register_autograd(
            f"fxquant::{_name}", _backward_of(_name), setup_context=_remember_inputs, lib=_lib
        )

# --------------------------------------------------------------------------------------------
# Weight layouts (computed once, at lowering time)
# --------------------------------------------------------------------------------------------


def prepack_int4(
    packed: Tensor, scale: Tensor, zero: Tensor, *, group_size: int
) -> tuple[Tensor, Tensor, Tensor]:
    """The rewrite's int4 layout → the kernel's: (weight uint8 [N, K/2], scale, offset).

    In: ``packed`` [N, K/2] (two codes a byte along K, low nibble = even column), ``scale``
    fp32 and ``zero`` uint8 [N, K/g], with w = (u - z) * s. Out: per 32 columns 16 bytes, byte
    i holding columns i (low nibble) and i + 16 (high), so 16 low nibbles meet 16 consecutive
    activations; ``offset = -z * s`` so that w = u * s + offset.
    """
    from fxquant.core import reference as ref

    if group_size % INT4_BLOCK:
        raise ValueError(f"prepack_int4: group_size={group_size} must be a multiple of 32")
    u = ref.unpack_int4(packed)  # [N, K]
    n, k = u.shape
    blocks = u.reshape(n, k // INT4_BLOCK, 2, INT4_BLOCK // 2)
    kernel = (blocks[:, :, 0] | (blocks[:, :, 1] << 4)).reshape(n, k // 2).contiguous()
    scale = scale.float().contiguous()
    offset = (-zero.float() * scale).contiguous()
    return kernel, scale, offset


VNNI_PANEL = 16  # output columns per panel of the AVX-512 VNNI int8 GEMM (int8_fp8.cpp)


def prepack_int8_vnni(weight: Tensor) -> tuple[Tensor, Tensor]:
    """An int8 weight [N, K] → the AVX-512 VNNI GEMM's layout, once (w8a8 on VNNI machines).

    Out: ``panels`` int8 [ceil(N/16), ceil(K/4) * 64], panel p's 64 bytes at quad g holding
    w[16p + c, 4g + t] at byte 4c + t (columns and k past the weight are zeros), and ``comp``
    int32 [16 ceil(N/16)], 128 x each column's sum: the kernel meets the activations as
    xq + 128 (vpdpbusd's unsigned operand) and takes 128 x sum(w) back out, exactly.
    """
    if weight.dtype != torch.int8 or weight.dim() != 2:
        raise ValueError(
            f"prepack_int8_vnni: weight must be a 2-D int8 tensor, got {weight.dtype} "
            f"{tuple(weight.shape)}"
        )
    n, k = weight.shape
    padded = F.pad(weight, (0, -k % 4, 0, -n % VNNI_PANEL))
    panels, quads = padded.shape[0] // VNNI_PANEL, padded.shape[1] // 4
    layout = padded.reshape(panels, VNNI_PANEL, quads, 4).permute(0, 2, 1, 3)
    comp = padded.sum(dim=1, dtype=torch.int32) * 128
    return layout.reshape(panels, quads * 64).contiguous(), comp.contiguous()


def pad_columns(t: Tensor, k: int) -> Tensor:
    """``t`` [M, K'] zero-padded to K columns (int4 weights are padded to whole groups)."""
    return t if t.shape[-1] == k else F.pad(t, (0, k - t.shape[-1]))


# --------------------------------------------------------------------------------------------
# Build and load
# --------------------------------------------------------------------------------------------


def _compiler() -> str:
    from torch._inductor.cpp_builder import get_cpp_compiler

    return get_cpp_compiler()


def cpu_signature() -> str:
    """The CPU's model and flag set (what ``-march=native`` builds for): part of the cache keys
    of what is compiled for this machine."""
    flags = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "model name")):
                flags += line
            if line.startswith("flags"):
                break
    return platform.machine() + flags


def _march() -> str:
    return os.environ.get("FXQUANT_NATIVE_MARCH", "native")


@functools.cache
def _sources() -> dict[str, bytes]:
    """The kernels' sources as this process first reads them: what its key hashes and what its
    build compiles, so a file edited in between cannot put a build under a key that names other
    sources (it did: a register.cpp one edit old, under the new sources' key)."""
    return {name: (_HERE / name).read_bytes() for name in _SOURCES}


@functools.cache
def _key() -> str:
    h = hashlib.sha256()
    h.update(_march().encode())
    for text in _sources().values():
        h.update(text)
    h.update(torch.__version__.encode())
    h.update(cpu_signature().encode())
    h.update(_compiler().encode())
    return h.hexdigest()[:20]


def build_dir() -> Path:
    """Where this machine's build of the kernels lives (it may not exist yet)."""
    return cache_root() / "native" / _key()


def _build(target: Path) -> None:
    from torch.utils.cpp_extension import include_paths

    cxx = _compiler()
    includes = [f"-I{p}" for p in include_paths()]
    flags = ["-O3", f"-march={_march()}", "-fopenmp", "-fPIC", "-std=c++17", "-DNDEBUG"]
    torch_lib = Path(torch.__file__).parent / "lib"
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".build-", dir=target.parent))
    try:
        for name, text in _sources().items():  # the bytes the key hashed
            (tmp / name).write_bytes(text)

        def run(*cmd: str) -> None:
            proc = subprocess.run(cmd, cwd=tmp, capture_output=True, text=True)
            if proc.returncode:
                raise RuntimeError(f"{' '.join(cmd[:3])} … failed:\n{proc.stderr[-2000:]}")

        def compile_object(name: str) -> str:
            obj = Path(name).with_suffix(".o").name
            run(cxx, *flags, *includes, "-c", name, "-o", obj)
            return obj

        # one compiler per core: the five sources took ~10 s one after another on two cores
        with ThreadPoolExecutor(max_workers=os.cpu_count() or 1) as pool:
            shim = pool.submit(compile_object, "register.cpp")
            objects = list(pool.map(compile_object, _KERNEL_SOURCES))
            shim.result()
        run("ar", "rcs", _ARCHIVE, *objects)
        run(
            cxx, "-shared", "-fopenmp", "register.o", *objects, f"-L{torch_lib}",
            f"-Wl,-rpath,{torch_lib}", "-ltorch", "-ltorch_cpu", "-lc10", "-o", _SHARED,
        )  # fmt: skip
        try:
            os.replace(tmp, target)  # atomic: another process may have finished first
        except OSError:
            if not (target / _SHARED).exists():
                raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


_state: dict[str, object] = {}


def load() -> bool:
    """Build (if needed) and load the kernels into this process; True when they are usable."""
    if "ok" in _state:
        return bool(_state["ok"])
    if os.environ.get("FXQUANT_NATIVE", "1") == "0":
        _state.update(ok=False, reason="disabled by FXQUANT_NATIVE=0")
        return False
    try:
        target = build_dir()
        if not (target / _SHARED).exists():
            _build(target)
        torch.ops.load_library(str(target / _SHARED))
        _state.update(ok=True, reason=None)
    except Exception as exc:  # noqa: BLE001  (no compiler, a failed build: fall back, say why)
        _state.update(ok=False, reason=f"{type(exc).__name__}: {exc}".strip())
    return bool(_state["ok"])


def available() -> bool:
    """Whether the native kernels are built and loaded (building them on first call)."""
    return load()


def unavailable_reason() -> str | None:
    """Why :func:`available` is False (None when it is True)."""
    load()
    return _state.get("reason")  # type: ignore[return-value]


def aoti_options() -> dict:
    """Inductor settings that make AOTInductor call the C shims and link the kernels in."""
    if not load():
        return {}
    ops = {getattr(torch.ops.fxquant, n).default: [shim] for n, (_, shim) in NATIVE_OPS.items()}
    return {
        "aot_inductor.custom_ops_to_c_shims": ops,
        # ":name" makes the linker take that exact file from LIBRARY_PATH (see link_path)
        "aot_inductor.custom_op_libs": [f":{_ARCHIVE}"],
    }


@contextlib.contextmanager
def link_path() -> Iterator[None]:
    """Put the static archive's folder on the linker's search path (``LIBRARY_PATH``) while an
    AOTInductor package links; the archive's code is copied into the package's model .so."""
    if not load():
        yield
        return
    old = os.environ.get("LIBRARY_PATH")
    os.environ["LIBRARY_PATH"] = os.pathsep.join(p for p in (str(build_dir()), old) if p)
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LIBRARY_PATH", None)
        else:
            os.environ["LIBRARY_PATH"] = old
