"""Token-budget scheduling with continuous batching, prefix reuse and recompute preemption.

Each step spends at most ``max_num_batched_tokens`` tokens:

1. running sequences, in admission order, each get what they still need (1 token when decoding,
   the rest of the prompt, or as much of it as the budget allows: chunked prefill);
2. if no sequence was preempted in (1), waiting sequences are admitted in FIFO order while
   budget, ``max_num_seqs`` and memory allow: a prefix-cache hit gives a slot that already
   holds the longest cached prefix (`PrefixCache.acquire`: no recompute), else a fresh slot
   is taken.

Admission stops at the first sequence whose tokens do not all fit, so a partially prefilled
sequence is always the most recently admitted one: admission order puts decodes first.

Memory: before its tokens are computed, a sequence's slot is grown (`KVArena.grow`) to map them.
When the pool is short, the scheduler evicts prefix-cache entries (LRU) and then preempts the most
recently admitted running sequence: its slot is released (to the prefix cache, so a resume may
reuse it) and it goes back to the front of the queue to be recomputed (vLLM's recompute
preemption). A waiting sequence never preempts a running one.

The scheduler is the one owner of sequence status and token accounting; it hands the runner a
plain `ScheduledBatch` and takes the sampled tokens back in `update`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from edmm.engine.errors import EngineConfigError
from edmm.engine.prefix_cache import PrefixCache
from edmm.engine.sampling import RequestRng, SamplingParams
from edmm.engine.sequence import ABORTED, Sequence, SequenceStatus
from edmm.memory import KVArena, NoFreeSlotError, PoolExhaustedError


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits."""

    max_num_batched_tokens: int
    max_num_seqs: int

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise EngineConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise EngineConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} < max_num_seqs="
                f"{self.max_num_seqs}: some running sequences could not decode in a step")


@dataclass(frozen=True)
class ScheduledSeq:
    """One sequence's work in a step: compute ``token_ids`` at positions ``start..``."""

    request_id: str
    slot: int
    token_ids: list[int]  # tokens to compute, at positions [start, start + len)
    start: int  # num_computed_tokens before this step
    sample: bool  # True when this step reaches the sequence's last token: sample the next one
    params: SamplingParams
    rng: RequestRng
    # The tokens generated so far, given only to a sampling entry whose params have
    # logits processors (they need them); empty otherwise.
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def context_len(self) -> int:
        """Tokens with KV in the slot after this step."""
        return self.start + len(self.token_ids)


@dataclass
class ScheduledBatch:
    """What the scheduler decided for one step (built by `Scheduler.schedule`, then read-only)."""

    seqs: list[ScheduledSeq] = field(default_factory=list)
    preempted: list[str] = field(default_factory=list)  # request ids preempted in this step

    @property
    def num_tokens(self) -> int:
        """Tokens computed in this step."""
        return sum(len(s.token_ids) for s in self.seqs)

    @property
    def is_empty(self) -> bool:
        """True when there is nothing to compute."""
        return not self.seqs


class Scheduler:
    """Continuous-batching scheduler over a KV arena; see the module docstring."""

    def __init__(self, arena: KVArena, prefix_cache: PrefixCache, config: SchedulerConfig) -> None:
        self.arena = arena
        self.prefix_cache = prefix_cache
        self.config = config
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # admission order
        self.num_preemptions = 0
        self._seqs: dict[str, Sequence] = {}

    # ------------------------------------------------------------------ requests
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (its request id must be unused)."""
        if seq.request_id in self._seqs:
            raise ValueError(f"request id {seq.request_id!r} is already scheduled")
        self._seqs[seq.request_id] = seq
        self.waiting.append(seq)

    def get(self, request_id: str) -> Sequence | None:
        """The unfinished sequence of a request, if any."""
        return self._seqs.get(request_id)

    def has_unfinished(self) -> bool:
        """True while any sequence waits or runs."""
        return bool(self._seqs)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Stop a sequence (``reason``: a FinishReason value or ABORTED) and release its slot."""
        if seq.status == SequenceStatus.RUNNING:
            self.running.remove(seq)
            self._release_slot(seq)
        elif seq.status == SequenceStatus.WAITING:
            self.waiting.remove(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        self._seqs.pop(seq.request_id, None)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a request as aborted; None if it is unknown or already finished."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            self.finish(seq, ABORTED)
        return seq

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> ScheduledBatch:
        """Decide the next step: running sequences first, then admissions (module docstring)."""
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
        if not batch.preempted:
            self._schedule_waiting(batch, budget)
        return batch

    def update(self, batch: ScheduledBatch, sampled: list[int | None]) -> list[Sequence]:
        """Account for a computed step: advance ``num_computed_tokens``, append the sampled
        tokens (one per sampling entry of ``batch``); return the sequences that got one."""
        if len(sampled) != len(batch.seqs):
            raise ValueError(f"{len(sampled)} results for {len(batch.seqs)} scheduled sequences")
        out = []
        for item, token in zip(batch.seqs, sampled, strict=True):
            seq = self._seqs[item.request_id]
            seq.num_computed_tokens = item.context_len
            if item.sample:
                if token is None:
                    raise ValueError(f"request {item.request_id!r} was sampled but got no token")
                seq.append_token(token)
                out.append(seq)
            assert seq.slot is not None
            self.prefix_cache.track(seq.slot, seq.token_ids, seq.num_computed_tokens)
        return out

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._grow_or_preempt(seq, seq.num_computed_tokens + n, batch):
                break  # ``seq`` itself was preempted: it was the last running sequence
            batch.seqs.append(self._entry(seq, n))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting[0]
            n = self._admit(seq, budget)
            if n == 0:
                break
            self.waiting.popleft()
            self.running.append(seq)
            seq.status = SequenceStatus.RUNNING
            batch.seqs.append(self._entry(seq, n))
            budget -= n

    def _entry(self, seq: Sequence, n: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        assert seq.slot is not None
        sample = start + n == seq.num_tokens
        outputs = seq.output_token_ids if sample and seq.params.logits_processors else []
        return ScheduledSeq(
            request_id=seq.request_id, slot=seq.slot, token_ids=seq.token_ids[start:start + n],
            start=start, sample=sample, params=seq.params, rng=seq.rng,
            output_token_ids=outputs)

    # ------------------------------------------------------------------ memory
    def _grow_or_preempt(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Map ``num_tokens`` tokens of a running sequence's slot, evicting cache entries and
        then preempting the latest running sequences as needed; False if ``seq`` was preempted.
        """
        assert seq.slot is not None
        while True:
            try:
                self.arena.grow(seq.slot, num_tokens)
                return True
            except PoolExhaustedError:
                if self.prefix_cache.evict_one():
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim.request_id)
                if victim is seq:
                    return False

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Give a waiting sequence a slot (from the prefix cache if a prefix matches) mapped
        for its next chunk; return the chunk's size, or 0 (sequence unchanged) if memory is
        short even with the prefix cache empty."""
        while True:
            try:
                self._assign_slot(seq)
                assert seq.slot is not None
                n = min(seq.num_uncomputed_tokens, budget)
                self.arena.grow(seq.slot, seq.num_computed_tokens + n)
                return n
            except (NoFreeSlotError, PoolExhaustedError):
                if seq.slot is not None:
                    self._release_slot(seq)  # an adopted entry goes back to the cache
                if not self.prefix_cache.evict_one():
                    return 0

    def _assign_slot(self, seq: Sequence) -> None:
        # The last token must be computed to get logits, so reuse at most num_tokens - 1.
        hit = self.prefix_cache.acquire(seq.token_ids, seq.num_tokens - 1)
        if hit is None:
            seq.slot, seq.num_computed_tokens = self.arena.allocate(), 0
        else:
            seq.slot, seq.num_computed_tokens = hit.slot, hit.num_tokens
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens

    def _preempt(self, seq: Sequence) -> None:
        self._release_slot(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)

    def _release_slot(self, seq: Sequence) -> None:
        assert seq.slot is not None
        self.prefix_cache.release(seq.slot, seq.token_ids, seq.num_computed_tokens)
        seq.slot, seq.num_computed_tokens = None, 0
