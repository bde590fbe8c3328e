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

Token masks are computed on the engine thread, between everyone's steps, so a grammar's cost is
budgeted (`GrammarBudget`): a grammar whose first mask takes too long is refused when compiled
(400), and a processor whose masks cost too much on average stops (`GrammarLogitsProcessor.
failure`; the server ends that request with an error). llguidance's messages reach clients
without Rust backtraces or grammar listings (`clean_message`).
"""

from __future__ import annotations

import json
import re
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
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
_CHECKED_SCHEMAS = 256  # tool schemas remembered as valid (agents send the same tools each turn)
_MAX_MESSAGE_CHARS = 500
# Bounds that no value meets when the first is over the second (llguidance drops such an
# optional property silently instead of refusing the schema).
_BOUND_PAIRS = (("minimum", "maximum"), ("minLength", "maxLength"), ("minItems", "maxItems"),
                ("minProperties", "maxProperties"))


@dataclass(frozen=True)
class GrammarBudget:
    """What computing one request's token masks may cost the shared engine thread.

    Attributes:
        first_mask_s: the first mask, computed when the grammar is compiled; over it the
            request is refused (400).
        mask_s: the mean time per mask while generating, counted after ``grace_masks``; over
            it the processor stops (`GrammarLogitsProcessor.failure`).
        grace_masks: masks granted before the mean counts (a lexer's states are built lazily).
    """

    first_mask_s: float = 0.05
    mask_s: float = 0.01
    grace_masks: int = 8


class GrammarLogitsProcessor:
    """Masks the tokens a grammar forbids next; one per request (it is stateful).

    Called by the engine before each sampled token with the request's outputs so far; it feeds
    the matcher the tokens it has not seen, then keeps only the allowed tokens' logits. Once the
    grammar is complete only EOS is allowed, so the request stops there.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int,
                 eos_token_id: int, budget: GrammarBudget | None = None,
                 param: str | None = None) -> None:
        self._matcher = matcher
        self._vocab_size = vocab_size
        self._eos = eos_token_id
        self._consumed = 0
        self._bitmask = allocate_token_bitmask(1, vocab_size)  # [1, ceil(V / 32)] int32
        self._budget = budget or GrammarBudget()
        self._masks = 0
        self._mask_time_s = 0.0
        self.failure: str | None = None  # why the processor stopped (its masks cost too much)
        self.param = param  # the request parameter the grammar comes from

    def __call__(self, output_token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[V]`` with the forbidden tokens set to ``-inf`` (once the processor has
        stopped: everything but EOS, at no cost)."""
        if self.failure is not None:
            return self._only_eos(logits)
        for token in output_token_ids[self._consumed:]:
            self._matcher.consume_token(token)
        self._consumed = len(output_token_ids)
        t0 = time.perf_counter()
        allowed = self._allowed()  # [V] bool
        self._spend(time.perf_counter() - t0)
        return logits.masked_fill_(~allowed.to(logits.device), float("-inf"))

    def first_mask_time(self) -> float:
        """Compute the mask of the grammar's start (lexer states are built) and return how
        long it took."""
        t0 = time.perf_counter()
        fill_next_token_bitmask(self._matcher, self._bitmask)
        return time.perf_counter() - t0

    def _spend(self, seconds: float) -> None:
        self._masks += 1
        self._mask_time_s += seconds
        budget = self._budget
        if self._mask_time_s > budget.mask_s * (self._masks + budget.grace_masks):
            self.failure = (f"the grammar is too costly to enforce: its token masks took "
                            f"{self._mask_time_s / self._masks * 1e3:.1f} ms each on average, "
                            f"over the budget of {budget.mask_s * 1e3:g} ms")

    def _only_eos(self, logits: torch.Tensor) -> torch.Tensor:
        eos = logits[self._eos].clone()
        logits.fill_(float("-inf"))
        logits[self._eos] = eos
        return logits

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

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int,
                 budget: GrammarBudget | None = None) -> None:
        self._llt = llguidance.hf.from_tokenizer(tokenizer, n_vocab=vocab_size,
                                                 eos_token=eos_token_id)
        self.budget = budget or GrammarBudget()
        self._checked: OrderedDict[str, None] = OrderedDict()
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
                 f"{_lark_json(f.parameters or _ANY_OBJECT, 'tools')} \"}}\""
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
        return self._processor(f"start: {_lark_json(schema or _ANY_OBJECT, 'response_format')}",
                               "response_format")

    def check_schema(self, schema: Any, param: str) -> None:
        """400 unless ``schema`` compiles as a JSON schema (what a forced call would use);
        schemas found valid are remembered."""
        key = json.dumps(schema, sort_keys=True)
        if key in self._checked:
            self._checked.move_to_end(key)
            return
        _check_bounds(schema, param)
        grammar = llguidance.LLMatcher.grammar_from_lark(f"start: {_lark_json(schema, param)}")
        self._validate(grammar, param)
        self._checked[key] = None
        if len(self._checked) > _CHECKED_SCHEMAS:
            self._checked.popitem(last=False)

    @property
    def _open(self) -> str:
        return f"<[{self._start_id}]>" if self._start_id is not None else _lark_string(
            TOOL_CALL_START)

    @property
    def _close(self) -> str:
        return f"<[{self._end_id}]>" if self._end_id is not None else _lark_string(
            TOOL_CALL_END)

    def _validate(self, grammar: str, param: str) -> None:
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, self._llt)
        if is_error:
            raise BadRequestError(f"invalid JSON schema: {clean_message(messages[0])}",
                                  param=param)

    def _processor(self, lark: str, param: str) -> GrammarLogitsProcessor:
        grammar = llguidance.LLMatcher.grammar_from_lark(lark)
        self._validate(grammar, param)
        matcher = llguidance.LLMatcher(self._llt, grammar, log_level=0)
        if matcher.is_error():
            raise BadRequestError(f"invalid JSON schema: {clean_message(matcher.get_error())}",
                                  param=param)
        processor = GrammarLogitsProcessor(matcher, self._vocab_size, self._eos, self.budget,
                                           param)
        took = processor.first_mask_time()
        if matcher.is_error():
            raise BadRequestError(f"invalid JSON schema: {clean_message(matcher.get_error())}",
                                  param=param)
        if took > self.budget.first_mask_s:
            raise BadRequestError(
                f"the grammar is too costly to enforce: its first token mask took "
                f"{took * 1e3:.0f} ms, over the budget of {self.budget.first_mask_s * 1e3:g} ms",
                param=param, code="grammar_too_costly")
        return processor


def _check_bounds(schema: Any, param: str) -> None:
    """400 for a (sub)schema with a lower bound over its upper bound, anywhere in it."""
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            for low, high in _BOUND_PAIRS:
                lo, hi = item.get(low), item.get(high)
                if (isinstance(lo, int | float) and isinstance(hi, int | float)
                        and not isinstance(lo, bool) and not isinstance(hi, bool) and lo > hi):
                    raise BadRequestError(f"invalid JSON schema: {low} ({lo}) is greater than "
                                          f"{high} ({hi})", param=param)
            stack.extend(item.values())


def clean_message(message: str) -> str:
    """An llguidance error as a client may read it: no Rust backtrace, no grammar listing,
    at most a few hundred characters."""
    text = re.split(r"\n?<backtrace>|\nstack backtrace:", str(message), maxsplit=1)[0]
    lines = [line for line in text.splitlines()
             if not re.match(r"\s*\d+ \|", line) and line.strip() != "^"]  # grammar listing
    text = re.sub(r"^at \d+\(\d+\): ", "", " ".join(line.strip() for line in lines if line.strip()))
    return text if len(text) <= _MAX_MESSAGE_CHARS else text[:_MAX_MESSAGE_CHARS] + "..."


def _call_prefix(name: str) -> str:
    return '{"name": ' + json.dumps(name) + ', "arguments": '


def _lark_string(text: str) -> str:
    """A Lark string literal of ``text``."""
    return json.dumps(text)


def _lark_json(schema: Any, param: str) -> str:
    """An inline ``%json`` rule for ``schema`` with this module's JSON options."""
    if not isinstance(schema, dict):
        raise BadRequestError("a JSON schema must be an object", param=param)
    own = schema.get("x-guidance", {})
    if not isinstance(own, dict):
        raise BadRequestError("x-guidance must be an object of llguidance's JSON options",
                              param=param)
    options = {**_JSON_OPTIONS, **own}
    return "%json " + json.dumps({**schema, "x-guidance": options})


def _single_token(tokenizer: Any, text: str) -> int | None:
    """The id of ``text`` if the tokenizer has it as one token, else None."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return int(ids[0]) if len(ids) == 1 else None
