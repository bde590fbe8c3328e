"""Host twin of the CUDA VMM backend, on Linux pages.

A memfd is the physical store: a "page" is a page-sized extent of the memfd. A virtual range is
reserved with an anonymous ``PROT_NONE`` mapping; `map` places one extent of the memfd at an
address inside it with ``mmap(MAP_FIXED | MAP_SHARED)`` and, like ``cuMemMap``, grants no access
until `set_access` (``mprotect``). This is a real remap: the bytes read at an address follow
whichever page is mapped there, and a page mapped at two addresses shows the same bytes in both.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import mmap
import os
import platform

import torch

from edmm.memory.errors import BackendUnavailableError, VMMError

_PROT_NONE = 0
_PROT_RW = mmap.PROT_READ | mmap.PROT_WRITE
_MAP_SHARED = 0x01
_MAP_PRIVATE = 0x02
_MAP_FIXED = 0x10
_MAP_ANONYMOUS = 0x20
_MAP_NORESERVE = 0x4000
_FALLOC_FL_KEEP_SIZE = 0x01
_FALLOC_FL_PUNCH_HOLE = 0x02
_MAP_FAILED = ctypes.c_void_p(-1).value

DEFAULT_HOST_PAGE_SIZE = 64 * 1024


def load_libc() -> ctypes.CDLL:
    """The C library with the argument and result types of the calls the host twin makes
    (``mmap``, ``munmap``, ``mprotect``, ``fallocate``); errors set ``errno``."""
    libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [
        ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long,
    ]
    libc.munmap.restype = ctypes.c_int
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mprotect.restype = ctypes.c_int
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    libc.fallocate.restype = ctypes.c_int
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    return libc


def _os_error(call: str) -> VMMError:
    err = ctypes.get_errno()
    return VMMError(call, errno.errorcode.get(err, str(err)), os.strerror(err))


class HostVMM:
    """VMM backend over Linux pages; see the module docstring."""

    name = "host"

    def __init__(self, page_size: int = DEFAULT_HOST_PAGE_SIZE) -> None:
        if platform.system() != "Linux" or not hasattr(os, "memfd_create"):
            raise BackendUnavailableError(
                "the host twin needs Linux (memfd_create, mmap MAP_FIXED)")
        os_page = mmap.PAGESIZE
        if page_size <= 0 or page_size % os_page:
            raise ValueError(f"page_size must be a positive multiple of {os_page}, got {page_size}")
        self.page_size = page_size
        self.device = torch.device("cpu")
        self._libc = load_libc()
        self._fd = os.memfd_create("edmm-pages", os.MFD_CLOEXEC)
        self._num_extents = 0
        self._free_extents: list[int] = []
        self._live: set[int] = set()

    def reserve(self, size: int) -> int:
        """Reserve ``size`` bytes as an inaccessible, unbacked anonymous range."""
        self._check_aligned("reserve", 0, size)
        flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE
        raw = self._libc.mmap(None, size + self.page_size, _PROT_NONE, flags, -1, 0)
        if raw in (None, _MAP_FAILED):
            raise _os_error("mmap(reserve)")
        # Align the base to the page size: trim the slack before and after.
        base = -(-int(raw) // self.page_size) * self.page_size
        head, tail = base - int(raw), int(raw) + size + self.page_size - (base + size)
        if head:
            self.free_range(int(raw), head)
        if tail:
            self.free_range(base + size, tail)
        return base

    def free_range(self, va: int, size: int) -> None:
        """Unmap a reserved range."""
        if self._libc.munmap(va, size) != 0:
            raise _os_error("munmap")

    def create_page(self) -> int:
        """Take a free extent of the memfd (growing it if none) as a new physical page."""
        if self._free_extents:
            handle = self._free_extents.pop()
        else:
            handle = self._num_extents
            try:
                os.ftruncate(self._fd, (handle + 1) * self.page_size)
            except OSError as e:
                raise VMMError("ftruncate", errno.errorcode.get(e.errno or 0, "?"), str(e)) from e
            self._num_extents += 1
        self._live.add(handle)
        return handle

    def release_page(self, handle: int) -> None:
        """Punch the extent out of the memfd (its memory goes back to the OS)."""
        if handle not in self._live:
            raise VMMError("release_page", "EINVAL", f"unknown page handle {handle}")
        mode = _FALLOC_FL_PUNCH_HOLE | _FALLOC_FL_KEEP_SIZE
        if self._libc.fallocate(self._fd, mode, handle * self.page_size, self.page_size) != 0:
            raise _os_error("fallocate(PUNCH_HOLE)")
        self._live.remove(handle)
        self._free_extents.append(handle)

    def map(self, va: int, handle: int) -> None:
        """Map page ``handle`` at ``va`` with no access (like cuMemMap)."""
        self._check_aligned("map", va, self.page_size)
        if handle not in self._live:
            raise VMMError("mmap(map)", "EINVAL", f"unknown page handle {handle}")
        flags = _MAP_SHARED | _MAP_FIXED
        got = self._libc.mmap(va, self.page_size, _PROT_NONE, flags, self._fd,
                              handle * self.page_size)
        if got in (None, _MAP_FAILED):
            raise _os_error("mmap(map)")

    def set_access(self, va: int, size: int) -> None:
        """Make ``[va, va + size)`` readable and writable (like cuMemSetAccess)."""
        self._check_aligned("set_access", va, size)
        if self._libc.mprotect(va, size, _PROT_RW) != 0:
            raise _os_error("mprotect")

    def unmap(self, va: int, size: int) -> None:
        """Put the reservation back over ``[va, va + size)`` in one call (like cuMemUnmap)."""
        self._check_aligned("unmap", va, size)
        flags = _MAP_PRIVATE | _MAP_ANONYMOUS | _MAP_NORESERVE | _MAP_FIXED
        got = self._libc.mmap(va, size, _PROT_NONE, flags, -1, 0)
        if got in (None, _MAP_FAILED):
            raise _os_error("mmap(unmap)")

    def fence(self) -> None:
        """CPU work is synchronous: nothing to wait for."""

    def byte_view(self, va: int, size: int) -> torch.Tensor:
        """Zero-copy uint8 tensor over host memory at ``va``."""
        buf = (ctypes.c_uint8 * size).from_address(va)
        return torch.frombuffer(buf, dtype=torch.uint8)

    def describe(self) -> dict[str, str]:
        """Backend facts for reports."""
        return {"backend": self.name, "device": platform.processor() or platform.machine(),
                "page_size": str(self.page_size), "driver": f"linux {platform.release()}"}

    def close(self) -> None:
        """Close the memfd (mapped extents stay valid until unmapped)."""
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def _check_aligned(self, call: str, va: int, size: int) -> None:
        if va % self.page_size or size % self.page_size or size <= 0:
            raise VMMError(call, "EINVAL", f"va={va:#x} size={size} not multiples of "
                           f"page size {self.page_size}")
