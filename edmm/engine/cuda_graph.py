"""Forward passes replayed from CUDA graphs: decode batches and mixed / prefill batches.

A forward pass of a 7B model is a few hundred kernels; launched one by one from Python they cost
more CPU time than the GPU needs for a decode step, and milliseconds of gaps in a 512-token
prefill. `CudaGraphRunner` captures the model's forward once per padded shape, into static
input buffers, and replays the graph after copying a step's inputs in:

- **decode graphs**, one per batch size in ``sizes``: every sequence computes one token (the
  split-K decode kernel), and the graph ends with the logits of every row, so a decode step
  launches only the sampler after it;
- **mixed graphs**, per token count ``T`` in ``token_sizes`` one per sequence bound ``S``
  (the ``seq_buckets`` below ``min(max_seqs, T - 1)``, and that): any batch of at most ``T``
  tokens and ``S`` sequences — prefill chunks, a resume's new tokens, decodes with a
  speculation riding along (the varlen prefill kernel, whose launch depends on the token and
  sequence counts only). A batch with a prefill has fewer sequences than tokens, so every
  such batch of at most ``max_seqs`` sequences fits the graph of the smallest ``T`` that
  holds its tokens; of that ``T``, the smallest ``S`` that holds its sequences replays. The
  prefill kernel launches ``T / BLOCK_M + S`` row tiles per head and each padding sequence's
  tile still runs the kernel's prologue, so a prefill with few sequences beside it must not
  replay a graph padded to hundreds (`mixed_shape`).

Padding never touches a live slot: padding tokens write their KV to token 0 of a reserved
one-token pad slot, padding sequences have no queries (query offsets repeat the last one) and
attend to the pad slot. Padding rows of the output hold garbage that no sampled row reads
(rows never mix outside attention). Batches larger than every captured shape run eagerly
through `ModelRunner.forward`.

The attention backend must take lengths from device tensors (the Triton backend does); the
reference SDPA backend loops over Python lengths and is not captured.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass

import torch
from torch import Tensor

from edmm.engine.config import DEFAULT_MIXED_SEQ_BUCKETS
from edmm.engine.runner import CausalModel, ModelInputs, ModelRunner, Picked
from edmm.engine.sampling import Sampler
from edmm.memory import KVArena
from edmm.model.attention import AttentionMetadata

DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 32)


def decode_graph_sizes(max_seqs: int) -> tuple[int, ...]:
    """Decode batch sizes to capture for up to ``max_seqs`` running sequences: 1, 2, 4, 8,
    then every multiple of 8 (a batch pads at most 7 rows, as vLLM's capture sizes do), and
    ``max_seqs`` itself."""
    sizes = {s for s in (1, 2, 4, 8) if s <= max_seqs} | set(range(16, max_seqs + 1, 8))
    return tuple(sorted(sizes | {max_seqs}))


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: Tensor  # [size, hidden] output written by the graph
    logits: Tensor | None  # [size, vocab] float32 of every row (decode graphs)


class _StaticInputs:
    """Device buffers a family of graphs reads (a graph of ``t`` tokens and ``b`` sequences
    uses the leading rows), and the copy of a step's inputs into them.

    Rows past the step's tokens / sequences are reset to padding only where an earlier, larger
    step left real values (``_dirty_*``), so a steady decode batch costs one multi-tensor copy
    and a fill.
    """

    def __init__(self, tokens: int, seqs: int, pad_slot: int, device: torch.device) -> None:
        def buf(n: int, fill: int) -> Tensor:
            return torch.full((n,), fill, dtype=torch.int64, device=device)

        self.pad_slot = pad_slot
        self.ids, self.pos = buf(tokens, 0), buf(tokens, 0)  # [tokens]
        self.slot_index, self.token_index = buf(tokens, pad_slot), buf(tokens, 0)  # [tokens]
        self.slot_ids, self.ctx = buf(seqs, pad_slot), buf(seqs, 1)  # [seqs]
        self.query_start = buf(seqs + 1, 0)  # [seqs + 1]
        self._dirty_tokens = 0
        self._dirty_seqs = 0

    def meta(self, tokens: int, seqs: int, query_lens: list[int]) -> AttentionMetadata:
        """Static metadata over the leading rows. Its Python lists (``query_lens`` must sum to
        ``tokens``) only satisfy the model's shape checks and pick the kernel: the kernels read
        the tensors."""
        return AttentionMetadata(
            slot_ids=list(range(seqs)), query_lens=query_lens, context_lens=list(query_lens),
            slot_index=self.slot_index[:tokens], token_index=self.token_index[:tokens],
            last_token_index=None,  # not read by the model
            slot_ids_t=self.slot_ids[:seqs], context_lens_t=self.ctx[:seqs],
            query_start_loc=self.query_start[:seqs + 1], placeholder_lists=True)

    def load(self, inputs: ModelInputs) -> None:
        """Copy a step's tokens and metadata in; reset stale rows to padding."""
        meta = inputs.meta
        assert (meta.slot_index is not None and meta.token_index is not None
                and meta.slot_ids_t is not None and meta.context_lens_t is not None
                and meta.query_start_loc is not None)
        t, b = inputs.input_ids.shape[0], meta.num_seqs
        torch._foreach_copy_(  # one launch for the seven copies
            [self.ids[:t], self.pos[:t], self.slot_index[:t], self.token_index[:t],
             self.slot_ids[:b], self.ctx[:b], self.query_start[:b + 1]],
            [inputs.input_ids, inputs.positions, meta.slot_index, meta.token_index,
             meta.slot_ids_t, meta.context_lens_t, meta.query_start_loc])
        if self._dirty_tokens > t:
            end = self._dirty_tokens
            self.ids[t:end].zero_()
            self.pos[t:end].zero_()
            self.slot_index[t:end].fill_(self.pad_slot)
            self.token_index[t:end].zero_()
        if self._dirty_seqs > b:
            self.slot_ids[b:self._dirty_seqs].fill_(self.pad_slot)
            self.ctx[b:self._dirty_seqs].fill_(1)
        self.query_start[b + 1:].fill_(t)  # padding sequences: no queries
        self._dirty_tokens, self._dirty_seqs = t, b


def mixed_buckets(tokens: int, max_seqs: int, seq_buckets: tuple[int, ...]) -> tuple[int, ...]:
    """Sequence bounds of the mixed graphs of ``tokens`` tokens, ascending: each of
    ``seq_buckets`` below the most such a graph takes, ``min(max_seqs, tokens - 1)``, then
    that most."""
    most = min(max_seqs, tokens - 1)
    return tuple(sorted({b for b in seq_buckets if 0 < b < most} | {most}))


def mixed_shape(token_sizes: tuple[int, ...], max_seqs: int, seq_buckets: tuple[int, ...],
                tokens: int, seqs: int) -> tuple[int, int] | None:
    """The (tokens, sequences) of the mixed graph a batch replays: the smallest token count
    of ``token_sizes`` (ascending) that holds ``tokens`` and whose largest graph holds
    ``seqs``, then its smallest sequence bound that holds ``seqs``; None: no graph fits."""
    for t in token_sizes:
        if t >= tokens and min(max_seqs, t - 1) >= seqs:
            return t, next(b for b in mixed_buckets(t, max_seqs, seq_buckets) if b >= seqs)
    return None


class CudaGraphRunner(ModelRunner):
    """A `ModelRunner` whose batches replay captured CUDA graphs (see the module docstring).

    Args:
        sizes: decode batch sizes to capture.
        token_sizes: token counts of the mixed graphs (those that fit a slot are kept); the
            graph of ``T`` tokens takes ``min(max_seqs, T - 1)`` sequences, fewer than its
            tokens, so its static metadata always selects the prefill kernel. Empty: no
            mixed graphs.
        max_seqs: most sequences a mixed graph takes (default: the most the arena can hold).
        seq_buckets: smaller sequence bounds of the mixed graphs (`mixed_buckets`).
    """

    def __init__(self, model: CausalModel, arena: KVArena, device: torch.device | str,
                 sampler: Sampler | None = None,
                 sizes: tuple[int, ...] = DEFAULT_GRAPH_SIZES,
                 token_sizes: tuple[int, ...] = (), max_seqs: int | None = None,
                 seq_buckets: tuple[int, ...] = DEFAULT_MIXED_SEQ_BUCKETS) -> None:
        super().__init__(model, arena, device, sampler)
        self.pad_slot = arena.allocate()
        arena.grow(self.pad_slot, 1)
        usable = arena.num_slots - 1
        self.max_seqs = min(max_seqs or usable, usable)
        self.sizes = tuple(sorted(s for s in sizes if s <= usable))
        self.token_sizes = tuple(sorted(t for t in token_sizes if 1 < t <= arena.max_tokens))
        self.seq_buckets = seq_buckets
        self._decode_in = _StaticInputs(max(self.sizes, default=0), max(self.sizes, default=0),
                                        self.pad_slot, self.device)
        self._mixed_in = _StaticInputs(max(self.token_sizes, default=0), self.max_seqs,
                                       self.pad_slot, self.device)
        self._pool = torch.cuda.graph_pool_handle()
        # Largest first, so smaller graphs reuse the pool's blocks.
        self._mixed = {(t, b): self._capture(self._mixed_in, t, b, logits=False)
                       for t in reversed(self.token_sizes)
                       for b in reversed(self.mixed_buckets(t))}
        self._decode = {bs: self._capture(self._decode_in, bs, bs, logits=True)
                        for bs in reversed(self.sizes)}
        self._logits: Tensor | None = None  # [T, vocab] of the decode graph just replayed
        self.replays: Counter[str] = Counter()  # forward passes by path: decode, mixed, eager

    @property
    def reserved_slots(self) -> int:
        """The pad slot (one token, one page)."""
        return 1

    def mixed_seqs(self, tokens: int) -> int:
        """The most sequences a mixed graph of ``tokens`` tokens takes."""
        return min(self.max_seqs, tokens - 1)

    def mixed_buckets(self, tokens: int) -> tuple[int, ...]:
        """Sequence bounds of the mixed graphs of ``tokens`` tokens (`mixed_buckets`)."""
        return mixed_buckets(tokens, self.max_seqs, self.seq_buckets)

    def _capture(self, static: _StaticInputs, tokens: int, seqs: int, logits: bool) -> _Graph:
        query_lens = [tokens - seqs + 1] + [1] * (seqs - 1)  # sums to tokens
        meta = static.meta(tokens, seqs, query_lens)
        ids, pos, kv = static.ids[:tokens], static.pos[:tokens], self.arena.kv

        def run() -> tuple[Tensor, Tensor | None]:
            hidden = self.model.forward(ids, pos, kv, meta)  # [tokens, hidden]
            return hidden, self.model.compute_logits(hidden) if logits else None

        with torch.inference_mode():
            for _ in range(2):  # warm-up: compile kernels, settle the allocator
                run()
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                hidden, out = run()
        return _Graph(graph, hidden, out)

    def _route(self, tokens: int, seqs: int, decode_only: bool
               ) -> tuple[str, _StaticInputs, _Graph] | None:
        """The path, input buffers and graph of a step of ``tokens`` tokens over ``seqs``
        sequences: the smallest captured graph that fits; None: it runs eagerly."""
        if decode_only and seqs <= max(self.sizes, default=0):
            return "decode", self._decode_in, self._decode[next(s for s in self.sizes
                                                                if s >= seqs)]
        shape = mixed_shape(self.token_sizes, self.max_seqs, self.seq_buckets, tokens, seqs)
        return None if shape is None else ("mixed", self._mixed_in, self._mixed[shape])

    def graph_for(self, num_tokens: int, num_seqs: int = 1) -> torch.cuda.CUDAGraph | None:
        """The graph a step of ``num_tokens`` tokens over ``num_seqs`` sequences replays (a
        decode graph when each computes one token), None when such a step runs eagerly; its
        `replay` reruns the last step of that shape alone (profiling)."""
        route = self._route(num_tokens, num_seqs, num_tokens == num_seqs)
        return route[2].graph if route is not None else None

    def forward(self, inputs: ModelInputs) -> Tensor:
        """Replay the smallest captured graph that fits the batch; else run eagerly."""
        t = inputs.input_ids.shape[0]
        route = self._route(t, inputs.meta.num_seqs, inputs.is_decode_only)
        if route is None:
            self.replays["eager"] += 1
            self._logits = None
            return super().forward(inputs)
        path, static, g = route
        self.replays[path] += 1
        static.load(inputs)
        g.graph.replay()
        self._logits = g.logits[:t] if g.logits is not None else None
        return g.hidden[:t]

    def sample_picked(self, hidden: Tensor, inputs: ModelInputs) -> Picked:
        """Sample from the logits the decode graph computed, else as `ModelRunner` does."""
        logits, self._logits = self._logits, None
        if logits is None or not inputs.sample_seqs:
            return super().sample_picked(hidden, inputs)
        if len(inputs.sample_seqs) == logits.shape[0]:  # every row samples, in order
            return self.pick(logits, inputs)
        return self.pick(logits[inputs.sample_rows], inputs)

    def close(self) -> None:
        """Drop the graphs and give the pad slot back."""
        self._mixed.clear()
        self._decode.clear()
        self.arena.free(self.pad_slot)
