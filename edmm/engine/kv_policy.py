"""`AdoptionCost`: how a claimed cache entry is adopted on a partial match.

When a request claims a tagged entry (an agent session's retained KV, a speculation branch)
that matches only part of its prompt, the entry is either *truncated* in place (its tail pages
are unmapped: one driver unmap per page) or *branched* from (a new slot maps the entry's full
prefix pages: one map + set-access per page; the entry stays). This policy picks the cheaper in
driver time; the prefix index (`PrefixCache`) asks it and holds no cost of its own.
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
