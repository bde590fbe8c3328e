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

The runner sees only the batch; it never reads scheduler state.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np
import torch
from torch import Tensor

from edmm.engine.sampling import RequestRng, Sampler, SamplingParams, apply_logits_processors
from edmm.engine.scheduler import ScheduledBatch
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

    @property
    def is_decode_only(self) -> bool:
        """True when every sequence computes one token (the CUDA-graph case)."""
        return all(q == 1 for q in self.meta.query_lens)


class ModelRunner:
    """Runs scheduled batches through ``model`` with KV in ``arena``."""

    def __init__(self, model: CausalModel, arena: KVArena, device: torch.device | str,
                 sampler: Sampler | None = None) -> None:
        self.model = model
        self.arena = arena
        self.device = torch.device(device)
        self.sampler = sampler if sampler is not None else Sampler()

    @property
    def reserved_slots(self) -> int:
        """Arena slots the runner itself holds (each maps one page) for as long as it lives."""
        return 0

    def execute(self, batch: ScheduledBatch) -> list[int | None]:
        """Compute a step; return the sampled token of each sequence of the batch (None for
        those that do not sample this step, e.g. a prefill chunk short of the prompt's end)."""
        out: list[int | None] = [None] * len(batch.seqs)
        if batch.is_empty:
            return out
        inputs = self.prepare(batch)
        with torch.inference_mode():
            hidden = self.forward(inputs)  # [T, hidden]
            tokens = self.sample(hidden, inputs)  # [N]
        for i, token in zip(inputs.sample_seqs, tokens.tolist(), strict=True):
            out[i] = int(token)
        return out

    def prepare(self, batch: ScheduledBatch) -> ModelInputs:
        """Flatten a batch into device tensors (two host-to-device copies: token ids and
        sampled rows, then the attention metadata, whose token indices are the positions)."""
        ids: list[int] = []
        rows: list[int] = []
        sample_seqs: list[int] = []
        for i, s in enumerate(batch.seqs):
            ids.extend(s.token_ids)
            if s.sample:
                rows.append(len(ids) - 1)
                sample_seqs.append(i)
        meta = AttentionMetadata.build(
            [s.slot for s in batch.seqs], [len(s.token_ids) for s in batch.seqs],
            [s.context_len for s in batch.seqs], self.device)
        assert meta.token_index is not None
        input_ids, sample_rows = int64_tensor(ids + rows, self.device).split(
            [len(ids), len(rows)])
        return ModelInputs(
            input_ids=input_ids, positions=meta.token_index, meta=meta,
            sample_rows=sample_rows, sample_seqs=sample_seqs,
            params=[batch.seqs[i].params for i in sample_seqs],
            rngs=[batch.seqs[i].rng for i in sample_seqs],
            output_token_ids=[batch.seqs[i].output_token_ids for i in sample_seqs])

    def forward(self, inputs: ModelInputs) -> Tensor:
        """Hidden states ``[T, hidden]``; writes the new tokens' KV into the arena in place."""
        return self.model.forward(inputs.input_ids, inputs.positions, self.arena.kv, inputs.meta)

    def sample(self, hidden: Tensor, inputs: ModelInputs) -> Tensor:
        """Next tokens ``[N]`` of the sampled rows of ``hidden`` ``[T, hidden]``."""
        if not inputs.sample_seqs:
            return torch.empty(0, dtype=torch.int64)
        return self.pick(self.model.compute_logits(hidden[inputs.sample_rows]), inputs)

    def pick(self, logits: Tensor, inputs: ModelInputs) -> Tensor:
        """Next tokens ``[N]`` from the sampled rows' float32 logits ``[N, vocab]``: logits
        processors, then the sampler."""
        if any(p.logits_processors for p in inputs.params):
            logits = apply_logits_processors(logits, inputs.params, inputs.output_token_ids)
        return self.sampler(logits, inputs.params, inputs.rngs)  # [N]


def int64_tensor(values: list[int], device: torch.device | str) -> Tensor:
    """``values`` as an int64 tensor on ``device``, converted through numpy (a 16K-token
    prompt's ids ~4x faster than ``torch.tensor``) and copied without waiting for the device."""
    host = torch.from_numpy(np.array(values, dtype=np.int64))
    return host.to(device, non_blocking=True)
