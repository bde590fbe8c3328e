"""Decode steps replayed from CUDA graphs.

A decode step of a 7B model is a few hundred small kernels; launching them one by one costs
more CPU time than the GPU needs to run them. `CudaGraphRunner` captures the model's forward
for decode batches padded to a few sizes, into static input buffers, and replays the graph
after copying the step's inputs in. Padding rows attend to a reserved one-token pad slot, so
they read and write only mapped memory. Anything that is not a pure decode batch, or is larger
than the largest captured size, runs eagerly through `ModelRunner.forward`.

The attention backend must take lengths from device tensors (the Triton backend does); the
reference SDPA backend loops over Python lengths and is not captured.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from edmm.engine.runner import CausalModel, ModelInputs, ModelRunner
from edmm.engine.sampling import Sampler
from edmm.memory import KVArena
from edmm.model.attention import AttentionMetadata

DEFAULT_GRAPH_SIZES = (1, 2, 4, 8, 16, 32)


@dataclass
class _Graph:
    graph: torch.cuda.CUDAGraph
    meta: AttentionMetadata  # static device tensors of this size
    hidden: Tensor  # [bs, hidden] output written by the graph


class CudaGraphRunner(ModelRunner):
    """A `ModelRunner` whose decode batches replay captured CUDA graphs."""

    def __init__(self, model: CausalModel, arena: KVArena, device: torch.device | str,
                 sampler: Sampler | None = None,
                 sizes: tuple[int, ...] = DEFAULT_GRAPH_SIZES) -> None:
        super().__init__(model, arena, device, sampler)
        self.pad_slot = arena.allocate()
        arena.grow(self.pad_slot, 1)
        usable = arena.num_slots - 1
        self.sizes = tuple(sorted(s for s in sizes if s <= usable))
        top = max(self.sizes, default=0)
        dev = self.device
        # Static inputs shared by every graph (a graph of size bs uses the first bs rows).
        self._ids = torch.zeros(top, dtype=torch.int64, device=dev)
        self._pos = torch.zeros(top, dtype=torch.int64, device=dev)
        self._slot = torch.full((top,), self.pad_slot, dtype=torch.int64, device=dev)
        self._tok = torch.zeros(top, dtype=torch.int64, device=dev)
        self._ctx = torch.ones(top, dtype=torch.int64, device=dev)
        self._rows = torch.arange(top + 1, dtype=torch.int64, device=dev)
        self._pool = torch.cuda.graph_pool_handle()
        self._graphs = {bs: self._capture(bs) for bs in reversed(self.sizes)}

    def _static_meta(self, bs: int) -> AttentionMetadata:
        # Python lists only satisfy the model's shape checks; kernels read the tensors.
        return AttentionMetadata(
            slot_ids=list(range(bs)), query_lens=[1] * bs, context_lens=[1] * bs,
            slot_index=self._slot[:bs], token_index=self._tok[:bs],
            last_token_index=self._rows[:bs], slot_ids_t=self._slot[:bs],
            context_lens_t=self._ctx[:bs], query_start_loc=self._rows[:bs + 1])

    def _capture(self, bs: int) -> _Graph:
        meta = self._static_meta(bs)
        kv = self.arena.kv
        with torch.inference_mode():
            for _ in range(2):  # warm-up: compile kernels, settle the allocator
                self.model.forward(self._ids[:bs], self._pos[:bs], kv, meta)
            torch.cuda.synchronize(self.device)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self._pool):
                hidden = self.model.forward(self._ids[:bs], self._pos[:bs], kv, meta)
        return _Graph(graph, meta, hidden)

    def forward(self, inputs: ModelInputs) -> Tensor:
        """Replay the smallest captured graph that fits a decode batch; else run eagerly."""
        b = inputs.meta.num_seqs
        if not inputs.is_decode_only or b > max(self.sizes, default=0):
            return super().forward(inputs)
        bs = next(s for s in self.sizes if s >= b)
        meta = inputs.meta
        assert meta.slot_ids_t is not None and meta.context_lens_t is not None
        self._ids[:b].copy_(inputs.input_ids)
        self._pos[:b].copy_(inputs.positions)
        self._slot[:b].copy_(meta.slot_ids_t)
        self._ctx[:b].copy_(meta.context_lens_t)
        self._tok[:b].copy_(inputs.positions)  # one new token per sequence, at its position
        if bs > b:  # padding rows: the pad slot's one mapped token
            self._ids[b:bs].zero_()
            self._pos[b:bs].zero_()
            self._slot[b:bs].fill_(self.pad_slot)
            self._ctx[b:bs].fill_(1)
            self._tok[b:bs].zero_()
        g = self._graphs[bs]
        g.graph.replay()
        return g.hidden[:b]

    def close(self) -> None:
        """Drop the graphs and give the pad slot back."""
        self._graphs.clear()
        self.arena.free(self.pad_slot)
