"""What the engine returns per request (vLLM's ``RequestOutput`` / ``CompletionOutput``)."""

from __future__ import annotations

from dataclasses import dataclass

from edmm.engine.prefix_cache import PrefixHit


@dataclass(frozen=True)
class TokenLogprobs:
    """A sampled token's log probability and the most likely tokens at its place (``top``:
    ``(token_id, logprob)``, most likely first; as many as the request asked for)."""

    token_id: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


@dataclass
class CompletionOutput:
    """One generated continuation of a prompt, as far as it got."""

    index: int
    text: str  # detokenized output, cut before a matched stop string ("" without a tokenizer)
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", or None while running
    # One per token of ``token_ids`` when the request asked for them
    # (`SamplingParams.logprobs`); None otherwise.
    logprobs: list[TokenLogprobs] | None = None

    @property
    def finished(self) -> bool:
        """True once the continuation stopped."""
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestTiming:
    """Where a request's time went inside the engine (for profiles; `edmm.server.stages`):
    ``first_scheduled_ns``, the wall clock (``time.time_ns``) when the scheduler first admitted
    it (None: not yet); ``memory_wait_steps``, the steps it headed the waiting queue and was not
    admitted because KV memory was short."""

    first_scheduled_ns: int | None
    memory_wait_steps: int


@dataclass
class RequestOutput:
    """A request's state after a step (or at the end of `LLM.generate`)."""

    request_id: str
    prompt: str | None  # None when the request was given as token ids
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int  # prompt tokens whose KV came from the prefix cache
    prefix_hit: PrefixHit | None = None  # where that KV came from (None: computed from token 0)
    timing: RequestTiming | None = None  # the engine's times of it (None: not recorded)
