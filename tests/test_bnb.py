"""The bitsandbytes formats: NF4 / FP4 (Bnb4WeightOnly, double quant) and LLM.int8 (LLMInt8).

Reference math against values worked out by hand from bitsandbytes' rules, quantization error
floors, the ops against the reference (and opcheck), the schemes end to end on the tiny Llama,
the CPU lowering compiled by Inductor, and ``from_hf(BitsAndBytesConfig)``.
"""

from __future__ import annotations

import pytest
import torch
from torch.library import opcheck

import fxquant
from fxquant import Bnb4WeightOnly, LLMInt8, QuantConfig, from_hf
from fxquant.core import reference_bnb as rb
from fxquant.core.reference import sqnr
from fxquant.passes.lower import lower
from fxquant.passes.rewrite import counters

fxq = torch.ops.fxquant
NF4 = rb.code_4bit("nf4")
FP4 = rb.code_4bit("fp4")


def _bnb4(w, **kw):
    """(constants in op order, dequantized W) for one weight."""
    t = rb.quantize_4bit(w, **kw)
    args = [t.get(n) for n in ("qweight", "absmax", "quant_map")]
    args += [t.get(n) for n in ("nested_absmax", "nested_quant_map", "nested_offset")]
    return args, rb.dequantize_4bit(*args, block_size=kw["block_size"])


# --------------------------------------------------------------------------------------------
# Reference vs hand-computed bitsandbytes values
# --------------------------------------------------------------------------------------------


def test_code_tables_are_bnbs():
    assert NF4[0] == -1 and NF4[7] == 0 and NF4[15] == 1
    assert NF4[14].item() == pytest.approx(0.7229568362236023, abs=0)  # fp32 of bnb's literal
    assert torch.all(NF4[1:] > NF4[:-1])
    # bnb's FP4 order: 0, 0.0625, 8, 12, 4, 6, 2, 3 (then negated), divided by 12
    want = torch.tensor([0, 0.0625, 8, 12, 4, 6, 2, 3], dtype=torch.float32) / 12
    assert torch.equal(FP4[:8], want) and torch.equal(FP4[8:], -want)
    assert str(FP4[8].item()) == "-0.0"
    dm = rb.dynamic_map()
    assert dm.shape == (256,) and torch.all(dm[1:] >= dm[:-1])
    assert dm[127] == 0 and dm[255] == 1 and dm[128].item() == pytest.approx(0.55e-6)
    # the largest magnitude below 1: the midpoint of the last of 64 steps of [0.1, 1]
    assert dm[0].item() == pytest.approx(-(1 + 0.1 + 0.9 * 63 / 64) / 2, rel=1e-6)


@pytest.mark.parametrize(("quant_type", "code"), [("nf4", NF4), ("fp4", FP4)])
def test_a_block_of_code_values_packs_high_nibble_first(quant_type, code):
    # a row that is 2.5 × each code value in turn: absmax 2.5, index i % 16 everywhere
    w = (2.5 * code).repeat(8).reshape(2, 64)
    t = rb.quantize_4bit(w, quant_type=quant_type, block_size=64, double_quant=False)
    assert t["absmax"].tolist() == [2.5, 2.5]
    # FP4's index 8 is -0.0, and -0.0 is as near to +0.0 (index 0): the first index wins, as
    # with bnb's argmin
    first = 0x89 if quant_type == "nf4" else 0x09
    row = [0x01, 0x23, 0x45, 0x67, first, 0xAB, 0xCD, 0xEF] * 4
    assert t["qweight"].tolist() == [row, row]
    _, dq = _bnb4(w, quant_type=quant_type, block_size=64, double_quant=False)
    torch.testing.assert_close(dq, w, rtol=1e-6, atol=0)


def test_nearest_code_and_blocks_over_the_flattened_weight():
    # K = 96 is not a multiple of 64: the second block takes the last 32 of row 0 and the first
    # 32 of row 1, as bnb's flat blocks do
    w = torch.zeros(2, 96)
    w[0, 70] = -4.0  # block 1's absmax
    w[1, 10] = 0.6 * 4.0  # 0.6 lies between NF4 0.5626 and 0.7230: nearer the first
    w[1, 40] = 1.0  # block 2 (row 1, columns 32..95)
    t = rb.quantize_4bit(w, quant_type="nf4", block_size=64, double_quant=False)
    assert t["absmax"].tolist() == [0.0, 4.0, 1.0]
    idx = rb.unpack_4bit(t["qweight"].reshape(-1)).reshape(2, 96)
    assert idx[0, 70] == 0 and idx[1, 10] == 13 and idx[1, 40] == 15 and idx[0, 0] == 7
    _, dq = _bnb4(w, quant_type="nf4", block_size=64, double_quant=False)
    assert dq[1, 10].item() == pytest.approx(4.0 * 0.5626170039176941)


def test_double_quant_by_hand():
    # four blocks with absmax 1, 2, 3, 4: offset 2.5, centred ±0.5, ±1.5, nested absmax 1.5
    w = torch.zeros(4, 64)
    for i in range(4):
        w[i, i] = float(i + 1)
    t = rb.quantize_4bit(w, quant_type="nf4", block_size=64, double_quant=True)
    dm = rb.dynamic_map()
    assert t["nested_offset"].tolist() == [2.5] and t["nested_absmax"].tolist() == [1.5]
    assert t["absmax"].dtype == torch.uint8 and t["absmax"][[0, 3]].tolist() == [0, 255]
    scaled = torch.tensor([-1.0, -1 / 3, 1 / 3, 1.0])
    for q, s in zip(t["absmax"].long(), scaled, strict=True):  # each is the nearest map value
        assert (dm[q] - s).abs() == (dm - s).abs().min()
    decoded = rb.bnb4_absmax(
        t["absmax"], t["nested_absmax"], t["nested_quant_map"], t["nested_offset"]
    )
    assert decoded[3] == 4.0
    torch.testing.assert_close(decoded, torch.tensor([1.0, 2.0, 3.0, 4.0]), rtol=2e-2, atol=0)


@pytest.mark.parametrize(
    ("quant_type", "double_quant", "floor"),
    [("nf4", False, 20.0), ("nf4", True, 20.0), ("fp4", False, 17.5), ("fp4", True, 17.5)],
)
def test_quantize_dequantize_sqnr(quant_type, double_quant, floor):
    torch.manual_seed(0)
    w = torch.randn(96, 128)
    _, dq = _bnb4(w, quant_type=quant_type, block_size=64, double_quant=double_quant)
    assert sqnr(w, dq) >= floor


def test_llm_int8_weight_and_outlier_columns_by_hand():
    q, scb = rb.quantize_llm_int8_weight(torch.tensor([[0.5, -1.0, 0.25], [0.0, 0.0, 0.0]]))
    assert q.tolist() == [[64, -127, 32], [0, 0, 0]] and scb.tolist() == [1.0, 0.0]
    # token 0 has an outlier in column 1: column 1 leaves the int8 part for every token, and
    # token 0's absmax is taken without it
    x = torch.tensor([[1.0, 8.0, -2.0], [0.5, 0.25, 1.0]])
    xq, absmax, cols = rb.quantize_llm_int8_activation(x, threshold=6.0)
    assert cols.tolist() == [False, True, False] and absmax.tolist() == [2.0, 1.0]
    assert xq.tolist() == [[64, 0, -127], [64, 0, 127]]
    w = torch.randn(5, 3)
    cb, s = rb.quantize_llm_int8_weight(w)
    y = rb.llm_int8_linear(x, cb, s, threshold=6.0)
    int8_part = rb.llm_int8_linear(x * torch.tensor([1.0, 0.0, 1.0]), cb, s, threshold=0.0)
    float_part = x[:, 1:2] @ (cb.float() * s[:, None] / 127)[:, 1:2].t()
    torch.testing.assert_close(y, int8_part + float_part)
    # one token: bnb leaves the column alone but the outlier itself is zeroed: the same
    xq1, _, _ = rb.quantize_llm_int8_activation(x[:1], threshold=6.0)
    assert xq1.tolist() == [[64, 0, -127]]


def test_zeros_give_zeros_not_nan():
    x = torch.randn(3, 64)
    args, dq = _bnb4(torch.zeros(8, 64), quant_type="fp4", block_size=64, double_quant=True)
    assert torch.equal(dq, torch.zeros(8, 64))
    assert torch.equal(fxq.bnb4_weight_only_linear(x, *args, None, 64), torch.zeros(3, 8))
    q, s = rb.quantize_llm_int8_weight(torch.zeros(8, 64))
    assert torch.equal(fxq.llm_int8_linear(x, q, s, None, 6.0), torch.zeros(3, 8))
    q, s = rb.quantize_llm_int8_weight(torch.randn(8, 64))
    y = fxq.llm_int8_linear(torch.zeros(2, 64), q, s, None, 6.0)
    assert torch.equal(y, torch.zeros(2, 8))


# --------------------------------------------------------------------------------------------
# The ops
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_ops_match_reference_and_pass_opcheck(dtype):
    torch.manual_seed(0)
    x = torch.randn(3, 5, 96).to(dtype)
    x[0, 0, 7] = 9.0  # an outlier column for LLM.int8
    w, b = torch.randn(17, 96), torch.randn(17).to(dtype)
    cases = []
    for dq in (False, True):
        args, _ = _bnb4(w, quant_type="nf4", block_size=64, double_quant=dq)
        want = rb.bnb4_weight_only_linear(x, *args, b, block_size=64)
        cases.append((fxq.bnb4_weight_only_linear, (x, *args, b, 64), want))
    q, s = rb.quantize_llm_int8_weight(w)
    for t in (6.0, 0.0):
        want = rb.llm_int8_linear(x, q, s, b, threshold=t)
        cases.append((fxq.llm_int8_linear, (x, q, s, b, t), want))
    for op, args, want in cases:
        got = op(*args)
        assert got.dtype == dtype and got.shape == (3, 5, 17)
        torch.testing.assert_close(got, want, rtol=0, atol=0)
        if dtype == torch.float32:  # the schema and fake kernel do not depend on x's dtype
            opcheck(op, args)


def test_schemes_validate_their_fields():
    for bad, message in [
        (lambda: Bnb4WeightOnly(quant_type="int4"), r"quant_type='int4'.*'nf4', 'fp4'"),
        (lambda: Bnb4WeightOnly(block_size=32), r"block_size=32.*64, 128"),
        (lambda: Bnb4WeightOnly(double_quant="yes"), r"double_quant='yes'"),
        (lambda: LLMInt8(threshold=-1.0), r"threshold=-1.0.*>= 0"),
        (lambda: LLMInt8(threshold=True), r"threshold=True"),
        (lambda: LLMInt8(threshold=float("inf")), r"finite"),
    ]:
        with pytest.raises(ValueError, match=message):
            bad()
    assert fxquant.from_recipe_name("nf4") == Bnb4WeightOnly(quant_type="nf4", block_size=64)
    assert fxquant.from_recipe_name("llm-int8") == LLMInt8(threshold=6.0)
    assert Bnb4WeightOnly().unsupported_reason(out_features=4, in_features=63) is not None
    cfg = QuantConfig(scheme=Bnb4WeightOnly(quant_type="fp4", double_quant=True))
    assert QuantConfig.from_json(cfg.to_json()) == cfg


# --------------------------------------------------------------------------------------------
# End to end, and the CPU lowering
# --------------------------------------------------------------------------------------------


def test_tiny_llama_end_to_end(tiny_llama):
    torch.manual_seed(0)
    ids = torch.randint(0, 96, (2, 9))
    with torch.no_grad():
        ref = tiny_llama(ids)
    ep = torch.export.export(tiny_llama, (ids,))
    # measured: 32.6 dB (nf4 + double quant) and 53.3 dB (LLM.int8) on this model
    for scheme, floor in [(Bnb4WeightOnly(double_quant=True), 28.0), (LLMInt8(), 45.0)]:
        before = counters[scheme.name]
        qep = fxquant.quantize(ep, scheme)
        assert counters[scheme.name] - before == 14  # lm_head stays in float
        with torch.no_grad():
            assert sqnr(ref, qep.module()(ids)) >= floor, scheme


def test_cpu_lowering_compiles_to_the_reference():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 48), torch.nn.GELU(), torch.nn.Linear(48, 32))
    x = torch.randn(3, 64)
    cfg = QuantConfig(  # threshold 0.5: the second layer's input has outlier columns
        scheme=Bnb4WeightOnly(quant_type="fp4", double_quant=True),
        overrides={"2": LLMInt8(threshold=0.5)},
        modules_to_not_convert=(),
    )
    qep = fxquant.quantize(model.eval(), cfg, example_inputs=(x,))
    lowered = lower(qep)
    assert not [n for n in lowered.graph.nodes if str(n.target).startswith("fxquant.")]
    with torch.no_grad():
        want = qep.module()(x)
        got = torch.compile(lowered.module())(x)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------
# from_hf(BitsAndBytesConfig)
# --------------------------------------------------------------------------------------------


def test_from_hf_maps_bitsandbytes_configs():
    from transformers import BitsAndBytesConfig

    cfg = from_hf(
        BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type="nf4",
            bnb_4bit_use_double_quant=True,
            bnb_4bit_compute_dtype=torch.bfloat16,
            bnb_4bit_quant_storage=torch.bfloat16,
            llm_int8_skip_modules=["lm_head", "mlp"],
        )
    )
    assert cfg.scheme == Bnb4WeightOnly(quant_type="nf4", block_size=64, double_quant=True)
    assert cfg.modules_to_not_convert == ("lm_head", "mlp")
    cfg = from_hf(BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=4.0))
    assert cfg.scheme == LLMInt8(threshold=4.0) and cfg.modules_to_not_convert == ("lm_head",)
    # a model's config.json, which repeats the flags as private keys
    d = {"quant_method": "bitsandbytes", "_load_in_4bit": True, "load_in_4bit": True}
    assert from_hf(d).scheme == Bnb4WeightOnly(quant_type="fp4")  # transformers' default: fp4
    d = {"quant_method": "bitsandbytes", "load_in_8bit": True, "llm_int8_threshold": 0.0}
    assert from_hf(d).scheme == LLMInt8(threshold=0.0)


@pytest.mark.parametrize(
    ("config", "error", "message"),
    [
        ({"load_in_4bit": True, "load_in_8bit": True}, ValueError, "both True"),
        ({}, ValueError, "quantizes nothing"),
        (
            {"load_in_4bit": True, "bnb_4bit_quant_type": "int4"},
            NotImplementedError,
            r"bnb_4bit_quant_type='int4'",
        ),
        (
            {"load_in_4bit": True, "bnb_4bit_compute_dtype": "float64"},
            NotImplementedError,
            r"bnb_4bit_compute_dtype='float64'",
        ),
        (
            {"load_in_4bit": True, "_load_in_4bit": False},
            NotImplementedError,
            "disagrees with _load_in_4bit",
        ),
        ({"load_in_8bit": True, "blocksize": 128}, NotImplementedError, r"\['blocksize'\]"),
    ],
)
def test_from_hf_refuses_what_bitsandbytes_would_not_do(config, error, message):
    with pytest.raises(error, match=message):
        from_hf({"quant_method": "bitsandbytes", **config})
