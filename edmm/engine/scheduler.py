"""Token-budget scheduling with continuous batching, prefix reuse and recompute preemption.

Each step spends at most ``max_num_batched_tokens`` tokens:

1. running sequences, in admission order, each get what they still need (1 token when decoding,
   the rest of the prompt, or as much of it as the budget allows: chunked prefill);
2. if no sequence was preempted in (1), waiting sequences are admitted in order of their
   request's ``priority`` (lower first), then arrival (`WaitingQueue`: all priorities 0 is
   first come, first served; a preempted sequence keeps its place) while budget,
   ``max_num_seqs`` and memory allow: a prefix-cache hit gives a slot that already
   holds the longest cached prefix (`KVCacheManager.match`: no recompute), else a fresh slot
   is taken.

3. speculative prefills (`SequenceKind.SPECULATIVE`, an agent's branches in a tool window) get
   only what is left: the whole remaining budget when no request ran in the step, else at most
   ``speculative_tokens_when_busy`` tokens (small enough not to slow a decode step) or, in a
   step that prefills and is padded to one of ``padded_token_sizes`` (a mixed CUDA graph),
   the padding it would compute anyway, whichever is more; within a cap on the pages
   speculation holds. So under sustained load, when decode steps leave speculation nothing,
   it still runs in the padding of the resumes' and prompts' prefill steps. They never
   sample; once every token has KV the sequence finishes and its slot becomes a tagged
   `EntryRank.SPECULATIVE` cache entry. One that extends its session's KV in place
   (`SlotHints.in_place`) runs in the session's own slot (`KVCacheManager.lend`) and gives it
   back as the session's entry; under memory pressure it is dropped with its tokens cut off,
   the session's KV kept.

Admission stops at the first sequence whose tokens do not all fit (no sequence overtakes the
head of the queue, so none starves), so a partially prefilled sequence is always the most
recently admitted one: admission order puts decodes first.

Memory: the scheduler sees it only through a `KVCacheManager` (match, allocate, grow, free,
make room). Before its tokens are computed, a sequence's slot is grown to map them.
When the pool (or the slots) are short for a request, the scheduler reclaims in this order:
speculation entries, running speculative prefills, the other prefix-cache entries (by rank,
priority, then LRU), and finally it preempts the most recently admitted running request: its
slot is released (to the prefix cache, so a resume may reuse it) and it goes back to the front
of the queue to be recomputed (vLLM's recompute preemption). A waiting request never preempts a
running one; a speculative prefill only ever evicts speculation and plain entries, never a
retained session's KV.

The scheduler is the one owner of sequence status and token accounting; it hands the runner a
plain `ScheduledBatch` and takes the sampled tokens back in `update`.

**Async scheduling.** `update` is two halves that may run a step apart: `advance` accounts
for a step as soon as it is launched (its tokens have KV; each sampling sequence gets a
`PENDING_TOKEN` in the sampled token's place), `resolve` writes the sampled values once they
reach the host. So the next step can be scheduled and launched while the device still computes
this one: a decoding sequence whose last token is pending is scheduled with that placeholder
(`ScheduledSeq.pending_input`) and the runner takes its value from the previous step's
tokens on the device. A sequence that reaches ``max_num_tokens`` is not scheduled past it;
one that stops on a token only its value reveals (EOS, a stop string) computes one more
token in the step already in flight, which `resolve` drops (`Sequence.num_pending`).
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import time
from collections import Counter, deque
from collections.abc import Iterator
from dataclasses import dataclass, field

from edmm.engine.errors import EngineConfigError, IntegrityError
from edmm.engine.kv_manager import KVCacheManager
from edmm.engine.prefix_cache import CacheTag, EntryRank, PrefixHit
from edmm.engine.sampling import OutputCounts, RequestRng, SamplingParams
from edmm.engine.sequence import (
    ABORTED,
    PENDING_TOKEN,
    SPECULATED,
    Sequence,
    SequenceStatus,
)
from edmm.memory import NoFreeSlotError, PoolExhaustedError
from edmm.memory.errors import pages_short


@dataclass(frozen=True)
class SchedulerConfig:
    """Per-step limits."""

    max_num_batched_tokens: int
    max_num_seqs: int
    speculative_tokens_when_busy: int = 64  # speculation tokens in a step that runs requests
    speculative_tokens_when_idle: int = 2048  # bounds how long a resume waits behind a step
    max_speculative_pages: int | None = None  # pages speculation may hold; None: no cap
    # Token counts a step with a prefill is padded to (the mixed CUDA graphs), and the most
    # sequences such a step takes: speculation may fill a busy step's padding. () : none.
    padded_token_sizes: tuple[int, ...] = ()
    padded_max_seqs: int = 0

    def __post_init__(self) -> None:
        if self.speculative_tokens_when_busy < 0 or self.speculative_tokens_when_idle < 0:
            raise EngineConfigError("speculative_tokens_when_busy/_idle must be >= 0")
        if self.max_speculative_pages is not None and self.max_speculative_pages < 0:
            raise EngineConfigError("max_speculative_pages must be >= 0")
        if self.max_num_seqs < 1:
            raise EngineConfigError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise EngineConfigError(
                f"max_num_batched_tokens={self.max_num_batched_tokens} < max_num_seqs="
                f"{self.max_num_seqs}: some running sequences could not decode in a step")


@dataclass
class MemoryWaits:
    """Steps in which admission stopped because memory was short (the queue's head waited
    while others ran), and the pages running requests mapped then: what holds the pool when
    a turn waits for memory."""

    steps: int = 0
    running_pages: int = 0  # summed over those steps

    def record(self, running_pages: int) -> None:
        """One more step whose admission stopped for memory."""
        self.steps += 1
        self.running_pages += running_pages


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
    counts: OutputCounts | None = None  # its output's token counts (penalized params only)
    speculative: bool = False  # an agent's speculative prefill (never samples)
    # Its one token is the previous step's sample, still on the device (async scheduling):
    # the runner takes the value from that step's sampled tokens.
    pending_input: bool = False

    @property
    def context_len(self) -> int:
        """Tokens with KV in the slot after this step."""
        return self.start + len(self.token_ids)


@dataclass(frozen=True)
class Resolved:
    """A sampled token in its place: ``seq.token_ids[index] == token``."""

    seq: Sequence
    token: int
    index: int


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


class WaitingQueue:
    """Waiting requests in admission order: by ``priority`` (lower first), then by
    ``arrival`` (when the scheduler first queued them). A preempted sequence goes back under
    its first arrival, so it is ahead of everything queued after it (FCFS: the front, vLLM's
    recompute preemption)."""

    def __init__(self) -> None:
        self._items: list[Sequence] = []  # sorted by (priority, arrival)

    def push(self, seq: Sequence) -> None:
        """Queue ``seq`` at its place."""
        bisect.insort(self._items, seq, key=_admission_key)

    def peek(self) -> Sequence:
        """The next sequence to admit (IndexError when empty)."""
        return self._items[0]

    def pop(self) -> Sequence:
        """Remove and return the next sequence to admit."""
        return self._items.pop(0)

    def remove(self, seq: Sequence) -> None:
        """Take ``seq`` out; ValueError if it is not waiting."""
        self._items.remove(seq)

    def __iter__(self) -> Iterator[Sequence]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)


def _admission_key(seq: Sequence) -> tuple[float, int]:
    return seq.priority, seq.arrival


class Scheduler:
    """Continuous-batching scheduler over a KV cache manager; see the module docstring."""

    def __init__(self, kv: KVCacheManager, config: SchedulerConfig) -> None:
        self.kv = kv
        self.config = config
        self.waiting = WaitingQueue()
        self.running: list[Sequence] = []  # admission order
        self.spec_waiting: deque[Sequence] = deque()
        self.spec_running: list[Sequence] = []  # admission order
        self.num_preemptions = 0
        self.memory_waits = MemoryWaits()
        # True when the last `schedule` preempted a request or left the queue's head waiting
        # for KV memory: pages freed now are wanted by a request (what a prefetch must not take)
        self.memory_short = False
        self.speculated: Counter[CacheTag] = Counter()  # tag -> tokens computed by speculation
        self.speculated_total = 0  # tokens computed by speculation, since start
        self._seqs: dict[str, Sequence] = {}
        self._arrivals = itertools.count()

    # ------------------------------------------------------------------ requests
    def add(self, seq: Sequence) -> None:
        """Queue a new sequence (its request id must be unused)."""
        if seq.request_id in self._seqs:
            raise ValueError(f"request id {seq.request_id!r} is already scheduled")
        self._seqs[seq.request_id] = seq
        seq.arrival = next(self._arrivals)
        if seq.is_speculative:
            self.spec_waiting.append(seq)
        else:
            self.waiting.push(seq)

    def get(self, request_id: str) -> Sequence | None:
        """The unfinished sequence of a request, if any."""
        return self._seqs.get(request_id)

    def has_unfinished(self) -> bool:
        """True while any request (speculative prefills aside) waits or runs."""
        return bool(self.waiting or self.running)

    def has_speculation(self) -> bool:
        """True while any speculative prefill waits or runs."""
        return bool(self.spec_waiting or self.spec_running)

    def finish(self, seq: Sequence, reason: str) -> None:
        """Stop a sequence (``reason``: a FinishReason value, ABORTED or SPECULATED) and
        release its slot (to the prefix cache, with the sequence's slot hints); tokens still
        pending are dropped first (`drop_pending`)."""
        self.drop_pending(seq)
        if seq.status == SequenceStatus.RUNNING:
            self._running(seq).remove(seq)
            self._release_slot(seq)
        elif seq.status == SequenceStatus.WAITING:
            self._queue(seq).remove(seq)
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, reason
        self._seqs.pop(seq.request_id, None)

    def abort(self, request_id: str) -> Sequence | None:
        """Finish a request as aborted; None if it is unknown or already finished."""
        seq = self._seqs.get(request_id)
        if seq is not None:
            self.finish(seq, ABORTED)
        return seq

    def check_integrity(self) -> None:
        """Raise `IntegrityError` if the queues, the sequences' slots and the KV manager
        disagree: a running sequence holds a live slot of its own (not a cache entry) mapping
        its computed tokens; a waiting one holds none."""
        running = [*self.running, *self.spec_running]
        queued = [*self.waiting, *self.spec_waiting]
        if {s.request_id for s in (*running, *queued)} != set(self._seqs) or (
                len(running) + len(queued) != len(self._seqs)):
            raise IntegrityError("scheduler queues out of sync with its sequences")
        slots = [s.slot for s in running]
        if None in slots or len(set(slots)) != len(slots):
            raise IntegrityError(f"running sequences' slots {slots}: missing or shared")
        entries = set(self.kv.entry_slots())
        for seq in running:
            assert seq.slot is not None
            if seq.slot in entries or self.kv.num_tokens(seq.slot) < seq.num_computed_tokens:
                raise IntegrityError(f"{seq.request_id!r}: slot {seq.slot} is a cache entry "
                                     f"or maps fewer than {seq.num_computed_tokens} tokens")
        if any(s.slot is not None or s.status != SequenceStatus.WAITING for s in queued):
            raise IntegrityError("a waiting sequence holds a slot")
        self.kv.check_integrity()

    # ------------------------------------------------------------------ scheduling
    def schedule(self) -> ScheduledBatch:
        """Decide the next step: running sequences first, then admissions, then speculation
        in what is left (module docstring)."""
        batch = ScheduledBatch()
        budget = self._schedule_running(batch, self.config.max_num_batched_tokens)
        self.memory_short = bool(batch.preempted)
        if batch.preempted:
            return batch
        budget = self._schedule_waiting(batch, budget)
        if not batch.seqs and not self.running:  # idle (a request whose last token is still
            # on the device runs: its output waits for the next step)
            self._schedule_speculation(batch, min(budget, self.config.speculative_tokens_when_idle))
            return batch
        busy, padding = self.config.speculative_tokens_when_busy, self._padding(batch)
        max_seqs = self.config.padded_max_seqs if padding > busy else None
        cap = max(busy, padding)
        self._schedule_speculation(batch, min(budget, cap), max_seqs)
        return batch

    def _padding(self, batch: ScheduledBatch) -> int:
        """Tokens a busy step that prefills would pad with anyway (0: a decode-only step, which
        replays a decode graph, or no padded size fits)."""
        t = batch.num_tokens
        if t == len(batch.seqs) or len(batch.seqs) >= self.config.padded_max_seqs:
            return 0
        return next((size - t for size in sorted(self.config.padded_token_sizes) if size >= t), 0)

    def update(self, batch: ScheduledBatch, sampled: list[int | None]) -> list[Resolved]:
        """Account for a computed step (`advance`, then `resolve`); the sequences that got a
        token, with it."""
        seqs = self.advance(batch)
        return self.resolve(batch, seqs, sampled)

    def advance(self, batch: ScheduledBatch) -> list[Sequence | None]:
        """Account for a launched step: its tokens have KV now, each sampling entry's sequence
        gets a `PENDING_TOKEN`; speculative prefills that computed their last token finish.
        Returns the entries' sequences, for `resolve`."""
        seqs: list[Sequence | None] = []
        done = []
        for item in batch.seqs:
            seq = self._seqs[item.request_id]
            seqs.append(seq)
            seq.num_computed_tokens = item.context_len
            if seq.is_speculative:
                self.speculated[seq.hints.tag or ""] += len(item.token_ids)
                self.speculated_total += len(item.token_ids)
                if seq.num_uncomputed_tokens == 0:
                    done.append(seq)
            if item.sample:
                seq.append_token(PENDING_TOKEN)
                seq.num_pending += 1
        for seq in done:
            self.finish(seq, SPECULATED)
        return seqs

    def resolve(self, batch: ScheduledBatch, seqs: list[Sequence | None],
                sampled: list[int | None]) -> list[Resolved]:
        """Write the sampled tokens of an advanced step in their places (``seqs``: what
        `advance` returned) and index the KV they complete; the sequences that got a token,
        with it. A sequence finished meanwhile (stopped, aborted) gets nothing."""
        if len(sampled) != len(batch.seqs):
            raise ValueError(f"{len(sampled)} results for {len(batch.seqs)} scheduled sequences")
        out = []
        for item, seq, token in zip(batch.seqs, seqs, sampled, strict=True):
            assert seq is not None
            if item.sample:
                if token is None:
                    raise ValueError(f"request {item.request_id!r} was sampled but got no token")
                if seq.is_finished:
                    continue
                seq.token_ids[item.context_len] = token
                seq.num_pending -= 1
                out.append(Resolved(seq, token, item.context_len))
            if seq.slot is not None and not seq.is_finished:
                self.kv.track(seq.slot, seq.token_ids, seq.num_computed_tokens,
                              seq.hints.cache_salt)
        return out

    def drop_pending(self, seq: Sequence) -> None:
        """Forget the tokens a sequence that stops now was given after its last resolved one
        (their KV, computed by a step in flight, stays valid but unused)."""
        if seq.num_pending:
            del seq.token_ids[-seq.num_pending:]
            seq.num_computed_tokens = min(seq.num_computed_tokens, seq.num_tokens)
            seq.num_pending = 0

    def _schedule_running(self, batch: ScheduledBatch, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            seq = self.running[i]
            if seq.num_pending and seq.will_stop:
                i += 1  # its pending token is its last: nothing more to compute
                continue
            n = min(seq.num_uncomputed_tokens, budget)
            if not self._grow_or_preempt(seq, seq.num_computed_tokens + n, batch):
                break  # ``seq`` itself was preempted: it was the last running sequence
            batch.seqs.append(self._entry(seq, n))
            budget -= n
            i += 1
        return budget

    def _schedule_waiting(self, batch: ScheduledBatch, budget: int) -> int:
        while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
            seq = self.waiting.peek()
            n = self._admit(seq, budget)
            if n == 0:
                self.memory_waits.record(
                    sum(self.kv.mapped_pages(s.slot) for s in self.running if s.slot is not None))
                seq.memory_wait_steps += 1
                self.memory_short = True
                break
            if seq.first_scheduled_ns is None:
                seq.first_scheduled_ns = time.time_ns()
            self.waiting.pop()
            self.running.append(seq)
            seq.status = SequenceStatus.RUNNING
            batch.seqs.append(self._entry(seq, n))
            budget -= n
        return budget

    def _schedule_speculation(self, batch: ScheduledBatch, budget: int,
                              max_seqs: int | None = None) -> None:
        """Running speculative prefills, then admissions, in ``budget`` tokens (and while the
        batch has fewer than ``max_seqs`` sequences); a speculation that cannot get memory (or
        would pass the page cap) stops where it is."""
        idle = not batch.seqs
        seqs_left = (lambda: True) if max_seqs is None else (
            lambda: len(batch.seqs) < max_seqs)
        for seq in list(self.spec_running):
            if budget <= 0 or not seqs_left():
                return
            n = self._map_speculation(seq, min(seq.num_uncomputed_tokens, budget))
            if not n:
                self.finish(seq, SPECULATED)  # the cap or the pool stops it here
                continue
            batch.seqs.append(self._entry(seq, n))
            budget -= n
        while self.spec_waiting and budget > 0 and seqs_left():
            seq = self.spec_waiting[0]
            if not self._extends_cached(seq):
                self.finish(seq, ABORTED)  # the KV it extends is gone (SlotHints.min_cached)
                continue
            chunk = self._admit_speculation(seq, budget)
            if chunk is None:
                if not idle:
                    return  # memory is short while requests run: wait for them
                self.finish(seq, ABORTED)  # no memory even with nothing else running
                continue
            self.spec_waiting.popleft()
            seq.status = SequenceStatus.RUNNING
            self.spec_running.append(seq)
            if chunk == 0:
                self.finish(seq, SPECULATED)  # every token already has KV
                continue
            batch.seqs.append(self._entry(seq, chunk))
            budget -= chunk

    def _extends_cached(self, seq: Sequence) -> bool:
        """Whether the KV a speculative prefill extends is still there: its first
        ``min_cached`` tokens in the pool, or (in place) in its session's entry."""
        h = seq.hints
        if h.in_place:
            assert h.tag is not None
            return self.kv.lendable(h.tag, seq.token_ids, h.min_cached, h.cache_salt)
        return not h.min_cached or self.kv.cached_prefix(
            seq.token_ids, seq.num_tokens) >= h.min_cached

    def _entry(self, seq: Sequence, n: int) -> ScheduledSeq:
        start = seq.num_computed_tokens
        assert seq.slot is not None
        sample = start + n == seq.num_tokens and not seq.is_speculative
        outputs = seq.output_token_ids if sample and seq.params.logits_processors else []
        return ScheduledSeq(
            request_id=seq.request_id, slot=seq.slot, token_ids=seq.token_ids[start:start + n],
            start=start, sample=sample, params=seq.params, rng=seq.rng,
            counts=seq.counts, output_token_ids=outputs, speculative=seq.is_speculative,
            pending_input=seq.num_pending > 0)

    # ------------------------------------------------------------------ memory
    def _grow_or_preempt(self, seq: Sequence, num_tokens: int, batch: ScheduledBatch) -> bool:
        """Map ``num_tokens`` tokens of a running sequence's slot, evicting cache entries and
        then preempting the latest running sequences as needed; False if ``seq`` was preempted.
        """
        assert seq.slot is not None
        while True:
            try:
                self.kv.grow(seq.slot, num_tokens)
                return True
            except PoolExhaustedError as e:
                if self._make_room(pages=e.shortfall):
                    continue
                victim = self.running.pop()
                self._preempt(victim)
                batch.preempted.append(victim.request_id)
                if victim is seq:
                    return False

    def _admit(self, seq: Sequence, budget: int) -> int:
        """Give a waiting sequence a slot (from the prefix cache if a prefix matches) mapped
        for its next chunk; return the chunk's size, or 0 (sequence unchanged) if memory is
        short even with the prefix cache empty.

        Host copies of the entries it claims are restored first. While other requests run,
        a sequence whose copy cannot come back yet (the pool is short of the pages it maps)
        waits instead of recomputing it in a fresh slot (a chunk would fit where the whole
        copy does not, and the recompute ends up needing the same pages), and the loop below
        never evicts the sequence's own session entry to make room for it (that frees no
        memory it would not need again to recompute the same tokens); with nothing running it
        evicts any other entry. It never evicts the entry it adopted, or loaded from the host,
        and gave back (its own KV, as a preempted request's): that KV would be adopted or
        loaded again on the retry, no page the better (a tail-first trim of it, reloaded, is a
        loop that never ends). If nothing else is left to evict, the sequence does not fit
        the pool and waits."""
        own = () if seq.hints.tag is None else (seq.hints.tag,)
        if not self.kv.restore_claimed({*seq.hints.claim, *own}) and self.running:
            return 0
        while True:
            hit = None
            try:
                hit = self._assign_slot(seq)
                assert seq.slot is not None
                n = min(seq.num_uncomputed_tokens, budget)
                self.kv.grow(seq.slot, seq.num_computed_tokens + n)
                self._record_admission(seq, hit)
                return n
            except (NoFreeSlotError, PoolExhaustedError) as e:
                mine: tuple[int, ...] = ()
                if seq.slot is not None:
                    kept = hit is not None and (hit.slot == hit.source or hit.host_tokens > 0)
                    mine = (seq.slot,) if kept else ()
                    self._unassign(seq, hit)
                if not self._make_room(own if self.running else (), pages_short(e), mine):
                    return 0

    def _admit_speculation(self, seq: Sequence, budget: int) -> int | None:
        """Give a waiting speculative prefill a slot mapped for its next chunk, evicting only
        speculation entries; return the chunk's size (0: nothing left to compute), or None
        (sequence unchanged) if memory or the page cap allows no token."""
        while True:
            try:
                hit = self._assign_slot(seq)
                break
            except (NoFreeSlotError, PoolExhaustedError) as e:
                if not self._free_for_speculation(pages_short(e)) or not self._extends_cached(
                        seq):  # the room was made from the KV it extends
                    return None
        want = min(seq.num_uncomputed_tokens, budget)
        chunk = self._map_speculation(seq, want) if want else 0
        if want and not chunk:
            self._unassign(seq, hit)
            return None
        self._record_admission(seq, hit)
        return chunk

    def _map_speculation(self, seq: Sequence, want: int) -> int:
        """Map up to ``want`` more tokens of a speculative slot within the page cap and the
        pool, evicting older speculation entries when short; return how many (0: none)."""
        assert seq.slot is not None
        start = seq.num_computed_tokens
        while True:
            n = min(want, self._speculation_room(seq) - start)
            if n < want and self._free_for_speculation():
                continue
            if n <= 0:
                return 0
            try:
                self.kv.grow(seq.slot, start + n)
                return n
            except PoolExhaustedError as e:
                if not self._free_for_speculation(e.shortfall):
                    return 0

    def _speculation_room(self, seq: Sequence) -> int:
        """Most tokens speculative ``seq``'s slot may hold under ``max_speculative_pages``."""
        cap = self.config.max_speculative_pages
        if cap is None:
            return self.kv.max_tokens
        assert seq.slot is not None
        mine = self._speculation_pages(seq)
        others = self.speculative_pages() - (mine if seq in self.spec_running else 0)
        return self.kv.tokens_in_pages(self.kv.mapped_pages(seq.slot) + cap - others - mine)

    def speculative_pages(self) -> int:
        """Pages held only by speculation (running prefills, speculation entries and the
        speculative tails of entries extended in place)."""
        running = sum(self._speculation_pages(s) for s in self.spec_running if s.slot is not None)
        entries = sum(self.kv.private_pages(slot)
                      for slot in self.kv.entry_slots(EntryRank.SPECULATIVE))
        return running + entries + self.kv.tail_pages()

    def _speculation_pages(self, seq: Sequence) -> int:
        """Pages speculative ``seq`` holds for itself: its slot's private pages, or in place
        those past the session's KV it extends."""
        assert seq.slot is not None
        if seq.hints.in_place:
            return max(0, self.kv.mapped_pages(seq.slot) - self.kv.pages_for(seq.hints.min_cached))
        return self.kv.private_pages(seq.slot)

    def _free_for_speculation(self, pages: int | None = None) -> bool:
        """Reclaim retired slots, else evict one speculation or plain entry (never a retained
        session's) for ``pages`` pages (None: a slot); False if none."""
        return self.kv.make_room(EntryRank.PLAIN, pages=pages)

    def _make_room(self, protect: tuple[CacheTag, ...] = (), pages: int | None = None,
                   spare: tuple[int, ...] = ()) -> bool:
        """Free memory for a request that lacks ``pages`` pages (None: a slot): slots retired
        by zero-copy commits, a speculation entry, else the latest speculative prefill, else
        any other cache entry (rank, priority, LRU) not tagged in ``protect`` and not in
        ``spare``. False if none is left."""
        if self.kv.make_room(EntryRank.SPECULATIVE, pages=pages, spare=spare):
            return True
        if self.spec_running:
            seq = self.spec_running.pop()
            self._drop(seq)
            return True
        return self.kv.make_room(protect=protect, pages=pages, spare=spare)

    def _drop(self, seq: Sequence) -> None:
        """Finish a speculative prefill and free its slot outright (memory pressure); in
        place, the slot goes back as its session's entry with the speculated tokens cut off."""
        assert seq.slot is not None
        self.kv.drop(seq.slot)
        seq.slot, seq.num_computed_tokens = None, 0
        seq.status, seq.finish_reason = SequenceStatus.FINISHED, ABORTED
        self._seqs.pop(seq.request_id, None)

    def _assign_slot(self, seq: Sequence) -> PrefixHit | None:
        """A slot for ``seq``: the longest cached prefix (claimed entries adopted), else a
        fresh one. Returns the hit, timed."""
        # A request must compute its last token to get logits: reuse at most num_tokens - 1.
        limit = seq.num_tokens if seq.is_speculative else seq.num_tokens - 1
        t0 = time.perf_counter()
        h = seq.hints
        if h.in_place:
            assert h.tag is not None
            hit: PrefixHit | None = self.kv.lend(h.tag, seq.token_ids, h.min_cached,
                                                 h.cache_salt)
        else:
            hit = self.kv.match(seq.token_ids, limit, h.claim, h.tag, h.cache_salt)
        if hit is None:
            seq.slot, seq.num_computed_tokens = self.kv.allocate(), 0
            return None
        seq.slot, seq.num_computed_tokens = hit.slot, hit.num_tokens
        return dataclasses.replace(hit, seconds=time.perf_counter() - t0)

    def _unassign(self, seq: Sequence, hit: PrefixHit | None) -> None:
        """Undo `_assign_slot` after memory ran short: an adopted entry, or a slot holding KV
        loaded from the host, goes back to the cache (with its KV: the retry finds it there,
        the host copy is not loaded again); a fresh slot or a branch is freed (caching a
        branch, a copy of part of its source, and evicting it would loop forever)."""
        assert seq.slot is not None
        if hit is not None and (hit.slot == hit.source or hit.host_tokens):
            self._release_slot(seq, (hit.rank, hit.priority))
            return
        self.kv.drop(seq.slot)
        seq.slot, seq.num_computed_tokens = None, 0

    def _record_admission(self, seq: Sequence, hit: PrefixHit | None) -> None:
        """The sequence holds its slot: entries still tagged like it are stale (earlier KV it
        did not adopt) and go under its ``stale_tag``; the first admission's hit is kept."""
        hints = seq.hints
        if hints.tag is not None and not hints.in_place:  # in place: its slot is the entry
            stale = EntryRank.SPECULATIVE if seq.is_speculative else EntryRank.PLAIN
            self.kv.mark_stale(hints.tag, stale, hints.stale_tag)
        if seq.num_preemptions == 0:
            seq.num_cached_tokens = seq.num_computed_tokens
            seq.prefix_hit = hit

    def _preempt(self, seq: Sequence) -> None:
        self._release_slot(seq)
        seq.status = SequenceStatus.WAITING
        seq.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push(seq)

    def _release_slot(self, seq: Sequence,
                      adopted: tuple[EntryRank, float] | None = None) -> None:
        """Give the slot back to the prefix cache under the sequence's tag and class; an
        entry it adopted and gives back unused (``adopted``: the class it had) keeps the
        higher of the two (a paused session's KV must not turn into a plain entry)."""
        assert seq.slot is not None
        h = seq.hints
        rank = EntryRank.SPECULATIVE if seq.is_speculative else h.rank
        rank, priority = max((rank, h.priority), adopted or (rank, h.priority))
        self.kv.free(seq.slot, seq.token_ids, seq.num_computed_tokens, h.tag, rank, priority,
                     h.cache_salt)
        seq.slot, seq.num_computed_tokens = None, 0

    def _queue(self, seq: Sequence) -> deque[Sequence] | WaitingQueue:
        return self.spec_waiting if seq.is_speculative else self.waiting

    def _running(self, seq: Sequence) -> list[Sequence]:
        return self.spec_running if seq.is_speculative else self.running

