"""GGUF files (llama.cpp) → fxquant constants, read through the ``gguf`` package.

Where it sits: the reader behind ``fxquant.checkpoints.read_quantized`` for ``.gguf`` paths.
GGUF stores each weight row by row in blocks along K (gguf-py ``quants.py``, llama.cpp
``ggml-quants.c``); what maps exactly:

- ``Q4_0``: blocks of 32, an fp16 ``d`` and 16 bytes of nibbles (low nibbles are elements 0-15,
  high nibbles 16-31), w = d · (q - 8): ``Int4WeightOnly(group_size=32)`` with u = q, z = 8,
  s = d, after re-packing the nibbles into fxquant's order (low nibble = even column). Bit exact.
- ``Q4_1``: w = d · q + m with a float minimum m per block of 32, and ``Q4_K``: super-blocks of
  256 whose 8 sub-blocks of 32 carry 6-bit scales and minimums, w = (d·sc) · q - dmin·m. Both
  are (q - z) · s with s = d (d·sc) and a *float* zero point z = -m / s:
  ``IntxWeightOnly(bits=4, group_size=32, zero_point="float")``. The codes and scales are the
  file's; z is rounded once to fp32, so a weight differs from gguf's d·q + m by fp32 rounding
  (a few ulp), not by any requantization. A block with s = 0 but m != 0 is refused.
- ``Q6_K``: super-blocks of 256: 128 bytes of low nibbles, 64 bytes of high bit pairs, 16 int8
  sub-block scales and an fp16 ``d``; each sub-block of 16 has w = d · sc · (q - 32) with q in
  [0, 63]: ``IntxWeightOnly(bits=6, group_size=16, symmetric=True)`` with u = q, z = 32,
  s = d · sc (negative or zero scales included). Bit exact: d · sc (11 + 7 significant bits,
  |sc| <= 128) and s · (q - 32) (18 + 5, |q - 32| <= 32) fit fp32's 24, so fxquant's
  (u - z) · s and gguf-py's fp32 dequantization are the same numbers.
- ``Q8_0``: blocks of 32, an fp16 ``d`` and 32 int8, w = d · q. fxquant's int8 has one scale
  per output row, so this maps (to ``Int8WeightOnly``) only when every block of each row has the
  same ``d``; otherwise it is refused (no grouped int8 format).
- ``F32`` / ``F16`` / ``BF16`` tensors (norms, embeddings, unquantized linears) load as they are.
- ``token_embd`` (the embedding) in any quantized type is decoded to fp32 by gguf-py: fxquant
  keeps embeddings in float (a tied ``lm_head`` then runs in float too).

Refused, with the reason in the error: the other K-quants and 5-bit types, and every type not
listed here. A tensor whose bytes do not fill its blocks raises ``CheckpointError`` naming it; a
file cut short inside the tensor data already fails in gguf-py's reader, before any tensor is
listed, so that ``CheckpointError`` names the file and gguf-py's reason.

llama.cpp's converter permutes the rows of Llama's q_proj and k_proj (its rotary pairs are
interleaved); the default name map undoes that on the quantized rows, exactly (a row
permutation moves each row's blocks with it).
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from fxquant.checkpoints.base import CheckpointError, LoadedCheckpoint, int_weight
from fxquant.core.config import Int8WeightOnly, QuantConfig
from fxquant.core.scheme import QuantizedWeight

__all__ = ["ExactPlan", "exact_plan", "llama_tensor_names", "read_gguf"]

_REFUSED = {
    "Q5_0": "5-bit values: fxquant has no 5-bit format",
    "Q5_1": "5-bit values: fxquant has no 5-bit format",
    "Q5_K": "5-bit values: fxquant has no 5-bit format",
    "Q2_K": "Q2_K's 2-bit values carry 4-bit scales and minimums per 16: fxquant's 2-bit "
    "groups are 32 to 256 wide (16 only for 6-bit codes)",
    "Q3_K": "Q3_K's 3-bit values carry 6-bit scales per 16: fxquant's 3-bit groups are 32 to 256 "
    "wide (16 only for 6-bit codes)",
}

_LLAMA = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def llama_tensor_names(name: str) -> str | None:
    """llama.cpp's tensor names → Hugging Face Llama names (None: dropped, e.g. rope_freqs)."""
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)\.(weight|bias)", name)
    if m:
        part = _LLAMA.get(m.group(2))
        return None if part is None else f"model.layers.{m.group(1)}.{part}.{m.group(3)}"
    m = re.fullmatch(r"(\w+)\.(weight|bias)", name)
    if m and m.group(1) in _LLAMA:
        return f"{_LLAMA[m.group(1)]}.{m.group(2)}"
    return None


def _unpermute_rows(n: int, n_head: int) -> torch.Tensor:
    """Row order that undoes llama.cpp's ``permute`` of q/k (transformers'
    ``reverse_permute_weights``): new row i = stored row index[i]."""
    idx = torch.arange(n)
    return idx.reshape(n_head, n // n_head // 2, 2).transpose(1, 2).reshape(n)


def read_gguf(
    path: str | Path,
    *,
    tensor_names: Callable[[str], str | None] | None = None,
    refused: dict[str, str] | None = None,
) -> LoadedCheckpoint:
    """``refused``: when a dict, a linear weight whose type has no exact fxquant form is left
    out and recorded there (model name → why) instead of raising ``NotImplementedError``."""
    try:
        import gguf
    except ImportError as e:  # pragma: no cover - an optional dependency
        raise ImportError("reading a .gguf file needs `pip install gguf`") from e
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint file {path} does not exist")
    try:
        reader = gguf.GGUFReader(str(path))
    except Exception as e:
        raise CheckpointError(
            f"{path} is not a readable GGUF file (corrupt or truncated?): {type(e).__name__}: {e}"
        ) from e
    arch = _field(reader, "general.architecture")
    heads = {"q": _field(reader, f"{arch}.attention.head_count")}
    heads["k"] = _field(reader, f"{arch}.attention.head_count_kv") or heads["q"]
    default = tensor_names is None
    names = tensor_names or llama_tensor_names
    if default and arch not in ("llama", None):
        raise NotImplementedError(
            f"GGUF architecture {arch!r}: the default name map is Llama's; pass "
            "tensor_names=callable(gguf_name) -> model name"
        )
    qt = gguf.GGMLQuantizationType
    out = LoadedCheckpoint(format="gguf")
    for t in reader.tensors:
        target = names(t.name)
        if target is None:
            continue
        kind = qt(t.tensor_type).name
        shape = tuple(int(v) for v in reversed(t.shape.tolist()))  # GGUF lists ne0 (K) first
        try:
            data = torch.from_numpy(t.data.copy())
        except Exception as e:
            raise CheckpointError(
                f"tensor {t.name!r} in {path} cannot be read (truncated?): {e}"
            ) from e
        if kind in ("F32", "F16", "BF16"):
            if kind == "BF16":
                data = data.view(torch.bfloat16)
            out.tensors[target] = data.reshape(shape)
            continue
        if t.name.startswith("token_embd."):
            # an embedding is looked up, not multiplied: fxquant keeps it in float, so its
            # blocks are decoded (gguf's own dequantizer: the file's values, not requantized)
            values = gguf.quants.dequantize(t.data, t.tensor_type)
            out.tensors[target] = torch.from_numpy(values.copy()).reshape(shape)
            continue
        if len(shape) != 2 or not target.endswith(".weight"):
            raise NotImplementedError(
                f"tensor {t.name!r}: quantized {kind} of shape {list(shape)} is not a linear weight"
            )
        if kind not in _BLOCK_BYTES:
            why = _REFUSED.get(kind, f"{kind} has no fxquant loader")
            if refused is not None:
                refused[target] = f"{kind}: {why}"
                continue
            raise NotImplementedError(f"tensor {t.name!r} is {kind}: {why}")
        n, k = shape
        per, nbytes = _BLOCK_BYTES[kind]
        if k % per or tuple(data.shape) != (n, k // per * nbytes):
            raise CheckpointError(
                f"tensor {t.name!r} ({kind}) has {list(data.shape)} bytes, "
                f"expected [{n}, {k // per * nbytes}] for [{n}, {k}]"
            )
        blocks = data.reshape(n, k // per, nbytes)
        module = target.removesuffix(".weight")
        rows = None
        if default:
            role = re.search(r"attn_([qk])\.weight$", t.name)
            if role and heads[role.group(1)]:
                rows = _unpermute_rows(n, int(heads[role.group(1)]))
        if kind == "Q8_0":
            d = _f16(blocks[..., :2])
            if not bool((d == d[:, :1]).all()):
                if refused is not None:
                    refused[target] = "Q8_0 with a scale per block of 32 (fxquant's int8: per row)"
                    continue
                raise NotImplementedError(
                    f"tensor {t.name!r} is Q8_0 with a different scale per block of 32: "
                    "fxquant's int8 schemes hold one scale per output row and there is no "
                    "grouped int8 format, so it cannot be loaded exactly"
                )
            q = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k)
            tensors = {"qweight": q, "scale": d[:, 0].contiguous()}
            scheme = Int8WeightOnly()
        else:
            decode, group_size, bits = _DECODE[kind]
            u, scale, zero = decode(blocks, n, k)
            if zero.is_floating_point():
                try:
                    zero = _float_zero(t.name, kind, scale, zero)
                except NotImplementedError as e:
                    if refused is None:
                        raise
                    refused[target] = f"{kind}: {e}"
                    continue
            scheme, weight = int_weight(t.name, u, scale, zero, group_size, bits=bits)
            tensors = weight.tensors
        if rows is not None:
            tensors = {name: v[rows].contiguous() for name, v in tensors.items()}
        out.add(module, scheme, QuantizedWeight(tensors, None), (n, k))
    for name, t in list(out.tensors.items()):
        if default and re.search(r"self_attn\.[qk]_proj\.(weight|bias)$", name):
            role = "q" if ".q_proj." in name else "k"
            if heads[role]:
                out.tensors[name] = t[_unpermute_rows(t.shape[0], int(heads[role]))]
    return out


# GGML type → (values per block, bytes per block) for the types that load
_BLOCK_BYTES = {
    "Q4_0": (32, 18),
    "Q8_0": (32, 34),
    "Q4_1": (32, 20),
    "Q4_K": (256, 144),
    "Q6_K": (256, 210),
}


def _f16(b: torch.Tensor) -> torch.Tensor:
    """[..., 2] bytes (little-endian fp16) → fp32 [...] (exact)."""
    return b.contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """[N, B, 16] bytes of a 32-block: element j in the low nibble, j + 16 in the high one."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1)


def _q4_0(blocks, n, k):  # w = d · (q - 8)
    d = _f16(blocks[..., :2])
    u = _nibbles(blocks[..., 2:]).reshape(n, k)
    return u, d, torch.full((n, k // 32), 8, dtype=torch.uint8)


def _q4_1(blocks, n, k):  # w = d · q + m, returned as (q, d, minimum m) for _float_zero
    d, m = _f16(blocks[..., :2]), _f16(blocks[..., 2:4])
    return _nibbles(blocks[..., 4:]).reshape(n, k), d, m


def _q4_k(blocks, n, k):
    """Super-blocks of 256: fp16 d and dmin, 12 bytes of 6-bit (scale, min) pairs for the 8
    sub-blocks of 32, then 4 × 32 bytes whose low / high nibbles are sub-blocks 2c / 2c + 1;
    w = d·sc·q - dmin·m (gguf-py's ``Q4_K.dequantize_blocks``)."""
    nb = k // 256
    d, dmin = _f16(blocks[..., :2]), _f16(blocks[..., 2:4])
    sc8 = blocks[..., 4:16].to(torch.int32).reshape(n, nb, 3, 4)
    lo, mi, hi = sc8[..., 0, :], sc8[..., 1, :], sc8[..., 2, :]
    sc = torch.cat([lo & 0x3F, (hi & 0x0F) | ((lo >> 2) & 0x30)], dim=-1)  # [N, nb, 8]
    mn = torch.cat([mi & 0x3F, (hi >> 4) | ((mi >> 2) & 0x30)], dim=-1)
    qs = blocks[..., 16:].reshape(n, nb, 4, 1, 32)
    u = torch.cat([qs & 0x0F, qs >> 4], dim=3).reshape(n, k)
    scale = (d[..., None] * sc.float()).reshape(n, k // 32)  # fp16 × 6-bit int: exact in fp32
    minimum = (dmin[..., None] * mn.float()).reshape(n, k // 32)
    return u, scale, -minimum  # w = s·q + (-minimum)


def _q6_k(blocks, n, k):
    """Super-blocks of 256 (gguf-py's ``Q6_K.dequantize_blocks``): ql (128 bytes), qh (64),
    16 int8 scales, fp16 d. Each half h of 128 values takes ql[64h:64h+64] (value 128h + 64s + i
    in the nibble s of byte i) and qh[32h:32h+32] (value 128h + 32t + i in the bit pair t of
    byte i); q = low | high << 4, w = d·sc_j·(q - 32) for the 16 values of sub-block j."""
    nb = k // 256
    ql = blocks[..., :128].reshape(n, nb, 2, 1, 64)
    low = torch.cat([ql & 0x0F, ql >> 4], dim=3)  # [N, nb, h, s, i]
    qh = blocks[..., 128:192].reshape(n, nb, 2, 1, 32)
    high = torch.cat([(qh >> (2 * t)) & 0x03 for t in range(4)], dim=3)  # [N, nb, h, t, i]
    u = (low.reshape(n, nb, 256) | (high.reshape(n, nb, 256) << 4)).reshape(n, k)
    sc = blocks[..., 192:208].contiguous().view(torch.int8).float()  # [N, nb, 16], signed
    d = _f16(blocks[..., 208:210])
    # fp16 × int8: exact in fp32, so this is gguf-py's fp32 d * scales to the bit
    scale = (d[..., None] * sc).reshape(n, k // 16)
    return u, scale, torch.full((n, k // 16), 32, dtype=torch.uint8)


# GGML type → (decoder to (u, scale, zero), group size, bits) for the grouped-integer types
_DECODE = {
    "Q4_0": (_q4_0, 32, 4),
    "Q4_1": (_q4_1, 32, 4),
    "Q4_K": (_q4_k, 32, 4),
    "Q6_K": (_q6_k, 16, 6),
}


def _float_zero(name: str, kind: str, scale: torch.Tensor, m: torch.Tensor) -> torch.Tensor:
    """w = s·q + m written as (q - z)·s: z = -m / s, a float zero point (fp32, rounded once)."""
    bad = (scale == 0) & (m != 0)
    if bool(bad.any()):
        raise NotImplementedError(
            f"tensor {name!r} ({kind}) has a block with scale 0 and minimum "
            f"{float(m[bad][0])}: a constant block (q - z)·s cannot express"
        )
    return torch.where(scale == 0, torch.zeros_like(m), -m / torch.where(scale == 0, 1, scale))


def _field(reader, key: str):
    f = reader.fields.get(key)
    if f is None:
        return None
    value = f.parts[f.data[0]]
    if value.dtype.kind == "u" and value.dtype.itemsize == 1 and len(value) > 1:
        return bytes(value).decode()
    return value.tolist()[0] if len(value) else None


# --------------------------------------------------------------------------------------------
# The CLI's GGUF path: the file's own blocks where the recipe asks for what the file stores
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ExactPlan:
    """What ``exact_plan`` decided: the config to quantize with, the GGUF's own constants by the
    program's weight names (for ``fxquant.quantize(..., weights=)``), and one line saying which
    layers carry the file's blocks and which are re-quantized from its dequantized values."""

    config: QuantConfig
    weights: dict[str, QuantizedWeight] = field(default_factory=dict)
    summary: str = ""


def exact_plan(path: str | Path, program, config: QuantConfig | None) -> ExactPlan:
    """Match a program exported from ``path`` (a ``.gguf`` that transformers dequantized to
    float) against the file's own quantized tensors.

    Where it sits: ``fxquant quantize model.gguf`` calls it between export and quantize.
    ``config=None`` means "the file's types": every layer the file quantizes keeps its blocks
    (``--recipe gguf``), every other linear stays float. Otherwise a layer takes the file's
    blocks when ``config`` asks for exactly the scheme they map to (Q4_1 is
    ``IntxWeightOnly(bits=4, group_size=32, zero_point="float")``), and is quantized from the
    dequantized float weight, as without this, when it asks for another one. A layer whose
    type has no exact form (Q5_K, Q8_0 with a scale per block) is quantized from float as the config
    says (with ``config=None``: kept in float), and the summary says so.
    """
    refused: dict[str, str] = {}
    ckpt = read_gguf(path, refused=refused)
    prefix = _prefix([*ckpt.weights, *refused], program.state_dict)
    ckpt = ckpt.with_prefix(prefix)
    if config is None:
        config = ckpt.config
    exact, other = Counter(), Counter()
    weights = {}
    for name, weight in ckpt.weights.items():
        module = name.removesuffix(".weight")
        stored = ckpt.schemes[module]
        if config.scheme_for(module)[0] == stored:
            weights[name] = weight
            exact[str(stored)] += 1
        else:
            other[str(stored)] += 1
    total = len(ckpt.weights) + len(refused)
    parts = [
        f"{Path(path).name}: {sum(exact.values())} of its {total} quantized linears carry the "
        "file's own blocks, exactly" + (f" ({_listed(exact)})" if exact else "")
    ]
    if other:
        parts.append(
            f"{sum(other.values())} re-quantized from the dequantized file: the config asks for "
            f"another scheme than the file's ({_listed(other)})"
        )
    for fate, why in _fates(refused, prefix, config).items():
        parts.append(f"{sum(why.values())} {fate}: no exact form ({_listed(why)})")
    return ExactPlan(config, weights, "; ".join(parts))


def _fates(refused: dict[str, str], prefix: str, config: QuantConfig) -> dict[str, Counter]:
    """The layers with no exact form, by what the config does with them, then by why."""
    out: dict[str, Counter] = {}
    for name, why in refused.items():
        scheme, _ = config.scheme_for(prefix + name.removesuffix(".weight"))
        fate = "kept in float" if scheme is None else "quantized from the dequantized file"
        out.setdefault(fate, Counter())[why] += 1
    return out


def _prefix(names: list[str], state) -> str:
    """The prefix the program puts before the checkpoint's names (``CausalLMWrapper`` and the
    KV-cache wrapper hold the model as a submodule)."""
    name = next(iter(names), None)
    if name is None or name in state:
        return ""
    hits = [k for k in state if k.endswith("." + name)]
    if len(hits) != 1:
        raise CheckpointError(f"the program has {len(hits)} weights named like {name!r}")
    return hits[0].removesuffix(name)


def _listed(counts: Counter) -> str:
    return ", ".join(f"{n} × {s}" for s, n in counts.most_common())
