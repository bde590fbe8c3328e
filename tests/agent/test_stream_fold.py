"""`StreamFold`: streamed tool output folded chunk by chunk equals the whole text tokenized
(for a word-level pre-tokenizer), and the work stops at the context."""

from __future__ import annotations

import itertools
import re

from hypothesis import given, settings
from hypothesis import strategies as st
from tiers import examples

from edmm.agent.speculation import MAX_CHARS_PER_TOKEN, StreamFold

_WORD = re.compile(r" ?[^\s]+|\s+(?!\S)|\s+")  # GPT-2 style: a space starts the next word


def encode(text: str) -> list[int]:
    """A word-level tokenizer: one id per pre-token (its text's code points summed)."""
    return [sum(map(ord, m.group())) for m in _WORD.finditer(text)]


class Counting:
    def __init__(self) -> None:
        self.chars = 0

    def __call__(self, text: str) -> list[int]:
        self.chars += len(text)
        return encode(text)


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
