"""Triton attention kernels vs SDPA, per layer.

    python -m benchmarks.kernels.attention --out DIR

Qwen2.5-7B head shapes (28 query heads, 4 KV heads, head dim 128, bf16) over KV in the arena's
token-major layout across 28 layers: a real CUDA VMM arena when the driver API is usable, else a
plain tensor with the same strides.

- decode: `decode_attention` vs SDPA on the strided view, batch 1 and 8, 4K/16K/32K context;
  eager, and inside a CUDA graph of all 28 layers (per-layer mean), as the engine runs it;
- prefill: `prefill_attention_varlen` (512 queries of one sequence) vs SDPA with
  ``causal_lower_right``, FlashAttention-4 on the arena's slots (`edmm.kernels.fa4`; skipped,
  with a note, where it does not import), and cuDNN's fused attention on the same strided KV
  (two calls, merged: `edmm.kernels.fused_sdpa`), as candidates;
- sweeps at 16K: decode splits and launch configs, prefill launch configs;
- ``--fp8-prefill-sweep``: the prefill kernel's tile shapes reading a scaled e4m3 copy of the
  same KV (the engine's FP8 cache), beside the engine's BF16 config and a route that
  dequantises the context to a BF16 scratch and runs the BF16 kernel on it (torch's two
  passes, and `edmm.kernels.kv_dequant`'s one).

Eager times are CUDA-event medians over ``reps`` calls after warmup. Each call reads the next
layer, so the working set exceeds L2 as in a real step, and a GPU sleep before each timed call
lets the host queue run ahead, so launch latency is not in the numbers.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.nn.functional as F

from edmm.bench.stats import percentile
from edmm.kernels import (
    DecodeConfig,
    PrefillConfig,
    decode_attention,
    default_num_splits,
    prefill_attention_varlen,
    triton_usable,
)
from edmm.kernels.fa4 import fa4_usable, fa4_varlen_args, fa4_varlen_attention
from edmm.kernels.fused_sdpa import (
    AttendLSE,
    cudnn_attend,
    cudnn_expanded_attend,
    end_aligned_by_parts,
)
from edmm.kernels.kv_dequant import dequantize_kv_varlen
from edmm.memory import KVArena, KVMemoryError, KVSpec, PagePool, open_backend
from edmm.model.attention_triton import PREFILL, PREFILL_FP8
from edmm.model.kv_quant import FP8_HEADROOM, FP8_MAX, quantize_fp8

SPEC = KVSpec(num_layers=28, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16)
NUM_HEADS = 28
SCALE = SPEC.head_dim**-0.5
DEVICE = "cuda"
SLEEP_CYCLES = 2_000_000  # ~1 ms of GPU sleep before each timed call: the host runs ahead
SWEEP_CONTEXT = 16384
DECODE_SWEEP = (DecodeConfig(32, 4, 4), DecodeConfig(64, 4, 2), DecodeConfig(64, 4, 4),
                DecodeConfig(128, 4, 2), DecodeConfig(128, 8, 3))
P = PrefillConfig
PREFILL_SWEEP = (  # (earlier sweeps: benchmarks/results/2026-11-30-h200-session3/attention.md)
    P(128, 64, 8, 3), P(128, 64, 8, 3, reverse=True),
    P(128, 128, 4, 2, warp_specialize=True), P(128, 128, 4, 2, warp_specialize=True, reverse=True),
    P(128, 64, 4, 2, warp_specialize=True))
PREFILL_FP8_SWEEP = (  # FP8 KV: PREFILL_FP8 (the engine's) first, then the others measured
    PREFILL_FP8, P(128, 64, 4, 2, warp_specialize=True, reverse=True),
    P(128, 128, 4, 2, warp_specialize=True, reverse=True), P(128, 64, 8, 3, reverse=True),
    P(64, 128, 4, 3, reverse=True))
CHUNK = 2048  # the engine's default token budget: a full prefill runs in chunks of this

T = TypeVar("T")
Fn = Callable[[int], torch.Tensor]  # one attention call on layer ``i % 28``


@dataclass(frozen=True)
class AttentionBenchConfig:
    """What to time: contexts, decode batch sizes, prefill queries, repeats, sweeps."""

    contexts: tuple[int, ...] = (4096, 16384, 32768)
    batches: tuple[int, ...] = (1, 8)
    prefill_queries: int = 512
    reps: int = 50
    warmup: int = 10
    graph_reps: int = 20
    sweeps: bool = True
    prefill_only: bool = False  # the prefill sweep alone
    fp8_prefill_only: bool = False  # the FP8 prefill sweep alone


@dataclass
class Row:
    """One timed case, per layer."""

    op: str  # decode | decode-graph | prefill | *-sweep
    impl: str
    batch: int
    context: int
    queries: int
    median_us: float
    p10_us: float
    p90_us: float
    throughput: float  # GB/s of K+V read (decode) or TFLOP/s (prefill)
    unit: str
    rel_err: float | None = None  # error norm / SDPA output norm
    note: str = ""
    extra: dict[str, Any] = field(default_factory=dict)


# ---------------------------------------------------------------------------- timing
def time_eager(fn: Callable[[int], object], warmup: int, reps: int) -> list[float]:
    """Per-call GPU times in microseconds, each call behind a GPU sleep."""
    for i in range(warmup):
        fn(i)
    torch.cuda.synchronize()
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(reps)]
    for i, (start, end) in enumerate(events):
        torch.cuda._sleep(SLEEP_CYCLES)
        start.record()
        fn(i)
        end.record()
    torch.cuda.synchronize()
    return [start.elapsed_time(end) * 1e3 for start, end in events]


def time_graph(fn: Fn, reps: int) -> list[float]:
    """Per-layer times (us) of a CUDA graph that runs ``fn`` on all layers, replayed ``reps`` x."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for i in range(SPEC.num_layers):
            fn(i)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(SPEC.num_layers):
            fn(i)
    for _ in range(3):
        graph.replay()
    times = time_eager(lambda _: graph.replay(), 0, reps)
    return [t / SPEC.num_layers for t in times]


def _row(op: str, impl: str, batch: int, context: int, queries: int, times: list[float],
         work: float, unit: str, **kw: Any) -> Row:
    """A row from per-call times; ``work`` is bytes (GB/s) or FLOPs (TFLOP/s) per call."""
    med = percentile(times, 50)
    scale = 1e-3 if unit == "GB/s" else 1e-6  # bytes/us -> GB/s, FLOP/us -> TFLOP/s
    return Row(op, impl, batch, context, queries, med, percentile(times, 10),
               percentile(times, 90), work / med * scale, unit, **kw)


def _rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    return float((got.float() - ref.float()).norm() / ref.float().norm())


# ---------------------------------------------------------------------------- KV memory
@dataclass
class KVMemory:
    """The bench's KV cache [slots, max_tokens, 28, 2, 4, 128] and how to release it."""

    kv: torch.Tensor
    kind: str
    close: Callable[[], None]


def make_kv(num_slots: int, max_tokens: int) -> KVMemory:
    """A CUDA VMM arena with every slot full, or a plain tensor of the same strides."""
    try:
        backend = open_backend("cuda")
    except (KVMemoryError, RuntimeError, OSError, ImportError) as e:
        kv = torch.empty(num_slots, max_tokens, SPEC.num_layers, 2, SPEC.num_kv_heads,
                         SPEC.head_dim, dtype=SPEC.dtype, device=DEVICE).normal_()
        return KVMemory(kv, f"plain tensor (no VMM: {e})", lambda: None)
    pages = num_slots * math.ceil(max_tokens * SPEC.token_bytes / backend.page_size)
    pool = PagePool(backend, pages)
    arena = KVArena(pool, SPEC, num_slots, max_tokens)
    for slot in range(num_slots):
        arena.allocate()
        arena.grow(slot, max_tokens)
        arena.kv[slot].normal_()

    def close() -> None:
        torch.cuda.synchronize()
        arena.close()
        pool.close()
        backend.close()

    return KVMemory(arena.kv, "cuda vmm arena", close)


# ---------------------------------------------------------------------------- decode
def _decode_fns(kv: torch.Tensor, batch: int, context: int,
                **kernel_kw: Any) -> tuple[Fn, Fn]:
    """Triton and SDPA decode calls for ``batch`` full slots of ``context`` tokens."""
    q = torch.randn(batch, NUM_HEADS, SPEC.head_dim, dtype=SPEC.dtype, device=DEVICE)
    slot_ids = torch.arange(batch, dtype=torch.int32, device=DEVICE)
    lens = torch.full((batch,), context, dtype=torch.int32, device=DEVICE)
    q4 = q[:, :, None]  # [B, Hq, 1, D]

    def triton_fn(i: int) -> torch.Tensor:
        return decode_attention(q, kv, i % SPEC.num_layers, slot_ids, lens, SCALE, **kernel_kw)

    def sdpa_fn(i: int) -> torch.Tensor:
        layer = kv[:batch, :context, i % SPEC.num_layers]  # [B, n, 2, Hkv, D] strided
        k, v = layer[:, :, 0].transpose(1, 2), layer[:, :, 1].transpose(1, 2)  # [B, Hkv, n, D]
        return F.scaled_dot_product_attention(q4, k, v, scale=SCALE, enable_gqa=True)[:, :, 0]

    return triton_fn, sdpa_fn


@dataclass(frozen=True)
class Case:
    """One shape: what is timed and the work per call (bytes read or FLOPs)."""

    op: str
    batch: int
    context: int
    queries: int
    work: float
    unit: str


def time_case(case: Case, impls: dict[str, Fn], timer: Callable[[Fn], list[float]],
              notes: dict[str, str] | None = None, reference: Fn | None = None) -> list[Row]:
    """Rows of every impl that runs; each one's error is measured against ``reference`` (not
    timed; default: the "sdpa" impl) on the same inputs.

    An impl that fails (a sweep config past shared memory, an SDPA path that is missing) is
    reported on stderr and left out.
    """
    reference = reference or impls.get("sdpa")
    ref = _guarded(lambda: reference(0)) if reference is not None else None
    rows = []
    for impl, fn in impls.items():
        times = _guarded(functools.partial(timer, fn))
        if times is None:
            continue
        err = _rel_err(fn(0), ref) if impl != "sdpa" and ref is not None else None
        rows.append(_row(case.op, impl, case.batch, case.context, case.queries, times, case.work,
                         case.unit, rel_err=err, note=(notes or {}).get(impl, "")))
    return rows


def _decode_bytes(batch: int, context: int) -> float:
    return float(batch * context * SPEC.num_kv_heads * SPEC.head_dim * 2 * SPEC.dtype.itemsize)


def bench_decode(kv: torch.Tensor, cfg: AttentionBenchConfig) -> list[Row]:
    """Eager and graph-captured decode at every context and batch size."""
    eager = functools.partial(time_eager, warmup=cfg.warmup, reps=cfg.reps)
    graph = functools.partial(time_graph, reps=cfg.graph_reps)
    rows = []
    for context in cfg.contexts:
        for batch in cfg.batches:
            tri, sdpa = _decode_fns(kv, batch, context, max_context=kv.shape[1])
            splits = default_num_splits(batch, SPEC.num_kv_heads, kv.shape[1])
            notes = {"triton": f"splits={splits}"}
            for op, timer in (("decode", eager), ("decode-graph", graph)):
                case = Case(op, batch, context, 1, _decode_bytes(batch, context), "GB/s")
                rows += time_case(case, {"triton": tri, "sdpa": sdpa}, timer, notes)
    return rows


def sweep_decode(kv: torch.Tensor, cfg: AttentionBenchConfig) -> list[Row]:
    """Batch 1 at 16K: split counts, then launch configs."""
    eager = functools.partial(time_eager, warmup=cfg.warmup, reps=cfg.reps)
    case = Case("decode-sweep", 1, SWEEP_CONTEXT, 1, _decode_bytes(1, SWEEP_CONTEXT), "GB/s")
    variants: list[tuple[str, dict[str, Any]]] = [
        (f"splits={s}", {"num_splits": s}) for s in (16, 32, 64, 128)]
    variants += [(f"{c}", {"config": c}) for c in DECODE_SWEEP]
    rows = []
    for note, kw in variants:
        tri, _ = _decode_fns(kv, 1, SWEEP_CONTEXT, **kw)
        rows += time_case(case, {"triton": tri}, eager, {"triton": note})
    return rows


# ---------------------------------------------------------------------------- prefill
def _prefill_fns(kv: torch.Tensor, context: int, queries: int,
                 config: PrefillConfig | None = None) -> dict[str, Fn]:
    """`_attention_fns` on a random q of ``queries`` tokens (a second call draws another:
    compare only one call's outputs)."""
    q = torch.randn(queries, NUM_HEADS, SPEC.head_dim, dtype=SPEC.dtype, device=DEVICE)
    return _attention_fns(kv, q, context, config)


def _attention_fns(kv: torch.Tensor, q: torch.Tensor, context: int,
                   config: PrefillConfig | None = None) -> dict[str, Fn]:
    """Triton, SDPA and cuDNN calls of the new tokens ``q`` [Lq, Hq, D] at the end of slot
    0's ``context``."""
    from torch.nn.attention.bias import causal_lower_right

    queries = q.shape[0]
    q4 = q.transpose(0, 1)[None].contiguous()  # [1, Hq, Lq, D]
    mask = causal_lower_right(queries, context)

    cu, slot, ctx = _one_sequence(queries, context)

    def triton_fn(i: int) -> torch.Tensor:  # the engine's (varlen) entry point
        return prefill_attention_varlen(q, kv, i % SPEC.num_layers, cu, slot, ctx, SCALE,
                                        config=config)

    def sdpa_fn(i: int) -> torch.Tensor:
        layer = kv[0:1, :context, i % SPEC.num_layers]  # [1, n, 2, Hkv, D]
        k, v = layer[:, :, 0].transpose(1, 2), layer[:, :, 1].transpose(1, 2)
        out = F.scaled_dot_product_attention(q4, k, v, attn_mask=mask, scale=SCALE,
                                             enable_gqa=True)
        return out[0].transpose(0, 1)  # [Lq, Hq, D]

    return {"triton": triton_fn, "sdpa": sdpa_fn, **_fa4_fns(kv, q, cu, slot, ctx),
            **_cudnn_fns(kv, q, context)}


FA4_NOTE = "flash_attn_varlen_func, the arena's slots as its batch (no copy)"


def _fa4_fns(kv: torch.Tensor, q: torch.Tensor, cu: torch.Tensor, slot: torch.Tensor,
             ctx: torch.Tensor) -> dict[str, Fn]:
    """FA4 on the queries ``q`` [n, Hq, D] of one sequence (query starts ``cu``, ``slot``,
    context ``ctx``), or nothing where FA4 does not run (`environment` says why)."""
    if not fa4_usable(DEVICE):
        return {}
    args = fa4_varlen_args(cu, slot, ctx, kv.shape[0], skip_single=False)

    def fa4_fn(i: int) -> torch.Tensor:
        return fa4_varlen_attention(q, kv, i % SPEC.num_layers, args, SCALE)

    return {"fa4": fa4_fn}


def _prefill_flops(queries: int, context: int) -> float:
    """QK^T and PV over the causal pairs of ``queries`` tokens ending ``context``."""
    pairs = queries * context - queries * (queries - 1) / 2
    return 4.0 * pairs * SPEC.head_dim * NUM_HEADS


def _one_sequence(queries: int, context: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Varlen arguments of slot 0's last ``queries`` of ``context`` tokens (on the device)."""
    return tuple(torch.tensor(v, dtype=torch.int32, device=DEVICE)  # type: ignore[return-value]
                 for v in ([0, queries], [0], [context]))


def _chunked_fn(kv: torch.Tensor, context: int, impl: str,
                config: PrefillConfig | None = None,
                make: Callable[[torch.Tensor, int], dict[str, Fn]] | None = None) -> Fn:
    """A full prefill of ``context`` tokens as the engine runs it, through ``impl`` (a key of
    ``make(q, end)``'s calls; default `_attention_fns`): CHUNK queries at a time, each chunk
    attending to every token before it."""
    q = torch.randn(CHUNK, NUM_HEADS, SPEC.head_dim, dtype=SPEC.dtype, device=DEVICE)
    make = make or (lambda q, end: _attention_fns(kv, q, end, config))
    steps = [make(q, end)[impl] for end in range(CHUNK, context + 1, CHUNK)]

    def fn(i: int) -> torch.Tensor:
        for step in steps:
            out = step(i)
        return out

    return fn


CUDNN_NOTES = {"cudnn-gqa": "arena KV in place: unmasked prefix + causal square, lse-merged",
               "cudnn-expanded": "cudnn-gqa with the KV heads copied to Hq each call"}
CUDNN_ATTENDS: dict[str, AttendLSE] = {"cudnn-gqa": cudnn_attend,
                                       "cudnn-expanded": cudnn_expanded_attend}


def _cudnn_fns(kv: torch.Tensor, q: torch.Tensor, context: int) -> dict[str, Fn]:
    """cuDNN candidates on the arena's strided KV of slot 0 (no copy unless expanded) for the
    queries ``q`` [n, Hq, D] at the end of ``context`` tokens."""
    q4 = q.transpose(0, 1)[None]  # [1, Hq, n, D] view

    def make(attend: AttendLSE) -> Fn:
        def fn(i: int) -> torch.Tensor:
            layer = kv[0:1, :context, i % SPEC.num_layers]  # [1, n, 2, Hkv, D]
            k, v = layer[:, :, 0].transpose(1, 2), layer[:, :, 1].transpose(1, 2)
            out = end_aligned_by_parts(q4, k, v, SCALE, attend)  # [1, Hq, n, D]
            return out[0].transpose(0, 1)  # [n, Hq, D]

        return fn

    return {name: make(attend) for name, attend in CUDNN_ATTENDS.items()}


def bench_prefill(kv: torch.Tensor, cfg: AttentionBenchConfig) -> list[Row]:
    """Prefill of ``prefill_queries`` tokens at every context."""
    eager = functools.partial(time_eager, warmup=cfg.warmup, reps=cfg.reps)
    n = cfg.prefill_queries
    notes = {"triton": f"{PrefillConfig()}", "triton-backend": f"{PREFILL}",
             "sdpa": "causal_lower_right", "fa4": FA4_NOTE, **CUDNN_NOTES}
    rows = []
    for context in cfg.contexts:
        case = Case("prefill", 1, context, n, _prefill_flops(n, context), "TFLOP/s")
        rows += time_case(case, _prefill_fns(kv, context, n), eager, notes)
        backend = _prefill_fns(kv, context, n, PREFILL)  # another q
        rows += time_case(case, {"triton-backend": backend["triton"]}, eager, notes,
                          reference=backend["sdpa"])
    return rows


def sweep_prefill(kv: torch.Tensor, cfg: AttentionBenchConfig) -> list[Row]:
    """Launch configs of the prefill kernel at 16K: ``prefill_queries`` on a cached prefix,
    and a full prefill in CHUNK-token chunks; the same chunks through cuDNN."""
    eager = functools.partial(time_eager, warmup=cfg.warmup, reps=cfg.reps)
    chunked = functools.partial(time_eager, warmup=2, reps=max(5, cfg.reps // 10))
    n, ctx = cfg.prefill_queries, SWEEP_CONTEXT
    case = Case("prefill-sweep", 1, ctx, n, _prefill_flops(n, ctx), "TFLOP/s")
    full = Case("full-prefill-sweep", 1, ctx, ctx, _prefill_flops(ctx, ctx), "TFLOP/s")
    rows = []
    for config in PREFILL_SWEEP:
        tri = _prefill_fns(kv, ctx, n, config)["triton"]
        rows += time_case(case, {"triton": tri}, eager, {"triton": f"{config}"})
        rows += time_case(full, {"triton": _chunked_fn(kv, ctx, "triton", config)}, chunked,
                          {"triton": f"chunks of {CHUNK}, {config}"})
    rows += time_case(full, {"cudnn-gqa": _chunked_fn(kv, ctx, "cudnn-gqa")}, chunked,
                      {"cudnn-gqa": f"chunks of {CHUNK}, {CUDNN_NOTES['cudnn-gqa']}"})
    if fa4_usable(DEVICE):
        rows += time_case(full, {"fa4": _chunked_fn(kv, ctx, "fa4")}, chunked,
                          {"fa4": f"chunks of {CHUNK}, {FA4_NOTE}"})
    return rows


def fp8_copy(kv: torch.Tensor, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Slot 0's first ``context`` tokens of ``kv`` [S, M, L, 2, Hkv, D] as a scaled e4m3 cache
    [1, context, L, 2, Hkv, D] and its float32 scales [L, 2, Hkv]: each head's largest
    magnitude stored at 448 / `FP8_HEADROOM`, as the engine's calibration does."""
    src = kv[0:1, :context]
    amax = src.abs().amax(dim=(0, 1, 5)).float()  # [L, 2, Hkv]
    scales = (amax * (FP8_HEADROOM / FP8_MAX)).clamp_min(1e-12)
    kv8 = torch.empty(src.shape, dtype=torch.float8_e4m3fn, device=src.device)
    for layer in range(src.shape[2]):  # a layer at a time: float32 temporaries stay small
        for kind in range(2):
            kv8[:, :, layer, kind] = quantize_fp8(src[:, :, layer, kind], scales[layer, kind])
    return kv8, scales.contiguous()


def _fp8_fns(kv8: torch.Tensor, scales: torch.Tensor, q: torch.Tensor, context: int,
             config: PrefillConfig) -> dict[str, Fn]:
    """The queries ``q`` [n, Hq, D] at the end of slot 0's ``context`` tokens of the FP8 cache
    ``kv8``: the prefill kernel reading it (``triton-fp8``), the context dequantised to a
    BF16 scratch and the engine's BF16 kernel on that (``dequant+bf16``), and SDPA over the
    dequantised KV (``sdpa``, the reference)."""
    from torch.nn.attention.bias import causal_lower_right

    cu, slot, ctx = _one_sequence(q.shape[0], context)
    scratch = torch.empty(1, context, 1, 2, SPEC.num_kv_heads, SPEC.head_dim, dtype=SPEC.dtype,
                          device=kv8.device)  # [1, n, 1, 2, Hkv, D]

    def dequantised(layer: int) -> torch.Tensor:  # [1, n, 2, Hkv, D] in scratch
        out = scratch[:, :, 0]
        torch.mul(kv8[0:1, :context, layer].to(SPEC.dtype),
                  scales[layer][:, :, None].to(SPEC.dtype), out=out)
        return out

    def fp8_fn(i: int) -> torch.Tensor:
        layer = i % SPEC.num_layers
        return prefill_attention_varlen(q, kv8, layer, cu, slot, ctx, SCALE, config=config,
                                        kv_scale=scales[layer])

    def route_fn(i: int) -> torch.Tensor:
        dequantised(i % SPEC.num_layers)
        return prefill_attention_varlen(q, scratch, 0, cu, slot, ctx, SCALE, config=PREFILL)

    cu_ctx = torch.tensor([0, context], dtype=torch.int32, device=kv8.device)

    def fused_fn(i: int) -> torch.Tensor:
        layer = i % SPEC.num_layers
        dequantize_kv_varlen(kv8, layer, slot, ctx, cu_ctx, scales[layer], scratch[0, :, 0],
                             max_ctx=context)
        return prefill_attention_varlen(q, scratch, 0, cu, slot, ctx, SCALE, config=PREFILL)

    def sdpa_fn(i: int) -> torch.Tensor:
        layer = dequantised(i % SPEC.num_layers)
        k, v = layer[:, :, 0].transpose(1, 2), layer[:, :, 1].transpose(1, 2)
        q4 = q.transpose(0, 1)[None]  # [1, Hq, n, D]
        out = F.scaled_dot_product_attention(q4, k, v, scale=SCALE, enable_gqa=True,
                                             attn_mask=causal_lower_right(q.shape[0], context))
        return out[0].transpose(0, 1)  # [n, Hq, D]

    return {"triton-fp8": fp8_fn, "dequant+bf16": route_fn, "dequant-fused+bf16": fused_fn,
            "sdpa": sdpa_fn}


def sweep_prefill_fp8(kv: torch.Tensor, cfg: AttentionBenchConfig) -> list[Row]:
    """`PREFILL_FP8_SWEEP` on an FP8 copy of slot 0 at 16K (``prefill_queries`` on a cached
    prefix, and a full prefill in CHUNK-token chunks), the dequantising route once, and the
    engine's BF16 config on the BF16 KV for the ratio."""
    eager = functools.partial(time_eager, warmup=cfg.warmup, reps=cfg.reps)
    chunked = functools.partial(time_eager, warmup=2, reps=max(5, cfg.reps // 10))
    n, ctx = cfg.prefill_queries, SWEEP_CONTEXT
    kv8, scales = fp8_copy(kv, ctx)
    case = Case("prefill-fp8", 1, ctx, n, _prefill_flops(n, ctx), "TFLOP/s")
    full = Case("full-prefill-fp8", 1, ctx, ctx, _prefill_flops(ctx, ctx), "TFLOP/s")
    bf16 = {"triton-bf16": f"the engine's BF16 config on the BF16 KV, {PREFILL}"}
    q = torch.randn(n, NUM_HEADS, SPEC.head_dim, dtype=SPEC.dtype, device=DEVICE)
    rows = time_case(case, {"triton-bf16": _attention_fns(kv, q, ctx, PREFILL)["triton"]},
                     eager, bf16)
    rows += time_case(full, {"triton-bf16": _chunked_fn(kv, ctx, "triton", PREFILL)}, chunked,
                      bf16)
    for i, config in enumerate(PREFILL_FP8_SWEEP):
        impls = (("triton-fp8", "dequant+bf16", "dequant-fused+bf16") if i == 0
                 else ("triton-fp8",))
        notes = {"triton-fp8": f"{config}", "dequant+bf16": f"torch dequantise, then {PREFILL}",
                 "dequant-fused+bf16": f"dequantize_kv_varlen (one pass), then {PREFILL}"}
        fns = _fp8_fns(kv8, scales, q, ctx, config)
        rows += time_case(case, {k: fns[k] for k in impls}, eager, notes, reference=fns["sdpa"])

        def make(q: torch.Tensor, end: int, config: PrefillConfig = config) -> dict[str, Fn]:
            return _fp8_fns(kv8, scales, q, end, config)

        rows += time_case(full, {k: _chunked_fn(kv8, ctx, k, make=make) for k in impls},
                          chunked, {k: f"chunks of {CHUNK}, {v}" for k, v in notes.items()})
    return rows


def _guarded(run: Callable[[], T]) -> T | None:
    """``run()``, or None (with a message) when it cannot compile or launch."""
    try:
        return run()
    except Exception as e:  # e.g. a config past the SM's shared memory: report it, go on
        print(f"  skipped: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}",
              file=sys.stderr)
        return None


# ---------------------------------------------------------------------------- report
def markdown(rows: Sequence[Row]) -> str:
    """The rows as a Markdown table, with Triton's speedup over SDPA where both ran."""
    sdpa = {(r.op, r.batch, r.context): r.median_us for r in rows if r.impl == "sdpa"}
    lines = ["| op | impl | batch | context | queries | median us | p10 | p90 | throughput "
             "| x SDPA | rel err | note |", "|" + "---|" * 12]
    for r in rows:
        base = sdpa.get((r.op.removesuffix("-sweep"), r.batch, r.context))
        speedup = f"{base / r.median_us:.2f}" if base and r.impl != "sdpa" else ""
        err = f"{r.rel_err:.1e}" if r.rel_err is not None else ""
        lines.append(f"| {r.op} | {r.impl} | {r.batch} | {r.context} | {r.queries} | "
                     f"{r.median_us:.1f} | {r.p10_us:.1f} | {r.p90_us:.1f} | "
                     f"{r.throughput:.0f} {r.unit} | {speedup} | {err} | {r.note} |")
    return "\n".join(lines)


def environment(kv_kind: str) -> dict[str, Any]:
    """Device and versions of this run (FA4's, or why its rows are missing)."""
    import triton

    from edmm.model.attention_choice import AttentionCapabilities

    caps = AttentionCapabilities.probe(DEVICE)
    return {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton.__version__, "kv_memory": kv_kind,
            "sms": torch.cuda.get_device_properties(0).multi_processor_count,
            "fa4": _fa4_version() if caps.fa4 else f"skipped: {caps.fa4_reason}"}


def _fa4_version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("flash-attn-4")
    except PackageNotFoundError:
        return "importable (no package metadata)"


def run(cfg: AttentionBenchConfig, out_dir: Path) -> list[Row]:
    """Run every case, print the table, write ``attention.json`` and ``attention.md``."""
    mem = make_kv(max(cfg.batches), max(cfg.contexts))
    try:
        with torch.inference_mode():
            if cfg.fp8_prefill_only:
                rows = sweep_prefill_fp8(mem.kv, cfg)
            elif cfg.prefill_only:
                rows = sweep_prefill(mem.kv, cfg)
            else:
                rows = bench_decode(mem.kv, cfg) + bench_prefill(mem.kv, cfg)
                if cfg.sweeps:
                    rows += sweep_decode(mem.kv, cfg) + sweep_prefill(mem.kv, cfg)
        env = environment(mem.kind)
    finally:
        mem.close()
    table = markdown(rows)
    print(f"{env}\n\n{table}")
    out_dir.mkdir(parents=True, exist_ok=True)
    payload = {"environment": env, "config": asdict(cfg), "rows": [asdict(r) for r in rows]}
    (out_dir / "attention.json").write_text(json.dumps(payload, indent=2))
    (out_dir / "attention.md").write_text(f"{env}\n\n{table}\n")
    return rows


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.kernels.attention``."""
    parser = argparse.ArgumentParser(prog="python -m benchmarks.kernels.attention",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for attention.json/md")
    parser.add_argument("--reps", type=int, default=50)
    parser.add_argument("--no-sweeps", action="store_true", help="skip the launch-config sweeps")
    parser.add_argument("--prefill-sweep", action="store_true", help="the prefill sweep only")
    parser.add_argument("--fp8-prefill-sweep", action="store_true",
                        help="the FP8-KV prefill sweep only (tile shapes, the dequantising "
                             "route, BF16 beside them)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """CLI entry: ``python -m benchmarks.kernels.attention --out DIR [--no-sweeps] [--reps N]``."""
    args = build_parser().parse_args(argv)
    if not torch.cuda.is_available() or not triton_usable("cuda"):
        print("benchmarks.kernels.attention needs a CUDA GPU and triton", file=sys.stderr)
        return 2
    run(AttentionBenchConfig(reps=args.reps, sweeps=not args.no_sweeps,
                             prefill_only=args.prefill_sweep,
                             fp8_prefill_only=args.fp8_prefill_sweep), args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
