"""What the engine returns per request (vLLM's ``RequestOutput`` / ``CompletionOutput``)."""

from __future__ import annotations

from dataclasses import dataclass

from edmm.engine.prefix_cache import PrefixHit


@dataclass
class CompletionOutput:
    """One generated continuation of a prompt, as far as it got."""

    index: int
    text: str  # detokenized output, cut before a matched stop string ("" without a tokenizer)
    token_ids: list[int]
    finish_reason: str | None = None  # "stop", "length", "abort", or None while running

    @property
    def finished(self) -> bool:
        """True once the continuation stopped."""
        return self.finish_reason is not None


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
