"""``edmm bench vmm``: what the VMM layer costs, per page and per operation, on one backend.

Measured, each as the median over repeats (p10/p90 beside it):
- per page: create, map + set access, unmap (one call per page, and one call over all the
  pages, as the arena frees a slot), remap (unmap + map + set access) through the
  backend, and the same remap through bare driver/OS calls (the overhead of EDMM's wrapper);
- per context (a 7.6B Qwen2.5-shaped model's KV: 28 layers, 4 KV heads, head dim 128, bf16):
  branch creation from a prefix, commit at resume, releasing the old slot after the commit,
  and a device copy of the same bytes (what a copy-based engine would pay instead);
- attention layout: SDPA reading token-major strided KV vs per-layer contiguous KV (GPU only).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial
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
from edmm.memory.arena import KVArena, KVSpec
from edmm.memory.backends import open_backend
from edmm.memory.pool import PagePool
from edmm.memory.vmm import VMMBackend

QWEN25_7B_KV = KVSpec(num_layers=28, num_kv_heads=4, head_dim=128, dtype=torch.bfloat16)


@dataclass(frozen=True)
class VMMBenchConfig:
    """What to measure: backend, contexts (tokens), repeats, pages per per-page batch."""

    backend: str = "auto"
    contexts: tuple[int, ...] = (4096, 16384, 32768)
    repeats: int = 20
    pages: int = 64
    host_page_size: int = 2 * 1024 * 1024
    spec: KVSpec = QWEN25_7B_KV


class _Timer:
    """Wall-clock timing of host-side calls, synchronising the device where work is queued."""

    def __init__(self, backend: VMMBackend) -> None:
        self.backend = backend

    @contextmanager
    def time(self, out: list[float], per: int = 1, sync: bool = False) -> Iterator[None]:
        if sync:
            self.backend.fence()
        t0 = time.perf_counter_ns()
        yield
        if sync:
            self.backend.fence()
        out.append((time.perf_counter_ns() - t0) / 1e3 / per)


def _row(op: str, samples: list[float], context_tokens: int | None = None,
         **extra: Any) -> dict[str, Any]:
    s = summarize(samples)
    return {"op": op, "context_tokens": context_tokens, **extra, "median_us": s.median,
            "p10_us": s.p10, "p90_us": s.p90, "trimmed_mean_us": s.trimmed_mean, "n": s.n}


def bench_per_page(backend: VMMBackend, cfg: VMMBenchConfig) -> list[dict[str, Any]]:
    """Per-page create / map+access / unmap / remap through the backend."""
    p, n = backend.page_size, cfg.pages
    timer = _Timer(backend)
    create: list[float] = []
    map_access: list[float] = []
    unmap: list[float] = []
    unmap_range: list[float] = []
    remap: list[float] = []
    va = backend.reserve(n * p)
    for _ in range(cfg.repeats):
        with timer.time(create, per=n):
            handles = [backend.create_page() for _ in range(n)]
        _map_all(backend, va, handles, map_access, timer)
        with timer.time(remap, per=n):  # every address gets the next page: a real swap
            for i in range(n):
                backend.unmap(va + i * p, p)
                backend.map(va + i * p, handles[(i + 1) % n])
                backend.set_access(va + i * p, p)
        with timer.time(unmap, per=n):
            for i in range(n):
                backend.unmap(va + i * p, p)
        _map_all(backend, va, handles, [], timer)
        with timer.time(unmap_range, per=n):  # the arena's way: a slot's pages in one call
            backend.unmap(va, n * p)
        for h in handles:
            backend.release_page(h)
    backend.free_range(va, n * p)
    extra = {"pages": n, "bytes": p}
    return [_row("create page", create, **extra), _row("map + set access", map_access, **extra),
            _row("unmap", unmap, **extra),
            _row(f"unmap, {n} pages in one call", unmap_range, **extra),
            _row("remap (unmap+map+access)", remap, **extra)]


def _map_all(backend: VMMBackend, va: int, handles: list[int], out: list[float],
             timer: _Timer) -> None:
    """Map ``handles`` at consecutive pages from ``va``, one map + access per page, timed."""
    p = backend.page_size
    with timer.time(out, per=len(handles)):
        for i, h in enumerate(handles):
            backend.map(va + i * p, h)
            backend.set_access(va + i * p, p)


def bench_bare_remap(backend: VMMBackend, cfg: VMMBenchConfig) -> list[dict[str, Any]]:
    """The same remap loop through bare driver (CUDA) or OS (host) calls, no EDMM code."""
    bare = _bare_remap_cuda if backend.name == "cuda" else _bare_remap_host
    samples = [bare(backend.page_size, cfg.pages) for _ in range(cfg.repeats)]
    return [_row("remap, bare driver calls", samples, pages=cfg.pages, bytes=backend.page_size)]


def _bare_remap_cuda(page: int, n: int) -> float:
    from cuda.bindings import driver as cu

    dev = torch.cuda.current_device()
    prop = cu.CUmemAllocationProp()
    prop.type = cu.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = dev
    acc = cu.CUmemAccessDesc()
    acc.location.type = cu.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    acc.location.id = dev
    acc.flags = cu.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    _, base = cu.cuMemAddressReserve(n * page, page, 0, 0)
    handles = [cu.cuMemCreate(page, prop, 0)[1] for _ in range(n)]
    ptrs = [cu.CUdeviceptr(int(base) + i * page) for i in range(n)]
    for ptr, h in zip(ptrs, handles, strict=True):
        cu.cuMemMap(ptr, page, 0, h, 0)
        cu.cuMemSetAccess(ptr, page, [acc], 1)
    t0 = time.perf_counter_ns()
    for i, ptr in enumerate(ptrs):
        cu.cuMemUnmap(ptr, page)
        cu.cuMemMap(ptr, page, 0, handles[(i + 1) % n], 0)
        cu.cuMemSetAccess(ptr, page, [acc], 1)
    elapsed = (time.perf_counter_ns() - t0) / 1e3 / n
    for ptr in ptrs:
        cu.cuMemUnmap(ptr, page)
    for h in handles:
        cu.cuMemRelease(h)
    cu.cuMemAddressFree(base, n * page)
    return elapsed


def _bare_remap_host(page: int, n: int) -> float:
    import mmap
    import os

    from edmm.memory.host import load_libc

    libc = load_libc()
    fd = os.memfd_create("edmm-bare", os.MFD_CLOEXEC)
    os.ftruncate(fd, n * page)
    base = libc.mmap(None, n * page, 0, 0x02 | 0x20 | 0x4000, -1, 0)
    rw, shared_fixed = mmap.PROT_READ | mmap.PROT_WRITE, 0x01 | 0x10
    for i in range(n):
        libc.mmap(base + i * page, page, rw, shared_fixed, fd, i * page)
    t0 = time.perf_counter_ns()
    for i in range(n):
        va = base + i * page
        libc.mmap(va, page, 0, 0x02 | 0x20 | 0x4000 | 0x10, -1, 0)  # unmap to reservation
        libc.mmap(va, page, 0, shared_fixed, fd, ((i + 1) % n) * page)
        libc.mprotect(va, page, rw)
    elapsed = (time.perf_counter_ns() - t0) / 1e3 / n
    libc.munmap(base, n * page)
    os.close(fd)
    return elapsed


def bench_contexts(backend: VMMBackend, cfg: VMMBenchConfig) -> list[dict[str, Any]]:
    """Branch, commit, release and a device copy of the same bytes, per context length."""
    spec, p = cfg.spec, backend.page_size
    max_ctx = max(cfg.contexts)
    # The session, one branch and one boundary page, plus headroom for the branch's new tokens.
    pages_needed = 2 * (-(-max_ctx * spec.token_bytes // p)) + 8
    pool = PagePool(backend, pages_needed)
    arena = KVArena(pool, spec, num_slots=3, max_tokens=max_ctx + 1024)
    timer = _Timer(backend)
    rows: list[dict[str, Any]] = []
    try:
        for ctx in cfg.contexts:
            rows += _bench_one_context(arena, timer, ctx, cfg.repeats)
    finally:
        arena.close()
        pool.close()
    return rows


def _bench_one_context(arena: KVArena, timer: _Timer, ctx: int,
                       repeats: int) -> list[dict[str, Any]]:
    nbytes = ctx * arena.spec.token_bytes
    branch_t: list[float] = []
    commit_t: list[float] = []
    release_t: list[float] = []
    copy_t: list[float] = []
    for _ in range(repeats):
        session = arena.allocate()
        arena.grow(session, ctx)
        with timer.time(branch_t, sync=True):
            br = arena.branch(session, ctx - 7)  # a cut inside a page: one boundary copy
        arena.grow(br, ctx + 200)  # the speculated tokens
        with timer.time(commit_t):
            session = arena.commit(session, br)
        with timer.time(release_t, sync=True):
            arena.reclaim()
        arena.free(session)
    src = torch.empty(nbytes, dtype=torch.uint8, device=arena.kv.device)
    dst = torch.empty_like(src)
    for _ in range(repeats):
        with timer.time(copy_t, sync=True):
            dst.copy_(src)
    del src, dst
    extra = {"context_tokens": ctx, "pages": arena.pages_for(ctx), "bytes": nbytes}
    return [_row("branch (map shared prefix + copy boundary page)", branch_t, **extra),
            _row("commit at resume (slot swap)", commit_t, **extra),
            _row("release old slot after commit (off critical path)", release_t, **extra),
            _row("device copy of the prefix bytes", copy_t, **extra)]


def bench_layout(cfg: VMMBenchConfig, device: torch.device) -> list[dict[str, Any]]:
    """SDPA over token-major strided KV vs per-layer contiguous KV (one layer, GPU events)."""
    if device.type != "cuda":
        return []
    spec, q_heads = cfg.spec, 28
    rows = []
    for ctx in cfg.contexts:
        # Token-major: [tokens, layers, 2, kv_heads, head_dim] -> layer 0 K/V as [1, H, T, D].
        tm = torch.randn(ctx, spec.num_layers, 2, spec.num_kv_heads, spec.head_dim,
                         dtype=spec.dtype, device=device)
        k_tm, v_tm = (tm[:, 0, i].permute(1, 0, 2).unsqueeze(0) for i in (0, 1))
        k_c, v_c = k_tm.contiguous(), v_tm.contiguous()
        for q_len in (1, 512):
            q = torch.randn(1, q_heads, q_len, spec.head_dim, dtype=spec.dtype, device=device)
            for name, k, v in (("token-major strided", k_tm, v_tm),
                               ("per-layer contiguous", k_c, v_c)):
                samples = _cuda_time(partial(_sdpa_end_aligned, q, k, v), cfg.repeats)
                rows.append(_row(f"SDPA q={q_len}, {name}", samples, context_tokens=ctx,
                                 pages=0, bytes=2 * k.numel() * k.element_size()))
        del tm, k_c, v_c
    return rows


def _sdpa_end_aligned(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    from torch.nn.attention.bias import causal_lower_right

    mask = causal_lower_right(q.shape[2], k.shape[2]) if q.shape[2] > 1 else None
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                            enable_gqa=True)


def _cuda_time(fn: Callable[[], object], repeats: int) -> list[float]:
    for _ in range(3):
        fn()
    out = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e3)
    return out


def run_vmm_bench(cfg: VMMBenchConfig, out_dir: Path) -> dict[str, Path]:
    """Run every VMM measurement on one backend and write CSV, JSON, Markdown and PNG."""
    backend = open_backend(cfg.backend, host_page_size=cfg.host_page_size)
    stages: list[tuple[str, Callable[[], list[dict[str, Any]]]]] = [
        ("per page", lambda: bench_per_page(backend, cfg)),
        ("bare driver calls", lambda: bench_bare_remap(backend, cfg)),
        ("contexts", lambda: bench_contexts(backend, cfg)),
        ("KV layout", lambda: bench_layout(cfg, backend.device))]
    progress = Progress("vmm", len(stages))
    rows: list[dict[str, Any]] = []
    try:
        facts = backend.describe()
        env = collect_environment(backend.device.type)
        for name, stage in stages:
            rows += stage()
            progress.step(name)
    finally:
        backend.close()
    for r in rows:
        r["backend"] = facts["backend"]
    writer = ResultWriter(out_dir, f"vmm-{facts['backend']}", env)
    writer.add_rows(rows)
    notes = [f"backend: {', '.join(f'{k}={v}' for k, v in facts.items())}",
             f"KV spec: {cfg.spec}, {cfg.spec.token_bytes} bytes per token",
             f"repeats: {cfg.repeats}; per-page rows average over {cfg.pages} pages per repeat",
             *_verdicts(rows),
             *(["the targets are GPU targets (CUDA VMM on an H200); the host twin's mmap "
                "calls only show the mechanism works"] if facts["backend"] != "cuda" else [])]
    paths = writer.write(rows, title=f"edmm bench vmm ({facts['backend']})", notes=notes)
    with contextlib.suppress(RuntimeError):  # no matplotlib: no plot
        paths["png"] = plot_vmm(rows, out_dir / f"vmm-{facts['backend']}.png")
    return paths


def plot_vmm(rows: list[dict[str, Any]], path: Path) -> Path:
    """Commit, branch and a device copy of the prefix by context (log scale): the commit at
    resume stays flat while the others grow with the context."""
    ops = ("commit at resume (slot swap)", "branch (map shared prefix + copy boundary page)",
           "device copy of the prefix bytes")
    picked = [{"context": tokens_label(r["context_tokens"]), "op": r["op"],
               "median_us": r["median_us"]}
              for r in rows if r["op"] in ops and r["context_tokens"] is not None]
    backend = rows[0].get("backend", "?") if rows else "?"
    device = device_label("cuda" if backend == "cuda" else "cpu")
    return plot_bars(picked, "context", "median_us", "op", path,
                     f"KV arena operations at resume vs context ({backend} backend, {device})",
                     log_y=True, x_label="context length (tokens)",
                     y_label="median time (µs, log scale)", legend_title="operation",
                     caption="Commit adopts a speculated branch by swapping slot indices (no "
                     "copy): it should stay flat. Branch maps the prefix's pages into a new slot. "
                     "The copy is what a copying engine would move instead.")


def _verdicts(rows: list[dict[str, Any]]) -> list[str]:
    """Plain statements of the targets: commit <= 50 us and flat; remap within 1.2x of bare."""
    by = {r["op"]: r for r in rows if r["context_tokens"] is None}
    out = []
    remap, bare = by.get("remap (unmap+map+access)"), by.get("remap, bare driver calls")
    if remap and bare and bare["median_us"] > 0:
        ratio = remap["median_us"] / bare["median_us"]
        out.append(f"remap per page vs bare calls: {ratio:.2f}x (target <= 1.2x): "
                   f"{'met' if ratio <= 1.2 else 'MISSED'}")
    commits = [r for r in rows if r["op"].startswith("commit")]
    if commits:
        worst = max(r["median_us"] for r in commits)
        out.append(f"commit at resume, worst median over contexts: {worst:.2f} us "
                   f"(target <= 50 us): {'met' if worst <= 50 else 'MISSED'}")
    return out
