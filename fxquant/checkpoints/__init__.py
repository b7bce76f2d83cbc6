"""Pre-quantized checkpoints in and out: Hub formats → fxquant constants → compressed-tensors.

Where it sits: beside ``fxquant.quantize``, at the top of the data flow. A loader reads a
checkpoint's tensors and re-packs each quantized layer's integers and scales into exactly the
storage the layer's fxquant scheme keeps (``QuantizedWeight``, checked by ``check_layout``), with
no float round trip: nothing is dequantized and requantized, so the program computes with the
checkpoint's own grid. ``load_quantized`` then hands those constants to ``fxquant.quantize``
(``weights=``) over a float skeleton of the model, whose other tensors (embeddings, norms, biases)
are replaced by the checkpoint's.

```
checkpoint dir / .safetensors / .gguf / state dict
   └─ read_quantized ──▶ LoadedCheckpoint(config, weights, tensors)   (per-format readers below)
          └─ load_quantized(model skeleton) ──▶ experts stacked ──▶ fxquant.quantize(..., weights=)
                                                                      ──▶ ExportedProgram
ExportedProgram ──save_compressed_tensors──▶ model.safetensors + config.json (compressed-tensors)
```

Formats (docs/checkpoints.md lists what maps exactly and what is refused, and why), one reader
module each: compressed-tensors ``naive-quantized`` / ``int-quantized`` / ``float-quantized`` /
``pack-quantized`` (``compressed_tensors_read``; ``compressed_tensors`` holds the format's schemes,
which ``fxquant.hf`` maps from too, and the writer), DeepSeek-style FP8 blocks
(``fp8``), GPTQ and AWQ GEMM (``gptq``), gpt-oss MXFP4 experts (``mxfp4``), MLX affine groups
(``mlx``: transformers' ``MetalConfig`` and Apple MLX's own files), GGUF (``gguf``).
The readers build on ``base`` (the error type, ``TensorSource``, ``LoadedCheckpoint``, the shared
conversions); ``read`` dispatches a path to its reader; ``attach`` holds ``load_quantized``;
``experts`` stacks a MoE checkpoint's per-expert linears into a model's stacked experts (and
splits them for the writer).
Each reader raises ``CheckpointError`` naming the tensor and what was expected, and
``NotImplementedError`` saying why when a layout has no exact fxquant form.
"""

from fxquant.checkpoints.attach import load_quantized
from fxquant.checkpoints.base import CheckpointError, LoadedCheckpoint, TensorSource
from fxquant.checkpoints.compressed_tensors import save_compressed_tensors
from fxquant.checkpoints.read import read_quantized

__all__ = [
    "CheckpointError",
    "LoadedCheckpoint",
    "TensorSource",
    "load_quantized",
    "read_quantized",
    "save_compressed_tensors",
]
