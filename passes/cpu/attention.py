"""Attention over a repeated KV cache, in the graphs the ``torch.compile`` backend gets, read in
place by fxquant's packed attention and its native kernel instead.

Where it sits: the CPU step of ``fxquant.backend`` (native kernels built), on the torch-level
graph Dynamo hands over, before Inductor. Under Dynamo transformers' ``sdpa`` attention repeats
each key/value head G times (``repeat_kv``: ``x[:, :, None]``, ``.expand``, ``.reshape``) and
calls ``scaled_dot_product_attention`` with the mask. At a decode step of Hugging Face's
``generate`` with a static cache that is a copy of the whole cache per layer: it hands attention
all ``max_cache_len`` positions, masked past the current one. Each such call becomes
``fxquant.core.ops.packed_gqa_attention`` on the cache as it lies: the packed attention
``fxquant.export_llm`` traces, whose kernel (kernels/cpu/attention.cpp) reads each cached row
once, and only up to the last position a row attends to.

Taken: query, key and value of one float dtype on CPU; key and value each the repeat of one
[B, Hkv, L, D] tensor by the same G > 1, with H = G · Hkv query heads; a bool mask [B or 1, 1,
T, L]; no dropout; not causal; no ``enable_gqa``. Anything else is left as it is (a prefill
transformers calls with ``is_causal=True`` and no mask, say).

fp32, bf16 and fp16 all run the native kernel (a bf16 / fp16 cache, a model loaded in its
checkpoint's dtype as ``from_pretrained`` does by default, widened to fp32 as it is read; the
result rounded back). On SmolLM2 in bf16 under ``generate`` with a 2048-position cache
(int8wo+lm_head, Zen 4, one-off runs by hand): 50.5 ms a decode step with sdpa's CPU flash
kernel on the repeated cache, 13.9 with the packed composition (two bf16 matmuls over the whole
cache and a softmax in fp32: its bmm was a third of the step), 7.9 with the kernel.
"""

from __future__ import annotations

import contextlib
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true

from fxquant.core.ops import packed_gqa_attention
from fxquant.passes.plan import node_value

__all__ = ["pack_repeated_attention", "share_attention_masks"]

_SDPA = torch.nn.functional.scaled_dot_product_attention
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")
_NEW_AXIS = (slice(None), slice(None), None, slice(None), slice(None))  # x[:, :, None]
_FLOATS = (torch.float32, torch.bfloat16, torch.float16)


def pack_repeated_attention(graph: fx.Graph) -> int:
    """Rewrite every sdpa over a repeated cache that qualifies (above); returns how many."""
    from fxquant.passes.rewrite import counters

    done = 0
    for node in list(graph.nodes):
        if not (node.op == "call_function" and node.target is _SDPA):
            continue
        args = dict(zip(_SDPA_ARGS, node.args, strict=False)) | dict(node.kwargs)
        key, value = _repeated(args.get("key")), _repeated(args.get("value"))
        if key is None or value is None or key[1] != value[1]:
            continue
        scale = _scale(args)
        if scale is None:
            continue
        with graph.inserting_before(node):
            packed = graph.call_function(
                packed_gqa_attention,
                (args["query"], key[0], value[0], args["attn_mask"], scale),
                {"native": True},
            )
        packed.meta.update(node.meta)  # the same [B, H, T, D] result
        repeats = (args["key"], args["value"])
        node.replace_all_uses_with(packed)
        graph.erase_node(node)
        for repeat in repeats:
            _erase_repeat(graph, repeat)
        counters["attention.packed"] += 1
        done += 1
    return done


def share_attention_masks(graph: fx.Graph) -> int:
    """Hand the native attention calls that share a mask one copy of it (not a view), computed
    once after the mask; returns how many masks. Where it sits: ``fxquant.export_llm`` (its
    program, whatever compiles it) and ``fxquant.passes.lower.prepacked`` (any program
    ``aot_compile`` packages); an ``export_llm`` program's 30-odd layers all read the model's one
    causal mask.

    The op lets Inductor hand it inputs in any layout (``flexible_layout``: under the default,
    exact strides, Inductor copied a shared input once per call, recomputing the mask for every
    layer). In such a program the mask reaches each call as views (unsqueeze, expand) of a
    computation whose last size is data-dependent (the visible positions), and Inductor cannot
    order the strides of such a view to pass it as it lies (``GuardOnDataDependentSymNode``); a
    copy that is not a view is computed into one buffer, which every call reads. Only for a
    bool mask (the native kernel's)."""
    target = torch.ops.fxquant.native_gqa_attention.default
    calls: dict[fx.Node, list[fx.Node]] = {}
    for node in graph.nodes:
        if node.op == "call_function" and node.target is target:
            mask = node.args[3]
            if not (isinstance(mask, fx.Node) and mask.op == "call_function"):
                continue
            if mask.target is torch.ops.aten.ne.Scalar:  # shared already (fxquant.export_llm)
                continue
            if getattr(mask.meta.get("val"), "dtype", None) == torch.bool:
                calls.setdefault(mask, []).append(node)
    for mask, users in calls.items():
        # mask != 0: a computation (Inductor drops a clone as a no-op), equal to the bool mask
        with graph.inserting_after(mask):
            copy = graph.call_function(torch.ops.aten.ne.Scalar, (mask, 0))
        val = mask.meta["val"]  # a bool tensor: the calls were gathered by its dtype
        with getattr(val, "fake_mode", None) or contextlib.nullcontext():
            copy.meta["val"] = torch.ops.aten.ne.Scalar(val, 0)
        for user in users:
            user.replace_input_with(mask, copy)
    return len(calls)


def _repeated(node) -> tuple[fx.Node, int] | None:
    """``(x, G)`` where ``node`` is transformers' ``repeat_kv(x, G)`` of a float CPU
    [B, Hkv, L, D] tensor x, else None."""
    if not _is_method(node, "reshape"):
        return None
    expand = node.args[0]
    if not _is_method(expand, "expand") or len(expand.users) != 1:
        return None
    item = expand.args[0]
    if not (
        isinstance(item, fx.Node)
        and item.op == "call_function"
        and item.target is operator.getitem
        and item.args[1] == _NEW_AXIS
        and len(item.users) == 1
    ):
        return None
    source = item.args[0]
    x, out = node_value(source), node_value(node)
    if not (_float_cpu(x, 4) and _float_cpu(out, 4)):
        return None
    groups = out.shape[1] // x.shape[1] if _ints(out.shape[1], x.shape[1]) else 0
    same = all(_same(out.shape[i], x.shape[i]) for i in (0, 2, 3))
    if groups < 2 or out.shape[1] != groups * x.shape[1] or not same:
        return None
    return source, groups


def _scale(args: dict) -> float | None:
    """The attention's scale where the call qualifies (module docstring), else None."""
    q, mask = node_value(args.get("query")), node_value(args.get("attn_mask"))
    key = node_value(args["key"])
    if not _float_cpu(q, 4) or mask is None or not isinstance(mask, torch.Tensor):
        return None
    if not key.dtype == node_value(args["value"]).dtype == q.dtype:
        return None
    if args.get("dropout_p", 0.0) != 0.0 or args.get("is_causal") or args.get("enable_gqa"):
        return None
    if mask.dtype != torch.bool or mask.dim() != 4 or not _same(mask.shape[1], 1):
        return None
    if not (_same(mask.shape[2], q.shape[2]) and _same(mask.shape[3], key.shape[2])):
        return None
    if not (_same(q.shape[1], key.shape[1]) and _same(q.shape[3], key.shape[3])):
        return None
    if not (_same(mask.shape[0], 1) or _same(mask.shape[0], q.shape[0])):
        return None
    scale = args.get("scale")
    if scale is None:
        return q.shape[3] ** -0.5 if isinstance(q.shape[3], int) else None
    return float(scale) if isinstance(scale, (int, float)) else None


def _is_method(node, name: str) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_method" and node.target == name


def _float_cpu(value, dim: int) -> bool:
    return (
        isinstance(value, torch.Tensor)
        and value.dtype in _FLOATS
        and value.device.type == "cpu"
        and value.dim() == dim
    )


def _ints(*sizes) -> bool:
    return all(isinstance(s, int) for s in sizes)


def _same(a, b) -> bool:
    """Equal sizes, symbolic ones only where provably so (no guard added)."""
    return statically_known_true(a == b)


def _erase_repeat(graph: fx.Graph, reshape: fx.Node) -> None:
    """Drop ``repeat_kv``'s three nodes (reshape ← expand ← x[:, :, None]) nothing reads now."""
    expand = reshape.args[0]
    for node in (reshape, expand, expand.args[0]):
        if node.users:
            return
        graph.erase_node(node)
