"""Incremental detokenization and stop strings, one request at a time.

Decoding the whole output after every token costs O(n^2). `IncrementalDetokenizer` decodes only a
short window (vLLM's prefix/read offsets): the text of the new tokens is the decoding of
``ids[prefix:]`` minus the decoding of ``ids[prefix:read]``, so tokenizers whose pieces depend on
their left neighbour (SentencePiece's leading spaces, byte-level pieces of one character) come out
right. A few prompt tokens seed the window so the first output token has left context too, and
text ending in an incomplete UTF-8 sequence (U+FFFD) is held back until the next token completes it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from edmm.engine.sampling import truncate_at_stop

_PROMPT_CONTEXT = 5  # prompt tokens decoded with the first output tokens (as in vLLM)


class IncrementalDetokenizer:
    """Text of a growing list of output tokens; see the module docstring."""

    def __init__(self, tokenizer: Any, prompt_token_ids: Sequence[int],
                 skip_special_tokens: bool = True) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._ids = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix = 0
        self._read = len(self._ids)
        self.text = ""

    def push(self, token_id: int) -> str:
        """Append one output token; return the text it completes (possibly empty)."""
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
