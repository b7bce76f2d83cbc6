"""The calibration configs: ``GPTQConfig`` (``quant_method="gptq"``) and ``AwqConfig``
(``"awq"``) choose their weights from data, so their mappers give a ``QuantConfig`` *and* the
``GPTQ`` / ``AWQ`` method for ``fxquant.calibrate`` (``calibration_from_hf``; ``from_hf`` refuses
them). Each ``HF_CONFIGS`` entry sits beside its mapper. Their checkpoints load through
``fxquant/checkpoints/gptq.py``."""

from __future__ import annotations

from typing import Any

from fxquant.core.config import Int4WeightOnly, Int8WeightOnly, QuantConfig, Scheme
from fxquant.hf.base import SKIP, maps, not_converted, refuse

GPTQ_CONFIG = {
    "class": "GPTQConfig",
    "status": "calibration",
    "why": "GPTQ chooses its weights from calibration data, which a QuantConfig alone "
    "cannot say (quantize() would round to nearest): `fxquant.calibration_from_hf(cfg)` "
    "returns the QuantConfig and the `GPTQ` method for `fxquant.calibrate(model, config, "
    "data, method=...)`; GPTQ checkpoints (v1 and v2) load with `fxquant.load_quantized`",
    # keys that config.json files of GPTQ checkpoints carry beside GPTQConfig's own
    "private_fields": (
        "checkpoint_format",
        "static_groups",
        "lm_head",
        "model_name_or_path",
        "model_file_base_name",
        "use_exllama",
        "exllama_config",
        "use_cuda_fp16",
    ),
    "fields": {
        "bits": "4 → Int4WeightOnly, 8 → Int8WeightOnly (per output channel, needs "
        "group_size=-1 and sym=True); 2 and 3 refused (GPTQ produces int4 and int8 weights)",
        "group_size": "int4: 32, 64, 128 or 256 → Int4WeightOnly(group_size=...); -1 (one "
        "group per row) refused for int4",
        "damp_percent": "GPTQ(damp_percent=...)",
        "desc_act": "True → GPTQ(desc_act=True) with static_groups=True (config.json's "
        "static_groups); without static groups refused for int4 (the groups would follow "
        "g_idx, fxquant's are contiguous along K)",
        "act_group_aware": "GPTQ(act_group_aware=...) (groups whole, no g_idx; ignored "
        "with desc_act, as GPTQModel)",
        "sym": "Int4WeightOnly(symmetric=...): s = amax / 7 with z = 8, or an integer zero "
        "point and s = (max - min) / 15 over a range that includes 0, as GPTQ's quantizer",
        "true_sequential": "True honoured (finer: each linear is calibrated on the inputs "
        "the quantized linears before it give); False refused",
        "format": "accepted: a checkpoint layout ('gptq' / 'gptq_v2'), not a numeric",
        "tokenizer": "accepted, not used: `calibrate` takes token ids as `data`",
        "dataset": "accepted, not used: tokenize the samples and pass them as `data`",
        "model_seqlen": "accepted, not used: the samples' length is theirs",
        "batch_size": "accepted, no effect (all samples are run)",
        "pad_token_id": "accepted, not used",
        "max_input_length": "accepted, no effect",
        "cache_block_outputs": "accepted, no effect (a memory trade-off of transformers' loop)",
        "meta": "accepted, informational",
        "backend": "accepted, no effect (a kernel choice)",
        "block_name_to_quantize": "accepted, not needed: the linears are found in the "
        "exported graph",
        "module_name_preceding_first_block": "accepted, not needed",
        "modules_in_block_to_quantize": "None honoured; a list refused (use QuantConfig.overrides)",
    },
}


def _int4(cls: str, group_size: Any, symmetric: bool) -> Int4WeightOnly:
    if group_size not in (32, 64, 128, 256):
        why = "allowed: 32, 64, 128, 256"
        if group_size == -1:
            why = "one int4 group per row is not an fxquant layout; " + why
        raise refuse(cls, "group_size", group_size, why)
    return Int4WeightOnly(group_size=group_size, symmetric=symmetric)


@maps("gptq", GPTQ_CONFIG)
def _gptq(f: dict[str, Any]) -> tuple[QuantConfig, Any, None]:
    from fxquant.calibration.methods import GPTQ

    cls = "GPTQConfig"
    bits, group_size, sym = f.get("bits", 4), f.get("group_size", 128), f.get("sym", True)
    desc_act, static = bool(f.get("desc_act", False)), bool(f.get("static_groups", False))
    if bits == 4:
        if desc_act and not static:
            raise refuse(
                cls, "desc_act", True,
                "act-order without static_groups puts each column in the group g_idx says; "
                "fxquant's int4 groups are contiguous along K (static_groups=True is honoured)",
            )  # fmt: skip
        scheme: Scheme = _int4(cls, group_size, bool(sym))
    elif bits == 8:
        if group_size != -1:
            raise refuse(cls, "group_size", group_size, "8-bit GPTQ maps to fxquant's per-row "
                          "int8 only with group_size=-1")  # fmt: skip
        if not sym:
            raise refuse(cls, "sym", sym, "fxquant's int8 weights are symmetric")
        scheme = Int8WeightOnly()
    else:
        raise refuse(cls, "bits", bits, "GPTQ here produces 4-bit (Int4WeightOnly) and 8-bit "
                      "(Int8WeightOnly) weights")  # fmt: skip
    if f.get("true_sequential", True) is not True:
        raise refuse(cls, "true_sequential", f["true_sequential"], "fxquant calibrates each "
                      "linear on the inputs of the quantized layers before it")  # fmt: skip
    if f.get("modules_in_block_to_quantize") is not None:
        raise refuse(cls, "modules_in_block_to_quantize", f["modules_in_block_to_quantize"],
                      "not mapped; choose the layers with QuantConfig.overrides")  # fmt: skip
    skip = {"modules_to_not_convert": ()} if f.get("lm_head") else {}
    method = GPTQ(
        damp_percent=float(f.get("damp_percent", 0.1)), desc_act=desc_act,
        static_groups=static and bits == 4, act_group_aware=bool(f.get("act_group_aware", False)),
    )  # fmt: skip
    return QuantConfig(scheme=scheme, **skip), method, None


AWQ_CONFIG = {
    "class": "AwqConfig",
    "status": "calibration",
    "why": "AWQ chooses per-channel scales and clipping from calibration data: "
    "`fxquant.calibration_from_hf(cfg)` returns the QuantConfig and the `AWQ` method for "
    "`fxquant.calibrate`; AWQ GEMM checkpoints load with `fxquant.load_quantized`",
    "private_fields": (
        "version",
        "do_fuse",
        "fuse_max_seq_len",
        "modules_to_fuse",
        "exllama_config",
    ),
    "fields": {
        "bits": "4 → Int4WeightOnly; anything else refused",
        "group_size": "32, 64, 128 or 256 → Int4WeightOnly(group_size=...); others refused",
        "zero_point": "True → symmetric=False (integer zero point; approximated: fxquant's "
        "range includes 0, AWQ's is the group's [min, max]); False → symmetric=True "
        "(amax / 7, codes -8..7, as AWQ)",
        "backend": "accepted, no effect (a kernel choice)",
        "modules_to_not_convert": SKIP,
    },
}


@maps("awq", AWQ_CONFIG)
def _awq(f: dict[str, Any]) -> tuple[QuantConfig, Any, str | None]:
    from fxquant.calibration.methods import AWQ

    cls = "AwqConfig"
    if f.get("bits", 4) != 4:
        raise refuse(cls, "bits", f["bits"], "AWQ is 4-bit")
    zero_point = bool(f.get("zero_point", True))
    scheme = _int4(cls, f.get("group_size", 128), not zero_point)
    approximation = None
    if zero_point:
        approximation = (
            "zero_point=True: AWQ's integer grid spans each group's [min, max]; fxquant's "
            "Int4WeightOnly grid always includes 0 (as GPTQ's), so a group whose values all "
            "have one sign gets a wider step"
        )
    return QuantConfig(scheme=scheme, **not_converted(f)), AWQ(), approximation
