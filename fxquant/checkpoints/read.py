"""``read_quantized``: a checkpoint path or state dict → the reader for its format → a
``LoadedCheckpoint``.

Where it sits: above the readers, below ``attach`` (``load_quantized``).
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from fxquant.checkpoints.base import (
    CheckpointError,
    LoadedCheckpoint,
    TensorSource,
    _safetensors_files,
    read_config_json,
)


def read_quantized(
    checkpoint: str | os.PathLike | Mapping[str, torch.Tensor],
    *,
    quantization_config: Mapping[str, Any] | None = None,
    tensor_names: Callable[[str], str | None] | None = None,
) -> LoadedCheckpoint:
    """Read a pre-quantized checkpoint into fxquant's storage, without a model.

    Args:
        checkpoint: a Hugging Face model directory (``config.json`` + ``*.safetensors``, sharded
            or not), one ``.safetensors`` file, a ``.gguf`` file, or a state dict.
        quantization_config: the ``quantization_config`` dict of ``config.json`` (needed when
            ``checkpoint`` is a file or a state dict; for a directory it is read from there).
        tensor_names: GGUF only: maps a GGUF tensor name (``blk.0.attn_q.weight``) to the model's
            name, or None to drop it (default: llama.cpp's names → Hugging Face Llama names).

    Returns:
        A ``LoadedCheckpoint``; ``load_quantized`` attaches it to a model.
    """
    if isinstance(checkpoint, Mapping):
        source = TensorSource(checkpoint)
        qcfg = quantization_config
    else:
        path = Path(checkpoint)
        if path.suffix == ".gguf":
            from fxquant.checkpoints.gguf import read_gguf

            return read_gguf(path, tensor_names=tensor_names)
        if path.is_dir():
            source = TensorSource(files=_safetensors_files(path))
            qcfg = quantization_config or _config_of(read_config_json(path))
        elif path.suffix == ".safetensors":
            source = TensorSource(files=[path])
            qcfg = quantization_config
        else:
            raise CheckpointError(
                f"checkpoint {str(path)!r} is not supported; allowed: a model directory, a "
                ".safetensors file, a .gguf file or a state dict"
            )
    if tensor_names is not None:
        raise ValueError("tensor_names applies to GGUF files only")
    if isinstance(checkpoint, Mapping):
        return _read_with_config(source, qcfg)
    try:
        return _read_with_config(source, qcfg)
    except CheckpointError as e:  # a tensor's name alone does not say which checkpoint
        if str(path) in str(e):
            raise
        raise CheckpointError(f"{path}: {e}") from e


def _config_of(config: Mapping[str, Any]) -> Mapping[str, Any] | None:
    # Hugging Face's quantization_config; MLX (mlx-lm) writes "quantization" instead
    if "quantization_config" in config:
        return config["quantization_config"]
    if isinstance(config.get("quantization"), Mapping):
        return {"quant_method": "mlx", **config["quantization"]}
    return None


def _read_with_config(source: TensorSource, qcfg: Mapping[str, Any] | None) -> LoadedCheckpoint:
    if not qcfg:
        raise CheckpointError(
            "the checkpoint says nothing about how it is quantized: no quantization_config in "
            "config.json; pass quantization_config={...} (the dict from the model's config.json)"
        )
    method = qcfg.get("quant_method")
    method = getattr(method, "value", method)
    if method == "compressed-tensors":
        from fxquant.checkpoints.compressed_tensors_read import read_compressed_tensors

        return read_compressed_tensors(source, qcfg)
    if method == "fp8":
        from fxquant.checkpoints.fp8 import read_fp8_blocks

        return read_fp8_blocks(source, qcfg)
    if method == "fbgemm_fp8":
        from fxquant.checkpoints.fbgemm_fp8 import read_fbgemm_fp8

        return read_fbgemm_fp8(source, qcfg)
    if method in ("gptq", "awq"):
        from fxquant.checkpoints.gptq import read_awq, read_gptq

        return (read_gptq if method == "gptq" else read_awq)(source, qcfg)
    if method == "mxfp4":
        from fxquant.checkpoints.mxfp4 import read_mxfp4_experts

        return read_mxfp4_experts(source, qcfg)
    if method in ("metal", "mlx"):
        from fxquant.checkpoints.mlx import read_mlx

        return read_mlx(source, qcfg)
    if method in ("auto-round", "intel/auto-round"):
        from fxquant.checkpoints.auto_round import read_auto_round

        return read_auto_round(source, qcfg)
    if method == "spqr":
        from fxquant.checkpoints.spqr import read_spqr

        return read_spqr(source, qcfg)
    if method == "vptq":
        from fxquant.checkpoints.vptq import read_vptq

        return read_vptq(source, qcfg)
    if method == "aqlm":
        from fxquant.checkpoints.aqlm import read_aqlm

        return read_aqlm(source, qcfg)
    if method == "higgs":
        raise NotImplementedError(
            "HIGGS checkpoints store FLUTE's packed layout (int16 weight, tables, tables2), which "
            "fxquant does not read; quantize the float model with fxquant.from_hf(HiggsConfig(...))"
        )
    if method == "quark":
        from fxquant.checkpoints.quark import read_quark

        return read_quark(source, qcfg)
    if method == "fp_quant":
        from fxquant.checkpoints.fp_quant import read_fp_quant

        return read_fp_quant(source, qcfg)
    raise NotImplementedError(
        f"loading quant_method={method!r} checkpoints is not supported; supported: "
        "'compressed-tensors', 'fp8' (DeepSeek-style blocks), 'fbgemm_fp8' (per-channel "
        "e4m3, Llama 4's experts too), 'gptq', 'awq', 'mxfp4' (gpt-oss "
        "experts), 'metal' / MLX affine, 'fp_quant', 'auto-round', 'quark', 'aqlm', 'vptq', "
        "'spqr', and .gguf files"
    )
