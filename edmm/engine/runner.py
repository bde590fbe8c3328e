"""The model runner: turns a `ScheduledBatch` into one forward pass and sampled tokens.

Three stages, each replaceable on its own:

- `prepare`: flatten the batch into ``input_ids`` / ``positions`` ``[T]`` and the
  `AttentionMetadata` (slot, query length and context length per sequence);
- `forward`: the model over the arena's KV view, returning hidden states ``[T, hidden]``.
  This is the seam for CUDA graphs: a decode-graph runner overrides `forward` for batches where
  `ModelInputs.is_decode_only` holds (every query length 1), replaying a graph captured for the
  padded batch size, and defers to this one otherwise;
- `sample`: logits only for the rows that sample (the last token of each sequence that reaches
  its end this step), then the `Sampler`.

`execute` runs the three and waits for the sampled tokens. `launch` queues them on the device
and returns at once (`Launch.tokens` waits): with async scheduling the engine schedules and
launches the next step meanwhile. Such a step may decode a token whose value is still on the
device (`ScheduledSeq.pending_input`): `prepare` takes it from the previous launch's sampled
tokens, on the device; a logits processor that reads the outputs (constrained decoding) gets
that token's value after the forward is queued, so the host computes its masks while the
device computes (`with_resolved_outputs`). On CUDA every host-to-device copy of a step goes
through one pinned staging buffer (a copy from pageable memory would wait for the device)
and the sampled tokens come back into pinned memory.

The runner sees only the batch; it never reads scheduler state.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from edmm.engine.outputs import TokenLogprobs
from edmm.engine.sampling import (
    OutputCounts,
    RequestRng,
    SampledLogprobs,
    Sampler,
    SamplingParams,
    adjust_logits,
    apply_logits_processors,
    count_outputs,
    raw_logprobs,
    sampled_logprobs,
)
from edmm.engine.scheduler import ScheduledBatch
from edmm.engine.sequence import PENDING_TOKEN
from edmm.memory import KVArena
from edmm.model.attention import AttentionMetadata


class CausalModel(Protocol):
    """What the runner needs of a model (`edmm.model.CausalLM` provides it)."""

    def forward(
        self, input_ids: Tensor, positions: Tensor, kv_cache: Tensor, meta: AttentionMetadata
    ) -> Tensor:
        """``[T]`` ids and positions, the arena KV view and metadata -> hidden ``[T, hidden]``."""
        ...

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """``[N, hidden]`` -> float32 ``[N, vocab]``."""
        ...


@dataclass(frozen=True)
class ModelInputs:
    """Device tensors and metadata of one forward pass over ``T`` tokens of ``B`` sequences."""

    input_ids: Tensor  # [T] int64
    positions: Tensor  # [T] int64, a token's index in its slot
    meta: AttentionMetadata  # B sequences, index tensors built on the device
    sample_rows: Tensor  # [N] int64 rows of T whose logits are sampled
    sample_seqs: list[int]  # [N] index in the batch of each sampled row
    params: list[SamplingParams]  # [N]
    rngs: list[RequestRng]  # [N]
    output_token_ids: list[list[int]] = field(default_factory=list)  # [N], for logits processors
    counts: list[OutputCounts | None] = field(default_factory=list)  # [N], penalized rows'

    @property
    def is_decode_only(self) -> bool:
        """True when every sequence computes one token (the CUDA-graph case)."""
        return all(q == 1 for q in self.meta.query_lens)


@dataclass(frozen=True)
class Picked:
    """What sampling one step gave: the tokens ``[N]`` and, when a row asked for them, their
    log probabilities (`SampledLogprobs`), on the device."""

    tokens: Tensor  # [N] int64
    logprobs: SampledLogprobs | None = None


class Launch:
    """A step queued on the device; its sampled tokens come to the host on their own.

    ``rows``: each sampling request's row of ``tokens_dev``, for a next step that decodes the
    token before it reaches the host (`ModelRunner.prepare`). ``logprobs``: the sampled
    tokens' log probabilities when a row asked for them (on CUDA copied to pinned host memory
    before ``event``, so reading them never waits for a later step).
    """

    def __init__(self, batch: ScheduledBatch, sample_seqs: list[int], tokens_dev: Tensor,
                 host: Tensor | None, event: torch.cuda.Event | None,
                 logprobs: SampledLogprobs | None = None) -> None:
        self.batch = batch
        self.sample_seqs = sample_seqs  # [N] batch index of each sampled row
        self.tokens_dev = tokens_dev  # [N] int64 on the device
        self.rows = {batch.seqs[i].request_id: r for r, i in enumerate(sample_seqs)}
        self._host = host  # [N] pinned copy of tokens_dev (CUDA); None: tokens_dev is here
        self._event = event  # recorded after the copy to ``host``
        self._tokens: list[int | None] | None = None
        self._logprobs = logprobs

    def logprobs(self) -> dict[str, TokenLogprobs]:
        """The sampled token's log probabilities of each request that asked for them, by
        request id (call after `tokens`)."""
        lp = self._logprobs
        if lp is None:
            return {}
        tokens = self.tokens()
        chosen, ids, values = lp.chosen.tolist(), lp.top_ids.tolist(), lp.top_values.tolist()
        out: dict[str, TokenLogprobs] = {}
        for row, i in enumerate(self.sample_seqs):
            seq = self.batch.seqs[i]
            k = seq.params.logprobs
            token = tokens[i]
            if k is None or token is None:
                continue
            top = tuple(zip(ids[row][:k], values[row][:k], strict=True))
            out[seq.request_id] = TokenLogprobs(token, chosen[row], top)
        return out

    def token_of(self, request_id: str) -> int:
        """The token ``request_id`` sampled in this step (waits for the device, as `tokens`);
        KeyError when it did not sample here."""
        token = self.tokens()[self.sample_seqs[self.rows[request_id]]]
        assert token is not None
        return token

    def tokens(self) -> list[int | None]:
        """The sampled token of each entry of the batch (None: it did not sample); waits for
        the device (the GIL is free meanwhile)."""
        if self._tokens is None:
            if self._event is not None:
                self._event.synchronize()
            values = (self._host if self._host is not None else self.tokens_dev).tolist()
            out: list[int | None] = [None] * len(self.batch.seqs)
            for i, token in zip(self.sample_seqs, values, strict=True):
                out[i] = int(token)
            self._tokens = out
        return self._tokens


class PinnedRing:
    """Pinned host buffers used in turn for host <-> device copies that must not wait for the
    device's queue (a copy from pageable memory would): a buffer is reused only once the copy
    last made from it is done (its event), and grows when a step needs more."""

    def __init__(self, device: torch.device, dtype: torch.dtype, size: int = 4) -> None:
        self.device, self.dtype = device, dtype
        self._bufs: list[Tensor | None] = [None] * size
        self._events: list[torch.cuda.Event | None] = [None] * size
        self._next = 0

    def take(self, n: int) -> tuple[Tensor, int]:
        """A pinned buffer of at least ``n`` elements that no pending copy uses, and its
        index for `copied`."""
        i, self._next = self._next, (self._next + 1) % len(self._bufs)
        event = self._events[i]
        if event is not None:
            event.synchronize()
        buf = self._bufs[i]
        if buf is None or buf.numel() < n:
            buf = torch.empty(max(n, 4096, 2 * (buf.numel() if buf is not None else 0)),
                              dtype=self.dtype, pin_memory=True)
            self._bufs[i] = buf
        return buf, i

    def copied(self, i: int) -> torch.cuda.Event:
        """Mark buffer ``i``'s copy queued on the current stream; its event."""
        event = torch.cuda.Event()
        event.record()
        self._events[i] = event
        return event


class ModelRunner:
    """Runs scheduled batches through ``model`` with KV in ``arena``."""

    def __init__(self, model: CausalModel, arena: KVArena, device: torch.device | str,
                 sampler: Sampler | None = None) -> None:
        self.model = model
        self.arena = arena
        self.device = torch.device(device)
        self.sampler = sampler if sampler is not None else Sampler()
        cuda = self.device.type == "cuda"
        self._inputs = PinnedRing(self.device, torch.int64) if cuda else None
        self._outputs = PinnedRing(self.device, torch.int64) if cuda else None

    @property
    def reserved_slots(self) -> int:
        """Arena slots the runner itself holds (each maps one page) for as long as it lives."""
        return 0

    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        """Compute a step; return the sampled token of each sequence of the batch (None for
        those that do not sample this step, e.g. a prefill chunk short of the prompt's end)."""
        if batch.is_empty:
            return [None] * len(batch.seqs)
        return self.launch(batch).tokens()

    def launch(self, batch: ScheduledBatch, previous: Launch | None = None) -> Launch:
        """Queue a (non-empty) step on the device and return without waiting for it;
        ``previous``: the launch whose sampled tokens this step's pending inputs are."""
        inputs = self.prepare(batch, previous)
        with torch.inference_mode():
            hidden = self.forward(inputs)  # [T, hidden]
            # queued: while the device computes the forward, the host waits for the previous
            # step's tokens where a logits processor reads them, then computes its masks
            inputs = with_resolved_outputs(inputs, batch, previous)
            picked = self.sample_picked(hidden, inputs)
        tokens = picked.tokens  # [N]
        if self._outputs is None or not inputs.sample_seqs:
            return Launch(batch, inputs.sample_seqs, tokens, None, None, picked.logprobs)
        logprobs = _to_pinned(picked.logprobs)
        host, i = self._outputs.take(len(inputs.sample_seqs))
        host = host[:len(inputs.sample_seqs)]
        host.copy_(tokens, non_blocking=True)
        return Launch(batch, inputs.sample_seqs, tokens, host, self._outputs.copied(i),
                      logprobs)

    def prepare(self, batch: ScheduledBatch, previous: Launch | None = None) -> ModelInputs:
        """Flatten a batch into device tensors, in one host-to-device copy: the token ids,
        the sampled rows, the attention metadata (whose token indices are the positions) and,
        for pending inputs, where their values sit in ``previous``'s sampled tokens."""
        ids: list[int] = []
        rows: list[int] = []
        sample_seqs: list[int] = []
        dst: list[int] = []  # rows of ids whose value is pending
        src: list[int] = []  # their rows in previous.tokens_dev
        for i, s in enumerate(batch.seqs):
            if s.pending_input:
                if previous is None or s.request_id not in previous.rows:
                    raise ValueError(f"{s.request_id!r}: pending input without its launch")
                dst.append(len(ids) + len(s.token_ids) - 1)
                src.append(previous.rows[s.request_id])
            ids.extend(s.token_ids)
            if s.sample:
                rows.append(len(ids) - 1)
                sample_seqs.append(i)
        meta = AttentionMetadata(
            [s.slot for s in batch.seqs], [len(s.token_ids) for s in batch.seqs],
            [s.context_len for s in batch.seqs])
        parts = [*meta.index_arrays(), *(np.asarray(v, dtype=np.int64)
                                         for v in (ids, rows, dst, src))]
        views = self._to_device(np.concatenate(parts)).split([len(p) for p in parts])
        meta = meta.with_tensors(views[:6])
        input_ids, sample_rows, dst_t, src_t = views[6:]
        if dst:
            assert previous is not None
            input_ids[dst_t] = previous.tokens_dev[src_t]  # [len(dst)], on the device
        assert meta.token_index is not None
        return ModelInputs(
            input_ids=input_ids, positions=meta.token_index, meta=meta,
            sample_rows=sample_rows, sample_seqs=sample_seqs,
            params=[batch.seqs[i].params for i in sample_seqs],
            rngs=[batch.seqs[i].rng for i in sample_seqs],
            output_token_ids=[batch.seqs[i].output_token_ids for i in sample_seqs],
            counts=[batch.seqs[i].counts for i in sample_seqs])

    def _to_device(self, values: np.ndarray) -> Tensor:
        """``values`` (int64) on the device: through a pinned buffer on CUDA, so the copy is
        queued without waiting for the device's work."""
        host = torch.from_numpy(values)
        if self._inputs is None:
            return host.to(self.device)
        buf, i = self._inputs.take(len(values))
        staged = buf[:len(values)]
        staged.copy_(host)
        out = staged.to(self.device, non_blocking=True)
        self._inputs.copied(i)
        return out

    def forward(self, inputs: ModelInputs) -> Tensor:
        """Hidden states ``[T, hidden]``; writes the new tokens' KV into the arena in place."""
        return self.model.forward(inputs.input_ids, inputs.positions, self.arena.kv, inputs.meta)

    def sample(self, hidden: Tensor, inputs: ModelInputs) -> Tensor:
        """Next tokens ``[N]`` of the sampled rows of ``hidden`` ``[T, hidden]``."""
        return self.sample_picked(hidden, inputs).tokens

    def sample_picked(self, hidden: Tensor, inputs: ModelInputs) -> Picked:
        """`sample`, with the sampled tokens' log probabilities where a row asks for them."""
        if not inputs.sample_seqs:
            return Picked(torch.empty(0, dtype=torch.int64))
        return self.pick(self.model.compute_logits(hidden[inputs.sample_rows]), inputs)

    def pick(self, logits: Tensor, inputs: ModelInputs) -> Picked:
        """Next tokens ``[N]`` from the sampled rows' float32 logits ``[N, vocab]``: the raw
        log probabilities where asked for, penalties and logit biases, logits processors, then
        the sampler; the penalized rows count their new token on the device."""
        params = inputs.params
        raw = raw_logprobs(logits, params)  # [N, V] or None
        if any(p.penalized or p.logit_bias for p in params):
            logits = adjust_logits(logits, params, inputs.counts)
        if any(p.logits_processors for p in params):
            logits = apply_logits_processors(logits, params, inputs.output_token_ids)
        tokens = self.sampler(logits, params, inputs.rngs)  # [N]
        if any(c is not None for c in inputs.counts):
            count_outputs(tokens, inputs.counts)
        return Picked(tokens, sampled_logprobs(raw, tokens, params) if raw is not None
                      else None)


def with_resolved_outputs(inputs: ModelInputs, batch: ScheduledBatch,
                          previous: Launch | None) -> ModelInputs:
    """``inputs`` whose logits processors' outputs end in the value of a token still pending
    (async scheduling: sampled by ``previous``, not yet on the host) get that value: waits for
    ``previous``'s tokens only then. ValueError when such a token has no launch to come from,
    or a placeholder sits anywhere but last (one step in flight at most)."""
    outputs = inputs.output_token_ids
    if not any(out and out[-1] == PENDING_TOKEN for out in outputs):
        return inputs
    resolved = []
    for out, i in zip(outputs, inputs.sample_seqs, strict=True):
        if PENDING_TOKEN in out[:-1]:
            raise ValueError(f"{batch.seqs[i].request_id!r}: a pending token before its last")
        if out and out[-1] == PENDING_TOKEN:
            request_id = batch.seqs[i].request_id
            if previous is None or request_id not in previous.rows:
                raise ValueError(f"{request_id!r}: a pending output without its launch")
            out = [*out[:-1], previous.token_of(request_id)]
        resolved.append(out)
    return replace(inputs, output_token_ids=resolved)


def _to_pinned(lp: SampledLogprobs | None) -> SampledLogprobs | None:
    """``lp`` copied to pinned host memory, queued on the current stream (CUDA)."""
    if lp is None:
        return None

    def pinned(t: Tensor) -> Tensor:
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        return host.copy_(t, non_blocking=True)

    return SampledLogprobs(pinned(lp.chosen), pinned(lp.top_ids), pinned(lp.top_values))


def int64_tensor(values: list[int], device: torch.device | str) -> Tensor:
    """``values`` as an int64 tensor on ``device``, converted through numpy (a 16K-token
    prompt's ids ~4x faster than ``torch.tensor``) and copied without waiting for the device."""
    host = torch.from_numpy(np.array(values, dtype=np.int64))
    return host.to(device, non_blocking=True)
