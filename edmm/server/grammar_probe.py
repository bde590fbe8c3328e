"""Grammar checks away from the server: validate a grammar and measure what compiling it costs.

Compiling a client's grammar and computing its first token mask is native work whose cost the
client controls: a ``json_schema`` ``pattern`` like ``^((a{100}){100}){10}$`` builds lexer
states for a third of a second, a hundred forced tools take as long. llguidance drops the GIL
for it, yet on a busy CPU a thread doing it still takes a core from the engine thread; and a
server thread at a lower CPU priority would stall everyone whenever the OS left it waiting
while it holds the GIL. So `GrammarProbe` checks grammars in a process of its own at a lower
CPU priority, started and warmed with the server: there a grammar is validated, compiled with
the serving limits (`GrammarLimits`) and its first mask computed, and the CPU time of all of
it is compared with the `GrammarBudget`. Only what passes is compiled again in the server,
where it costs at most that budget, and the verdict is remembered by the caller (agents send
the same tools every turn).

This module imports no torch and no server code: the probe process starts in well under a
second (`check_grammar` is also what an in-process check runs).
"""

from __future__ import annotations

import multiprocessing
import re
import time
from concurrent.futures import Future, ProcessPoolExecutor
from dataclasses import dataclass
from typing import Literal

import llguidance
from llguidance.numpy import allocate_token_bitmask, fill_next_token_bitmask

from edmm.server.children import record_semaphores, worker_init

PROBE_NICENESS = 10  # the probe process yields the CPU to the server
_MAX_MESSAGE_CHARS = 500


@dataclass(frozen=True)
class GrammarBudget:
    """What one request's grammar may cost the server.

    Attributes:
        compile_s: CPU time to validate and compile the grammar and compute its first token
            mask (lexer states are built then), measured in the probe; over it the request is
            refused (400, ``grammar_too_costly``).
        first_mask_s: CPU time of that first mask alone (it would otherwise be paid on the
            engine thread, between everyone's steps).
        mask_s: the mean time per mask while generating, counted after ``grace_masks``; over
            it the processor stops (`GrammarLogitsProcessor.failure`).
        grace_masks: masks granted before the mean counts (a lexer's states are built lazily).
    """

    compile_s: float = 0.25
    first_mask_s: float = 0.05
    mask_s: float = 0.01
    grace_masks: int = 8


@dataclass(frozen=True)
class GrammarLimits:
    """llguidance's parser limits for every grammar the server compiles (None: its default).

    ``step_lexer_fuel`` bounds the work of one token mask: a mask over it puts the matcher in
    an error state, and that request stops (the default of 200,000 let one mask of a costly
    pattern take ~0.2 s on the engine thread; 20,000 stops it within ~10 ms, while ordinary
    schemas on Qwen2.5's vocabulary use a small fraction of it).
    """

    step_lexer_fuel: int | None = 20_000
    initial_lexer_fuel: int | None = None
    step_max_items: int | None = None
    max_lexer_states: int | None = None
    max_grammar_size: int | None = None

    def llguidance(self) -> llguidance.LLParserLimits:
        """These limits as llguidance's object."""
        return llguidance.LLParserLimits(
            step_lexer_fuel=self.step_lexer_fuel, initial_lexer_fuel=self.initial_lexer_fuel,
            step_max_items=self.step_max_items, max_lexer_states=self.max_lexer_states,
            max_grammar_size=self.max_grammar_size, verbose_errors=False)


@dataclass(frozen=True)
class Verdict:
    """The outcome of checking one grammar.

    Attributes:
        problem: None (the grammar may be used), ``"invalid"`` or ``"costly"``.
        message: why, as a client may read it ("" when fine).
    """

    problem: Literal["invalid", "costly"] | None = None
    message: str = ""


OK = Verdict()


@dataclass(frozen=True)
class TokenizerSpec:
    """What builds llguidance's tokenizer in another process (plain data, picklable)."""

    tokenizer_json: str
    vocab_size: int
    eos_token_id: int

    def build(self) -> llguidance.LLTokenizer:
        """llguidance's tokenizer of this vocabulary."""
        return llguidance.LLTokenizer(self.tokenizer_json, n_vocab=self.vocab_size,
                                      eos_token=self.eos_token_id)


def check_grammar(tokenizer: llguidance.LLTokenizer, vocab_size: int, grammar: str,
                  costed: bool, budget: GrammarBudget, limits: GrammarLimits) -> Verdict:
    """Validate ``grammar`` (llguidance's, from ``grammar_from_lark``); when ``costed``, also
    compile it and compute its first mask within ``budget`` (CPU time)."""
    t0 = time.process_time()
    try:
        lim = limits.llguidance()
        is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(
            grammar, tokenizer, limits=lim)
        if is_error:
            return Verdict("invalid", clean_message(messages[0]))
        if not costed:
            return OK
        matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0, limits=lim)
        if matcher.is_error():
            return Verdict("invalid", clean_message(matcher.get_error()))
        compiled = time.process_time()
        fill_next_token_bitmask(matcher, allocate_token_bitmask(1, vocab_size))
        done = time.process_time()
    except BaseException as e:  # a Rust panic (pyo3's PanicException is a BaseException)
        return Verdict("invalid", clean_message(str(e)))
    if matcher.is_error():  # a valid grammar whose mask went over the limits
        return Verdict("costly", f"its first token mask went over the parser's limits "
                                 f"({clean_message(matcher.get_error())})")
    if done - compiled > budget.first_mask_s:
        return Verdict("costly", f"its first token mask took {(done - compiled) * 1e3:.0f} ms "
                                 f"of CPU, over the budget of {budget.first_mask_s * 1e3:g} ms")
    if done - t0 > budget.compile_s:
        return Verdict("costly", f"compiling it took {(done - t0) * 1e3:.0f} ms of CPU, over "
                                 f"the budget of {budget.compile_s * 1e3:g} ms")
    return OK


def clean_message(message: str) -> str:
    """An llguidance error as a client may read it: no Rust backtrace, no grammar listing,
    at most a few hundred characters."""
    text = re.split(r"\n?<backtrace>|\nstack backtrace:|\n?<state>", str(message),
                    maxsplit=1)[0]
    lines = [line for line in text.splitlines()
             if not re.match(r"\s*\d+ \|", line) and line.strip() != "^"]  # grammar listing
    text = re.sub(r"^at \d+\(\d+\): ", "", " ".join(line.strip() for line in lines if line.strip()))
    return text if len(text) <= _MAX_MESSAGE_CHARS else text[:_MAX_MESSAGE_CHARS] + "..."


class GrammarProbe:
    """A worker process (one, at a lower CPU priority) that runs `check_grammar` for the server.

    `start` spawns it and waits until it has built its tokenizer; `submit` queues a batch of
    grammars and returns a future of their verdicts, in order.
    """

    def __init__(self, tokenizer: TokenizerSpec, budget: GrammarBudget,
                 limits: GrammarLimits) -> None:
        self._spec = tokenizer
        self._budget = budget
        self._limits = limits
        self._pool: ProcessPoolExecutor | None = None

    def start(self) -> None:
        """Start the process and wait until it checks grammars (its start-up, which builds
        llguidance's tokenizer, is paid by no request)."""
        self.submit([("start: \"x\"", True)]).result()

    def submit(self, grammars: list[tuple[str, bool]]) -> Future[list[Verdict]]:
        """Verdicts of ``(grammar, costed)`` pairs (see `check_grammar`), checked in the
        probe process."""
        if self._pool is None:
            self._pool = ProcessPoolExecutor(
                max_workers=1, mp_context=multiprocessing.get_context("spawn"),
                initializer=_init_worker, initargs=(self._spec,))
            record_semaphores(self._pool)
        return self._pool.submit(_check_in_worker, grammars, self._budget, self._limits)

    def restart(self) -> None:
        """Forget a pool whose process died (the next `submit` starts another)."""
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
            self._pool = None

    def close(self) -> None:
        """Stop the process."""
        if self._pool is not None:
            self._pool.shutdown(wait=True, cancel_futures=True)
            self._pool = None


class _Worker:
    """The probe process's tokenizer (built once, by `_init_worker`)."""

    tokenizer: llguidance.LLTokenizer | None = None
    vocab_size = 0


def _init_worker(spec: TokenizerSpec) -> None:
    worker_init(PROBE_NICENESS)
    _Worker.tokenizer = spec.build()
    _Worker.vocab_size = spec.vocab_size


def _check_in_worker(grammars: list[tuple[str, bool]], budget: GrammarBudget,
                     limits: GrammarLimits) -> list[Verdict]:
    tokenizer = _Worker.tokenizer
    assert tokenizer is not None, "the probe process was not initialised"
    return [check_grammar(tokenizer, _Worker.vocab_size, g, costed, budget, limits)
            for g, costed in grammars]
