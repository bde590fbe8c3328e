"""The engine: requests in, one scheduled step at a time, `RequestOutput`s out.

``Engine`` wires the pieces and owns nothing they own: the `Scheduler` owns sequences and their
slots, the `KVCacheManager` (``engine.kv``) owns KV memory (arena, pool, prefix index, host
offload), the `ModelRunner` computes. The engine validates and tokenizes requests, decides when
a request stops (EOS, stop tokens, stop strings, ``max_tokens``, ``max_model_len``) and
detokenizes incrementally; `stats` returns an `EngineStats` snapshot.

The scheduler and the runner are private: code above the engine (the agent layer, the server,
the benches) asks the engine (`memory_short`, `padding_free`, `num_prefilling`, `reclaim`) or
its `KVCacheManager` (``engine.kv``), never their internals.
"""

from __future__ import annotations

import dataclasses
import json
import math
import operator
import time
from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edmm.engine.config import HOST_POOL_BYTES, EngineConfig
from edmm.engine.cuda_graph import CudaGraphRunner, decode_graph_sizes
from edmm.engine.detokenizer import IncrementalDetokenizer, StopStringMatcher
from edmm.engine.errors import (
    ContextLengthError,
    EngineConfigError,
    InvalidRequestError,
    SchedulerStallError,
)
from edmm.engine.hooks import ParallelHooks
from edmm.engine.kv_manager import KVCacheManager, KVStats
from edmm.engine.kv_policy import cache_policy
from edmm.engine.outputs import CompletionOutput, RequestOutput, RequestTiming, TokenLogprobs
from edmm.engine.prefix_cache import CacheTag, PrefixCache
from edmm.engine.runner import Launch, ModelRunner
from edmm.engine.sampling import FinishReason, Sampler, SamplingParams, is_stop
from edmm.engine.scheduler import Resolved, ScheduledBatch, Scheduler, SchedulerConfig
from edmm.engine.sequence import SPECULATED, SequenceKind, SlotHints
from edmm.engine.sequence import Sequence as Seq
from edmm.engine.step_cost import StepCostModel, StepShape, StepTimeModel
from edmm.kernels._common import FP8_KV_DTYPE
from edmm.kernels.decode_routes import default_decode_routes
from edmm.kernels.matmul_routes import default_matmul_routes
from edmm.kernels.skinny_matmul import RoutedMatmul
from edmm.memory import KVArena, KVSpec, PagePool, open_backend
from edmm.memory.copies import make_copier
from edmm.memory.offload import HostKVStore
from edmm.memory.vmm import VMMBackend
from edmm.model import CausalLM, ModelConfig, load_model, load_tokenizer
from edmm.model.attention_choice import (
    AttentionCapabilities,
    build_backend,
    kv_read_align,
    resolve_attention,
)
from edmm.model.kv_quant import (
    calibrate_kv_scales,
    calibration_ids,
    is_fp8,
    kv_storage_dtype,
)
from edmm.model.prompt_encoder import TokenIds

PromptInput = str | Sequence[int]


@dataclass(frozen=True)
class Request:
    """A validated, tokenized request, ready to be queued."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    cache_salt: str | None = None  # KV shared only with requests of the same salt
    # Admission order among waiting requests: lower first, then arrival (vLLM's convention);
    # all 0 is first come, first served.
    priority: float = 0.0

    def __post_init__(self) -> None:
        check_priority(self.priority)


def check_priority(priority: float) -> None:
    """`InvalidRequestError` unless ``priority`` is a finite number."""
    if not math.isfinite(priority):
        raise InvalidRequestError(f"priority must be a finite number, got {priority}")


@dataclass(frozen=True)
class EngineStats:
    """A snapshot of the engine (`Engine.stats`): KV memory, queues, and counters since start.

    Prompt tokens are counted when a request finishes (aborted ones are not): ``reused`` had
    their KV already (prefix cache, retained or speculated KV), ``computed`` were prefilled.
    """

    kv: KVStats
    requests_waiting: int
    requests_running: int
    speculations: int  # speculative prefills waiting or running
    requests_finished: int
    prompt_tokens: int
    prompt_tokens_reused: int
    prompt_tokens_computed: int
    speculation_tokens_computed: int  # tokens prefilled by speculation (all branches)
    num_preemptions: int
    memory_wait_steps: int  # steps whose admissions stopped because memory was short
    memory_wait_running_pages: int  # pages running requests mapped then, summed over them


@dataclass
class _Counters:
    requests_finished: int = 0
    prompt_tokens: int = 0
    prompt_tokens_reused: int = 0


@dataclass(frozen=True)
class RequestValidator:
    """Builds a `Request` from token ids and checks it against the model's fixed limits.

    Immutable and independent of the engine's state, so any thread may use it (the server
    validates on its tokenizing thread while the engine steps on its own). Raises
    `InvalidRequestError` for an empty prompt, token ids outside the vocabulary, bad sampling
    params or stop strings without a tokenizer, and `ContextLengthError` for a prompt longer
    than ``max_model_len``.
    """

    vocab_size: int
    max_model_len: int
    has_tokenizer: bool

    def make(self, request_id: str, prompt_token_ids: Sequence[int],
             params: SamplingParams | None = None, prompt: str | None = None) -> Request:
        """The validated request (``prompt``: its text, when it came as text)."""
        params = params if params is not None else SamplingParams()
        if not isinstance(params, SamplingParams):
            raise InvalidRequestError(f"sampling params must be SamplingParams, got {params!r}")
        if params.stop and not self.has_tokenizer:
            raise InvalidRequestError("stop strings need a tokenizer; use stop_token_ids")
        outside = [t for t in params.logit_bias if t >= self.vocab_size]
        if outside:
            raise InvalidRequestError(f"logit_bias: token id {outside[0]} is not in the "
                                      f"vocabulary [0, {self.vocab_size})")
        ids = self.token_ids(prompt_token_ids)
        if not ids:
            raise InvalidRequestError(f"request {request_id!r}: empty prompt")
        if len(ids) > self.max_model_len:
            raise ContextLengthError(request_id, len(ids), self.max_model_len)
        return Request(request_id, prompt, ids, params)

    def token_ids(self, prompt: Sequence[int]) -> list[int]:
        """``prompt`` as a list of token ids in the vocabulary (`InvalidRequestError` if not)."""
        if not isinstance(prompt, Sequence) or isinstance(prompt, str):
            raise InvalidRequestError(f"prompt must be text or token ids, got {type(prompt)}")
        vocab = self.vocab_size
        if isinstance(prompt, TokenIds) and len(prompt.packed) == len(prompt) and prompt:
            # A tokenizer's ids with their packed twin (`PromptEncoder.encode_ids`): bounds
            # checked on the twin in one pass, the ints taken as they are.
            lo, hi = torch.frombuffer(prompt.packed, dtype=torch.int64).aminmax()
            if int(lo) >= 0 and int(hi) < vocab:
                return prompt[:]  # a plain list (list() of a subclass goes item by item)
        elif isinstance(prompt, array) and prompt.typecode == "q" and prompt:
            # Packed ids (`PromptEncoder.encode_array`): bounds checked in one pass.
            lo, hi = torch.frombuffer(prompt, dtype=torch.int64).aminmax()
            if int(lo) >= 0 and int(hi) < vocab:
                return prompt.tolist()
        elif set(map(type, prompt)) == {int}:  # the common case, checked at C speed
            ints: list[int] = list(prompt)
            if min(ints) >= 0 and max(ints) < vocab:
                return ints
        ids: list[int] = []
        for t in prompt:
            tok = _token_id(t)
            if tok is None or not 0 <= tok < vocab:
                raise InvalidRequestError(f"token id {t!r} is not in the vocabulary [0, {vocab})")
            ids.append(tok)
        return ids


@dataclass(frozen=True)
class StepTiming:
    """Where one `Engine.step` call's host time went (seconds): scheduling, launching the step
    (inputs to the device, the forward pass and sampling queued), waiting for sampled tokens
    (the host idle while the device computes: with async scheduling, the previous step's),
    and processing them (detokenizing, stop checks, outputs)."""

    schedule_s: float = 0.0
    launch_s: float = 0.0
    wait_s: float = 0.0
    process_s: float = 0.0


class _StepClock:
    """Marks the phases of one step (`StepTiming`)."""

    def __init__(self) -> None:
        self._t = time.perf_counter()
        self._marks: dict[str, float] = {}

    def _mark(self, phase: str) -> None:
        now = time.perf_counter()
        self._marks[phase] = now - self._t
        self._t = now

    def scheduled(self) -> None:
        self._mark("schedule_s")

    def launched(self) -> None:
        self._mark("launch_s")

    def waited(self) -> None:
        self._mark("wait_s")

    def finished(self) -> None:
        self._mark("process_s")

    def step_seconds(self) -> float:
        """The step's measured time: launching it and waiting for sampled tokens (with async
        scheduling, the previous step's: in a steady stream, one step of the device's)."""
        return self._marks.get("launch_s", 0.0) + self._marks.get("wait_s", 0.0)

    def timing(self) -> StepTiming:
        return StepTiming(**self._marks)


class _RequestState:
    """Engine-side state of one request: its text so far and how to extend it."""

    def __init__(self, request: Request, tokenizer: Any) -> None:
        self.request = request
        self.detok = (IncrementalDetokenizer(tokenizer, request.prompt_token_ids)
                      if tokenizer is not None else None)
        self.stops = StopStringMatcher(request.params.stop)
        self.text = ""
        # Each output token's log probabilities, when the request asked for them.
        self.logprobs: list[TokenLogprobs] | None = (
            [] if request.params.logprobs is not None else None)

    def push(self, token_id: int, check_stop_strings: bool) -> bool:
        """Detokenize one more token; True if a stop string now ends the text."""
        if self.detok is None:
            return False
        new = len(self.detok.push(token_id))
        self.text = self.detok.text
        if not check_stop_strings:
            return False
        self.text, matched = self.stops.check(self.text, new)
        return matched is not None


class Engine:
    """An LLM engine over a VMM-backed KV arena; see the module docstring.

    ``parallel``: one tensor-parallel rank's hooks (`edmm.engine.tp.build_engine` passes them;
    required when ``config.tensor_parallel_size > 1``).
    """

    def __init__(self, config: EngineConfig | None = None,
                 parallel: ParallelHooks | None = None) -> None:
        self.config = config = config if config is not None else EngineConfig()
        if config.tensor_parallel_size > 1 and parallel is None:
            raise EngineConfigError(
                "tensor_parallel_size > 1: build the engine with edmm.engine.tp.build_engine")
        self.parallel = parallel
        folder = _model_folder(config.model)
        model_ref = folder if folder is not None else str(config.model)
        self.model, self.model_config = load_model(model_ref, config.device, config.dtype,
                                                   load_format=config.load_format)
        if parallel is not None:
            self.model = parallel.shard(self.model)  # model.cfg: this rank's heads
        self.tokenizer = _load_tokenizer(config.tokenizer, folder)
        self.eos_token_ids = _eos_token_ids(self.model_config, self.tokenizer, folder)
        self.max_model_len = _max_model_len(config, self.model)
        local = self.model.cfg  # with ``parallel``: this rank's heads
        spec = KVSpec(local.num_layers, local.num_kv_heads, local.head_dim,
                      _kv_dtype(config, self.model, self.tokenizer,
                                self.model_config.vocab_size))
        self.attention = _attention_name(config)
        self._backend, pool, arena = _build_memory(config, spec, self.max_model_len,
                                                   kv_read_align(self.attention), parallel)
        offload = (HostKVStore(arena, config.kv_offload_bytes,
                               make_copier(arena.kv.device, config.kv_copy_stream),
                               block_tokens=config.prefix_block_size)
                   if config.kv_offload_bytes > 0 and config.enable_prefix_caching else None)
        self.kv = KVCacheManager(arena, PrefixCache(
            arena, config.prefix_block_size, config.enable_prefix_caching, offload,
            cache_policy=cache_policy(config.kv_cache_policy)))
        self._scheduler = Scheduler(self.kv, config.scheduler_config(pool.capacity))
        runner = _build_runner(config, self.model, arena, self.max_model_len, self.attention)
        if isinstance(runner, CudaGraphRunner) and config.speculation_fills_padding:
            self.update_scheduler_config(padded_token_sizes=runner.token_sizes,
                                         padded_max_seqs=runner.max_seqs)
        self._runner = parallel.wrap_runner(runner) if parallel is not None else runner
        self._counters = _Counters()
        self.step_cost = StepCostModel()  # seconds per token of a step, fitted online
        # Modelled step seconds instead of measured ones (replays on a machine without the
        # GPU they model: `StepTimeModel`); None: measured.
        self.step_time_model: StepTimeModel | None = None
        self.last_step_timing: StepTiming | None = None  # where the last step's host time went
        # What the last step computed and its seconds (None: nothing computed): the modelled
        # clock of `edmm bench agents` charges it, its step log records it.
        self.last_step: StepShape | None = None
        self.validator = RequestValidator(self.model_config.vocab_size, self.max_model_len,
                                          self.tokenizer is not None)
        self._states: dict[str, _RequestState] = {}
        self._closed = False
        self._async = config.uses_async_scheduling
        # spares mapped beside the device's work: only while a launched step computes (async;
        # in step, the host's time would only move from one admission to the step before it),
        # and in one process (the ranks' arenas move in step)
        self._spares = (config.prefix_spares and config.enable_prefix_caching and self._async
                        and parallel is None)
        # The launched step whose outputs the next `step` returns (async scheduling).
        self._in_flight: tuple[Launch, list[Seq | None]] | None = None

    # ------------------------------------------------------------------ requests
    def make_request(self, request_id: str, prompt: PromptInput,
                     params: SamplingParams | None = None) -> Request:
        """Validate and tokenize a request without queuing it (`RequestValidator`; a text
        prompt is tokenized with the engine's tokenizer). A used request id is refused by
        `submit`, on the engine's thread."""
        text, ids = self._tokenize(prompt)
        return self.validator.make(request_id, ids, params, text)

    def submit(self, request: Request, hints: SlotHints | None = None) -> None:
        """Queue a request made by `make_request`; ``hints`` tie its slot to tagged cache
        entries (agent sessions: `SlotHints`)."""
        if (request.request_id in self._states
                or self._scheduler.get(request.request_id) is not None):
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        self._states[request.request_id] = _RequestState(request, self.tokenizer)
        hints = hints if hints is not None else SlotHints()
        if request.cache_salt is not None:
            hints = dataclasses.replace(hints, cache_salt=request.cache_salt)
        seq = Seq.new(request.request_id, request.prompt_token_ids, request.params,
                      hints=hints, priority=request.priority)
        seq.max_num_tokens = min(seq.num_tokens + request.params.max_tokens, self.max_model_len)
        self._force_outputs(seq, self._states[request.request_id])
        self._scheduler.add(seq)

    def _force_outputs(self, seq: Seq, state: _RequestState) -> None:
        """Append the tokens its output is known to start with (`SamplingParams.forced_prefix`)
        as generated tokens without KV: the first step computes them with the prompt and
        samples after them."""
        forced = seq.params.forced_prefix(self.eos_token_ids)
        if not forced:
            return
        assert seq.max_num_tokens is not None
        room = max(seq.max_num_tokens - seq.num_tokens - 1, 0)  # one token is always sampled
        forced = self.validator.token_ids(forced)[:room]
        seq.token_ids.extend(forced)
        for token in forced:
            state.push(token, check_stop_strings=False)

    def add_request(self, request_id: str, prompt: PromptInput,
                    params: SamplingParams | None = None,
                    hints: SlotHints | None = None) -> None:
        """Validate, tokenize and queue a request (`make_request` then `submit`)."""
        self.submit(self.make_request(request_id, prompt, params), hints)

    # ------------------------------------------------------------------ speculation
    def speculate(self, spec_id: str, token_ids: Sequence[int], hints: SlotHints) -> None:
        """Queue a speculative prefill of ``token_ids`` (low priority, never sampled): once
        computed, its slot is a cache entry tagged ``hints.tag`` that a request claiming the
        tag adopts zero-copy. A speculation already running under ``spec_id`` is stopped
        first; claiming its own tag, the new one continues from its KV."""
        if spec_id in self._states:
            raise InvalidRequestError(f"speculation id {spec_id!r} is a request id")
        _, ids = self._tokenize(token_ids)
        if not ids or len(ids) > self.max_model_len:
            raise InvalidRequestError(
                f"speculation {spec_id!r}: {len(ids)} tokens, need 1..{self.max_model_len}")
        if hints.tag is None or not self.kv.caching:
            raise InvalidRequestError(
                f"speculation {spec_id!r} needs a tag and prefix caching to be claimed by")
        self.stop_speculation(spec_id)
        self._scheduler.add(Seq.new(spec_id, ids, SamplingParams(), SequenceKind.SPECULATIVE,
                                    hints))

    def stop_speculation(self, spec_id: str) -> bool:
        """Stop a speculative prefill where it is: the KV computed so far stays claimable
        under its tag. False if there is none running or queued under ``spec_id``."""
        seq = self._scheduler.get(spec_id)
        if seq is None or not seq.is_speculative:
            return False
        self._scheduler.finish(seq, SPECULATED)
        return True

    def speculation_progress(self, spec_id: str) -> tuple[int, int] | None:
        """``(tokens with KV, tokens)`` of a queued or running speculation, else None."""
        seq = self._scheduler.get(spec_id)
        if seq is None or not seq.is_speculative:
            return None
        return seq.num_computed_tokens, seq.num_tokens

    def has_speculation(self) -> bool:
        """True while a speculative prefill waits or runs."""
        return self._scheduler.has_speculation()

    def speculation_ids(self) -> list[str]:
        """Ids of the speculative prefills that wait or run."""
        sched = self._scheduler
        return [s.request_id for s in (*sched.spec_waiting, *sched.spec_running)]

    def take_speculated_tokens(self, tag: CacheTag) -> int:
        """Tokens speculation computed under ``tag`` since the last call (then forgotten)."""
        return self._scheduler.speculated.pop(tag, 0)

    def abort(self, request_id: str) -> bool:
        """Stop a request and release its memory; False if it is unknown or finished."""
        self._states.pop(request_id, None)
        return self._scheduler.abort(request_id) is not None

    def has_unfinished(self) -> bool:
        """True while any request waits or runs, or a launched step has a running request's
        output to give (speculative prefills aside, as they are for the scheduler)."""
        if self._scheduler.has_unfinished():
            return True
        return self._in_flight is not None and any(
            seq is not None and not seq.is_finished and not seq.is_speculative
            for seq in self._in_flight[1])

    def num_prefilling(self) -> int:
        """Requests (speculation aside) that wait, or run with prompt tokens still to
        compute."""
        sched = self._scheduler
        return len(sched.waiting) + sum(s.num_computed_tokens < s.num_prompt_tokens
                                        for s in sched.running)

    def memory_short(self) -> bool:
        """True when the last step preempted a request or left the queue's head waiting for
        KV memory: pages freed now are wanted by a request (a prefetch must not take them)."""
        return self._scheduler.memory_short

    @property
    def padding_free(self) -> bool:
        """True when steps that prefill are padded to a CUDA graph's size and speculation
        fills the padding (its tokens then cost no step time of their own)."""
        return bool(self._scheduler.config.padded_token_sizes)

    # ------------------------------------------------------------------ stepping
    def step(self) -> list[RequestOutput]:
        """Run one scheduled step; return the outputs of the requests that got a token.

        With async scheduling (`EngineConfig.async_scheduling`) the step is launched and the
        one launched by the previous call is finished meanwhile: the outputs returned are the
        previous step's (a logits processor that reads the outputs, constrained decoding,
        gets the previous step's token once this step's forward is queued: the runner's
        `with_resolved_outputs`). `last_step_timing` says where the call's host time went."""
        self.last_step = None
        clock = _StepClock()
        restored = self.kv.restored_tokens()
        batch = self._scheduler.schedule()
        clock.scheduled()
        if batch.is_empty:
            if self._in_flight is not None:
                return self._finish(self._take_in_flight(), clock)
            if self.has_unfinished() and not batch.preempted:
                raise SchedulerStallError(
                    f"{len(self._scheduler.waiting)} waiting request(s) cannot be admitted")
            self.kv.reclaim()  # idle: release slots retired by zero-copy commits
            return []
        launch = self._runner.launch(batch, self._in_flight[0] if self._in_flight else None)
        launched = launch, self._scheduler.advance(batch)
        if self._spares:  # while the device computes: the host would wait for it
            self.kv.make_spare()
        clock.launched()
        if self._async:
            previous, self._in_flight = self._in_flight, launched
            outputs = self._finish(previous, clock) if previous is not None else []
        else:
            outputs = self._finish(launched, clock)
        self._record_step(batch, restored, clock.step_seconds())
        self.last_step_timing = clock.timing()
        return outputs

    def _take_in_flight(self) -> tuple[Launch, list[Seq | None]]:
        launched, self._in_flight = self._in_flight, None
        assert launched is not None
        return launched

    def _finish(self, launched: tuple[Launch, list[Seq | None]],
                clock: _StepClock) -> list[RequestOutput]:
        """Wait for a launched step's sampled tokens, put them in place and process them."""
        launch, seqs = launched
        sampled = launch.tokens()
        clock.waited()
        logprobs = launch.logprobs()
        resolved = self._scheduler.resolve(launch.batch, seqs, sampled)
        outputs = [self._process(r, logprobs.get(r.seq.request_id)) for r in resolved]
        clock.finished()
        self.last_step_timing = clock.timing()
        return outputs

    def _record_step(self, batch: ScheduledBatch, restored: float, seconds: float) -> None:
        """What the step computed and its seconds (modelled when a step-time model is set)."""
        shape = StepShape(tuple(len(s.token_ids) for s in batch.seqs),
                          tuple(s.context_len for s in batch.seqs),
                          self.kv.restored_tokens() - restored,
                          speculative_tokens=sum(len(s.token_ids) for s in batch.seqs
                                                 if s.speculative))
        if self.step_time_model is not None:
            seconds = self.step_time_model(shape)
        self.last_step = dataclasses.replace(shape, seconds=seconds)
        self.step_cost.observe(batch.num_tokens, seconds)

    def _process(self, r: Resolved, logprobs: TokenLogprobs | None = None) -> RequestOutput:
        """Detokenize a sequence's new token (keep its ``logprobs``, if asked for) and finish
        it if it stops here."""
        seq, token = r.seq, r.token
        state = self._states[seq.request_id]
        if state.logprobs is not None and logprobs is not None:
            state.logprobs.append(logprobs)
        generated = r.index + 1 - seq.num_prompt_tokens
        reason = is_stop(token, generated, seq.params, self.eos_token_ids)
        may_stop = generated >= seq.params.min_tokens
        if state.push(token, check_stop_strings=may_stop):
            reason = FinishReason.STOP
        if reason is None and r.index + 1 >= self.max_model_len:
            reason = FinishReason.LENGTH
        if reason is not None:
            self._scheduler.finish(seq, reason.value)
            del self._states[seq.request_id]
            self._count_finished(seq)
        return _output(seq, state, r.index + 1)

    def _count_finished(self, seq: Seq) -> None:
        c = self._counters
        c.requests_finished += 1
        c.prompt_tokens += seq.num_prompt_tokens
        c.prompt_tokens_reused += seq.num_cached_tokens

    # ------------------------------------------------------------------ memory, stats
    def reclaim(self) -> int:
        """Release the slots retired by zero-copy commits (driver unmaps: off the critical
        path; the serving loop calls it when idle); return how many."""
        return self.kv.reclaim()

    def reset_prefix_cache(self) -> int:
        """Free every prefix-cache entry (and slots retired by commits); return how many."""
        return self.kv.reset()

    def update_scheduler_config(self, **changes: Any) -> SchedulerConfig:
        """Change scheduler limits between steps (fields of `SchedulerConfig`, validated);
        return the previous config."""
        old = self._scheduler.config
        self._scheduler.config = dataclasses.replace(old, **changes)
        return old

    def stats(self) -> EngineStats:
        """A snapshot of KV memory, the queues and the counters (call on the engine thread)."""
        c, sched = self._counters, self._scheduler
        return EngineStats(
            kv=self.kv.stats(), requests_waiting=len(sched.waiting),
            requests_running=len(sched.running),
            speculations=len(sched.spec_waiting) + len(sched.spec_running),
            requests_finished=c.requests_finished, prompt_tokens=c.prompt_tokens,
            prompt_tokens_reused=c.prompt_tokens_reused,
            prompt_tokens_computed=c.prompt_tokens - c.prompt_tokens_reused,
            speculation_tokens_computed=sched.speculated_total,
            num_preemptions=sched.num_preemptions, memory_wait_steps=sched.memory_waits.steps,
            memory_wait_running_pages=sched.memory_waits.running_pages)

    def check_integrity(self) -> None:
        """Raise if the scheduler and the KV memory disagree, or the arena, the pool, the
        prefix index or the host tier breaks an invariant."""
        self._scheduler.check_integrity()
        if self.parallel is not None:
            self.parallel.check_integrity()

    def close(self) -> None:
        """Release the arena, the pool and the backend; the engine is unusable after."""
        if self._closed:
            return
        self._closed = True
        if self.parallel is not None:
            self.parallel.close()
        if self._in_flight is not None:
            self._in_flight[0].tokens()  # the device is done with the step's slots
            self._in_flight = None
        for request_id in list(self._states):
            self.abort(request_id)
        for seq in [*self._scheduler.spec_waiting, *self._scheduler.spec_running]:
            self._scheduler.abort(seq.request_id)
        if isinstance(self._runner, CudaGraphRunner):
            self._runner.close()
        self.kv.close()
        self._backend.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ helpers
    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequestError("a text prompt needs a tokenizer; pass token ids")
            return prompt, list(self.tokenizer.encode(prompt))
        return None, self.validator.token_ids(prompt)


def _token_id(value: object) -> int | None:
    """``value`` as a token id if it is an integer (numpy and torch integers too), else None."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        return None


def _output(seq: Seq, state: _RequestState, num_tokens: int) -> RequestOutput:
    """The request's output through its first ``num_tokens`` tokens (tokens past them are
    still on the device)."""
    req = state.request
    completion = CompletionOutput(0, state.text, seq.token_ids[seq.num_prompt_tokens:num_tokens],
                                  seq.finish_reason,
                                  list(state.logprobs) if state.logprobs is not None else None)
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion],
                         seq.is_finished, seq.num_cached_tokens, seq.prefix_hit,
                         RequestTiming(seq.first_scheduled_ns, seq.memory_wait_steps))


def _model_folder(model: str | None) -> Path | None:
    """The model folder: ``model`` if it is a directory, the embedded tool model if None, else
    None."""
    if model is None:
        from edmm.model.tiny import default_model

        return default_model()
    path = Path(model)
    return path if path.is_dir() else None


def _load_tokenizer(tokenizer: str | None, folder: Path | None) -> Any:
    if tokenizer is not None:
        return load_tokenizer(tokenizer)
    has_files = folder is not None and any(
        (folder / f).is_file() for f in ("tokenizer.json", "tokenizer_config.json"))
    return load_tokenizer(folder) if has_files and folder is not None else None


def _eos_token_ids(cfg: ModelConfig, tokenizer: Any, folder: Path | None) -> frozenset[int]:
    """EOS ids from the model config, ``generation_config.json`` and the tokenizer."""
    ids: set[int] = set(cfg.eos_token_ids)
    gen = folder / "generation_config.json" if folder is not None else None
    if gen is not None and gen.is_file():
        ids.update(_as_ids(json.loads(gen.read_text()).get("eos_token_id")))
    if tokenizer is not None:
        ids.update(_as_ids(tokenizer.eos_token_id))
    return frozenset(ids)


def _as_ids(value: int | Iterable[int] | None) -> list[int]:
    if value is None:
        return []
    return [int(value)] if isinstance(value, int) else [int(v) for v in value]


def _max_model_len(config: EngineConfig, model: CausalLM) -> int:
    limit = int(model.rotary.max_positions)
    if config.max_model_len is None:
        return limit
    if config.max_model_len > limit:
        raise EngineConfigError(
            f"max_model_len={config.max_model_len} exceeds the model's {limit} positions")
    return config.max_model_len


def _kv_dtype(config: EngineConfig, model: CausalLM, tokenizer: Any,
              vocab_size: int) -> torch.dtype:
    """The KV cache's storage dtype (``config.kv_cache_dtype`` for this model); for FP8 the
    model's KV scales are calibrated and set first (every tensor-parallel rank does this
    together: the pass runs the model's collectives)."""
    weights = next(model.parameters()).dtype
    dtype = kv_storage_dtype(config.kv_cache_dtype, weights)
    if config.uses_cuda_graphs and dtype not in (weights, FP8_KV_DTYPE):
        raise EngineConfigError(
            f"kv_cache_dtype={config.kv_cache_dtype!r} with {weights} weights: the GPU kernels "
            "read KV of the weights' dtype or FP8 (other caches run eagerly: enforce_eager)")
    if is_fp8(dtype):
        model.set_kv_scales(calibrate_kv_scales(model, calibration_ids(tokenizer, vocab_size)))
    return dtype


def _attention_name(config: EngineConfig) -> str:
    """The attention backend the steps run: ``config.attention`` resolved for the device when
    steps replay CUDA graphs, else the reference SDPA."""
    if not config.uses_cuda_graphs:
        return "sdpa"
    return resolve_attention(config.attention, AttentionCapabilities.probe(config.device))


def _build_memory(config: EngineConfig, spec: KVSpec, max_model_len: int, read_align: int = 1,
                  parallel: ParallelHooks | None = None
                  ) -> tuple[VMMBackend, PagePool, KVArena]:
    """The VMM backend, the page pool and the arena (slots mapped up to ``read_align``
    tokens, the attention's); the pool must hold one longest sequence (with ``parallel``: the
    same pool size on every rank, and the rank's own arena)."""
    backend = open_backend(config.backend_kind,
                           device_index=torch.device(config.device).index or 0,
                           host_page_size=config.host_page_size)
    per_seq = -(-max_model_len * spec.token_bytes // backend.page_size)
    num_pages = _num_pages(config, backend.page_size, per_seq)
    if parallel is not None:
        num_pages = parallel.agree_num_pages(num_pages)
    if num_pages < per_seq:
        backend.close()
        raise EngineConfigError(
            f"{num_pages} KV pages of {backend.page_size} B cannot hold one sequence of "
            f"max_model_len={max_model_len} ({per_seq} pages); raise num_pages or lower "
            "max_model_len")
    pool = PagePool(backend, num_pages)
    if parallel is not None:
        return backend, pool, parallel.make_arena(pool, spec, config.num_slots, max_model_len,
                                                  read_align)
    return backend, pool, KVArena(pool, spec, config.num_slots, max_model_len, read_align)


def _num_pages(config: EngineConfig, page_size: int, per_seq: int) -> int:
    """Pool size: explicit, else a share of the GPU's memory, else enough for every slot."""
    if config.num_pages is not None:
        return config.num_pages
    if config.backend_kind == "cuda":
        free, total = torch.cuda.mem_get_info(torch.device(config.device))
        usable = free - (1.0 - config.gpu_memory_utilization) * total
        return max(int(usable // page_size), 0)
    return min(config.num_slots * per_seq, max(HOST_POOL_BYTES // page_size, per_seq))


def _build_runner(config: EngineConfig, model: CausalLM, arena: KVArena,
                  max_model_len: int, attention: str) -> ModelRunner:
    """On CUDA (unless ``enforce_eager``): the ``attention`` backend (FA4 or Triton), fused
    pointwise ops, CUDA graphs for decode and mixed batches (captured, and FA4's kernels
    compiled, here at start-up)."""
    sampler = Sampler(config.seed)
    if not config.uses_cuda_graphs:
        return ModelRunner(model, arena, config.device, sampler)
    model.set_backend(build_backend(attention, max_model_len,
                                    decode_routes=default_decode_routes()))
    model.enable_fusion()
    matmul_routes = default_matmul_routes()
    if matmul_routes is not None:  # decode batches' projections: measured skinny routes
        model.set_matmul(RoutedMatmul(matmul_routes))
    token_sizes = tuple(t for t in config.cuda_graph_token_sizes
                        if t <= config.max_num_batched_tokens)
    # Mixed graphs take the running sequences and as many speculative prefills.
    return CudaGraphRunner(model, arena, config.device, sampler,
                           sizes=decode_graph_sizes(config.max_num_seqs),
                           token_sizes=token_sizes, max_seqs=2 * config.max_num_seqs,
                           seq_buckets=config.cuda_graph_mixed_seq_buckets)
