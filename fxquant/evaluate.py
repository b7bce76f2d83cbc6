"""Quality and speed of a causal LM at any stage of the pipeline.

Where this sits: at both ends of the data flow. :class:`CausalLMWrapper` is what gets
``torch.export``-ed (``nn.Module`` → ``ExportedProgram``); :func:`perplexity` and
:func:`decode_tokens_per_s` then measure whatever callable comes out of it: the eager model, an
``ExportedProgram.module()`` before or after ``fxquant.quantize``, an Inductor-compiled module or
a loaded AOTInductor package. The one contract is ``fn(input_ids [B, T] int64) → logits [B, T, V]``.

Perplexity follows the docs/assets.md protocol so numbers are comparable: non-overlapping windows
(512 tokens), no BOS token, mean negative log-likelihood over every predicted token (a window of
L tokens predicts L - 1), ``exp`` of that mean.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F
from torch import nn
from torch.export import Dim

__all__ = [
    "CausalLMWrapper",
    "decode_tokens_per_s",
    "export_causal_lm",
    "greedy_decode",
    "perplexity",
]

LogitsFn = Callable[[torch.Tensor], torch.Tensor]


class CausalLMWrapper(nn.Module):
    """An HF causal LM as ``input_ids [B, T] → logits [B, T, V]``: the graph that gets exported.

    ``use_cache=False`` keeps the KV cache (a ``DynamicCache`` object) out of the inputs and the
    outputs, so the exported signature is one tensor in, one tensor out: what the quantization
    passes, ``.pt2`` files and AOTInductor packages expect.

    No attention mask or position ids are passed: without padding, the model's own causal mask
    and ``arange`` positions are right for every (batch, seq), and with transformers 5 they trace
    with both dims symbolic (checked in ``tests/test_assets.py``).
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits


def export_causal_lm(
    model: nn.Module,
    *,
    example_batch: int = 2,
    example_seq: int = 16,
    vocab_size: int | None = None,
) -> torch.export.ExportedProgram:
    """Export ``CausalLMWrapper(model)`` with dynamic batch and sequence dims.

    The example sizes must both be >= 2: ``torch.export`` specializes any dim whose example
    size is 0 or 1 (the "0/1 specialization"), and a ``Dim.DYNAMIC`` dim that got specialized is
    an error ("export 0/1 specialized due to hint of 1"). The program exported from a (2, 16)
    example still runs at batch 1 and seq 1; the symbolic range reported is [2, inf) only
    because of that hint.

    Args:
        model: an HF causal LM in eval mode (anything :class:`CausalLMWrapper` accepts).
        example_batch, example_seq: trace-time sizes, >= 2 each.
        vocab_size: range of the random example ids; defaults to ``model.config.vocab_size``.

    Returns:
        The ``ExportedProgram``; ``program.module()(ids)`` returns logits.
    """
    if example_batch < 2 or example_seq < 2:
        raise ValueError(
            f"export_causal_lm: example_batch={example_batch}, example_seq={example_seq}; both "
            "must be >= 2, or torch.export specializes that dim to its example size (0/1 rule)"
        )
    vocab = vocab_size or model.config.vocab_size
    example = torch.randint(0, vocab, (example_batch, example_seq), dtype=torch.long)
    # Dim.DYNAMIC rather than named Dims with bounds: the graph constrains neither dim (RoPE
    # positions are computed, not looked up in a table), so there is no max to assert.
    dynamic = ({0: Dim.DYNAMIC, 1: Dim.DYNAMIC},)
    return torch.export.export(CausalLMWrapper(model), (example,), dynamic_shapes=dynamic)


def _as_ids(token_ids: torch.Tensor | Sequence[int]) -> torch.Tensor:
    ids = torch.as_tensor(token_ids, dtype=torch.long)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1:
        raise ValueError(
            f"token ids must be 1-D or [1, T]; got shape {tuple(ids.shape)} (one sequence only)"
        )
    return ids


def _logits(fn: LogitsFn, input_ids: torch.Tensor) -> torch.Tensor:
    out = fn(input_ids)
    # An AOTInductor package returns its flat outputs as a list; an eager HF model (called
    # without the wrapper) returns a ModelOutput. Accept both so any stage can be measured.
    if isinstance(out, (list, tuple)):
        out = out[0]
    out = getattr(out, "logits", out)
    if not isinstance(out, torch.Tensor) or out.dim() != 3:
        raise TypeError(
            "fn must map input_ids [B, T] to logits [B, T, V]; got "
            f"{type(out).__name__} {tuple(getattr(out, 'shape', ()))}"
        )
    return out


@torch.no_grad()
def perplexity(
    fn: LogitsFn,
    token_ids: torch.Tensor | Sequence[int],
    *,
    window: int = 512,
    max_tokens: int = 8192,
    progress: bool = True,
) -> float:
    """Perplexity of ``fn`` on the first ``max_tokens`` tokens, in non-overlapping windows.

    Each window starts fresh (no context carried over, no BOS), so the first token of every
    window is context only. A trailing window shorter than 2 tokens predicts nothing and is
    dropped.

    Args:
        fn: ``input_ids [1, T] → logits [1, T, V]``.
        token_ids: the tokenized text, 1-D or ``[1, N]``.
        window: tokens per forward pass.
        max_tokens: how much of the text to score (fewer if the text is shorter).
        progress: show a tqdm bar with the running perplexity.

    Returns:
        ``exp(mean NLL)`` over all predicted tokens.
    """
    if window < 2:
        raise ValueError(f"perplexity: window={window}; must be >= 2 (a window predicts L - 1)")
    ids = _as_ids(token_ids)[:max_tokens]
    starts = [s for s in range(0, ids.numel(), window) if ids.numel() - s >= 2]
    if not starts:
        raise ValueError(f"perplexity: need at least 2 tokens, got {ids.numel()}")

    from tqdm.auto import tqdm

    nll_sum, count = 0.0, 0
    bar = tqdm(starts, desc="perplexity", unit="win", disable=not progress, leave=False)
    for start in bar:
        chunk = ids[start : start + window].unsqueeze(0)
        logits = _logits(fn, chunk)
        if logits.shape[1] != chunk.shape[1]:
            raise ValueError(
                f"perplexity: {chunk.shape[1]} tokens in, logits for {logits.shape[1]} positions "
                "out; scoring needs every position's (an export_llm program or package returns "
                'the last one\'s unless exported with logits="all")'
            )
        # fp32 log-softmax whatever the model dtype: bf16 logits would round the NLL itself.
        nll = F.cross_entropy(logits[0, :-1].float(), chunk[0, 1:], reduction="sum")
        nll_sum += nll.item()
        count += chunk.shape[1] - 1
        bar.set_postfix(ppl=f"{math.exp(nll_sum / count):.2f}")
    return math.exp(nll_sum / count)


@torch.no_grad()
def greedy_decode(
    fn: LogitsFn,
    prompt_ids: torch.Tensor | Sequence[int],
    *,
    new_tokens: int = 16,
    step_times: list[float] | None = None,
) -> torch.Tensor:
    """Greedy-decode ``new_tokens`` tokens WITHOUT a KV cache; returns them as a 1-D tensor.

    Every step reruns ``fn`` on the whole growing sequence (prompt + tokens so far), because the
    exported graph takes only ``input_ids``. Step cost therefore grows with the length, and the
    result measures prefill-like work per token, not cached decoding.

    Args:
        step_times: if given, the wall time of each step (seconds) is appended to it.
    """
    seq = _as_ids(prompt_ids).unsqueeze(0)
    out = []
    for _ in range(new_tokens):
        t0 = time.perf_counter()
        next_id = _logits(fn, seq)[:, -1].argmax(dim=-1, keepdim=True)
        if step_times is not None:
            step_times.append(time.perf_counter() - t0)
        out.append(next_id)
        seq = torch.cat([seq, next_id], dim=1)
    return torch.cat(out, dim=1)[0]


def decode_tokens_per_s(
    fn: LogitsFn,
    prompt_ids: torch.Tensor | Sequence[int],
    *,
    new_tokens: int = 16,
) -> float:
    """Greedy decoding speed in tokens/s, WITHOUT a KV cache (see :func:`greedy_decode`).

    Each step reruns the full, growing sequence, so this compares implementations of the same
    graph (fp32 vs quantized, eager vs AOTInductor) rather than serving throughput. The first
    step is a warm-up (lazy init, allocator, first-call autotuning) and is excluded; the rate is
    ``1 / median`` of the other step times, which shrugs off a noisy step on a shared machine.

    Args:
        fn: ``input_ids [1, T] → logits [1, T, V]``.
        prompt_ids: 1-D or ``[1, T]`` prompt.
        new_tokens: tokens to generate, >= 2 (one warm-up plus at least one timed step).
    """
    if new_tokens < 2:
        raise ValueError(f"decode_tokens_per_s: new_tokens={new_tokens}; need >= 2 (1 warm-up)")
    times: list[float] = []
    greedy_decode(fn, prompt_ids, new_tokens=new_tokens, step_times=times)
    return 1.0 / statistics.median(times[1:])
