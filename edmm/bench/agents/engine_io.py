"""The only place the agent bench reaches past `AgentEngine`'s public methods.

- `read_counters`, `pages_in_use`, `pages_total`: the engine's `stats()` snapshot, as the
  bench's counters; `pages_by_state` splits the pool by what holds each page.
- `KVBallast`: shrinks the usable KV pool of a built engine (so one engine, built once, runs at
  several oversubscriptions) by holding pages out of use (`KVCacheManager.hold_pages`); the
  KV manager's invariants hold throughout.
"""

from __future__ import annotations

from dataclasses import dataclass

from edmm.agent import AgentEngine
from edmm.engine import Engine


@dataclass(frozen=True)
class EngineCounters:
    """KV pages and host-copy totals at one moment."""

    pages_total: int
    pages_used: int
    offloaded_bytes_held: int  # host bytes held by offloaded sessions now
    offloads: int  # copies to the host, over the engine's life
    offloaded_bytes: int
    offload_s: float
    restores: int  # copies back, over the engine's life
    restored_bytes: int
    restore_s: float
    memory_wait_steps: int  # steps whose admissions waited for memory, over the engine's life
    memory_wait_running_pages: int  # pages running requests held then, summed
    cached_pages: int = 0  # pages held by prefix-cache entries (paused sessions, prefixes)


def pages_in_use(engine: Engine) -> int:
    """Pages of the engine's pool mapped now."""
    return engine.stats().kv.pages_in_use


def pages_total(engine: Engine) -> int:
    """Pages of the engine's pool."""
    return engine.stats().kv.pages_total


def read_counters(agent: AgentEngine, reserved_pages: int = 0) -> EngineCounters:
    """The engine's counters now, less ``reserved_pages`` held by a `KVBallast` (host-copy
    totals are 0 without offload)."""
    stats = agent.engine.stats()
    kv = stats.kv
    return EngineCounters(kv.pages_total - reserved_pages, kv.pages_in_use - reserved_pages,
                          kv.offload_bytes, kv.offloads, kv.offloaded_bytes_total, kv.offload_s,
                          kv.restores, kv.restored_bytes_total, kv.restore_s,
                          stats.memory_wait_steps, stats.memory_wait_running_pages,
                          kv.cached_pages)


PAGE_STATES = ("running_pages", "paused_gpu_pages", "host_pages", "free_pages")


def pages_by_state(total: int, used: int, cached: int, host_bytes: float,
                   page_bytes: int) -> dict[str, float]:
    """KV pages by state: mapped by running (or waiting) requests, held by prefix-cache
    entries (paused sessions' KV and shared prefixes, on the GPU), their host copies (bytes
    held over the page size) and free."""
    return {"running_pages": max(used - cached, 0), "paused_gpu_pages": cached,
            "host_pages": round(host_bytes / page_bytes, 2), "free_pages": max(total - used, 0)}


class KVBallast:
    """Holds ``num_pages`` pages of ``engine``'s pool in otherwise unused arena slots."""

    def __init__(self, engine: Engine, num_pages: int) -> None:
        self._engine = engine
        self._held = engine.kv.hold_pages(num_pages)
        self.slots: list[int] = list(self._held.slots)
        self.num_pages = self._held.num_pages

    def release(self) -> None:
        """Give the pages and slots back."""
        if self.slots:
            self._engine.kv.release_held(self._held)
        self.slots.clear()


def ballast_slots(engine_pages: int, target_pages: int, pages_per_slot: int) -> int:
    """Arena slots a ballast of ``engine_pages - target_pages`` pages takes."""
    return -(-max(engine_pages - target_pages, 0) // pages_per_slot)


def speculated_tokens_now(agent: AgentEngine) -> int:
    """Tokens with KV of every queued or running speculation (to tell a step that advanced
    speculation from one that could not schedule any)."""
    engine = agent.engine
    total = 0
    for spec_id in engine.speculation_ids():
        progress = engine.speculation_progress(spec_id)
        total += progress[0] if progress is not None else 0
    return total
