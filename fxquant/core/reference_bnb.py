"""Reference math of the bitsandbytes formats, in plain torch: NF4 / FP4 4-bit weights
(``load_in_4bit``, with double quant of the block scales) and LLM.int8 (``load_in_8bit``).

Where it sits: beside ``fxquant.core.reference``, and the truth for the ``Bnb4WeightOnly`` and
``LLMInt8`` schemes. The scheme declarations quantize weights with the functions here
(``fxquant/core/schemes/bnb.py``); ``fxquant::bnb4_weight_only_linear`` and
``fxquant::llm_int8_linear`` run the linears here eagerly; the CPU lowering is these linears in aten
ops; the Triton kernels (``fxquant.kernels.bnb4_weight_only``, ``llm_int8``) are tested against
them.

The numerics are those of bitsandbytes itself (read from its source: ``functional.py``
``get_4bit_type`` / ``quantize_4bit`` / ``create_dynamic_map`` and the pure-PyTorch kernels of
``backends/default/ops.py``), so a config from ``fxquant.from_hf(BitsAndBytesConfig(...))``
quantizes to the same codes and scales bnb stores:

- 4-bit: the weight is flattened (row-major [N, K]) and cut into blocks of ``block_size``
  (the last one may be short); absmax per block (fp32); each value times ``1 / absmax``,
  clamped to [-1, 1], takes the index of the nearest of the 16 code values (the first index on
  a tie, as ``argmin``). Two indices per byte, the *first* element in the *high* nibble (bnb
  pads an odd count; fxquant takes even K only, so there is none). With K a multiple of the
  block (every real model), a block is a run of K inside one output row.
- double quant: the fp32 absmax vector minus its mean is quantized the same way in blocks of
  256 with bnb's signed 8-bit dynamic map; absmax = map[q] * nested_absmax + offset.
- LLM.int8: activations and weights are first put on the fp16 grid (bnb casts both to fp16;
  fxquant saturates at ±65504 instead of overflowing to inf); values with |x| >= threshold are
  outliers; their feature columns (over all tokens of the current input) are computed in float
  against the dequantized int8 weight columns, everything else as int8 per token × int8 per
  output channel, q = round(x * (127 / absmax)).

Departures, none of which moves a code on ordinary weights: bnb divides by a zero absmax (an
all-zero block or row gives NaN there), here it gives zeros; fp16 saturates instead of
overflowing; the int8 GEMM is rescaled by exactly 1 / 127² (bnb's pure-PyTorch backend writes
the constant as 6.200124e-05, 1.8e-5 relative away from it).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fxquant.core.reference import _finish

QUANT_TYPES = ("nf4", "fp4")
NESTED_BLOCK_SIZE = 256  # bnb's block for the double quant of the absmax values
FP16_MAX = 65504.0
_CHUNK = 1 << 18  # elements per nearest-code search (bounds the [chunk, codes] distance matrix)

# bnb get_4bit_type("nf4"): the NormalFloat levels of QLoRA, already in [-1, 1].
_NF4 = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)
# bnb get_4bit_type("fp4"): sign bit, then 2 exponent and 1 mantissa bits, in bnb's own order
# (index 3 = 12 is the largest); bnb divides the table by its absmax (12) in fp32.
_FP4_UNSCALED = (0.0, 0.0625, 8.0, 12.0, 4.0, 6.0, 2.0, 3.0)


def code_4bit(quant_type: str) -> Tensor:
    """The 16 fp32 values a 4-bit index stands for (bnb's ``quant_map``)."""
    if quant_type == "nf4":
        return torch.tensor(_NF4, dtype=torch.float32)
    if quant_type == "fp4":
        pos = torch.tensor(_FP4_UNSCALED, dtype=torch.float32)
        table = torch.cat([pos, -pos])  # index 8 is -0.0, as in bnb
        return table / table.abs().max()
    raise ValueError(f"quant_type={quant_type!r} is not supported; allowed: {QUANT_TYPES}")


def dynamic_map() -> Tensor:
    """bnb's signed 8-bit dynamic map (``create_dynamic_map()``), the code of double quant.

    For each decade 10**(i-6), i = 0..6, the midpoints of 2**i equal steps of [0.1, 1] (fp32),
    both signs; plus 0 and 1.0; sorted. 256 values in [-0.993, 1].
    """
    values = [0.0, 1.0]
    for i in range(7):
        edges = torch.linspace(0.1, 1, 2**i + 1, dtype=torch.float32)
        mids = (edges[:-1] + edges[1:]) / 2.0
        decade = 10 ** (i - 6)  # a Python number, as bnb multiplies with (1e-06 … 1)
        values += (decade * mids).tolist() + ((-decade) * mids).tolist()
    return torch.tensor(sorted(values), dtype=torch.float32)


def _blocks(flat: Tensor, block_size: int) -> Tensor:
    """[n] → [ceil(n/b), b], the short last block zero-padded (zeros change no absmax)."""
    nb = -(-flat.numel() // block_size)
    return F.pad(flat, (0, nb * block_size - flat.numel())).reshape(nb, block_size)


def _nearest(scaled: Tensor, code: Tensor) -> Tensor:
    """Index (uint8) of the nearest code value for each element; first index on a tie."""
    out = [
        (part[:, None] - code).abs().argmin(dim=-1).to(torch.uint8) for part in scaled.split(_CHUNK)
    ]
    return torch.cat(out) if out else scaled.new_empty(0, dtype=torch.uint8)


def quantize_blockwise(t: Tensor, *, code: Tensor, block_size: int) -> tuple[Tensor, Tensor]:
    """Any float tensor → (indices uint8 [n] into ``code``, absmax fp32 [ceil(n/b)]), bnb's
    blockwise rule on the flattened tensor."""
    flat = t.reshape(-1).float()
    blocks = _blocks(flat, block_size)
    absmax = blocks.abs().amax(dim=1)
    # bnb multiplies by 1 / absmax (NaN for an all-zero block); zero blocks stay zero here
    recip = torch.where(absmax > 0, 1 / absmax, torch.zeros_like(absmax))
    scaled = (blocks * recip[:, None]).clamp(-1, 1).reshape(-1)[: flat.numel()]
    return _nearest(scaled, code), absmax


def dequantize_blockwise(idx: Tensor, absmax: Tensor, code: Tensor, *, block_size: int) -> Tensor:
    """Inverse of ``quantize_blockwise``: fp32 [n] (n = idx.numel())."""
    n = idx.numel()
    vals = code[idx.reshape(-1).long()]
    return (_blocks(vals, block_size) * absmax[:, None]).reshape(-1)[:n]


def pack_4bit(idx: Tensor) -> Tensor:
    """[n] indices in [0, 15], n even → [n/2] uint8, first element in the high nibble (bnb)."""
    return (idx[0::2] << 4) | idx[1::2]


def unpack_4bit(packed: Tensor) -> Tensor:
    """[n/2] uint8 → [n] indices (uint8)."""
    return torch.stack([packed >> 4, packed & 0x0F], dim=-1).reshape(-1)


def quantize_4bit(
    w: Tensor, *, quant_type: str, block_size: int, double_quant: bool
) -> dict[str, Tensor]:
    """W [N, K] → the constants of ``fxquant::bnb4_weight_only_linear``, in its argument order:

    - ``qweight`` uint8 [N, K/2]: packed indices of the flattened W, bnb's flat ``weight``
      viewed as N rows (K must be even, so that no byte spans two rows);
    - ``absmax`` fp32 [ceil(N·K/b)], or uint8 with double quant;
    - ``quant_map`` fp32 [16]: the code table;
    - with double quant: ``nested_absmax`` fp32 [ceil(blocks/256)], ``nested_quant_map`` fp32
      [256] (the dynamic map) and ``nested_offset`` fp32 [1] (the mean of the absmax values).
    """
    if w.dim() != 2 or w.shape[1] % 2:
        raise ValueError(
            f"bnb 4-bit weights must be [N, K] with K even (two values per byte along K); got "
            f"shape {list(w.shape)}"
        )
    code = code_4bit(quant_type)
    idx, absmax = quantize_blockwise(w, code=code, block_size=block_size)
    packed = pack_4bit(idx).reshape(w.shape[0], w.shape[1] // 2)
    out = {"qweight": packed, "absmax": absmax, "quant_map": code}
    if double_quant:
        offset = absmax.mean().reshape(1)
        nested_code = dynamic_map()
        q_abs, nested_absmax = quantize_blockwise(
            absmax - offset, code=nested_code, block_size=NESTED_BLOCK_SIZE
        )
        out.update(
            absmax=q_abs,
            nested_absmax=nested_absmax,
            nested_quant_map=nested_code,
            nested_offset=offset,
        )
    return out


def bnb4_absmax(
    absmax: Tensor,
    nested_absmax: Tensor | None,
    nested_quant_map: Tensor | None,
    nested_offset: Tensor | None,
) -> Tensor:
    """The fp32 block absmax values, undoing double quant when it was applied."""
    if nested_absmax is None:
        return absmax
    if nested_quant_map is None or nested_offset is None:
        raise ValueError("double quant needs nested_absmax, nested_quant_map and nested_offset")
    scale = dequantize_blockwise(
        absmax, nested_absmax, nested_quant_map, block_size=NESTED_BLOCK_SIZE
    )
    return scale + nested_offset


def dequantize_4bit(
    qweight: Tensor,
    absmax: Tensor,
    quant_map: Tensor,
    nested_absmax: Tensor | None = None,
    nested_quant_map: Tensor | None = None,
    nested_offset: Tensor | None = None,
    *,
    block_size: int,
) -> Tensor:
    """The constants of ``quantize_4bit`` → W fp32 [N, K]."""
    rows, k = qweight.shape[0], 2 * qweight.shape[1]
    scales = bnb4_absmax(absmax, nested_absmax, nested_quant_map, nested_offset)
    idx = unpack_4bit(qweight.reshape(-1))
    w = dequantize_blockwise(idx, scales, quant_map, block_size=block_size)
    return w.reshape(rows, k)


def bnb4_weight_only_linear(
    x,
    qweight,
    absmax,
    quant_map,
    nested_absmax=None,
    nested_quant_map=None,
    nested_offset=None,
    bias=None,
    *,
    block_size: int,
):
    """x [..., K] · the 4-bit W [N, K] (dequantized in fp32; bnb's default compute dtype)."""
    w = dequantize_4bit(
        qweight,
        absmax,
        quant_map,
        nested_absmax,
        nested_quant_map,
        nested_offset,
        block_size=block_size,
    )
    return _finish(x.float() @ w.t(), bias, x.dtype)


# --------------------------------------------------------------------------------------------
# LLM.int8: int8 per token × int8 per output channel, outlier feature columns in float
# --------------------------------------------------------------------------------------------


def to_fp16_grid(t: Tensor) -> Tensor:
    """t rounded to fp16 (bnb casts LLM.int8 inputs and weights to fp16), as fp32; saturating
    at ±65504 where bnb would overflow to inf. The same values as ``.half().float()``.

    Written as arithmetic on the fp32 bits, not as a cast: Inductor drops a float → fp16 →
    float round trip inside a fused kernel (``emulate_precision_casts`` is off by default),
    which would move the outlier test and the int8 rounding off bnb's values once compiled.
    """
    t = t.float().clamp(-FP16_MAX, FP16_MAX)
    bits = t.view(torch.int32)
    # normal fp16 range: round the 23-bit mantissa to 10 bits, half to even, on the bit
    # pattern (a carry moves into the exponent, as it should); the sign bit is untouched
    normal = ((bits + 0xFFF + ((bits >> 13) & 1)) & -0x2000).view(torch.float32)
    # below 2**-14 fp16 is subnormal: multiples of 2**-24 (scaling by 2**24 is exact)
    subnormal = torch.round(t * 2.0**24) * 2.0**-24
    return torch.where(t.abs() < 2.0**-14, subnormal, normal)


def _int8_rows(t: Tensor, absmax: Tensor) -> Tensor:
    """round(t * (127 / absmax)) per row, bnb's expression (``127.0 / absmax`` is a reciprocal
    times 127 in torch, and bnb rounds exactly that); a zero row stays zero."""
    recip = torch.where(absmax > 0, 127.0 / absmax, torch.zeros_like(absmax))
    return torch.round(t * recip[..., None]).to(torch.int8)


def quantize_llm_int8_weight(w: Tensor) -> tuple[Tensor, Tensor]:
    """W [N, K] → (CB int8 [N, K], SCB fp32 [N]): bnb's ``int8_vectorwise_quant`` of the fp16
    weight. SCB is the row's absmax (not divided by 127), as bnb stores it."""
    wh = to_fp16_grid(w)
    scb = wh.abs().amax(dim=1)
    return _int8_rows(wh, scb), scb


def quantize_llm_int8_activation(x2: Tensor, *, threshold: float) -> tuple[Tensor, Tensor, Tensor]:
    """x [M, K] → (q int8 [M, K], row absmax fp32 [M], outlier columns bool [K]).

    An element with |x| >= threshold (on the fp16 grid) is an outlier: it is left out of its
    row's absmax and quantized to 0, and its whole column is zeroed in q (those columns are
    computed in float). threshold 0: no outliers. The column set is a mask, not an index list,
    so every shape stays static and the op exports (bnb's ``argwhere`` has a data-dependent
    length).
    """
    xh = to_fp16_grid(x2)
    if threshold > 0:
        is_outlier = xh.abs() >= threshold
        cols = is_outlier.any(dim=0)
        xh = torch.where(is_outlier, torch.zeros_like(xh), xh)
    else:
        cols = torch.zeros(x2.shape[-1], dtype=torch.bool, device=x2.device)
    absmax = xh.abs().amax(dim=-1)
    q = _int8_rows(xh, absmax)
    # bnb zeroes outlier columns for rows > 1 only; with one row the column holds just the
    # outlier, already zero, so zeroing always is the same
    q = torch.where(cols, torch.zeros_like(q), q)
    return q, absmax, cols


def llm_int8_linear(x, weight, absmax, bias=None, *, threshold: float):
    """x [..., K] · LLM.int8 W (CB int8 [N, K], SCB fp32 [N]) → [..., N] in x's dtype.

    y = (q · CBᵀ) · row_absmax · SCB / 127² + x[:, outlier cols] · (CB · SCB / 127)[:, cols]ᵀ;
    the second term uses x as given (not fp16-rounded) and the dequantized int8 weight, as bnb
    does (``int8_mixed_scaled_mm``).
    """
    k = x.shape[-1]
    n = weight.shape[0]
    x2 = x.reshape(-1, k)
    q, row_absmax, cols = quantize_llm_int8_activation(x2, threshold=threshold)
    y = (q.float() @ weight.float().t()) * (row_absmax[:, None] * absmax) * (1.0 / (127 * 127))
    if threshold > 0:
        # outlier columns only, as a mask multiply: a static shape for export (see above)
        x_out = torch.where(cols, x2.float(), torch.zeros_like(x2, dtype=torch.float32))
        y = y + (x_out @ weight.float().t()) * (absmax * (1.0 / 127))
    return _finish(y, bias, x.dtype).reshape(*x.shape[:-1], n)
