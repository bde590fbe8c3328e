"""One request's token state, as the scheduler accounts for it.

Token accounting instead of phases: a sequence holds ``num_tokens`` tokens (prompt + output) of
which the first ``num_computed_tokens`` have KV in its arena slot. Prefill, chunked prefill,
decode and recompute after preemption are all "compute tokens ``[num_computed, num_tokens)``";
a step that reaches ``num_tokens`` samples the next token.
"""

from __future__ import annotations

import enum
from collections.abc import Sequence as Seq
from dataclasses import dataclass

from edmm.engine.prefix_cache import CacheTag, EntryRank, PrefixHit
from edmm.engine.sampling import OutputCounts, RequestRng, SamplingParams


class SequenceStatus(enum.IntEnum):
    """Lifecycle of a sequence, ordered: ``WAITING < RUNNING < FINISHED``."""

    WAITING = 0  # queued, or preempted (no slot)
    RUNNING = 1  # holds a slot and is scheduled every step
    FINISHED = 2  # done; its slot went to the prefix cache or back to the arena


class SequenceKind(enum.IntEnum):
    """What a sequence is for: a request, or a speculative prefill (low priority, never
    sampled, scheduled only in the token budget requests leave, preempted first)."""

    REQUEST = 0
    SPECULATIVE = 1


@dataclass(frozen=True)
class SlotHints:
    """How a sequence's arena slot relates to tagged prefix-cache entries (agent sessions).

    ``tag``/``rank``/``priority``: what the slot becomes when the sequence releases it (see
    `PrefixCache.release`); ``claim``: tags of entries the sequence may adopt at admission
    besides its own ``tag`` (the speculation branches of a resuming session);
    ``min_cached``: a speculative prefill is dropped at admission unless at least this many
    of its first tokens have KV in the pool (it extends its session's KV; when memory
    pressure took that away, recomputing it speculatively would only take pages and compute
    from the requests, and the resume brings it back anyway).
    ``cache_salt``: the slot's KV is shared only with sequences of the same salt (tenants).
    ``stale_tag``: the tag that entries still tagged ``tag`` take once the sequence holds its
    slot (earlier KV it did not adopt: still valid, evicted in turn); None: untagged. An agent
    session gives a tag it frees with the session, so closing it frees them too.
    ``in_place``: a speculative prefill that extends the entry tagged ``tag`` (its session's
    KV) in its own slot (`KVCacheManager.lend`) instead of a branch of it: dropped at
    admission unless that entry holds its first ``min_cached`` tokens; its slot goes back as
    that entry (class and priority its own, not ``rank``/``priority``).
    """

    tag: CacheTag | None = None
    rank: EntryRank = EntryRank.PLAIN
    priority: float = 0.0
    claim: tuple[CacheTag, ...] = ()
    min_cached: int = 0
    cache_salt: str | None = None
    stale_tag: CacheTag | None = None
    in_place: bool = False


ABORTED = "abort"  # finish reason of an aborted request (besides FinishReason's stop/length)
# A sampled token whose value is still on the device (async scheduling): it holds its place in
# ``token_ids`` until `Scheduler.resolve` writes the value; never hashed, never sent out.
PENDING_TOKEN = -1
SPECULATED = "speculated"  # finish reason of a speculative prefill that computed all its tokens


@dataclass(eq=False)
class Sequence:
    """Token state of one request. Owned and mutated by the `Scheduler` only."""

    request_id: str
    token_ids: list[int]  # prompt + output, in order
    num_prompt_tokens: int
    params: SamplingParams
    rng: RequestRng
    status: SequenceStatus = SequenceStatus.WAITING
    num_computed_tokens: int = 0  # tokens with KV in ``slot``
    num_cached_tokens: int = 0  # tokens reused from the prefix cache at first admission
    num_preemptions: int = 0
    slot: int | None = None
    finish_reason: str | None = None  # FinishReason value, ABORTED or SPECULATED
    kind: SequenceKind = SequenceKind.REQUEST
    hints: SlotHints = SlotHints()
    prefix_hit: PrefixHit | None = None  # how the first admission found its KV
    priority: float = 0.0  # admission order among waiting requests: lower first (`Request`)
    arrival: int = -1  # when the scheduler first queued it (its admission order among equals)
    first_scheduled_ns: int | None = None  # wall clock (time.time_ns) of its first admission
    memory_wait_steps: int = 0  # steps it headed the queue and was not admitted: memory short
    # Most tokens (prompt + output) it can reach: past this it surely stops (its max_tokens,
    # the model's length); a step in flight never computes a token beyond it. None: no bound.
    max_num_tokens: int | None = None
    num_pending: int = 0  # sampled tokens at the end of token_ids still on the device
    counts: OutputCounts | None = None  # its output's token counts (penalized params only)

    @classmethod
    def new(cls, request_id: str, prompt_token_ids: Seq[int], params: SamplingParams,
            kind: SequenceKind = SequenceKind.REQUEST, hints: SlotHints | None = None,
            priority: float = 0.0) -> Sequence:
        """A waiting sequence for a prompt, with its own random state."""
        # A slice copies a list (a `TokenIds` too) in one pass; list() walks a subclass.
        ids = prompt_token_ids[:] if isinstance(prompt_token_ids, list) else list(prompt_token_ids)
        return cls(request_id, ids, len(prompt_token_ids), params,
                   RequestRng.for_params(params), kind=kind,
                   hints=hints if hints is not None else SlotHints(), priority=priority,
                   counts=OutputCounts() if params.penalized else None)

    @property
    def is_speculative(self) -> bool:
        """True for a speculative prefill."""
        return self.kind == SequenceKind.SPECULATIVE

    @property
    def num_tokens(self) -> int:
        """Prompt + output tokens."""
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far (those still on the device included)."""
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def will_stop(self) -> bool:
        """True when the tokens it has (pending ones included) reach ``max_num_tokens``: it
        stops once they resolve, so no step computes more of it."""
        return self.max_num_tokens is not None and self.num_tokens >= self.max_num_tokens

    @property
    def num_uncomputed_tokens(self) -> int:
        """Tokens still without KV: the prompt's rest, or 1 when decoding."""
        return len(self.token_ids) - self.num_computed_tokens

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt (a copy)."""
        return self.token_ids[: self.num_prompt_tokens]

    @property
    def output_token_ids(self) -> list[int]:
        """The generated tokens (a copy)."""
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        """True once the request stopped, for any reason."""
        return self.status == SequenceStatus.FINISHED

    def append_token(self, token_id: int) -> None:
        """Add a sampled token; it has no KV until the next step computes it."""
        self.token_ids.append(token_id)

