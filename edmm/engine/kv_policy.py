"""The named policies the prefix index (`PrefixCache`) consults: `AdoptionCost` and
`CachePolicy`.

`AdoptionCost`: how a claimed cache entry is adopted on a partial match. When a request claims
a tagged entry (an agent session's retained KV, a speculation branch) that matches only part of
its prompt, the entry is either *truncated* in place (its tail pages are unmapped: one driver
unmap per page) or *branched* from (a new slot maps the entry's full prefix pages: one map +
set-access per page; the entry stays). This policy picks the cheaper in driver time; the prefix
index asks it and holds no cost of its own.

`CachePolicy`: how entries are evicted (whole, or tail-first page by page) and what goes to the
host tier and comes back (paused sessions by their tag, or every block by its content);
`CACHE_POLICIES` names the ones the engine offers (`EngineConfig.kv_cache_policy`).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class AdoptionCost:
    """Driver costs per page that decide between truncating and branching.

    The defaults are per 2 MiB page on an H200 (CUDA 13, driver 580), the planning numbers of
    the design brief: a remap (unmap + map + set access) 37-44 us, counted as 40 us for the
    unmap of a mapped page, and 28 us for map + set access (``edmm bench vmm`` on the same
    machine: 42.8 us remap, 26.3 us map + access).
    """

    unmap_page_us: float = 40.0
    map_page_us: float = 28.0

    def prefer_branch(self, tail_pages: int, prefix_pages: int) -> bool:
        """True when unmapping ``tail_pages`` (truncate) costs more than mapping
        ``prefix_pages`` (branch)."""
        return tail_pages * self.unmap_page_us > prefix_pages * self.map_page_us


@dataclass(frozen=True)
class CachePolicy:
    """How the prefix index evicts entries and uses the host tier (`HostKVStore`).

    - ``tail_first``: an eviction that is asked for ``k`` pages unmaps only the last ``k``
      private pages of the victim entry (`KVArena.truncate`), keeping its prefix indexed, as
      vLLM's automatic prefix caching frees a finished request's blocks from the tail; the
      entry goes whole only when its private pages do not exceed ``k``. Off: an evicted entry
      goes whole.
    - ``write_through``: every full block of a sequence is copied to the host as soon as its
      KV is computed (once: a block held is not copied again).
    - ``offload_all``: the KV an eviction removes goes to the host whatever the entry (a
      preempted turn's too, a session waiting for its user's next message), and an admission
      loads from the host the blocks of its prompt that the GPU lacks (LMCache, vLLM's
      offloading connector). Off: only paused sessions' KV (tagged ``RETAINED`` entries) goes
      to the host.
    - ``session_records``: a paused session's KV goes to the host whole, recorded by its tag,
      and comes back by it (`PrefixCache.restore`: a prefetch before the tool's expected
      return, the resume's claim); its entry is never trimmed tail-first. Off (with
      ``offload_all``): it is one more entry whose blocks come back when an admission asks.

    The host tier holds each block once (content-addressed) under every policy, and every
    restore maps the longest prefix the GPU still holds and loads only the rest.
    """

    tail_first: bool = False
    write_through: bool = False
    offload_all: bool = False
    session_records: bool = True


CACHE_POLICIES: dict[str, CachePolicy] = {
    # paused sessions' KV: evicted whole, to the host by session, back by session (EDMM)
    "sessions": CachePolicy(),
    # vLLM's automatic prefix caching: block-granular, tail-first eviction
    "apc": CachePolicy(tail_first=True),
    # LMCache / vLLM's offloading connector: APC's eviction, every block written through
    # to the host as computed, any admission loads what the GPU lacks
    "blocks": CachePolicy(tail_first=True, write_through=True, offload_all=True,
                          session_records=False),
    # EDMM's: paused sessions by their tag (prefetched, restored whole), everything else as
    # APC's eviction with its KV to the host and loaded back at admission (the same host tier)
    "tiered": CachePolicy(tail_first=True, offload_all=True),
}


def cache_policy(name: str) -> CachePolicy:
    """The named `CachePolicy` (``ValueError`` naming the known ones otherwise)."""
    try:
        return CACHE_POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown KV cache policy {name!r}; known: "
                         f"{sorted(CACHE_POLICIES)}") from None
