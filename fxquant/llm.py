"""An LLM as one exported program with its KV cache: prefill and decode, ``export_llm``.

Where this sits: the capture step of the data flow, for causal LMs that are served token by
token. A Hugging Face decoder-only model is wrapped with a static KV cache whose tensors are
buffers of the wrapper, and exported once with a dynamic number of tokens T:

    (input_ids [B, T] int64, cache_position [T] int64) → logits [B, L, V] fp32

with L = 1 (the last position's logits: what generation reads, and all a prompt's prefill
needs; the default) or L = T (``logits="all"``: every position's, for scoring text).

``cache_position`` holds the positions of those T tokens: ``arange(T)`` for a prompt (one call
prefills it), ``[p]`` for the token at position p (one call per decoded token). The program
writes the new keys and values into its cache buffers (mutated in place by an AOTInductor
package as well) and attends over positions ``<= p``, so a new prompt at position 0 starts
over without any reset. The result is an ordinary ``ExportedProgram``: ``fxquant.quantize``,
``fxquant.aot_compile`` and ``torch.export.save`` take it as they take any other, and
``fxquant.generate`` (``fxquant.runtime``) drives the package.

What is fixed at export: the batch (``max_batch`` rows; the runtime pads fewer), the cache
length, the dtype, which logits come out. The program records them (:func:`llm_info`) and
``aot_compile`` copies them into the package's metadata, where the runtime checks every request
against them before any computation.

Why only the last position's logits by default: a prompt's prefill would otherwise run the LM
head on every prompt token (on SmolLM2-135M a fifth of the prefill's multiply-adds: a 49152 ×
576 head, 128 rows for a 128-token prompt) and return logits nobody reads; llama.cpp computes
the last token's only as well.

Built on transformers' ``StaticCache`` (``cache_utils``), as its executorch exporter is, with
two differences: prompts prefill in one call (T is dynamic) and ``cache_position`` is an input
(its wrapper drops it). Sliding-window layers become full-attention static layers, which is
exact while the cache is no longer than the window (checked).
"""

from __future__ import annotations

import inspect
import json
import traceback
from typing import Any

import torch
from torch import nn
from torch.export import Dim, ExportedProgram

from fxquant.core.ops import packed_gqa_attention

__all__ = [
    "INFO_KEY",
    "CachedCausalLM",
    "LLMExportError",
    "cache_len_limit",
    "decode_bytes",
    "export_llm",
    "llm_info",
]

INFO_KEY = "fxquant_llm"  # node.meta["custom"][INFO_KEY], the JSON of llm_info
# transformers' attention-implementation name the export traces with (registered on first use)
ATTENTION = "fxquant_packed_gqa"


class LLMExportError(RuntimeError):
    """A model the cached-LLM export cannot take; the message names the architecture and why."""


def _text_config(model: nn.Module):
    config = getattr(model, "config", None)
    if config is None:
        raise LLMExportError(
            f"export_llm: {type(model).__name__} has no .config; it takes a Hugging Face causal "
            "LM (AutoModelForCausalLM)"
        )
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _architecture(model: nn.Module) -> str:
    config = getattr(model, "config", None)
    archs = getattr(config, "architectures", None) or [type(model).__name__]
    return archs[0]


LOGITS = ("last", "all")  # export_llm's choices of which positions' logits the program returns


def _check_logits(who: str, logits: str) -> None:
    if logits not in LOGITS:
        raise ValueError(f"{who}: logits={logits!r}; allowed: {', '.join(map(repr, LOGITS))}")


class CachedCausalLM(nn.Module):
    """``(input_ids [B, T], cache_position [T]) → logits [B, L, V]`` over a static KV cache,
    L = 1 (``logits="last"``) or T (``"all"``).

    The cache tensors are this module's buffers (``cache_key_<i>``, ``cache_value_<i>``,
    ``cache_length_<i>``, non-persistent), so ``torch.export`` lifts them as buffers the
    program mutates. Each call points transformers' cache layers at those buffers first:
    during a non-strict export they are the tracer's versions, not the eager tensors.

    Attention is :func:`_packed_gqa_attention` in every mode. Under ``torch.compile`` set
    ``torch._dynamo.config.capture_scalar_outputs = True``: the attended length is data
    (``cache_position[-1].item()``), a graph break otherwise.
    """

    def __init__(
        self, model: nn.Module, *, max_cache_len: int, max_batch: int = 1, logits: str = "last"
    ) -> None:
        super().__init__()
        _check_logits("CachedCausalLM", logits)
        from transformers.cache_utils import StaticCache, StaticLayer

        config = _text_config(model)
        self.model = model
        self.max_cache_len, self.max_batch, self.logits = max_cache_len, max_batch, logits
        # attention through _packed_gqa_attention where the model runs transformers' sdpa; off
        # where the model's own code does not take that name (export_llm checks which agrees)
        self.pack_attention = True
        # transformers' causal LMs slice the hidden states before their head when asked
        params = inspect.signature(model.forward).parameters
        self._keep = "logits_to_keep" in params
        # the cache's keyword: `cache` in transformers 5.25, `past_key_values` before (5.17, the
        # lent GPU image's, takes any other keyword into **kwargs and runs without the cache)
        self._cache_arg = "cache" if "cache" in params else "past_key_values"
        self.cache = StaticCache(config=config, max_cache_len=max_cache_len)
        # every layer becomes a _VisibleLayer: transformers' sliding-window layers have
        # data-dependent control flow (a ring buffer of the window), and full layers would attend
        # over the whole cache. A sliding layer then keeps every position, as a full one does,
        # and its attention mask, built from config.sliding_window, still attends over the
        # window only (tested past the window): the same attention, its cache max_cache_len long
        layer_cls = _visible_layer_class(StaticLayer)
        self.cache.layers = [layer_cls(max_cache_len) for _ in self.cache.layers]
        states = _one_token_states(model, self._cache_arg, max_batch)
        if states is not None and len(states) == len(self.cache.layers):
            for layer, (key, value) in zip(self.cache.layers, states, strict=True):
                layer.lazy_initialization(key, value)
        else:  # the config's head shapes, as transformers' own export recipe sizes them
            heads, head_dim = _head_shapes(config)
            device = next(model.parameters()).device
            self.cache.early_initialization(max_batch, heads, head_dim, _dtype(model), device)
        if getattr(config, "_attn_implementation", None) == "sdpa":
            _register_attention()  # once, outside any trace: a global registry
        for i, layer in enumerate(self.cache.layers):
            self.register_buffer(f"cache_key_{i}", layer.keys, persistent=False)
            self.register_buffer(f"cache_value_{i}", layer.values, persistent=False)
            self.register_buffer(f"cache_length_{i}", layer.cumulative_length, persistent=False)

    def forward(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        # Attention reads the positions written so far, [0, last + 1), not the whole cache: a
        # decode step at position p reads p + 1 keys whatever max_cache_len is. The length is
        # data (an unbacked size in the exported program), bounded by the cache.
        visible = cache_position[-1].item() + 1
        # not checked against the prompt's length: torch 2.11's AOTInductor wrote that runtime
        # assert with a size symbol it never declared (the wrapper did not compile)
        torch._check(visible >= 1)
        torch._check(visible <= self.max_cache_len)
        for i, layer in enumerate(self.cache.layers):
            layer.keys = getattr(self, f"cache_key_{i}")
            layer.values = getattr(self, f"cache_value_{i}")
            layer.cumulative_length = getattr(self, f"cache_length_{i}")
            layer.visible = visible
            # the layer writes at cumulative_length + arange(T): start at this call's position
            layer.cumulative_length.copy_(cache_position[0])
        position_ids = cache_position.unsqueeze(0).expand(input_ids.shape[0], -1)
        last = self.logits == "last"
        # packed grouped-query attention in every mode (eager, export, torch.compile): under
        # Dynamo transformers' sdpa repeats the visible cache per layer and step
        with (
            _PackedAttention(self.model.config, enabled=self.pack_attention),
            _ChunksAsCausal(self.model.config, self.max_cache_len),
        ):
            out = self.model(
                input_ids=input_ids,
                position_ids=position_ids,
                **{self._cache_arg: self.cache},
                use_cache=True,
                **({"logits_to_keep": 1} if last and self._keep else {}),
            )
        logits = out.logits[:, -1:] if last else out.logits
        return logits.float()


def _one_token_states(model: nn.Module, cache_arg: str, batch: int) -> list | None:
    """Each layer's key and value states for one token of ``batch`` rows, from a forward of
    the model into a dynamic cache: what the static cache's layers are sized from. The model
    knows its shapes where its config's ``head_dim`` does not say them: DeepSeek's multi-head
    latent attention caches keys qk_nope + qk_rope wide and values v_head_dim wide. None where
    some layer cached nothing (the caller then sizes from the config)."""
    from transformers.cache_utils import DynamicCache

    cache = DynamicCache(config=model.config)
    device = next(model.parameters()).device
    ids = torch.zeros((batch, 1), dtype=torch.long, device=device)
    with torch.no_grad():
        model(input_ids=ids, use_cache=True, **{cache_arg: cache})
    states = [(getattr(la, "keys", None), getattr(la, "values", None)) for la in cache.layers]
    if any(k is None or v is None or k.dim() != 4 for k, v in states):
        return None
    return states


def _head_shapes(config) -> tuple[Any, Any]:
    """``(num_kv_heads, head_dim)`` for ``StaticCache.early_initialization``: transformers'
    ``get_head_shapes`` where it exists (per-layer lists for mixed configs); releases before it
    (the second lent H200's image had one) take the plain config attributes, as they did."""
    try:
        from transformers.configuration_utils import get_head_shapes
    except ImportError:
        heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        return heads, head_dim
    return get_head_shapes(config)


def _visible_layer_class(base: type) -> type:
    """transformers' ``StaticLayer`` that hands attention only the first ``visible`` positions
    (and sizes the mask to them); ``visible`` is set before every call."""

    class _VisibleLayer(base):
        visible: Any = None

        def update(self, key_states, value_states, *args, **kwargs):
            keys, values = super().update(key_states, value_states, *args, **kwargs)
            if self.visible is None:
                return keys, values
            return keys[:, :, : self.visible], values[:, :, : self.visible]

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return (self.max_cache_len if self.visible is None else self.visible), 0

    return _VisibleLayer


def _packed_gqa_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, is_causal=None, **kwargs
):
    """Attention for CachedCausalLM (exported or compiled): grouped-query heads packed, not
    repeated.

    With H query heads sharing Hkv key/value heads (SmolLM2: 9 and 3), transformers' ``sdpa``
    under export repeats each key/value head H/Hkv times: a copy of the visible cache per layer
    and step. Here the G = H/Hkv query heads of a group become G * T query rows of its one
    key/value head (the mask repeats along those rows: ``fxquant.core.ops.packed_gqa_attention``),
    so the cache is read as it is. On CPU, where fxquant's native kernels are built, that is
    one op, ``fxquant::native_gqa_attention`` (kernels/cpu/attention.cpp): at decode (G rows a
    head) its own loops read each cached row once, the positions split between the cores, where
    MKL's bmm spent ~12 µs a call on 3 x ~200 x 64 (60 calls a SmolLM2 token, ~11 % of a w8a8
    step); a prompt goes through ATen's flash attention for CPU inside the op (fp32; a bf16
    model's in bf16 on AMX Xeons).
    Elsewhere two batched matmuls and a softmax (fp32, as transformers' eager attention), which
    Inductor lowers to MKL's bmm and one fused kernel. Measured on SmolLM2 decode (AVX2, 2
    cores), that bmm form: 45 µs a layer against 72 for transformers' ``sdpa`` (repeat + CPU
    flash attention), whose kernel splits its work by head and query block, few at M = 1. The
    same scores and softmax up to fp32 rounding. Anything else (no mask, no groups, dropout, a
    position bias, softcapping) goes to transformers' own ``sdpa`` unchanged.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    groups = getattr(module, "num_key_value_groups", 1)
    plain = (
        groups == 1
        or attention_mask is None
        or attention_mask.dim() != 4
        or attention_mask.shape[1] != 1
        or dropout
        or kwargs.get("position_bias") is not None
        or kwargs.get("softcap") is not None
    )
    if plain:
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling,
            is_causal=is_causal, **kwargs,
        )  # fmt: skip
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    native = query.device.type == "cpu" and _native_attention(query, key, value, attention_mask)
    out = packed_gqa_attention(
        query, key, value, attention_mask, scale, native=native, heads_first=False
    )
    return out, None


def _native_attention(q, key, value, mask) -> bool:
    """Whether the native CPU kernel (``fxquant::native_gqa_attention``) can take this
    attention: fp32, bf16 or fp16 tensors of one dtype, a boolean mask, and the kernels built
    on this machine."""
    floats = (torch.float32, torch.bfloat16, torch.float16)
    if mask.dtype != torch.bool or q.dtype not in floats:
        return False
    if not q.dtype == key.dtype == value.dtype:
        return False
    return _native_built()


@torch.compiler.assume_constant_result
def _native_built() -> bool:
    """Whether the native CPU kernels are built here: a constant to Dynamo, which would
    otherwise trace into the loader (``lru_cache``, file locks) inside a compiled forward."""
    from fxquant.kernels import cpu as native

    return native.available()


def _register_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(ATTENTION, _packed_gqa_attention)
    AttentionMaskInterface.register(ATTENTION, sdpa_mask)


class _PackedAttention:
    """Run with :func:`_packed_gqa_attention` where the model runs transformers' ``sdpa`` (its
    name registered by ``CachedCausalLM``); the config's attention implementation is restored
    afterwards (the caller's model is kept)."""

    def __init__(self, config, *, enabled: bool = True) -> None:
        self.config, self.was, self.enabled = config, None, enabled

    def __enter__(self) -> None:
        self.was = getattr(self.config, "_attn_implementation", None) if self.enabled else None
        if self.was == "sdpa":
            self.config._attn_implementation = ATTENTION

    def __exit__(self, *exc) -> None:
        if self.was == "sdpa":
            self.config._attn_implementation = self.was


def _chunk_limit(config) -> int | None:
    """Llama 4's chunk length (``attention_chunk_size``) where some layer attends within chunks
    of it, else None."""
    chunk = getattr(config, "attention_chunk_size", None)
    chunked = "chunked_attention" in (getattr(config, "layer_types", None) or ())
    return chunk if chunked and isinstance(chunk, int) and chunk > 0 else None


class _ChunksAsCausal:
    """Llama 4's chunked-attention layers attend within chunks of ``attention_chunk_size``
    positions (8192); a cache no longer than that holds one chunk, where that is the causal
    mask. Run those layers with the causal mask then (the config's layer types restored
    afterwards): the chunked mask, exported, has sizes AOTInductor packaged wrongly (under 5 dB
    SQNR against the model on tiny Llama 4s, and no error; torch 2.13). Longer caches keep the
    chunked mask (``export_llm`` refuses them)."""

    def __init__(self, config, max_cache_len: int) -> None:
        limit = _chunk_limit(config)
        self.config, self.was = config, None
        self.on = limit is not None and max_cache_len <= limit

    def __enter__(self) -> None:
        if self.on:
            self.was = self.config.layer_types
            self.config.layer_types = [
                "full_attention" if t == "chunked_attention" else t for t in self.was
            ]

    def __exit__(self, *exc) -> None:
        if self.on:
            self.config.layer_types = self.was


def _dtype(model: nn.Module) -> torch.dtype:
    return next(model.parameters()).dtype


def _positional_limit(config) -> int | None:
    for name in ("max_position_embeddings", "n_positions", "n_ctx"):
        value = getattr(config, name, None)
        if isinstance(value, int) and value > 0:
            return value
    return None


def cache_len_limit(config) -> int | None:
    """The most cache positions :func:`export_llm` takes for a model of this Hugging Face config
    (its positional limit), or None: no limit known. What the command line's default
    ``max_cache_len`` is capped at."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    limits = [v for v in (_positional_limit(config), _chunk_limit(config)) if v is not None]
    return min(limits, default=None)


def _eos_ids(model: nn.Module) -> list[int]:
    found: list[int] = []
    for cfg in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        eos = getattr(cfg, "eos_token_id", None)
        for e in eos if isinstance(eos, (list, tuple)) else [eos]:
            if isinstance(e, int) and e not in found:
                found.append(e)
    return found


def _check(model: nn.Module, config, *, max_cache_len: int, max_batch: int) -> None:
    arch = _architecture(model)
    if not isinstance(max_cache_len, int) or max_cache_len < 2:
        raise ValueError(f"export_llm: max_cache_len={max_cache_len!r}; allowed: an int >= 2")
    if not isinstance(max_batch, int) or max_batch < 1:
        raise ValueError(f"export_llm: max_batch={max_batch!r}; allowed: an int >= 1")
    limit = _positional_limit(config)
    if limit is not None and max_cache_len > limit:
        raise ValueError(
            f"export_llm: max_cache_len={max_cache_len} is above {arch}'s positional limit "
            f"({limit} positions, config.max_position_embeddings); allowed: 2..{limit}"
        )
    chunk = _chunk_limit(config)
    if chunk is not None and max_cache_len > chunk:
        raise ValueError(
            f"export_llm: max_cache_len={max_cache_len} is above {arch}'s attention chunk "
            f"({chunk} positions, config.attention_chunk_size): past it its chunked layers "
            f"attend within their chunk, which the exported cache does not build; allowed: "
            f"2..{chunk}"
        )
    if getattr(config, "is_encoder_decoder", False):
        raise LLMExportError(
            f"export_llm: {arch} is an encoder-decoder model; it takes decoder-only LMs"
        )


def _agreement(ep: ExportedProgram, model: nn.Module, ids: torch.Tensor) -> float:
    """SQNR (dB) of the program's last logits against the model's own, uncached: after a
    prefill of ``ids`` but its last token, and after that token's decode step (which reads what
    the prefill cached). The program's cache is emptied again afterwards."""
    from fxquant.core.reference import sqnr

    t = ids.shape[1]
    program = ep.module()
    with torch.no_grad():
        want = model(input_ids=ids, use_cache=False).logits.float()
        prefill = program(ids[:, : t - 1], torch.arange(t - 1))[:, -1]
        decode = program(ids[:, t - 1 :], torch.tensor([t - 1]))[:, -1]
    for name, value in [*ep.state_dict.items(), *ep.constants.items()]:
        if name.startswith("cache_") and isinstance(value, torch.Tensor):
            value.zero_()
    return min(float(sqnr(want[:, -2], prefill)), float(sqnr(want[:, -1], decode)))


def _failing_frame(exc: BaseException) -> str:
    # the innermost frame in the model's own code (transformers or the user's), which names
    # the op or line the exporter could not trace
    frames = traceback.extract_tb(exc.__traceback__)
    mine = [f for f in frames if "torch/" not in f.filename.replace("\\", "/")]
    f = (mine or frames or [None])[-1]
    return (
        "" if f is None else f" at {f.filename.rsplit('/', 1)[-1]}:{f.lineno} ({f.name}: {f.line})"
    )


def export_llm(
    model: nn.Module,
    *,
    max_cache_len: int = 2048,
    max_batch: int = 1,
    example_tokens: int = 8,
    logits: str = "last",
) -> ExportedProgram:
    """Export a Hugging Face causal LM with a static KV cache, for prefill and decode alike.

    Args:
        model: a decoder-only ``AutoModelForCausalLM`` (Llama, Mistral, Qwen, Gemma, Falcon …) in
            eval mode; it is not changed.
        max_cache_len: positions the cache holds: prompt plus generated tokens, at most the
            model's positional limit (sliding-window layers hold them all too, their mask
            attends over the window).
        max_batch: rows of the cache; the program takes exactly this many sequences (the
            runtime pads fewer).
        example_tokens: trace-time T (>= 2: a 1 would specialize the dynamic dim).
        logits: ``"last"`` (default): the program returns the last position's logits
            [max_batch, 1, V], all that generating text reads, and a prefill skips the LM head
            on the other prompt tokens; ``"all"``: [max_batch, T, V], for scoring text
            (perplexity).

    Returns:
        An ``ExportedProgram`` ``(input_ids [max_batch, T], cache_position [T]) → logits``
        with T dynamic in 1..max_cache_len, the KV cache as mutated buffers and
        :func:`llm_info` recorded on its inputs.

    Raises:
        ValueError: a size outside what the model allows.
        LLMExportError: an architecture the exporter cannot trace (the message names it and
            the failing op; ``fxquant.evaluate.export_causal_lm`` still exports it uncached).
    """
    _check_logits("export_llm", logits)
    config = _text_config(model)
    _check(model, config, max_cache_len=max_cache_len, max_batch=max_batch)
    example_tokens = max(2, min(example_tokens, max_cache_len))
    arch = _architecture(model)
    try:
        wrapper = CachedCausalLM(
            model, max_cache_len=max_cache_len, max_batch=max_batch, logits=logits
        ).eval()
        vocab = config.vocab_size
        ids = torch.randint(0, vocab, (max_batch, example_tokens))
        ep = _export(wrapper, ids)
        # the program against the model itself: a model whose attention code does not take the
        # packed attention's name (Falcon under transformers 5.17 ran its own eager branch on
        # the mask meant for it: 15 dB) is exported again with its own attention
        floor = 50.0 if _dtype(model) == torch.float32 else 25.0  # dB; agreeing ones: 80+ / 35+
        db = _agreement(ep, model, ids)
        if db < floor:
            wrapper.pack_attention = False
            ep = _export(wrapper, ids)
            db = _agreement(ep, model, ids)
    except (ValueError, LLMExportError):
        raise
    except Exception as exc:  # noqa: BLE001  (any tracing failure: say which model and where)
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise LLMExportError(
            f"export_llm: {arch} could not be exported with a static KV cache"
            f"{_failing_frame(exc)}: {type(exc).__name__}: {first[:300]}. The uncached export "
            "(fxquant.evaluate.export_causal_lm) may still work."
        ) from exc
    if db < floor:
        raise LLMExportError(
            f"export_llm: {arch} with a static KV cache disagrees with the model itself on "
            f"{example_tokens} example tokens ({db:.1f} dB SQNR of the last logits, at least "
            f"{floor:.0f} expected): this transformers release's {arch} does not run on the "
            "cache as fxquant drives it. The uncached export (fxquant.evaluate.export_causal_lm) "
            "may still work."
        )
    info = {
        "architecture": arch,
        "name_or_path": getattr(model.config, "_name_or_path", "") or "",
        "max_cache_len": max_cache_len,
        "max_batch": max_batch,
        "vocab_size": int(config.vocab_size),
        "eos_token_ids": _eos_ids(model),
        "dtype": str(_dtype(model)).removeprefix("torch."),
        "positional_limit": _positional_limit(config),
        "logits": logits,
    }
    set_llm_info(ep, info)
    return ep


def _export(wrapper: CachedCausalLM, ids: torch.Tensor) -> ExportedProgram:
    tokens = Dim("tokens", min=1, max=wrapper.max_cache_len)
    with torch.no_grad():
        ep = torch.export.export(
            wrapper,
            (ids, torch.arange(ids.shape[1])),
            dynamic_shapes=({1: tokens}, {0: tokens}),
            strict=False,
            # a guard that holds over the whole range but that the solver cannot prove becomes a
            # runtime check instead of a refusal: Llama 4 guards t · min(L, L·t) == L·t, true
            # for every t ≥ 1
            prefer_deferred_runtime_asserts_over_guards=True,
        )
    # every layer's attention reads one computed copy of the causal mask, not views of it: under
    # torch.compile with the attended length captured (docs/llm.md) or AOTInductor its size is
    # data-dependent, and Inductor cannot hand such a view to the op (passes/cpu/attention.py)
    from fxquant.passes.cpu.attention import share_attention_masks

    if share_attention_masks(ep.graph_module.graph):
        ep.graph_module.recompile()
    return ep


def decode_bytes(ep: ExportedProgram) -> tuple[int, int]:
    """(weight bytes a decode step reads, KV-cache bytes per cached position) of a cached LLM.

    Every parameter, buffer and constant is read once per decode step except the KV cache
    (read up to the current position: the second figure) and an embedding table only looked up
    (one row per token). For a benchmark's bytes-per-token against memory bandwidth.
    """
    sizes = {**ep.state_dict, **ep.constants}
    used = {n.name: n for n in ep.graph.nodes if n.op == "placeholder" and n.users}
    weights, kv, seen = 0, 0, set()
    for spec in ep.graph_signature.input_specs:
        node, t = used.get(spec.arg.name), sizes.get(spec.target)
        if node is None or not isinstance(t, torch.Tensor) or t.data_ptr() in seen:
            continue  # unused, a user input, or a tied alias already counted
        seen.add(t.data_ptr())
        if "cache_key_" in spec.target or "cache_value_" in spec.target:
            kv += t.nbytes
        elif "cache_length_" in spec.target or all(
            u.target == torch.ops.aten.embedding.default and u.args[0] is node for u in node.users
        ):
            continue  # a position counter, or a table only looked up (a row per token)
        else:
            weights += t.nbytes
    info = llm_info(ep) or {}
    return weights, kv // max(int(info.get("max_cache_len", 1)), 1)


def set_llm_info(ep: ExportedProgram, info: dict[str, Any]) -> None:
    """Record ``info`` on the nodes that read the program's inputs (their meta["custom"], which
    ``torch.export.save`` keeps for operator nodes and the passes copy along)."""
    text = json.dumps(info, sort_keys=True)
    inputs = {n for n in ep.graph.nodes if n.op == "placeholder"}
    inputs = {n for n in inputs if n.name in ("input_ids", "cache_position")}
    for node in ep.graph.nodes:
        if node.op == "call_function" and any(a in inputs for a in node.all_input_nodes):
            node.meta.setdefault("custom", {})[INFO_KEY] = text


def llm_info(ep: ExportedProgram) -> dict[str, Any] | None:
    """What :func:`export_llm` recorded (cache length, batch, vocabulary, EOS ids …), or None
    for a program that is not a cached LLM."""
    for node in ep.graph.nodes:
        text = node.meta.get("custom", {}).get(INFO_KEY)
        if text:
            return json.loads(text)
    return None
