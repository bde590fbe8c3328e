"""The physical page pool: the one owner of page reference counts and the free list.

Pages are created ahead of need (at construction, or by an explicit `add_pages` off the critical
path), so that growing or branching a sequence never waits on ``cuMemCreate``. A page may be
mapped at several virtual addresses at once (a shared prefix); its reference count is the number
of such mappings, and it returns to the free list when that falls to zero.
"""

from __future__ import annotations

from collections import deque

from edmm.memory.errors import KVMemoryError, PoolExhaustedError, SlotStateError
from edmm.memory.vmm import VMMBackend


class PagePool:
    """A fixed set of physical pages with reference counts.

    Page ids are dense ints ``0..capacity-1``; the backend handle of page ``p`` is `handle(p)`.
    """

    def __init__(self, backend: VMMBackend, num_pages: int) -> None:
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.backend = backend
        self._handles: list[int] = []
        self._refcount: list[int] = []
        self._free: deque[int] = deque()
        self._shared = 0  # pages with refcount > 1
        self.add_pages(num_pages)

    @property
    def page_size(self) -> int:
        """Bytes per page."""
        return self.backend.page_size

    @property
    def capacity(self) -> int:
        """Pages owned by the pool."""
        return len(self._handles)

    @property
    def num_free(self) -> int:
        """Pages with no mapping."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages mapped at least once."""
        return self.capacity - self.num_free

    @property
    def num_shared(self) -> int:
        """Pages mapped more than once (a prefix several slots share)."""
        return self._shared

    def add_pages(self, n: int) -> None:
        """Create ``n`` more physical pages (driver calls: keep this off the critical path)."""
        for _ in range(n):
            handle = self.backend.create_page()
            self._handles.append(handle)
            self._refcount.append(0)
            self._free.append(len(self._handles) - 1)

    def handle(self, page: int) -> int:
        """The backend handle of a page id."""
        return self._handles[page]

    def refcount(self, page: int) -> int:
        """How many mappings hold ``page``."""
        return self._refcount[page]

    def alloc(self, n: int) -> list[int]:
        """Take ``n`` free pages (each with refcount 1), all or nothing."""
        if n > len(self._free):
            raise PoolExhaustedError(n, len(self._free))
        pages = [self._free.popleft() for _ in range(n)]
        for p in pages:
            self._refcount[p] = 1
        return pages

    def incref(self, page: int) -> None:
        """Record one more mapping of a page that is in use."""
        if self._refcount[page] <= 0:
            raise SlotStateError(f"incref of free page {page}")
        self._refcount[page] += 1
        self._shared += self._refcount[page] == 2

    def decref(self, page: int) -> bool:
        """Drop one mapping of ``page``; return True when it went back to the free list."""
        if self._refcount[page] <= 0:
            raise SlotStateError(f"decref of free page {page}")
        self._refcount[page] -= 1
        self._shared -= self._refcount[page] == 1
        if self._refcount[page] == 0:
            self._free.append(page)
            return True
        return False

    def check_integrity(self) -> None:
        """Assert the pool's invariants: free list == pages with refcount 0, no duplicates,
        the shared count == pages with refcount > 1."""
        free = list(self._free)
        if len(set(free)) != len(free):
            raise KVMemoryError("pool: duplicate page in free list")
        zero = {p for p, rc in enumerate(self._refcount) if rc == 0}
        if set(free) != zero:
            raise KVMemoryError(
                f"pool: free list {sorted(free)} != refcount-0 pages {sorted(zero)}")
        if any(rc < 0 for rc in self._refcount):
            raise KVMemoryError("pool: negative refcount")
        if self._shared != sum(rc > 1 for rc in self._refcount):
            raise KVMemoryError(f"pool: {self._shared} pages counted shared, "
                                f"{sum(rc > 1 for rc in self._refcount)} are")

    def close(self) -> None:
        """Destroy every page. All pages must be free (unmapped)."""
        if self.num_used:
            raise SlotStateError(f"closing a pool with {self.num_used} page(s) still mapped")
        for h in self._handles:
            self.backend.release_page(h)
        self._handles.clear()
        self._refcount.clear()
        self._free.clear()
