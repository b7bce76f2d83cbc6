"""fxquant::triton_norm_quant (kernels/norm_quant.py) against reference.norm_quant.

Runs the Triton kernel on CPU tensors under TRITON_INTERPRET=1 (conftest sets it without a GPU).
``normed`` may differ from the reference in the last bit of x's dtype (the row sums are reduced in
another order), so it is compared with the dtype's tolerance; the quantization is then checked
bit for bit by re-quantizing the kernel's own ``normed`` with the reference, and end to end by
allowing only rare one-code differences.
"""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

triton = pytest.importorskip("triton")

from fxquant.core import reference as ref  # noqa: E402
from fxquant.kernels import norm_quant as nq  # noqa: E402

pytestmark = pytest.mark.interpreter

op = torch.ops.fxquant.triton_norm_quant
# Interpreted on CPU tensors without a GPU; compiled, on the GPU, where there is one.
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FP8 = torch.float8_e4m3fn
EPS = 1e-6

FP32 = (torch.float32, 1e-5, 1e-5)  # (dtype, rtol, atol)
BF16 = (torch.bfloat16, 1.6e-2, 1e-5)
FP16 = (torch.float16, 1e-3, 1e-5)
# (rms, has_weight, has_bias, dtype, rtol, atol): both dtypes where there is a weight (rounding to
# bf16 and fp32 differ in the kernel; a missing weight or bias does not interact with the dtype)
NORMS = [
    pytest.param(True, True, False, *FP32, id="rms-w-fp32"),
    pytest.param(True, True, False, *BF16, id="rms-w-bf16"),
    pytest.param(True, False, False, *BF16, id="rms-bf16"),
    pytest.param(False, True, True, *FP32, id="ln-wb-fp32"),
    pytest.param(False, True, True, *BF16, id="ln-wb-bf16"),
    pytest.param(False, False, False, *FP32, id="ln-fp32"),
]
QUANTS = [  # (quant_dtype, group_size, scale_ub); scale_ub=2.0 binds on N(0, 1) rows
    (torch.int8, -1, None),
    (FP8, -1, None),
    (FP8, -1, 2.0),
    (FP8, 128, None),
    (FP8, 32, None),
]


def _quant_id(quant):
    quant_dtype, group_size, scale_ub = quant
    kind = "int8" if quant_dtype == torch.int8 else "fp8"
    scaling = "token" if group_size == -1 else f"g{group_size}"
    return f"{kind}-{scaling}" + ("" if scale_ub is None else f"-ub{scale_ub}")


SHAPES = [(1, 1), (3, 37), (5, 130), (4, 300), (2, 3, 64)]


def _inputs(shape, dtype, has_weight, has_bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    k = shape[-1]
    x = (torch.randn(shape, generator=g) * 3 + 0.5).to(DEVICE, dtype)
    w = (torch.randn(k, generator=g) + 1).to(DEVICE, dtype) if has_weight else None
    b = torch.randn(k, generator=g).to(DEVICE, dtype) if has_bias else None
    return x, w, b


def _bits(q):
    return q.view(torch.uint8) if q.dtype == FP8 else q


def _codes(q):
    """Quantized values as integers in which neighbouring codes differ by one (±0 are both 0)."""
    if q.dtype != FP8:
        return q.int()
    b = q.view(torch.uint8).int()
    return torch.where(b >= 128, -(b & 127), b)


def _check(x, w, b, *, rms, quant, rtol, atol):
    quant_dtype, group_size, scale_ub = quant
    q, scale, normed = op(x, w, b, EPS, rms, quant_dtype, group_size, scale_ub, True)
    rq, rscale, rnormed = ref.norm_quant(
        x, w, b, eps=EPS, rms=rms, quant_dtype=quant_dtype, group_size=group_size, scale_ub=scale_ub
    )
    assert (q.dtype, q.shape) == (quant_dtype, x.shape)
    assert (scale.dtype, scale.shape) == (torch.float32, rscale.shape)
    torch.testing.assert_close(normed, rnormed, rtol=rtol, atol=atol)

    # The quantization alone, from the kernel's own normed: bit-exact.
    q_own, scale_own = ref.quantize_activation(
        normed, quant_dtype=quant_dtype, group_size=group_size, scale_ub=scale_ub
    )
    assert torch.equal(_bits(q), _bits(q_own))
    assert torch.equal(scale, scale_own)

    # End to end: a last-bit difference in normed moves at most one code, in rare elements.
    torch.testing.assert_close(scale, rscale, rtol=rtol, atol=0)
    diff = (_codes(q) - _codes(rq)).abs()
    assert diff.max() <= 1
    assert (diff != 0).float().mean() <= 0.01


@pytest.mark.parametrize("quant", QUANTS, ids=_quant_id)
@pytest.mark.parametrize(("rms", "has_weight", "has_bias", "dtype", "rtol", "atol"), NORMS)
def test_matches_reference(rms, has_weight, has_bias, dtype, rtol, atol, quant):
    for shape in SHAPES:
        x, w, b = _inputs(shape, dtype, has_weight, has_bias)
        _check(x, w, b, rms=rms, quant=quant, rtol=rtol, atol=atol)


@pytest.mark.parametrize("quant", [*QUANTS, (FP8, 96, None)], ids=_quant_id)  # 96: masked columns
@pytest.mark.parametrize(
    ("rms", "dtype", "rtol", "atol"),
    [pytest.param(True, *FP16, id="rms-fp16"), pytest.param(False, *FP32, id="ln-fp32")],
)
def test_row_longer_than_one_tile(monkeypatch, rms, dtype, rtol, atol, quant):
    """The multi-pass path (statistics, row amax, quantize), forced with a 64-element tile."""
    monkeypatch.setattr(nq, "MAX_ROW_BLOCK", 64)
    group, block_r, _, _ = nq._tile(300, quant[1])
    assert block_r * group < 300
    x, w, b = _inputs((3, 300), dtype, True, not rms)
    _check(x, w, b, rms=rms, quant=quant, rtol=rtol, atol=atol)


def test_layer_norm_of_one_element_is_zero():
    x = torch.tensor([[3.0]], device=DEVICE)
    for quant in QUANTS:
        q, scale, normed = op(x, None, None, EPS, False, *quant, True)
        assert normed.item() == 0 and q.float().item() == 0
        assert torch.isfinite(scale).all()


@pytest.mark.parametrize("quant", [QUANTS[0], QUANTS[2], QUANTS[4]], ids=_quant_id)
@pytest.mark.parametrize("rms", [True, False], ids=["rms", "ln"])
def test_zero_and_constant_rows_give_zeros(monkeypatch, rms, quant):
    """All-zero rows (and, for LayerNorm, constant rows) normalize to zeros: q = 0, finite scale."""
    x = torch.zeros(3, 300, device=DEVICE)
    x[1] = 7.0 if not rms else 0.0
    x[2] = torch.randn(300, generator=torch.Generator().manual_seed(0))
    for tile in (nq.MAX_ROW_BLOCK, 64):  # one tile, then the multi-pass path
        monkeypatch.setattr(nq, "MAX_ROW_BLOCK", tile)
        q, scale, normed = op(x, None, None, EPS, rms, *quant, True)
        assert torch.isfinite(scale).all() and (scale > 0).all()
        assert not normed[:2].any() and not q[:2].float().any()
        assert q[2].float().abs().max() > 0


@pytest.mark.parametrize("quant", [QUANTS[0], QUANTS[4]], ids=_quant_id)
def test_normed_only_written_when_asked(quant):
    x, w, b = _inputs((4, 130), torch.bfloat16, True, True)
    q, scale, normed = op(x, w, b, EPS, False, *quant, True)
    q2, scale2, empty = op(x, w, b, EPS, False, *quant, False)
    assert (empty.shape, empty.dtype) == ((0,), torch.bfloat16)
    assert torch.equal(_bits(q), _bits(q2)) and torch.equal(scale, scale2)


def test_warp_counts_that_would_spill_are_not_tuned():
    """The autotuner never sees more than 64 tile elements per thread (not run under the
    interpreter, which keeps one config, so checked here on the pruning function itself)."""
    configs = [triton.Config({}, num_warps=w) for w in (4, 1, 2, 8, 16)]

    def warps(block_r, block_c):
        kept = nq._prune_warps(configs, {}, BLOCK_R=block_r, BLOCK_C=block_c)
        return sorted(c.num_warps for c in kept)

    assert warps(1, 16384) == [8, 16]
    assert warps(32, 128) == [2, 4, 8, 16]
    assert warps(1, 128) == [1, 2, 4, 8, 16]
    assert warps(1, 65536) == [16]  # nothing fits: the most warps


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"quant_dtype": torch.int8, "group_size": 128}, "int8 activations are per token"),
        ({"quant_dtype": torch.int8, "scale_ub": 1.0}, "int8 activations are per token"),
        ({"quant_dtype": torch.float8_e5m2}, "quant_dtype=torch.float8_e5m2 is not supported"),
        ({"group_size": 0}, "group_size=0, scale_ub=None is not supported"),
        ({"group_size": 128, "scale_ub": 1.0}, "group_size=128, scale_ub=1.0 is not supported"),
        ({"rms": True, "bias": torch.zeros(64)}, "RMSNorm has no bias"),
        ({"weight": torch.ones(32)}, r"weight must be a float tensor of shape \[K=64\]"),
        ({"x": torch.ones(2, 64, dtype=torch.int32)}, "x dtype is torch.int32"),
        ({"x": torch.ones(2, 0)}, "with K > 0"),
    ],
)
def test_bad_arguments_raise(kwargs, message):
    args = {
        "x": torch.randn(2, 64),
        "weight": None,
        "bias": None,
        "eps": EPS,
        "rms": False,
        "quant_dtype": FP8,
        "group_size": -1,
        "scale_ub": None,
        "return_normed": True,
    }
    args.update(kwargs)
    with pytest.raises(ValueError, match=message):
        op(*args.values())


# The checks that run interpreted: with TRITON_INTERPRET=1, wrap_triton returns the kernel itself
# instead of a traceable wrapper, so the op's fake implementation (its own body) would launch the
# kernel on fake tensors. test_faketensor and test_aot_dispatch_dynamic need the GPU.
INTERPRETED_UTILS = ("test_schema", "test_autograd_registration")
ALL_UTILS = (*INTERPRETED_UTILS, "test_faketensor", "test_aot_dispatch_dynamic")
OPCHECK_CASES = pytest.mark.parametrize(
    ("rms", "has_weight", "has_bias", "quant", "return_normed"),
    [
        pytest.param(True, True, False, (torch.int8, -1, None), True, id="rms-w-int8"),
        pytest.param(False, True, True, (FP8, -1, 2.0), False, id="ln-wb-fp8-token-ub"),
        pytest.param(True, False, False, (FP8, 32, None), True, id="rms-fp8-g32"),
    ],
)


def _opcheck(rms, has_weight, has_bias, quant, return_normed, test_utils):
    x, w, b = _inputs((2, 3, 80), torch.bfloat16, has_weight, has_bias)
    args = (x, w, b, EPS, rms, *quant, return_normed)
    # SchemaCheckMode compares every tensor an op touches with torch.allclose, which has no
    # float8 kernel ("mul_cpu_reduced_float" not implemented for 'Float8_e4m3fn'); the fp8 cases
    # run every other opcheck test (the op is declared functional, mutates_args=()).
    if quant[0] == FP8:
        test_utils = tuple(t for t in test_utils if t != "test_schema")
    opcheck(op, args, test_utils=test_utils)


@pytest.mark.skipif(DEVICE == "cuda", reason="the GPU runs every opcheck test (test_opcheck_gpu)")
@OPCHECK_CASES
def test_opcheck_interpreted(rms, has_weight, has_bias, quant, return_normed):
    _opcheck(rms, has_weight, has_bias, quant, return_normed, INTERPRETED_UTILS)


@pytest.mark.gpu
@pytest.mark.skipif(DEVICE != "cuda", reason="needs a CUDA device")
@OPCHECK_CASES
def test_opcheck_gpu(rms, has_weight, has_bias, quant, return_normed):
    _opcheck(rms, has_weight, has_bias, quant, return_normed, ALL_UTILS)
