"""``edmm bench ttft``: the model-level costs that bound an agent's resume, beside transformers.

For each context length n (a preset's real shapes, random weights: speed does not depend on the
values), in one process:
- decode step: the token that completes an n-token context (appended to n - 1 cached tokens),
  logits and a greedy pick. Its page is already mapped, as in 35 of 36 decode steps of the
  qwen2.5-7b preset (56 KiB of KV per token, 2 MiB pages); appending to n cached tokens at a
  power-of-two n would map a page every repeat (~0.12 ms on an H200);
- prefill of ``new_tokens`` (default 512) new tokens on a cached (n - 512)-token prefix;
- full prefill of n tokens into an empty slot: in one pass, or (``full_prefill_chunk``) in
  chunks as the engine's token budget splits a long prompt, each chunk's pages mapped and its
  pass launched while the previous chunk still computes, sampling after the last (on the GPU
  EDMM's chunks replay a CUDA graph of that many tokens, as the engine's mixed graphs do).
EDMM runs them on its KV arena (mapping pages as it grows, as the engine does), with its GPU
attention (``attentions``: FlashAttention-4 prefill where it runs, else Triton; several names
time each in the same process), fused pointwise ops and CUDA-graph decode on the GPU
(``eager``: reference SDPA, no fusion, no graphs); the peer is HF
transformers' best path for the same work (SDPA, a DynamicCache cropped back between repeats).
Wall-clock times with the device synchronised around each repeat.

``kv_cache_dtypes`` times each EDMM side once per KV cache dtype (``fp8`` beside ``bf16``:
`edmm.model.kv_quant`, scales calibrated as the engine does), and ``decode_batches`` adds decode
steps of that many sequences at each context (op ``decode step xB``; EDMM only): the slot's
KV copied into B - 1 more slots (their own pages, as B sessions hold), each appending a token.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from edmm.bench.results import (
    Progress,
    ResultWriter,
    collect_environment,
    device_label,
    plot_bars,
    tokens_label,
)
from edmm.bench.stats import summarize
from edmm.engine.cuda_graph import CudaGraphRunner
from edmm.engine.runner import ModelInputs, ModelRunner
from edmm.engine.sampling import RequestRng, SamplingParams
from edmm.kernels import PrefillConfig
from edmm.kernels.decode_routes import DecodeRoutes, default_decode_routes
from edmm.kernels.matmul_routes import MatmulRoutes, default_matmul_routes, with_pdl
from edmm.kernels.skinny_matmul import RoutedMatmul
from edmm.memory.arena import KVArena, KVSpec
from edmm.memory.backends import open_backend
from edmm.memory.pool import PagePool
from edmm.model.attention import AttentionMetadata
from edmm.model.attention_choice import (
    AttentionCapabilities,
    build_backend,
    kv_read_align,
    resolve_attention,
)
from edmm.model.attention_triton import PREFILL
from edmm.model.config import ModelConfig
from edmm.model.kv_quant import (
    calibrate_kv_scales,
    calibration_ids,
    is_fp8,
    kv_storage_dtype,
)
from edmm.model.loader import load_model

MEASURED_BF16_TFLOPS = 790.0  # dense bf16 matmul on the lent H200 (docs/design.md)
OPS = ("decode step", "prefill on cached prefix", "full prefill")
PREFILL_KERNELS: dict[str, PrefillConfig] = {  # --prefill-kernel
    "warp-specialized": PREFILL,
    "default": PrefillConfig(),
}


@dataclass(frozen=True)
class ModelOpsConfig:
    """What to run: model preset or folder, device, contexts, repeats, peer on/off."""

    model: str = "qwen2.5-7b"
    device: str = "cuda"
    dtype: str = "bfloat16"
    contexts: tuple[int, ...] = (4096, 16384, 32768)
    repeats: int = 20
    full_prefill_repeats: int = 5
    new_tokens: int = 512
    peer: bool = True
    eager: bool = False
    host_page_size: int = 64 * 1024
    prefill_kernel: str = "warp-specialized"  # a PREFILL_KERNELS key, for comparisons
    full_prefill_chunk: int = 0  # tokens per pass of the full prefill (both engines); 0: one
    # EDMM's attention backends (`ATTENTION_CHOICES`), timed one after the other: the first's
    # rows are engine "edmm", the others' "edmm-<name>"
    attentions: tuple[str, ...] = ("auto",)
    decode_routes: str | None = None  # decode routing table file; None: the committed one
    # projections' skinny-matmul routing table file; None: the committed one; "off": cuBLAS
    matmul_routes: str | None = None
    matmul_pdl: bool = False  # every routed skinny launch with PDL (`with_pdl`: an experiment)
    # None: the model driven directly on one device; N: through the engine, split over N GPUs
    # (`edmm.bench.model_ops_engine`)
    tensor_parallel_size: int | None = None
    # KV cache dtypes (`KV_CACHE_DTYPES`) each EDMM side is timed with, one after the other:
    # the first's rows keep the side's engine label, the others' get "-kv-<name>"
    kv_cache_dtypes: tuple[str, ...] = ("auto",)
    decode_batches: tuple[int, ...] = (1,)  # sequences of the decode steps timed (EDMM only)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@contextmanager
def _timed(out: list[float], device: torch.device) -> Iterator[None]:
    _sync(device)
    t0 = time.perf_counter()
    yield
    _sync(device)
    out.append((time.perf_counter() - t0) * 1e3)


class EdmmSide:
    """The model on a KV arena with one slot, driven directly (no scheduler in the way)."""

    def __init__(self, cfg: ModelOpsConfig, max_ctx: int, attention: str = "auto",
                 kv_cache_dtype: str = "auto") -> None:
        self.device = torch.device(cfg.device)
        attention = resolve_attention(attention, AttentionCapabilities.probe(cfg.device))
        max_tokens = max_ctx + cfg.new_tokens + 1
        self.model, self.cfg = load_model(cfg.model, self.device, cfg.dtype,
                                          max_positions=max_tokens)
        cuda = self.device.type == "cuda"
        self.backend = open_backend("cuda" if cuda else "host",
                                    host_page_size=cfg.host_page_size)
        dtype = kv_storage_dtype(kv_cache_dtype, self.model.model.embed_tokens.weight.dtype)
        if is_fp8(dtype):  # the engine's scales: calibrated once, before any KV is written
            ids = calibration_ids(None, self.cfg.vocab_size)
            self.model.set_kv_scales(calibrate_kv_scales(self.model, ids))
        spec = KVSpec(self.cfg.num_layers, self.cfg.num_kv_heads, self.cfg.head_dim, dtype)
        align = kv_read_align(attention)
        batch = max(cfg.decode_batches)
        pages = batch * (-(-max_tokens * spec.token_bytes // self.backend.page_size) + 2)
        pad = -(-align * spec.token_bytes // self.backend.page_size)  # the pad slot's pages
        self.pool = PagePool(self.backend, pages + pad)
        self.arena = KVArena(self.pool, spec, num_slots=batch + 1, max_tokens=max_tokens,
                             read_align=align)
        self.runner: ModelRunner
        if cuda and not cfg.eager:
            self.model.set_backend(build_backend(attention, max_tokens,
                                                 PREFILL_KERNELS[cfg.prefill_kernel],
                                                 decode_routes_of(cfg)))
            self.model.enable_fusion()
            matmul_routes = matmul_routes_of(cfg)
            if matmul_routes is not None:
                self.model.set_matmul(RoutedMatmul(matmul_routes))
            # As the engine's mixed graphs: the chunks of a full prefill replay one too.
            chunks = (cfg.full_prefill_chunk,) if cfg.full_prefill_chunk > 1 else ()
            self.runner = CudaGraphRunner(self.model, self.arena, self.device,
                                          sizes=tuple(sorted({1, *cfg.decode_batches})),
                                          token_sizes=(cfg.new_tokens, *chunks), max_seqs=1)
        else:
            self.runner = ModelRunner(self.model, self.arena, self.device)
        self.slot = self.arena.allocate()
        self.copies: list[int] = []  # slots of `fill_batch`'s copies
        self._greedy = [SamplingParams(temperature=0.0)]

    @torch.inference_mode()
    def extend(self, ids: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        """Append ``ids`` [n] to the slot: map pages, run the model, greedy-pick the next token.

        With ``chunk`` > 0, in passes of that many tokens: each maps its pages and launches
        without waiting for the one before (only the last samples, which waits), so mapping
        overlaps the device's work as in the engine's chunked prefill. On the GPU (unless
        ``eager``) a decode step and a prefill of ``new_tokens`` on the cached prefix replay
        CUDA graphs; other token counts run eagerly.
        """
        starts = _chunk_starts(ids.shape[0], chunk)
        for lo, hi in itertools.pairwise(starts):
            self.runner.forward(self.inputs(ids[lo:hi]))  # no sampling: nothing waits
        inputs = self.inputs(ids[starts[-1]:])
        hidden = self.runner.forward(inputs)  # [n_last, hidden]
        return self.runner.sample(hidden, inputs)  # [1]

    def inputs(self, ids: torch.Tensor) -> ModelInputs:
        """Map pages for ``ids`` [n] after the slot's tokens; the model inputs that append them
        and sample after the last."""
        n = ids.shape[0]
        start = self.arena.num_tokens(self.slot)
        self.arena.grow(self.slot, start + n)
        meta = AttentionMetadata.build([self.slot], [n], [start + n], self.device)
        assert meta.token_index is not None and meta.last_token_index is not None
        return ModelInputs(
            input_ids=ids, positions=meta.token_index, meta=meta,
            sample_rows=meta.last_token_index, sample_seqs=[0], params=self._greedy,
            rngs=[RequestRng()])

    def fill_batch(self, batch: int, n: int) -> None:
        """Copy the slot's first ``n`` tokens' KV into ``batch - 1`` other slots (their own
        pages, not shared ones: B sessions' KV, each read from its own memory)."""
        while len(self.copies) < batch - 1:
            self.copies.append(self.arena.allocate())
        src = self.arena.token_bytes_view(self.slot, 0, n)  # [n * token_bytes] uint8
        for slot in self.copies[:batch - 1]:
            self.arena.truncate(slot, 0)
            self.arena.grow(slot, n)
            self.arena.token_bytes_view(slot, 0, n).copy_(src)

    @torch.inference_mode()
    def decode_batch(self, token: torch.Tensor, batch: int) -> torch.Tensor:
        """One decode step of the slot and its first ``batch - 1`` copies, each appending
        ``token`` [1]; greedy picks [batch]."""
        slots = [self.slot, *self.copies[:batch - 1]]
        ctxs = [self.arena.num_tokens(s) + 1 for s in slots]
        for slot, n in zip(slots, ctxs, strict=True):
            self.arena.grow(slot, n)
        meta = AttentionMetadata.build(slots, [1] * batch, ctxs, self.device)
        assert meta.token_index is not None and meta.last_token_index is not None
        inputs = ModelInputs(
            input_ids=token.expand(batch).contiguous(), positions=meta.token_index, meta=meta,
            sample_rows=meta.last_token_index, sample_seqs=list(range(batch)),
            params=self._greedy * batch, rngs=[RequestRng() for _ in range(batch)])
        return self.runner.sample(self.runner.forward(inputs), inputs)

    def truncate_batch(self, batch: int, n: int) -> None:
        """Cut the slot and its first ``batch - 1`` copies back to ``n`` tokens."""
        for slot in [self.slot, *self.copies[:batch - 1]]:
            self.arena.truncate(slot, n)

    def truncate(self, n: int) -> None:
        self.arena.truncate(self.slot, n)

    def close(self) -> None:
        if isinstance(self.runner, CudaGraphRunner):
            self.runner.close()
        self.arena.close()
        self.pool.close()
        self.backend.close()


class HFSide:
    """HF transformers with the same shapes: SDPA attention, DynamicCache."""

    def __init__(self, cfg: ModelOpsConfig, mcfg: ModelConfig) -> None:
        from transformers import AutoConfig, AutoModelForCausalLM

        self.device = torch.device(cfg.device)
        hf_dict = mcfg.to_hf_dict()
        hf_config = AutoConfig.for_model(hf_dict.pop("model_type"), **hf_dict)
        dtype = getattr(torch, cfg.dtype)
        with torch.device(self.device):
            self.model = AutoModelForCausalLM.from_config(
                hf_config, attn_implementation="sdpa", dtype=dtype).eval()
        self.cache: Any = None

    @torch.inference_mode()
    def extend(self, ids: torch.Tensor, chunk: int = 0) -> torch.Tensor:
        """Append ``ids`` [n] to the cache (in passes of ``chunk`` tokens when > 0) and
        greedy-pick the next token."""
        starts = _chunk_starts(ids.shape[0], chunk)
        for lo, hi in itertools.pairwise([*starts, ids.shape[0]]):
            out = self.model(ids[None, lo:hi], past_key_values=self.cache, use_cache=True,
                             logits_to_keep=1)
            self.cache = out.past_key_values
        return out.logits[0, -1].argmax(dim=-1)

    def truncate(self, n: int) -> None:
        if n == 0:
            self.cache = None
        elif n < self.cache.get_seq_length():
            self.cache.crop(n - self.cache.get_seq_length())  # negative: tokens to drop

    def close(self) -> None:
        del self.model, self.cache


def _chunk_starts(n: int, chunk: int) -> list[int]:
    """First token of each pass over ``n`` tokens in passes of ``chunk`` (0: one pass)."""
    return list(range(0, n, chunk)) if chunk > 0 else [0]


def _measure(side: EdmmSide | HFSide, ids: torch.Tensor, ctx: int, cfg: ModelOpsConfig,
             engine: str, progress: Progress) -> list[dict[str, Any]]:
    """Per-iteration rows of the three operations at one context length."""
    dev = side.device
    rows: list[dict[str, Any]] = []
    plans: list[tuple[str, int, int, int, int]] = [  # op, keep, extend to, repeats, chunk
        ("full prefill", 0, ctx, cfg.full_prefill_repeats, cfg.full_prefill_chunk),
        ("prefill on cached prefix", ctx - cfg.new_tokens, ctx, cfg.repeats, 0),
        ("decode step", ctx - 1, ctx, cfg.repeats, 0),
    ]
    side.truncate(0)
    side.extend(ids[:ctx])  # warm-up, and the cache every later plan starts from
    for op, keep, end, repeats, chunk in plans:
        times: list[float] = []
        for i in range(repeats + 1):  # the first repeat is a warm-up
            side.truncate(keep)
            out: list[float] = times if i else []
            with _timed(out, dev):
                side.extend(ids[keep:end], chunk)
            progress.step(f"{engine} {op} at {ctx}")
        rows += [{"engine": engine, "op": op, "context_tokens": ctx,
                  "new_tokens": end - keep, "iteration": i, "ms": t}
                 for i, t in enumerate(times)]
        if op == "full prefill":
            side.truncate(ctx)
    if isinstance(side, EdmmSide):
        for batch in (b for b in cfg.decode_batches if b > 1):
            rows += _measure_batch(side, ids, ctx, batch, cfg.repeats, engine, progress)
    return rows


def _measure_batch(side: EdmmSide, ids: torch.Tensor, ctx: int, batch: int, repeats: int,
                   engine: str, progress: Progress) -> list[dict[str, Any]]:
    """Rows of decode steps of ``batch`` sequences completing ``ctx``-token contexts."""
    op = f"decode step x{batch}"
    side.truncate(ctx - 1)
    side.fill_batch(batch, ctx - 1)
    times: list[float] = []
    for i in range(repeats + 1):  # the first repeat is a warm-up
        side.truncate_batch(batch, ctx - 1)
        with _timed(times if i else [], side.device):
            side.decode_batch(ids[ctx - 1:ctx], batch)
        progress.step(f"{engine} {op} at {ctx}")
    side.truncate_batch(batch, 0)
    side.extend(ids[:ctx])  # the single sequence's cache, as the next context expects
    return [{"engine": engine, "op": op, "context_tokens": ctx, "new_tokens": batch,
             "iteration": i, "ms": t} for i, t in enumerate(times)]


def _summary(rows: list[dict[str, Any]], flops_of: Callable[[str, int], float],
             gpus: int = 1) -> list[dict[str, Any]]:
    keys = list(dict.fromkeys((r["engine"], r["op"], r["context_tokens"]) for r in rows))
    out = []
    for engine, op, ctx in keys:
        s = summarize([r["ms"] for r in rows
                       if (r["engine"], r["op"], r["context_tokens"]) == (engine, op, ctx)])
        floor = flops_of(op, ctx) / (gpus * MEASURED_BF16_TFLOPS * 1e12) * 1e3
        out.append({"engine": engine, "op": op, "context_tokens": ctx,
                    "trimmed_mean_ms": s.trimmed_mean, "median_ms": s.median,
                    "p10_ms": s.p10, "p90_ms": s.p90, "n": s.n,
                    "compute_floor_ms": floor})
    return out


def _flops(mcfg: ModelConfig, new_tokens: int) -> Callable[[str, int], float]:
    """Matmul FLOPs of an op: 2 x params x new tokens + attention (QK^T and PV, causal)."""
    h, inter, layers = mcfg.hidden_size, mcfg.intermediate_size, mcfg.num_layers
    q, kv = mcfg.num_heads * mcfg.head_dim, mcfg.num_kv_heads * mcfg.head_dim
    params = layers * (h * (q + 2 * kv) + q * h + 3 * h * inter) + h * mcfg.vocab_size

    def flops(op: str, ctx: int) -> float:
        batch = int(op.rsplit("x", 1)[1]) if op.startswith("decode step x") else 1
        if batch > 1:  # B sequences of one new token each over ctx keys
            dense = 2 * params * batch
            return float(dense + 4 * batch * ctx * mcfg.num_heads * mcfg.head_dim * layers)
        n = {"decode step": 1, "prefill on cached prefix": new_tokens,
             "full prefill": ctx}[op]
        lm_head_rows = 1  # logits only for the last token
        dense = 2 * (params - h * mcfg.vocab_size) * n + 2 * h * mcfg.vocab_size * lm_head_rows
        keys = n * ctx - n * (n - 1) / 2  # causal pairs, end-aligned
        attn = 4 * keys * mcfg.num_heads * mcfg.head_dim * layers
        return float(dense + attn)

    return flops


def run_model_ops_bench(cfg: ModelOpsConfig, out_dir: Path) -> dict[str, Path]:
    """Run both engines over every context; write CSV (per iteration), JSON, Markdown, PNG."""
    torch.manual_seed(0)
    out_dir.mkdir(parents=True, exist_ok=True)
    max_ctx = max(cfg.contexts)
    if cfg.tensor_parallel_size is not None:
        if cfg.kv_cache_dtypes != ("auto",) or max(cfg.decode_batches) > 1:
            raise ValueError("kv_cache_dtypes and decode_batches time the model driven "
                             "directly, not through the engine (tensor_parallel_size)")
        rows, mcfg = _measure_through_engine(cfg, max_ctx)
    else:
        rows, mcfg = _measure_direct(cfg, max_ctx)
    summary = _summary(rows, _flops(mcfg, cfg.new_tokens), cfg.tensor_parallel_size or 1)
    env = collect_environment(cfg.device)
    cuda = cfg.device.startswith("cuda")
    writer = ResultWriter(out_dir, "ttft-model", env)
    writer.add_rows(rows)
    notes = [f"model: {cfg.model} ({mcfg.architecture}, {mcfg.num_layers} layers), "
             f"{cfg.dtype}, random weights",
             f"repeats: {cfg.repeats} (full prefill: {cfg.full_prefill_repeats}), after one "
             "warm-up; trimmed mean drops 10% each side",
             f"compute floor: matmul FLOPs / ({cfg.tensor_parallel_size or 1} GPU(s) x "
             f"{MEASURED_BF16_TFLOPS} TFLOP/s, the H200's measured bf16 rate"
             + ("" if cuda else "; a GPU figure, not this CPU's") + ")",
             *(_engine_notes(cfg) if cfg.tensor_parallel_size is not None
               else _direct_notes(cfg)),
             *_plot(summary, out_dir, device_label(cfg.device), cfg.model)]
    paths = writer.write(summary, title=f"edmm bench ttft (model level, {cfg.device})",
                         notes=notes)
    return paths


def _measure_direct(cfg: ModelOpsConfig, max_ctx: int
                    ) -> tuple[list[dict[str, Any]], ModelConfig]:
    """The three ops on the model driven directly, once per EDMM attention backend, then
    (``peer``) on transformers."""
    sides = edmm_sides(cfg)
    rows: list[dict[str, Any]] = []
    per_ctx = cfg.full_prefill_repeats + 2 * cfg.repeats + 3  # + a warm-up of each op
    batched = sum(b > 1 for b in cfg.decode_batches) * (cfg.repeats + 1)
    runs = len(sides) * len(cfg.kv_cache_dtypes)
    progress = Progress("model ops", (runs * (per_ctx + batched) + cfg.peer * per_ctx)
                        * len(cfg.contexts))
    ids: torch.Tensor | None = None
    for side_label, attention in sides.items():
        for i, kv_dtype in enumerate(cfg.kv_cache_dtypes):
            engine = side_label if i == 0 else f"{side_label}-kv-{kv_dtype}"
            edmm = EdmmSide(cfg, max_ctx, attention, kv_dtype)
            mcfg = edmm.cfg
            if ids is None:  # the same tokens for every side
                ids = torch.randint(0, mcfg.vocab_size, (max_ctx + 1,), device=edmm.device)
            for ctx in cfg.contexts:
                rows += _measure(edmm, ids, ctx, cfg, engine, progress)
            edmm.close()
            del edmm
    assert ids is not None
    if cfg.peer:
        hf = HFSide(cfg, mcfg)
        for ctx in cfg.contexts:
            rows += _measure(hf, ids, ctx, cfg, "transformers", progress)
        hf.close()
    return rows, mcfg


def _measure_through_engine(cfg: ModelOpsConfig, max_ctx: int
                            ) -> tuple[list[dict[str, Any]], ModelConfig]:
    """The three ops as engine requests over ``tensor_parallel_size`` GPUs (no peer)."""
    from edmm.bench.model_ops_engine import EngineSide, measure_engine

    tp = cfg.tensor_parallel_size or 1
    side = EngineSide(cfg.model, cfg.device, cfg.dtype, max_ctx, cfg.new_tokens, tp,
                      cfg.repeats)
    progress = Progress("engine ops", len(cfg.contexts) * 3)
    try:
        rows: list[dict[str, Any]] = []
        for ctx in cfg.contexts:
            rows += measure_engine(side, ctx, cfg.repeats, cfg.full_prefill_repeats,
                                   f"edmm-engine-tp{tp}", progress)
        return rows, side.engine.model_config
    finally:
        side.close()


def _direct_notes(cfg: ModelOpsConfig) -> list[str]:
    gpu = [] if not cfg.device.startswith("cuda") else [
        "attention (CUDA, not eager): " + ", ".join(
            f"{engine}: {attention}" for engine, attention in edmm_sides(cfg).items()),
        "decode kernel launch: " + _routes_note(decode_routes_of(cfg)),
        "projections of <= 16 rows: " + _matmul_note(matmul_routes_of(cfg)),
        f"Triton prefill kernel (attention triton): {cfg.prefill_kernel} "
        f"({PREFILL_KERNELS[cfg.prefill_kernel]})"]
    graphs = ("; EDMM's replay a CUDA graph of that size, as the engine's mixed graphs do"
              if gpu and not cfg.eager and cfg.full_prefill_chunk > 1 else "")
    return [*gpu, "full prefill: " + (f"chunks of {cfg.full_prefill_chunk} tokens (both "
                                      f"engines{graphs}), each launched without waiting for "
                                      "the last" if cfg.full_prefill_chunk else "one pass"),
            *_kv_notes(cfg)]


def _kv_notes(cfg: ModelOpsConfig) -> list[str]:
    notes = [f"KV cache: {', '.join(cfg.kv_cache_dtypes)} (the first under each side's own "
             "engine label, the others as -kv-<dtype>; fp8: e4m3 with per-layer, per-KV-head "
             "scales)"]
    batches = [b for b in cfg.decode_batches if b > 1]
    if batches:
        notes.append(f"decode step xB: B sequences of the context (each its own pages), one "
                     f"token each, B in {batches}; EDMM only")
    return notes


def _engine_notes(cfg: ModelOpsConfig) -> list[str]:
    return [f"through the engine (requests, scheduling and page mapping included), tensor "
            f"parallel over {cfg.tensor_parallel_size} GPU(s); decode step: one engine step "
            "of one request at contexts n .. n + repeats; no transformers peer"]


def decode_routes_of(cfg: ModelOpsConfig) -> DecodeRoutes | None:
    """The decode routing table of the run: ``cfg.decode_routes``'s file, else the committed
    one (None: the kernel's heuristic)."""
    if cfg.decode_routes is not None:
        return DecodeRoutes.from_json(cfg.decode_routes)
    return default_decode_routes()


def matmul_routes_of(cfg: ModelOpsConfig) -> MatmulRoutes | None:
    """The projections' routing table of the run: ``cfg.matmul_routes``'s file, else the
    committed one; None (every projection on cuBLAS) for "off" or without a table."""
    if cfg.matmul_routes == "off":
        return None
    routes = (MatmulRoutes.from_json(cfg.matmul_routes) if cfg.matmul_routes is not None
              else default_matmul_routes())
    return with_pdl(routes) if routes is not None and cfg.matmul_pdl else routes


def edmm_sides(cfg: ModelOpsConfig) -> dict[str, str]:
    """Engine label -> resolved attention backend of each EDMM side (``eager``: one side,
    "edmm-eager", on the reference SDPA). Raises `AttentionChoiceError` for a backend that
    cannot run on ``cfg.device``."""
    if cfg.eager or torch.device(cfg.device).type != "cuda":
        return {"edmm-eager" if cfg.eager else "edmm": "sdpa"}
    caps = AttentionCapabilities.probe(cfg.device)
    names = list(dict.fromkeys(resolve_attention(a, caps) for a in cfg.attentions))
    return {("edmm" if i == 0 else f"edmm-{name}"): name for i, name in enumerate(names)}


def _routes_note(routes: DecodeRoutes | None) -> str:
    if routes is None:
        return "the split-K kernel's heuristic (no measured routing table)"
    return f"measured routing table ({routes.source}, {len(routes.routes)} shapes)"


def _matmul_note(routes: MatmulRoutes | None) -> str:
    if routes is None:
        return "cuBLAS (no skinny-matmul routing table)"
    skinny = sum(r.config is not None for r in routes.routes)
    return (f"skinny kernel where measured faster ({routes.source}: {skinny} of "
            f"{len(routes.routes)} shapes), else cuBLAS")


def _plot(summary: list[dict[str, Any]], out_dir: Path, device: str, model: str) -> list[str]:
    notes = []
    batched = [op for op in dict.fromkeys(r["op"] for r in summary) if op not in OPS]
    for op in (*OPS, *batched):
        rows = [dict(r, context=tokens_label(r["context_tokens"])) for r in summary
                if r["op"] == op]
        if not rows:
            continue
        name = f"ttft-{op.split()[0]}{'-' + op.split()[-1] if op in batched else ''}.png"
        peer = " beside transformers" if any(r["engine"] == "transformers" for r in rows) else ""
        try:
            plot_bars(rows, "context", "trimmed_mean_ms", "engine", out_dir / name,
                      f"{op}: EDMM{peer} ({device}, model {model})",
                      x_label="context length (tokens)", y_label="time (ms, trimmed mean)",
                      legend_title="engine")
            notes.append(f"plot: {name}")
        except RuntimeError as e:
            notes.append(f"plot skipped: {e}")
    return notes
