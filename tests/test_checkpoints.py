"""Pre-quantized checkpoints → fxquant constants, and fxquant → compressed-tensors.

Each loader is checked on tensors made by the producing library where it installs here
(compressed-tensors' own compressors, gguf-py's quantizers), otherwise on tensors built to the
published layout: the loaded constants dequantize to exactly the library's dequantized weight,
and the loaded program's output equals the reference op applied to that weight.
"""

from __future__ import annotations

import json

import pytest
import torch
from torch import nn

import fxquant
from fxquant.checkpoints import CheckpointError, read_quantized
from fxquant.core import reference as ref
from fxquant.core import reference_lowbit as ref_lowbit
from fxquant.core import reference_mx as ref_mx
from fxquant.core.config import (
    MXFP4,
    Float8Block,
    Float8Dynamic,
    Float8Static,
    Float8WeightOnly,
    Int4WeightOnly,
    Int8DynamicActivation,
    Int8WeightOnly,
    IntxWeightOnly,
)

N, K = 64, 96


class One(nn.Module):
    """The skeleton: one linear with a bias (a plain tensor the checkpoint must supply)."""

    def __init__(self, n: int = N, k: int = K) -> None:
        super().__init__()
        self.proj = nn.Linear(k, n)
        nn.init.zeros_(self.proj.weight)  # the skeleton's values must never matter
        nn.init.zeros_(self.proj.bias)

    def forward(self, x):
        return self.proj(x)


def dequantize(scheme, c: dict[str, torch.Tensor], n: int, k: int) -> torch.Tensor:
    """fxquant's constants → the fp32 weight they stand for (the reference math)."""
    if isinstance(scheme, IntxWeightOnly):
        w = ref_lowbit.dequantize_intx_grouped(
            c["qweight"], c["scale"], c["zero"], bits=scheme.bits, group_size=scheme.group_size
        )
        return w[:, :k]
    if isinstance(scheme, Int4WeightOnly):
        w = ref.dequantize_int4_grouped(
            c["qweight"], c["scale"], c["zero"], group_size=scheme.group_size
        )
        return w[:, :k]
    if isinstance(scheme, MXFP4):
        return ref_mx.dequantize_mxfp4_weight(c["qweight"], c["scale"])
    if isinstance(scheme, Float8Block):
        b = scheme.block_size
        return c["qweight"].float() * ref.expand_block_scale(
            c["scale"], rows=n, cols=k, block_size=b
        )
    s = c["scale"]
    return c["qweight"].float() * (s[:, None] if s.numel() == n and n > 1 else s)


def reference_linear(scheme, x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor):
    """The scheme's op on a given float weight: activation quantized as the scheme says."""
    if isinstance(scheme, Int8DynamicActivation):
        xq, xs = ref.quantize_int8_per_token(x)
        x = xq.float() * xs
    elif isinstance(scheme, Float8Dynamic):
        fn = ref.quantize_fp8_per_token if scheme.per_row else ref.quantize_fp8_per_tensor
        xq, xs = fn(x)
        x = xq.float() * xs
    elif isinstance(scheme, Float8Block):
        xq, xs = ref.quantize_fp8_groups(x, group_size=scheme.block_size)
        x = xq.float() * ref.expand_group_scale(xs, cols=x.shape[-1], group_size=scheme.block_size)
    elif isinstance(scheme, Float8Static):
        xs = torch.tensor([scheme.activation_scale])
        x = ref.quantize_fp8_static(x, xs).float() * xs
    return x @ w.t() + bias


def check_loaded(ckpt_tensors, qcfg, want_w, want_scheme, *, n=N, k=K):
    """Read, compare constants with the library's dequantized weight, load, run, compare."""
    ckpt = read_quantized(ckpt_tensors, quantization_config=qcfg)
    assert ckpt.schemes == {"proj": want_scheme}
    got_w = dequantize(want_scheme, ckpt.weights["proj.weight"].tensors, n, k)
    torch.testing.assert_close(got_w, want_w.float(), rtol=0, atol=0)
    torch.manual_seed(1)
    x = torch.randn(3, k)
    ep = fxquant.load_quantized(One(n, k), ckpt, example_inputs=(x,))
    row = fxquant.report(ep).rows[0]
    assert row["status"] == "quantized" and row["weights"] == "given"
    bias = ckpt_tensors["proj.bias"]
    torch.testing.assert_close(
        ep.module()(x), reference_linear(want_scheme, x, want_w.float(), bias)
    )
    return ep


# --------------------------------------------------------------------------------------------
# compressed-tensors, produced by the library's own compressors
# --------------------------------------------------------------------------------------------


def ct_compress(w, weights, acts=None, fmt="naive-quantized", module="proj"):
    """(checkpoint tensors, quantization_config, dequantized weight) from compressed-tensors:
    its qparams rule (calculate_qparams) and its compressor, exactly as llm-compressor saves."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme
    from compressed_tensors.quantization.utils import calculate_qparams

    scheme = QuantizationScheme(
        targets=["Linear"],
        weights=QuantizationArgs(**weights),
        input_activations=None if acts is None else QuantizationArgs(**acts),
    )
    a = scheme.weights
    n, k = w.shape
    if a.strategy == "channel":
        mn, mx = w.amin(1, keepdim=True), w.amax(1, keepdim=True)
    elif a.strategy == "group":
        wg = w.reshape(n, -1, a.group_size)
        mn, mx = wg.amin(-1), wg.amax(-1)
    elif a.strategy == "tensor":
        mn, mx = w.amin().reshape(1), w.amax().reshape(1)
    else:  # block
        b = a.block_structure[0]
        tiles = w.reshape(n // b, b, k // b, b)
        mn, mx = tiles.amin(dim=(1, 3)), tiles.amax(dim=(1, 3))
    scale, zp = calculate_qparams(mn, mx, a)
    sd = {"weight": w, "weight_scale": scale, "weight_zero_point": zp}
    compressor = BaseCompressor.get_value_from_registry(fmt)
    comp = compressor.compress(sd, scheme)
    deq = compressor.decompress(comp, scheme)["weight"]
    tensors = {f"{module}.{name}": t for name, t in comp.items()}
    qcfg = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": json.loads(scheme.model_dump_json())},
        "ignore": ["lm_head"],
    }
    return tensors, qcfg, deq


_FP8 = {"num_bits": 8, "type": "float"}
_CT_CASES = {
    "int8-channel": (
        {"num_bits": 8, "type": "int", "strategy": "channel"},
        None,
        "naive-quantized",
        Int8WeightOnly(),
    ),
    "w8a8-token": (
        {"num_bits": 8, "type": "int", "strategy": "channel"},
        {"num_bits": 8, "type": "int", "strategy": "token", "dynamic": True},
        "int-quantized",
        Int8DynamicActivation(),
    ),
    "w8a16-packed": (
        {"num_bits": 8, "type": "int", "strategy": "channel"},
        None,
        "pack-quantized",
        Int8WeightOnly(),
    ),
    "int4-g32-sym": (
        {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32},
        None,
        "pack-quantized",
        Int4WeightOnly(group_size=32, symmetric=True),
    ),
    "int4-g32-asym": (
        {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "symmetric": False},
        None,
        "pack-quantized",
        Int4WeightOnly(group_size=32, symmetric=False),
    ),
    "int4-channel": (
        {"num_bits": 4, "type": "int", "strategy": "channel"},
        None,
        "pack-quantized",
        Int4WeightOnly(group_size=32, symmetric=True),
    ),
    "int3-g32-sym": (
        {"num_bits": 3, "type": "int", "strategy": "group", "group_size": 32},
        None,
        "pack-quantized",
        IntxWeightOnly(bits=3, group_size=32, symmetric=True),
    ),
    "int2-g96-asym": (  # a group of 96 is split into fxquant groups of 32
        {"num_bits": 2, "type": "int", "strategy": "group", "group_size": 96, "symmetric": False},
        None,
        "pack-quantized",
        IntxWeightOnly(bits=2, group_size=32, symmetric=False),
    ),
    "int6-g16-sym": (  # GGUF Q6_K's grid, as compressed-tensors packs it
        {"num_bits": 6, "type": "int", "strategy": "group", "group_size": 16},
        None,
        "pack-quantized",
        IntxWeightOnly(bits=6, group_size=16, symmetric=True),
    ),
    "fp8-channel-wo": (
        {**_FP8, "strategy": "channel"},
        None,
        "naive-quantized",
        Float8WeightOnly(),
    ),
    "fp8-dynamic": (
        {**_FP8, "strategy": "channel"},
        {**_FP8, "strategy": "token", "dynamic": True},
        "float-quantized",
        Float8Dynamic(granularity="row"),
    ),
    "fp8-tensor": (
        {**_FP8, "strategy": "tensor"},
        {**_FP8, "strategy": "tensor", "dynamic": True},
        "float-quantized",
        Float8Dynamic(granularity="tensor"),
    ),
    "fp8-block": (
        {**_FP8, "strategy": "block", "block_structure": [32, 32]},
        {**_FP8, "strategy": "group", "group_size": 32, "dynamic": True},
        "float-quantized",
        Float8Block(block_size=32),
    ),
}


@pytest.mark.parametrize("case", list(_CT_CASES))
def test_compressed_tensors_checkpoints_load_exactly(case):
    weights, acts, fmt, scheme = _CT_CASES[case]
    torch.manual_seed(0)
    w = torch.randn(N, K)
    tensors, qcfg, deq = ct_compress(w, weights, acts, fmt)
    tensors["proj.bias"] = torch.randn(N)
    check_loaded(tensors, qcfg, deq, scheme)


# --------------------------------------------------------------------------------------------
# fxquant → compressed-tensors → back
# --------------------------------------------------------------------------------------------


def test_save_compressed_tensors_is_read_by_the_library_and_loads_back(tmp_path):
    """Every scheme with a compressed-tensors form is written, decompressed by the library's own
    dequantizer to exactly fxquant's weights, and loads back into the same program."""
    from compressed_tensors.entrypoints.convert.converters.ct_dequantizer import (
        CompressedTensorsDequantizer,
    )
    from safetensors.torch import load_file

    from conftest import TinyLlama

    torch.manual_seed(0)
    model = TinyLlama(layers=2).eval()  # layers.1 takes the default: symmetric int4
    overrides = {
        r"layers\.0\.q_proj": Int8WeightOnly(),
        r"layers\.0\.k_proj": Float8Dynamic(granularity="row"),
        r"layers\.0\.v_proj": Float8Block(block_size=32),
        r"layers\.0\.o_proj": Int8DynamicActivation(),
        r"layers\.0\.gate_proj": Int4WeightOnly(group_size=32, symmetric=False),
        r"layers\.0\.up_proj": Float8WeightOnly(),
        r"layers\.0\.down_proj": IntxWeightOnly(bits=3, group_size=32),
        r"layers\.1\.down_proj": IntxWeightOnly(bits=6, group_size=16, symmetric=True),
    }
    config = fxquant.QuantConfig(
        scheme=Int4WeightOnly(group_size=64, symmetric=True), overrides=overrides
    )
    ids = torch.randint(0, 96, (2, 5))
    qep = fxquant.quantize(model, config, example_inputs=(ids,))
    out = fxquant.save_compressed_tensors(qep, tmp_path / "ckpt", model_config={"vocab_size": 96})
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]

    tensors = load_file(str(out / "model.safetensors"))
    deq = CompressedTensorsDequantizer(out, dtype=torch.float32).process(dict(tensors))
    ckpt = read_quantized(out)
    assert len(ckpt.schemes) == 14
    assert ckpt.schemes["layers.0.down_proj"] == IntxWeightOnly(bits=3, group_size=32)
    assert ckpt.schemes["layers.1.down_proj"] == IntxWeightOnly(
        bits=6, group_size=16, symmetric=True
    )
    for module, scheme in ckpt.schemes.items():
        n, k = ckpt.shapes[f"{module}.weight"]
        mine = dequantize(
            scheme,
            {c: qep.state_dict[f"{module}.{c}"] for c in ckpt.weights[f"{module}.weight"].tensors},
            n,
            k,
        )
        torch.testing.assert_close(deq[f"{module}.weight"], mine, rtol=0, atol=0)
    assert ckpt.schemes["layers.0.gate_proj"] == Int4WeightOnly(group_size=32, symmetric=False)
    assert torch.equal(deq["embed_tokens.weight"], model.embed_tokens.weight.detach())

    skeleton = TinyLlama(layers=2)
    back = fxquant.load_quantized(skeleton, out, example_inputs=(ids,))
    torch.testing.assert_close(back.module()(ids), qep.module()(ids), rtol=0, atol=0)


# --------------------------------------------------------------------------------------------
# DeepSeek-style FP8 blocks, GPTQ, AWQ: files built to the published layouts; the dequantizers
# of compressed-tensors' converters (FP8BlockDequantizer, AutoAWQConverter) read them too.
# --------------------------------------------------------------------------------------------


def test_deepseek_fp8_blocks_load_exactly():
    from compressed_tensors.entrypoints.convert.converters.fp8block_dequantizer import (
        FP8BlockDequantizer,
    )

    torch.manual_seed(0)
    n, k, b = 80, 96, 32  # 80 rows: a short last block row, as DeepSeek allows
    w = torch.randn(n, k)
    q, s = ref.quantize_fp8_blocks(w, block_size=b)  # DeepSeek's weight_quant: amax / 448 tiles
    tensors = {"proj.weight": q, "proj.weight_scale_inv": s, "proj.bias": torch.randn(n)}
    qcfg = {
        "quant_method": "fp8",
        "fmt": "e4m3",
        "activation_scheme": "dynamic",
        "weight_block_size": [b, b],
    }
    deq = FP8BlockDequantizer(
        targets=["Linear"], weight_block_size=(b, b), dtype=torch.float32
    ).process(dict(tensors))["proj.weight"]
    check_loaded(tensors, qcfg, deq, Float8Block(block_size=b), n=n, k=k)
    with pytest.raises(NotImplementedError, match="activation_scheme='static'"):
        read_quantized(tensors, quantization_config={**qcfg, "activation_scheme": "static"})


def _pack_rows(v: torch.Tensor, bits: int) -> torch.Tensor:
    """AutoGPTQ's pack loop: consecutive rows of ``v`` into one int32 row, lowest bits first."""
    per = 32 // bits
    out = torch.zeros(v.shape[0] // per, v.shape[1], dtype=torch.int64)
    for i in range(per):
        out |= v[i::per].to(torch.int64) << (bits * i)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


def awq_pack(v: torch.Tensor) -> torch.Tensor:
    """AutoAWQ's WQLinear_GEMM.from_linear: eight columns of ``v`` into one int32, interleaved
    0 2 4 6 1 3 5 7, lowest bits first."""
    out = torch.zeros(v.shape[0], v.shape[1] // 8, dtype=torch.int64)
    for i, col in enumerate((0, 2, 4, 6, 1, 3, 5, 7)):
        out |= v[:, col::8].to(torch.int64) << (4 * i)
    return torch.where(out >= 2**31, out - 2**32, out).to(torch.int32)


@pytest.mark.parametrize("fmt", ["gptq", "gptq_v2"])
def test_gptq_checkpoints_load_exactly(fmt):
    torch.manual_seed(0)
    n, k, g = N, K, 32
    q = torch.randint(0, 16, (k, n))  # GPTQ keeps W as [K, N]
    z = torch.randint(0, 16, (k // g, n))
    s = torch.rand(k // g, n).half() * 0.1 + 0.01
    want = ((q - z.repeat_interleave(g, 0)) * s.float().repeat_interleave(g, 0)).t()
    stored_z = z - 1 if fmt == "gptq" else z  # v1: AutoGPTQ's pack does `zeros -= 1`
    tensors = {
        "proj.qweight": _pack_rows(q, 4),
        "proj.qzeros": _pack_rows((stored_z & 0xF).t(), 4).t().contiguous(),
        "proj.scales": s,
        "proj.g_idx": (torch.arange(k) // g).to(torch.int32),
        "proj.bias": torch.randn(n),
    }
    qcfg = {
        "quant_method": "gptq",
        "bits": 4,
        "group_size": g,
        "desc_act": False,
        "sym": False,
        "checkpoint_format": fmt,
    }
    if fmt == "gptq":
        # a zero of 0 is stored as -1 → 0xF, which v1 kernels read back as 16
        want = torch.where(
            (z == 0).repeat_interleave(g, 0).t(),
            want - 16 * s.float().repeat_interleave(g, 0).t(),
            want,
        )
    check_loaded(tensors, qcfg, want, Int4WeightOnly(group_size=32, symmetric=False))

    act_order = dict(tensors, **{"proj.g_idx": torch.randperm(k).to(torch.int32) // g})
    with pytest.raises(NotImplementedError, match="act-order"):
        read_quantized(act_order, quantization_config=qcfg)


def test_awq_gemm_checkpoints_load_exactly():
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.entrypoints.convert.converters.autoawq import AutoAWQConverter

    torch.manual_seed(0)
    n, k, g = N, K, 32
    q = torch.randint(0, 16, (k, n))
    z = torch.randint(0, 16, (k // g, n))
    s = torch.rand(k // g, n).half() * 0.1 + 0.01

    tensors = {
        "proj.qweight": awq_pack(q),
        "proj.qzeros": awq_pack(z),
        "proj.scales": s,
        "proj.bias": torch.randn(n),
    }
    qcfg = {
        "quant_method": "awq",
        "bits": 4,
        "group_size": g,
        "zero_point": True,
        "version": "gemm",
    }
    # compressed-tensors' own AWQ → pack-quantized converter, then its decompressor
    conv = AutoAWQConverter(group_size=g).process(dict(tensors))
    scheme = AutoAWQConverter(group_size=g)._build_quant_config().config_groups["config_group_0"]
    comp = {name.removeprefix("proj."): t for name, t in conv.items() if name != "proj.bias"}
    deq = BaseCompressor.get_value_from_registry("pack-quantized").decompress(comp, scheme)
    want = ((q - z.repeat_interleave(g, 0)) * s.float().repeat_interleave(g, 0)).t()
    # the library dequantizes in the scales' fp16: the same products, rounded once
    torch.testing.assert_close(deq["weight"], want.half(), rtol=0, atol=0)
    check_loaded(tensors, qcfg, want, Int4WeightOnly(group_size=32, symmetric=False))


# --------------------------------------------------------------------------------------------
# GGUF, written with gguf-py's own writer and quantizers
# --------------------------------------------------------------------------------------------


def write_gguf(path, tensors: dict, *, arch="llama", heads=None):
    """tensors: name → (float array to quantize or uint8 [N, bytes] blocks to write as they
    are, gguf type name) or a float array (F32)."""
    import gguf
    import numpy as np

    w = gguf.GGUFWriter(str(path), arch)
    if heads:
        w.add_head_count(heads[0])
        w.add_head_count_kv(heads[1])
    for name, v in tensors.items():
        if isinstance(v, tuple):
            data, kind = v
            qtype = gguf.GGMLQuantizationType[kind]
            if isinstance(data, torch.Tensor) and data.dtype == torch.uint8:  # blocks as given
                raw = data.numpy()
            elif kind.endswith("_K"):  # gguf-py cannot quantize K-quants: zero blocks, same size
                block, nbytes = gguf.GGML_QUANT_SIZES[qtype]
                raw = np.zeros((data.shape[0], data.shape[1] // block * nbytes), dtype=np.uint8)
            else:
                raw = gguf.quants.quantize(np.asarray(data, dtype=np.float32), qtype)
            w.add_tensor(name, raw, raw_shape=raw.shape, raw_dtype=qtype)
        else:
            w.add_tensor(name, np.asarray(v, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


def gguf_dequantized(path, name):
    import gguf

    t = next(t for t in gguf.GGUFReader(str(path)).tensors if t.name == name)
    return torch.from_numpy(gguf.quants.dequantize(t.data, t.tensor_type).copy())


def test_gguf_q4_0_loads_exactly(tmp_path):
    torch.manual_seed(0)
    w, bias = torch.randn(N, K), torch.randn(N)
    path = write_gguf(tmp_path / "m.gguf", {"proj.weight": (w, "Q4_0"), "proj.bias": bias})
    deq = gguf_dequantized(path, "proj.weight")
    ckpt = read_quantized(path, tensor_names=lambda name: name)
    assert ckpt.schemes == {"proj": Int4WeightOnly(group_size=32, symmetric=True)}
    got = dequantize(ckpt.schemes["proj"], ckpt.weights["proj.weight"].tensors, N, K)
    torch.testing.assert_close(got, deq, rtol=0, atol=0)
    x = torch.randn(3, K)
    ep = fxquant.load_quantized(One(), ckpt, example_inputs=(x,))
    torch.testing.assert_close(ep.module()(x), x @ deq.t() + bias)


def test_gguf_llama_names_and_rotary_rows_are_undone(tmp_path):
    """The default map gives Hugging Face Llama names and undoes llama.cpp's q/k row permutation
    exactly as transformers' GGUF loader does on dequantized weights."""
    from transformers.modeling_gguf_pytorch_utils import LlamaTensorProcessor

    torch.manual_seed(0)
    q, k_ = torch.randn(64, 64), torch.randn(32, 64)
    path = write_gguf(
        tmp_path / "llama.gguf",
        {
            "token_embd.weight": torch.randn(96, 64),
            "blk.0.attn_q.weight": (q, "Q4_0"),
            "blk.0.attn_k.weight": (k_, "Q4_0"),
            "blk.0.attn_norm.weight": torch.ones(64),
        },
        heads=(4, 2),
    )
    ckpt = read_quantized(path)
    assert sorted(ckpt.schemes) == [
        "model.layers.0.self_attn.k_proj",
        "model.layers.0.self_attn.q_proj",
    ]
    assert sorted(ckpt.tensors) == [
        "model.embed_tokens.weight",
        "model.layers.0.input_layernorm.weight",
    ]
    wrapped = ckpt.with_prefix("model.")  # e.g. for CausalLMWrapper(model)
    assert "model.model.layers.0.self_attn.q_proj.weight" in wrapped.weights
    proc = LlamaTensorProcessor(config={"num_attention_heads": 4, "num_key_value_heads": 2})
    for gname, module, n in (
        ("blk.0.attn_q.weight", "self_attn.q_proj", 64),
        ("blk.0.attn_k.weight", "self_attn.k_proj", 32),
    ):
        want = proc.process(gguf_dequantized(path, gname).numpy(), gname).weights
        name = f"model.layers.0.{module}"
        got = dequantize(ckpt.schemes[name], ckpt.weights[f"{name}.weight"].tensors, n, 64)
        torch.testing.assert_close(got, torch.from_numpy(want), rtol=0, atol=0)


def test_gguf_formats_without_an_exact_form_are_refused(tmp_path):
    torch.manual_seed(0)
    w = torch.randn(8, 64)
    # Q8_0 maps only when each row has one scale: make every block hold the row's amax
    uniform = w.clone()
    uniform[:, ::32] = w.abs().amax(dim=1, keepdim=True)
    path = write_gguf(tmp_path / "q8.gguf", {"proj.weight": (uniform, "Q8_0")})
    ckpt = read_quantized(path, tensor_names=lambda name: name)
    assert ckpt.schemes == {"proj": Int8WeightOnly()}
    got = dequantize(Int8WeightOnly(), ckpt.weights["proj.weight"].tensors, 8, 64)
    torch.testing.assert_close(got, gguf_dequantized(path, "proj.weight"), rtol=0, atol=0)

    for kind, why in (("Q8_0", "different scale per block"), ("Q3_K", "per 16")):
        path = write_gguf(tmp_path / f"{kind}.gguf", {"proj.weight": (torch.randn(8, 256), kind)})
        with pytest.raises(NotImplementedError, match=f"'proj.weight' is {kind}.*{why}"):
            read_quantized(path, tensor_names=lambda name: name)


# --------------------------------------------------------------------------------------------
# Errors: corrupt, truncated and mismatched files name the tensor and what was expected
# --------------------------------------------------------------------------------------------

_INT4 = {
    "quant_method": "compressed-tensors",
    "format": "pack-quantized",
    "quantization_status": "compressed",
    "config_groups": {
        "group_0": {
            "targets": ["Linear"],
            "weights": {
                "num_bits": 4,
                "type": "int",
                "strategy": "group",
                "group_size": 32,
                "symmetric": False,
            },
        }
    },
}


def _int4_tensors():
    return {
        "proj.weight_packed": torch.zeros(N, K // 8, dtype=torch.int32),
        "proj.weight_shape": torch.tensor([N, K]),
        "proj.weight_scale": torch.ones(N, K // 32),
        "proj.weight_zero_point": torch.zeros(N // 8, K // 32, dtype=torch.int32),
        "proj.bias": torch.zeros(N),
    }


@pytest.mark.parametrize(
    "change, error",
    [
        (
            {"proj.weight_scale": torch.ones(N, 2)},
            r"'proj.weight_scale' has shape \[64, 2\], expected \[64, 3\]",
        ),
        (
            {"proj.weight_packed": torch.zeros(N, K // 8, dtype=torch.int64)},
            r"'proj.weight_packed' has dtype int64, expected int32",
        ),
        (
            {"proj.weight_packed": torch.zeros(N, 5, dtype=torch.int32)},
            r"'proj.weight_packed' has shape \[64, 5\], expected \[64, 12\]",
        ),
        ({"proj.weight_zero_point": None}, r"'proj.weight_zero_point' is missing"),
        ({"other.weight_zero_point": torch.zeros(1)}, r"'other.weight_zero_point' belongs to no"),
    ],
)
def test_bad_tensors_are_named(change, error):
    tensors = _int4_tensors()
    for name, t in change.items():
        if t is None:
            del tensors[name]
        else:
            tensors[name] = t
    with pytest.raises(CheckpointError, match=error):
        read_quantized(tensors, quantization_config=_INT4)


def test_checkpoint_and_model_must_agree():
    x = torch.randn(2, K)
    with pytest.raises(
        CheckpointError, match=r"'proj.weight' is \[64, 96\].*model's is \[64, 80\]"
    ):
        fxquant.load_quantized(
            One(N, 80),
            _int4_tensors(),
            quantization_config=_INT4,
            example_inputs=(torch.randn(2, 80),),
        )
    no_bias = {k: v for k, v in _int4_tensors().items() if k != "proj.bias"}
    with pytest.raises(CheckpointError, match=r"no tensor for 1 .*: proj.bias"):
        fxquant.load_quantized(One(), no_bias, quantization_config=_INT4, example_inputs=(x,))
    extra = {**_int4_tensors(), "rotary.inv_freq": torch.ones(4)}
    with pytest.raises(CheckpointError, match=r"no place for: rotary.inv_freq"):
        fxquant.load_quantized(One(), extra, quantization_config=_INT4, example_inputs=(x,))
    ep = fxquant.load_quantized(
        One(), extra, quantization_config=_INT4, example_inputs=(x,), strict=False
    )
    assert fxquant.report(ep).rows[0]["weights"] == "given"
    with pytest.raises(CheckpointError, match="no quantization_config"):
        read_quantized(_int4_tensors())


def test_truncated_files_raise_and_failed_saves_leave_nothing(tmp_path):
    from safetensors.torch import save_file

    path = tmp_path / "model.safetensors"
    save_file(_int4_tensors(), str(path))
    path.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="model.safetensors is not a readable safetensors"):
        read_quantized(path, quantization_config=_INT4)
    gguf_path = write_gguf(tmp_path / "m.gguf", {"proj.weight": (torch.randn(8, 64), "Q4_0")})
    gguf_path.write_bytes(gguf_path.read_bytes()[:-40])
    with pytest.raises(CheckpointError, match="m.gguf"):
        read_quantized(gguf_path, tensor_names=lambda name: name)

    x = torch.randn(2, K)
    ub = fxquant.quantize(One(), Float8Dynamic(activation_scale_ub=1200.0), example_inputs=(x,))
    with pytest.raises(NotImplementedError, match="activation_scale_ub"):
        fxquant.save_compressed_tensors(ub, tmp_path / "out")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())


def _q4_k_blocks(n: int, k: int) -> torch.Tensor:
    """Q4_K bytes built to llama.cpp's layout from random fields (gguf-py cannot quantize K-quants;
    its dequantizer is the oracle): fp16 d, dmin; 6-bit scales and minimums; nibbles."""
    nb = n * k // 256
    d = (torch.rand(nb) * 0.01 + 1e-3).half().view(torch.uint8).reshape(nb, 2)
    dmin = (torch.rand(nb) * 0.01).half().view(torch.uint8).reshape(nb, 2)
    sc, mn = torch.randint(1, 64, (nb, 8)), torch.randint(0, 64, (nb, 8))
    scales = torch.cat(
        [
            sc[:, :4] | ((sc[:, 4:] >> 4) << 6),
            mn[:, :4] | ((mn[:, 4:] >> 4) << 6),
            (sc[:, 4:] & 0xF) | ((mn[:, 4:] & 0xF) << 4),
        ],
        dim=1,
    ).to(torch.uint8)
    qs = torch.randint(0, 256, (nb, 128), dtype=torch.uint8)
    return torch.cat([d, dmin, scales, qs], dim=1).reshape(n, k // 256 * 144)


@pytest.mark.parametrize("kind", ["Q4_1", "Q4_K"])
def test_gguf_float_minimum_types_load_with_a_float_zero_point(tmp_path, kind):
    """Q4_1 and Q4_K keep the file's codes and scales; their minimum becomes a float zero point,
    so the weights equal gguf's dequantization up to fp32 rounding (not bit for bit)."""
    import gguf

    torch.manual_seed(0)
    n, k = N, 256
    w = gguf.GGUFWriter(str(tmp_path / "m.gguf"), "llama")
    if kind == "Q4_1":
        import numpy as np

        raw = gguf.quants.quantize(np.asarray(torch.randn(n, k)), gguf.GGMLQuantizationType.Q4_1)
    else:
        raw = _q4_k_blocks(n, k).numpy()
    qtype = gguf.GGMLQuantizationType[kind]
    w.add_tensor("proj.weight", raw, raw_shape=raw.shape, raw_dtype=qtype)
    w.add_tensor("proj.bias", torch.randn(n).numpy())
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    path = tmp_path / "m.gguf"
    deq = gguf_dequantized(path, "proj.weight")
    ckpt = read_quantized(path, tensor_names=lambda name: name)
    scheme = IntxWeightOnly(bits=4, group_size=32, zero_point="float")
    assert ckpt.schemes == {"proj": scheme}
    got = dequantize(scheme, ckpt.weights["proj.weight"].tensors, n, k)
    torch.testing.assert_close(got, deq, rtol=1e-5, atol=1e-6)
    x = torch.randn(3, k)
    ep = fxquant.load_quantized(One(n, k), ckpt, example_inputs=(x,))
    want = x @ deq.t() + ckpt.tensors["proj.bias"]
    torch.testing.assert_close(ep.module()(x), want, rtol=1e-4, atol=1e-4)


def _q6_k_blocks(n: int, k: int) -> torch.Tensor:
    """Q6_K bytes built to llama.cpp's layout from random fields (gguf-py cannot quantize
    K-quants; its dequantizer is the oracle): ql (128 bytes), qh (64), 16 int8 scales, fp16 d.
    Scales and d take negative and zero values too."""
    nb = n * k // 256
    qs = torch.randint(0, 256, (nb, 192), dtype=torch.uint8)  # ql and qh: any bits are codes
    sc = torch.randint(-128, 128, (nb, 16), dtype=torch.int8)
    sc[::3, 5] = 0
    d = torch.randn(nb) * 1e-3
    d[1] = 0.0
    d = d.half().view(torch.uint8).reshape(nb, 2)
    return torch.cat([qs, sc.view(torch.uint8), d], dim=1).reshape(n, k // 256 * 210)


def test_gguf_q6_k_loads_exactly(tmp_path):
    """Q6_K's w = d·sc·(q - 32) per 16 is (u - z)·s with z = 32, s = d·sc: the products are
    exact in fp32, so the weights are gguf-py's dequantization bit for bit (signed zeros too)."""
    from fxquant.core.scheme import check_layout

    torch.manual_seed(0)
    n, k = N, 512
    blocks, bias = _q6_k_blocks(n, k), torch.randn(n)
    path = write_gguf(tmp_path / "m.gguf", {"proj.weight": (blocks, "Q6_K"), "proj.bias": bias})
    deq = gguf_dequantized(path, "proj.weight")
    ckpt = read_quantized(path, tensor_names=lambda name: name)
    scheme = IntxWeightOnly(bits=6, group_size=16, symmetric=True)
    assert ckpt.schemes == {"proj": scheme}
    weight = ckpt.weights["proj.weight"]
    check_layout(scheme, "proj.weight", (n, k), weight)
    assert bool((weight.tensors["scale"] < 0).any()) and bool((weight.tensors["scale"] == 0).any())
    got = dequantize(scheme, weight.tensors, n, k)
    assert torch.equal(got.view(torch.int32), deq.view(torch.int32))
    x = torch.randn(3, k)
    ep = fxquant.load_quantized(One(n, k), ckpt, example_inputs=(x,))
    torch.testing.assert_close(ep.module()(x), x @ deq.t() + bias, rtol=1e-5, atol=1e-4)


def test_gguf_q6_k_short_block_buffer_names_the_tensor(tmp_path, monkeypatch):
    """A tensor whose bytes do not fill its Q6_K blocks: CheckpointError naming it and the
    expected size. (A file cut inside tensor data already fails in gguf-py's reader, which
    names no tensor: CheckpointError with the file, test_truncated_files_raise_...)."""
    import gguf

    path = write_gguf(tmp_path / "m.gguf", {"proj.weight": (_q6_k_blocks(4, 256), "Q6_K")})
    reader = gguf.GGUFReader(str(path))
    tensor = reader.tensors[0]
    reader.tensors[0] = tensor._replace(data=tensor.data[:, :-3])  # 207 of 210 bytes a row
    monkeypatch.setattr(gguf, "GGUFReader", lambda _: reader)
    with pytest.raises(CheckpointError, match=r"'proj.weight' \(Q6_K\).*expected \[4, 210\]"):
        read_quantized(path, tensor_names=lambda name: name)


def test_gptq_3bit_dense_bit_stream_loads_exactly():
    """3-bit GPTQ packs 32 codes into 3 int32 words as one little-endian bit stream (AutoGPTQ's
    pack lets codes 10 and 21 straddle words)."""
    torch.manual_seed(0)
    n, k, g = 32, 64, 32
    q = torch.randint(0, 8, (k, n))
    z = torch.randint(0, 8, (k // g, n))
    s = torch.rand(k // g, n).half() * 0.1 + 0.01

    def stream_pack(v):  # [R, C] codes → int32 [R·3/32, C], packed along R
        out = torch.zeros(v.shape[0] * 3 // 32, v.shape[1], dtype=torch.int32)
        for c in range(v.shape[1]):
            for r0 in range(0, v.shape[0], 32):
                big = sum(int(v[r0 + j, c]) << (3 * j) for j in range(32))
                for wi in range(3):
                    word = (big >> (32 * wi)) & 0xFFFFFFFF
                    out[r0 * 3 // 32 + wi, c] = word - 2**32 if word >= 2**31 else word
        return out

    tensors = {
        "proj.qweight": stream_pack(q),
        "proj.qzeros": stream_pack(z.t()).t().contiguous(),
        "proj.scales": s,
        "proj.bias": torch.randn(n),
    }
    qcfg = {"quant_method": "gptq", "bits": 3, "group_size": g, "checkpoint_format": "gptq_v2"}
    want = ((q - z.repeat_interleave(g, 0)) * s.float().repeat_interleave(g, 0)).t()
    check_loaded(tensors, qcfg, want, IntxWeightOnly(bits=3, group_size=32), n=n, k=k)


@pytest.mark.parametrize("preset", ["MXFP4A16", "MXFP4", "NVFP4A16"])
def test_compressed_tensors_fp4_checkpoints_load(preset):
    """MXFP4 loads bit for bit; NVFP4's global scale is a divisor in compressed-tensors and a
    multiplier in fxquant, so its weights agree to the fp32 rounding of that reciprocal."""
    from compressed_tensors.compressors import BaseCompressor
    from compressed_tensors.quantization.quant_scheme import preset_name_to_scheme
    from compressed_tensors.quantization.utils import calculate_qparams, generate_gparam

    from fxquant.core.config import MXFP4, NVFP4

    torch.manual_seed(0)
    w, bias = torch.randn(N, K), torch.randn(N)
    scheme = preset_name_to_scheme(preset, ["Linear"])
    a = scheme.weights
    wg = w.reshape(N, -1, a.group_size)
    nv = preset.startswith("NV")
    gs = generate_gparam(w.min(), w.max()) if nv else None
    scale, _ = calculate_qparams(wg.amin(-1), wg.amax(-1), a, global_scale=gs)
    sd = {"weight": w, "weight_scale": scale, **({"weight_global_scale": gs} if nv else {})}
    fmt = "nvfp4-pack-quantized" if nv else "mxfp4-pack-quantized"
    compressor = BaseCompressor.get_value_from_registry(fmt)
    comp = compressor.compress(sd, scheme)
    deq = compressor.decompress(comp, scheme)["weight"].float()  # the library's bf16 weights
    tensors = {f"proj.{n}": t for n, t in comp.items()}
    tensors["proj.bias"] = bias
    qcfg = {
        "quant_method": "compressed-tensors",
        "format": fmt,
        "quantization_status": "compressed",
        "config_groups": {"group_0": json.loads(scheme.model_dump_json())},
    }
    ckpt = read_quantized(tensors, quantization_config=qcfg)
    want = {
        "MXFP4A16": MXFP4(activations=False),
        "MXFP4": MXFP4(activations=True, scale_rule="even"),
        "NVFP4A16": NVFP4(activations=False),
    }[preset]
    assert ckpt.schemes == {"proj": want}
    c = ckpt.weights["proj.weight"].tensors
    if nv:
        got = ref_mx.dequantize_nvfp4_weight(c["qweight"], c["scale"], c["tensor_scale"])
        torch.testing.assert_close(got.bfloat16().float(), deq, rtol=1e-2, atol=0)
    else:
        got = ref_mx.dequantize_mxfp4_weight(c["qweight"], c["scale"])
        torch.testing.assert_close(got, deq, rtol=0, atol=0)  # e2m1 × 2^e: exact in bf16
    x = torch.randn(3, K)
    ep = fxquant.load_quantized(One(), ckpt, example_inputs=(x,))
    x_ref = ref_mx.mx_fake_quantize(x, elem="e2m1", rule="even") if want.activations else x
    torch.testing.assert_close(ep.module()(x), x_ref @ got.t() + bias)
