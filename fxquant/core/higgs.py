"""Reference math of HIGGS (Malinovskii et al., 2024, "Pushing the Limits of Large Language Model
Quantization via the Linearity Theorem"; transformers' ``HiggsConfig``): a Hadamard rotation of
each block of weights, then vector quantization onto a grid that is MSE-optimal for the standard
Gaussian.

Where it sits: beside ``fxquant.core.reference``. The scheme ``Higgs``
(``fxquant/core/schemes/higgs.py``) quantizes weights with it; ``fxquant::higgs_linear`` runs
:func:`higgs_linear` as its eager kernel; the CPU lowering compiles it with Inductor and the
Triton kernel (``fxquant.kernels.higgs``) is tested against it.

**Quantization** (transformers' ``quantize_with_higgs``, which HiggsConfig runs): K is padded with
zeros to a multiple of the rotation size h (``hadamard_size``). Each block b of h values of a
weight row is multiplied by the ±1 Sylvester Hadamard matrix H and divided by its L2 norm, which
makes its entries ~N(0, 1); consecutive pairs (p = 2) or single values (p = 1) are replaced by
the index of the nearest point of the grid G (2^(p·bits) points; ties to the lower index); the
block keeps s = ‖b‖ / √h. An all-zero block gets s = 0 (transformers divides by its zero norm).

**Dequantization** stays in the rotated basis: ŵ = G[code]·s is w·Ĥ with Ĥ = H / √h orthonormal
and symmetric, so y = x·wᵀ = (x·Ĥ)·ŵᵀ per block: the activation is rotated by the same Ĥ (padded
with zeros like K) and multiplied by the decoded weight, with fp32 accumulation. The
``group_size`` of ``HiggsConfig`` is the storage group of its GPU kernel (FLUTE), whose scales
repeat each block's s; it does not change the numerics.

**Grids** (``higgs_grids.json``): the method's tables as its authors ship them (transformers
5.25, ``integrations/higgs.py``), for p = 1 with 4, 8, 16 points and p = 2 with 16, 64, 256;
p = 1 are the Lloyd-Max quantizers of N(0, 1), which tests/test_higgs.py recomputes.
"""

from __future__ import annotations

import functools
import json
import math
from pathlib import Path

import torch
from torch import Tensor

from fxquant.core.reference import EPS, _finish, sylvester_hadamard

HIGGS_BITS = (2, 3, 4)
HIGGS_P = (1, 2)
HIGGS_GROUP_SIZES = (64, 128, 256)


@functools.cache
def _tables() -> dict[str, list]:
    return json.loads((Path(__file__).with_name("higgs_grids.json")).read_text())["grids"]


def grid(p: int, bits: int) -> Tensor:
    """The HIGGS grid of 2^(p·bits) points in p dimensions, fp32 [2^(p·bits), p]."""
    key = f"{p}x{2 ** (p * bits)}"
    tables = _tables()
    if key not in tables:
        raise ValueError(
            f"HIGGS has no grid for p={p}, bits={bits}; allowed: p in {HIGGS_P}, bits in "
            f"{HIGGS_BITS} (p = 2 with 2 to 4 bits, p = 1 with 2 to 4 bits)"
        )
    return torch.tensor(tables[key], dtype=torch.float32)


def rotation(size: int) -> Tensor:
    """Ĥ = H / √size, fp32 [size, size]: orthonormal and symmetric."""
    return sylvester_hadamard(size) / math.sqrt(size)


def _pad(t: Tensor, multiple: int) -> Tensor:
    k = t.shape[-1]
    return torch.nn.functional.pad(t, (0, -(-k // multiple) * multiple - k))


def quantize(w: Tensor, *, bits: int, p: int, hadamard_size: int) -> tuple[Tensor, Tensor]:
    """W [N, K] → (codes uint8 [N, Kp/p], block scales fp32 [N, Kp/h]), Kp = K padded to h."""
    g = grid(p, bits)
    h = hadamard_size
    blocks = _pad(w.float(), h).unflatten(-1, (-1, h))  # [N, B, h]
    norms = torch.linalg.vector_norm(blocks, dim=-1)  # [N, B]
    r = (blocks @ sylvester_hadamard(h)) / norms.clamp(min=EPS)[..., None]
    pts = r.unflatten(-1, (-1, p))  # [N, B, h/p, p]
    codes = torch.argmax(2 * pts @ g.t() - g.pow(2).sum(-1), dim=-1)  # the nearest point
    return codes.flatten(1).to(torch.uint8), norms / math.sqrt(h)


def dequantize(codes: Tensor, scale: Tensor, g: Tensor, *, hadamard_size: int) -> Tensor:
    """The stored weight → ŵ in the rotated basis, fp32 [N, Kp]."""
    n = codes.shape[0]
    values = g.float()[codes.long()].reshape(n, -1, hadamard_size)  # [N, B, h]
    return (values * scale.float()[..., None]).flatten(1)


def rotate(x: Tensor, hadamard_size: int) -> Tensor:
    """x [..., K] → x·Ĥ per block of h (padded with zeros to a multiple of h), fp32."""
    xb = _pad(x.float(), hadamard_size).unflatten(-1, (-1, hadamard_size))
    return (xb @ rotation(hadamard_size)).flatten(-2)


def unrotate(t: Tensor, hadamard_size: int, k: int) -> Tensor:
    """Rotated [N, Kp] back to the original basis, the first k columns (for the report)."""
    tb = t.float().unflatten(-1, (-1, hadamard_size))
    return (tb @ rotation(hadamard_size)).flatten(-2)[..., :k]


def higgs_linear(
    x: Tensor,
    weight: Tensor,
    scale: Tensor,
    grid: Tensor,
    bias: Tensor | None = None,
    *,
    hadamard_size: int,
) -> Tensor:
    """x [..., K] rotated per block · the decoded rotated weight (codes [N, Kp/p] into
    ``grid`` [2^(p·bits), p], block scales [N, Kp/h]) + bias, fp32 accumulation."""
    w = dequantize(weight, scale, grid, hadamard_size=hadamard_size)
    return _finish(rotate(x, hadamard_size) @ w.t(), bias, x.dtype)
