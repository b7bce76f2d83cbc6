"""Run an LLM package: load, check, prefill, decode, sample, stream text. Torch only.

Where this sits: the far end of the data flow, in the process that serves the artifact.
``fxquant.export_llm`` → ``fxquant.quantize`` → ``fxquant.aot_compile`` make an AOTInductor
package whose metadata says what it serves (cache length, batch, vocabulary, EOS ids, the
torch, device and CPU it was built for); this module reads that metadata straight from the
package file, refuses a request the package cannot serve before anything runs, then drives the
package: one call prefills the prompt, one call per new token decodes, the KV cache living in
the package.

It imports torch and the standard library only (the tokenizer is any object with ``encode`` /
``decode`` or ``__call__``, e.g. a transformers tokenizer): a serving process needs neither
fxquant's passes nor transformers. ``fxquant generate`` and ``fxquant.generate`` are this.
"""

from __future__ import annotations

import json
import os
import time
import zipfile
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

__all__ = [
    "METADATA_KEY",
    "isa_flags",
    "GenerationStats",
    "LLMPackage",
    "PackageError",
    "Stream",
    "generate",
    "read_package_metadata",
]

METADATA_KEY = "fxquant_llm"  # the package metadata entry (a JSON string) aot_compile writes


class PackageError(ValueError):
    """A package or request this runtime cannot serve; the message says what and why."""


def read_package_metadata(path: str | os.PathLike) -> dict[str, str]:
    """The AOTInductor metadata of a ``.pt2`` package, read from the file (nothing is loaded)."""
    path = Path(path)
    if not path.is_file():
        raise PackageError(f"{path}: no such file")
    try:
        with zipfile.ZipFile(path) as zf:
            names = [n for n in zf.namelist() if n.endswith("wrapper_metadata.json")]
            if not names:
                raise PackageError(
                    f"{path}: not an AOTInductor package (no wrapper_metadata.json inside); "
                    "make one with fxquant.aot_compile"
                )
            return json.loads(zf.read(names[0]))
    except zipfile.BadZipFile as exc:
        raise PackageError(f"{path}: not an AOTInductor package (not a zip file: {exc})") from exc


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


_ISA_PREFIXES = ("avx", "amx", "sse", "ssse", "fma", "f16c", "bmi", "vnni", "vpclmul", "gfni")


def isa_flags() -> list[str]:
    """This CPU's vector-ISA flags (what ``-march=native`` code may use), for a package's
    metadata: the runtime refuses a package whose builder had flags this CPU lacks."""
    return sorted(f for f in _cpu_flags() if f.startswith(_ISA_PREFIXES))


def _check_machine(path: Path, info: dict[str, Any], meta: dict[str, str]) -> None:
    built_torch = info.get("torch")
    if built_torch and built_torch != torch.__version__:
        raise PackageError(
            f"{path}: built with torch {built_torch}, this is torch {torch.__version__}; "
            "AOTInductor packages run only on the torch that built them: rebuild it here"
        )
    device = meta.get("AOTI_DEVICE_KEY", "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise PackageError(f"{path}: built for {device}, and this machine has no CUDA device")
    # a CPU package is compiled with -march=native: every vector feature of the machine that
    # built it must be here, or its kernels stop on an illegal instruction
    needed = set(info.get("isa_flags", []))
    have = _cpu_flags()
    if needed and have and not needed <= have:
        missing = ", ".join(sorted(needed - have))
        raise PackageError(
            f"{path}: built on a CPU with {missing}, which this CPU lacks; rebuild the package "
            "on this machine (its kernels are compiled for the machine that built them)"
        )


@dataclass
class GenerationStats:
    """What one generation took: prefill and per-token decode times, tokens, why it stopped."""

    prompt_tokens: int = 0
    new_tokens: int = 0
    prefill_s: float = 0.0
    decode_s: list[float] = field(default_factory=list)  # one per decoded token
    sample_s: float = 0.0  # sampler and tokenizer time, outside the package calls
    stop_reason: str = ""

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prompt_tokens / self.prefill_s if self.prefill_s else 0.0

    @property
    def decode_tokens_per_s(self) -> float:
        """1 / the median decode step (the first step after prefill included)."""
        if not self.decode_s:
            return 0.0
        steps = sorted(self.decode_s)
        return 1.0 / steps[len(steps) // 2]

    def summary(self) -> str:
        return (
            f"prefill {self.prompt_tokens} tok in {self.prefill_s:.2f} s "
            f"({self.prefill_tokens_per_s:.0f} tok/s) · decode {self.new_tokens} tok at "
            f"{self.decode_tokens_per_s:.1f} tok/s"
        )


class LLMPackage:
    """A loaded LLM package: ``pkg(input_ids, cache_position) → logits`` plus its metadata.

    Args:
        path: an AOTInductor ``.pt2`` made by ``fxquant.aot_compile`` from an
            ``fxquant.export_llm`` program.

    Raises:
        PackageError: not such a package, or one built for another torch, device or CPU.
    """

    def __init__(self, path: str | os.PathLike) -> None:
        self.path = Path(path)
        self.metadata = read_package_metadata(self.path)
        text = self.metadata.get(METADATA_KEY)
        if not text:
            raise PackageError(
                f"{self.path}: an AOTInductor package, but not an LLM one (no {METADATA_KEY} "
                "metadata): build it from fxquant.export_llm(model) with fxquant.aot_compile"
            )
        self.info: dict[str, Any] = json.loads(text)
        _check_machine(self.path, self.info, self.metadata)
        self._run = torch._inductor.aoti_load_package(str(self.path))

    @property
    def max_cache_len(self) -> int:
        return int(self.info["max_cache_len"])

    @property
    def max_batch(self) -> int:
        return int(self.info["max_batch"])

    @property
    def vocab_size(self) -> int:
        return int(self.info["vocab_size"])

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.info.get("eos_token_ids") or [])

    def check(self, batch: int, positions: int) -> None:
        """Refuse, before any computation, a request the package cannot hold."""
        if batch > self.max_batch:
            raise PackageError(
                f"batch {batch} is above this package's max_batch={self.max_batch}; export "
                f"with fxquant.export_llm(model, max_batch={batch})"
            )
        if positions > self.max_cache_len:
            raise PackageError(
                f"{positions} positions (prompt + new tokens) do not fit this package's "
                f"max_cache_len={self.max_cache_len}; shorten the prompt or max_new_tokens, or "
                f"export with a larger max_cache_len"
            )

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, cache_position: torch.Tensor) -> torch.Tensor:
        """Logits [B, L, V] for ``input_ids`` [B, T] at ``cache_position`` [T] (B <= max_batch;
        fewer rows are padded with copies of the first, and their logits dropped): L = 1, the
        last position's, unless the program was exported with ``logits="all"`` (L = T)."""
        # Everything the compiled code would index with is checked here: it has no bounds
        # checks of its own (an id past the vocabulary or a position past the cache would read
        # or write outside its buffers).
        if input_ids.dim() != 2 or input_ids.shape[1] == 0:
            raise PackageError(
                f"input_ids must be [batch, T] with T >= 1, got {tuple(input_ids.shape)}"
            )
        b, t = input_ids.shape
        start = int(cache_position[0]) if cache_position.numel() else -1
        if (
            cache_position.shape != (t,)
            or start < 0
            or not torch.equal(cache_position.to(torch.long), torch.arange(start, start + t))
        ):
            raise PackageError(
                f"cache_position must be the {t} consecutive positions of the tokens, "
                f"arange(p, p + {t}) with p >= 0; got {cache_position.tolist()[:8]}"
            )
        lo, hi = int(input_ids.min()), int(input_ids.max())
        if lo < 0 or hi >= self.vocab_size:
            raise PackageError(
                f"token ids must be in [0, {self.vocab_size}); got ids from {lo} to {hi}"
            )
        self.check(b, start + t)
        if b < self.max_batch:
            input_ids = torch.cat([input_ids, input_ids[:1].expand(self.max_batch - b, -1)])
        out = self._run(input_ids.to(torch.long), cache_position.to(torch.long))
        out = out[0] if isinstance(out, (list, tuple)) else out
        return out[:b]


# --------------------------------------------------------------------------------------------
# Sampling and the generation loop
# --------------------------------------------------------------------------------------------


def _sample(
    logits: torch.Tensor, *, temperature: float, top_k: int, top_p: float, gen: torch.Generator
) -> int:
    """One token id from logits [V]: greedy at temperature 0, else top-k / top-p sampling."""
    if temperature <= 0:
        return int(logits.argmax())
    logits = logits.float() / temperature
    if 0 < top_k < logits.numel():
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True)
        keep = torch.cumsum(sorted_p, 0) - sorted_p < top_p  # the smallest set reaching top_p
        probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
    return int(torch.multinomial(probs / probs.sum(), 1, generator=gen))


def _encode(tokenizer, text: str) -> list[int]:
    if hasattr(tokenizer, "encode"):
        return list(tokenizer.encode(text, add_special_tokens=False))
    return list(tokenizer(text)["input_ids"])


def _check_tokenizer(tokenizer, pkg: LLMPackage) -> None:
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else getattr(tokenizer, "vocab_size", 0)
    if size and size > pkg.vocab_size:
        raise PackageError(
            f"the tokenizer has {size} tokens but the package's model has a vocabulary of "
            f"{pkg.vocab_size}: they do not belong together (wrong tokenizer for this model?)"
        )


class Stream:
    """An iterator of text pieces as they are generated; ``stats`` and ``token_ids`` after."""

    def __init__(self, run: Callable[[], Iterator[str]], stats: GenerationStats) -> None:
        self._it = run()
        self.stats = stats
        self.token_ids: list[int] = []

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> str:
        return next(self._it)

    def text(self) -> str:
        """Run to the end and return the whole completion."""
        return "".join(self)


def generate(
    package: LLMPackage | str | os.PathLike,
    tokenizer,
    prompt: str | Sequence[int],
    *,
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    top_k: int = 0,
    top_p: float = 1.0,
    seed: int | None = None,
    stop_at_eos: bool = True,
) -> Stream:
    """Generate a completion of ``prompt`` with an LLM package, streamed as text.

    Args:
        package: a loaded :class:`LLMPackage` or the path of one.
        tokenizer: encodes the prompt (``encode`` or ``__call__``) and decodes the new tokens.
        prompt: text, or token ids already encoded.
        max_new_tokens: stop after this many new tokens.
        temperature: 0 (default) is greedy; above 0 samples, restricted by ``top_k`` (0: all)
            and ``top_p`` (nucleus, 1.0: all), reproducibly when ``seed`` is given.
        stop_at_eos: stop at one of the model's EOS tokens (not yielded).

    Returns:
        A :class:`Stream`: iterate it for text pieces (``"".join`` is the completion); then
        ``stream.stats`` holds prefill / decode times and ``stream.token_ids`` the new ids.

    Raises:
        PackageError: before anything runs, when prompt + ``max_new_tokens`` exceed the cache,
            or the tokenizer's vocabulary is larger than the model's.
    """
    pkg = package if isinstance(package, LLMPackage) else LLMPackage(package)
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens}; allowed: >= 0")
    if temperature < 0 or not 0 < top_p <= 1 or top_k < 0:
        raise ValueError(
            f"temperature={temperature}, top_k={top_k}, top_p={top_p}; allowed: temperature "
            ">= 0, top_k >= 0, 0 < top_p <= 1"
        )
    _check_tokenizer(tokenizer, pkg)
    ids = list(prompt) if not isinstance(prompt, str) else _encode(tokenizer, prompt)
    if not ids:
        raise ValueError("generate: the prompt has no tokens")
    pkg.check(1, len(ids) + max_new_tokens)
    stats = GenerationStats(prompt_tokens=len(ids))
    gen = torch.Generator().manual_seed(seed if seed is not None else 0)
    if seed is None and temperature > 0:
        gen.seed()
    eos = set(pkg.eos_token_ids) if stop_at_eos else set()

    def run() -> Iterator[str]:
        t0 = time.perf_counter()
        logits = pkg(torch.tensor([ids]), torch.arange(len(ids)))[0, -1]
        stats.prefill_s = time.perf_counter() - t0
        if max_new_tokens == 0:
            stats.stop_reason = "max_new_tokens"
            return
        new: list[int] = stream.token_ids
        shown = ""
        pos = len(ids)
        while True:
            t0 = time.perf_counter()
            token = _sample(logits, temperature=temperature, top_k=top_k, top_p=top_p, gen=gen)
            if token in eos:
                stats.stop_reason = "eos"
                stats.sample_s += time.perf_counter() - t0
                return
            new.append(token)
            stats.new_tokens = len(new)
            text = tokenizer.decode(new, skip_special_tokens=True)
            # a token may end inside a multi-byte character: wait for the rest of it
            piece = "" if text.endswith("\ufffd") else text[len(shown) :]
            stats.sample_s += time.perf_counter() - t0
            if piece:
                shown += piece
                yield piece
            if len(new) >= max_new_tokens:
                stats.stop_reason = "max_new_tokens"
                return
            t0 = time.perf_counter()
            logits = pkg(torch.tensor([[token]]), torch.tensor([pos]))[0, -1]
            stats.decode_s.append(time.perf_counter() - t0)
            pos += 1

    stream = Stream(run, stats)
    return stream
