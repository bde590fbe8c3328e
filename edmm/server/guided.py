"""Grammar-constrained decoding with llguidance: forced tool calls and JSON-schema responses.

`GuidedDecoding` turns a request into grammars (`Grammar`): one that is enforced, for

- ``tool_choice="required"`` or a named function: one (or, with ``parallel_tool_calls``, several)
  ``<tool_call>`` blocks in the chat template's own format, each ``{"name": "<tool>",
  "arguments": <JSON matching that tool's parameters schema>}``;
- ``response_format`` ``json_schema`` / ``json_object``: a JSON value of the schema,

one per tool's parameter schema, only checked (it must compile, whatever the tool choice), and
one per regex ``pattern`` of an enforced schema, costed on its own: a pattern whose lexer is
costly to build is refused even where the enforced grammar would reach it only after a few
cheap masks.
JSON is emitted with the separators Jinja's ``tojson`` uses (``", "`` and ``": "``) and no
other whitespace, so the arguments read exactly as the template would print them, and a
random-weight model cannot pad them with whitespace forever.

What a grammar costs is the client's choice, so it is budgeted (`GrammarBudget`) and bounded:
the server checks new grammars in the probe process (`check_isolated`, see
`edmm.server.grammar_probe`: validation, compilation and the first mask, in CPU time), then
compiles the enforced one again in-process (`processor`, on a server thread, at most the
budget) into a `GrammarLogitsProcessor` for the engine's per-request logits hook. Token masks
are computed on the engine thread, between everyone's steps: each is bounded by the parser's
fuel (`GrammarLimits`; a mask over it stops that request), and a processor whose masks cost too
much on average stops too (`GrammarLogitsProcessor.failure`; the server ends that request with
an error). Verdicts are remembered (agents send the same tools each turn; a refused grammar is
refused again at once). llguidance's messages reach clients without Rust backtraces or grammar
listings (`clean_message`).
"""

from __future__ import annotations

import asyncio
import copy
import json
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass
from typing import Any

import llguidance
import numpy as np
import torch

# llguidance.numpy, not llguidance.torch: the latter imports triton (tests that run triton's
# interpreter must set it up before triton is first imported)
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from edmm.server.errors import BadRequestError
from edmm.server.grammar_probe import (
    OK,
    GrammarBudget,
    GrammarLimits,
    GrammarProbe,
    TokenizerSpec,
    Verdict,
    check_grammar,
    clean_message,
)
from edmm.server.protocol import ChatCompletionRequest, FunctionDefinition, NamedToolChoice
from edmm.server.tool_parser import TOOL_CALL_END, TOOL_CALL_START

__all__ = ["Grammar", "GrammarBudget", "GrammarLimits", "GrammarLogitsProcessor",
           "GrammarMasks", "GuidedDecoding", "apply_bitmask", "clean_message",
           "unpack_bitmask", "unpack_bitmask_host"]

# Applied to every schema (a schema's own "x-guidance" may override them).
_JSON_OPTIONS = {"item_separator": ", ", "key_separator": ": ", "whitespace_flexible": False,
                 "lenient": True}
_ANY_OBJECT: dict[str, Any] = {"type": "object"}
_VERDICTS = 1024  # grammars whose verdict is remembered
# The default bound of a forced call's string arguments (`GuidedDecoding`): none, as vLLM and
# SGLang (a request's max_tokens ends a runaway string). A bound makes llguidance's mask of a
# string's every token 6-8x costlier (its slicer does not apply to a counted repetition:
# `python -m benchmarks.scripts.grammar_masks --string-bound 8192`), paid on the engine's
# host side at every step of every such call.
FORCED_STRING_CHARS: int | None = None
_STRING_BOUNDS = ("maxLength", "enum", "const", "pattern", "format")
_LITERAL_KEYWORDS = frozenset({"const", "enum", "default", "examples"})
# Bounds that no value meets when the first is over the second (llguidance drops such an
# optional property silently instead of refusing the schema).
_BOUND_PAIRS = (("minimum", "maximum"), ("minLength", "maxLength"), ("minItems", "maxItems"),
                ("minProperties", "maxProperties"))


@dataclass(frozen=True)
class Grammar:
    """One grammar of a request.

    Attributes:
        text: llguidance's grammar (from ``grammar_from_lark``).
        param: the request parameter it comes from (named in errors).
        enforced: constrains the output (a processor is built for it).
        costed: its compilation and first mask are checked against the budget (else it is
            only validated: a tool's schema that no choice forces).
    """

    text: str
    param: str
    enforced: bool
    costed: bool

    @property
    def key(self) -> tuple[str, bool]:
        """What its verdict is remembered by."""
        return self.text, self.costed


class GrammarMasks:
    """Applies the token masks of one step's grammar rows together (the engine's
    `LogitsBatch`): each row's matcher fills its row of one int32 bitmask ``[k, ceil(V / 32)]``
    on the host, one copy moves it to the logits' device, and one pass there unpacks it and
    masks the ``[k, V]`` logits. Per row the cost is then the matcher's own mask fill; unpacking
    and masking row by row on the host took ~0.5 ms more per row at Qwen2.5's 151,669 tokens.

    One per `GuidedDecoding`, shared by its processors, which fill their rows one by one
    (llguidance's thread pool was slower for a step's masks on the device's CPUs:
    `benchmarks.scripts.grammar_masks`).

    It keeps two host bitmask buffers (pinned for a GPU's logits, grown to the largest batch
    seen), used in turn: the copy to the device does not wait for the device's queue (the
    forward it follows may still run, async scheduling), and a buffer is written again only
    once its last copy is done.
    """

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._words = (vocab_size + 31) // 32
        self._buffers: list[torch.Tensor | None] = [None, None]  # [rows, words] int32, host
        self._copied: list[torch.cuda.Event | None] = [None, None]  # each buffer's last copy
        self._next = 0

    def apply(self, procs: Sequence[GrammarLogitsProcessor],
              outputs: Sequence[Sequence[int]], logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[k, V]`` of ``procs``' rows (``outputs``: each row's tokens so far)
        with every token their grammars forbid set to ``-inf``."""
        i, self._next = self._next, 1 - self._next
        bits = self._rows(i, len(procs), logits.device)  # [k, words]
        self.fill(procs, outputs, bits)
        masked = apply_bitmask(logits, bits)
        if logits.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
            self._copied[i] = event
        return masked

    def fill(self, procs: Sequence[GrammarLogitsProcessor], outputs: Sequence[Sequence[int]],
             bits: torch.Tensor) -> None:
        """`GrammarLogitsProcessor.fill_row` of every row into ``bits`` (``[k, words]`` int32,
        host)."""
        for row, (proc, out) in enumerate(zip(procs, outputs, strict=True)):
            proc.fill_row(out, bits[row].numpy())

    def _rows(self, i: int, k: int, device: torch.device) -> torch.Tensor:
        """Buffer ``i``'s first ``k`` rows, once its last copy to the device is done."""
        event, self._copied[i] = self._copied[i], None
        if event is not None:
            event.synchronize()
        pin = device.type == "cuda"
        buf = self._buffers[i]
        if buf is None or buf.shape[0] < k or buf.is_pinned() != pin:
            buf = torch.empty((max(k, 8), self._words), dtype=torch.int32, pin_memory=pin)
            self._buffers[i] = buf
        return buf[:k]


def apply_bitmask(logits: torch.Tensor, bits: torch.Tensor) -> torch.Tensor:
    """``logits`` ``[k, V]`` (in place) with ``-inf`` wherever ``bits`` ``[k, ceil(V / 32)]``
    (int32, host; bit ``j`` of word ``w`` is token ``32 w + j``) is 0. On a GPU the words are
    copied once, without waiting for the device's queue when ``bits`` is pinned (the caller
    keeps it unchanged until the copy is done), and unpacked there; on the CPU numpy unpacks
    them."""
    vocab = logits.shape[1]
    if logits.device.type == "cpu":
        allowed = unpack_bitmask_host(bits, vocab)
    else:
        allowed = unpack_bitmask(bits.to(logits.device, non_blocking=True), vocab)
    return logits.masked_fill_(~allowed, float("-inf"))


def unpack_bitmask(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """``[k, V]`` bool from int32 ``words`` ``[k, ceil(V / 32)]``, with torch ops on their
    device (one pass over ``k x 32 x words`` elements)."""
    k = words.shape[0]
    shifts = torch.arange(32, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & 1).view(k, -1)[:, :vocab].bool()


def unpack_bitmask_host(words: torch.Tensor, vocab: int) -> torch.Tensor:
    """`unpack_bitmask` of host ``words`` through numpy (faster there)."""
    unpacked = np.unpackbits(words.numpy().view(np.uint8), axis=1, bitorder="little")
    return torch.from_numpy(unpacked[:, :vocab].astype(np.bool_))


class GrammarLogitsProcessor:
    """Masks the tokens a grammar forbids next; one per request (it is stateful).

    Called by the engine before each sampled token with the request's outputs so far; it feeds
    the matcher the tokens it has not seen, then keeps only the allowed tokens' logits. Once the
    grammar is complete only EOS is allowed, so the request stops there. The engine applies
    the processors of one step's rows together through their shared ``batch``
    (`GrammarMasks`); called alone it masks one row the same way.
    """

    def __init__(self, matcher: llguidance.LLMatcher, vocab_size: int,
                 eos_token_id: int, budget: GrammarBudget | None = None,
                 param: str | None = None, batch: GrammarMasks | None = None) -> None:
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
        self.batch = batch if batch is not None else GrammarMasks(vocab_size)
        # The tokens every output of the grammar starts with (set by `prepare`): the engine
        # computes them with the prompt (`SamplingParams.forced_output_ids`).
        self.forced: tuple[int, ...] = ()

    def __call__(self, output_token_ids: Sequence[int], logits: torch.Tensor) -> torch.Tensor:
        """``logits`` ``[V]`` with the forbidden tokens set to ``-inf`` (once the processor has
        stopped: everything but EOS, at no cost)."""
        return self.batch.apply([self], [output_token_ids], logits.unsqueeze(0))[0]

    def fill_row(self, output_token_ids: Sequence[int], row: np.ndarray) -> None:
        """Feed the matcher the tokens it has not seen, then write the allowed next tokens
        into ``row`` (``[ceil(V / 32)]`` int32): only EOS once the processor has stopped, or
        when the grammar allows nothing else."""
        if not self.feed(output_token_ids, row):
            return
        t0 = time.perf_counter()
        fill_next_token_bitmask(self._matcher, row.reshape(1, -1))
        self._spend(time.perf_counter() - t0)  # a mask over the budget still applies
        if self._matcher.is_error():  # masks never allow a wrong token: over the limits
            self.failure = (f"the grammar is too costly to enforce: "
                            f"{clean_message(self._matcher.get_error())}")
            self._only_eos(row)
        elif not row.any():
            self._only_eos(row)

    @property
    def matcher(self) -> llguidance.LLMatcher:
        """The request's matcher (its state: the outputs fed so far)."""
        return self._matcher

    def feed(self, output_token_ids: Sequence[int], row: np.ndarray) -> bool:
        """Feed the matcher the tokens it has not seen; False (``row`` then allows only EOS)
        once the processor has stopped: no mask to compute."""
        if self.failure is not None:
            self._only_eos(row)
            return False
        for token in output_token_ids[self._consumed:]:
            self._matcher.consume_token(token)
        self._consumed = len(output_token_ids)
        return True

    def _only_eos(self, row: np.ndarray) -> None:
        row[:] = 0
        row.view(np.uint32)[self._eos // 32] = np.uint32(1 << (self._eos % 32))

    def prepare(self, fast_forward: bool = True) -> None:
        """Compute the mask of the grammar's start (its lexer states are built here, not on
        the engine thread) and, with ``fast_forward``, the tokens every output starts with
        (`forced`: llguidance's fast-forward tokens, canonically tokenized; the matcher stays
        at the start and consumes them with the outputs); 400 if it goes over the parser's
        limits."""
        fill_next_token_bitmask(self._matcher, self._bitmask)
        if fast_forward and not self._matcher.is_error():
            self.forced = tuple(self._matcher.compute_ff_tokens())
        if self._matcher.is_error():
            raise BadRequestError(
                f"the grammar is too costly to enforce: "
                f"{clean_message(self._matcher.get_error())}",
                param=self.param, code="grammar_too_costly")

    def _spend(self, seconds: float) -> None:
        self._masks += 1
        self._mask_time_s += seconds
        budget = self._budget
        if self.failure is None and (
                self._mask_time_s > budget.mask_s * (self._masks + budget.grace_masks)):
            self.failure = (f"the grammar is too costly to enforce: its token masks took "
                            f"{self._mask_time_s / self._masks * 1e3:.1f} ms each on average, "
                            f"over the budget of {budget.mask_s * 1e3:g} ms")

    @property
    def error(self) -> str:
        """Why the matcher rejected a token ("" while all is well)."""
        return str(self._matcher.get_error())


class GuidedDecoding:
    """Grammars of one tokenizer; build once per server (it wraps the tokenizer).

    With ``isolated`` (the server), `start` starts the probe process that `check_isolated`
    uses; without, grammars are checked in the calling thread (`check`).
    ``forced_string_chars``: the most characters of a string in a forced call's arguments
    whose schema sets no bound of its own (no ``maxLength``, ``enum``, ``const``, ``pattern``
    or ``format``); None (the default, `FORCED_STRING_CHARS`): unbounded, a model may write a
    string argument until the request's max_tokens. A bound costs mask time (above).
    ``fast_forward``: each processor's `GrammarLogitsProcessor.forced` holds the tokens every
    output of its grammar starts with (the server computes them with the prompt); False: none
    (each is decoded, one step a token).
    """

    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_id: int,
                 budget: GrammarBudget | None = None, limits: GrammarLimits | None = None,
                 isolated: bool = False,
                 forced_string_chars: int | None = FORCED_STRING_CHARS,
                 fast_forward: bool = True) -> None:
        self.forced_string_chars = forced_string_chars
        self.fast_forward = fast_forward
        self.spec = TokenizerSpec(_tokenizer_json(tokenizer), vocab_size, eos_token_id)
        self._llt = self.spec.build()
        self.budget = budget or GrammarBudget()
        self.limits = limits or GrammarLimits()
        self._probe = GrammarProbe(self.spec, self.budget, self.limits) if isolated else None
        self._verdicts: OrderedDict[tuple[str, bool], Verdict] = OrderedDict()
        self._lock = threading.Lock()  # verdicts are read and written from several threads
        self._vocab_size = vocab_size
        self._eos = eos_token_id
        self._mask_batch = GrammarMasks(vocab_size)  # shared by this decoding's processors
        self._start_id = _single_token(tokenizer, TOOL_CALL_START)
        self._end_id = _single_token(tokenizer, TOOL_CALL_END)

    def start(self) -> None:
        """Start the probe process (when isolated) and wait until it checks grammars."""
        if self._probe is not None:
            self._probe.start()

    def close(self) -> None:
        """Stop the probe process."""
        if self._probe is not None:
            self._probe.close()

    # ------------------------------------------------------------------ grammars
    def chat_grammars(self, req: ChatCompletionRequest) -> list[Grammar]:
        """The grammars of a chat request: every tool's schema (checked), then the one the
        tool choice or response format enforces, if any."""
        grammars = [self.schema_grammar(t.function.parameters, f"tools.{i}")
                    for i, t in enumerate(req.tools or []) if t.function.parameters is not None]
        choice = req.tool_choice
        if choice == "required" or isinstance(choice, NamedToolChoice):
            tools = [t.function for t in req.tools or []]
            if isinstance(choice, NamedToolChoice):
                tools = [f for f in tools if f.name == choice.function.name]
            parts = [g for f in tools for g in self.pattern_grammars(f.parameters, "tools")]
            return [*grammars, *parts, self.tool_calls_grammar(
                tools, req.parallel_tool_calls is not False and choice == "required")]
        fmt = req.response_format
        if fmt is None or fmt.type == "text":
            return grammars
        if fmt.type == "json_object":
            return [*grammars, self.json_schema_grammar(None)]
        if fmt.json_schema is None:
            raise BadRequestError("response_format json_schema needs a json_schema",
                                  param="response_format")
        schema = fmt.json_schema.schema_
        return [*grammars, *self.pattern_grammars(schema, "response_format"),
                self.json_schema_grammar(schema)]

    def tool_calls_grammar(self, functions: Sequence[FunctionDefinition],
                           parallel: bool) -> Grammar:
        """The grammar forcing one call (several if ``parallel``) of one of ``functions``."""
        if not functions:
            raise BadRequestError("a forced tool choice needs at least one tool", param="tools")
        bound = self.forced_string_chars
        rules = [f"call_{i}: {_lark_string(_call_prefix(f.name))} "
                 f"{_lark_json(bounded_strings(f.parameters or _ANY_OBJECT, bound), 'tools')}"
                 ' "}"' for i, f in enumerate(functions)]
        alternatives = " | ".join(f"call_{i}" for i in range(len(functions)))
        lark = "\n".join([
            'start: block ("\\n" block)*' if parallel else "start: block",
            f'block: {self._open} "\\n" ({alternatives}) "\\n" {self._close}',
            *rules,
        ])
        return Grammar(llguidance.LLMatcher.grammar_from_lark(lark), "tools", True, True)

    def json_schema_grammar(self, schema: dict[str, Any] | None) -> Grammar:
        """The grammar forcing a JSON value of ``schema`` (any object if None)."""
        lark = f"start: {_lark_json(schema or _ANY_OBJECT, 'response_format')}"
        return Grammar(llguidance.LLMatcher.grammar_from_lark(lark), "response_format", True,
                       True)

    def schema_grammar(self, schema: Any, param: str) -> Grammar:
        """The grammar of a tool's parameter ``schema``, to be checked only."""
        _check_bounds(schema, param)
        lark = f"start: {_lark_json(schema, param)}"
        return Grammar(llguidance.LLMatcher.grammar_from_lark(lark), param, False, False)

    def pattern_grammars(self, schema: Any, param: str) -> list[Grammar]:
        """One costed grammar per distinct regex ``pattern`` in ``schema``: a JSON string of
        that pattern alone, so its first mask builds that regex's lexer states."""
        return [Grammar(llguidance.LLMatcher.grammar_from_lark(
                    f"start: {_lark_json({'type': 'string', 'pattern': p}, param)}"),
                        param, False, True) for p in _patterns(schema)]

    # ------------------------------------------------------------------ checks
    def check(self, grammars: Sequence[Grammar]) -> None:
        """400 for the first of ``grammars`` that is invalid or over the budget, checked in
        the calling thread (verdicts remembered)."""
        for g in grammars:
            verdict = self._known(g)
            if verdict is None:
                verdict = check_grammar(self._llt, self._vocab_size, g.text, g.costed,
                                        self.budget, self.limits)
                self._remember(g.key, verdict)
            _raise_for(g, verdict)

    def known_to_pass(self, grammars: Sequence[Grammar]) -> bool:
        """Whether ``grammars`` are all checked only (none enforced) and passed their check
        before: a request with them needs neither a check nor a processor."""
        for g in grammars:
            verdict = self._known(g)
            if g.enforced or verdict is None or verdict.problem is not None:
                return False
        return True

    async def check_isolated(self, grammars: Sequence[Grammar]) -> None:
        """`check`, with the grammars not checked before sent to the probe process (the
        caller waits; nothing runs in this process). Without a probe: `check` on a thread."""
        if self._probe is None:
            await asyncio.to_thread(self.check, grammars)
            return
        found = {g.key: self._known(g) for g in grammars}
        unknown = [key for key, verdict in found.items() if verdict is None]
        if unknown:
            try:
                verdicts = await asyncio.wrap_future(self._probe.submit(unknown))
            except BrokenProcessPool:
                self._probe.restart()
                raise BadRequestError("the grammar check was killed", param=grammars[0].param,
                                      code="grammar_too_costly") from None
            for key, verdict in zip(unknown, verdicts, strict=True):
                found[key] = verdict
                self._remember(key, verdict)
        for g in grammars:
            _raise_for(g, found[g.key] or OK)

    def processor(self, grammar: Grammar) -> GrammarLogitsProcessor:
        """A processor enforcing ``grammar`` (checked before), with its first mask computed."""
        matcher = llguidance.LLMatcher(self._llt, grammar.text, log_level=0,
                                       limits=self.limits.llguidance())
        if matcher.is_error():
            raise BadRequestError(f"invalid JSON schema: {clean_message(matcher.get_error())}",
                                  param=grammar.param)
        processor = GrammarLogitsProcessor(matcher, self._vocab_size, self._eos, self.budget,
                                           grammar.param, self._mask_batch)
        try:
            processor.prepare(self.fast_forward)
        except BadRequestError:
            self._remember(grammar.key,
                           Verdict("costly", "its first token mask went over the parser's limits"))
            raise
        return processor

    # ------------------------------------------------------------------ in-process use
    def tool_calls(self, functions: Sequence[FunctionDefinition],
                   parallel: bool) -> GrammarLogitsProcessor:
        """A processor forcing one call (several if ``parallel``) of one of ``functions``
        (checked in the calling thread)."""
        parts = [g for f in functions for g in self.pattern_grammars(f.parameters, "tools")]
        return self._checked_processor(self.tool_calls_grammar(functions, parallel), parts)

    def json_schema(self, schema: dict[str, Any] | None) -> GrammarLogitsProcessor:
        """A processor forcing a JSON value of ``schema`` (any object if None; checked in the
        calling thread)."""
        return self._checked_processor(self.json_schema_grammar(schema),
                                       self.pattern_grammars(schema, "response_format"))

    def check_schema(self, schema: Any, param: str) -> None:
        """400 unless ``schema`` compiles as a JSON schema (checked in the calling thread)."""
        self.check([self.schema_grammar(schema, param)])

    def _checked_processor(self, grammar: Grammar,
                           parts: Sequence[Grammar]) -> GrammarLogitsProcessor:
        self.check([*parts, grammar])
        return self.processor(grammar)

    def _known(self, grammar: Grammar) -> Verdict | None:
        key = grammar.key
        with self._lock:
            verdict = self._verdicts.get(key)
            if verdict is not None:
                self._verdicts.move_to_end(key)
        return verdict

    def _remember(self, key: tuple[str, bool], verdict: Verdict) -> None:
        with self._lock:
            self._verdicts[key] = verdict
            if len(self._verdicts) > _VERDICTS:
                self._verdicts.popitem(last=False)

    @property
    def _open(self) -> str:
        return f"<[{self._start_id}]>" if self._start_id is not None else _lark_string(
            TOOL_CALL_START)

    @property
    def _close(self) -> str:
        return f"<[{self._end_id}]>" if self._end_id is not None else _lark_string(
            TOOL_CALL_END)


def _raise_for(grammar: Grammar, verdict: Verdict) -> None:
    if verdict.problem == "invalid":
        raise BadRequestError(f"invalid JSON schema: {verdict.message}", param=grammar.param)
    if verdict.problem == "costly":
        raise BadRequestError(f"the grammar is too costly to enforce: {verdict.message}",
                              param=grammar.param, code="grammar_too_costly")


def _tokenizer_json(tokenizer: Any) -> str:
    """The Rust tokenizer of a fast Hugging Face tokenizer as JSON (what llguidance builds its
    own from), without padding or truncation."""
    backend = copy.copy(tokenizer.backend_tokenizer)
    backend.no_padding()
    backend.no_truncation()
    return str(backend.to_str())


def _patterns(schema: Any) -> list[str]:
    """The distinct regexes under a ``pattern`` key anywhere in ``schema``."""
    found: dict[str, None] = {}
    stack = [schema]
    while stack:
        item = stack.pop()
        if isinstance(item, list):
            stack.extend(item)
        elif isinstance(item, dict):
            if isinstance(item.get("pattern"), str):
                found[item["pattern"]] = None
            stack.extend(item.values())
    return list(found)


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


def bounded_strings(schema: Any, most: int | None) -> Any:
    """``schema`` with ``maxLength: most`` on every string subschema that bounds its strings
    in no other way (see `GuidedDecoding`); literal values (``const``, ``enum``, ``default``,
    ``examples``) are left as they are. A copy; None: ``schema`` itself."""
    if most is None:
        return schema
    if isinstance(schema, list):
        return [bounded_strings(item, most) for item in schema]
    if not isinstance(schema, dict):
        return schema
    out = {k: v if k in _LITERAL_KEYWORDS else bounded_strings(v, most)
           for k, v in schema.items()}
    kind = schema.get("type")
    if (kind == "string" or (isinstance(kind, list) and "string" in kind)) and not any(
            k in schema for k in _STRING_BOUNDS):
        out["maxLength"] = most
    return out


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
