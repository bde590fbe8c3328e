"""The model-level ops of ``edmm bench ttft`` measured through the engine (any TP size).

``edmm bench ttft --tensor-parallel-size N`` times the same three ops as the direct path
(`edmm.bench.model_ops`), but as requests to an `Engine` built by `edmm.engine.tp.build_engine`, so
with ``N > 1`` the model is split over N GPUs and every step is broadcast to the other ranks:

- full prefill: a prompt of n fresh tokens, to its first token;
- prefill on a cached prefix: the first n - ``new_tokens`` tokens are a prefix-cache hit (a
  shared prefix, block-aligned), followed by ``new_tokens`` fresh ones, to the first token;
- decode step: one `Engine.step` of a single request decoding at a context of n tokens.

The times include the engine's host work (scheduling, page mapping, the broadcast), which the
direct path leaves out; compare TP sizes with each other on this path, not with the direct one.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from edmm.bench.results import Progress
from edmm.engine.config import EngineConfig
from edmm.engine.engine import Engine
from edmm.engine.sampling import SamplingParams
from edmm.engine.tp import build_engine

Row = dict[str, object]


class EngineSide:
    """One engine (TP over ``tensor_parallel_size`` GPUs) with room for the longest context."""

    def __init__(self, model: str, device: str, dtype: str, max_ctx: int, new_tokens: int,
                 tensor_parallel_size: int, repeats: int) -> None:
        self.device = torch.device(device)
        max_len = max_ctx + repeats + 2
        self.engine: Engine = build_engine(EngineConfig(
            model=model, device=device, dtype=dtype, max_model_len=max_len,
            max_num_batched_tokens=max_ctx, num_slots=8, max_num_seqs=2,
            tensor_parallel_size=tensor_parallel_size))
        self.vocab = self.engine.model_config.vocab_size
        self.new_tokens = new_tokens
        self._gen = torch.Generator().manual_seed(0)
        self._ids = 0

    def fresh(self, n: int) -> list[int]:
        """``n`` random token ids (never a cache hit beyond what is shared on purpose)."""
        return torch.randint(0, self.vocab, (n,), generator=self._gen).tolist()

    def first_token_ms(self, prompt: list[int]) -> tuple[float, int]:
        """Milliseconds from submitting ``prompt`` to its first token; its cached tokens."""
        rid = self._next_id()
        _sync(self.device)
        t0 = time.perf_counter()
        self.engine.add_request(rid, prompt, SamplingParams(temperature=0.0, max_tokens=1))
        out = None
        while out is None or not out.finished:
            out = next((o for o in self.engine.step() if o.request_id == rid), out)
        _sync(self.device)
        return (time.perf_counter() - t0) * 1e3, out.num_cached_tokens

    def decode_steps_ms(self, prompt: list[int], steps: int) -> list[float]:
        """Milliseconds of each of ``steps`` decode steps after ``prompt``'s first token."""
        rid = self._next_id()
        params = SamplingParams(temperature=0.0, max_tokens=steps + 1, ignore_eos=True)
        self.engine.add_request(rid, prompt, params)
        while not any(o.request_id == rid for o in self.engine.step()):
            pass
        times = []
        for _ in range(steps):
            _sync(self.device)
            t0 = time.perf_counter()
            self.engine.step()
            _sync(self.device)
            times.append((time.perf_counter() - t0) * 1e3)
        return times

    def close(self) -> None:
        self.engine.close()

    def _next_id(self) -> str:
        self._ids += 1
        return f"bench-{self._ids}"


def measure_engine(side: EngineSide, ctx: int, repeats: int, full_repeats: int, name: str,
                   progress: Progress) -> list[Row]:
    """Per-iteration rows of the three ops at context ``ctx`` (one warm-up each)."""
    keep = ctx - side.new_tokens
    prefix = side.fresh(keep)
    plans: list[tuple[str, int, int, Callable[[], float]]] = [
        ("full prefill", 0, full_repeats, lambda: side.first_token_ms(side.fresh(ctx))[0]),
        ("prefill on cached prefix", keep, repeats,
         lambda: _cached(side, prefix, keep)),
    ]
    side.first_token_ms(prefix + side.fresh(1))  # the shared prefix, cached from here on
    rows: list[Row] = []
    for op, cached, n, run in plans:
        times = [run() for _ in range(n + 1)][1:]
        progress.step(f"{name} {op} at {ctx}")
        rows += [{"engine": name, "op": op, "context_tokens": ctx, "new_tokens": ctx - cached,
                  "iteration": i, "ms": t} for i, t in enumerate(times)]
    steps = side.decode_steps_ms(prefix + side.fresh(ctx - 1 - keep), repeats + 1)[1:]
    progress.step(f"{name} decode step at {ctx}")
    rows += [{"engine": name, "op": "decode step", "context_tokens": ctx, "new_tokens": 1,
              "iteration": i, "ms": t} for i, t in enumerate(steps)]  # contexts ctx + i
    side.engine.reset_prefix_cache()
    return rows


def _cached(side: EngineSide, prefix: list[int], keep: int) -> float:
    ms, cached = side.first_token_ms(prefix + side.fresh(side.new_tokens))
    if cached < keep - side.engine.config.prefix_block_size:  # the prefix was evicted
        raise RuntimeError(f"expected ~{keep} cached tokens, got {cached}")
    return ms


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
