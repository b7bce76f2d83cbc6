"""What the tiled GEMMs of ``fxquant.kernels`` share: a program's tile, the fp32 dot, the
epilogue, the decode/prefill pair of autotuned kernels and their launch, and the CUDA lowering's
choice between the two paths.

Where it sits: under every GEMM kernel file. The autotuned decode/prefill GEMMs
(``int8_weight_only``, ``intx_weight_only`` and ``int4_weight_only``, ``bnb4_weight_only``,
``bitnet``, ``int8_dynamic``, ``float8_block``) use all of the first two sections; the MX
kernels (``mxfp4``, ``mxfp8``, ``mxfp4_grouped``: one fixed tile, no split-K) the epilogue. The
CUDA lowerings the kernel files register (``fxquant.passes.lower_cuda`` collects them) use the
last section.

Two launch shapes, picked by :func:`launch` from M (``configs.is_decode``) or by the caller:

- decode (M ≤ ``configs.DECODE_MAX_M``): a GEMV in disguise, all weight bandwidth. One 16-row
  tile covers M; split-K spreads K over ``SPLIT_K`` programs per column tile so that a small N
  still fills the GPU. Partial sums are ``atomic_add``-ed into fp32 zeros (scales and bias are
  linear, so each partial applies its own scale; only the first K slice adds the bias), and
  the launcher casts that buffer to the output dtype. Outputs may differ between runs in the
  last bit (the atomics' order).
- prefill: plain tiled GEMM writing the output dtype directly, tiles visited in GROUP_M-row
  bands so that neighbouring programs reuse the same weight tiles from L2.

A GEMM kernel here takes ``(*operands, bias_ptr, y_ptr, M, N, K, *extra, <its constexprs>,
HAS_BIAS, GROUP_M, BLOCK_M, BLOCK_N, BLOCK_K, SPLIT_K)``, the tile sizes and SPLIT_K from the
autotune configs (``configs``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch import Tensor
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxquant.kernels import configs

GROUP_M = 8  # row tiles per band in the prefill tile order (Triton's matmul tutorial value)
# The interpreter (triton 3.9) multiplies bf16 dot operands as their raw uint16 bits; there the
# operands go up to fp32 first, which gives the GPU's bf16 MMA result (exact products, fp32 sums).
_BF16_DOT_IN_FP32 = tl.constexpr(configs.interpreting())


# --------------------------------------------------------------------------------------------
# Kernel helpers
# --------------------------------------------------------------------------------------------


@triton.jit
def program_tile(M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    """This program's share of y [M, N]: (rows [BLOCK_M], columns [BLOCK_N], K slice pid_k).

    Program ids are laid out in bands of GROUP_M row tiles, so W tiles hit L2; axis 1 is the
    K slice (split-K)."""
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    band = pid // (GROUP_M * tiles_n)
    first_m = band * GROUP_M
    band_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    pid_m = first_m + (pid % (GROUP_M * tiles_n)) % band_rows
    pid_n = (pid % (GROUP_M * tiles_n)) // band_rows
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    return offs_m, offs_n, tl.program_id(1)


@triton.jit
def load_a(x_ptr, offs_m, mask_m, k, K):
    """The A tile of a K step: row-major x [M, K] at rows ``offs_m`` and columns ``k``, zeros
    outside; returned with k's mask."""
    mask_k = k < K
    a = tl.load(
        x_ptr + offs_m[:, None] * K + k[None, :],
        mask=mask_m[:, None] & mask_k[None, :],
        other=0.0,
    )
    return a, mask_k


@triton.jit
def dot_f32(a, b):
    """a · b accumulated in fp32. fp32 operands use IEEE products, not TF32, so the GPU, the
    interpreter and the fp32 reference agree to fp32 rounding."""
    if _BF16_DOT_IN_FP32 and a.dtype == tl.bfloat16:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, input_precision="ieee") if a.dtype == tl.float32 else tl.dot(a, b)


@triton.jit
def as_operand(w, dtype: tl.constexpr):
    """Weight values (exact in ``dtype``) → the dot operand. Integers go through fp32: the
    interpreter (triton 3.9) casts int → bf16 by reinterpreting the bits; on the GPU both
    converts are exact."""
    if w.dtype.is_int():
        w = w.to(tl.float32)
    return w.to(dtype)


@triton.jit
def store_tile(
    y_ptr,  # [M, N] row-major
    acc,  # [BLOCK_M, BLOCK_N] fp32, already scaled
    bias_ptr,  # [N] float; ignored unless HAS_BIAS
    offs_m,
    offs_n,
    M,
    N,
    pid_k,
    HAS_BIAS: tl.constexpr,
    SPLIT_K: tl.constexpr,
):
    """Add the bias (first K slice only) and write the tile: a store, or an fp32 atomic add
    into zeros when SPLIT_K programs share the tile. Rows at or past M are masked off."""
    mask_n = offs_n < N
    if HAS_BIAS:
        bias = tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        if SPLIT_K > 1:
            bias = tl.where(pid_k == 0, bias, 0.0)
        acc += bias[None, :]
    y_ptrs = y_ptr + offs_m.to(tl.int64)[:, None] * N + offs_n[None, :]  # M·N may pass 2**31
    mask = (offs_m[:, None] < M) & mask_n[None, :]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tl.atomic_add(y_ptrs, acc, mask=mask)


# --------------------------------------------------------------------------------------------
# Autotuning and launch
# --------------------------------------------------------------------------------------------

X_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def check_activation(x: Tensor) -> None:
    """The activation dtypes the weight-only GEMMs take (the weight tile is cast to x's)."""
    if x.dtype not in X_DTYPES:
        raise ValueError(f"x dtype is {x.dtype}; allowed: bfloat16, float16, float32")


def decode_and_prefill(
    kernel,
    *,
    key: list[str],
    prefill_key: list[str] | None = None,
    decode_configs: list[triton.Config] | None = None,
    prefill_configs: list[triton.Config] | None = None,
):
    """(decode, prefill): ``kernel`` autotuned over the decode and the prefill configs.

    ``key`` names the arguments the best config depends on, besides M. Prefill keys on M too
    (``prefill_key`` defaults to M + ``key``: a 32-row and a 4096-row problem want different
    tiles); decode's M is one tile whatever it is. ``reset_to_zero``: autotuning runs the
    split-K kernel repeatedly on the same buffer, which must start at zero each time.
    """
    decode = triton.autotune(
        configs=configs.decode_configs() if decode_configs is None else decode_configs,
        key=key,
        reset_to_zero=["y_ptr"],
    )(kernel)
    prefill = triton.autotune(
        configs=configs.prefill_configs() if prefill_configs is None else prefill_configs,
        key=["M", *key] if prefill_key is None else prefill_key,
    )(kernel)
    return decode, prefill


def grid(m, n):
    """One program per tile of y [m, n] (``program_tile`` orders them), times SPLIT_K."""
    return lambda meta: (
        triton.cdiv(m, meta["BLOCK_M"]) * triton.cdiv(n, meta["BLOCK_N"]),
        meta["SPLIT_K"],
    )


def launch(
    kernels,
    operands: tuple,
    bias: Tensor | None,
    m,
    n,
    k,
    *extra,
    out_dtype: torch.dtype,
    decode: bool | None,
    **constexprs,
) -> Tensor:
    """Run a GEMM on y [m, n]: pick the path, allocate y, launch, return y in ``out_dtype``.

    ``kernels`` is the (decode, prefill) pair of :func:`decode_and_prefill`; ``operands`` the
    tensors before ``bias_ptr`` (contiguous), ``extra`` the runtime arguments after K.
    ``decode`` forces a path (see ``configs.is_decode``); None picks from M.
    """
    device = operands[0].device
    if configs.is_decode(m, decode):
        # split-K programs add their partial sums into fp32, whatever the output dtype
        y = torch.zeros((m, n), device=device, dtype=torch.float32)
        kernel, split = kernels[0], {}
    else:
        y = torch.empty((m, n), device=device, dtype=out_dtype)
        kernel, split = kernels[1], {"SPLIT_K": 1}
    torch.library.wrap_triton(kernel)[grid(m, n)](
        *operands,
        operands[0] if bias is None else bias.contiguous(),  # HAS_BIAS=False never reads it
        y,
        m,
        n,
        k,
        *extra,
        HAS_BIAS=bias is not None,
        GROUP_M=GROUP_M,
        **constexprs,
        **split,
    )
    return y.to(out_dtype)


# --------------------------------------------------------------------------------------------
# Prefill through the vendor library
# --------------------------------------------------------------------------------------------

# On a GPU a prefill GEMM (M > DECODE_MAX_M) does not run the fused Triton prefill kernel where
# the vendor library serves: weight-only W is dequantized once to x's dtype for the dense GEMM,
# and fp8 × fp8 goes to torch._scaled_mm. Measured on an H200 (Llama-3-8B q/o, M = 2048, median
# ms, benchmarks/results/gpu/h200_2026-12-04.json): bf16 F.linear 0.092 against the fused
# kernels' 0.60 (int4wo-128), 0.15 (int8wo), 0.16 (fp8wo); the row-scaled fp8 GEMM alone 0.091
# against _scaled_mm's 0.055. Writing W out once is one pass over N·K, which 2048 rows amortize
# many times over; decode (M ≤ 16) keeps the fused split-K kernels, whose weight reads are the
# whole cost. The GPU script times both paths (``LIBRARY_PREFILL`` off for the fused one).
LIBRARY_PREFILL = True


def library_prefill(t: Tensor, m, decode: bool | None) -> bool:
    """Whether a GEMM on M rows of ``t`` takes the library path: a prefill
    (``configs.is_decode`` false) on a device the library path serves, with it switched on."""
    return LIBRARY_PREFILL and _library_device(t) and not configs.is_decode(m, decode)


def _library_device(t: Tensor) -> bool:
    # CUDA only: on CPU tensors (the interpreter's tests) the fused kernels are what is being
    # checked; tests patch this to run the library path there too.
    return t.is_cuda


def dense_linear(x2: Tensor, w: Tensor, bias: Tensor | None) -> Tensor:
    """x2 [M, K] · W [N, K] (+ bias) by the dense GEMM, W and bias already or made x's dtype:
    the library path of the weight-only GEMMs, after their dequantization."""
    b = None if bias is None else bias.to(x2.dtype)
    return F.linear(x2.contiguous(), w.to(x2.dtype), b)


def scaled_mm_serves(xq: Tensor, n: int, k: int, out_dtype: torch.dtype) -> bool:
    """Whether torch._scaled_mm takes this e4m3 × e4m3 GEMM: K and N multiples of 16 (its
    layout rule), a bf16 output (what row-wise scaling returns), and on CUDA a device with fp8
    tensor cores (sm 8.9 or later)."""
    if k % 16 or n % 16 or out_dtype != torch.bfloat16:
        return False
    return not xq.is_cuda or torch.cuda.get_device_capability(xq.device) >= (8, 9)


def library_scaled_mm(
    xq: Tensor, xs: Tensor, weight: Tensor, scale: Tensor, bias: Tensor | None, out_dtype
) -> Tensor:
    """(xq · Wᵀ) · xs · scale (+ bias) by torch._scaled_mm: xq e4m3 [M, K] with xs [M, 1] or a
    single scale, W e4m3 [N, K] with scale [N] or [1]. One scale on both sides is its
    tensor-wise mode; otherwise both go row-wise ([M, 1] and [1, N], which it needs together)."""
    m, n = xq.shape[0], weight.shape[0]
    if xs.dim() < 2 and scale.numel() == 1:
        a, b = xs.reshape(1), scale.reshape(1)
    else:
        a = xs.reshape(-1, 1).expand(m, 1).contiguous()
        b = scale.reshape(1, -1).expand(1, n).contiguous()
    # W [N, K] row-major is the column-major second operand _scaled_mm asks for, as Wᵀ
    bias = None if bias is None else bias.to(out_dtype)
    return torch._scaled_mm(xq, weight.t(), scale_a=a, scale_b=b, bias=bias, out_dtype=out_dtype)


# --------------------------------------------------------------------------------------------
# CUDA lowering: the aten around a GEMM op
# --------------------------------------------------------------------------------------------


def rows(t: Tensor) -> Tensor:
    """[..., K] → [M, K]."""
    return t.reshape(-1, t.shape[-1])


def decode_or_prefill(op, args: tuple, m) -> Tensor:
    """``op(*args)``, a GEMM whose last argument ``decode`` picks its kernel, on M rows.

    When M is known (a number, or a symbol whose range settles it) the op picks its own path.
    A dynamic M gets both paths under ``torch.cond(M <= DECODE_MAX_M, decode, prefill)``: one
    artifact then runs the split-K GEMV at M = 1 and the tiled kernel at M = 2048, chosen when
    it runs (the op alone could only take the path that is right for every M, the tiled one).
    ``torch.cond`` takes the tensor arguments as operands; the rest go in by keyword.
    """
    limit = configs.DECODE_MAX_M
    if statically_known_true(m <= limit) or statically_known_true(m > limit):
        return op(*args)
    names = [a.name for a in op._schema.arguments]
    tensors = {n: a for n, a in zip(names, args, strict=False) if isinstance(a, Tensor)}
    # Everything else (None bias, group size, dtype) goes in by keyword through the branch:
    # passed positionally, Dynamo lifted the ints into the branches' operands, which export's
    # placeholder naming pass cannot take ("'int' object has no attribute 'name'").
    fixed = {n: a for n, a in zip(names, args, strict=False) if n not in tensors}

    def branch(decode: bool):
        def run(*ts):
            return op(**dict(zip(tensors, ts, strict=True)), **fixed, decode=decode)

        return run

    # Dynamo traces every branch from this same code, so an int of `fixed` that differs between
    # two GEMMs (int2 and int3 layers in one program, or two group sizes in one process) would
    # be made a dynamic input by automatic-dynamic and lifted into the operands again (the
    # error above). The branches' tensor shapes come from the operands, so this loses nothing.
    with torch._dynamo.config.patch(automatic_dynamic_shapes=False):
        return torch.cond(m <= limit, branch(True), branch(False), tuple(tensors.values()))


def linear(op, x: Tensor, *args) -> Tensor:
    """``op(x, *args)`` on x [..., K]: 2-D for the kernel, its path by M, the leading dims back."""
    x2 = rows(x)
    y = decode_or_prefill(op, (x2, *args), x2.shape[0])
    return y.reshape(*x.shape[:-1], y.shape[-1])


def scaled_linear(mm, xq: Tensor, xs: Tensor, *args) -> Tensor:
    """A ``*_scaled_mm`` op on [..., K] activations, as :func:`linear`.

    Per-token / per-group scales ([..., 1], [..., G]) flatten with the rows; a per-tensor
    scale ([1]) is left as it is.
    """
    xq2 = rows(xq)
    xs2 = xs if xs.dim() == 1 else rows(xs)
    y = decode_or_prefill(mm, (xq2, xs2, *args), xq2.shape[0])
    return y.reshape(*xq.shape[:-1], y.shape[-1])
