"""The small interface every VMM backend implements.

A backend knows four things: reserve a virtual range, create a physical page, map a page at a
page-aligned address inside a reserved range (with access granted separately), and unmap. The
page pool and the KV arena are written against this interface only, so the host twin exercises
exactly the code paths the CUDA backend runs.
"""

from __future__ import annotations

from typing import Protocol

import torch


class VMMBackend(Protocol):
    """Virtual memory management primitives over one device.

    Addresses are plain ints. ``page_size`` is the mapping granularity in bytes; every address
    and size passed to `map`, `set_access` and `unmap` is a multiple of it.
    """

    name: str
    device: torch.device
    page_size: int

    def reserve(self, size: int) -> int:
        """Reserve ``size`` bytes of virtual address space (no physical memory); return its base."""
        ...

    def free_range(self, va: int, size: int) -> None:
        """Give back a range returned by `reserve`. Nothing may be mapped in it any more."""
        ...

    def create_page(self) -> int:
        """Create one physical page of ``page_size`` bytes; return an opaque handle."""
        ...

    def release_page(self, handle: int) -> None:
        """Destroy a physical page. It must not be mapped anywhere."""
        ...

    def map(self, va: int, handle: int) -> None:
        """Map the page ``handle`` at ``va`` (one page). Access is granted by `set_access`."""
        ...

    def set_access(self, va: int, size: int) -> None:
        """Grant read/write access to the mapped range ``[va, va + size)``."""
        ...

    def unmap(self, va: int, size: int) -> None:
        """Unmap every page mapped in ``[va, va + size)``; the range stays reserved.

        The range may span several pages mapped by separate `map` calls, but must cover each
        of them whole (``cuMemUnmap`` cannot unmap part of one mapping).
        """
        ...

    def fence(self) -> None:
        """Wait until device work that may touch mapped memory has finished (before unmaps)."""
        ...

    def byte_view(self, va: int, size: int) -> torch.Tensor:
        """A zero-copy uint8 tensor over ``[va, va + size)``; its ``data_ptr()`` is ``va``.

        The tensor does not keep the mapping alive: the caller must not use it after unmapping.
        """
        ...

    def describe(self) -> dict[str, str]:
        """Facts about the device and driver for reports (name, driver version, ...)."""
        ...

    def close(self) -> None:
        """Release backend-level resources (file descriptors, contexts)."""
        ...
