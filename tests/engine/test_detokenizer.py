"""Incremental detokenization and stop strings, with the tiny model's byte-level tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from edmm.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from edmm.model import load_tokenizer

TEXTS = [
    "The weather in Paris is sunny today, with a high of 24 degrees.",
    "Zürich — naïve café, 東京 and emoji 🙂🚀 split over byte-level pieces.",
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
]


@pytest.fixture(scope="module")
def tokenizer(tiny_dir: Path) -> object:
    return load_tokenizer(tiny_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tokenizer: object, text: str) -> None:
    prompt = tokenizer.encode("Answer: ")  # type: ignore[attr-defined]
    ids = tokenizer.encode(text)  # type: ignore[attr-defined]
    detok = IncrementalDetokenizer(tokenizer, prompt)
    deltas = [detok.push(t) for t in ids]
    assert "".join(deltas) == detok.text == text
    assert all("\ufffd" not in d for d in deltas)


def test_special_tokens_are_skipped(tokenizer: object) -> None:
    ids = tokenizer.encode("Hi there<|im_end|>")  # type: ignore[attr-defined]
    detok = IncrementalDetokenizer(tokenizer, [])
    for t in ids:
        detok.push(t)
    assert detok.text == "Hi there"


def test_stop_strings_across_pushes() -> None:
    matcher = StopStringMatcher(["STOP", "\n\n"])
    text = ""
    for piece in ["Hello S", "TO", "P and more"]:
        text += piece
        cut, matched = matcher.check(text, len(piece))
        if matched:
            break
    assert (cut, matched) == ("Hello ", "STOP")
    assert StopStringMatcher([]).check("a\n\nb", 4) == ("a\n\nb", None)
    assert StopStringMatcher(["b", "\n\n"]).check("a\n\nb", 4) == ("a", "\n\n")
