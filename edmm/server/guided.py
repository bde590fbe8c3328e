"""Grammar-constrained decoding with llguidance: forced tool calls and JSON-schema responses.

`GuidedDecoding` compiles, per request, a grammar for

- ``tool_choice="required"`` or a named function: one (or, with ``parallel_tool_calls``, several)
  ``<tool_call>`` blocks in the chat template's own format, each ``{"name": "<tool>",
  "arguments": <JSON matching that tool's parameters schema>}``;
- ``response_format`` ``json_schema`` / ``json_object``: a JSON value of the schema,

and turns it into a `GrammarLogitsProcessor` for the engine's per-request logits hook. JSON is
emitted with the separators Jinja's ``tojson`` uses (``", "`` and ``": "``) and no other
whitespace, so the arguments read exactly as the template would print them, and a random-weight
model cannot pad them with whitespace forever.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

import llguidance
import llguidance.hf
import numpy as np
import torch
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from edmm.server.errors import BadRequestError
from edmm.server.protocol import FunctionDefinition
from edmm.server.tool_parser import TOOL_CALL_END, TOOL_CALL_START

# Applied to every schema (a schema's own "x-guidance" may override them).
_JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False,
                 "lenient": True}
_ANY_OBJECT: dict[str, Any] = {"type": "object"}


class GrammarLogitsProcessor:
    """Masks the tokens a grammar forbids next; one per request (it is stateful).

    Called by the engine before each sampled token with the request's outputs so far; it feeds
    the matcher the tokens it has not seen, then keeps only the allowed tokens' logits. Once the
    grammar is complete only EOS is allowed, so the request stops there.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int,
                 eos_token_id: int) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._eos = eos_token_id
        self._consumed = 0
        self._bitmask = allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32

    def __call__(self, output_token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[V]`` with the forbidden tokens set to ``-inf``."""
        for token in output_token_ids[self._consumed:]:
            self._matcher.consume_token(token)
        self._consumed = len(output_token_ids)
        allowed = self._allowed()  # [V] bool
        return logits.masked_fill_(~allowed.to(logits.device), float("-inf"))

    @property
    def error(self) -> str:
        """Why the matcher rejected a token ("" while all is well)."""
        return str(self._matcher.get_error())

    def _allowed(self) -> torch.Tensor:
        allowed = torch.zeros(self._vocab_size, dtype=torch.bool)
        if self._matcher.is_error():
            allowed[self._eos] = True  # cannot happen when every token was masked; stop safely
            return allowed
        fill_next_token_bitmask(self._matcher, self._bitmask)
        bits = np.unpackbits(self._bitmask.view(np.uint8), bitorder="little")
        allowed = torch.from_numpy(bits[:self._vocab_size].astype(np.bool_))
        if not allowed.any():
            allowed[self._eos] = True
        return allowed


class GuidedDecoding:
    """Compiles grammars for one tokenizer; build once per server (it wraps the tokenizer)."""

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int) -> None:
        self._llt = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                 eos_token=eos_token_id)
        self._vocab_size = vocab_size
        self._eos = eos_token_id
        self._start_id = _single_token(tokenizer, TOOL_CALL_START)
        self._end_id = _single_token(tokenizer, TOOL_CALL_END)

    def tool_calls(self, functions: Sequence[FunctionDefinition],
                   parallel: bool) -> GrammarLogitsProcessor:
        """A processor forcing one call (several if ``parallel``) of one of ``functions``."""
        if not functions:
            raise BadRequestError("a forced tool choice needs at least one tool", param="tools")
        rules = [f"call_{i}: {_lark_string(_call_prefix(f.name))} "
                 f"{_lark_json(f.parameters or _ANY_OBJECT)} \"}}\""
                 for i, f in enumerate(functions)]
        alternatives = " | ".join(f"call_{i}" for i in range(len(functions)))
        lark = "\n".join([
            'start: block ("\\n" block)*' if parallel else "start: block",
            f'block: {self._open} "\\n" ({alternatives}) "\\n" {self._close}',
            *rules,
        ])
        return self._processor(lark, "tools")

    def json_schema(self, schema: dict[str, Any] | None) -> GrammarLogitsProcessor:
        """A processor forcing a JSON value of ``schema`` (any object if None)."""
        return self._processor(f"start: {_lark_json(schema or _ANY_OBJECT)}", "response_format")

    @property
    def _open(self) -> str:
        return f"<[{self._start_id}]>" if self._start_id is not None else _lark_string(
            TOOL_CALL_START)

    @property
    def _close(self) -> str:
        return f"<[{self._end_id}]>" if self._end_id is not None else _lark_string(
            TOOL_CALL_END)

    def _processor(self, lark: str, param: str) -> GrammarLogitsProcessor:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._llt)
        if is_error:
            raise BadRequestError(f"invalid JSON schema: {messages[0]}", param=param)
        matcher = llguidance.LLMatcher(self._llt, grammar, log_level=0)
        if matcher.is_error():
            raise BadRequestError(f"invalid JSON schema: {matcher.get_error()}", param=param)
        return GrammarLogitsProcessor(matcher, self._vocab_size, self._eos)


def _call_prefix(name: str) -> str:
    return '{"name": ' + json.dumps(name) + ', "arguments": '


def _lark_string(text: str) -> str:
    """A Lark string literal of ``text``."""
    return json.dumps(text)


def _lark_json(schema: dict[str, Any]) -> str:
    """An inline ``%json`` rule for ``schema`` with this module's JSON options."""
    if not isinstance(schema, dict):
        raise BadRequestError("a JSON schema must be an object", param="parameters")
    options = {**_JSON_OPTIONS, **schema.get("x-guidance", {})}
    return "%json " + json.dumps({**schema, "x-guidance": options})


def _single_token(tokenizer: Any, text: str) -> int | None:
    """The id of ``text`` if the tokenizer has it as one token, else None."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None
