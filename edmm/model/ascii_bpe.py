"""ASCII text through tiktoken's BPE, with the tokenizer's own vocabulary.

A resume's encoding is its tool result (`edmm.model.prompt_encoder`), and Hugging Face's fast
tokenizer spends ~2-3 µs a word on it whatever the word (measured on the development CPU: 1.5
ms for a 512-token result; the normaliser, the pre-tokenizer's splits with their alignments,
the byte-level mapping and the encoding's token strings, much more than the BPE merges
themselves). ``tiktoken`` runs the same pipeline without that bookkeeping, ~6-8x faster on the
same text.

`AsciiBPE.of` takes that route only where the two pipelines are the same:

- the pipeline is one `cuttable` tokenizer's: byte-level BPE (no dropout, no word prefix or
  suffix, no byte fallback) after the Qwen2 or Llama 3 split pattern, with NFC or no
  normaliser; tiktoken runs the same pattern;
- the vocabulary's ids are BPE ranks: every byte is a token, and the merges are listed in
  the order of the ids they make (tiktoken merges the adjacent pair whose concatenation has
  the lowest id; Hugging Face the adjacent listed pair listed first). The vocabularies
  converted from tiktoken ranks (`edmm.model.qwen_vocab`, transformers' ``TikTokenConverter``)
  are such;
- the text is ASCII (`encode` is only given ASCII text). There NFC changes nothing, and the
  pattern's classes (``\\p{L}``, ``\\p{N}``, ``\\s``) mean the same to both regex engines;
  outside it their Unicode tables and normalisers may differ by version.

What stays an assumption, not a proof: that the two pick the same merges on every word. Two
ways they can part are known: tiktoken takes a pre-token that is itself a token whole,
without merging (Hugging Face does so only with ``ignore_merges``), so a word whose merges
stop short of it differs; and where two overlapping pairs make the same token, tiktoken
merges the left one, Hugging Face the one listed first. Neither happened on ~41 M tokens of
ASCII source files under Qwen's ranks, with every split of a token listed as a merge
(`edmm.model.qwen_vocab.bpe_merges`) or with one recovered merge per token, the form of
Qwen2.5's published tokenizer.json (`edmm.model.qwen_vocab.recovered_merges`;
``python -m benchmarks.scripts.ascii_bpe_check`` checks a corpus). The tests compare the two
on random ASCII text. ``PromptEncoder(fast_bpe=False)`` turns it off.
"""

from __future__ import annotations

import json
from functools import lru_cache
from typing import Any


@lru_cache(maxsize=1)
def byte_alphabet() -> tuple[str, ...]:
    """GPT-2's byte-level alphabet: the printable character standing for each byte."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1),
            *range(ord("®"), ord("ÿ") + 1)]
    table: dict[int, str] = {b: chr(b) for b in keep}
    extra = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + extra)
            extra += 1
    return tuple(table[b] for b in range(256))


class AsciiBPE:
    """tiktoken's encoder over a Hugging Face tokenizer's ranks, for ASCII text (see the
    module docstring); build it with `of`."""

    def __init__(self, encoding: Any) -> None:
        self._encoding = encoding

    @classmethod
    def of(cls, fast: Any, pattern: str) -> AsciiBPE | None:
        """The encoder for the ``tokenizers.Tokenizer`` ``fast`` whose split pattern is
        ``pattern`` (already found `cuttable`), or None where tiktoken is missing or the
        BPE model is not one whose ids are ranks."""
        try:
            import tiktoken
        except ImportError:
            return None
        try:
            model = json.loads(fast.model.__getstate__())
        except (AttributeError, TypeError, ValueError):
            return None
        ranks = _ranks(model)
        if ranks is None:
            return None
        return cls(tiktoken.Encoding("edmm-ascii-bpe", pat_str=pattern,
                                     mergeable_ranks=ranks, special_tokens={}))

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``, which must be ASCII and hold no added token."""
        return self._encoding.encode_ordinary(text)


def vocab_bytes(vocab: dict[str, int]) -> dict[bytes, int] | None:
    """A byte-level ``tokenizer.json`` vocabulary keyed by its tokens' bytes, or None if a
    token holds a character outside the byte-level alphabet."""
    alphabet = byte_alphabet()
    letters = set(alphabet)
    if any(not letters.issuperset(token) for token in vocab):
        return None
    to_latin1 = {ord(c): chr(b) for b, c in enumerate(alphabet)}
    return {token.translate(to_latin1).encode("latin-1"): i for token, i in vocab.items()}


def _ranks(model: dict[str, Any]) -> dict[bytes, int] | None:
    """The BPE ``model``'s vocabulary as tiktoken ranks (token bytes -> id), or None unless
    its ids are ranks its merges follow (see the module docstring)."""
    if (model.get("type") != "BPE" or model.get("dropout") is not None
            or model.get("continuing_subword_prefix") or model.get("end_of_word_suffix")
            or model.get("byte_fallback")):
        return None
    vocab: dict[str, int] = model.get("vocab") or {}
    ranks = vocab_bytes(vocab)
    if ranks is None or len(ranks) != len(vocab) or any(bytes([b]) not in ranks
                                                         for b in range(256)):
        return None
    last = -1
    for merge in model.get("merges") or []:
        left, right = merge.split(" ", 1) if isinstance(merge, str) else merge
        a, b, made = vocab.get(left), vocab.get(right), vocab.get(left + right)
        if a is None or b is None or made is None or made < last:
            return None
        last = made
    return ranks

