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


@pytest.mark.parametrize("stream", [True, False], ids=["rust-stream", "wrapper"])
@pytest.mark.parametrize("text", TEXTS)
def test_incremental_text_equals_full_decode(tokenizer: object, text: str, stream: bool) -> None:
    prompt = tokenizer.encode("Answer: ")  # type: ignore[attr-defined]
    ids = tokenizer.encode(text)  # type: ignore[attr-defined]
    detok = IncrementalDetokenizer(tokenizer, prompt, stream=stream)
    assert (detok._stream is not None) == stream
    deltas = [detok.push(t) for t in ids]
    assert "".join(deltas) == detok.text == text
    assert all("\ufffd" not in d for d in deltas)


@pytest.mark.parametrize("stream", [True, False], ids=["rust-stream", "wrapper"])
def test_special_tokens_are_skipped(tokenizer: object, stream: bool) -> None:
    ids = tokenizer.encode("Hi there<|im_end|>")  # type: ignore[attr-defined]
    detok = IncrementalDetokenizer(tokenizer, [], stream=stream)
    for t in ids:
        detok.push(t)
    assert detok.text == "Hi there"


def test_the_rust_stream_gives_the_wrapper_s_text_for_any_ids(tokenizer: object) -> None:
    """Random ids (byte pieces that split characters, special and added tokens, whatever a
    sampler may draw), each push's delta and the whole text: the same both ways."""
    import random

    vocab = tokenizer.backend_tokenizer.get_vocab_size()  # type: ignore[attr-defined]
    rng = random.Random(0)
    for _ in range(200):
        prompt = [rng.randrange(vocab) for _ in range(rng.randrange(0, 8))]
        ids = [rng.randrange(vocab) for _ in range(200)]
        fast = IncrementalDetokenizer(tokenizer, prompt)
        slow = IncrementalDetokenizer(tokenizer, prompt, stream=False)
        assert [fast.push(t) for t in ids] == [slow.push(t) for t in ids]
        assert fast.text == slow.text


def test_a_tokenizer_that_cleans_up_spaces_decodes_through_its_wrapper(tokenizer: object
                                                                        ) -> None:
    import copy

    cleaning = copy.deepcopy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True  # type: ignore[attr-defined]
    assert IncrementalDetokenizer(cleaning, [])._stream is None


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
