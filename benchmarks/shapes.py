"""Named real-model shapes: the one table every benchmark takes its sizes from.

Benchmarks never hard-code shapes (shared/STYLE.md): a script picks rows of this table by name,
so a figure in a JSON result can be traced to a model. Dimensions are those of the published
configs (Hugging Face ``config.json``); ``bench-stack-1024`` is the synthetic LayerNorm → MLP
residual stack the issue's CPU latency targets are stated on.

    from shapes import SHAPES, get_shape, linears     # scripts run as `python benchmarks/<x>.py`
    s = get_shape("smollm2-135m")
    for name, n, k in linears(s): ...                 # the linear layers of one block, W[N, K]
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SHAPES", "ModelShape", "get_shape", "linears"]


@dataclass(frozen=True)
class ModelShape:
    """Sizes of one model. ``heads`` is None for a stack without attention; ``vocab`` is None
    where the benchmark has no embedding / LM head. ``gated_mlp``: SwiGLU (gate, up, down)
    rather than a plain two-linear MLP."""

    name: str
    d_model: int
    ffn: int
    layers: int
    heads: int | None = None
    kv_heads: int | None = None
    vocab: int | None = None
    gated_mlp: bool = False
    source: str = ""

    @property
    def head_dim(self) -> int | None:
        return None if self.heads is None else self.d_model // self.heads


_ROWS = [
    ModelShape(
        "bench-stack-1024",
        d_model=1024,
        ffn=4096,
        layers=4,
        source="issue benchmark: LayerNorm→Linear(D,4D)→GELU→Linear(4D,D) residual blocks",
    ),
    ModelShape(
        "minilm-l6",
        d_model=384,
        ffn=1536,
        layers=6,
        heads=12,
        kv_heads=12,
        vocab=30522,
        source="sentence-transformers/all-MiniLM-L6-v2",
    ),
    ModelShape(
        "smollm2-135m",
        d_model=576,
        ffn=1536,
        layers=30,
        heads=9,
        kv_heads=3,
        vocab=49152,
        gated_mlp=True,
        source="HuggingFaceTB/SmolLM2-135M",
    ),
    ModelShape(
        "qwen2.5-0.5b",
        d_model=896,
        ffn=4864,
        layers=24,
        heads=14,
        kv_heads=2,
        vocab=151936,
        gated_mlp=True,
        source="Qwen/Qwen2.5-0.5B",
    ),
    ModelShape(
        "llama3.2-1b",
        d_model=2048,
        ffn=8192,
        layers=16,
        heads=32,
        kv_heads=8,
        vocab=128256,
        gated_mlp=True,
        source="meta-llama/Llama-3.2-1B",
    ),
    ModelShape(
        "llama3-8b",
        d_model=4096,
        ffn=14336,
        layers=32,
        heads=32,
        kv_heads=8,
        vocab=128256,
        gated_mlp=True,
        source="meta-llama/Meta-Llama-3-8B",
    ),
]

SHAPES: dict[str, ModelShape] = {s.name: s for s in _ROWS}


def get_shape(name: str) -> ModelShape:
    """The row called ``name``; a ValueError lists the known names otherwise."""
    try:
        return SHAPES[name]
    except KeyError:
        raise ValueError(f"unknown shape {name!r}; known: {', '.join(SHAPES)}") from None


def linears(shape: ModelShape) -> list[tuple[str, int, int]]:
    """The linear layers of one block as (name, N, K), i.e. weights W[N, K] (Hugging Face
    module names). Attention projections only where the shape has heads."""
    d, f = shape.d_model, shape.ffn
    out: list[tuple[str, int, int]] = []
    if shape.heads is not None:
        hd = shape.head_dim
        kv = shape.kv_heads or shape.heads
        out += [
            ("q_proj", shape.heads * hd, d),
            ("k_proj", kv * hd, d),
            ("v_proj", kv * hd, d),
            ("o_proj", d, shape.heads * hd),
        ]
    if shape.gated_mlp:
        out += [("gate_proj", f, d), ("up_proj", f, d), ("down_proj", d, f)]
    else:
        out += [("fc1", f, d), ("fc2", d, f)]
    return out
