"""SpQR (``Spqr``, transformers' ``SpQRConfig``): checkpoints in the ``spqr_quant`` package's
layout load onto the weights that layout encodes; the op and its CPU lowering against the
reference; bad checkpoints and configs.

The tiles are packed here as the package's C++ ``tensor_compress_interleaved`` / ``TileArray``
lay them out (read, not run: the package builds only with CUDA): per 16×16 tile, a 64-bit word
per row with the row's scale and zero codes, its 16 weight codes and one byte of the tile's four
fp16 second-level statistics (byte p in rows 2p and 2p + 1). The outliers and the permutation are
packed as the package's Python does (``merge_col_val``, ``pack_uint16_to_uint32``). The expected
weight is computed from the unpacked codes directly, in fp16 as the package's kernels do.
"""

from __future__ import annotations

import pytest
import torch
from test_checkpoints import One

import fxquant
from conftest import check_package_without_fxquant
from fxquant import Spqr
from fxquant.checkpoints import CheckpointError, read_quantized
from fxquant.core import spqr
from fxquant.core.reference import sqnr
from fxquant.passes.lower import lower

M, N = 32, 48
QCFG = {"quant_method": "spqr", "bits": 3, "beta1": 16, "beta2": 16}


def _u16(h: torch.Tensor) -> int:
    return int(h.view(torch.int16).item()) & 0xFFFF


def _layer(seed: int = 0, *, ptcsr: bool = False):
    """(tensors of layer ``proj``, the fp32 weight they encode)."""
    g = torch.Generator().manual_seed(seed)
    ti, tj = M // 16, N // 16
    q = torch.randint(0, 8, (M, N), generator=g)
    ws, wz = torch.randint(0, 8, (M, tj), generator=g), torch.randint(0, 8, (M, tj), generator=g)
    stats = [(torch.rand(ti, tj, generator=g) * 0.02 + 0.01).half() for _ in range(2)]  # s of s, z
    zeros = [torch.randint(0, 8, (ti, tj), generator=g).half() for _ in range(2)]  # z of s, z
    words = []
    for i in range(ti):
        for j in range(tj):
            v = _u16(stats[0][i, j]) | _u16(stats[1][i, j]) << 16
            v |= _u16(zeros[0][i, j]) << 32 | _u16(zeros[1][i, j]) << 48
            for r in range(16):
                row = i * 16 + r
                b = int(ws[row, j]) | int(wz[row, j]) << 3
                for c in range(16):
                    b |= int(q[row, j * 16 + c]) << (3 * (c + 2))
                words.append(b | ((v >> (8 * (r // 2))) & 0xFF) << 54)
    # the expected dense weight, in permuted column order, each step in fp16
    rows, tiles = torch.arange(M) // 16, torch.arange(N) // 16
    s = (ws.half() - zeros[0][rows]) * stats[0][rows]  # [M, TJ]
    z = (wz.half() - zeros[1][rows]) * stats[1][rows]
    wp = (q.half() - z[:, tiles]) * s[:, tiles]
    # outliers: three in row 1, one in row 17, none elsewhere (CSR or PTCSR offsets)
    out_rows, out_cols = torch.tensor([1, 1, 1, 17]), torch.tensor([0, 5, 47, 3])
    vals = (torch.randn(4, generator=g)).half()
    col_vals = vals.view(torch.int16).to(torch.int64) << 16 | out_cols.to(torch.int16).to(
        torch.int64
    )
    col_vals = col_vals.to(torch.int32)
    if ptcsr:  # sparse_util.init_ptcsr: a block of 16 rows holds 16 × its rows' most outliers,
        # row r's k-th at 16·k + r % 16, zeros (column 0, +0) elsewhere
        blocks = []
        for b in range(M // 16):
            mine = [
                (r, cv)
                for r, cv in zip(out_rows.tolist(), col_vals.tolist(), strict=True)
                if r // 16 == b
            ]
            most = max([sum(r == row for r, _ in mine) for row in range(b * 16, b * 16 + 16)])
            lane, seen = [0] * (16 * most), {}
            for r, cv in mine:
                k = seen.get(r, 0)
                lane[16 * k + r % 16], seen[r] = cv, k + 1
            blocks.append(lane)
        col_vals = torch.tensor(blocks[0] + blocks[1], dtype=torch.int32)
        offsets = torch.tensor([0, len(blocks[0]), len(blocks[0]) + len(blocks[1])])
    else:
        counts = torch.bincount(out_rows, minlength=M)
        offsets = torch.cat([torch.zeros(1, dtype=torch.long), counts.cumsum(0)])
    dense = wp.float()
    dense.index_put_((out_rows, out_cols), vals.float(), accumulate=True)
    perm = torch.randperm(N, generator=g)
    w = torch.empty(M, N)
    w[:, perm] = dense.half().float()
    packed_perm = (perm[1::2] << 16 | perm[0::2]).to(torch.int32)
    tensors = {
        "proj.dense_weights": torch.tensor(words, dtype=torch.int64),
        "proj.row_offsets": offsets.to(torch.int32),
        "proj.col_vals": col_vals,
        "proj.in_perm": packed_perm,
    }
    return tensors, w


def _loaded(tensors):
    bias = torch.randn(M)
    ckpt = read_quantized({**tensors, "proj.bias": bias}, quantization_config=QCFG)
    dyn = ({0: torch.export.Dim.DYNAMIC},)
    ep = fxquant.load_quantized(
        One(M, N), ckpt, example_inputs=(torch.randn(3, N),), dynamic_shapes=dyn
    )
    return ckpt, bias, ep


@pytest.mark.parametrize("ptcsr", [False, True], ids=["csr", "ptcsr"])
def test_spqr_checkpoints_load_onto_the_weights_they_encode(ptcsr):
    tensors, want = _layer(ptcsr=ptcsr)
    ckpt, bias, ep = _loaded(tensors)
    assert ckpt.schemes == {"proj": Spqr()} and ckpt.shapes["proj.weight"] == (M, N)
    t = ckpt.weights["proj.weight"].tensors
    assert torch.equal(spqr.dequantize(*(t[c] for c in Spqr.constants)), want)
    x = torch.randn(5, N)
    ref = x @ want.t() + bias
    torch.testing.assert_close(ep.module()(x), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())
    torch.library.opcheck(
        torch.ops.fxquant.spqr_linear.default, (x, *(t[c] for c in Spqr.constants), bias)
    )


def test_the_lowerings_compute_the_reference():
    tensors, _ = _layer(1)
    _, _, ep = _loaded(tensors)
    lowered = lower(ep)
    targets = {str(n.target) for n in lowered.graph.nodes if n.op == "call_function"}
    assert not any(t.startswith("fxquant.") for t in targets), targets
    for m in (1, 6):
        x = torch.randn(m, N)
        assert sqnr(ep.module()(x), lowered.module()(x)) > 80
    # the CUDA lowering (a Triton GEMM) on this loaded layer: tests/test_kernels_spqr.py checks
    # it case by case under the interpreter; it sums K in another order, so fp32 rounding apart
    pytest.importorskip("triton")
    from fxquant.kernels.spqr import lower_spqr_linear

    t = read_quantized(tensors, quantization_config=QCFG).weights["proj.weight"].tensors
    x = torch.randn(4, N)
    args = [t[c] for c in Spqr.constants]
    want = spqr.spqr_linear(x, *args)
    torch.testing.assert_close(
        lower_spqr_linear(x, *args, None), want, rtol=1e-5, atol=1e-5 * want.abs().max().item()
    )


def test_bad_spqr_checkpoints_and_configs_say_what_is_wrong():
    tensors, _ = _layer()
    with pytest.raises(NotImplementedError, match="bits=4"):
        read_quantized(tensors, quantization_config={**QCFG, "bits": 4})
    shapes = {**QCFG, "shapes": {"proj.col_vals.shape": 7}}
    with pytest.raises(CheckpointError, match=r"'proj.col_vals' has shape \[4\], expected \[7\]"):
        read_quantized(tensors, quantization_config=shapes)
    with pytest.raises(CheckpointError, match="'proj.in_perm' is missing"):
        read_quantized(
            {k: v for k, v in tensors.items() if k != "proj.in_perm"}, quantization_config=QCFG
        )
    with pytest.raises(CheckpointError, match="row_offsets"):
        read_quantized(
            {**tensors, "proj.row_offsets": tensors["proj.row_offsets"][:5]},
            quantization_config=QCFG,
        )
    with pytest.raises(NotImplementedError, match="calibration"):
        fxquant.from_hf({"quant_method": "spqr"})
    with pytest.raises(ValueError, match="Spqr.bits=2"):
        Spqr(bits=2)


@pytest.mark.slow
def test_a_spqr_program_saves_and_packages(tmp_path):
    tensors, _ = _layer(2)
    _, _, ep = _loaded(tensors)
    path = tmp_path / "spqr.pt2"
    torch.export.save(ep, path)
    x = torch.randn(4, N)
    assert torch.equal(torch.export.load(path).module()(x), ep.module()(x))
    check_package_without_fxquant(ep, tmp_path, [torch.randn(m, N) for m in (1, 6)])
