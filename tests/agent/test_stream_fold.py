"""`StreamFold`: streamed tool output folded chunk by chunk equals the whole text tokenized
(for a word-level pre-tokenizer), and the work stops at the context."""

from __future__ import annotations

import itertools
import json
import re
from collections.abc import Callable

from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from edmm.agent.speculation import MAX_CHARS_PER_TOKEN, MAX_TAIL_CHARS, StreamFold

_WORD = re.compile(r" ?[^\s]+|\s+(?!\S)|\s+")  # GPT-2 style: a space starts the next word
# GPT-2's pre-tokenizer (ASCII): letters, digits and punctuation runs apart
_BPE = re.compile(r" ?[A-Za-z]+| ?[0-9]+| ?[^\sA-Za-z0-9]+|\s+(?!\S)|\s+")


def encode(text: str) -> list[int]:
    """A word-level tokenizer: one id per pre-token (its text's code points summed)."""
    return [sum(map(ord, m.group())) for m in _WORD.finditer(text)]


def encode_bpe(text: str) -> list[int]:
    """One id per GPT-2 pre-token."""
    return [sum(map(ord, m.group())) for m in _BPE.finditer(text)]


class Counting:
    def __init__(self, encoder: Callable[[str], list[int]] = encode) -> None:
        self.chars = 0
        self.encoder = encoder

    def __call__(self, text: str) -> list[int]:
        self.chars += len(text)
        return self.encoder(text)


TEXT = st.text(alphabet=st.sampled_from("ab \n"), max_size=60)


@settings(max_examples=examples(200), deadline=None)
@given(text=TEXT, cuts=st.lists(st.integers(0, 60), max_size=6))
def test_folding_chunks_equals_encoding_the_whole(text: str, cuts: list[int]) -> None:
    fold = StreamFold(True, head=[1, 2])
    bounds = sorted({0, len(text), *(min(c, len(text)) for c in cuts)})
    ids = None
    for start, end in itertools.pairwise(bounds):
        ids = fold.extend(text[start:end], encode, None)
    if ids is not None:
        assert ids == [1, 2, *encode(text)]


def test_work_is_bounded_by_the_context() -> None:
    """Megabytes of output into a small context: tokenized up to the budget once, then
    nothing (no speculation past the context)."""
    counting = Counting()
    fold = StreamFold(True, head=[0] * 10)
    chunk = "word " * 200_000  # 1 MB
    results = [fold.extend(chunk, counting, 100) for _ in range(4)]
    assert fold.full and results[1:] == [None, None, None]
    assert counting.chars <= 2 * 100 * MAX_CHARS_PER_TOKEN


def test_token_id_chunks_are_appended() -> None:
    fold = StreamFold(False, head=[7])
    assert fold.extend([1, 2], encode, 10) == [7, 1, 2]
    assert fold.extend([3], encode, 10) == [7, 1, 2, 3]
    assert fold.extend(list(range(20)), encode, 10) is None and fold.full


MINIFIED = json.dumps([{"id": i, "name": f"item{i}", "tags": ["a", "b"], "ok": i % 2 == 0}
                       for i in range(300)], separators=(",", ":"))  # no whitespace: 15 kB


@settings(max_examples=examples(20), deadline=None)
@given(sizes=st.lists(st.integers(1, 40), min_size=1, max_size=20))
def test_text_without_whitespace_costs_each_chunk_a_bounded_tail(sizes: list[int]) -> None:
    """Minified JSON streamed in small chunks: each chunk encodes its own length plus at most
    a bounded tail again (the whole tail each time before: quadratic), and where punctuation
    follows a word the cut is a pre-token boundary, so the ids are the whole text's."""
    counting = Counting(encode_bpe)
    fold = StreamFold(True, head=[5])
    chunks, start = [], 0
    for size in itertools.cycle(sizes):
        if start >= len(MINIFIED):
            break
        chunks.append(MINIFIED[start:start + size])
        start += size
    for chunk in chunks:
        ids = fold.extend(chunk, counting, None)
    assert ids == [5, *encode_bpe(MINIFIED)]
    assert len(fold.tail) <= MAX_TAIL_CHARS
    assert counting.chars <= 3 * len(MINIFIED) + 2 * MAX_TAIL_CHARS * len(chunks)


def test_a_tail_without_any_boundary_is_cut_anyway() -> None:
    """Base64-like text (letters and digits only) one character at a time: bounded work."""
    counting = Counting()
    fold = StreamFold(True, head=[])
    text = "QUJD" * 5000  # 20,000 characters
    for char in text:
        fold.extend(char, counting, None)
    assert len(fold.tail) <= MAX_TAIL_CHARS
    assert counting.chars <= 3 * MAX_TAIL_CHARS * len(text)  # ~2e8 before: the whole tail
