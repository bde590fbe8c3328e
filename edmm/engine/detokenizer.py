"""Incremental detokenization and stop strings, one request at a time.

Decoding the whole output after every token costs O(n^2). `IncrementalDetokenizer` decodes only a
short window (vLLM's prefix/read offsets): the text of the new tokens is the decoding of
``ids[prefix:]`` minus the decoding of ``ids[prefix:read]``, so tokenizers whose pieces depend on
their left neighbour (SentencePiece's leading spaces, byte-level pieces of one character) come out
right. A few prompt tokens seed the window so the first output token has left context too, and
text ending in an incomplete UTF-8 sequence (U+FFFD) is held back until the next token completes it.
With a tokenizer backed by `tokenizers` (a fast HF tokenizer without clean-up of spaces), the same
window runs in Rust (`tokenizers.decoders.DecodeStream`, as vLLM's fast detokenizer): one call per
token instead of two decodes through the Python wrapper (~1.6 against ~10.6 us a token on the
tiny model's tokenizer, this sandbox's CPU), the same text (tests/engine/test_detokenizer.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from tokenizers import Tokenizer
from tokenizers.decoders import DecodeStream

from edmm.engine.sampling import truncate_at_stop

_PROMPT_CONTEXT = 5  # prompt tokens decoded with the first output tokens (as in vLLM)


class IncrementalDetokenizer:
    """Text of a growing list of output tokens; see the module docstring."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True, stream: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""
        # The Rust window (see the module docstring); None: decodes through the wrapper.
        self._stream: tuple[DecodeStream, Tokenizer] | None = None
        backend = _stream_backend(tokenizer) if stream else None
        if backend is not None:
            window = DecodeStream(skip_special_tokens=skip_special_tokens)
            pending = False
            for token in self._ids:  # left context, its text discarded
                pending = window.step(backend, token) is None
            # A context ending in an unfinished character would flush it into the output's
            # text: such a request decodes through the wrapper, which leaves it to the prompt.
            if not pending:
                self._stream = (window, backend)

    def push(self, token_id: int) -> str:
        """Append one output token; return the text it completes (possibly empty)."""
        if self._stream is not None:
            window, backend = self._stream
            delta = window.step(backend, token_id) or ""
            self.text += delta
            return delta
        self._ids.append(token_id)
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) <= len(before) or after.endswith("\ufffd"):
            return ""
        delta = after[len(before):]
        self._prefix, self._read = self._read, len(self._ids)
        self.text += delta
        return delta

    def _decode(self, ids: list[int]) -> str:
        return str(self._tokenizer.decode(ids, skip_special_tokens=self._skip_special))


def _stream_backend(tokenizer: Any) -> Tokenizer | None:
    """The `tokenizers.Tokenizer` whose decoding is ``tokenizer``'s, or None (a tokenizer of
    another kind, or one that cleans up spaces after decoding)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if not isinstance(backend, Tokenizer) or getattr(tokenizer, "clean_up_tokenization_spaces",
                                                     False):
        return None
    return backend


class StopStringMatcher:
    """Finds the earliest stop string in a growing text, scanning each character about once."""

    def __init__(self, stop: Sequence[str]) -> None:
        self.stop = list(stop)
        self._overlap = max((len(s) for s in self.stop), default=0) - 1

    def check(self, text: str, new_chars: int) -> tuple[str, str | None]:
        """``(text cut before the first stop string, that string)`` or ``(text, None)``;
        only the last ``new_chars`` characters of ``text`` are new since the previous call."""
        if not self.stop or new_chars == 0:
            return text, None
        return truncate_at_stop(text, self.stop, len(text) - new_chars - self._overlap)
